"""``offloadlab gpu-check``: prove the CUDA paths on a real GPU in one run, and keep the results.

The run has parts, in this order: the GPU-marked tests, every chapter and lab under nbval (in
quick mode: ``OFFLOADLAB_QUICK=1``), the link probe (saved as reference data), and the
benchmarks — link, overlap, CPU Adam, optimizer offload, prefetch and the NVMe tier. Each is
planned before anything runs, from the GPU's :class:`~offloadlab.devices.DeviceProfile`: the
pinned host bytes and device bytes it holds at most at once, and its estimated seconds.

- ``--dry-run`` prints that plan and runs nothing heavy, with or without a GPU; ``--profile
  NAME`` plans for a named profile (h100-sxm, h200, a100-40gb, l4, rtx-4090) instead of the GPU
  present, and ``--json FILE`` writes it: top-level ``pinned_bytes`` and ``device_bytes`` (the
  most any part holds: parts run one after another and each frees its memory), ``seconds`` (all
  parts), ``limits`` and ``parts``, a list of objects with ``name``, ``pinned_bytes``,
  ``device_bytes``, ``seconds`` and ``basis``. An instructor sees before running whether the kit
  fits their server: at most a quarter of its host memory pinned, 80 % of the GPU's memory.
- The real run refuses to start when the plan does not fit, keeps to it (every benchmark sizes
  itself from the same profile and never beyond its plan), writes each part's result as JSON
  with its provenance into ``--out``, marks a part that fails as failed and never writes it as
  reference data, and prints a one-screen summary last. Reference data (the probe, each
  benchmark that passed) goes into ``offloadlab/reference`` in the checkout, to be committed.
- Without a GPU it says so in one line, runs the parts that need none (the benchmarks on the
  emulated link), and exits 0. A machine whose GPU torch cannot use (a CPU build of torch, or a
  CUDA build newer than the driver) is a failure, exit 1: passing there would prove nothing.

    offloadlab gpu-check [--out DIR] [--full] [--disk DIR]
    offloadlab gpu-check --dry-run [--profile NAME] [--json FILE [--force]]

Run it from an environment made beforehand (``make env TORCH=...``): ``make gpu-check`` installs
nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import bench, devices, ladder, machine, probe, reference
from .devices import ASSUMED, DeviceProfile, Footprint
from .units import format_duration, format_size

BENCHMARKS = ("link", "overlap", "adam", "offload", "prefetch", "nvme")
ROOT = Path(__file__).resolve().parent.parent  # the kit's checkout: tests/, book/, labs/
PEERS = ("torchao", "deepspeed", "accelerate")
PINNED_SHARE = 0.25  # of host memory, at most, pinned by any part
DEVICE_SHARE = 0.80  # of device memory, at most, held by any part
BUDGET_SECONDS = 8 * 60  # what the whole run should take on one H200

__all__ = [
    "plan",
    "format_plan",
    "profile_for",
    "run",
    "BENCHMARKS",
    "PINNED_SHARE",
    "DEVICE_SHARE",
    "BUDGET_SECONDS",
]


# ----------------------------------------------------------------------------- the plan


def _gpu_tests(root: Path) -> int:
    """How many tests carry the gpu mark (counted in the test files, as pytest -m gpu selects
    them)."""
    return sum(
        path.read_text(encoding="utf-8").count("@pytest.mark.gpu")
        for path in (root / "tests").glob("*.py")
    )


def _notebooks(root: Path) -> list[Path]:
    return sorted([*root.glob("book/[0-9]*.md"), *root.glob("labs/lab*.md")])


def _tests_footprint(profile: DeviceProfile, root: Path) -> Footprint:
    """The GPU tests: the largest is the capped training test (lab 4's model under lab 4's cap),
    with CPUOffloadAdam's pinned state for it (16 bytes per parameter with bf16 weights)."""
    from .offload import capacity

    count = _gpu_tests(root)
    cap = capacity.lab_cap()
    return Footprint(
        16 * capacity.LAB_CONFIG.params,
        cap,
        ASSUMED["process_start"] + 5.0 + 6.0 * count,
        f"{count} GPU-marked tests; the largest runs lab 4's model under its {format_size(cap)} "
        f"cap (6 s a test assumed)",
    )


