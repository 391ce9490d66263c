"""Choosing a plan: the least offload that fits on one GPU, the fastest plan that fits on a node.

:func:`plan` builds every plan (:mod:`.single` for one GPU, :mod:`.node` for several), keeps those
that fit, picks one and says why: what binds it, what the runner-up would cost, when offload is
the wrong tool, and when nothing fits — naming the term that does not fit and the levers that
act on it. Units: bytes, bytes/s, seconds.
"""

from __future__ import annotations

from .. import budget, memory
from ..units import check_integer, format_bandwidth, format_duration, format_size
from .node import NodePlan, node_plans, nvme_plans
from .report import PlanReport
from .share import optimizer_share
from .single import Plan, candidates, gpu_binding, single_gpu_plans
from .workload import ASSUMED_NVME, Hardware, Workload

__all__ = ["plan"]

_NVME_NOTE = (
    "host memory cannot hold the offloaded state, so the plan keeps it on NVMe (ZeRO-Infinity): "
    "each step reads and writes it at the drive's speed, and a drive rated for a few full writes a "
    "day wears out in weeks at that rate (chapter 8)"
)


def plan(
    work: Workload,
    hw: Hardware,
    *,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    clipping: bool = False,
    recompute="auto",
    micro_batches: int = 1,
) -> PlanReport:
    """Choose the least offload that fits; within a level, the faster activation choice.

    ``duplex`` is how the link's two directions share it ('full', 'half' or a measured rate;
    see :mod:`offloadlab.budget`); ``recipe`` gives the bytes per parameter of each kind of state;
    ``clipping`` (global-norm gradient clipping) holds every update until backward is done;
    ``recompute`` is 'auto' (keep, recompute every layer, or the fewest layers that fit), 'none',
    'all' or a number of layers; ``micro_batches`` (per optimizer step) sizes the window a
    plan that offloads the optimizer hides its traffic behind, and decides whether its share is
    updated in place or parked (:mod:`.share`).
    """
    if not isinstance(work, Workload):
        raise TypeError(f"work: expected an offloadlab.Workload; got {work!r}")
    if not isinstance(hw, Hardware):
        raise TypeError(f"hw: expected an offloadlab.Hardware; got {hw!r}")
    check_integer(micro_batches, "micro_batches")
    recipe = memory.get_recipe(recipe).name
    budget.both_directions_rate(hw.link, duplex)  # refuse a bad duplex before planning
    ranking = candidates(work, recipe)
    if hw.gpus > 1:
        plans, chosen, runner_up, warnings = _plan_node(work, hw, duplex, recipe, recompute)
        return PlanReport(work, hw, plans, chosen, runner_up, ranking, warnings, duplex, recipe)
    plans = single_gpu_plans(work, hw, duplex, recipe, clipping, recompute)
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.level, p.step))
    # host memory is short: the next tier, NVMe
    if not fitting and hw.nvme and any(p.fits_gpu for p in plans):
        on_drive = [p for p in nvme_plans(work, hw, duplex, recipe, recompute) if p.fits]
        if on_drive:
            plans += on_drive
            best, *rest = sorted(on_drive, key=lambda p: p.step)
            return PlanReport(
                work,
                hw,
                plans,
                best,
                rest[0] if rest else None,
                ranking,
                [_NVME_NOTE],
                duplex,
                recipe,
            )
    chosen = fitting[0] if fitting else None
    others = sorted((p for p in fitting[1:]), key=lambda p: p.step)
    runner_up = others[0] if others else None
    warnings = []
    if chosen is None:
        warnings += _nothing_fits_on_one_gpu(work, hw, plans, duplex, recipe)
    elif chosen.level == 0:
        warnings.append("offload is not needed: the whole state fits on the GPU")
    else:
        if hw.comm_fraction >= WRONG_TOOL_SHARE:
            warnings.append(_WRONG_TOOL.format(hw.comm_fraction))
        if chosen.t_transfer > 2 * chosen.t_compute:
            warnings.append(
                "offload makes this run bandwidth-bound: a larger batch, a faster link or more "
                "GPUs (sharding instead of offloading) would serve it better"
            )
    share = None
    if chosen is not None and chosen.offload == "optimizer":
        share = optimizer_share(
            chosen, work, hw, duplex=duplex, recipe=recipe, micro_batches=micro_batches
        )
    return PlanReport(work, hw, plans, chosen, runner_up, ranking, warnings, duplex, recipe, share)


# From this share of the step spent exchanging gradients on, offload is called the wrong tool: a
# judgement, not a law (its traffic shares the PCIe switch the NIC sits behind on HGX nodes).
WRONG_TOOL_SHARE = 0.3
_WRONG_TOOL = (
    "offload is the wrong tool here: the run already spends {:.0%} of its step on communication; "
    "offload adds traffic — move less instead"
)


