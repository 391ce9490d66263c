"""How much of the optimizer to offload, and where to update it: chapter 4's "offload less" and
chapter 6's "park or update in place", for a plan that offloads the optimizer.

Offloading a share F of the parameters' optimizer state moves F of the traffic, gives the CPU F
of the update and keeps (1 − F) of the state on the GPU. Link and CPU time grow with F and GPU
memory shrinks with it, so the choice is the largest F whose link time and CPU update each still
hide behind the step's compute, provided the state kept fits the GPU's spare memory. Where no F
does both, memory sets the share and the step stalls.

Parking (state up for a GPU update and back down, once a step) is the other placement: in place
moves w + k·g bytes a parameter for k micro-batches and keeps the CPU busy, parking 2·s, with w,
g and s the recipe's weight, gradient and optimizer-state bytes. The placement that hides the
larger share is chosen (or, when neither hides what memory needs, the one busy for less).

Units: bytes, bytes/s, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import budget, memory
from ..units import format_duration, format_size
from .single import Plan
from .workload import Hardware, Workload

__all__ = [
    "OptimizerShare",
    "optimizer_share",
    "in_place_bytes",
    "parked_bytes",
    "crossover",
    "MEGATRON_FLAGS",
]

MEGATRON_FLAGS = (
    "--optimizer-cpu-offload --optimizer-offload-fraction {f:g} --overlap-cpu-optimizer-d2h-h2d"
)


def in_place_bytes(recipe: str, micro_batches: int) -> tuple[float, float]:
    """(up, down) bytes a parameter per step when the CPU updates its state in place: the weight
    up, and a gradient down per micro-batch."""
    r = memory.get_recipe(recipe)
    return r.weight_bytes, micro_batches * r.gradient_bytes


def parked_bytes(recipe: str) -> tuple[float, float]:
    """(up, down) bytes a parameter per step when its state is parked: the optimizer state up for
    the GPU's update and back down, whatever the number of micro-batches."""
    state = memory.get_recipe(recipe).optimizer_bytes
    return state, state


def crossover(recipe: str) -> int:
    """The fewest micro-batches a step at which parking moves fewer bytes than updating in place."""
    r = memory.get_recipe(recipe)
    return math.floor((2 * r.optimizer_bytes - r.weight_bytes) / r.gradient_bytes) + 1


@dataclass(frozen=True)
class OptimizerShare:
    """The share to offload (``offload_fraction``), where to update it (``update_on``), and why."""

    offload_fraction: float
    update_on: str
    micro_batches: int
    largest_hidden: float  # the largest F whose link time and CPU update hide behind the compute
    smallest_fitting: float  # the smallest F whose kept state fits the GPU
    window_s: float  # the step's compute: every micro-batch's forward and backward
    link_s: float  # link time of the offloaded share's traffic, updated where chosen
    cpu_s: float  # CPU time of its update (0 when parked: the GPU updates it)
    in_place_per_param: float  # bytes a parameter per step, both directions
    parked_per_param: float
    crossover: int  # micro-batches from which parking moves fewer bytes
    reason: str

    @property
    def stall_s(self) -> float:
        return max(0.0, self.link_s - self.window_s, self.cpu_s - self.window_s)

    def lines(self) -> list[str]:
        f = self.offload_fraction
        where = "parked, updated on the GPU" if self.update_on == "device" else "updated on the CPU"
        hidden = f": stalls {format_duration(self.stall_s)}" if self.stall_s else ": hidden"
        cpu = format_duration(self.cpu_s) if self.cpu_s else "none (the GPU updates it)"
        return [
            f"  optimizer share: offload_fraction={f:g}, {where}: {self.reason}",
            f"    link {format_duration(self.link_s)}, CPU update {cpu}, "
            f"against {format_duration(self.window_s)} of compute ({self.micro_batches} "
            f"micro-batch(es) a step){hidden}",
            f"    bytes a parameter per step: {self.in_place_per_param:g} in place, "
            f"{self.parked_per_param:g} parked (parking moves fewer from {self.crossover} "
            "micro-batches a step)",
            f"    offloadlab: CPUOffloadAdam(..., offload_fraction={f:g}, "
            f"update_on={self.update_on!r}); Megatron-Core: {MEGATRON_FLAGS.format(f=f)}",
        ]

    def to_dict(self) -> dict:
        return {
            "offload_fraction": self.offload_fraction,
            "update_on": self.update_on,
            "micro_batches": self.micro_batches,
            "largest_hidden_fraction": self.largest_hidden,
            "smallest_fitting_fraction": self.smallest_fitting,
            "window_s": self.window_s,
            "link_s": self.link_s,
            "cpu_s": self.cpu_s,
            "stall_s": self.stall_s,
            "in_place_bytes_per_param": self.in_place_per_param,
            "parked_bytes_per_param": self.parked_per_param,
            "parking_fewer_from_micro_batches": self.crossover,
            "reason": self.reason,
            "megatron_core": MEGATRON_FLAGS.format(f=self.offload_fraction),
        }


