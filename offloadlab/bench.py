"""Benchmarks: offloadlab's mechanisms against their peers, in one run, reported as ratios.

Wall-clock figures on shared machines are noisy; a ratio between two things measured
side by side in the same run is not. Each benchmark returns a dict with ``rows`` (one per
contender, with its figures) and ``ratios`` (named comparisons), plus provenance.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time

import torch

from . import experiment, machine, probe
from .link import open_link
from .units import format_bandwidth, format_duration, parse_size

__all__ = ["link", "overlap", "adam", "offload", "prefetch", "nvme", "check_nvme_folder", "format_result"]


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
        both = {r.params["direction"]: r.value for r in probe.bidirectional(chosen, largest, repeats=3 if quick else 5)}
    rows, ratios = [], {}
    nominal = machine.pcie_link().nominal_bytes_per_s if not emulated else None
    for direction in ("h2d", "d2h"):
        pinned = probe.fit_sweep(records, direction, pinned=True)
        pageable = probe.fit_sweep(records, direction, pinned=False)
        rows.append({"contender": f"offloadlab pinned {direction}", "bytes_per_s": pinned.beta,
                     "latency_s": pinned.alpha})
        rows.append({"contender": f"offloadlab pageable {direction}", "bytes_per_s": pageable.beta,
                     "latency_s": pageable.alpha})
        ratios[f"{direction} pinned / pageable"] = pinned.beta / pageable.beta
        rows.append({"contender": f"offloadlab pinned {direction}, both directions at once",
                     "bytes_per_s": both[direction]})
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
    one_way = {r["contender"].split()[-1]: r["bytes_per_s"] for r in rows if r["contender"].startswith(
        "offloadlab pinned") and "," not in r["contender"]}
    ratios["both directions at once / one direction (duplex; 2.0 is full duplex)"] = \
        (both["h2d"] + both["d2h"]) / max(one_way["h2d"], one_way["d2h"])
    return {"benchmark": "link", "source": "emulated" if emulated else "measured", "rows": rows,
            "ratios": ratios, "provenance": machine.provenance(),
            "note": "" if emulated or nominal else "nominal PCIe rate unknown (NVML unavailable)"}


def overlap(quick: bool = False) -> dict:
    """Measured step over predicted step, max(compute, transfer), in three regimes.

    The transfer is sized to a quarter of, equal to, and four times the compute; a ratio near
    1.0 means the overlap model predicts the machine.
    """
    with open_link() as chosen:
        rows, hidden = (256, 512) if chosen.emulated else (8192, 8192)
        work = experiment.MatmulWork(rows, hidden, 8 if quick else 16, chosen.device)
        calibration = experiment.measure_overlap(chosen, "8 MiB" if chosen.emulated else "256 MiB", work, 1)
        bandwidth = calibration.nbytes / calibration.t_transfer
        result_rows, ratios = [], {}
        for name, factor in (("transfer hidden (¼ of compute)", 0.25), ("balanced (equal)", 1.0),
                             ("bandwidth-bound (4× compute)", 4.0)):
            nbytes = max(4096, int(factor * calibration.t_compute * bandwidth))
            r = experiment.measure_overlap(chosen, nbytes, work, repeats=3 if quick else 5)
            result_rows.append({"contender": name, **r.to_dict()})
            ratios[f"{name}: measured / predicted step"] = r.ratio
        source = "emulated" if chosen.emulated else "measured"
    return {"benchmark": "overlap", "source": source, "rows": result_rows, "ratios": ratios,
            "provenance": machine.provenance()}


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _interleaved_medians(contenders: dict, repeats: int) -> dict:
    """Median seconds of each contender, timed in rounds that run every contender once, after a
    warm-up round: a slow spell of a shared machine then slows every contender alike."""
    samples = {name: [] for name in contenders}
    for round_ in range(repeats + 1):
        for name, step in contenders.items():
            start = time.perf_counter()
            step()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _deepspeed_step(weights):
    """DeepSpeedCPUAdam's step on ``weights``, or (None, why it is absent): its C++ extension is
    compiled at first use, which can fail long after the import succeeded."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import and build print notices: not the result
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam([weights], lr=1e-3, adamw_mode=True)
            optimizer.step()
    except ModuleNotFoundError:
        return None, "not installed: pip install deepspeed to compare"
    except Exception as error:  # its extension failed to build or load
        lines = [line for line in str(error).splitlines() if line.strip()] or [""]
        return None, f"{type(error).__name__}: {lines[-1].strip()}"
    return optimizer.step, ""


