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

import contextlib
import math
import statistics
import sys
import time

import torch

from . import devices, experiment, machine, probe
from .devices import ASSUMED, Footprint
from .link import open_link
from .units import format_bandwidth, format_duration, parse_size

__all__ = ["link", "overlap", "adam", "offload", "prefetch", "nvme", "check_nvme_folder", "format_result",
           "link_plan", "overlap_plan", "adam_plan", "offload_plan", "prefetch_plan", "nvme_plan", "OVERLAP_CASES"]

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
    sweep = sum(2 * ((repeats + 1) * size / rate + repeats * filler / pinned_rate)
                for size in sizes for rate in (pinned_rate, pageable_rate))
    both = (repeats + 1) * top / pinned_rate
    plain = 2 * (repeats + 2) * top / pageable_rate
    return Footprint(max(top + filler, 2 * top), max(top + filler, 2 * top), sweep + both + plain + 2.0,
                     f"a sweep of 4 KiB to {top >> 20} MiB each way, pinned and pageable, {repeats} repeats")


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


OVERLAP_CASES = (("transfer hidden (¼ of compute)", 0.25), ("balanced (equal)", 1.0),
                 ("bandwidth-bound (4× compute)", 4.0))
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

    def experiment_seconds(nbytes: int, repeats: int) -> float:  # measure_overlap: warm-up, repeats, timeline
        compute = window  # (the run counts its products from their measured time)
        transfer = nbytes / rate
        both = max(compute, transfer)
        return both + repeats * (compute + transfer + both) + both

    repeats = 3 if quick else 5
    seconds = experiment_seconds(_CALIBRATION_BYTES[False], 1) + sum(
        experiment_seconds(experiment.transfer_bytes(profile, f, window), repeats) for _, f in OVERLAP_CASES)
    return Footprint(buffers, buffers + experiment.matmul_device_bytes(*experiment.GPU_SHAPE), seconds,
                     f"transfers of ¼, 1 and 4 compute windows of {window * 1e3:.0f} ms over the nominal link, "
                     f"in one pinned buffer")


