"""Benchmarks: offloadlab's mechanisms against their peers, in one run, reported as ratios.

Wall-clock figures on shared machines are noisy; a ratio between two things measured
side by side in the same run is not. Each benchmark returns a dict with ``rows`` (one per
contender, with its figures) and ``ratios`` (named comparisons), plus provenance.

On a GPU each benchmark sizes its work from the GPU's :class:`~offloadlab.devices.DeviceProfile`
and then from what it measures, never beyond what its plan (``*_plan(profile)``, what
``offloadlab gpu-check --dry-run`` prints) allows: the plan's bytes come from datasheet peaks,
so the real, slower machine stays under them.
"""

from __future__ import annotations

from types import MappingProxyType
import contextlib
import functools
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import devices, experiment, machine, probe
from .devices import ASSUMED, Footprint
from .link import open_link
from .units import format_bandwidth, format_duration, format_size, parse_size

__all__ = [
    "link",
    "overlap",
    "adam",
    "offload",
    "prefetch",
    "nvme",
    "check_nvme_folder",
    "format_result",
    "link_plan",
    "overlap_plan",
    "adam_plan",
    "offload_plan",
    "prefetch_plan",
    "nvme_plan",
    "OVERLAP_CASES",
]

MiB = 2**20


def _plain_copy_bandwidth(nbytes: int, direction: str, repeats: int) -> float:
    """Median bytes/s of torch's ordinary blocking copy between pageable memory and the GPU."""
    host = torch.zeros(nbytes // 4)
    device = torch.empty(nbytes // 4, device="cuda")
    seconds = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if direction == "h2d":
            device.copy_(host)
        else:
            host.copy_(device)
        torch.cuda.synchronize()
        if i:
            seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds)


def link_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`link` asks of a GPU of ``profile``: the sweep's buffers, then both directions at
    once over two buffers of its largest size (at most twice that, pinned and on the device)."""
    sizes = probe.default_sizes_for(emulated=False, quick=quick)
    filler, repeats, top = probe.busy_filler_bytes(False), 3 if quick else 5, sizes[-1]
    pinned_rate = profile.link_bytes_per_s * ASSUMED["link_efficiency"]
    pageable_rate = profile.link_bytes_per_s * ASSUMED["pageable_efficiency"]
    sweep = sum(
        2 * ((repeats + 1) * size / rate + repeats * filler / pinned_rate)
        for size in sizes
        for rate in (pinned_rate, pageable_rate)
    )
    both = (repeats + 1) * top / pinned_rate
    plain = 2 * (repeats + 2) * top / pageable_rate
    return Footprint(
        max(top + filler, 2 * top),
        max(top + filler, 2 * top),
        sweep + both + plain + 2.0,
        f"a sweep of 4 KiB to {top >> 20} MiB each way, pinned and pageable, {repeats} repeats",
    )


def link(quick: bool = False) -> dict:
    """Pinned transfers on the link's copy engines against the nominal PCIe figure and a plain copy.

    On a GPU: the pinned asymptotic bandwidth (α–β fit of the size sweep) per direction as a
    fraction of NVML's nominal PCIe rate and as a multiple of torch's plain pageable copy. On
    the emulated link: achieved against configured bandwidth, and pinned against pageable. On
    both: the two directions at once, their sum over one direction alone (the duplex figure).
    """
    with open_link() as chosen:
        records = probe.link_sweep(chosen, quick=quick, repeats=3 if quick else 5)
        emulated = chosen.emulated
        configured = getattr(chosen, "bandwidth", None)
        largest = max(r.params["size"] for r in records)
        both = {
            r.params["direction"]: r.value
            for r in probe.bidirectional(chosen, largest, repeats=3 if quick else 5)
        }
    rows, ratios = [], {}
    nominal = machine.pcie_link().nominal_bytes_per_s if not emulated else None
    for direction in ("h2d", "d2h"):
        pinned = probe.fit_sweep(records, direction, pinned=True)
        pageable = probe.fit_sweep(records, direction, pinned=False)
        rows.append(
            {
                "contender": f"offloadlab pinned {direction}",
                "bytes_per_s": pinned.beta,
                "latency_s": pinned.alpha,
            }
        )
        rows.append(
            {
                "contender": f"offloadlab pageable {direction}",
                "bytes_per_s": pageable.beta,
                "latency_s": pageable.alpha,
            }
        )
        ratios[f"{direction} pinned / pageable"] = pinned.beta / pageable.beta
        rows.append(
            {
                "contender": f"offloadlab pinned {direction}, both directions at once",
                "bytes_per_s": both[direction],
            }
        )
        if emulated:
            ratios[f"{direction} pinned / configured emulated bandwidth"] = pinned.beta / configured
            continue
        plain = _plain_copy_bandwidth(largest, direction, repeats=3 if quick else 5)
        rows.append({"contender": f"torch plain pageable copy {direction}", "bytes_per_s": plain})
        ratios[f"{direction} pinned / torch plain copy"] = pinned.beta / plain
        if nominal:
            ratios[f"{direction} pinned / nominal PCIe"] = pinned.beta / nominal
        else:
            ratios[f"{direction} pinned / nominal PCIe"] = None
    one_way = {
        r["contender"].split()[-1]: r["bytes_per_s"]
        for r in rows
        if r["contender"].startswith("offloadlab pinned") and "," not in r["contender"]
    }
    ratios["both directions at once / one direction (duplex; 2.0 is full duplex)"] = (
        both["h2d"] + both["d2h"]
    ) / max(one_way["h2d"], one_way["d2h"])
    return {
        "benchmark": "link",
        "source": "emulated" if emulated else "measured",
        "rows": rows,
        "ratios": ratios,
        "provenance": machine.provenance(),
        "note": "" if emulated or nominal else "nominal PCIe rate unknown (NVML unavailable)",
    }


OVERLAP_CASES = (
    ("transfer hidden (¼ of compute)", 0.25),
    ("balanced (equal)", 1.0),
    ("bandwidth-bound (4× compute)", 4.0),
)
_CALIBRATION_BYTES = {True: 8 * MiB, False: 256 * MiB}  # by emulated


def _overlap_window(quick: bool) -> float:
    return experiment.WINDOW / 2 if quick else experiment.WINDOW


def overlap_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`overlap` asks of a GPU of ``profile``: the largest case's transfer (one pinned
    buffer and one device buffer serve all three), the products' memory, and its time."""
    window = _overlap_window(quick)
    largest = max(experiment.transfer_bytes(profile, 1.1 * f, window) for _, f in OVERLAP_CASES)
    buffers = max(largest, _CALIBRATION_BYTES[False])
    rate = profile.link_bytes_per_s * ASSUMED["link_efficiency"]

    # measure_overlap: warm-up, repeats, timeline
    def experiment_seconds(nbytes: int, repeats: int) -> float:
        compute = window  # (the run counts its products from their measured time)
        transfer = nbytes / rate
        both = max(compute, transfer)
        return both + repeats * (compute + transfer + both) + both

    repeats = 3 if quick else 5
    seconds = experiment_seconds(_CALIBRATION_BYTES[False], 1) + sum(
        experiment_seconds(experiment.transfer_bytes(profile, f, window), repeats)
        for _, f in OVERLAP_CASES
    )
    return Footprint(
        buffers,
        buffers + experiment.matmul_device_bytes(*experiment.GPU_SHAPE),
        seconds,
        f"transfers of ¼, 1 and 4 compute windows of {window * 1e3:.0f} ms over the nominal link, "
        f"in one pinned buffer",
    )


def overlap(quick: bool = False) -> dict:
    """Measured step over predicted step, max(compute, transfer), in three regimes.

    The transfer is sized to a quarter of, equal to, and four times the compute; a ratio near
    1.0 means the overlap model predicts the machine. On a GPU the compute is sized to a window of
    :data:`offloadlab.experiment.WINDOW` seconds (half of it with ``quick``) from the product's
    measured time, and no transfer exceeds what :func:`overlap_plan` allows.
    """
    with open_link() as chosen:
        if chosen.emulated:
            work, limit = (
                experiment.MatmulWork(
                    *experiment.EMULATED_SHAPE, 8 if quick else 16, chosen.device
                ),
                None,
            )
        else:
            profile = devices.present()
            work = experiment.overlap_work(chosen, _overlap_window(quick))
            limit = {
                f: experiment.transfer_bytes(profile, 1.1 * f, _overlap_window(quick))
                for _, f in OVERLAP_CASES
            }
        calibration = experiment.measure_overlap(
            chosen, _CALIBRATION_BYTES[chosen.emulated], work, 1
        )
        bandwidth = calibration.nbytes / calibration.t_transfer
        result_rows, ratios = [], {}
        # the largest first: the others reuse its buffers
        for name, factor in reversed(OVERLAP_CASES):
            nbytes = max(4096, int(factor * calibration.t_compute * bandwidth))
            if limit is not None:
                nbytes = min(nbytes, limit[factor])
            r = experiment.measure_overlap(chosen, nbytes, work, repeats=3 if quick else 5)
            result_rows.insert(0, {"contender": name, "factor": factor, **r.to_dict()})
            ratios[f"{name}: measured / predicted step"] = r.ratio
        ratios = dict(reversed(list(ratios.items())))
        source = "emulated" if chosen.emulated else "measured"
    return {
        "benchmark": "overlap",
        "source": source,
        "rows": result_rows,
        "ratios": ratios,
        "compute": {"rows": work.rows, "hidden": work.hidden, "products": work.count},
        "provenance": machine.provenance(),
    }


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _interleaved_samples(contenders: dict, repeats: int) -> dict:
    """Seconds of each run of each contender, timed in rounds that run every contender once,
    after a warm-up round: a slow spell of a shared machine then slows every contender alike."""
    samples = {name: [] for name in contenders}
    for round_ in range(repeats + 1):
        for name, step in contenders.items():
            start = time.perf_counter()
            step()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return samples


def cpu_adam_build_folder() -> Path:
    """Where torch builds DeepSpeed's CPU Adam (``torch.utils.cpp_extension.load`` of
    ``cpu_adam``): ``$TORCH_EXTENSIONS_DIR/cpu_adam``, or torch's default build root with this
    Python's and accelerator's folder."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / "cpu_adam"


def peer_installed(name: str) -> bool:
    """Whether the peer ``name`` (torchao, deepspeed, accelerate) can be imported here."""
    return importlib.util.find_spec(name) is not None


def stale_peer_build_lock() -> Path | None:
    """The ``lock`` a killed build of DeepSpeed's CPU Adam left in its build folder (torch would
    wait on it forever), or None: none there, or DeepSpeed absent."""
    if not peer_installed("deepspeed"):
        return None
    lock = cpu_adam_build_folder() / "lock"
    return lock if lock.exists() else None


def _deepspeed_step(weights):
    """DeepSpeedCPUAdam's step on ``weights``, or (None, why it is absent): its C++ extension is
    compiled at first use, which can fail long after the import succeeded."""
    try:
        # its import and build print notices: not the result
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam([weights], lr=1e-3, adamw_mode=True)
            optimizer.step()
    except ModuleNotFoundError:
        return None, "not installed: pip install deepspeed to compare"
    except Exception as error:  # its extension failed to build or load
        lines = [line for line in str(error).splitlines() if line.strip()] or [""]
        return None, f"{type(error).__name__}: {lines[-1].strip()}"
    return optimizer.step, ""


def _adam_params(quick: bool) -> int:
    return int(16e6 if quick else 64e6)


FLOOR_MARGIN = 1.05  # a contender this much faster than its floor shows the floor was not a floor
FLOOR_PASSES = 3  # floor passes per round: the floor is the best of them all
FLOOR_CACHE_MULTIPLE = 4  # the step's arrays, at least this many times the last-level cache


def adam_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`adam` asks: host memory only (ordinary, not pinned), bound by its bandwidth."""
    count = _adam_params(quick)
    # two variants, the same job, torch's two and the cast, DeepSpeed's two;
    contenders = 8 + 3 * FLOOR_PASSES
    step = 28 * count / ASSUMED["host_bandwidth"]  # and three floors
    # its CPU Adam may compile at first use
    deepspeed = 60.0 if importlib.util.find_spec("deepspeed") else 0.0
    return Footprint(
        0,
        0,
        contenders * ((3 if quick else 5) + 1) * step + deepspeed + 2.0,
        f"{count / 1e6:.0f} M parameters, every contender in interleaved rounds"
        + ("; DeepSpeed's CPU Adam may compile at first use (60 s assumed)" if deepspeed else ""),
    )