def adam(quick: bool = False, params: float | None = None, threads: int | None = None) -> dict:
    """The CPU AdamW step against its peers and the memory-bandwidth floor, same threads, one run.

    offloadlab's fused step (bf16 gradients in, bf16 weights out: 28 B/param) in the best
    variant this CPU runs and in the portable baseline, against torch AdamW foreach and fused
    (fp32 gradients, 28 B/param) and fused followed by a separate bf16 cast; and, when it is
    installed and its extension builds, DeepSpeedCPUAdam (its own OpenMP threads) alone and
    followed by the cast. The peers' steps alone do not make the bf16 copy, so offloadlab's step
    doing their job (fp32 gradients, no copy) is timed as well. The floor is the bytes the step
    must move over the bandwidth of an in-place update ``a += b`` timed in the same rounds, with
    the same threads. All contenders are timed round-robin.
    """
    from . import cpu_adam

    count = int(params or (16e6 if quick else 64e6))
    threads = threads or torch.get_num_threads()
    repeats = 3 if quick else 5
    kernel = cpu_adam.load()
    variants = [kernel.variant]  # the best this CPU runs (or the one OFFLOADLAB_CPU_ADAM_VARIANT names)
    if kernel.compiled and kernel.library.runnable[-1] != kernel.variant:
        variants.append(kernel.library.runnable[-1])  # the portable one, for CPUs without wider instructions
    labels = {variant: f"offloadlab fused step, {variant} variant" if variant != cpu_adam.TORCH
              else "offloadlab step, torch fallback" for variant in variants}
    same_job = f"offloadlab step, {variants[0]}, fp32 gradients, no copy"
    master, m, v = torch.randn(count), torch.zeros(count), torch.zeros(count)
    grad, out16 = torch.randn(count).to(torch.bfloat16), torch.empty(count, dtype=torch.bfloat16)
    weights = torch.randn(count, requires_grad=True)
    weights.grad = torch.randn(count)
    a, b = torch.ones(count), torch.ones(count)
    steps = iter(range(1, 10**9))
    contenders = {"in-place update a += b": lambda: a.add_(b)}
    for variant in variants:
        contenders[labels[variant]] = lambda variant=variant: cpu_adam.adamw_step(
            master, m, v, grad, out16, step=next(steps), lr=1e-3, threads=threads, variant=variant)
    contenders[same_job] = lambda: cpu_adam.adamw_step(master, m, v, weights.grad, step=next(steps), lr=1e-3,
                                                       threads=threads, variant=variants[0])
    foreach = torch.optim.AdamW([weights], lr=1e-3, foreach=True)
    fused = torch.optim.AdamW([weights], lr=1e-3, fused=True)
    contenders["torch AdamW foreach"] = foreach.step
    contenders["torch AdamW fused"] = fused.step
    contenders["torch AdamW fused + bf16 cast"] = lambda: (fused.step(), out16.copy_(weights.detach()))
    deepspeed, deepspeed_absent = _deepspeed_step(weights)
    if deepspeed:
        contenders["DeepSpeedCPUAdam"] = deepspeed
        contenders["DeepSpeedCPUAdam + bf16 cast"] = lambda: (deepspeed(), out16.copy_(weights.detach()))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _interleaved_medians(contenders, repeats)
    finally:
        torch.set_num_threads(previous)
    update_bandwidth = 3 * 4 * count / seconds.pop("in-place update a += b")
    floor = cpu_adam.bytes_per_param() * count / update_bandwidth  # seconds
    moved = cpu_adam.bytes_per_param() * count
    rows = [{"contender": name, "seconds": value, "params_per_s": count / value, "bytes_per_s": moved / value,
             "percent_of_floor": 100 * floor / value} for name, value in seconds.items()]
    ours = seconds[labels[variants[0]]]
    baseline = seconds[labels[variants[1]]] if len(variants) > 1 else None
    cast = seconds["torch AdamW fused + bf16 cast"]
    ratios = {
        "offloadlab step / bandwidth floor (target ≤ 1.10)": ours / floor,
        "fused + cast / offloadlab step (target ≥ 1.5)": cast / ours,
        "fused + cast / offloadlab baseline step (target ≥ 1.0)": cast / baseline if baseline else None,
        "DeepSpeedCPUAdam + cast / offloadlab step (target ≥ 1.0)":
            seconds["DeepSpeedCPUAdam + bf16 cast"] / ours if deepspeed else None,
        "DeepSpeedCPUAdam / offloadlab step, same job (target ≥ 1.0)":
            seconds["DeepSpeedCPUAdam"] / seconds[same_job] if deepspeed else None,
    }
    return {"benchmark": "adam", "source": "measured", "rows": rows, "ratios": ratios,
            "params": count, "threads": threads, "floor_seconds": floor, "update_bandwidth": update_bandwidth,
            "backend": cpu_adam.backend(), "provenance": machine.provenance(),
            "note": "" if deepspeed else f"DeepSpeedCPUAdam: absent ({deepspeed_absent})"}