def optimizer_share(
    plan: Plan,
    work: Workload,
    hw: Hardware,
    *,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    micro_batches: int = 1,
) -> OptimizerShare:
    """The optimizer share for ``plan`` (one that offloads the whole optimizer state), with
    ``micro_batches`` forward and backward passes of ``plan.t_compute`` each per step (the
    plan's CPU update, ``plan.t_cpu``, is that of the whole state).

    Fractions are rounded to hundredths, down for what hides and up for what fits.
    """
    r = memory.get_recipe(recipe)
    params = work.params
    both, _ = budget.both_directions_rate(hw.link, duplex)
    window = micro_batches * plan.t_compute
    up, down = in_place_bytes(recipe, micro_batches)
    state_up, state_down = parked_bytes(recipe)
    whole_link = budget.link_seconds(params * up, params * down, hw.link, both)
    parked_link = budget.link_seconds(params * state_up, params * state_down, hw.link, both)
    # seconds of link or CPU each placement keeps busy, offloading everything
    busy = {"cpu": max(whole_link, plan.t_cpu), "device": parked_link}
    hidden = {where: min(1.0, window / seconds) for where, seconds in busy.items()}
    room = plan.gpu_usable - plan.gpu_bytes  # the plan keeps none of the state on the GPU
    smallest_fitting = min(1.0, max(0.0, 1.0 - room / (params * r.optimizer_bytes)))
    fits = math.ceil(smallest_fitting * 100) / 100
    # the placement that hides the larger share (in place on a tie: no GPU time spent)
    update_on = "device" if hidden["device"] > hidden["cpu"] else "cpu"
    hides = math.floor(hidden[update_on] * 100) / 100
    how = "parked" if update_on == "device" else "updated in place"
    if fits <= hides:
        share = hides
        reason = (
            f"all of it, {how}: its traffic and CPU update hide behind the compute"
            if share == 1
            else f"the largest share whose traffic and CPU update hide behind the compute, {how}; "
            f"the state kept ({format_size((1 - share) * params * r.optimizer_bytes)}) fits the GPU"
        )
    else:
        share = fits
        update_on = "device" if busy["device"] < busy["cpu"] else "cpu"
        reason = (
            "no share both hides and fits, so the GPU's memory sets it; at "
            f"{micro_batches} micro-batch(es) a step "
            + ("parking" if update_on == "device" else "updating in place")
            + " keeps the link and CPU busy for less"
        )
    parking = update_on == "device"
    return OptimizerShare(
        share,
        update_on,
        micro_batches,
        hidden[update_on],
        smallest_fitting,
        window,
        share * (parked_link if parking else whole_link),
        0.0 if parking else share * plan.t_cpu,
        up + down,
        state_up + state_down,
        crossover(recipe),
        reason,
    )