def _nothing_fits_on_one_gpu(
    work: Workload, hw: Hardware, plans: list[Plan], duplex: str, recipe: str
) -> list[str]:
    warnings = []
    most = min(plans, key=lambda p: p.gpu_bytes)
    if not most.fits_gpu:
        warnings.append(
            "nothing fits: even with everything offloaded and activations recomputed the GPU "
            f"needs {format_size(most.gpu_bytes)}; what binds is "
            f"{gpu_binding(most.gpu_terms, most.gpu_usable)}"
        )
        return warnings
    least = min((p for p in plans if p.fits_gpu), key=lambda p: p.host_bytes)
    warnings.append(
        f"nothing fits: the GPU holds it once {least.offload} are offloaded "
        f"({format_size(least.gpu_bytes)} of {format_size(least.gpu_usable)}), but host memory "
        f"does not: that needs {format_size(least.host_bytes)} of host memory against "
        f"the {format_size(hw.usable_host_memory)} usable of {format_size(hw.host_memory)}; the "
        "next tier, NVMe, can hold it at a lower speed"
        + ("" if hw.nvme else " (give the drive's bandwidth, --nvme, to plan on it)")
    )
    if not hw.nvme:  # what the next tier would give, at an assumed rate
        on_drive = [
            p for p in nvme_plans(work, hw.replaced(nvme=ASSUMED_NVME), duplex, recipe) if p.fits
        ]
        if on_drive:
            best = min(on_drive, key=lambda p: p.step)
            warnings.append(
                f"on an NVMe drive sustaining {format_bandwidth(ASSUMED_NVME)} (an assumption) it "
                f"would fit, at {format_duration(best.step)} a step ({best.name}); pass --nvme "
                "with your drive's rate (`offloadlab probe --disk FOLDER` measures it) to plan on "
                "it"
            )
    return warnings


def _plan_node(
    work: Workload, hw: Hardware, duplex: str, recipe: str, recompute="auto"
) -> tuple[list[NodePlan], NodePlan | None, NodePlan | None, list[str]]:
    """Every sharding and offload choice on the node; the fastest that fits (the simpler on a
    tie)."""
    plans = node_plans(work, hw, duplex, recipe, recompute)
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
    warnings = []
    # the next tier: NVMe, at its speed
    if not fitting and hw.nvme and any(p.fits_gpu for p in plans):
        plans += nvme_plans(work, hw, duplex, recipe, recompute)
        fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
        if fitting:
            warnings.append(_NVME_NOTE)
    chosen = fitting[0] if fitting else None
    runner_up = fitting[1] if len(fitting) > 1 else None
    if chosen is None:
        warnings.append(_nothing_fits_on_a_node(hw, plans))
    else:
        alone = [p for p in fitting if p.strategy == "ddp" and p.offload != "none"]
        if alone and chosen.strategy != "ddp":
            warnings.append(
                f"offloading alone ({alone[0].name}) would take {format_duration(alone[0].step)} a "
                f"step and {format_size(alone[0].host_bytes * hw.gpus_per_node)} of host memory: "
                f"every GPU keeps and updates a whole copy"
            )
        if chosen.t_cpu:
            warnings.append(
                "each rank's CPU update runs on its Nth of the cores: bind its threads and its "
                "pinned buffers to the NUMA node next to its GPU (numactl, or DeepSpeed's "
                "--bind_cores_to_rank); across sockets both slow down"
            )
        if hw.comm_fraction >= WRONG_TOOL_SHARE and chosen.offload != "none":
            warnings.append(_WRONG_TOOL.format(hw.comm_fraction))
    return plans, chosen, runner_up, warnings


def _nothing_fits_on_a_node(hw: Hardware, plans: list[NodePlan]) -> str:
    """Name the plan closest to fitting, what does not fit, and what would help."""
    on_gpus = [p for p in plans if p.fits_gpu]
    n = hw.gpus
    if on_gpus:  # host memory binds: more nodes or the NVMe tier hold the state
        least = min(on_gpus, key=lambda p: p.host_need)
        return (
            f"nothing fits on {n} GPUs: {least.binding} even with {least.name}; add nodes (more "
            f"host memory for the state), or offload to NVMe (--nvme)"
        )
    least = min(plans, key=lambda p: p.gpu_bytes)
    return (
        f"nothing fits on {n} GPUs: even {least.name} needs {format_size(least.gpu_bytes)} a GPU; "
        f"what binds is {gpu_binding(least.gpu_terms, least.gpu_usable)}"
    )