# What each contender reads and writes: (gradient dtype, dtype of the weights' copy, or None).
_BF16_IN_OUT, _FP32_IN, _FP32_IN_BF16_OUT = (
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, None),
    (torch.float32, torch.bfloat16),
)
_FLOOR_NAMES = {
    _BF16_IN_OUT: "bf16 gradients in, bf16 weights out",
    _FP32_IN: "fp32 gradients in, no copy",
    _FP32_IN_BF16_OUT: "fp32 gradients in, bf16 weights out",
}


def floor_verdict(
    seconds: dict, floors: dict, streams: dict, array_bytes: int, cache_bytes: int | None
) -> str:
    """Why the floors of :func:`adam` are not floors, or '' when they are.

    ``seconds``: each contender's median; ``floors``: seconds of the floor of each kind of streams;
    ``streams``: each contender's kind. Not floors: arrays that fit in a few last-level caches
    (``cache_bytes``), or a contender faster than its floor by more than :data:`FLOOR_MARGIN`.
    """
    if cache_bytes is not None and array_bytes < FLOOR_CACHE_MULTIPLE * cache_bytes:
        return (
            f"the step's arrays ({array_bytes / 2**20:.0f} MiB) are less than "
            f"{FLOOR_CACHE_MULTIPLE}× the last-level cache ({cache_bytes / 2**20:.0f} MiB): give "
            "more parameters"
        )
    beaten = [
        (name, floors[streams[name]] / value)
        for name, value in seconds.items()
        if floors[streams[name]] / value > FLOOR_MARGIN
    ]
    if beaten:
        name, factor = max(beaten, key=lambda item: item[1])
        return (
            f"{name} ran at {100 * factor:.0f} % of its floor (over {100 * FLOOR_MARGIN:.0f} %): "
            f"the floor passes were slowed, or the arrays were in cache"
        )
    return ""


def adam(quick: bool = False, params: float | None = None, threads: int | None = None) -> dict:
    """The CPU AdamW step against its peers and the memory-bandwidth floor, same threads, one run.

    offloadlab's fused step (bf16 gradients in, bf16 weights out: 28 B/param) in the best
    variant this CPU runs and in the portable baseline, against torch AdamW foreach and fused
    (fp32 gradients, 28 B/param) and fused followed by a separate bf16 cast; and, when it is
    installed and its extension builds, DeepSpeedCPUAdam (its own OpenMP threads) alone and
    followed by the cast. The peers' steps alone do not make the bf16 copy, so offloadlab's step
    doing their job (fp32 gradients, no copy) is timed as well. All are timed round-robin.

    The floor, STREAM's way: :func:`offloadlab.cpu_adam.floor_pass`, the kernel's own loop with
    AdamW's arithmetic taken out, compiled in the kernel's build, on arrays as large as the
    step's, with the same threads, in the same rounds — best of all its passes. There is one
    floor per kind of streams the contenders move (bf16 in and out; fp32 in; fp32 in and bf16
    out), and each contender is set against its own. Floors are not printed when they are not
    floors (see :func:`floor_verdict`): ``floor`` in the result then says why.
    """
    from . import cpu_adam

    count = int(params or _adam_params(quick))
    threads = threads or torch.get_num_threads()
    repeats = 3 if quick else 5
    kernel = cpu_adam.load()
    # the best this CPU runs (or the one OFFLOADLAB_CPU_ADAM_VARIANT names)
    variants = [kernel.variant]
    if kernel.compiled and kernel.library.runnable[-1] != kernel.variant:
        # the portable one, for CPUs without wider instructions
        variants.append(kernel.library.runnable[-1])
    labels = {
        variant: f"offloadlab fused step, {variant} variant"
        if variant != cpu_adam.TORCH
        else "offloadlab step, torch fallback"
        for variant in variants
    }
    same_job = f"offloadlab step, {variants[0]}, fp32 gradients, no copy"
    master, m, v = torch.randn(count), torch.zeros(count), torch.zeros(count)
    grad, out16 = torch.randn(count).to(torch.bfloat16), torch.empty(count, dtype=torch.bfloat16)
    weights = torch.randn(count, requires_grad=True)
    weights.grad = torch.randn(count)
    steps = iter(range(1, 10**9))
    contenders, streams = {}, {}
    for variant in variants:
        contenders[labels[variant]] = lambda variant=variant: cpu_adam.adamw_step(
            master, m, v, grad, out16, step=next(steps), lr=1e-3, threads=threads, variant=variant
        )
        streams[labels[variant]] = _BF16_IN_OUT
    contenders[same_job] = lambda: cpu_adam.adamw_step(
        master, m, v, weights.grad, step=next(steps), lr=1e-3, threads=threads, variant=variants[0]
    )
    foreach = torch.optim.AdamW([weights], lr=1e-3, foreach=True)
    fused = torch.optim.AdamW([weights], lr=1e-3, fused=True)
    contenders["torch AdamW foreach"] = foreach.step
    contenders["torch AdamW fused"] = fused.step
    contenders["torch AdamW fused + bf16 cast"] = lambda: (
        fused.step(),
        out16.copy_(weights.detach()),
    )
    deepspeed, deepspeed_absent = _deepspeed_step(weights)
    if deepspeed:
        contenders["DeepSpeedCPUAdam"] = deepspeed
        contenders["DeepSpeedCPUAdam + bf16 cast"] = lambda: (
            deepspeed(),
            out16.copy_(weights.detach()),
        )
    for name in contenders:
        streams.setdefault(name, _FP32_IN_BF16_OUT if name.endswith("bf16 cast") else _FP32_IN)
    timed = dict(contenders)
    if kernel.compiled:  # the floors: arrays of their own, the kernel's loop without the arithmetic
        floor_arrays = [torch.zeros(count) for _ in range(3)]
        inputs = {
            torch.bfloat16: torch.zeros(count, dtype=torch.bfloat16),
            torch.float32: torch.zeros(count),
        }
        for kind in _FLOOR_NAMES:
            grad_dtype, out_dtype = kind
            floor_out = None if out_dtype is None else torch.empty(count, dtype=out_dtype)
            for k in range(FLOOR_PASSES):
                timed[("floor", kind, k)] = functools.partial(
                    cpu_adam.floor_pass,
                    *floor_arrays,
                    inputs[grad_dtype],
                    floor_out,
                    threads=threads,
                    variant=variants[0],
                )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        samples = _interleaved_samples(timed, repeats)
    finally:
        torch.set_num_threads(previous)
    seconds = {name: statistics.median(samples[name]) for name in contenders}
    floors = (
        {
            kind: min(
                t for key, values in samples.items() if key[:2] == ("floor", kind) for t in values
            )
            for kind in _FLOOR_NAMES
        }
        if kernel.compiled
        else {}
    )
    array_bytes = cpu_adam.bytes_per_param() * count
    cache = machine.last_level_cache_bytes()
    why = (
        floor_verdict(seconds, floors, streams, array_bytes, cache)
        if kernel.compiled
        else f"no compiled kernel, whose loop the floor is ({kernel.describe()})"
    )
    rows = []
    for name, value in seconds.items():
        moved = cpu_adam.bytes_per_param(*streams[name]) * count
        row = {
            "contender": name,
            "seconds": value,
            "params_per_s": count / value,
            "bytes_per_s": moved / value,
        }
        if not why:
            row["percent_of_floor"] = 100 * floors[streams[name]] / value
        rows.append(row)
    ours = seconds[labels[variants[0]]]
    baseline = seconds[labels[variants[1]]] if len(variants) > 1 else None
    cast = seconds["torch AdamW fused + bf16 cast"]
    ratios = {
        "offloadlab step / bandwidth floor (target ≤ 1.10)": None
        if why
        else ours / floors[_BF16_IN_OUT],
        "fused + cast / offloadlab step (target ≥ 1.5)": cast / ours,
        "fused + cast / offloadlab baseline step (target ≥ 1.0)": cast / baseline
        if baseline
        else None,
        "DeepSpeedCPUAdam + cast / offloadlab step (target ≥ 1.0)": seconds[
            "DeepSpeedCPUAdam + bf16 cast"
        ]
        / ours
        if deepspeed
        else None,
        "DeepSpeedCPUAdam / offloadlab step, same job (target ≥ 1.0)": seconds["DeepSpeedCPUAdam"]
        / seconds[same_job]
        if deepspeed
        else None,
    }
    floor = {
        "valid": not why,
        "why_not": why,
        "passes": FLOOR_PASSES * repeats,
        "last_level_cache_bytes": cache,
        "array_bytes": array_bytes,
        "kinds": [
            {
                "streams": _FLOOR_NAMES[kind],
                "seconds": floors[kind],
                "bytes_per_s": cpu_adam.bytes_per_param(*kind) * count / floors[kind],
            }
            for kind in floors
        ],
    }
    return {
        "benchmark": "adam",
        "source": "measured",
        "rows": rows,
        "ratios": ratios,
        "params": count,
        "threads": threads,
        "floor": floor,
        "backend": cpu_adam.backend(),
        "provenance": machine.provenance(),
        "note": "" if deepspeed else f"DeepSpeedCPUAdam: absent ({deepspeed_absent})",
    }


