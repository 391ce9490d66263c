"""`make gpu-check`, planned on CPU for real GPUs, and run on a machine without one.

The plan is the contract the real run keeps: every part sized from the GPU's profile. A test
plans every part for every shipped profile and holds it to the bounds a real server sets.
"""

import json
import subprocess
import sys

import pytest
import torch

from offloadlab import bench, devices, experiment, gpucheck, machine
from offloadlab.cli import main
from offloadlab.offload import capacity
from tests.conftest import ROOT

GiB = 2**30
PARTS = [
    "GPU-marked tests",
    "chapters and labs (nbval, quick mode)",
    "link probe (reference data)",
    *(f"bench {name}" for name in ("link", "overlap", "adam", "offload", "prefetch", "nvme")),
]


@pytest.fixture(scope="module")
def plans():
    return {name: gpucheck.plan(devices.get(name)) for name in devices.names()}


def test_every_part_fits_every_profile(plans):
    """Pinned memory at most a quarter of the server's host memory, device memory at most 80 % of
    the card's, every part listed, and the whole run within the 8 minutes it has on one H200."""
    for name, planned in plans.items():
        profile = devices.get(name)
        assert [p["name"] for p in planned["parts"]] == PARTS
        for part in planned["parts"]:
            assert part["pinned_bytes"] <= profile.host_memory_bytes / 4, (name, part)
            assert part["device_bytes"] <= 0.8 * profile.memory_bytes, (name, part)
            assert part["seconds"] > 0 and part["basis"], (name, part)
        assert planned["fits"]
    assert plans["h200"]["seconds"] <= gpucheck.BUDGET_SECONDS


def test_done_when_figures(plans):
    h100, l4 = plans["h100-sxm"], plans["l4"]
    for planned, device_limit in ((h100, 64e9), (l4, 24e9)):
        # the most any part holds, and (for a reader who adds them up) all parts together
        assert (
            planned["pinned_bytes"] <= sum(p["pinned_bytes"] for p in planned["parts"]) <= 32 * GiB
        )
        assert planned["device_bytes"] <= device_limit
    assert sum(p["device_bytes"] for p in h100["parts"]) <= 64e9


def test_the_prefetch_bench_computes_twice_its_transfer_on_every_profile():
    """ceil(2 × 1.27 ms / 21 ms) = 1 product made compute 17× the transfer on an H100, and every
    variant read as ≈ 1.0: products are now a quarter of a layer's transfer long."""
    for name in devices.names():
        profile = devices.get(name)
        for tf32 in (False, True):
            with _tf32(tf32):
                rows, hidden, count = bench.prefetch_shape(profile)
                compute = count * 2 * rows * hidden * hidden / profile.matmul_flops(torch.float32)
                transfer = bench._PREFETCH_LAYER_BYTES[False] / profile.link_bytes_per_s
                assert 1.5 <= compute / transfer <= 3, (name, tf32, compute / transfer)


def test_the_overlap_cases_are_a_quarter_one_and_four_windows_on_every_profile():
    """The products of 8192³ with TF32 off took a third of a second on an H100: four times that is
    94 GB of transfer. The compute is now a window, and each case's transfer that many windows."""
    for name in devices.names():
        profile = devices.get(name)
        for tf32 in (False, True):
            with _tf32(tf32):
                for quick in (False, True):
                    window = bench._overlap_window(quick)
                    count = experiment.planned_count(profile, window=window)
                    rows, hidden = experiment.GPU_SHAPE
                    compute = (
                        count * 2 * rows * hidden * hidden / profile.matmul_flops(torch.float32)
                    )
                    for _, factor in bench.OVERLAP_CASES:
                        transfer = (
                            experiment.transfer_bytes(profile, factor, window)
                            / profile.link_bytes_per_s
                        )
                        assert abs(transfer / compute / factor - 1) <= 0.10, (
                            name,
                            tf32,
                            quick,
                            factor,
                        )
                plan = bench.overlap_plan(profile)
                assert (
                    plan.pinned_bytes <= 16 * GiB
                    and plan.device_bytes <= 0.8 * profile.memory_bytes
                )


