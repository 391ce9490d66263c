"""The GPU kit (``make gpu-check``): prove the CUDA paths on a real GPU, and keep the results.

It runs this checkout's tests, chapters and labs, so it lives with them, not in the package.

The run has parts, in this order: the peers' build (DeepSpeed's CPU Adam compiled before anything
is timed), the GPU-marked tests, the chapters and then the labs under nbval (in quick mode:
``OFFLOADLAB_QUICK=1``), the link probe (saved as reference data), and the benchmarks — link,
overlap, CPU Adam, optimizer offload, prefetch and the NVMe tier. Each is planned before anything
runs, from the GPU's :class:`~offloadlab.devices.DeviceProfile`: the pinned host bytes and device
bytes it holds at most at once, its estimated seconds, and its own time limit (``timeout_s``:
three times the estimate, at least a minute).

- ``--only PART`` runs one part (``peers``, ``tests``, ``book``, ``labs``, ``probe``,
  ``bench-link`` … ``bench-nvme``), each planned to fit one 10-minute command; its result joins
  those of the parts run before into the same ``--out``. ``bench-adam`` builds the peers first.
- Every part runs in a process group of its own, killed at its ``timeout_s`` (the part is then
  failed, "timed out after N s"); inside the tests and notebooks, one test or cell past half of
  it fails alone.
- ``--dry-run`` prints that plan and runs nothing heavy, with or without a GPU; ``--profile
  NAME`` plans for a named profile (h100-sxm, h200, a100-40gb, l4, rtx-4090) instead of the GPU
  present, and ``--json FILE`` writes it: top-level ``pinned_bytes`` and ``device_bytes`` (the
  most any part holds: parts run one after another and each frees its memory), ``seconds`` (all
  parts), ``limits`` and ``parts``, a list of objects with ``name``, ``key`` (what ``--only``
  takes), ``pinned_bytes``, ``device_bytes``, ``seconds``, ``timeout_s`` and ``basis``. An
  instructor sees before running whether the kit fits their server: at most a quarter of its host
  memory (the smaller of the machine's and its cgroup's limit) pinned, 80 % of the GPU's memory.
- The real run refuses to start when the plan does not fit, keeps to it (every benchmark sizes
  itself from the same profile and never beyond its plan), writes each part's result as JSON
  with its provenance into ``--out``, marks a part that fails as failed and never writes it as
  reference data, and prints a one-screen summary last. Reference data (the probe, each
  benchmark that passed) goes into ``offloadlab/reference`` in the checkout, to be committed.
- Without a GPU it says so in one line, runs the parts that need none (the benchmarks on the
  emulated link), and exits 0. A machine whose GPU torch cannot use (a CPU build of torch, or a
  CUDA build newer than the driver) is a failure, exit 1: passing there would prove nothing.

    python tools/gpu_check.py [--only PART] [--out DIR] [--full] [--disk DIR]
    python tools/gpu_check.py --dry-run [--only PART] [--profile NAME] [--json FILE [--force]]

Run it from an environment made beforehand (``make gpu-env TORCH=...``: ``make env`` and the
peers): ``make gpu-check`` installs nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from offloadlab import bench, cli, devices, files, ladder, machine, probe, reference
from offloadlab.bench import cpu_adam_build_folder
from offloadlab.devices import ASSUMED, DeviceProfile, Footprint
from offloadlab.units import format_duration, format_size

BENCHMARKS = ("link", "overlap", "adam", "offload", "activations", "prefetch", "nvme")
ROOT = Path(__file__).resolve().parent.parent  # the kit's checkout: tests/, book/, labs/
PEERS = ("torchao", "deepspeed", "accelerate")
PINNED_SHARE = 0.25  # of host memory, at most, pinned by any part
DEVICE_SHARE = 0.80  # of device memory, at most, held by any part
# what all parts together should take on one H200: 9 of the 15 minutes a lent GPU gives, the rest
# for the machine's starts (each part is a command of its own, within COMMAND_SECONDS)
BUDGET_SECONDS = 9 * 60
COMMAND_SECONDS = 10 * 60  # what one command may take on a lent GPU machine: one part must fit
TIMEOUT_FACTOR = 3  # a part is killed at this many times its planned seconds ...
TIMEOUT_FLOOR = 60  # ... and never sooner than this
NO_GPU_TIMEOUT = 30 * 60  # a part's limit without a GPU (a CPU's work is not planned)
PEERS_BUILD_SECONDS = 60.0  # DeepSpeed's CPU Adam compiled from source, assumed
OFFLOAD_SCHEDULES = ("at step", "eager", "delayed")  # CPUOffloadAdam's, as bench offload runs them
# The parts in the order they run, by the name --only takes: peers are built before anything is
# timed; the chapters and the labs are two parts so that each fits one command.
PARTS = {
    "peers": "build peers (DeepSpeed's CPU Adam)",
    "tests": "GPU-marked tests",
    "book": "chapters (nbval, quick mode)",
    "labs": "labs (nbval, quick mode)",
    "probe": "link probe (reference data)",
    **{f"bench-{name}": f"bench {name}" for name in BENCHMARKS},
}
GPU_ONLY = ("peers", "book", "labs", "probe")  # skipped by a run without a GPU

__all__ = [
    "plan",
    "format_plan",
    "profile_for",
    "run",
    "check_only",
    "part_timeout",
    "offload_host_bytes_per_param",
    "build_peers",
    "BENCHMARKS",
    "PARTS",
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
    """The chapters and labs whose code reaches a device; the others (chapter 8's files, chapter
    9b's arithmetic, lab 7's disk) run on the GPU machine exactly as on CI's CPU."""
    every = sorted([*root.glob("book/[0-9]*.md"), *root.glob("labs/lab*.md")])
    return [path for path in every if _reaches_a_device(path)]


