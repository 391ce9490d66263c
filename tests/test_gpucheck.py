"""`make gpu-check`, planned on CPU for real GPUs, and run on a machine without one.

The plan is the contract the real run keeps: every part sized from the GPU's profile. A test
plans every part for every shipped profile and holds it to the bounds a real server sets.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import jupytext
import psutil
import pytest
import torch

from offloadlab import bench, devices, experiment, machine
from tools import gpu_check as gpucheck
from tools.gpu_check import main
from offloadlab.models import saved_activation_bytes
from offloadlab_course import capacity
from tests.conftest import ROOT

GiB = 2**30
PARTS = [
    "build peers (DeepSpeed's CPU Adam)",
    "GPU-marked tests",
    "chapters (nbval, quick mode)",
    "labs (nbval, quick mode)",
    "link probe (reference data)",
    *(
        f"bench {name}"
        for name in ("link", "overlap", "adam", "offload", "activations", "prefetch", "nvme")
    ),
]


@pytest.fixture(scope="module")
def plans():
    return {name: gpucheck.plan(devices.get(name)) for name in devices.names()}


def test_every_part_fits_every_profile(plans):
    """Pinned memory at most a quarter of the server's host memory, device memory at most 80 % of
    the card's, every part listed, and the whole run within the 9 minutes it has on one H200 (of
    the 15 a lent GPU gives; the rest for the machine's starts, one command a part)."""
    for name, planned in plans.items():
        profile = devices.get(name)
        assert [p["name"] for p in planned["parts"]] == PARTS
        for part in planned["parts"]:
            assert part["pinned_bytes"] <= profile.host_memory_bytes / 4, (name, part)
            assert part["device_bytes"] <= 0.8 * profile.memory_bytes, (name, part)
            assert part["seconds"] > 0 and part["basis"], (name, part)
        assert planned["fits"]
    assert plans["h200"]["seconds"] <= gpucheck.BUDGET_SECONDS


def test_every_part_has_a_time_limit_of_its_own_and_fits_one_command(plans):
    """A hung test used to cost pytest's 900 s, and the whole run was one command: each part now
    has its limit (three times its plan, at least a minute), and on an H200 each part, killed at
    its limit, still ends within a 10-minute command with a minute to spare."""
    for name, planned in plans.items():
        assert [p["key"] for p in planned["parts"]] == list(gpucheck.PARTS)
        for part in planned["parts"]:
            assert part["timeout_s"] == gpucheck.part_timeout(part["seconds"]), (name, part)
            assert part["timeout_s"] >= max(60, 3 * part["seconds"]), (name, part)
    for part in plans["h200"]["parts"]:
        assert part["timeout_s"] <= gpucheck.COMMAND_SECONDS - 60, part
    assert gpucheck.part_timeout(1.0) == 60 and gpucheck.part_timeout(100.0) == 300


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
    counted = saved_activation_bytes(config, 4, torch.float32)
    # (the meta device takes the unfused attention path: a little more)
    assert real <= counted <= 1.25 * real


def test_dry_run_json_has_the_shape_the_instructions_give(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--dry-run", "--profile", "h100-sxm", "--json", str(out)]) == 0
    planned = json.loads(out.read_text())
    assert {"pinned_bytes", "device_bytes", "seconds", "parts"} <= set(planned)
    assert all(
        {"name", "key", "pinned_bytes", "device_bytes", "seconds", "timeout_s"} <= set(p)
        for p in planned["parts"]
    )
    assert planned["pinned_bytes"] <= 32 * GiB and planned["device_bytes"] <= 64e9
    text = capsys.readouterr().out
    assert "bench nvme" in text and "fits" in text and f"wrote the plan to {out}" in text
    assert "bench-nvme" in text  # what --only takes, beside each part


def test_dry_run_only_plans_that_part(tmp_path):
    out = tmp_path / "plan.json"
    args = ["--dry-run", "--profile", "h200", "--only", "labs", "--json", str(out)]
    assert main(args) == 0
    planned = json.loads(out.read_text())
    assert [p["key"] for p in planned["parts"]] == ["labs"]
    assert planned["seconds"] == planned["parts"][0]["seconds"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--dry-run", "--profile", "h100"], "--profile: expected one of h100-sxm"),
        (["--json", "plan.json"], "--json: only with --dry-run"),
        (["--profile", "l4"], "--profile: only with --dry-run"),
        (["--only", "notebooks"], "--only: expected one of peers, tests, book, labs, probe, "),
        (["--dry-run", "--profile", "l4", "--only", "bench"], "got 'bench'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU present is planned by the real run")
def test_dry_run_without_a_gpu_names_the_profiles(capsys):
    assert main(["--dry-run"]) == 2
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
    monkeypatch.setattr(
        gpucheck,
        "build_peers",
        lambda require: {"step": "peers", "ok": True, "seconds": 0.0, "summary": "", "log": ""},
    )
    # (in this process, where the fakes are)
    assert gpucheck.run(tmp_path / "out", isolate=False) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"][0]["part"] == "peers"  # built before anything is timed
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


@pytest.mark.slow  # (every benchmark, on the emulated link)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU, gpu-check is the real thing: run make gpu-check"
)
def test_gpu_check_runs_the_cpu_parts_and_exits_0(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path), "--quick"],
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