# step over AdamW's, emulated link
OFFLOAD_TARGETS = MappingProxyType({"at step": 1.30, "delayed": 1.15, "fast link": 2.00})
# CPUOffloadAdam's traffic per step and parameter, in the parameters' element size: chapter 4's
# arithmetic (the gradient down, the new weight up, pinned only what the engines copy) with 5 %
# for the bytes that say whether weights were changed by hand
TRAFFIC_TARGETS = MappingProxyType(
    {"h2d": 1.05, "d2h": 1.05, "pinned": 2.25, "pinned, delayed update": 3.25}
)


def traffic_per_step(before: dict, after: dict, steps: int, params: int, link) -> dict:
    """A link's traffic between two :attr:`~offloadlab.link.Link.traffic` snapshots, per step
    and parameter (bytes), host synchronisations per step, and the pinned bytes it holds per
    parameter."""
    spent = {k: after[k] - before[k] for k in after}
    return {
        "h2d_bytes_per_param": spent["h2d_bytes"] / (steps * params),
        "d2h_bytes_per_param": spent["d2h_bytes"] / (steps * params),
        "copies_per_step": (spent["h2d_copies"] + spent["d2h_copies"]) / steps,
        "host_syncs_per_step": spent["syncs"] / steps,
        "host_syncs_in_backward": spent["syncs_in_backward"] / steps,
        "pinned_bytes_per_param": link.pinned_bytes / params,
    }


def traffic_verdict(traffic: dict, element_bytes: int, delayed: bool) -> list[str]:
    """What of ``traffic`` misses :data:`TRAFFIC_TARGETS` (an empty list: nothing)."""
    pinned = TRAFFIC_TARGETS["pinned, delayed update" if delayed else "pinned"]
    limits = {
        "h2d_bytes_per_param": TRAFFIC_TARGETS["h2d"] * element_bytes,
        "d2h_bytes_per_param": TRAFFIC_TARGETS["d2h"] * element_bytes,
        "pinned_bytes_per_param": pinned * element_bytes,
        "host_syncs_in_backward": 0,
    }
    return [
        f"{name} {traffic[name]:.3g} > {limit:.3g}"
        for name, limit in limits.items()
        if traffic[name] > limit
    ]


def _offload_models(gpu: bool) -> list[tuple]:
    """(name, config, batch) of the two models :func:`offload` trains: a small GPT, and a deep
    narrow decoder of 400 tensors (33 layers of two norms, four projections and their biases, the
    embeddings and the final norm), as many small tensors as a real decoder has (Llama-3.1-8B:
    291)."""
    from .models import GPTConfig

    if gpu:
        return [
            ("TinyGPT", GPTConfig(layers=8, hidden=1024, heads=16, vocab=8192, seq=512), 8),
            ("400 tensors", GPTConfig(layers=33, hidden=512, heads=8, vocab=8192, seq=256), 8),
        ]
    return [
        ("TinyGPT", GPTConfig(layers=2, hidden=256, heads=4, vocab=1024, seq=64), 4),
        ("400 tensors", GPTConfig(layers=33, hidden=64, heads=4, vocab=256, seq=32), 2),
    ]


def _offload_rounds(gpu: bool, quick: bool) -> tuple[int, int]:
    """(rounds, timed steps per contender and round) of :func:`offload`."""
    return (7, 2) if quick else (11, 3)


def _offload_contenders(torchao: bool) -> int:
    """How many contenders keep their state in pinned memory at once (one model's)."""
    # at step, eager, delayed; the fast link's (emulated only); torchao's (GPU only)
    return 4 + torchao