def _reaches_a_device(path: Path) -> bool:
    """Whether a notebook's code names a link, CUDA or a device."""
    import jupytext

    code = "\n".join(c.source for c in jupytext.read(path).cells if c.cell_type == "code")
    return any(word in code for word in ("open_link", "cuda", "device"))


def _tests_footprint(profile: DeviceProfile, root: Path) -> Footprint:
    """The GPU tests: the largest is the capped training test (lab 4's model under lab 4's cap),
    with CPUOffloadAdam's pinned state for it (16 bytes per parameter with bf16 weights)."""
    from offloadlab_course import capacity  # (the GPU kit runs from the checkout)

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
    from offloadlab_course import capacity  # (the GPU kit runs from the checkout)

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
    from offloadlab import experiment

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


def _book_and_labs(root: Path) -> tuple[list[Path], list[Path]]:
    notebooks = _notebooks(root)
    return (
        [p for p in notebooks if p.parent.name == "book"],
        [p for p in notebooks if p.parent.name == "labs"],
    )


def _notebook_part(profile: DeviceProfile, root: Path, which: str) -> Footprint:
    """The chapters' or the labs' share of :func:`_notebooks_footprint`: memory as the heaviest
    cell of either (a bound), time by notebook, lab 4's runs with the labs, the 60 s of sweeps,
    chapter 3 and lab 8 halved between them."""
    whole = _notebooks_footprint(profile, root)
    book, labs = _book_and_labs(root)
    count = len(book if which == "book" else labs)
    work = whole.seconds - len(book + labs) * ASSUMED["notebook_start"] - 60.0  # lab 4's runs
    seconds = count * ASSUMED["notebook_start"] + 30.0 + (work if which == "labs" else 0.0)
    if which == "book":
        basis = f"{count} chapters, chapter 2's sweep and chapter 3 (30 s)"
    else:
        basis = f"{count} labs, lab 4's three runs of 40 steps, lab 2's sweep and lab 8 (30 s)"
    basis += (
        f"; {ASSUMED['notebook_start']:.0f} s each to start; chapters and labs apart, so that "
        "each fits one 10-minute command"
    )
    return Footprint(whole.pinned_bytes, whole.device_bytes, seconds, basis)


def _peers_footprint() -> Footprint:
    """Building DeepSpeed's CPU Adam before anything is timed: host compile time only."""
    return Footprint(
        0,
        0,
        ASSUMED["process_start"] + (PEERS_BUILD_SECONDS if _present("deepspeed") else 0.0),
        f"DeepSpeed's CPU Adam compiled once ({PEERS_BUILD_SECONDS:.0f} s assumed), "
        "the peers imported",
    )