# ----------------------------------------------------------------------------- one part at a time


def test_a_part_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """A hung part used to wait for pytest's 900 s: its whole process group is killed at its
    limit, and the part is failed, saying so."""
    pid_file = tmp_path / "grandchild.pid"
    # a shell starts its grandchild at once; the limit is reached while both sleep
    script = f"sleep 600 & echo $! > {pid_file}; wait"
    step = gpucheck._run("hangs", ["sh", "-c", script], tmp_path / "log", timeout=2)
    assert not step["ok"] and step["summary"] == "timed out after 2 s"
    grandchild = psutil.Process(int(pid_file.read_text()))
    try:
        for _ in range(600):  # SIGKILL is delivered asynchronously
            if grandchild.status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
        assert grandchild.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


def test_a_part_is_run_in_its_own_process_and_failed_at_its_limit(tmp_path):
    """The benchmarks and the probe run in a process of their own: one that has not finished by
    its limit (here 1 s: not even torch is imported by then) is killed and failed."""
    step = gpucheck._run_part("bench-link", tmp_path, True, None, timeout=1, isolate=True)
    assert not step["ok"] and step["summary"] == "timed out after 1 s"
    assert not (tmp_path / "bench-link.json").exists()


def _faked(monkeypatch, ran):
    monkeypatch.setattr(
        gpucheck,
        "_pytest",
        lambda title, args, *a, **k: (
            ran.append(args[-1])
            or {"step": title, "ok": True, "seconds": 0.0, "summary": "", "log": ""}
        ),
    )
    for name in gpucheck.BENCHMARKS:

        def fake(quick=False, name=name, **kwargs):
            ran.append(name)
            return {"source": "emulated", "ratios": {name: 1.0}, "rows": []}

        monkeypatch.setattr(gpucheck.bench, name, fake)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU")
def test_only_runs_that_part_and_the_summary_gathers_the_parts(tmp_path, monkeypatch, capsys):
    ran = []
    _faked(monkeypatch, ran)
    out = tmp_path / "out"
    assert gpucheck.run(out, only="bench-link", isolate=False) == 0
    assert ran == ["link"]
    assert gpucheck.run(out, only="tests", isolate=False) == 0
    assert ran == ["link", "tests"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["part"] for s in summary["steps"]] == ["tests", "bench-link"]
    # a part that needs a GPU, without one: said so, nothing run, not a failure
    assert gpucheck.run(out, only="labs", isolate=False) == 0
    assert ran == ["link", "tests"] and "labs skipped (they need one)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="^--only: expected one of peers, tests, book, labs"):
        gpucheck.run(out, only="lab")


def test_bench_adam_alone_builds_the_peers_first(tmp_path, monkeypatch):
    """On a GPU (faked), as in the whole run: DeepSpeed's CPU Adam is not compiled while timed."""
    ran = []
    _faked(monkeypatch, ran)
    monkeypatch.setattr(gpucheck, "_has_gpu", lambda: True)
    monkeypatch.setattr(gpucheck, "profile_for", lambda name: devices.get("h200"))
    monkeypatch.setattr(gpucheck, "_present", lambda module: True)
    monkeypatch.setattr(
        gpucheck,
        "build_peers",
        lambda require: (
            ran.append("peers")
            or {"step": "peers", "ok": True, "seconds": 0.0, "summary": "", "log": ""}
        ),
    )
    monkeypatch.setattr(gpucheck.reference, "save", lambda *a, **k: None)
    assert gpucheck.run(tmp_path, only="bench-adam", isolate=False) == 0
    assert ran == ["peers", "adam"]
    assert [
        p["key"] for p in json.loads((tmp_path / "plan-bench-adam.json").read_text())["parts"]
    ] == ["bench-adam"]


