"""The per-step bandwidth budget: how many bytes a step can move without stalling.

Over one step a link of bandwidth B hides at most B × t_window bytes, where t_window is the
compute the transfers run behind. Each offload choice costs a known number of bytes per
parameter per step; the verdict compares that traffic with the ceiling. Following the
material, all traffic of a step (both directions) counts against one budget. Units: bytes,
bytes/s, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .units import format_bandwidth, format_duration, format_size, parse_bandwidth, parse_count, parse_duration

__all__ = ["Traffic", "TRAFFIC", "ceiling", "traffic_bytes", "Verdict", "verdict"]


@dataclass(frozen=True)
class Traffic:
    """Bytes per parameter one offload choice moves each step, down (to host) and up (to GPU)."""

    name: str
    down: float
    up: float
    reasoning: str

    @property
    def per_param(self) -> float:
        return self.down + self.up


TRAFFIC: dict[str, Traffic] = {
    t.name: t
    for t in (
        Traffic("optimizer", 2, 2,
                "update where it lives: 16-bit gradients down (2 B), refreshed 16-bit weights up (2 B)"),
        Traffic("gradients", 2, 0,
                "gradient streaming: each 16-bit gradient goes down as backward produces it (2 B)"),
        Traffic("parameters", 0, 4,
                "parameter offload: each layer's 16-bit weights come up for forward and again for backward (2 × 2 B)"),
        Traffic("park-and-copy", 12, 12,
                "park the optimizer state in host memory and copy it in and out for a GPU update: "
                "fp32 master weights and both moments (12 B) each way"),
    )
}


def ceiling(bandwidth, window) -> float:
    """Bytes a link of ``bandwidth`` moves in ``window`` seconds: the step's traffic budget."""
    return parse_bandwidth(bandwidth, "bandwidth") * parse_duration(window, "window")


def traffic_bytes(params, offload) -> float:
    """Bytes per step for ``params`` parameters under the offload choice(s) ``offload``."""
    count = parse_count(params, "params")
    names = [offload] if isinstance(offload, str) else list(offload)
    if not names:
        raise ValueError(f"offload: expected one or more of {', '.join(TRAFFIC)}; got nothing")
    for name in names:
        if name not in TRAFFIC:
            raise ValueError(f"offload: expected one or more of {', '.join(TRAFFIC)}; got {name!r}")
    if "optimizer" in names and "gradients" in names:  # the optimizer's traffic already streams the gradients
        names = [n for n in names if n != "gradients"]
    return count * sum(TRAFFIC[n].per_param for n in names)


@dataclass(frozen=True)
class Verdict:
    """A step's traffic against its budget, and what would make it fit."""

    traffic_bytes: float
    bandwidth: float
    window: float
    offload: list[str] = field(default_factory=list)

    @property
    def ceiling_bytes(self) -> float:
        return self.bandwidth * self.window

    @property
    def transfer_seconds(self) -> float:
        return self.traffic_bytes / self.bandwidth

    @property
    def ratio(self) -> float:
        """Traffic over budget: ≤ 1 fits, 5 means five times over."""
        return self.traffic_bytes / self.ceiling_bytes

    @property
    def fits(self) -> bool:
        return self.ratio <= 1

    @property
    def stall_seconds(self) -> float:
        return max(0.0, self.transfer_seconds - self.window)

    def fixes(self) -> list[str]:
        """What would bring the traffic within budget, each as a plain sentence."""
        if self.fits:
            return []
        return [
            f"offload less: cut the traffic to {format_size(self.ceiling_bytes)} per step "
            f"(÷{self.ratio:.1f})",
            f"a faster link: {format_bandwidth(self.traffic_bytes / self.window)} would carry it",
            f"a larger compute window: {format_duration(self.transfer_seconds)} of compute per step "
            f"(a larger batch or longer sequences) would hide it",
        ]

    def summary(self) -> str:
        lines = [
            f"budget: {format_bandwidth(self.bandwidth)} × {format_duration(self.window)} = "
            f"{format_size(self.ceiling_bytes)} per step",
        ]
        if self.offload:
            lines.append(f"traffic ({', '.join(self.offload)}): {format_size(self.traffic_bytes)} → "
                         f"{format_duration(self.transfer_seconds)} on the link")
            if self.fits:
                lines.append(f"verdict: fits ({self.ratio:.0%} of the budget)")
            else:
                lines.append(f"verdict: {self.ratio:.2g}× over budget; stalls {format_duration(self.stall_seconds)} "
                             f"per step")
                lines += [f"  fix: {fix}" for fix in self.fixes()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "bandwidth_bytes_per_s": self.bandwidth,
            "window_s": self.window,
            "ceiling_bytes": self.ceiling_bytes,
            "offload": self.offload,
            "traffic_bytes": self.traffic_bytes,
            "transfer_s": self.transfer_seconds,
            "ratio": self.ratio if self.offload else None,
            "fits": self.fits if self.offload else None,
            "fixes": self.fixes() if self.offload else [],
        }


def verdict(bandwidth, window, params=None, offload=("optimizer",)) -> Verdict:
    """The budget of a step, and — given ``params`` — whether ``offload``'s traffic fits it."""
    rate = parse_bandwidth(bandwidth, "bandwidth")
    seconds = parse_duration(window, "window")
    if params is None:
        return Verdict(0.0, rate, seconds, [])
    names = [offload] if isinstance(offload, str) else list(offload)
    return Verdict(traffic_bytes(params, names), rate, seconds, names)