def _notebooks_footprint(profile: DeviceProfile, root: Path) -> Footprint:
    """Every chapter and lab: the heaviest cells are lab 4's uncapped AdamW run (fp32 weights,
    gradients and moments, and the saved activations), chapter 2's and lab 2's link sweeps (full
    size: they choose their own sizes on a GPU) and chapter 3's overlap experiments (transfers up to
    3 compute windows of its quick mode)."""
    from .offload import capacity

    count = len(_notebooks(root))
    need = capacity.offloaded_need(capacity.LAB_CONFIG, capacity.LAB_BATCH)
    lab4_device = need.plain_adamw_state + need.activations
    sweep = probe.default_sizes_for(emulated=False, quick=False)[-1] + probe.busy_filler_bytes(
        False
    )
    chapter3 = experiment_bytes(profile)
    pinned = max(16 * capacity.LAB_CONFIG.params, sweep, 2 * 256 * 2**20, chapter3)
    device = max(lab4_device, sweep, chapter3)
    lab4_steps = (
        3 * 40 * 6 * capacity.LAB_CONFIG.params * capacity.LAB_BATCH * capacity.LAB_CONFIG.seq
    )
    lab4_seconds = (
        lab4_steps / (profile.bf16_flops * ASSUMED["matmul_efficiency"])
        + 40 * 28 * capacity.LAB_CONFIG.params / ASSUMED["host_bandwidth"]
    )
    # the link sweeps, chapter 3, and lab 8's two CPU processes (gloo): 60 s assumed
    work = 60.0 + lab4_seconds
    return Footprint(
        pinned,
        device,
        count * ASSUMED["notebook_start"] + work,
        f"{count} notebooks ({ASSUMED['notebook_start']:.0f} s each to start), lab 4's three runs "
        f"of 40 steps, 60 s for the sweeps, chapter 3 and lab 8",
    )


def experiment_bytes(profile: DeviceProfile) -> int:
    """Chapter 3's largest transfer in quick mode: three compute windows over the nominal link."""
    from . import experiment

    return experiment.transfer_bytes(profile, 3.0, experiment.WINDOW / 2)


def _probe_footprint(profile: DeviceProfile, quick: bool) -> Footprint:
    """ladder.measure: the host-memory probe, a device copy, the link sweep, both directions at once
    over two 256 MiB buffers, and the disk probe."""
    sizes = probe.default_sizes_for(emulated=False, quick=quick)
    sweep = sizes[-1] + probe.busy_filler_bytes(False)
    device_copy = 2 * (256 if quick else 2048) * 2**20
    seconds = (
        bench.link_plan(profile, quick).seconds
        + 3 * (64 if quick else 1024) * 2**20 / ASSUMED["disk_bandwidth"]
        + 5.0
    )
    return Footprint(
        max(sweep, 2 * 256 * 2**20),
        max(sweep, device_copy, 2 * 256 * 2**20),
        seconds,
        f"link sweep to {sizes[-1] >> 20} MiB, both directions at once, host, device and disk "
        "probes",
    )


def plan(profile: DeviceProfile, quick: bool = True, root: Path = ROOT) -> dict:
    """The plan of a gpu-check run on a GPU of ``profile`` (see the module docstring)."""
    parts = [
        ("GPU-marked tests", _tests_footprint(profile, root)),
        ("chapters and labs (nbval, quick mode)", _notebooks_footprint(profile, root)),
        ("link probe (reference data)", _probe_footprint(profile, quick)),
    ]
    for name in BENCHMARKS:
        parts.append((f"bench {name}", getattr(bench, f"{name}_plan")(profile, quick)))
    listed = [
        {
            "name": name,
            "pinned_bytes": int(f.pinned_bytes),
            "device_bytes": int(f.device_bytes),
            "seconds": round(f.seconds, 1),
            "basis": f.basis,
        }
        for name, f in parts
    ]
    limits = {
        "pinned_bytes": int(PINNED_SHARE * profile.host_memory_bytes),
        "device_bytes": int(DEVICE_SHARE * profile.memory_bytes),
    }
    result = {
        "profile": profile.to_dict(),
        "quick": quick,
        "pinned_bytes": max(p["pinned_bytes"] for p in listed),
        "device_bytes": max(p["device_bytes"] for p in listed),
        "seconds": round(sum(p["seconds"] for p in listed), 1),
        "limits": limits,
        "parts": listed,
        "assumed": ASSUMED,
    }
    result["fits"] = (
        result["pinned_bytes"] <= limits["pinned_bytes"]
        and result["device_bytes"] <= limits["device_bytes"]
    )
    return result