def offload_host_bytes_per_param(schedule: str, element_bytes: int = 2) -> int:
    """Host bytes CPUOffloadAdam holds per parameter (``HostState.nbytes``, no gradient sum): fp32
    master weights and both moments, the gradients as they land, the outgoing weights (below
    fp32), and with the delayed update a second landing buffer and a copy of the weights last
    sent."""
    if schedule not in OFFLOAD_SCHEDULES:
        raise ValueError(
            f"schedule: expected one of {', '.join(OFFLOAD_SCHEDULES)}; got {schedule!r}"
        )
    outgoing = element_bytes if element_bytes < 4 else 0
    delayed = 2 * element_bytes if schedule == "delayed" else 0
    return 12 + element_bytes + outgoing + delayed


def _offload_footprint(profile: DeviceProfile, quick: bool) -> Footprint:
    """``bench.offload_plan``, its pinned bytes counted buffer by buffer: every schedule's host
    state (:func:`offload_host_bytes_per_param`, bf16), torchao's at 16 bytes per parameter."""
    planned = bench.offload_plan(profile, quick)
    per_param = sum(offload_host_bytes_per_param(s, 2) for s in OFFLOAD_SCHEDULES)
    per_param += 16 if _present("torchao") else 0
    largest = max(config.params for _, config, _ in bench._offload_models(True))
    counted = per_param * largest
    return Footprint(
        max(planned.pinned_bytes, counted),
        planned.device_bytes,
        planned.seconds,
        f"{planned.basis}; pinned: {per_param} bytes per parameter in all (the delayed update "
        "keeps the weights last sent as well)",
    )


def part_timeout(seconds: float) -> int:
    """A part's own time limit: :data:`TIMEOUT_FACTOR` times its planned seconds, at least
    :data:`TIMEOUT_FLOOR`."""
    return int(max(TIMEOUT_FLOOR, math.ceil(TIMEOUT_FACTOR * seconds)))


def check_only(value: str) -> str:
    """``value`` if it names a part (see :data:`PARTS`), else ValueError naming them."""
    if value not in PARTS:
        raise ValueError(f"--only: expected one of {', '.join(PARTS)}; got {value!r}")
    return value