def offload_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`offload` asks of a GPU of ``profile``, model by model (each model's contenders
    are alive at once, the models one after the other): every offloaded contender's pinned
    buffers (4 bytes per parameter with bf16 weights: the landing gradients and the outgoing
    weights; master and moments are not pinned), and on the device every contender's bf16
    weights, AdamW's gradients and moments, each offloaded contender's gather and staging buffers
    and its check of weights changed by hand (a bucket joined end to end and widened to int64:
    5 buckets' bytes), and the saved activations of one step."""
    from .models import saved_activation_bytes
    from .offload.optimizer import DEFAULT_BUCKET_BYTES

    rounds, per_round = _offload_rounds(True, quick)
    torchao = importlib.util.find_spec("torchao") is not None
    offloaded = _offload_contenders(torchao) - 1  # (no fast link on a GPU)
    pinned, device, seconds = 0, 0, 0.0
    for _, config, batch in _offload_models(True):
        params = config.params
        activations = saved_activation_bytes(config, batch, torch.bfloat16)
        flops = 6 * params * batch * config.seq  # forward and backward
        device_step = flops / (profile.bf16_flops * ASSUMED["matmul_efficiency"])
        # the CPU update's traffic
        offloaded_step = max(device_step, 28 * params / ASSUMED["host_bandwidth"])
        build = 3.0  # a fresh model, and for the offloaded ones its pinned state
        steps = rounds * (1 + per_round)
        seconds += (2 + offloaded) * build + steps * (2 * device_step + offloaded * offloaded_step)
        pinned = max(pinned, offloaded * 4 * params)
        device = max(
            device,
            (2 + offloaded) * 2 * params
            + 6 * params
            + offloaded * (3 + 5) * DEFAULT_BUCKET_BYTES
            + activations,
        )
    # the sweep, on the first model, its contenders alive at once: a model each (2 bytes a
    # parameter), offloaded in place at each fraction and at 16 micro-batches (4 bytes a
    # parameter pinned, as above; (1 − F) of the 12 bytes of state kept on the device, 2.5 × 12
    # over the five fractions), parked at 1 and 16 (12 pinned, three device slots of a bucket's
    # state), and AdamW at both (16 bytes a parameter); a step is an AdamW step per micro-batch
    _, config, batch = _offload_models(True)[0]
    params = config.params
    flops = 6 * params * batch * config.seq
    device_step = flops / (profile.bf16_flops * ASSUMED["matmul_efficiency"])
    in_place, parked = len(SHARE_FRACTIONS) + 1, len(PARKED_MICRO_BATCHES)
    micro = len(SHARE_FRACTIONS) + 2 + 3 * max(PARKED_MICRO_BATCHES)
    # (a contender here is the small model alone: built and its state pinned in about 1.5 s)
    seconds += (in_place + parked + 2) * 1.5 + rounds * (1 + per_round) * micro * device_step
    pinned = max(pinned, (4 * in_place + 12 * parked) * params)
    bucket = min(params, DEFAULT_BUCKET_BYTES // 2)  # parameters of a bf16 bucket
    kept = sum(1 - f for f in SHARE_FRACTIONS) * 12 * params
    device = max(
        device,
        (in_place + parked + 2) * 2 * params
        + 2 * 16 * params
        + kept
        + parked * 3 * 12 * bucket
        + in_place * (3 + 5) * DEFAULT_BUCKET_BYTES
        + saved_activation_bytes(config, batch, torch.bfloat16),
    )
    models = " and ".join(
        f"{name} of {config.params / 1e6:.0f} M parameters"
        for name, config, _ in _offload_models(True)
    )
    return Footprint(
        pinned,
        device,
        seconds,
        f"{models}, {rounds} rounds of {1 + per_round} steps per "
        f"contender, then the fraction sweep and parking on the first; activations counted on "
        f"the meta device",
    )


def _offload_rounds_timed(
    runs: dict, rounds: int, per_round: int, threads: int, device: str, micro: dict | None = None
) -> dict:
    """{contender: [seconds of each timed step, round by round]}: ``rounds`` rounds in which every
    contender of ``runs`` ({name: (model, optimizer or None, batches)}) takes 1 + ``per_round``
    steps in a row, each of ``micro[name]`` micro-batches (default 1)."""
    seconds = {name: [[] for _ in range(rounds)] for name in runs}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for round_ in range(rounds):
            for name, (model, optimizer, data) in runs.items():
                for step in range(1 + per_round):
                    batch = [next(data) for _ in range((micro or {}).get(name, 1))]
                    start = time.perf_counter()
                    (optimizer or model).zero_grad()
                    for inputs, labels in batch:
                        (model(inputs.to(device), labels.to(device)) / len(batch)).backward()
                    if optimizer is not None:
                        optimizer.step()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if step:
                        seconds[name][round_].append(time.perf_counter() - start)
                if hasattr(optimizer, "synchronize"):
                    # (a delayed update: applied now, not in the next contender's turn)
                    optimizer.synchronize()
    finally:
        torch.set_num_threads(previous)
    return seconds


SHARE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
PARKED_MICRO_BATCHES = (1, 16)


def _predicted_share(optimizer, micro_batches: int) -> dict:
    """Chapter 4's and 6's arithmetic for ``optimizer`` (a CPUOffloadAdam) at ``micro_batches`` a
    step: bytes each way per step (in place: the offloaded share's weights up, a gradient down per
    micro-batch; parked: its fp32 state up and down once) and the device bytes its state holds."""
    from .offload.device_update import SLOTS

    engine = optimizer._engine
    element = torch.tensor([], dtype=optimizer.dtype).element_size()
    in_place = sum(b.numel for b in engine.host.buckets)
    up = down = 0
    device = 0
    for part in engine.on_device:
        state = 4 * part.parts  # fp32 master (unless the weights are fp32) and two moments
        if part.parked:
            up += state * part.numel
            slots = min(SLOTS, len(part.buckets))
            device += slots * state * max(b.numel for b in part.buckets)
        else:
            device += state * part.numel
    down = up + micro_batches * element * in_place
    up += element * in_place
    return {"h2d_bytes": up, "d2h_bytes": down, "device_bytes": device}


def _offload_setting() -> tuple[bool, str, torch.dtype, int]:
    """(GPU present, device, weights' dtype, torch and OpenMP threads) of the offload benchmarks:
    bf16 on a GPU, fp32 on CPUs (whose bf16 matmuls are emulated, slowly), a core left to the
    emulated link's copies."""
    gpu = torch.cuda.is_available()
    threads = torch.get_num_threads() if gpu else max(1, torch.get_num_threads() - 1)
    return gpu, "cuda" if gpu else "cpu", torch.bfloat16 if gpu else torch.float32, threads


def share_sweep(quick: bool = False, parking: bool = True) -> tuple[list, dict]:
    """Rows and ratios of the fraction sweep (offload_fraction over :data:`SHARE_FRACTIONS`, one
    micro-batch a step) and, with ``parking``, of parking against updating in place at
    :data:`PARKED_MICRO_BATCHES`, on the first model of :func:`_offload_models`; each against
    AdamW on the device at the same micro-batches, in paired rounds. Predicted beside measured:
    link bytes per step and the optimizer's device bytes (the arithmetic), and the step,
    proportional between the measured ends (F = 0 and 1: what a share would cost if its part were
    neither hidden nor overlapped)."""
    from .models import TinyGPT, batches, markov_corpus
    from .offload import CPUOffloadAdam

    gpu, device, dtype, threads = _offload_setting()
    _, config, batch = _offload_models(gpu)[0]
    rounds, per_round = _offload_rounds(gpu, quick)
    adamw = "AdamW on the device"
    contenders, micro = {}, {}
    for k in PARKED_MICRO_BATCHES if parking else (1,):
        at = f", {k} micro-batches" if k > 1 else ""
        contenders[adamw + at] = (k, lambda m: torch.optim.AdamW(m.parameters()))
        for f in SHARE_FRACTIONS if k == 1 else (1.0,):
            contenders[f"offload_fraction={f:g}{at}"] = (
                k,
                lambda m, f=f: CPUOffloadAdam(m.parameters(), threads=threads, offload_fraction=f),
            )
        if parking:
            contenders[f"parked{at}"] = (
                k,
                lambda m: CPUOffloadAdam(m.parameters(), threads=threads, update_on="device"),
            )
    runs, ledgers, rows, ratios = {}, {}, [], {}
    try:
        for name, (k, make) in contenders.items():
            torch.manual_seed(0)
            model = TinyGPT(config).to(device, dtype)
            optimizer = make(model)
            runs[name], micro[name] = (
                (model, optimizer, batches(markov_corpus(config.vocab, 50_000), batch, config.seq)),
                k,
            )
            if isinstance(optimizer, CPUOffloadAdam):
                ledgers[name] = optimizer.link.traffic.snapshot()
        seconds = _offload_rounds_timed(runs, rounds, per_round, threads, device, micro)
        steps = rounds * (1 + per_round)
        in_round = {
            name: [statistics.median(one) for one in rounds_] for name, rounds_ in seconds.items()
        }
        for name, (model, optimizer, _) in runs.items():
            k = micro[name]
            row = {
                "contender": name,
                "share": True,
                "micro_batches": k,
                "params": config.params,
                "seconds": statistics.median(s for one in seconds[name] for s in one),
            }
            if isinstance(optimizer, CPUOffloadAdam):
                after = optimizer.link.traffic.snapshot()
                row.update(
                    offload_fraction=optimizer.offload_fraction,
                    update_on=optimizer.update_on,
                    measured={
                        "h2d_bytes": (after["h2d_bytes"] - ledgers[name]["h2d_bytes"]) / steps,
                        "d2h_bytes": (after["d2h_bytes"] - ledgers[name]["d2h_bytes"]) / steps,
                        "device_bytes": sum(optimizer.device_bytes().values()),
                    },
                    predicted=_predicted_share(optimizer, k),
                )
                reference = adamw + (f", {k} micro-batches" if k > 1 else "")
                row["ratio_to_adamw"] = ratios[f"sweep: {name} / {reference}"] = statistics.median(
                    mine / theirs for mine, theirs in zip(in_round[name], in_round[reference])
                )
            rows.append(row)
    finally:
        for _, optimizer, _ in runs.values():
            if hasattr(optimizer, "close"):
                optimizer.close()
    swept = [r for r in rows if r.get("update_on") == "cpu" and r["micro_batches"] == 1]
    ends = {r["offload_fraction"]: r["seconds"] for r in swept}
    for row in swept:
        f = row["offload_fraction"]
        row["predicted"]["seconds"] = ends[0.0] + f * (ends[1.0] - ends[0.0])
    return rows, ratios


def offload(quick: bool = False) -> dict:
    """Step time under CPUOffloadAdam (at step(), eager, delayed update) against plain AdamW on the
    device and torchao's CPUOffloadOptimizer when installed, on two models: a small GPT, and a deep
    narrow decoder of 400 small tensors, where what each tensor costs shows.

    Like with like: every contender runs with the same torch threads, and CPUOffloadAdam's CPU
    update with as many OpenMP threads (without a GPU the "device" is those same cores). Each
    model also runs forward and backward alone: a contender's overhead per tensor is its step
    minus that, over the model's tensors. On the emulated link, the 400-tensor model also runs
    CPUOffloadAdam over a 1 TB/s link without latency, where little but that overhead is left.

    A model's contenders are timed in rounds, each contender a few steps in a row in every round
    (the first untimed: the one where a delayed update has nothing pending yet), so that a slow
    spell of a shared machine slows them all alike. A step time shown is the median of a
    contender's timed steps; a ratio is the median over rounds of the two contenders' ratio in
    the same round (a shared machine's speed drifts by a third within a minute: pairing the
    rounds takes that drift out of the ratio).
    Targets (emulated link, default rate): at step ≤ 1.30× AdamW's step, delayed ≤ 1.15×, and
    ≤ 2× on the fast link.

    Then the two other answers to a slow link, on the small GPT (:func:`share_sweep`): a share of
    the optimizer offloaded (``offload_fraction`` 0, ¼, ½, ¾, 1) and its state parked, at one
    micro-batch a step and at sixteen, each beside AdamW at the same micro-batches.
    """
    from .link import EmulatedLink
    from .models import TinyGPT, batches, markov_corpus
    from .offload import CPUOffloadAdam

    gpu, device, dtype, threads = _offload_setting()
    rounds, per_round = _offload_rounds(gpu, quick)
    alone, adamw, fast = (
        "forward and backward alone",
        "AdamW on the device",
        "CPUOffloadAdam (update at step), 1 TB/s link, no latency",
    )
    contenders = {
        alone: lambda m: None,
        adamw: lambda m: torch.optim.AdamW(m.parameters()),
        "CPUOffloadAdam (update at step)": lambda m: CPUOffloadAdam(
            m.parameters(), threads=threads
        ),
        "CPUOffloadAdam, eager (accumulation_steps=1)": lambda m: CPUOffloadAdam(
            m.parameters(), threads=threads, accumulation_steps=1
        ),
        "CPUOffloadAdam, delayed update": lambda m: CPUOffloadAdam(
            m.parameters(), threads=threads, delayed_update=True
        ),
    }
    targets = {
        "CPUOffloadAdam (update at step)": "at step",
        "CPUOffloadAdam, delayed update": "delayed",
        fast: "fast link",
    }
    note = (
        f"every contender: {threads} torch threads; CPUOffloadAdam's CPU update: {threads} OpenMP "
        f"threads; {rounds} rounds × {per_round} timed steps; ratios: median over rounds of the "
        f"ratio within a round"
    )
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception:
        note += "; torchao CPUOffloadOptimizer: absent (pip install torchao to compare)"
    else:
        if gpu:
            contenders["torchao CPUOffloadOptimizer"] = lambda m: CPUOffloadOptimizer(
                m.parameters(), torch.optim.AdamW, fused=True
            )
        else:
            note += "; torchao CPUOffloadOptimizer: needs a GPU"
    if gpu:
        note += "; the 1 TB/s link is the emulated one's: not run on a GPU"
    rows, ratios, misses = [], {}, []
    element_bytes = torch.tensor([], dtype=dtype).element_size()
    for model_name, config, batch in _offload_models(gpu):
        mine, fast_link = dict(contenders), None
        if not gpu and model_name == "400 tensors":
            fast_link = EmulatedLink(bandwidth=1e12, latency=0)
            mine[fast] = lambda m: CPUOffloadAdam(m.parameters(), threads=threads, link=fast_link)
        runs, traffic = {}, {}
        try:
            for name, make in mine.items():
                torch.manual_seed(0)
                model = TinyGPT(config).to(device, dtype)
                runs[name] = (
                    model,
                    make(model),
                    batches(markov_corpus(config.vocab, 50_000), batch, config.seq),
                )
            ledgers = {
                name: optimizer.link.traffic.snapshot()
                for name, (_, optimizer, _) in runs.items()
                if isinstance(optimizer, CPUOffloadAdam)
            }
            seconds = _offload_rounds_timed(runs, rounds, per_round, threads, device)
            for name, before in ledgers.items():
                link = runs[name][1].link
                traffic[name] = traffic_per_step(
                    before, link.traffic.snapshot(), rounds * (1 + per_round), config.params, link
                )
        finally:
            for _, optimizer, _ in runs.values():
                if hasattr(optimizer, "close"):
                    optimizer.close()
            if fast_link is not None:
                fast_link.close()
        median = {
            name: statistics.median(s for one in rounds_ for s in one)
            for name, rounds_ in seconds.items()
        }
        # a contender's ratio to AdamW: the median over rounds of their ratio within each round
        in_round = {
            name: [statistics.median(one) for one in rounds_] for name, rounds_ in seconds.items()
        }
        tensors = len(list(runs[alone][0].parameters()))
        for name, value in median.items():
            row = {
                "contender": name,
                "model": model_name,
                "tensors": tensors,
                "params": config.params,
                "seconds": value,
            }
            if name != alone:
                row["overhead_per_tensor_s"] = (value - median[alone]) / tensors
            if name in traffic:
                row["element_bytes"] = element_bytes
                row["traffic"] = traffic[name]
                missed = traffic_verdict(traffic[name], element_bytes, "delayed" in name)
                misses += [f"{model_name}, {name}: {miss}" for miss in missed]
            rows.append(row)
            if name not in (alone, adamw):
                target = targets.get(name)
                label = f"{model_name}: {name} / {adamw}"
                if target and not gpu:
                    label += f" (target ≤ {OFFLOAD_TARGETS[target]:.2f})"
                ratios[label] = statistics.median(
                    mine / theirs for mine, theirs in zip(in_round[name], in_round[adamw])
                )
    share_rows, share_ratios = share_sweep(quick)
    rows += share_rows
    ratios.update(share_ratios)
    return {
        "benchmark": "offload",
        "source": "measured" if gpu else "emulated",
        "rows": rows,
        "ratios": ratios,
        "params": {name: config.params for name, config, _ in _offload_models(gpu)},
        "traffic_targets": dict(TRAFFIC_TARGETS),
        "traffic_missed": misses,
        "provenance": machine.provenance(),
        "note": note,
    }


PREFETCH_LAYERS = 8
# each layer's compute over its transfer: double buffering can then hide the copy
PREFETCH_COMPUTE_RATIO = 2.0
_PREFETCH_LAYER_BYTES = {True: 4 * MiB, False: 64 * MiB}  # by emulated
_PREFETCH_HIDDEN = 2048  # on a GPU: (rows × 2048) @ (2048 × 2048) products, rows sized to the link
# products that last one layer's transfer: compute is counted in quarters of it
_PRODUCTS_PER_TRANSFER = 4


def fsdp(quick: bool = False) -> dict:
    """FSDP2 on two processes with the optimizer on the device (torch's AdamW), FSDP2's
    ``CPUOffloadPolicy``, and :class:`~offloadlab.offload.CPUOffloadAdam` on each rank's shard (at
    step and delayed): each on its own copy of lab 8's TinyGPT, in rounds that take turns in a
    rotating order on the same batches; step time and its ratio to AdamW's within each round (the
    median over rounds), and each rank's link bytes per step beside the arithmetic (its shard's
    elements × the weights' bytes, each way)."""
    import tempfile

    from . import fsdp_offload

    gpus = torch.cuda.device_count()
    processes, rounds, per_round = 2, (3 if quick else 8), (2 if quick else 4)
    with tempfile.TemporaryDirectory() as scratch:
        record = fsdp_offload.launch_compare(
            processes, rounds, per_round, out=Path(scratch) / "compare.json"
        )
    seconds = record["seconds"]
    element = 2 if record["bf16"] else 4
    rows = []
    for name, description in fsdp_offload.OPTIMIZERS.items():
        row = {
            "contender": name,
            "fsdp": True,
            "description": description,
            "seconds": statistics.median(seconds[name]),
            "ratio_to_adamw": statistics.median(
                mine / theirs for mine, theirs in zip(seconds[name], seconds["adamw"])
            ),
        }
        if name in record["ranks"][0]["traffic"]:
            row["ranks"] = [
                {
                    "h2d_bytes": rank["traffic"][name]["h2d_bytes"],
                    "d2h_bytes": rank["traffic"][name]["d2h_bytes"],
                    "predicted_each_way": rank["shard_elements"] * element,
                    "syncs_in_backward": rank["traffic"][name]["syncs_in_backward"],
                    "threads": rank["threads"][name],
                    "optimizer": rank["optimizers"][name],
                }
                for rank in record["ranks"]
            ]
        rows.append(row)
    gpu = gpus >= processes
    return {
        "benchmark": "fsdp",
        "source": "measured" if gpu else "emulated",
        "rows": rows,
        "ratios": {f"fsdp: {row['contender']} / adamw": row["ratio_to_adamw"] for row in rows[1:]},
        "params": record["params"],
        "provenance": machine.provenance(),
        "note": (
            f"TinyGPT of {record['params'] / 1e6:.2f} M parameters (lab 8's), global batch 8, on "
            f"{processes} {record['backend']} processes; {rounds} rounds × {per_round} steps of "
            "each, timed to the last update landed; ratios: median over rounds of the ratio within "
            "a round"
            + (
                ""
                if gpu
                else "; without two GPUs the device is this CPU: AdamW 'on the device' and "
                "CPUOffloadPolicy both run here, and the link is emulated"
            )
        ),
    }


def prefetch_shape(profile: devices.DeviceProfile) -> tuple[int, int, int]:
    """(rows, hidden, products per layer) of a layer's compute on ``profile``: products about a
    quarter of a layer's transfer long at the datasheet rate, as many as make the compute twice the
    transfer — so that the real GPU, whose rate is lower, still rounds to a ratio near 2."""
    transfer = _PREFETCH_LAYER_BYTES[False] / profile.link_bytes_per_s
    rate = profile.matmul_flops(torch.float32)
    hidden = _PREFETCH_HIDDEN
    rows = max(
        64, round(transfer / _PRODUCTS_PER_TRANSFER * rate / (2 * hidden * hidden) / 64) * 64
    )
    per_product = 2 * rows * hidden * hidden / rate
    return rows, hidden, max(1, round(PREFETCH_COMPUTE_RATIO * transfer / per_product))


ACTIVATION_CONTENDERS = (
    "keep",
    "save_on_cpu",
    "offload_activations",
    "recompute every block",
)


def _activation_model(gpu: bool):
    """(config, batch) of :func:`activations`: the small GPT of the offload benchmark, with a
    batch whose saved tensors outweigh its weights (on a GPU its own; the CPU's small model gets
    four times its batch)."""
    _, config, batch = _offload_models(gpu)[0]
    return config, batch if gpu else 4 * batch


def activations_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`activations` asks of a GPU of ``profile``: the model's weights, gradients and
    its saved activations of one step (kept: the largest case), and pinned memory for them three
    times over (the pool of offload_activations, and save_on_cpu's pinned copies, which torch's
    caching allocator rounds up to a power of two)."""
    from .models import saved_activation_bytes

    config, batch = _activation_model(True)
    saved = saved_activation_bytes(config, batch, torch.bfloat16)
    rounds, per_round = _offload_rounds(True, quick)
    flops = 8 * config.params * batch * config.seq  # forward, backward and a recomputation
    step = flops / (profile.bf16_flops * ASSUMED["matmul_efficiency"])
    transfer = 2 * saved / (profile.link_bytes_per_s * ASSUMED["link_efficiency"])
    steps = rounds * (1 + per_round) * len(ACTIVATION_CONTENDERS)
    return Footprint(
        3 * saved,
        4 * config.params + 2 * saved,
        steps * (step + transfer) + 10.0,
        f"TinyGPT of {config.params / 1e6:.0f} M parameters, batch {batch}: "
        f"{format_size(saved)} of saved activations a step",
    )


TIMELINES = ("activations",)  # the benchmarks whose result holds a "timeline" for Perfetto


def _pass_timeline(link, marks, recording) -> dict:
    """{lane: [(start_s, end_s, label)]} of one forward and backward: the compute between the
    three ``marks`` and every copy ``recording`` holds, on the link's clock (for Perfetto)."""
    link.synchronize()
    start, forward_done, backward_done = (mark.time for mark in marks)
    return {
        "compute": [(start, forward_done, "forward"), (forward_done, backward_done, "backward")],
        **recording.lanes(),
    }


def activations(quick: bool = False) -> dict:
    """Keeping activations, ``torch.autograd.graph.save_on_cpu``, :func:`offload_activations`
    and recomputing every block (``torch.utils.checkpoint``), on the same model and batches, in
    paired rounds (forward and backward; no optimizer): step time and its ratio to keeping, the
    saved bytes left on the device by forward (as saved, in the last step; on a GPU, the peak
    memory too), and the link's bytes each way beside the prediction (every saved tensor of at
    least ``min_bytes``, down once and up once), and the timeline of one more offloaded step
    (``timeline``: compute and both directions' copies, for :func:`~offloadlab.trace.chrome_trace`).
    """
    import torch.utils.checkpoint

    from .activations import DEFAULT_MIN_BYTES, ActivationOffload
    from .models import TinyGPT, batches, markov_corpus

    gpu, device, dtype, threads = _offload_setting()
    config, batch = _activation_model(gpu)
    rounds, per_round = _offload_rounds(gpu, quick)
    min_bytes = DEFAULT_MIN_BYTES if gpu else 64 * 2**10
    link = open_link()
    torch.manual_seed(0)
    model = TinyGPT(config).to(device, dtype)
    data = batches(markov_corpus(config.vocab, 50_000), batch, config.seq)
    offload = ActivationOffload(link, min_bytes=min_bytes)
    held: dict = {}

    def counted(name):
        """Saved tensors' bytes left on the device once forward is done, by storage."""
        storages: dict = {}

        def pack(t):
            if t.device.type == device:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), storages

    def forward(name, inputs, labels):
        if name == "keep":
            hooks, storages = counted(name)
            with hooks:
                loss = model(inputs, labels)
            held[name] = sum(storages.values())
            return loss
        if name == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=gpu):
                return model(inputs, labels)
        if name == "offload_activations":
            kept = offload.kept_bytes
            with offload:
                loss = model(inputs, labels)
            held[name] = offload.kept_bytes - kept
            return loss
        originals = [block.forward for block in model.blocks]
        hooks, storages = counted(name)
        try:
            for block, original in zip(model.blocks, originals):
                block.forward = functools.partial(
                    torch.utils.checkpoint.checkpoint, original, use_reentrant=False
                )
            with hooks:
                loss = model(inputs, labels)
            held[name] = sum(storages.values())
            return loss
        finally:
            for block, original in zip(model.blocks, originals):
                block.forward = original

    seconds = {name: [[] for _ in range(rounds)] for name in ACTIVATION_CONTENDERS}
    peaks: dict = {}
    before = link.traffic.snapshot()
    offloaded_before = offload.offloaded_bytes
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for round_ in range(rounds):
            for name in ACTIVATION_CONTENDERS:
                for step in range(1 + per_round):
                    inputs, labels = (t.to(device) for t in next(data))
                    model.zero_grad(set_to_none=True)
                    if gpu:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    forward(name, inputs, labels).backward()
                    if gpu:
                        torch.cuda.synchronize()
                        peaks[name] = torch.cuda.max_memory_allocated() - base
                    if step:
                        seconds[name][round_].append(time.perf_counter() - start)
        after = link.traffic.snapshot()
        offloaded_after = offload.offloaded_bytes
        # one more step of the overlapped offload, untimed, recorded for Perfetto
        inputs, labels = (t.to(device) for t in next(data))
        model.zero_grad(set_to_none=True)
        with link.record() as recording:
            marks = [link.mark()]
            loss = forward("offload_activations", inputs, labels)
            marks.append(link.mark())
            loss.backward()
            marks.append(link.mark())
        timeline = _pass_timeline(link, marks, recording)
    finally:
        torch.set_num_threads(previous)
        offload.close()
        link.close()
    steps = rounds * (1 + per_round)
    moved = {d: (after[f"{d}_bytes"] - before[f"{d}_bytes"]) / steps for d in ("d2h", "h2d")}
    offloaded = (offloaded_after - offloaded_before) / steps
    in_round = {
        name: [statistics.median(one) for one in rounds_] for name, rounds_ in seconds.items()
    }
    rows = []
    for name in ACTIVATION_CONTENDERS:
        row = {
            "contender": name,
            "activations": True,
            "seconds": statistics.median(s for one in seconds[name] for s in one),
        }
        if name in peaks:
            row["device_peak_bytes"] = peaks[name]
        if name in held:
            row["saved_on_device_bytes"] = held[name]
        if name == "offload_activations":
            row["link"] = {
                "d2h_bytes": moved["d2h"],
                "h2d_bytes": moved["h2d"],
                "predicted_each_way": offloaded,
            }
        rows.append(row)
    ratios = {
        f"activations: {name} / keep": statistics.median(
            mine / theirs for mine, theirs in zip(in_round[name], in_round["keep"])
        )
        for name in ACTIVATION_CONTENDERS
        if name != "keep"
    }
    return {
        "benchmark": "activations",
        "source": "measured" if gpu else "emulated",
        "rows": rows,
        "ratios": ratios,
        "timeline": timeline,
        "params": config.params,
        "provenance": machine.provenance(),
        "note": (
            f"TinyGPT of {config.params / 1e6:.1f} M parameters, batch {batch}; saved tensors of "
            f"{format_size(min_bytes)} and more offloaded; {rounds} rounds × {per_round} timed "
            f"steps; ratios: median over rounds of the ratio within a round"
            + (
                ""
                if gpu
                else "; without a GPU the device is this CPU: save_on_cpu copies within it"
            )
        ),
    }