def format_plan(planned: dict) -> str:
    """The plan as a short table."""
    p = planned["profile"]
    lines = [
        f"gpu-check plan for {p['gpu']} ({p['name']}): {format_size(p['memory_bytes'])} device "
        f"memory, {format_size(p['host_memory_bytes'])} host memory ({p['host_memory_basis']}), "
        f"PCIe {p['pcie_generation']} ×{p['pcie_width']}",
        f"  {'part':<40} {'pinned':>10} {'device':>10} {'seconds':>8}",
    ]
    for part in planned["parts"]:
        lines.append(
            f"  {part['name']:<40} {format_size(part['pinned_bytes'], binary=True):>10} "
            f"{format_size(part['device_bytes']):>10} {part['seconds']:8.0f}"
        )
    limits = planned["limits"]
    lines.append(
        f"  {'most at once / all parts':<40} "
        f"{format_size(planned['pinned_bytes'], binary=True):>10} "
        f"{format_size(planned['device_bytes']):>10} {planned['seconds']:8.0f}"
    )
    lines.append(
        f"  limits: pinned ≤ {format_size(limits['pinned_bytes'], binary=True)} (a quarter of host "
        f"memory), device ≤ {format_size(limits['device_bytes'])} (80 %); "
        f"{'fits' if planned['fits'] else 'DOES NOT FIT'}; about "
        f"{format_duration(planned['seconds'])} (estimated: datasheet rates and the assumptions in "
        "'assumed')"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run


def _gpu_torch_cannot_see() -> str | None:
    """A line naming this machine's NVIDIA GPU when torch cannot use it, else None."""
    if _has_gpu():
        return None
    driver = Path("/proc/driver/nvidia/gpus")
    if not (driver.is_dir() and any(driver.iterdir())) and shutil.which("nvidia-smi") is None:
        return None
    build = f"torch {torch.__version__} " + (
        f"built for CUDA {torch.version.cuda}"
        if torch.version.cuda
        else "without CUDA (a CPU build)"
    )
    return (
        f"this machine has an NVIDIA GPU but {build} cannot use it: install the CUDA build of "
        "torch that the driver supports (nvidia-smi shows the driver's CUDA version), then run "
        "gpu-check again"
    )


def _has_gpu() -> bool:
    return torch.cuda.is_available()


def _run(title: str, command: list[str], log: Path, env: dict | None = None) -> dict:
    """Run a command, keep its output in ``log``, and report how it ended."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    log.write_text(result.stdout + result.stderr, encoding="utf-8")
    tail = (result.stdout.strip().splitlines() or [""])[-1]
    return {
        "step": title,
        "ok": result.returncode == 0,
        "seconds": time.perf_counter() - started,
        "summary": re.sub(r"\x1b\[[0-9;]*m", "", tail)[:90],
        "log": str(log),
    }


def _pytest(title: str, args: list[str], log: Path, env: dict | None = None) -> dict:
    return _run(
        title, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], log, env
    )


def _reference_name(prefix: str, gpu: str | None) -> str:
    return prefix + re.sub(r"[^A-Za-z0-9]+", "-", gpu or "unknown").strip("-").lower()


def _release_device_memory() -> None:
    """Between parts: what a part cached on the device goes back, so each starts from its plan."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(out: Path, quick: bool = True, disk: Path | None = None) -> int:
    """The real run (see the module docstring); returns the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    problem = _gpu_torch_cannot_see()
    if problem:
        print(problem)
        return 1
    gpu = _has_gpu()
    if not (ROOT / "tests").is_dir():
        print(f"no tests/ beside the package ({ROOT}): run gpu-check from a checkout of the kit")
        return 2
    provenance = machine.provenance()
    steps, results = [], {}
    if gpu:
        try:
            profile = profile_for(None)
        except ValueError as error:
            print(str(error).removeprefix("profile: "))
            return 2
        planned = plan(profile, quick)
        (out / "plan.json").write_text(json.dumps(planned, indent=1), encoding="utf-8")
        print(format_plan(planned))
        if not planned["fits"]:
            print("the plan does not fit this machine: nothing was run")
            return 1
    else:
        print(
            "no CUDA GPU on this machine: running the CPU parts; the GPU tests, the GPU notebook "
            "run and the reference measurement are skipped"
        )
    steps.append(
        _pytest("GPU-marked tests", ["-m", "gpu", "tests"], out.resolve() / "gpu-tests.log")
    )
    if gpu:
        quick_env = {**os.environ, "OFFLOADLAB_QUICK": "1"}
        steps.append(
            _pytest(
                "chapters and labs on the GPU (nbval, quick mode)",
                ["book", "labs"],
                out.resolve() / "notebooks.log",
                env=quick_env,
            )
        )
        steps.append(_probe(out, quick, provenance, disk or out))
    for name in BENCHMARKS:
        _release_device_memory()
        started = time.perf_counter()
        try:
            if name == "nvme":
                results[name] = bench.nvme(quick=quick, folder=disk or out)
            else:
                results[name] = getattr(bench, name)(quick=quick)
        # one failing benchmark must not hide the others; it is not reference data
        except Exception as error:
            steps.append(
                {
                    "step": f"bench {name}",
                    "ok": False,
                    "seconds": time.perf_counter() - started,
                    "summary": f"{type(error).__name__}: {error}"[:90],
                    "log": "",
                }
            )
            continue
        (out / f"bench-{name}.json").write_text(
            json.dumps(results[name], indent=1), encoding="utf-8"
        )
        if gpu:
            reference.save(
                _reference_name(f"bench-{name}-", provenance["gpu"]),
                "measured",
                provenance["gpu"],
                provenance,
                [results[name]],
                folder=reference.FOLDER,
                overwrite=True,
            )
        steps.append(
            {
                "step": f"bench {name} ({results[name]['source']})",
                "ok": True,
                "seconds": time.perf_counter() - started,
                "summary": _headline(results[name]),
                "log": str(out / f"bench-{name}.json"),
            }
        )
    peers = {p: importlib.util.find_spec(p) is not None for p in PEERS}
    summary = {"provenance": provenance, "steps": steps, "peers": peers}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    _print_summary(summary)
    return 0 if all(s["ok"] for s in steps) else 1


def _probe(out: Path, quick: bool, provenance: dict, disk: Path) -> dict:
    """The link probe, saved as reference data only when every probe in it ran."""
    started = time.perf_counter()
    try:
        measured = ladder.measure(quick=quick, disk_folder=disk)
    except Exception as error:
        return {
            "step": "link probe (reference data)",
            "ok": False,
            "seconds": time.perf_counter() - started,
            "summary": f"{type(error).__name__}: {error}"[:90],
            "log": "",
        }
    records = [r.to_dict() for r in measured["records"]]
    (out / "probe.json").write_text(
        json.dumps(
            {
                "machine": measured["machine"].to_dict(),
                "ladder": ladder.of_machine(measured),
                "records": records,
                "faults": measured["faults"],
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    if measured["faults"]:
        return {
            "step": "link probe (reference data)",
            "ok": False,
            "seconds": time.perf_counter() - started,
            "summary": "; ".join(measured["faults"])[:90],
            "log": str(out / "probe.json"),
        }
    path = reference.save(
        _reference_name("gpu-", provenance["gpu"]),
        "measured",
        provenance["gpu"],
        provenance,
        # into the checkout, to be committed
        records,
        folder=reference.FOLDER,
        overwrite=True,
    )
    return {
        "step": "link probe (reference data)",
        "ok": True,
        "seconds": time.perf_counter() - started,
        "summary": f"{len(records)} records → {path.name}",
        "log": str(out / "probe.json"),
    }


def _headline(result: dict) -> str:
    """The first ratio of a benchmark, as a short line."""
    for name, value in result["ratios"].items():
        if value is not None:
            return f"{name}: {value:.2f}"
    return ""


def _print_summary(summary: dict) -> None:
    p = summary["provenance"]
    print(
        f"\ngpu-check on {p['gpu'] or 'no GPU'} (driver {p.get('driver') or '–'}), torch "
        f"{p['torch']}, {p['cpu']}, {p['date']}"
    )
    for s in summary["steps"]:
        print(
            f"  {'ok  ' if s['ok'] else 'FAIL'} {s['step']:<48} {s['seconds']:6.1f} s  "
            f"{s['summary']}"
        )
    print(
        "  peers: "
        + ", ".join(f"{k} {'present' if v else 'absent'}" for k, v in summary["peers"].items())
    )


def profile_for(name: str | None) -> DeviceProfile:
    """The profile called ``name``, or (None) the GPU present's; ValueError naming what to do
    otherwise."""
    if name is not None:
        return devices.get(name)
    profile = devices.present()
    if profile is None:
        problem = _gpu_torch_cannot_see()
        raise ValueError(
            f"profile: {problem}"
            if problem
            else "profile: no CUDA GPU on this machine to plan for; name one of "
            f"{', '.join(devices.names())}"
        )
    return profile


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["gpu-check", *sys.argv[1:]]))