def plan(
    profile: DeviceProfile, quick: bool = True, root: Path = ROOT, only: str | None = None
) -> dict:
    """The plan of a gpu-check run on a GPU of ``profile`` (see the module docstring); with
    ``only``, of that part alone."""
    footprints = {
        "peers": _peers_footprint(),
        "tests": _tests_footprint(profile, root),
        "book": _notebook_part(profile, root, "book"),
        "labs": _notebook_part(profile, root, "labs"),
        "probe": _probe_footprint(profile, quick),
    }
    for name in BENCHMARKS:
        footprints[f"bench-{name}"] = (
            _offload_footprint(profile, quick)
            if name == "offload"
            else getattr(bench, f"{name}_plan")(profile, quick)
        )
    keys = list(PARTS) if only is None else [check_only(only)]
    listed = [
        {
            "name": PARTS[key],
            "key": key,
            "pinned_bytes": int(footprints[key].pinned_bytes),
            "device_bytes": int(footprints[key].device_bytes),
            "seconds": round(footprints[key].seconds, 1),
            "timeout_s": part_timeout(round(footprints[key].seconds, 1)),
            "basis": footprints[key].basis,
        }
        for key in keys
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
        "assumed": dict(ASSUMED),
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
        f"  {'part':<40} {'pinned':>10} {'device':>10} {'seconds':>8} {'limit':>6}  --only",
    ]
    for part in planned["parts"]:
        lines.append(
            f"  {part['name']:<40} {format_size(part['pinned_bytes'], binary=True):>10} "
            f"{format_size(part['device_bytes']):>10} {part['seconds']:8.0f} "
            f"{part['timeout_s']:6d}  {part['key']}"
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


_present = bench.peer_installed


def _run(
    title: str,
    command: list[str],
    log: Path,
    env: dict | None = None,
    timeout: int | None = None,
) -> dict:
    """Run a command in a process group of its own, keep its output in ``log``, and report how it
    ended; past ``timeout`` seconds the whole group is killed and the step failed."""
    started = time.perf_counter()
    if log.is_symlink():  # planted: replaced, never written through
        log.unlink()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with open(fd, "w", encoding="utf-8") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its own group: what it starts is killed with it
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            code = None
        except BaseException:  # Ctrl-C: the part goes with gpu-check
            _kill_group(process)
            raise
    lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines() or [""]
    tail = re.sub(r"\x1b\[[0-9;]*m", "", lines[-1])[:90]
    return {
        "step": title,
        "ok": code == 0,
        "seconds": time.perf_counter() - started,
        "summary": tail if code is not None else f"timed out after {timeout} s",
        "log": str(log),
    }


def _kill_group(process: subprocess.Popen) -> None:
    """Kill ``process`` and everything in its process group, and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _pytest(
    title: str, args: list[str], log: Path, env: dict | None = None, timeout: int | None = None
) -> dict:
    """pytest on ``args``; a test (or a notebook's cell) past half the part's ``timeout`` fails
    alone, and the part is killed at ``timeout``."""
    limits = []
    if timeout is not None:
        each = max(30, timeout // 2)
        limits = [f"--timeout={each}", f"--nbval-cell-timeout={each}"]
    return _run(
        title,
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *limits, *args],
        log,
        env,
        timeout,
    )


def _write(path: Path, text: str) -> None:
    """A file of the run's folder, replaced whole: a link planted at its name is replaced, never
    written through."""
    files.write_atomically(path, text, replace=True, follow=False)


def _reference_name(prefix: str, gpu: str | None) -> str:
    return prefix + re.sub(r"[^A-Za-z0-9]+", "-", gpu or "unknown").strip("-").lower()


def _release_device_memory() -> None:
    """Between parts: what a part cached on the device goes back, so each starts from its plan."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    out: Path,
    quick: bool = True,
    disk: Path | None = None,
    only: str | None = None,
    isolate: bool = True,
) -> int:
    """The real run (see the module docstring), or with ``only`` that part alone; returns the
    exit status. ``isolate=False`` runs the probe and the benchmarks in this process (for tests
    that fake them), without their timeouts."""
    if only is not None:
        check_only(only)
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
    profile = devices.get("h200")  # planned seconds, hence timeouts, without a GPU
    if gpu:
        try:
            profile = profile_for(None)
        except ValueError as error:
            print(str(error).removeprefix("profile: "))
            return 2
    planned = plan(profile, quick, only=only)
    keys = [part["key"] for part in planned["parts"]]
    if gpu:
        _write(
            out / ("plan.json" if only is None else f"plan-{only}.json"),
            json.dumps(planned, indent=1),
        )
        print(format_plan(planned))
        if not planned["fits"]:
            print("the plan does not fit this machine: nothing was run")
            return 1
        if only == "bench-adam" and _present("deepspeed"):
            keys.insert(0, "peers")  # DeepSpeed's CPU Adam is built before it is timed
    else:
        skipped = [k for k in keys if k in GPU_ONLY]
        keys = [k for k in keys if k not in GPU_ONLY]
        print(
            "no CUDA GPU on this machine: running the CPU parts; "
            + (
                f"{', '.join(skipped)} skipped (they need one)"
                if only is not None
                else "the peers' build, the GPU tests, the GPU notebook run and the reference "
                "measurement are skipped"
            )
        )
    timeouts = {
        # without a GPU the plan describes no part of the work: a guard against a hang only
        part["key"]: part["timeout_s"] if gpu else NO_GPU_TIMEOUT
        for part in plan(profile, quick)["parts"]
    }
    steps = []
    for key in keys:
        _release_device_memory()
        step = _run_part(key, out.resolve(), quick, disk, timeouts[key], isolate)
        steps.append({**step, "part": key})
    _write_summary(out, steps, provenance, merge=only is not None)
    return 0 if all(s["ok"] for s in steps) else 1


def _write_summary(out: Path, steps: list[dict], provenance: dict, merge: bool) -> None:
    """summary.json, and the one-screen summary; one part at a time (``merge``), the parts run
    before into the same folder stay in it."""
    path = out / "summary.json"
    listed = steps
    if merge and path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))["steps"]
        except (ValueError, KeyError, TypeError):
            before = []
        ran = {s["part"] for s in steps}
        listed = [s for s in before if s.get("part") not in ran] + steps
        listed.sort(key=lambda s: list(PARTS).index(s["part"]) if s.get("part") in PARTS else 0)
    peers = {p: _present(p) for p in PEERS}
    summary = {"provenance": provenance, "steps": listed, "peers": peers}
    _write(path, json.dumps(summary, indent=1))
    _print_summary(summary)