def prefetch_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`prefetch` asks of a GPU of ``profile`` (with Accelerate's comparison, when
    installed)."""
    layer = _PREFETCH_LAYER_BYTES[False]
    sweep = probe.default_sizes_for(emulated=False, quick=True)[-1] + probe.busy_filler_bytes(False)
    rows, hidden, count = prefetch_shape(profile)
    # the pinned weights (the pageable copies are ordinary memory)
    streaming = PREFETCH_LAYERS * layer
    # its Linear stack, streamed from pinned memory by StreamedModel
    accelerate = 16 * 4096 * 4096 * 4
    # (the weights live through the sweep and the comparison)
    pinned = streaming + max(sweep, accelerate)
    device = max(
        sweep,
        2 * layer + experiment.matmul_device_bytes(rows, hidden),
        2 * 4096 * 4096 * 4 + 3 * 4096 * 4096 * 4,
    )
    transfer = PREFETCH_LAYERS * layer / (profile.link_bytes_per_s * ASSUMED["link_efficiency"])
    compute = PREFETCH_COMPUTE_RATIO * transfer
    # four variants: a warm-up and five passes each; compute alone thrice
    passes = 4 * (1 + 5) + 2 * 3
    return Footprint(
        pinned,
        device,
        passes * (compute + transfer) + 10.0,
        f"{PREFETCH_LAYERS} layers of {layer >> 20} MiB, each computing {count} products of "
        f"{rows}×{hidden} (twice its transfer at the datasheet rates)",
    )


def prefetch(quick: bool = False) -> dict:
    """Layer streaming per variant: step time over max(compute, transfer), and link utilisation.

    Eight layers of weights in pinned host memory stream through a prefetcher while each
    layer's compute (twice its transfer: counted from the measured product and transfer times)
    is launched on the device's compute stream; the pageable variant streams ordinary copies of
    the same weights. On a GPU the products' shape comes from :func:`prefetch_shape` (quarter-
    transfer products, so the ratio can be met to within an eighth), and also a Linear stack
    under Accelerate's ``cpu_offload`` is set against the same stack under
    :class:`~offloadlab.streaming.StreamedModel`.
    """
    from .prefetch import Prefetcher

    layers = PREFETCH_LAYERS
    with open_link() as chosen:
        gpu = not chosen.emulated
        layer_bytes = _PREFETCH_LAYER_BYTES[chosen.emulated]
        weights = [chosen.host_buffer(layer_bytes // 4).normal_() for _ in range(layers)]
        pageable = [w.clone() for w in weights]
        peak = probe.fit_sweep(
            probe.link_sweep(chosen, directions=("h2d",), pinned=(True,), quick=True, repeats=3)
        ).beta
        t_layer_transfer = layer_bytes / peak
        rows_, hidden, _ = (
            prefetch_shape(devices.present()) if gpu else (*experiment.EMULATED_SHAPE, None)
        )

        def on_device(work, count=1) -> float:
            """Seconds of ``count`` launches of ``work`` on the compute stream, on the link's
            clock."""
            begin = chosen.mark()
            for _ in range(count):
                chosen.launch(work)
            end = chosen.mark()
            return end.time - begin.time

        probe_work = experiment.MatmulWork(rows_, hidden, 16, chosen.device)
        on_device(probe_work)  # warm-up: cuBLAS picks its kernel
        per_product = statistics.median(on_device(probe_work) for _ in range(3)) / 16
        count = max(1, round(PREFETCH_COMPUTE_RATIO * t_layer_transfer / per_product))
        work = probe_work.with_count(count)

        def one_pass(prefetcher) -> float:
            begin = chosen.mark()
            for _ in prefetcher:
                chosen.launch(work)
            end = chosen.mark()
            chosen.synchronize()
            return end.time - begin.time

        compute_alone = statistics.median(on_device(work, layers) for _ in range(3))
        transfer_alone = layers * t_layer_transfer
        bound = max(compute_alone, transfer_alone)
        result_rows, ratios = [], {}
        for name, sources, variant in (
            ("double buffered", weights, {}),
            ("one buffer", weights, {"buffers": 1}),
            ("pageable source", pageable, {"pinned": False}),
            ("synchronous copy", weights, {"synchronous": True}),
        ):
            prefetcher = Prefetcher(sources, chosen, **variant)
            one_pass(prefetcher)  # warm-up
            before, passes = chosen.traffic.snapshot(), 5
            seconds = statistics.median(one_pass(prefetcher) for _ in range(passes))
            spent = {k: v - before[k] for k, v in chosen.traffic.snapshot().items()}
            copies = prefetcher.timeline()["H2D"]
            busy = sum(end - start for start, end, _ in copies)
            result_rows.append(
                {
                    "contender": name,
                    "seconds": seconds,
                    "ratio_to_bound": seconds / bound,
                    "link_percent_of_peak": 100 * layers * layer_bytes / busy / peak,
                    # per pass: bytes over the weights' bytes (1: each weight up once), waits
                    "traffic": {
                        "h2d_bytes_per_weight_byte": spent["h2d_bytes"]
                        / (passes * layers * layer_bytes),
                        "d2h_bytes_per_weight_byte": spent["d2h_bytes"]
                        / (passes * layers * layer_bytes),
                        "host_syncs_per_pass": spent["syncs"] / passes,
                        "pinned_staging_bytes": prefetcher.host_staging_bytes,
                    },
                }
            )
            ratios[
                f"{name}: step / max(compute, transfer) (target ≤ 1.10 double buffered)"
                if name == "double buffered"
                else f"{name}: step / max(compute, transfer)"
            ] = seconds / bound
        by_name = {r["contender"]: r["seconds"] for r in result_rows}
        ratios["synchronous / double buffered (target ≥ 1.4; ideal 1.5)"] = (
            by_name["synchronous copy"] / by_name["double buffered"]
        )
        ratios["double buffered: link bandwidth / pinned peak (GPU target ≥ 0.90)"] = (
            result_rows[0]["link_percent_of_peak"] / 100
        )
        ratios["compute / transfer per layer (aimed at 2)"] = compute_alone / transfer_alone
        source = "measured" if gpu else "emulated"
    note = "median of 5 passes per variant"
    try:
        import accelerate  # noqa: F401
    except ImportError:
        note += "; Accelerate cpu_offload: absent (pip install accelerate to compare)"
    else:
        if gpu:
            ratios.update(_accelerate_comparison(quick))
        else:
            note += "; Accelerate cpu_offload: needs a GPU"
    return {
        "benchmark": "prefetch",
        "source": source,
        "rows": result_rows,
        "ratios": ratios,
        "compute_seconds": compute_alone,
        "transfer_seconds": transfer_alone,
        "peak_bytes_per_s": peak,
        "compute": {"rows": rows_, "hidden": hidden, "products_per_layer": count},
        "provenance": machine.provenance(),
        "note": note,
    }


def _accelerate_comparison(quick: bool) -> dict:
    """Forward of a Linear stack under Accelerate's cpu_offload against StreamedModel (GPU)."""
    from accelerate import cpu_offload
    from torch import nn

    from .link import CudaLink
    from .streaming import StreamedModel

    def stack():
        torch.manual_seed(0)
        model = nn.Module()
        model.blocks = nn.ModuleList(nn.Linear(4096, 4096) for _ in range(16))
        model.forward = lambda x: [x := block(x) for block in model.blocks][-1]
        return model

    x = torch.randn(4096, 4096, device="cuda")
    theirs = cpu_offload(stack(), execution_device=torch.device("cuda"))
    with torch.no_grad():
        t_theirs = _median_seconds(lambda: (theirs(x), torch.cuda.synchronize()), 3 if quick else 5)
    with CudaLink() as cuda:
        ours = stack()
        StreamedModel(ours, cuda)
        with torch.no_grad():
            t_ours = _median_seconds(lambda: (ours(x), torch.cuda.synchronize()), 3 if quick else 5)
    return {"Accelerate cpu_offload / StreamedModel (forward)": t_theirs / t_ours}


