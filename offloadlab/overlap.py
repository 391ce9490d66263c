"""The overlap-vs-stall condition, for one stage and for a pipeline of stages.

A stage moves X bytes over a link of bandwidth B (t_transfer = latency + X / B) while
t_compute of independent work runs. If t_transfer ≤ t_compute the transfer is hidden;
otherwise the GPU stalls for the difference. Pure arithmetic: seconds, bytes, bytes/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .units import check_non_negative, parse_bandwidth, parse_duration, parse_size

__all__ = ["Stage", "stage", "PipelineStep", "pipeline", "crossover_batch"]


@dataclass(frozen=True)
class Stage:
    """One stage: its transfer and compute times, the step time and the stall (seconds)."""

    t_transfer: float
    t_compute: float

    @property
    def hidden(self) -> bool:
        """True when the transfer fits inside the compute (no stall)."""
        return self.t_transfer <= self.t_compute

    @property
    def stall(self) -> float:
        """Seconds the compute waits for the transfer: max(0, t_transfer − t_compute)."""
        return max(0.0, self.t_transfer - self.t_compute)

    @property
    def step(self) -> float:
        """Seconds for the stage with perfect overlap: max(t_transfer, t_compute)."""
        return max(self.t_transfer, self.t_compute)

    @property
    def regime(self) -> str:
        return "compute-bound (transfer hidden)" if self.hidden else "bandwidth-bound (stalls)"


def stage(nbytes, bandwidth, t_compute, latency=0.0) -> Stage:
    """The overlap condition for moving ``nbytes`` over ``bandwidth`` during ``t_compute`` seconds."""
    size = parse_size(nbytes, "nbytes", allow_zero=True)
    rate = parse_bandwidth(bandwidth, "bandwidth")
    compute = parse_duration(t_compute, "t_compute", allow_zero=True)
    delay = parse_duration(latency, "latency", allow_zero=True)
    return Stage((delay + size / rate) if size else 0.0, compute)


@dataclass(frozen=True)
class PipelineStep:
    """A simulated pipeline: when each transfer and each compute ran (seconds from 0)."""

    transfers: list[tuple[float, float]]
    computes: list[tuple[float, float]]

    @property
    def step(self) -> float:
        return self.computes[-1][1] if self.computes else 0.0

    @property
    def stall(self) -> float:
        """Seconds the compute sat idle waiting for data."""
        return self.step - sum(end - start for start, end in self.computes)


def pipeline(transfer_seconds, compute_seconds, depth: int = 1) -> PipelineStep:
    """Layer i's data must arrive before layer i computes; the link moves one item at a time.

    ``depth`` is how many items may be fetched ahead of the one being computed, with
    ``depth + 1`` buffers: 0 is no prefetch (each fetch starts only when the previous
    layer's compute is done, so transfers serialise with compute); 1 is double buffering.
    A buffer is refilled only after the compute that used it has finished.
    """
    transfers = [check_non_negative(t, "transfer_seconds") for t in transfer_seconds]
    computes = [check_non_negative(c, "compute_seconds") for c in compute_seconds]
    if len(transfers) != len(computes):
        raise ValueError(f"compute_seconds: expected {len(transfers)} values, one per transfer; got {len(computes)}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth: expected an integer ≥ 0; got {depth!r}")
    fetched, computed = [], []
    for i, (t, c) in enumerate(zip(transfers, computes)):
        link_free = fetched[-1][1] if fetched else 0.0
        # With depth d, item i may be fetched once item i-d-1 is computed (its buffer is free);
        # with no prefetch (d = 0) that is once the previous item is computed.
        buffer_free = computed[i - depth - 1][1] if i - depth - 1 >= 0 else 0.0
        if depth == 0 and computed:
            buffer_free = computed[-1][1]
        start = max(link_free, buffer_free)
        fetched.append((start, start + t))
        begin = max(fetched[-1][1], computed[-1][1] if computed else 0.0)
        computed.append((begin, begin + c))
    return PipelineStep(fetched, computed)


def crossover_batch(traffic_bytes, bandwidth, compute_seconds_per_sample, latency=0.0) -> int:
    """The smallest batch whose compute (batch × seconds per sample) hides the step's transfer."""
    per_sample = parse_duration(compute_seconds_per_sample, "compute_seconds_per_sample")
    t_transfer = stage(traffic_bytes, bandwidth, 0, latency).t_transfer
    return max(1, math.ceil(t_transfer / per_sample - 1e-9))
