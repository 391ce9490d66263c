"""Benchmarks: offloadlab's mechanisms against their peers, in one run, reported as ratios.

Wall-clock figures on shared machines are noisy; a ratio between two things measured
side by side in the same run is not. Each benchmark returns a dict with ``rows`` (one per
contender, with its figures) and ``ratios`` (named comparisons), plus provenance.
"""

from __future__ import annotations

import statistics
import time

import torch

from . import experiment, machine, probe
from .link import open_link
from .units import format_bandwidth, format_duration

__all__ = ["link", "overlap", "format_result"]


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
    """Pinned transfers on the link's copy stream against the nominal PCIe figure and a plain copy.

    On a GPU: the pinned asymptotic bandwidth (α–β fit of the size sweep) per direction as a
    fraction of NVML's nominal PCIe rate and as a multiple of torch's plain pageable copy. On
    the emulated link: achieved against configured bandwidth, and pinned against pageable.
    """
    with open_link() as chosen:
        records = probe.link_sweep(chosen, quick=quick, repeats=3 if quick else 5)
        emulated = chosen.emulated
        configured = getattr(chosen, "bandwidth", None)
    largest = max(r.params["size"] for r in records)
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


def format_result(result: dict) -> str:
    """A short plain-text report of a benchmark result."""
    lines = [f"benchmark {result['benchmark']} ({result['source']})"]
    for row in result["rows"]:
        if "bytes_per_s" in row:
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