NVME_DEPTHS = (1, 4, 16)


def _nvme_bytes(quick: bool, nbytes=None) -> int:
    """Bytes of fp32 state bench nvme moves each way: a whole number of 1 MiB blocks."""
    size = int(parse_size(nbytes or ("256 MiB" if quick else "1 GiB"), "nbytes"))
    if size < 2**20:
        raise ValueError(f"nbytes: expected at least 1 MiB; got {nbytes!r}")
    return size - size % 2**20


def nvme_plan(profile: devices.DeviceProfile | None = None, quick: bool = False) -> Footprint:
    """What :func:`nvme` asks: no pinned or device memory; time bound by the disk (see
    :data:`ASSUMED`)."""
    size, repeats = _nvme_bytes(quick), 2 if quick else 3
    # per depth: both tiers' two slots written once, then per repeat each tier writes and reads and
    # the probe writes twice (untimed, then timed) and reads, at that depth and at its own
    moved = len(NVME_DEPTHS) * size * (4 + repeats * 10)
    return Footprint(
        0,
        0,
        moved / ASSUMED["disk_bandwidth"] + 2.0,
        f"{size >> 20} MiB of state at queue depths {', '.join(map(str, NVME_DEPTHS))}, "
        f"{moved / 1e9:.0f} GB of disk traffic",
    )


