"""A node of N GPUs: sharding against offloading, each plan fitted as the engine that runs it would.

Every (strategy, offload) that :mod:`offloadlab.sharding` knows is laid out for one GPU of the
node — its share of host memory, cores and link — with activations kept, recomputed, or
recomputed in as few layers as make it fit. Each plan belongs to the engine that runs it:

- ZeRO-1/2/3 are DeepSpeed's. A plan fits only if it fits by DeepSpeed's own estimate too
  (:func:`offloadlab.sharding.deepspeed_estimate`, ``estimate_zero{2,3}_model_states_mem_needs``,
  with ``zero_init`` for ZeRO-3 as the emitted snippet builds under ``deepspeed.zero.Init``): its
  host figure is for the node, with DeepSpeed's 1.5× allowance for buffers, and without ZeRO-3 it
  counts every process loading the fp32 model. Both figures are reported. The update of an
  offloaded shard runs after backward — DeepSpeed checks the gradients' norm and overflow first,
  and clips (``gradient_clipping``) — and its 16-bit result is copied up after it, not beside it.
- FSDP2 (``fully_shard``) runs the script :func:`offloadlab.engines.fsdp_snippet` writes: the
  model built on the meta device, so no process holds a whole copy; with ``CPUOffloadPolicy``
  its pinned shards and gradients (rounded as torch's pinned allocator rounds them) and
  ``torch.optim.AdamW(fused=True)``'s moments on the host, updated after backward.
- Data parallelism is torch's DDP: each process builds the fp32 model (4 B per parameter) before
  moving it to its GPU; with optimizer offload each keeps a whole copy of the state
  (offloadlab's ``CPUOffloadAdam``), whose per-layer uploads follow the updates.

Units: bytes, bytes/s, seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .. import budget, memory, sharding
from ..units import format_duration, format_size
from .single import HIDDEN_FRACTION, activations_name, recompute_choices
from .workload import (
    ASSUMED_COMPUTE,
    ASSUMED_INTERCONNECT,
    ASSUMED_CPU_ADAM,
    Hardware,
    Workload,
    usable_host,
)

__all__ = [
    "NodePlan",
    "NODE_CANDIDATES",
    "node_plans",
    "nvme_plans",
    "engine_of",
    "LOAD_BYTES_PER_PARAM",
]

# The node's candidates, simplest first: on a tie the simpler one is chosen.
NODE_CANDIDATES = tuple(
    (strategy, offload)
    for strategy in sharding.STRATEGIES
    for offload in sharding.OFFLOADS
    if sharding.valid(strategy, offload)
)
# a process that builds the model in fp32 before sharding it holds this much
LOAD_BYTES_PER_PARAM = 4


def engine_of(strategy: str) -> str:
    return {"ddp": "ddp", "fsdp2": "fsdp2"}.get(strategy, "deepspeed")


@dataclass(frozen=True)
class NodePlan:
    """One plan for one GPU of an N-GPU node: how state is sharded and offloaded, and its step.

    Bytes are per GPU (``host_bytes`` is this GPU's share of the state); ``host_need`` is what the
    node must hold for the plan, by the engine's own account (DeepSpeed's estimate, a loading
    peak), and ``host_memory`` is the node's, of which a plan may fill all but
    ``HOST_RESERVE_FRACTION``. The step model: collectives that run during forward
    and backward (weight gathers, gradient reductions) and the link's traffic in those passes
    overlap compute, each on its own wire; after backward come the CPU update of this GPU's shard
    on its Nth of the cores, its upload (after the update for DeepSpeed, ``serial_upload``;
    alongside it for offloadlab's per-layer pipeline), and ZeRO-1/2's all-gather of the new
    weights. The GPU's own Adam update (memory-bound, milliseconds) is left out.
    """

    layout: sharding.Layout
    recompute: bool
    gpu_bytes: float
    t_compute: float
    t_interconnect: float
    t_interconnect_after: float
    t_transfer: float
    t_upload_after: float
    t_cpu: float
    gpu_usable: float
    host_memory: float | None
    t_nvme_passes: float = 0.0
    t_nvme_after: float = 0.0
    checkpointed: int = 0
    layers: int = 0
    host_need: float = 0.0
    estimate: dict | None = None
    serial_upload: bool = False
    gpu_terms: dict = field(default_factory=dict, compare=False)
    node_gpus: int = 1  # GPUs a node (``layout.gpus`` is every node's)
    context: int = 1  # GPUs splitting each sequence (context parallelism)
    t_step_delayed = None

    @property
    def nodes(self) -> int:
        return self.layout.gpus // self.node_gpus

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def offload(self) -> str:
        return self.layout.offload

    @property
    def engine(self) -> str:
        return engine_of(self.strategy)

    @property
    def host_bytes(self) -> float:
        return self.layout.host_bytes

    @property
    def h2d_bytes(self) -> float:
        return self.layout.h2d_bytes

    @property
    def d2h_bytes(self) -> float:
        return self.layout.d2h_bytes

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_bytes <= self.gpu_usable

    @property
    def fits_host(self) -> bool:
        return self.host_memory is None or self.host_need <= usable_host(self.host_memory)

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def step(self) -> float:
        """Predicted seconds per step: the overlapped passes, then the update and what follows
        it."""
        passes = max(self.t_compute, self.t_interconnect, self.t_transfer, self.t_nvme_passes)
        update = self.t_cpu + self.t_nvme_after
        after = (
            update + self.t_upload_after if self.serial_upload else max(update, self.t_upload_after)
        )
        return passes + after + self.t_interconnect_after

    @property
    def waiting(self) -> float:
        return self.step - self.t_compute

    @property
    def binding(self) -> str:
        """What limits this plan: the memory it does not fit, or what its step waits on."""
        gpus = self.node_gpus
        if not self.fits_gpu:
            return (
                f"GPU memory: needs {format_size(self.gpu_bytes)} of the "
                f"{format_size(self.gpu_usable)} usable"
            )
        if not self.fits_host:
            whose = "by DeepSpeed's estimate" if self.estimate else "for the node"
            return (
                f"host memory: needs {format_size(self.host_need)} {whose} "
                f"({format_size(self.host_bytes)} per GPU of state) of the "
                f"{format_size(usable_host(self.host_memory))} usable of the node's "
                f"{format_size(self.host_memory)}"
                + (
                    f", {format_size(usable_host(self.host_memory) / gpus)} a GPU"
                    if gpus > 1
                    else ""
                )
            )
        if self.waiting <= HIDDEN_FRACTION * self.step:
            return "compute: collectives and transfers hide behind it"
        share = (
            f"of a {format_duration(self.step)} step, {format_duration(self.t_compute)} of it "
            "compute"
        )
        wire = "the network" if self.nodes > 1 else "the interconnect"
        waits = {
            wire: max(0.0, self.t_interconnect - self.t_compute) + self.t_interconnect_after,
            "the link": max(0.0, self.t_transfer - max(self.t_compute, self.t_interconnect))
            + (
                self.t_upload_after
                if self.serial_upload
                else max(0.0, self.t_upload_after - self.t_cpu)
            ),
            "the CPU": self.t_cpu,
            "the NVMe drive": max(
                0.0, self.t_nvme_passes - max(self.t_compute, self.t_interconnect, self.t_transfer)
            )
            + self.t_nvme_after,
        }
        worst = max(waits, key=waits.get)
        what = {
            wire: "collectives take "
            + format_duration(self.t_interconnect + self.t_interconnect_after),
            "the link": f"transfers take {format_duration(self.t_transfer + self.t_upload_after)}",
            "the CPU": f"its update of this GPU's shard takes {format_duration(self.t_cpu)} on an "
            "Nth of the cores",
            "the NVMe drive": f"reading and writing the state takes "
            f"{format_duration(self.t_nvme_passes + self.t_nvme_after)}",
        }
        return f"{worst}: {what[worst]} {share}"

    @property
    def name(self) -> str:
        split = f", context parallel over {self.context}" if self.context > 1 else ""
        return f"{self.layout.name}{split}, {activations_name(self.checkpointed, self.layers)}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "engine": self.engine,
            "strategy": self.strategy,
            "offload": self.offload,
            "recompute": self.recompute,
            "checkpointed_layers": self.checkpointed,
            "gpus": self.layout.gpus,
            "nodes": self.nodes,
            "context_parallel": self.context,
            "gpu_bytes": self.gpu_bytes,
            "gpu_terms": self.gpu_terms,
            "host_bytes_per_gpu": self.host_bytes,
            "host_bytes_per_node": self.host_bytes * self.node_gpus,
            "host_need_per_node": self.host_need,
            "deepspeed_estimate": self.estimate,
            "bytes_per_direction": {"h2d": self.h2d_bytes, "d2h": self.d2h_bytes},
            "interconnect_bytes_per_gpu": self.layout.interconnect_bytes,
            "t_compute_s": self.t_compute,
            "t_interconnect_s": self.t_interconnect + self.t_interconnect_after,
            "t_transfer_s": self.t_transfer + self.t_upload_after,
            "t_cpu_s": self.t_cpu,
            "nvme_bytes_per_gpu": self.layout.nvme_bytes,
            "t_nvme_s": self.t_nvme_passes + self.t_nvme_after,
            "step_s": self.step,
            "waiting_s": self.waiting,
            "fits": self.fits,
            "fits_gpu": self.fits_gpu,
            "fits_host": self.fits_host,
            "binding": self.binding,
        }


def _parts(
    work: Workload, gpus: int, strategy: str, offload: str, recipe: str, nvme: bool
) -> sharding.Layout:
    if nvme:
        return sharding.nvme_layout(
            work.params,
            gpus,
            largest_module=work.largest_module_params(),
            largest_weight=work.largest_weight_params(),
            recipe=recipe,
        )
    return sharding.layout(
        strategy,
        offload,
        work.params,
        gpus,
        largest_module=work.largest_module_params(),
        block_params=work.layer_params(),
        root_params=work.root_params(),
        recipe=recipe,
        shapes=work.weight_shapes(),
    )


def _estimate(work: Workload, parts: sharding.Layout, hw: Hardware) -> dict | None:
    """DeepSpeed's own estimate for a ZeRO plan (ZeRO-1 by ZeRO-2's, which has the same host
    state)."""
    if engine_of(parts.strategy) != "deepspeed" or parts.nvme_bytes:
        return None
    stage = 3 if parts.strategy == "zero3" else 2
    return sharding.deepspeed_estimate(
        stage,
        parts.offload,
        work.params,
        work.largest_module_params(),
        hw.gpus_per_node,
        nodes=hw.nodes,
    )


def _host_need(work: Workload, parts: sharding.Layout, estimate: dict | None, n: int) -> float:
    """Host memory one node of ``n`` GPUs needs for ``parts``."""
    node = parts.host_bytes * n
    if estimate is not None:
        return max(node, estimate["host_bytes_per_node"])
    # each process builds the whole fp32 model before moving it to its GPU
    if parts.strategy == "ddp":
        return max(node, LOAD_BYTES_PER_PARAM * work.params * n)
    return node


def _node_plan(
    work: Workload,
    hw: Hardware,
    strategy: str,
    offload: str,
    checkpointed: int,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    nvme: bool = False,
) -> NodePlan:
    """One GPU's plan on ``hw``'s nodes of N GPUs (data parallel: each GPU its own micro-batch
    of ``work``, the state sharded over every GPU of every node); with ``nvme``, ZeRO-Infinity's
    layout on each node's NVMe drive (shared by its GPUs)."""
    n, mine = hw.gpus_per_node, hw.share()
    parts = _parts(work, hw.gpus, strategy, offload, recipe, nvme)
    estimate = _estimate(work, parts, hw)
    state = max(parts.gpu_bytes, estimate["gpu_bytes"] if estimate else 0.0)
    element = int(memory.get_recipe(recipe).weight_bytes)
    activations = work.activations(checkpointed, element)
    gpu = state + activations.total
    terms = {
        "model state": state - parts.gathered_bytes,
        "gathered weights": parts.gathered_bytes,
        **activations.terms(),
    }
    net = hw.collective_rate
    # a context group sits within a node: its ring of keys and values runs over the interconnect,
    # beside attention (counted with the collectives, as if on one wire)
    ring = work.context_bytes(checkpointed, element) / (hw.interconnect or ASSUMED_INTERCONNECT)
    both, _ = budget.both_directions_rate(mine.link, duplex)
    # With only the optimizer offloaded the new weights go up after the update; with parameters
    # offloaded they stay on the host and come up with the next step's gathers.
    after_update = parts.upload_after
    t_compute = work.compute_flops(checkpointed) / (hw.compute or ASSUMED_COMPUTE)
    drive = (hw.nvme or float("inf")) / n  # the drive's sustained rate, shared by the node's GPUs
    return NodePlan(
        parts,
        checkpointed > 0,
        gpu,
        t_compute,
        parts.interconnect_overlapped / net + ring,
        parts.interconnect_after / net,
        budget.link_seconds(parts.h2d_bytes - after_update, parts.d2h_bytes, mine.link, both),
        after_update / mine.link,
        parts.cpu_params / (mine.cpu_adam or ASSUMED_CPU_ADAM),
        hw.usable_gpu_memory,
        hw.host_memory,
        parts.nvme_during_passes / drive,
        parts.nvme_after / drive,
        checkpointed,
        work.layers,
        _host_need(work, parts, estimate, n),
        estimate,
        serial_upload=engine_of(strategy) == "deepspeed",
        gpu_terms=terms,
        node_gpus=n,
        context=work.context,
    )


