"""The per-step bandwidth budget: how many bytes a step can move without stalling.

A link of bandwidth B moves at most B × t_window bytes in one direction while t_window of compute
runs, and the transfers an offload needs each step hide only if they fit. Each offload choice
moves a known number of bytes per parameter per step in each direction, derived from the
training recipe's bytes per kind of state (:mod:`offloadlab.memory`); the verdict compares the
time those bytes take with the window.

How the two directions share the link is an assumption every figure depends on, so it is an
argument, ``duplex``:

- ``"full"`` (the default): PCIe has separate lanes each way and a GPU a copy engine per
  direction, so gradients going to the host and weights coming back move at the same time when
  the software issues them on two streams. Read as the upper bound: each direction at its
  one-way rate. A real link typically keeps most but not all of it, since each direction also
  carries the other's read requests and flow-control packets;
- ``"half"``: every byte of the step shares one rate. The sources' worked figures read the link
  this way; it is the conservative reading;
- a bandwidth: what each direction keeps while both run, measured (lab 2,
  :func:`offloadlab.probe.bidirectional`). Host memory and the root complex are shared, so on
  many machines this lies between the two.

With ``both`` the rate each direction keeps while both run, a step that moves ``h2d`` bytes up
and ``d2h`` bytes down spends min(h2d, d2h) / both seconds with both directions busy and
|h2d − d2h| / B with one: full duplex is both = B, half duplex both = B / 2.

Units: bytes, bytes/s, seconds. "Up" (h2d) is host to GPU, "down" (d2h) GPU to host.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
import math
from dataclasses import dataclass, field

from . import memory
from .units import (
    check_integer,
    check_non_negative,
    check_positive,
    format_bandwidth,
    format_duration,
    format_size,
    parse_bandwidth,
    parse_count,
    parse_duration,
    plain_scalar,
)

__all__ = [
    "OFFLOAD_CHOICES",
    "DUPLEX_FORMS",
    "PCIE_X16",
    "Traffic",
    "TRAFFIC",
    "traffic",
    "traffic_bytes",
    "ceiling",
    "both_directions_rate",
    "link_seconds",
    "Verdict",
    "verdict",
]

OFFLOAD_CHOICES = ("optimizer", "gradients", "parameters", "park-and-copy")
# PCIe ×16 links, per direction: (nominal, achievable) bytes/s. Nominal is the line rate after
# 128b/130b encoding (machine.pcie_bandwidth: gen 4 is 16 GT/s × 16 lanes × 128/130 ÷ 8); achievable
# is what large pinned copies typically reach (bandwidthTest, nvbandwidth), the rest going to
# packet headers and flow control. Worked budgets use the achievable figure; lab 2 measures yours.
PCIE_X16 = MappingProxyType(
    {
        "PCIe 4.0 ×16": (31.5e9, 25e9),
        "PCIe 5.0 ×16": (63.0e9, 50e9),
    }
)

# Two measurements of the same link differ by a few percent: a both-directions rate this much above
# the one-direction rate is read as full duplex, not refused.
MEASUREMENT_SLACK = 0.10
DUPLEX_FORMS = (
    "'full', 'half', or the bandwidth each direction keeps while both run, such as '20 GB/s'"
)


@dataclass(frozen=True)
class Traffic:
    """Bytes per parameter an offload moves each step: ``h2d`` up to the GPU, ``d2h`` down to the
    host."""

    offload: tuple[str, ...]
    recipe: str
    h2d: float
    d2h: float
    reasoning: tuple[str, ...]

    @property
    def per_param(self) -> float:
        """Bytes per parameter per step, both directions together."""
        return self.h2d + self.d2h


def _names(offload) -> list[str]:
    names = [offload] if isinstance(offload, str) else list(offload)
    if not names or any(n not in OFFLOAD_CHOICES for n in names):
        got = "nothing" if not names else repr(next(n for n in names if n not in OFFLOAD_CHOICES))
        raise ValueError(
            f"offload: expected one or more of {', '.join(OFFLOAD_CHOICES)}; got {got}"
        )
    if "park-and-copy" in names and "optimizer" in names:
        raise ValueError(
            "offload: expected 'optimizer' (update where it lives) or 'park-and-copy', not both: "
            "they are two ways of offloading the same state; got both"
        )
    return list(dict.fromkeys(names))


def traffic(offload, recipe: str = memory.DEFAULT_RECIPE, micro_batches: int = 1) -> Traffic:
    """Bytes per parameter per step, each way, of the offload choice(s) ``offload`` under
    ``recipe``, for ``micro_batches`` forward and backward passes a step.

    Every figure is a kind of state's bytes from the recipe:

    - ``optimizer`` (update where it lives): each micro-batch's gradient goes down for the CPU
      update and the refreshed weight comes back up — unless parameters are offloaded too, when
      the next forward's fetch brings it;
    - ``gradients``: each micro-batch's gradient goes down as backward produces it. With the
      optimizer offloaded that trip is already paid; without it, the sum must come back up for
      the GPU's update;
    - ``parameters``: each layer's weights come up for every forward and again for every
      backward. Without the optimizer offloaded, the GPU's updated weights also go back down to
      their home;
    - ``park-and-copy``: the optimizer state comes up for a GPU update and goes back down, once a
      step whatever the micro-batches (gradients stay on the GPU).
    """
    names = _names(offload)
    k = check_integer(plain_scalar(micro_batches), "micro_batches")
    r = memory.get_recipe(recipe)
    w, g, state = r.weight_bytes, r.gradient_bytes, r.optimizer_bytes
    h2d = d2h = 0.0
    why = []
    each = "" if k == 1 else f"{k} × "
    if "optimizer" in names:
        d2h += k * g
        why.append(f"gradients down for the CPU update ({each}{g:g} B)")
        if "parameters" not in names:
            h2d += w
            why.append(f"refreshed weights up ({w:g} B)")
    if "gradients" in names:
        if "optimizer" in names:
            why.append("gradients: already on their way down for the CPU update (0 B more)")
        else:
            d2h += k * g
            h2d += g
            why.append(
                f"gradients down as backward makes them ({each}{g:g} B) and their sum back up for "
                f"the GPU's update ({g:g} B)"
            )
    if "parameters" in names:
        h2d += 2 * k * w
        why.append(
            f"each layer's weights up for forward and again for backward ({2 * k} × {w:g} B)"
        )
        if "optimizer" not in names:
            d2h += w
            why.append(f"the GPU's updated weights back down to host memory ({w:g} B)")
    if "park-and-copy" in names:
        h2d += state
        d2h += state
        why.append(f"optimizer state up for the GPU's update and back down ({state:g} B each way)")
    return Traffic(tuple(names), r.name, h2d, d2h, tuple(why))


# Each choice on its own, for the default recipe.
TRAFFIC: Mapping[str, Traffic] = MappingProxyType({name: traffic(name) for name in OFFLOAD_CHOICES})


def traffic_bytes(params, offload, recipe: str = memory.DEFAULT_RECIPE) -> float:
    """Bytes per step, both directions together, for ``params`` parameters under ``offload``."""
    return parse_count(params, "params") * traffic(offload, recipe).per_param


def ceiling(bandwidth, window) -> float:
    """Bytes one direction of a ``bandwidth`` link moves in ``window`` seconds: the step's
    budget."""
    return parse_bandwidth(bandwidth, "bandwidth") * parse_duration(window, "window")


def both_directions_rate(bandwidth, duplex="full") -> tuple[float, str]:
    """(bytes/s each direction keeps while both run, 'full' | 'half' | 'measured') for
    ``duplex``."""
    rate = parse_bandwidth(bandwidth, "bandwidth")
    if duplex == "full":
        return rate, "full"
    if duplex == "half":
        return rate / 2, "half"
    try:
        both = parse_bandwidth(duplex, "duplex")
    except ValueError:
        raise ValueError(f"duplex: expected {DUPLEX_FORMS}; got {duplex!r}") from None
    if both > rate * (1 + MEASUREMENT_SLACK):
        raise ValueError(
            f"duplex: expected at most the one-direction bandwidth {format_bandwidth(rate)}, give "
            f"or take the {MEASUREMENT_SLACK:.0%} two measurements differ by (a direction cannot "
            f"gain from the other running); got {duplex!r}"
        )
    return min(both, rate), "measured"  # a measurement a little above the one-way rate is that rate


def link_seconds(h2d_bytes: float, d2h_bytes: float, bandwidth: float, both: float) -> float:
    """Seconds to move ``h2d_bytes`` up and ``d2h_bytes`` down: both at ``both`` B/s each while
    both directions are busy, the rest at ``bandwidth`` alone."""
    h2d_bytes = check_non_negative(h2d_bytes, "h2d_bytes")
    d2h_bytes = check_non_negative(d2h_bytes, "d2h_bytes")
    bandwidth, both = check_positive(bandwidth, "bandwidth"), check_positive(both, "both")
    overlapped = min(h2d_bytes, d2h_bytes)
    return overlapped / both + (max(h2d_bytes, d2h_bytes) - overlapped) / bandwidth


@dataclass(frozen=True)
class Verdict:
    """A step's traffic, each way, against the window that should hide it; what would make it
    fit."""

    h2d_bytes: float
    d2h_bytes: float
    bandwidth: float
    both_directions: float
    duplex: str
    window: float
    offload: list[str] = field(default_factory=list)
    recipe: str = memory.DEFAULT_RECIPE
    micro_batches: int = 1

    @property
    def traffic_bytes(self) -> float:
        return self.h2d_bytes + self.d2h_bytes

    @property
    def ceiling_bytes(self) -> float:
        """Bytes one direction moves in the window (under full duplex, each direction's budget)."""
        return self.bandwidth * self.window

    @property
    def transfer_seconds(self) -> float:
        return link_seconds(self.h2d_bytes, self.d2h_bytes, self.bandwidth, self.both_directions)

    @property
    def ratio(self) -> float:
        """Link time over the window: ≤ 1 fits, 5 means five times over."""
        return self.transfer_seconds / self.window

    @property
    def fits(self) -> bool:
        return self.ratio <= 1

    @property
    def stall_seconds(self) -> float:
        return max(0.0, self.transfer_seconds - self.window)

    @property
    def offload_fraction(self) -> float | None:
        """For the optimizer offloaded alone: the largest share of it (by bytes, to hundredths,
        rounded down) whose traffic fits the window; None for other offloads."""
        if self.offload != ["optimizer"]:
            return None
        return 1.0 if self.fits else math.floor(100 / self.ratio) / 100

    def park_or_update(self) -> dict | None:
        """For an offloaded optimizer: bytes a parameter per step (both directions) updated in
        place and parked, at this many micro-batches, and which moves fewer; else None."""
        if not {"optimizer", "park-and-copy"} & set(self.offload):
            return None
        r = memory.get_recipe(self.recipe)
        in_place = r.weight_bytes + self.micro_batches * r.gradient_bytes
        parked = 2 * r.optimizer_bytes
        return {
            "micro_batches": self.micro_batches,
            "in_place_bytes_per_param": in_place,
            "parked_bytes_per_param": parked,
            "fewer": "parked" if parked < in_place else "in place",
        }

    def _budget(self) -> str:
        """The window's allowance in words, under this duplex assumption."""
        one_way = format_size(self.ceiling_bytes)
        if self.duplex == "full":
            return (
                f"{one_way} each way (full duplex: both directions at once, each at its "
                "one-way rate)"
            )
        if self.duplex == "half":
            return f"{one_way} for both directions together (half duplex: they share one rate)"
        return (
            f"{one_way} one way alone, {format_size(self.both_directions * self.window)} each way "
            f"while both run (measured: {format_bandwidth(self.both_directions)} per direction)"
        )

    def fixes(self) -> list[str]:
        """What would bring the traffic within budget, each as a plain sentence."""
        if self.fits:
            return []
        less = (
            f": offload_fraction={self.offload_fraction:g} of the optimizer (Megatron-Core "
            f"--optimizer-offload-fraction, DeepSpeed ZeRO-3 offload_optimizer.ratio)"
            if self.offload_fraction is not None
            else ""
        )
        return [
            f"offload less: cut the traffic to {format_size(self.traffic_bytes / self.ratio)} per "
            f"step (÷{self.ratio:.2g}){less}",
            f"a faster link: {format_bandwidth(self.bandwidth * self.ratio)} per direction would "
            "carry it",
            f"a larger compute window: {format_duration(self.transfer_seconds)} of compute per "
            f"step (a larger batch or longer sequences) would hide it",
        ]

    def summary(self) -> str:
        lines = [
            f"budget: {format_bandwidth(self.bandwidth)} × {format_duration(self.window)}: "
            f"{self._budget()}"
        ]
        if self.offload:
            lines.append(
                f"traffic ({', '.join(self.offload)}; {self.recipe}): "
                f"{format_size(self.h2d_bytes)} up, {format_size(self.d2h_bytes)} down → "
                f"{format_duration(self.transfer_seconds)} on the link"
            )
            if self.fits:
                lines.append(f"verdict: fits ({self.ratio:.0%} of the window)")
            else:
                lines.append(
                    f"verdict: {self.ratio:.2g}× over budget; stalls "
                    f"{format_duration(self.stall_seconds)} per step"
                )
                lines += [f"  fix: {fix}" for fix in self.fixes()]
            choice = self.park_or_update()
            if choice is not None:
                lines.append(
                    f"park or update in place ({self.micro_batches} micro-batch(es) a step): "
                    f"{choice['in_place_bytes_per_param']:g} B a parameter in place, "
                    f"{choice['parked_bytes_per_param']:g} parked → {choice['fewer']} moves fewer"
                )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        given = bool(self.offload)
        return {
            "bandwidth_bytes_per_s": self.bandwidth,
            "duplex": self.duplex,
            "each_direction_while_both_run_bytes_per_s": self.both_directions,
            "window_s": self.window,
            "ceiling_bytes": self.ceiling_bytes,
            "offload": self.offload,
            "recipe": self.recipe,
            "bytes_per_direction": {"h2d": self.h2d_bytes, "d2h": self.d2h_bytes},
            "traffic_bytes": self.traffic_bytes,
            "transfer_s": self.transfer_seconds,
            "ratio": self.ratio if given else None,
            "fits": self.fits if given else None,
            "stall_s": self.stall_seconds if given else None,
            "fixes": self.fixes() if given else [],
            "micro_batches": self.micro_batches,
            "offload_fraction": self.offload_fraction if given else None,
            "park_or_update": self.park_or_update() if given else None,
        }


def verdict(
    bandwidth,
    window,
    params=None,
    offload=("optimizer",),
    *,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    micro_batches: int = 1,
) -> Verdict:
    """The budget of a step, and — given ``params`` — whether ``offload``'s traffic fits it.

    ``bandwidth`` is one direction's rate alone; ``duplex`` says how the directions share it
    (see the module docstring); ``window`` is the step's compute, all ``micro_batches`` of it.
    """
    rate = parse_bandwidth(bandwidth, "bandwidth")
    seconds = parse_duration(window, "window")
    both, label = both_directions_rate(rate, duplex)
    recipe = memory.get_recipe(recipe).name
    if params is None:
        return Verdict(0.0, 0.0, rate, both, label, seconds, [], recipe)
    count = parse_count(params, "params")
    moved = traffic(offload, recipe, micro_batches)
    return Verdict(
        count * moved.h2d,
        count * moved.d2h,
        rate,
        both,
        label,
        seconds,
        list(moved.offload),
        recipe,
        micro_batches,
    )