def check_nvme_folder(folder=".", quick: bool = False, nbytes=None) -> None:
    """Refuse a folder bench nvme could not finish in, before it starts: ValueError for a missing
    folder, OSError for a read-only one or one without room for two tiers (two slots each) and a
    probe file."""
    probe.check_disk_folder(folder, 5 * _nvme_bytes(quick, nbytes))


def nvme(quick: bool = False, folder=".", nbytes=None) -> dict:
    """Optimizer state through the NVMe tier at queue depths 1, 4 and 16, against raw direct I/O.

    Per depth, in one run and interleaved: the tier writes a step of fp32 state (all blocks, then
    the commit with its syncs and header) and reads it back, with crc32 checksums and without; the
    probe writes and reads a file of the same size in the same 1 MiB blocks at the same depth, with
    none of that. All use O_DIRECT where the file system allows it. Both of a tier's slots are
    written before timing, so the figures are its steady state (a first write into reserved space
    also pays the file system's allocation). Ratios: the checksummed tier at its best depth
    against the probe's own rate (``offloadlab probe``: depth 1, 4 MiB blocks; target ≥ 0.80 each
    way), and its I/O time over the raw I/O time at the same depth — what crash safety costs
    (target ≤ 1.10), split into the commit protocol and the checksums.
    """
    from .nvme import FileTier, aligned_empty

    size = _nvme_bytes(quick, nbytes)
    check_nvme_folder(folder, quick, size)
    repeats = 2 if quick else 3
    state = aligned_empty(size // 4)
    state.normal_()
    kinds = {"raw": "raw direct I/O", "plain": "FileTier, no checksums", "tier": "FileTier, crc32"}
    seconds = {
        (kind, way, depth): []
        for kind in kinds
        for way in ("write", "read")
        for depth in NVME_DEPTHS
    }
    probed = {"write": [], "read": []}  # what `offloadlab probe` reports: depth 1, 4 MiB blocks
    direct = True
    for depth in NVME_DEPTHS:
        with (
            FileTier.temporary(folder, state.numel(), queue_depth=depth) as tier,
            FileTier.temporary(folder, state.numel(), queue_depth=depth, checksums=False) as plain,
        ):
            direct = direct and tier.direct and plain.direct
            for each in (tier, plain):
                for _ in range(2):  # both slots once: the steady state a training run lives in
                    each.write(0, state)
                    each.commit()
            for _ in range(repeats):
                for kind, each in (("tier", tier), ("plain", plain)):
                    start = time.perf_counter()
                    each.write(0, state)
                    each.commit()
                    seconds[kind, "write", depth].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    each.read(0, state)
                    seconds[kind, "read", depth].append(time.perf_counter() - start)
                write, read = probe.disk_bandwidth(folder, size, block="1 MiB", queue_depth=depth)
                seconds["raw", "write", depth].append(write.params["median_seconds"])
                seconds["raw", "read", depth].append(read.params["median_seconds"])
                write, read = probe.disk_bandwidth(folder, size)
                probed["write"].append(write.value)
                probed["read"].append(read.value)
    median = {key: statistics.median(values) for key, values in seconds.items()}
    baseline = {way: statistics.median(values) for way, values in probed.items()}
    rows = [
        {"contender": f"probe {way}, depth 1, 4 MiB blocks", "bytes_per_s": baseline[way]}
        for way in ("write", "read")
    ]
    rows += [
        {
            "contender": f"{name} {way}, depth {depth}",
            "bytes_per_s": size / median[kind, way, depth],
            "queue_depth": depth,
        }
        for depth in NVME_DEPTHS
        for kind, name in kinds.items()
        for way in ("write", "read")
    ]

    def io_time(kind, depth):
        return median[kind, "write", depth] + median[kind, "read", depth]

    ratios = {}
    for way in ("write", "read"):
        best = min(NVME_DEPTHS, key=lambda d: median["tier", way, d])
        ratios[f"tier {way} at its best depth ({best}) / probe {way} (target ≥ 0.80)"] = (
            size / median["tier", way, best] / baseline[way]
        )
    best = min(NVME_DEPTHS, key=lambda d: io_time("tier", d))
    ratios[
        f"tier I/O time / raw I/O time at depth {best}: crash-safety overhead (target ≤ 1.10)"
    ] = io_time("tier", best) / io_time("raw", best)
    ratios[f"commit protocol alone: no-checksum tier / raw at depth {best}"] = io_time(
        "plain", best
    ) / io_time("raw", best)
    ratios[f"checksums alone: crc32 tier / no-checksum tier at depth {best}"] = io_time(
        "tier", best
    ) / io_time("plain", best)
    for way in ("write", "read"):
        ratios[f"tier {way}: depth 16 / depth 1"] = median["tier", way, 1] / median["tier", way, 16]
    return {
        "benchmark": "nvme",
        "source": "measured",
        "rows": rows,
        "ratios": ratios,
        "bytes": size,
        "folder": str(machine.disk(folder).path),
        "provenance": machine.provenance(),
        "note": ""
        if direct
        else "O_DIRECT refused by this file system: the page cache may serve these rates",
    }


def format_result(result: dict) -> str:
    """A short plain-text report of a benchmark result."""
    lines = [f"benchmark {result['benchmark']} ({result['source']})"]
    for row in result["rows"]:
        if "params_per_s" in row:
            of_floor = (
                f"  {row['percent_of_floor']:5.1f}% of floor" if "percent_of_floor" in row else ""
            )
            lines.append(
                f"  {row['contender']:<58} {row['seconds'] * 1e3:8.1f} ms  "
                f"{row['params_per_s'] / 1e9:5.2f} G params/s  "
                f"{format_bandwidth(row['bytes_per_s']):>10}{of_floor}"
            )
        elif "ratio_to_bound" in row:
            t = row["traffic"]
            lines.append(
                f"  {row['contender']:<22} {format_duration(row['seconds']):>10}  "
                f"{row['ratio_to_bound']:.2f}× max(compute, transfer)  "
                f"link {row['link_percent_of_peak']:.0f}% of pinned peak  "
                f"{t['h2d_bytes_per_weight_byte']:.2f}× the weights up, "
                f"{t['host_syncs_per_pass']:.0f} host waits a pass"
            )
        elif "activations" in row:
            extra = []
            if "device_peak_bytes" in row:
                extra.append(f"device peak {format_size(row['device_peak_bytes'])}")
            if "saved_on_device_bytes" in row:
                extra.append(f"saved on the device {format_size(row['saved_on_device_bytes'])}")
            if "link" in row:
                link_row = row["link"]
                extra.append(
                    f"link {format_size(link_row['d2h_bytes'])} down, "
                    f"{format_size(link_row['h2d_bytes'])} up (predicted "
                    f"{format_size(link_row['predicted_each_way'])} each way)"
                )
            lines.append(
                f"  {row['contender']:<24} {format_duration(row['seconds']):>10} per step  "
                + "; ".join(extra)
            )
        elif "fsdp" in row:
            lines.append(
                f"  {row['contender']:<20} {format_duration(row['seconds']):>10} per step  "
                f"{row['ratio_to_adamw']:.2f}× AdamW   {row['description']}"
            )
            for rank, moved in enumerate(row.get("ranks", [])):
                lines.append(
                    f"  {'':<20} rank {rank}: {format_size(moved['d2h_bytes'])} down, "
                    f"{format_size(moved['h2d_bytes'])} up a step (its shard: "
                    f"{format_size(moved['predicted_each_way'])} each way); "
                    f"{moved['syncs_in_backward']:.0f} waits inside backward; "
                    f"{moved['threads']} CPU thread" + "s" * (moved["threads"] > 1)
                )
        elif "share" in row:
            if "measured" not in row:
                lines.append(
                    f"  {'sweep:':<12} {row['contender']:<58} "
                    f"{format_duration(row['seconds']):>10} per step"
                )
                continue
            measured, predicted = row["measured"], row["predicted"]
            proportional = (
                f" (proportional {format_duration(predicted['seconds'])})"
                if "seconds" in predicted
                else ""
            )
            lines.append(
                f"  {'sweep:':<12} {row['contender']:<58} "
                f"{format_duration(row['seconds']):>10} per step{proportional}, "
                f"{row['ratio_to_adamw']:.2f}× AdamW"
            )
            lines.append(
                f"  {'':<12}   per step: {format_size(measured['h2d_bytes'])} up, "
                f"{format_size(measured['d2h_bytes'])} down (predicted "
                f"{format_size(predicted['h2d_bytes'])}, {format_size(predicted['d2h_bytes'])}); "
                f"device {format_size(measured['device_bytes'])} (predicted "
                f"{format_size(predicted['device_bytes'])})"
            )
        elif "model" in row:
            overhead = (
                f"  {row['overhead_per_tensor_s'] * 1e6:+7.1f} µs per tensor"
                if "overhead_per_tensor_s" in row
                else ""
            )
            lines.append(
                f"  {row['model'] + ':':<12} {row['contender']:<58} "
                f"{format_duration(row['seconds']):>10} per step{overhead}"
            )
            if "traffic" in row:
                t = row["traffic"]
                lines.append(
                    f"  {'':<12}   per parameter and step: {t['h2d_bytes_per_param']:.3f} B up, "
                    f"{t['d2h_bytes_per_param']:.3f} B down ({row['element_bytes']} B weights); "
                    f"{t['pinned_bytes_per_param']:.2f} B pinned; host syncs "
                    f"{t['host_syncs_per_step']:.1f} a step, {t['host_syncs_in_backward']:.1f} "
                    f"in backward"
                )
        elif "t_compute_s" not in row and "seconds" in row:
            lines.append(f"  {row['contender']:<40} {format_duration(row['seconds']):>10} per step")
        elif "bytes_per_s" in row:
            extra = f"  latency {row['latency_s'] * 1e6:.0f} µs" if "latency_s" in row else ""
            lines.append(
                f"  {row['contender']:<40} {format_bandwidth(row['bytes_per_s']):>12}{extra}"
            )
        else:
            lines.append(
                f"  {row['contender']:<40} compute {format_duration(row['t_compute_s'])}, transfer "
                f"{format_duration(row['t_transfer_s'])}, both {format_duration(row['t_both_s'])}"
            )
    floor = result.get("floor")
    if floor and floor["valid"]:
        lines += [
            f"  floor, {kind['streams']:<52} {kind['seconds'] * 1e3:8.1f} ms  best of "
            f"{floor['passes']} passes  {format_bandwidth(kind['bytes_per_s']):>10}"
            for kind in floor["kinds"]
        ]
    elif floor:
        lines.append(f"  floor not valid, so not shown: {floor['why_not']}")
    if "traffic_missed" in result:
        missed = result["traffic_missed"]
        lines.append(
            "  traffic: every CPUOffloadAdam row within its targets"
            if not missed
            else "  traffic over target: " + "; ".join(missed)
        )
    if "timeline" in result:
        lanes = result["timeline"]
        (_, forward_done, _), (_, backward_done, _) = lanes["compute"]
        start = lanes["compute"][0][0]
        lines.append(
            f"  timeline of one offloaded step: forward {format_duration(forward_done - start)}, "
            f"backward {format_duration(backward_done - forward_done)}; "
            f"{len(lanes['D2H'])} copies down, {len(lanes['H2D'])} up (--trace FILE for Perfetto)"
        )
    lines.append("  ratios:")
    for name, value in result["ratios"].items():
        lines.append(f"    {name:<60} {'unknown' if value is None else f'{value:.2f}×'}")
    if result.get("note"):
        lines.append(f"  note: {result['note']}")
    return "\n".join(lines)