def _variants(
    work: Workload,
    hw: Hardware,
    strategy: str,
    offload: str,
    duplex: str,
    recipe: str,
    nvme: bool = False,
    recompute="auto",
) -> list[NodePlan]:
    def fits_with(k):
        return _node_plan(work, hw, strategy, offload, k, duplex, recipe, nvme).fits_gpu

    return [
        _node_plan(work, hw, strategy, offload, k, duplex, recipe, nvme)
        for k in recompute_choices(work, fits_with, recompute)
    ]


def nvme_plans(
    work: Workload, hw: Hardware, duplex: str, recipe: str, recompute="auto"
) -> list[NodePlan]:
    """ZeRO-Infinity on NVMe, activations kept or recomputed: the tier after host memory."""
    return _variants(
        work, hw, "zero3", "optimizer+parameters", duplex, recipe, nvme=True, recompute=recompute
    )


def node_plans(
    work: Workload,
    hw: Hardware,
    duplex: str = "full",
    recipe: str = memory.DEFAULT_RECIPE,
    recompute="auto",
) -> list[NodePlan]:
    """Every (strategy, offload) on the node, with its activation choices (see
    ``recompute_choices``); where none fits, the same with each sequence split over 2, 4 … of a
    node's GPUs (context parallelism), up to the first split with a plan that fits."""

    def every(work):
        return [
            plan
            for strategy, offload in NODE_CANDIDATES
            for plan in _variants(work, hw, strategy, offload, duplex, recipe, recompute=recompute)
        ]

    plans = every(work)
    split = 2
    while not any(p.fits for p in plans) and split <= hw.gpus_per_node:
        if hw.gpus_per_node % split == 0 and work.seq % split == 0:
            plans += every(dataclasses.replace(work, context=split))
        split *= 2
    return plans