def offload(quick: bool = False) -> dict:
    """Step time of a small GPT under CPUOffloadAdam (at step(), eager, delayed update) against
    plain AdamW on the device and torchao's CPUOffloadOptimizer when installed.

    Like with like: every contender runs with the same torch threads, and CPUOffloadAdam's CPU
    update with as many OpenMP threads (without a GPU the "device" is those same cores).
    """
    from .models import GPTConfig, TinyGPT, batches, markov_corpus
    from .offload import CPUOffloadAdam

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    config = GPTConfig(layers=12, hidden=1024, heads=16, vocab=8192, seq=512) if gpu else \
        GPTConfig(layers=2, hidden=256, heads=4, vocab=1024, seq=64)
    batch = 8 if gpu else 4
    steps = (5 if quick else 20) if gpu else (3 if quick else 8)
    corpus = markov_corpus(config.vocab, 50_000)
    dtype = torch.bfloat16 if gpu else torch.float32  # CPUs without bf16 units emulate bf16 matmuls slowly

    threads = torch.get_num_threads() if gpu else max(1, torch.get_num_threads() - 1)  # emulation: a core copies

    def timed(make_optimizer) -> float:
        torch.manual_seed(0)
        model = TinyGPT(config).to(device, dtype)
        previous = torch.get_num_threads()
        optimizer = make_optimizer(model)
        torch.set_num_threads(threads)
        data = batches(corpus, batch, config.seq)

        def one_step():
            inputs, targets = next(data)
            optimizer.zero_grad()
            model(inputs.to(device), targets.to(device)).backward()
            optimizer.step()
            if gpu:
                torch.cuda.synchronize()

        try:
            seconds = _median_seconds(one_step, steps)
        finally:
            if hasattr(optimizer, "close"):
                optimizer.close()
            torch.set_num_threads(previous)
        return seconds

    rows = [{"contender": "AdamW on the device", "seconds": timed(lambda m: torch.optim.AdamW(m.parameters()))},
            {"contender": "CPUOffloadAdam (update at step)",
             "seconds": timed(lambda m: CPUOffloadAdam(m.parameters(), threads=threads))},
            {"contender": "CPUOffloadAdam, eager (accumulation_steps=1)",
             "seconds": timed(lambda m: CPUOffloadAdam(m.parameters(), threads=threads, accumulation_steps=1))},
            {"contender": "CPUOffloadAdam, delayed update",
             "seconds": timed(lambda m: CPUOffloadAdam(m.parameters(), threads=threads, delayed_update=True))}]
    note = f"every contender: {threads} torch threads; CPUOffloadAdam's CPU update: {threads} OpenMP threads"
    try:
        from torchao.optim import CPUOffloadOptimizer
    except Exception:
        note += "; torchao CPUOffloadOptimizer: absent (pip install torchao to compare)"
    else:
        if gpu:
            rows.append({"contender": "torchao CPUOffloadOptimizer", "seconds": timed(
                lambda m: CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, fused=True))})
        else:
            note += "; torchao CPUOffloadOptimizer: needs a GPU"
    base = rows[0]["seconds"]
    ratios = {f"{r['contender']} / AdamW on the device": r["seconds"] / base for r in rows[1:]}
    return {"benchmark": "offload", "source": "measured" if gpu else "emulated", "rows": rows, "ratios": ratios,
            "params": config.params, "provenance": machine.provenance(), "note": note}