_CHILD = "--run-one-part"  # how run() starts a part in a process of its own


def _run_part(key: str, out: Path, quick: bool, disk: Path | None, timeout: int, isolate: bool):
    """One part, killed at ``timeout`` seconds: pytest for the tests and notebooks, this module in
    a process of its own for the rest (its step read back from ``part-KEY.json``)."""
    title = PARTS[key]
    if key == "tests":
        return _pytest(title, ["-m", "gpu", "tests"], out / "gpu-tests.log", timeout=timeout)
    if key in ("book", "labs"):
        quick_env = {**os.environ, "OFFLOADLAB_QUICK": "1"}
        book, labs = _book_and_labs(ROOT)  # those whose code reaches a device
        paths = [str(path) for path in (book if key == "book" else labs)]
        return _pytest(f"{title} on the GPU", paths, out / f"{key}.log", quick_env, timeout)
    if not isolate:
        return _part_here(key, out, quick, disk)
    result_file = out / f"part-{key}.json"
    result_file.unlink(missing_ok=True)
    spec = {"key": key, "out": str(out), "quick": quick, "disk": str(disk) if disk else None}
    command = [sys.executable, str(Path(__file__).resolve()), _CHILD, json.dumps(spec)]
    ran = _run(title, command, out / f"{key}.log", timeout=timeout)
    if ran["ok"] and result_file.is_file():
        step = json.loads(result_file.read_text(encoding="utf-8"))
        return {**step, "seconds": ran["seconds"]}
    return {**ran, "ok": False}


def _child(argument: str) -> int:
    """The process of one part (see :func:`_run_part`): runs it, writes its step."""
    spec = json.loads(argument)
    out = Path(spec["out"])
    step = _part_here(spec["key"], out, spec["quick"], Path(spec["disk"]) if spec["disk"] else None)
    _write(out / f"part-{spec['key']}.json", json.dumps(step, indent=1))
    return 0


def _part_here(key: str, out: Path, quick: bool, disk: Path | None) -> dict:
    """The peers' build, the probe or one benchmark, in this process."""
    if key == "peers":
        return build_peers(require=_has_gpu())
    provenance = machine.provenance()
    if key == "probe":
        return _probe(out, quick, provenance, disk or out)
    return _bench(key.removeprefix("bench-"), out, quick, disk, provenance)


def _bench(name: str, out: Path, quick: bool, disk: Path | None, provenance: dict) -> dict:
    """One benchmark: its result in ``bench-NAME.json`` and, measured on a GPU, as reference
    data; one that fails is marked failed and is not reference data."""
    started = time.perf_counter()
    lock = cpu_adam_build_folder() / "lock"
    if name == "adam" and _present("deepspeed") and lock.exists():  # (without a GPU: no peers step)
        return {
            "step": f"bench {name}",
            "ok": False,
            "seconds": time.perf_counter() - started,
            "summary": f"a killed build left {lock}: delete it, then run again",
            "log": "",
        }
    try:
        if name == "nvme":
            result = bench.nvme(quick=quick, folder=disk or out)
        else:
            result = getattr(bench, name)(quick=quick)
    except Exception as error:
        return {
            "step": f"bench {name}",
            "ok": False,
            "seconds": time.perf_counter() - started,
            "summary": f"{type(error).__name__}: {error}"[:90],
            "log": "",
        }
    _write(out / f"bench-{name}.json", json.dumps(result, indent=1))
    if _has_gpu():
        reference.save(
            _reference_name(f"bench-{name}-", provenance["gpu"]),
            "measured",
            provenance["gpu"],
            provenance,
            [result],
            folder=reference.FOLDER,
            overwrite=True,
        )
    return {
        "step": f"bench {name} ({result['source']})",
        "ok": True,
        "seconds": time.perf_counter() - started,
        "summary": _headline(result),
        "log": str(out / f"bench-{name}.json"),
    }


# ----------------------------------------------------------------------------- the peers