def test_a_stale_build_lock_is_reported_not_waited_on(tmp_path, monkeypatch):
    """A build of DeepSpeed's CPU Adam killed midway leaves ``lock`` in torch's extension folder,
    and torch waits for it forever: the peers' step names it instead, and builds nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(gpucheck, "_present", lambda module: True)
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    step = gpucheck.build_peers(require=True)
    assert not step["ok"] and str(lock) in step["summary"] and "delete it" in step["summary"]


def test_bench_adam_reports_a_stale_build_lock_too(tmp_path, monkeypatch):
    """Without a GPU there is no peers' step: bench adam waited on a lock left by a build killed at
    its limit, forever (found on this kit's own CPU run)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(gpucheck, "_present", lambda module: True)
    monkeypatch.setattr(gpucheck.bench, "adam", lambda **k: pytest.fail("waited on the lock"))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    step = gpucheck._bench("adam", tmp_path, True, None, {})
    assert not step["ok"] and str(lock) in step["summary"]


def test_absent_peers_fail_the_peers_step_on_a_gpu(monkeypatch):
    monkeypatch.setattr(gpucheck, "_present", lambda module: module == "deepspeed")
    step = gpucheck.build_peers(require=True)
    assert not step["ok"]
    assert step["summary"] == "absent: torchao, accelerate; install them: make gpu-env"


def test_the_build_folder_is_the_one_torch_locks(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    torch_folder = cpp_extension._get_build_directory("cpu_adam", False)
    assert gpucheck.cpu_adam_build_folder() == Path(torch_folder)


def test_make_gpu_env_installs_the_peers_and_gpu_check_documents_only():
    """torchao and accelerate were in no environment gpu-check ran in: the peer comparison it
    exists for never ran."""
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\ngpu-env:")[1].split("\n\n")[0]
    assert '-e ".[peers]"' in target
    help_text = makefile.split("## gpu-env:")[1].split("\ngpu-check:")[0]
    assert "GPU_CHECK=--only PART" in help_text
    for key in gpucheck.PARTS:
        assert key in help_text, key


# ----------------------------------------------------------------------------- every buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "schedule, options",
    [("at step", {}), ("eager", {"accumulation_steps": 1}), ("delayed", {"delayed_update": True})],
)
def test_the_plan_counts_every_host_buffer_the_optimizer_holds(schedule, options, dtype):
    from offloadlab.offload import CPUOffloadAdam

    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    optimizer = CPUOffloadAdam(model.parameters(), **options)
    try:
        held = optimizer.host_bytes()
    finally:
        optimizer.close()
    held.pop("accumulated_gradients", None)  # only once a step accumulates; not in the bench
    per_param = gpucheck.offload_host_bytes_per_param(
        schedule, torch.empty(0, dtype=dtype).element_size()
    )
    assert sum(held.values()) == per_param * params


def test_the_offload_part_counts_the_delayed_updates_copy_of_the_weights(plans):
    """The delayed update keeps the weights last sent and a second landing buffer as well, 2 bytes
    per parameter each in bf16: the plan counted 16 bytes per parameter for every schedule."""
    largest = max(config.params for _, config, _ in bench._offload_models(True))
    per_param = sum(gpucheck.offload_host_bytes_per_param(s) for s in gpucheck.OFFLOAD_SCHEDULES)
    assert per_param == 16 + 16 + 20
    for planned in plans.values():
        part = next(p for p in planned["parts"] if p["key"] == "bench-offload")
        assert part["pinned_bytes"] >= per_param * largest
    with pytest.raises(ValueError, match="^schedule: expected one of at step, eager, delayed"):
        gpucheck.offload_host_bytes_per_param("late")


def test_gpu_check_replaces_a_link_planted_in_its_folder_never_writes_through(tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").symlink_to(victim)
    provenance = {"gpu": None, "torch": "2", "cpu": "cpu", "date": "today"}
    gpucheck._write_summary(out, [], provenance, merge=False)
    assert victim.read_text() == "precious" and not (out / "summary.json").is_symlink()


def test_json_to_dev_stdout_on_a_pipe_is_written_there():
    """/dev/stdout on a pipe resolves to '/proc/PID/fd/pipe:[N]', which is no path: it was
    refused ('cannot create a file in /proc/PID/fd')."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--profile", "h200"]
        + ["--json", "/dev/stdout"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout[: result.stdout.index("\n}\n") + 2])["profile"]


def test_a_dangling_link_planted_at_the_json_is_refused(tmp_path, capsys):
    victim = tmp_path / "elsewhere.json"
    planted = tmp_path / "out.json"
    planted.symlink_to(victim)
    assert main(["--dry-run", "--profile", "h200", "--json", str(planted)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a symbolic link (to " in err and "--force" in err
    assert not victim.exists()


def test_the_notebooks_left_out_are_those_whose_code_reaches_no_device():
    """A notebook with no link, CUDA or device in its code runs on the GPU machine as on CI's CPU:
    the GPU check leaves it out, and only it (chapter 9b's split made the plan 540.1 s of 540)."""
    every = sorted([*ROOT.glob("book/[0-9]*.md"), *ROOT.glob("labs/lab*.md")])
    left_out = {path.name for path in every} - {p.name for p in gpucheck._notebooks(ROOT)}
    assert left_out == {"08_nvme.md", "09b_beyond_one_gpu.md", "lab07_one_tier_further.md"}
    for name in left_out:
        path = next(p for p in every if p.name == name)
        code = "\n".join(c.source for c in jupytext.read(path).cells if c.cell_type == "code")
        assert "device" not in code and "cuda" not in code and "open_link" not in code