def prefetch(quick: bool = False) -> dict:
    """Layer streaming per variant: step time over max(compute, transfer), and link utilisation.

    Eight layers of weights in pinned host memory stream through a prefetcher while each
    layer's compute (calibrated to twice its transfer) is launched on the device's compute
    stream; the pageable variant streams ordinary copies of the same weights. On a GPU, also a
    Linear stack under Accelerate's ``cpu_offload`` against the same stack under
    :class:`~offloadlab.streaming.StreamedModel`.
    """
    from .prefetch import Prefetcher

    layers = 8
    with open_link() as chosen:
        gpu = not chosen.emulated
        layer_bytes = (64 if gpu else 4) * 2**20
        weights = [chosen.host_buffer(layer_bytes // 4).normal_() for _ in range(layers)]
        pageable = [w.clone() for w in weights]
        peak = probe.fit_sweep(probe.link_sweep(chosen, directions=("h2d",), pinned=(True,), quick=True,
                                                repeats=3)).beta
        t_layer_transfer = layer_bytes / peak
        rows_, hidden = (8192, 8192) if gpu else (256, 512)

        def on_device(work, count=1) -> float:
            """Seconds of ``count`` launches of ``work`` on the compute stream, on the link's clock."""
            begin = chosen.mark()
            for _ in range(count):
                chosen.launch(work)
            end = chosen.mark()
            return end.time - begin.time

        probe_work = experiment.MatmulWork(rows_, hidden, 16, chosen.device)
        per_product = statistics.median(on_device(probe_work) for _ in range(3)) / 16
        work = experiment.MatmulWork(rows_, hidden, max(1, math.ceil(2 * t_layer_transfer / per_product)), chosen.device)

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
        for name, sources, variant in (("double buffered", weights, {}), ("one buffer", weights, {"buffers": 1}),
                                       ("pageable source", pageable, {"pinned": False}),
                                       ("synchronous copy", weights, {"synchronous": True})):
            prefetcher = Prefetcher(sources, chosen, **variant)
            one_pass(prefetcher)  # warm-up
            seconds = statistics.median(one_pass(prefetcher) for _ in range(5))
            copies = prefetcher.timeline()["H2D"]
            busy = sum(end - start for start, end, _ in copies)
            result_rows.append({"contender": name, "seconds": seconds, "ratio_to_bound": seconds / bound,
                                "link_percent_of_peak": 100 * layers * layer_bytes / busy / peak})
            ratios[f"{name}: step / max(compute, transfer) (target ≤ 1.10 double buffered)"
                   if name == "double buffered" else f"{name}: step / max(compute, transfer)"] = seconds / bound
        by_name = {r["contender"]: r["seconds"] for r in result_rows}
        ratios["synchronous / double buffered (target ≥ 1.4; ideal 1.5)"] = \
            by_name["synchronous copy"] / by_name["double buffered"]
        ratios["double buffered: link bandwidth / pinned peak (GPU target ≥ 0.90)"] = \
            result_rows[0]["link_percent_of_peak"] / 100
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
    return {"benchmark": "prefetch", "source": source, "rows": result_rows, "ratios": ratios,
            "compute_seconds": compute_alone, "transfer_seconds": transfer_alone, "peak_bytes_per_s": peak,
            "provenance": machine.provenance(), "note": note}


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


def check_nvme_folder(folder=".", quick: bool = False, nbytes=None) -> None:
    """Refuse a folder bench nvme could not finish in, before it starts: ValueError for a missing
    folder, OSError for a read-only one or one without room for two tiers (two slots each) and a probe file."""
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
    seconds = {(kind, way, depth): [] for kind in kinds for way in ("write", "read") for depth in NVME_DEPTHS}
    probed = {"write": [], "read": []}  # what `offloadlab probe` reports: depth 1, 4 MiB blocks
    direct = True
    for depth in NVME_DEPTHS:
        with FileTier.temporary(folder, state.numel(), queue_depth=depth) as tier, \
                FileTier.temporary(folder, state.numel(), queue_depth=depth, checksums=False) as plain:
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
    rows = [{"contender": f"probe {way}, depth 1, 4 MiB blocks", "bytes_per_s": baseline[way]} for way in ("write", "read")]
    rows += [{"contender": f"{name} {way}, depth {depth}", "bytes_per_s": size / median[kind, way, depth],
              "queue_depth": depth}
             for depth in NVME_DEPTHS for kind, name in kinds.items() for way in ("write", "read")]

    def io_time(kind, depth):
        return median[kind, "write", depth] + median[kind, "read", depth]

    ratios = {}
    for way in ("write", "read"):
        best = min(NVME_DEPTHS, key=lambda d: median["tier", way, d])
        ratios[f"tier {way} at its best depth ({best}) / probe {way} (target ≥ 0.80)"] = \
            size / median["tier", way, best] / baseline[way]
    best = min(NVME_DEPTHS, key=lambda d: io_time("tier", d))
    ratios[f"tier I/O time / raw I/O time at depth {best}: crash-safety overhead (target ≤ 1.10)"] = \
        io_time("tier", best) / io_time("raw", best)
    ratios[f"commit protocol alone: no-checksum tier / raw at depth {best}"] = \
        io_time("plain", best) / io_time("raw", best)
    ratios[f"checksums alone: crc32 tier / no-checksum tier at depth {best}"] = \
        io_time("tier", best) / io_time("plain", best)
    for way in ("write", "read"):
        ratios[f"tier {way}: depth 16 / depth 1"] = median["tier", way, 1] / median["tier", way, 16]
    return {"benchmark": "nvme", "source": "measured", "rows": rows, "ratios": ratios, "bytes": size,
            "folder": str(machine.disk(folder).path), "provenance": machine.provenance(),
            "note": "" if direct else "O_DIRECT refused by this file system: the page cache may serve these rates"}


def format_result(result: dict) -> str:
    """A short plain-text report of a benchmark result."""
    lines = [f"benchmark {result['benchmark']} ({result['source']})"]
    for row in result["rows"]:
        if "percent_of_floor" in row:
            lines.append(f"  {row['contender']:<58} {row['seconds'] * 1e3:8.1f} ms  {row['params_per_s'] / 1e9:5.2f} "
                         f"G params/s  {format_bandwidth(row['bytes_per_s']):>10}  {row['percent_of_floor']:5.1f}% of floor")
        elif "ratio_to_bound" in row:
            lines.append(f"  {row['contender']:<22} {format_duration(row['seconds']):>10}  "
                         f"{row['ratio_to_bound']:.2f}× max(compute, transfer)  "
                         f"link {row['link_percent_of_peak']:.0f}% of pinned peak")
        elif "t_compute_s" not in row and "seconds" in row:
            lines.append(f"  {row['contender']:<40} {format_duration(row['seconds']):>10} per step")
        elif "bytes_per_s" in row:
            extra = f"  latency {row['latency_s'] * 1e6:.0f} µs" if "latency_s" in row else ""
            lines.append(f"  {row['contender']:<40} {format_bandwidth(row['bytes_per_s']):>12}{extra}")
        else:
            lines.append(f"  {row['contender']:<40} compute {format_duration(row['t_compute_s'])}, transfer "
                         f"{format_duration(row['t_transfer_s'])}, both {format_duration(row['t_both_s'])}")
    lines.append("  ratios:")
    for name, value in result["ratios"].items():
        lines.append(f"    {name:<60} {'unknown' if value is None else f'{value:.2f}×'}")
    if result.get("note"):
        lines.append(f"  note: {result['note']}")
    return "\n".join(lines)