def build_peers(require: bool = True) -> dict:
    """The peers' step: DeepSpeed's CPU Adam built (or loaded) and run once, so that no benchmark
    compiles it while it is timed. A ``lock`` left in its build folder by a killed build would
    make torch wait forever: it is reported with its path instead. With ``require`` (on a GPU) an
    absent peer fails the step: the comparison gpu-check exists for would not run."""
    started = time.perf_counter()

    def step(ok: bool, summary: str) -> dict:
        return {
            "step": PARTS["peers"],
            "ok": ok,
            "seconds": time.perf_counter() - started,
            "summary": summary,
            "log": "",
        }

    absent = [p for p in PEERS if not _present(p)]
    if require and absent:
        return step(False, f"absent: {', '.join(absent)}; install them: make gpu-env")
    if "deepspeed" in absent:
        return step(True, f"absent: {', '.join(absent)}")
    lock = cpu_adam_build_folder() / "lock"
    if lock.exists():
        return step(False, f"a killed build left {lock}: delete it, then run again")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its notices are not the result
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            weights = torch.zeros(16, requires_grad=True)
            weights.grad = torch.ones(16)
            DeepSpeedCPUAdam([weights], lr=1e-3, adamw_mode=True).step()
    except Exception as error:  # its extension failed to build or load
        lines = [line for line in str(error).splitlines() if line.strip()] or [""]
        return step(False, f"DeepSpeedCPUAdam: {type(error).__name__}: {lines[-1].strip()}"[:90])
    built = f"DeepSpeedCPUAdam ready ({time.perf_counter() - started:.0f} s)"
    return step(True, built + (f"; absent: {', '.join(absent)}" if absent else ""))


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
    _write(
        out / "probe.json",
        json.dumps(
            {
                "machine": measured["machine"].to_dict(),
                "ladder": ladder.of_machine(measured),
                "records": records,
                "faults": measured["faults"],
            },
            indent=1,
        ),
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


# ----------------------------------------------------------------------------- the command


def _command(args) -> int:
    if args.only is not None:
        with cli.arguments():
            check_only(args.only)
    if not args.dry_run:
        for flag, given in (("--profile", args.profile), ("--json", args.json)):
            if given is not None:
                raise cli.UsageError(
                    f"{flag}: only with --dry-run (the real run measures the GPU present)"
                )
        if args.disk is not None and not Path(args.disk).is_dir():
            raise cli.UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
        return run(
            Path(args.out),
            quick=not args.full,
            disk=Path(args.disk) if args.disk else None,
            only=args.only,
        )
    target = cli.output_target(args.json, args.force)
    with cli.arguments(profile="--profile"):
        profile = profile_for(args.profile)
    planned = plan(profile, quick=not args.full, only=args.only)
    text = cli.dumps(planned, indent=1) + "\n"
    return cli.show_and_save_json(format_plan(planned), text, target, args.force, "the plan")


def build_parser() -> cli.Parser:
    """The kit's command line, with the offloadlab command's error contract (cli.main)."""
    parser = cli.Parser(
        prog="tools/gpu_check.py",
        description="the GPU kit: every CUDA path, benchmarks and reference data (or, with "
        "--dry-run, its plan)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (memory and time of each part) and run nothing heavy; works without a "
        "GPU",
    )
    parser.add_argument(
        "--profile",
        help="with --dry-run: plan for this GPU instead of the one present: "
        "h100-sxm, h200, a100-40gb, l4 or rtx-4090",
    )
    parser.add_argument(
        "--only",
        metavar="PART",
        help="run (or plan) one part, each sized for a 10-minute command: peers, tests, book, "
        "labs, probe, bench-link, bench-overlap, bench-adam, bench-offload, bench-prefetch or "
        "bench-nvme",
    )
    parser.add_argument("--json", metavar="FILE", help="with --dry-run: write the plan to FILE")
    parser.add_argument("--force", action="store_true", help="replace an existing --json file")
    parser.add_argument(
        "--full", action="store_true", help="full-size benchmarks and probe (past 8 minutes)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="quick benchmarks and probe (the default)"
    )
    parser.add_argument(
        "--out",
        default="build/gpu-check",
        help="folder for the results and logs (default build/gpu-check)",
    )
    parser.add_argument(
        "--disk", metavar="DIR", help="folder for the NVMe bench's scratch files (default: --out)"
    )
    parser.set_defaults(run=_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parser=build_parser())


if __name__ == "__main__":
    if sys.argv[1:2] == [_CHILD]:
        sys.exit(_child(sys.argv[2]))
    sys.exit(main())