def overlap(quick: bool = False) -> dict:
    """Measured step over predicted step, max(compute, transfer), in three regimes.

    The transfer is sized to a quarter of, equal to, and four times the compute; a ratio near
    1.0 means the overlap model predicts the machine. On a GPU the compute is sized to a window of
    :data:`offloadlab.experiment.WINDOW` seconds (half of it with ``quick``) from the product's
    measured time, and no transfer exceeds what :func:`overlap_plan` allows.
    """
    with open_link() as chosen:
        if chosen.emulated:
            work, limit = experiment.MatmulWork(*experiment.EMULATED_SHAPE, 8 if quick else 16, chosen.device), None
        else:
            profile = devices.present()
            work = experiment.overlap_work(chosen, _overlap_window(quick))
            limit = {f: experiment.transfer_bytes(profile, 1.1 * f, _overlap_window(quick)) for _, f in OVERLAP_CASES}
        calibration = experiment.measure_overlap(chosen, _CALIBRATION_BYTES[chosen.emulated], work, 1)
        bandwidth = calibration.nbytes / calibration.t_transfer
        result_rows, ratios = [], {}
        for name, factor in reversed(OVERLAP_CASES):  # the largest first: the others reuse its buffers
            nbytes = max(4096, int(factor * calibration.t_compute * bandwidth))
            if limit is not None:
                nbytes = min(nbytes, limit[factor])
            r = experiment.measure_overlap(chosen, nbytes, work, repeats=3 if quick else 5)
            result_rows.insert(0, {"contender": name, "factor": factor, **r.to_dict()})
            ratios[f"{name}: measured / predicted step"] = r.ratio
        ratios = dict(reversed(list(ratios.items())))
        source = "emulated" if chosen.emulated else "measured"
    return {"benchmark": "overlap", "source": source, "rows": result_rows, "ratios": ratios,
            "compute": {"rows": work.rows, "hidden": work.hidden, "products": work.count},
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


def _adam_params(quick: bool) -> int:
    return int(16e6 if quick else 64e6)


def adam_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`adam` asks: host memory only (ordinary, not pinned), bound by its bandwidth."""
    import importlib.util

    count = _adam_params(quick)
    contenders = 9  # the floor's update, two variants, the same job, torch's two and the cast, DeepSpeed's two
    step = 28 * count / ASSUMED["host_bandwidth"]
    deepspeed = 60.0 if importlib.util.find_spec("deepspeed") else 0.0  # its CPU Adam may compile at first use
    return Footprint(0, 0, contenders * ((3 if quick else 5) + 1) * step + deepspeed + 2.0,
                     f"{count / 1e6:.0f} M parameters, every contender in interleaved rounds"
                     + ("; DeepSpeed's CPU Adam may compile at first use (60 s assumed)" if deepspeed else ""))


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

    count = int(params or _adam_params(quick))
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


def _offload_setup(gpu: bool, quick: bool):
    """(config, batch, steps, dtype) of :func:`offload` on a GPU or on the emulated link."""
    from .models import GPTConfig

    if gpu:
        return GPTConfig(layers=12, hidden=1024, heads=16, vocab=8192, seq=512), 8, 5 if quick else 20, torch.bfloat16
    # CPUs without bf16 units emulate bf16 matmuls slowly: fp32 there
    return GPTConfig(layers=2, hidden=256, heads=4, vocab=1024, seq=64), 4, 3 if quick else 8, torch.float32


def offload_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`offload` asks of a GPU of ``profile``: CPUOffloadAdam's pinned state (16 bytes
    per parameter with bf16 weights), and on the device AdamW's contender, the largest: bf16
    weights, gradients and two moments (8 bytes per parameter) and the saved activations."""
    from .offload.capacity import saved_activation_bytes

    config, batch, steps, dtype = _offload_setup(True, quick)
    params = config.params
    activations = saved_activation_bytes(config, batch, dtype)
    flops = 6 * params * batch * config.seq  # forward and backward
    device_step = flops / (profile.bf16_flops * ASSUMED["matmul_efficiency"])
    offloaded_step = max(device_step, 28 * params / ASSUMED["host_bandwidth"])  # the CPU update's memory traffic
    build = 3.0  # a fresh model, and for the offloaded ones its pinned state
    seconds = (build + (steps + 1) * device_step) * 2 + 3 * (build + (steps + 1) * offloaded_step)
    return Footprint(16 * params, 8 * params + activations, seconds,
                     f"TinyGPT of {params / 1e6:.0f} M parameters, batch {batch} × {config.seq}, {steps} steps per "
                     f"contender; activations counted on the meta device")


def offload(quick: bool = False) -> dict:
    """Step time of a small GPT under CPUOffloadAdam (at step(), eager, delayed update) against
    plain AdamW on the device and torchao's CPUOffloadOptimizer when installed.

    Like with like: every contender runs with the same torch threads, and CPUOffloadAdam's CPU
    update with as many OpenMP threads (without a GPU the "device" is those same cores).
    """
    from .models import TinyGPT, batches, markov_corpus
    from .offload import CPUOffloadAdam

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    config, batch, steps, dtype = _offload_setup(gpu, quick)
    corpus = markov_corpus(config.vocab, 50_000)

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


PREFETCH_LAYERS = 8
PREFETCH_COMPUTE_RATIO = 2.0  # each layer's compute over its transfer: double buffering can then hide the copy
_PREFETCH_LAYER_BYTES = {True: 4 * MiB, False: 64 * MiB}  # by emulated
_PREFETCH_HIDDEN = 2048  # on a GPU: (rows × 2048) @ (2048 × 2048) products, rows sized to the link
_PRODUCTS_PER_TRANSFER = 4  # products that last one layer's transfer: compute is counted in quarters of it


def prefetch_shape(profile: devices.DeviceProfile) -> tuple[int, int, int]:
    """(rows, hidden, products per layer) of a layer's compute on ``profile``: products about a
    quarter of a layer's transfer long at the datasheet rate, as many as make the compute twice the
    transfer — so that the real GPU, whose rate is lower, still rounds to a ratio near 2."""
    transfer = _PREFETCH_LAYER_BYTES[False] / profile.link_bytes_per_s
    rate = profile.matmul_flops(torch.float32)
    hidden = _PREFETCH_HIDDEN
    rows = max(64, round(transfer / _PRODUCTS_PER_TRANSFER * rate / (2 * hidden * hidden) / 64) * 64)
    per_product = 2 * rows * hidden * hidden / rate
    return rows, hidden, max(1, round(PREFETCH_COMPUTE_RATIO * transfer / per_product))


def prefetch_plan(profile: devices.DeviceProfile, quick: bool = False) -> Footprint:
    """What :func:`prefetch` asks of a GPU of ``profile`` (with Accelerate's comparison, when installed)."""
    layer = _PREFETCH_LAYER_BYTES[False]
    sweep = probe.default_sizes_for(emulated=False, quick=True)[-1] + probe.busy_filler_bytes(False)
    rows, hidden, count = prefetch_shape(profile)
    streaming = PREFETCH_LAYERS * layer  # the pinned weights (the pageable copies are ordinary memory)
    accelerate = 16 * 4096 * 4096 * 4  # its Linear stack, streamed from pinned memory by StreamedModel
    pinned = streaming + max(sweep, accelerate)  # (the weights live through the sweep and the comparison)
    device = max(sweep, 2 * layer + experiment.matmul_device_bytes(rows, hidden),
                 2 * 4096 * 4096 * 4 + 3 * 4096 * 4096 * 4)
    transfer = PREFETCH_LAYERS * layer / (profile.link_bytes_per_s * ASSUMED["link_efficiency"])
    compute = PREFETCH_COMPUTE_RATIO * transfer
    passes = 4 * (1 + 5) + 2 * 3  # four variants: a warm-up and five passes each; compute alone thrice
    return Footprint(pinned, device, passes * (compute + transfer) + 10.0,
                     f"{PREFETCH_LAYERS} layers of {layer >> 20} MiB, each computing {count} products of "
                     f"{rows}×{hidden} (twice its transfer at the datasheet rates)")


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
        peak = probe.fit_sweep(probe.link_sweep(chosen, directions=("h2d",), pinned=(True,), quick=True,
                                                repeats=3)).beta
        t_layer_transfer = layer_bytes / peak
        rows_, hidden, _ = prefetch_shape(devices.present()) if gpu else (*experiment.EMULATED_SHAPE, None)

        def on_device(work, count=1) -> float:
            """Seconds of ``count`` launches of ``work`` on the compute stream, on the link's clock."""
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
    return {"benchmark": "prefetch", "source": source, "rows": result_rows, "ratios": ratios,
            "compute_seconds": compute_alone, "transfer_seconds": transfer_alone, "peak_bytes_per_s": peak,
            "compute": {"rows": rows_, "hidden": hidden, "products_per_layer": count},
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


def nvme_plan(profile: devices.DeviceProfile | None = None, quick: bool = False) -> Footprint:
    """What :func:`nvme` asks: no pinned or device memory; time bound by the disk (see :data:`ASSUMED`)."""
    size, repeats = _nvme_bytes(quick), 2 if quick else 3
    # per depth: both tiers' two slots written once, then per repeat each tier writes and reads and the
    # probe writes twice (untimed, then timed) and reads, at that depth and at its own
    moved = len(NVME_DEPTHS) * size * (4 + repeats * 10)
    return Footprint(0, 0, moved / ASSUMED["disk_bandwidth"] + 2.0,
                     f"{size >> 20} MiB of state at queue depths {', '.join(map(str, NVME_DEPTHS))}, "
                     f"{moved / 1e9:.0f} GB of disk traffic")


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