class _tf32:
    """torch's TF32 setting for fp32 matrix products, set and restored."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.on

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.before


def test_lab_4s_cap_is_above_its_need_and_below_plain_adamw():
    """A cap of 7.6 × P (1.19 GiB) sat under the offloaded run's own need (≈ 1.5 GiB with the saved
    activations): an OutOfMemoryError under its own cap. The cap is now the need plus 20 %."""
    need = capacity.offloaded_need(capacity.LAB_CONFIG, capacity.LAB_BATCH)
    cap = capacity.lab_cap()
    assert need.weights == 2 * capacity.LAB_CONFIG.params and need.activations > need.weights
    assert cap >= 1.2 * (need.weights + need.activations + need.buffers)
    assert cap > 7.6 * capacity.LAB_CONFIG.params  # the old cap was below the need
    assert cap < need.plain_adamw_state  # plain AdamW's state alone does not fit: the lab's point
    for name in devices.names():
        assert cap <= 0.8 * devices.get(name).memory_bytes


def test_saved_activations_are_counted_like_a_real_backward():
    """The meta-device count against what a real CPU forward saves, on a small model."""
    from offloadlab.models import GPTConfig, TinyGPT

    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model = TinyGPT(config)
    tokens = torch.zeros(4, 32, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    real = sum(n for ptr, n in saved.items() if ptr not in weights)
    counted = capacity.saved_activation_bytes(config, 4, torch.float32)
    # (the meta device takes the unfused attention path: a little more)
    assert real <= counted <= 1.25 * real


def test_dry_run_json_has_the_shape_the_instructions_give(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["gpu-check", "--dry-run", "--profile", "h100-sxm", "--json", str(out)]) == 0
    planned = json.loads(out.read_text())
    assert {"pinned_bytes", "device_bytes", "seconds", "parts"} <= set(planned)
    assert all(
        {"name", "pinned_bytes", "device_bytes", "seconds"} <= set(p) for p in planned["parts"]
    )
    assert planned["pinned_bytes"] <= 32 * GiB and planned["device_bytes"] <= 64e9
    text = capsys.readouterr().out
    assert "bench nvme" in text and "fits" in text and f"wrote the plan to {out}" in text


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--dry-run", "--profile", "h100"], "--profile: expected one of h100-sxm"),
        (["--json", "plan.json"], "--json: only with --dry-run"),
        (["--profile", "l4"], "--profile: only with --dry-run"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["gpu-check", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU present is planned by the real run")
def test_dry_run_without_a_gpu_names_the_profiles(capsys):
    assert main(["gpu-check", "--dry-run"]) == 2
    assert "name one of h100-sxm" in capsys.readouterr().err


def test_a_gpu_torch_cannot_use_is_a_failure_not_a_pass(tmp_path, monkeypatch, capsys):
    """A CPU wheel of torch, or a CUDA build newer than the driver, on a GPU machine: gpu-check used
    to run the CPU parts and exit 0."""
    monkeypatch.setattr(gpucheck, "_has_gpu", lambda: False)
    monkeypatch.setattr(
        gpucheck.shutil,
        "which",
        lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None,
    )
    ran = []
    monkeypatch.setattr(gpucheck, "_pytest", lambda *a, **k: ran.append(a))
    assert gpucheck.run(tmp_path) == 1
    assert "has an NVIDIA GPU but torch" in capsys.readouterr().out and ran == []


def test_a_failed_part_is_marked_failed_and_never_written_as_reference_data(tmp_path, monkeypatch):
    """As on a GPU (its detection faked): a benchmark that raises, and a probe whose disk failed."""
    saved = []
    monkeypatch.setattr(gpucheck, "_has_gpu", lambda: True)
    monkeypatch.setattr(gpucheck, "profile_for", lambda name: devices.get("h200"))
    real = machine.provenance()
    monkeypatch.setattr(gpucheck.machine, "provenance", lambda: {**real, "gpu": "NVIDIA H200"})
    monkeypatch.setattr(
        gpucheck,
        "_pytest",
        lambda title, *a, **k: {
            "step": title,
            "ok": True,
            "seconds": 0.0,
            "summary": "",
            "log": "",
        },
    )
    monkeypatch.setattr(
        gpucheck.reference, "save", lambda name, *a, **k: saved.append(name) or tmp_path / name
    )

    class Measured:
        def to_dict(self):
            return {}

    monkeypatch.setattr(
        gpucheck.ladder,
        "measure",
        lambda **k: {
            "machine": Measured(),
            "records": [],
            "faults": ["disk probe: No space left on device"],
        },
    )
    monkeypatch.setattr(gpucheck.ladder, "of_machine", lambda measured: {})

    def fine(quick=False, **kwargs):
        return {"source": "measured", "ratios": {"a": 1.0}, "rows": []}

    def broken(quick=False):
        raise RuntimeError("CUDA error: an illegal memory access")

    for name in gpucheck.BENCHMARKS:
        monkeypatch.setattr(gpucheck.bench, name, broken if name == "prefetch" else fine)
    assert gpucheck.run(tmp_path / "out") == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    failed = {s["step"] for s in summary["steps"] if not s["ok"]}
    assert failed == {"link probe (reference data)", "bench prefetch"}
    assert not any("prefetch" in name for name in saved) and not any(
        name.startswith("gpu-") for name in saved
    )
    assert sorted(saved) == sorted(
        f"bench-{n}-nvidia-h200" for n in gpucheck.BENCHMARKS if n != "prefetch"
    )
    assert (tmp_path / "out" / "plan.json").is_file()


def test_make_gpu_check_installs_nothing():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\ngpu-check:")[1].split("\n\n")[0]
    recipe_line = makefile.split("\ngpu-check:")[1].splitlines()[0]
    assert recipe_line.strip() == "" and "pip" not in target and "env" not in recipe_line


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU, gpu-check is the real thing: run make gpu-check"
)
def test_gpu_check_runs_the_cpu_parts_and_exits_0(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab.gpucheck", "--out", str(tmp_path), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("no CUDA GPU on this machine")
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {s["step"].split(" (")[0]: s for s in summary["steps"]}
    assert steps["GPU-marked tests"]["ok"] and "skipped" in steps["GPU-marked tests"]["summary"]
    for name in gpucheck.BENCHMARKS:
        assert steps[f"bench {name}"]["ok"]
        payload = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert payload["provenance"]["torch"] == torch.__version__ and payload["ratios"]
    assert summary["provenance"]["accelerator"] == "none"
    assert "gpu-check on no GPU" in result.stdout
