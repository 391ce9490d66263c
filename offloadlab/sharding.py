"""Sharding the training state across the GPUs of a node: what each GPU holds and what it sends.

Data parallelism on N GPUs replicates the model; ZeRO (Rajbhandari et al., 2020) and PyTorch's
FSDP2 split it. For P parameters under mixed-precision Adam (16-bit weights w and gradients g,
fp32 master weights and two fp32 moments: 12 bytes per parameter of optimizer state), each GPU
holds, in bytes:

==========================  =======================  ============================================
strategy                    on each GPU              collectives each step (bytes each GPU sends)
==========================  =======================  ============================================
data parallel (ZeRO-0)      (w + g + 12) P           all-reduce of gradients: 2 (N−1)/N · g P
ZeRO-1 (optimizer split)    (w + g) P + (12 + 4) P/N reduce-scatter of gradients (N−1)/N · g P,
                                                     all-gather of new weights (N−1)/N · w P
ZeRO-2 (and gradients)      w P + (g + 12 + 4) P/N   the same as ZeRO-1
ZeRO-3 (and weights)        (w + 4 + 12) P/N + G     all-gather of weights for forward and again
                                                     for backward, reduce-scatter of gradients:
                                                     (N−1)/N · (2 w + g) P
FSDP2 (fully_shard)         (4 + 4 + 8) P/N + G      the same as ZeRO-3, in FSDP2's dtypes
==========================  =======================  ============================================

Data parallelism can also offload on its own: each GPU keeps (w + g) P and its process keeps a
whole copy of the optimizer state on the host and updates all of it — offloading without sharding.

The "+ 4" is DeepSpeed's fp32 copy of a rank's gradient partition, which its optimizer reads;
FSDP2 has no separate master copy because its sharded parameters *are* fp32 (its gradients, 4 B,
and moments, 8 B, are sharded beside them) and it casts to 16 bits for the all-gather. G is the
gathered working set: ZeRO-3's estimator counts 4 bytes (16-bit weights and gradients) of the
largest module; FSDP2 holds the root unit (embeddings and head) for the whole step and two
blocks (the one computing, the one prefetched), weights and gradients in 16 bits.

The (N−1)/N factor is the ring: to all-gather or reduce-scatter S bytes each GPU sends and
receives (N−1)/N · S, and an all-reduce is one of each. On one GPU nothing moves.

Offload moves state to the host: ``"optimizer"`` (ZeRO-Offload: the fp32 partition and its
update go to the CPU; each GPU sends its gradient shard down and gets w P/N new weights back) or
``"optimizer+parameters"`` (ZeRO-Infinity on the CPU, FSDP2's ``CPUOffloadPolicy``: every sharded
byte lives on the host and each gather first copies the shard up). FSDP2 offers only the second.
Host bytes are per GPU; a node holds ``gpus_per_node`` times as much.

What crosses the host link is what each engine's code copies, not the recipe's dtypes. DeepSpeed
casts each gradient to fp32 on the GPU before it goes down (``stage_1_and_2.py``,
``async_inplace_copy_grad_to_fp32_buffer_from_gpu``; ``stage3.py``, ``partition_grads`` into an
fp32 host buffer): 4 B per parameter down, and the updated 16-bit weights, cast on the host, come
up at w. With its optimizer offloaded, DeepSpeed's ZeRO-3 (0.19, ``stage3.py``) keeps every
rank's 16-bit gradient partitions in one pinned host buffer (``grad_partitions_flat_buffer``):
each micro-batch's reduced gradient is copied into it and straight back to the GPU (g down, g up),
and at the accumulation boundary the GPU copy is cast to fp32 and sent down (4 B). One micro-batch
therefore moves g + 4 = 6 B down and g + w = 4 B up, or g + 2 w = 6 B up with the parameters on
the host too. FSDP2 with ``CPUOffloadPolicy`` keeps fp32 shards on the host: each gather copies the
fp32 shard up (4 B, for forward and again for backward) and each reduced gradient, cast back to
fp32 on the GPU, goes down (4 B). It pins every shard and gradient on its own
(``_fsdp_param.py``), and torch's pinned allocator rounds each request up to a power of two
(pytorch#95823): :func:`fsdp2_pinned_bytes` counts that from the model's tensor shapes.

:func:`layout` gives the bytes per GPU; :func:`deepspeed_estimate` reproduces DeepSpeed's own
estimators and says where and why they differ. Units: bytes and parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import memory
from .units import check_integer, check_non_negative, is_integer, parse_count

__all__ = [
    "STRATEGIES",
    "OFFLOADS",
    "Layout",
    "layout",
    "nvme_layout",
    "valid",
    "ring_bytes",
    "deepspeed_estimate",
    "fsdp2_pinned_bytes",
    "nvme_buffer_elements",
    "NVME_BUFFER_COUNT",
    "NVME_DEFAULT_BUFFER",
]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
OFFLOADS = ("none", "optimizer", "optimizer+parameters")
# bytes per parameter: DeepSpeed keeps its gradient partition in fp32 too
DEEPSPEED_FP32_GRADIENT = 4
# DeepSpeed's estimators' allowance for host buffers ("additional_buffer_factor")
DEEPSPEED_BUFFER_FACTOR = 1.5


def valid(strategy: str, offload: str) -> bool:
    """Whether this combination exists: parameters offload only with full sharding (FSDP2's own
    offload moves them with the optimizer), and data parallel offloads at most the optimizer
    (every GPU a whole copy). offloadlab's CPUOffloadAdam offloads the optimizer under DDP and
    under FSDP2 (each rank its shard)."""
    if strategy == "ddp":
        return offload in ("none", "optimizer")
    return offload != "optimizer+parameters" or strategy in ("zero3", "fsdp2")


def ring_bytes(collective: str, tensor_bytes: float, gpus: int) -> float:
    """Bytes each GPU sends (and receives) in a ring collective over ``tensor_bytes`` on ``gpus``
    GPUs."""
    times = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}
    if collective not in times:
        raise ValueError(f"collective: expected one of {', '.join(times)}; got {collective!r}")
    gpus = check_integer(gpus, "gpus", expected="a whole number of GPUs ≥ 1")
    tensor_bytes = check_non_negative(tensor_bytes, "tensor_bytes")
    return times[collective] * (gpus - 1) / gpus * tensor_bytes


@dataclass(frozen=True)
class Layout:
    """Per GPU: model-state bytes on the GPU and on the host, and the bytes one step moves.

    ``gpu_bytes`` excludes activations and workspace; ``gathered_bytes`` (part of it) is the
    transient working set of gathered weights and their gradients. ``interconnect_overlapped``
    runs during forward and backward (gathers, gradient reductions); ``interconnect_after``
    runs after the update (ZeRO-1/2's all-gather of new weights). ``h2d_bytes``/``d2h_bytes`` cross
    the GPU's host link, ``upload_after`` of the ``h2d_bytes`` after the update (the new 16-bit
    weights; the rest moves during the passes); ``cpu_params`` is how many parameters this GPU's
    rank updates on the CPU.
    """

    strategy: str
    offload: str
    gpus: int
    gpu_bytes: float
    gathered_bytes: float
    host_bytes: float
    interconnect_overlapped: float
    interconnect_after: float
    h2d_bytes: float
    d2h_bytes: float
    cpu_params: float
    nvme_bytes: float = 0.0
    nvme_during_passes: float = 0.0
    nvme_after: float = 0.0
    upload_after: float = 0.0

    @property
    def interconnect_bytes(self) -> float:
        return self.interconnect_overlapped + self.interconnect_after

    @property
    def name(self) -> str:
        label = {
            "ddp": "data parallel",
            "zero1": "ZeRO-1",
            "zero2": "ZeRO-2",
            "zero3": "ZeRO-3",
            "fsdp2": "FSDP2",
        }[self.strategy]
        where = " to NVMe" if self.nvme_bytes else ""
        return label if self.offload == "none" else f"{label} + offload {self.offload}{where}"

    def to_dict(self) -> dict:
        return {**self.__dict__, "name": self.name, "interconnect_bytes": self.interconnect_bytes}


def layout(
    strategy: str,
    offload: str,
    params: float,
    gpus: int,
    *,
    largest_module: float = 0.0,
    block_params: float = 0.0,
    root_params: float = 0.0,
    recipe: str = memory.DEFAULT_RECIPE,
    shapes=None,
) -> Layout:
    """Bytes per GPU of ``strategy`` with ``offload`` for ``params`` parameters on ``gpus`` GPUs.

    ``largest_module`` (ZeRO-3), ``block_params`` and ``root_params`` (FSDP2: one transformer block;
    the embeddings, final norm and head that the root unit holds) size the gathered working set.
    ``shapes``, every weight tensor's shape, lets FSDP2's offload count its pinned copies exactly.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload: expected one of {', '.join(OFFLOADS)}; got {offload!r}")
    if not valid(strategy, offload):
        raise ValueError(f"offload: expected one that {strategy} offers; got {offload!r}")
    check_integer(gpus, "gpus")
    kinds = memory.get_recipe(recipe).bytes_per_param
    w, g = kinds["weights"], kinds["gradients"]
    optimizer = sum(kinds.get(k, 0) for k in ("master_weights", "first_moment", "second_moment"))
    p, n = parse_count(params, "params"), gpus
    shard = p / n
    reduce_grads = ring_bytes("reduce-scatter", g * p, n)
    gather_weights = ring_bytes("all-gather", w * p, n)
    h2d = d2h = cpu = host = upload = 0.0
    after = 0.0
    if strategy == "ddp":
        gathered, overlapped = 0.0, ring_bytes("all-reduce", g * p, n)
        # a whole copy per GPU: state, gradient landing buffer, 16-bit weights
        if offload == "optimizer":
            gpu, host = (w + g) * p, (optimizer + g + w) * p
            d2h, h2d, cpu = g * p, w * p, p
            upload = h2d
        else:
            gpu = (w + g + optimizer) * p
    elif strategy in ("zero1", "zero2"):
        replicated = w + (g if strategy == "zero1" else 0)
        sharded = DEEPSPEED_FP32_GRADIENT + optimizer + (0 if strategy == "zero1" else g)
        gathered, overlapped, after = 0.0, reduce_grads, gather_weights
        if offload == "optimizer":  # the fp32 partition and its update move to the host; ZeRO-2's
            # reduced gradient buckets go straight down, leaving no shard behind
            gpu = replicated * p
            host = (DEEPSPEED_FP32_GRADIENT + optimizer) * shard
            d2h, h2d, cpu = DEEPSPEED_FP32_GRADIENT * shard, w * shard, shard
            upload = h2d
        else:
            gpu = replicated * p + sharded * shard
    elif strategy == "zero3":
        gathered = (w + g) * largest_module
        overlapped = 2 * gather_weights + reduce_grads
        state = w + DEEPSPEED_FP32_GRADIENT + optimizer
        if offload == "none":
            gpu = state * shard + gathered
        # the gradient's host round trip, then fp32 down; new weights up
        elif offload == "optimizer":
            gpu = w * shard + gathered
            host = (DEEPSPEED_FP32_GRADIENT + optimizer) * shard
            d2h, h2d, cpu = (g + DEEPSPEED_FP32_GRADIENT) * shard, (g + w) * shard, shard
            upload = w * shard
        else:  # the 16-bit shard lives on the host too and comes up for forward and for backward
            gpu = gathered
            host = state * shard
            d2h, h2d, cpu = (g + DEEPSPEED_FP32_GRADIENT) * shard, (g + 2 * w) * shard, shard
    else:  # fsdp2: fp32 sharded parameters (the master copy), fp32 sharded gradients, moments
        master = kinds.get("master_weights", 0) or w
        moments = optimizer - kinds.get("master_weights", 0)
        gathered = w * root_params + 2 * (w + g) * block_params
        overlapped = 2 * gather_weights + reduce_grads
        state = master + master + moments  # sharded gradients take the sharded parameters' dtype
        if offload == "none":
            gpu = state * shard + gathered
        # CPUOffloadAdam on each rank's shard: the 16-bit shard stays, its reduced gradient goes
        # down as FSDP2 makes it (into a landing buffer), the fp32 master and moments live and
        # update on the host, and the new 16-bit shard comes up a layer at a time behind them
        elif offload == "optimizer":
            gpu = w * shard + gathered
            host = (optimizer + g + w) * shard
            d2h, h2d, cpu = g * shard, w * shard, shard
            upload = h2d
        # CPUOffloadPolicy: the fp32 shard comes up before each gather; its gradient goes down
        else:
            gpu = gathered
            pinned = fsdp2_pinned_bytes(shapes, n, master) if shapes else 2 * master * shard
            # the moments are the optimizer's own, pageable, unrounded
            host = pinned + moments * shard
            h2d, d2h, cpu = 2 * master * shard, master * shard, shard
    return Layout(
        strategy,
        offload,
        n,
        gpu,
        gathered,
        host,
        overlapped,
        after,
        h2d,
        d2h,
        cpu,
        upload_after=upload,
    )


def fsdp2_pinned_bytes(shapes, gpus: int, element: float = 4) -> float:
    """Host bytes one rank pins under FSDP2's ``CPUOffloadPolicy``: each sharded parameter and its
    sharded gradient, ``element`` bytes a value (fp32), pinned one tensor at a time.

    FSDP2 pads a tensor's first dimension to a multiple of ``gpus`` and keeps one slice
    (``ceil(rows / gpus)`` rows); torch's caching host allocator rounds each pinned request up to
    the next power of two, so a 117 MB shard takes 134 MB (128 MiB).
    """
    gpus = check_integer(gpus, "gpus", expected="a whole number of GPUs ≥ 1")
    total = 0.0
    for index, shape in enumerate(shapes):
        shape = tuple(shape) or (1,)  # a 0-dim parameter: one value, unsharded rows of one
        if not all(is_integer(size) and size >= 0 for size in shape):
            raise ValueError(f"shapes[{index}]: expected whole sizes ≥ 0; got {shape!r}")
        rows, rest = (shape[0], 1) if len(shape) == 1 else (shape[0], _product(shape[1:]))
        nbytes = -(-rows // gpus) * rest * element
        total += 2 * (1 << max(0, math.ceil(math.log2(nbytes)))) if nbytes else 0
    return total


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


# DeepSpeed's NVMe staging, per process: ``buffer_count`` parameter buffers of ``buffer_size``
# 16-bit values (defaults 5 and 1e8, offload_config.py), and the optimizer swapper's 4 buffers of
# one fp32 sub-group (sub_group_size 1e9 parameters).
NVME_BUFFER_COUNT = 5
NVME_DEFAULT_BUFFER = 100_000_000
_OPTIMIZER_SWAP_BYTES = 4 * 1e9 * 4


def nvme_buffer_elements(largest_weight: float, gpus: int) -> int:
    """The ``offload_param.buffer_size`` an NVMe plan needs: at least the largest tensor's shard.

    DeepSpeed's ``partitioned_param_swapper.py`` asserts that each parameter's partition
    (``ceil(numel / gpus)`` elements) fits one buffer; its default of 1e8 is short for a large
    vocabulary's embedding (131,334,144 elements per GPU for Llama 3.1 70B on 8 GPUs).
    """
    shard = -(-int(largest_weight) // gpus)
    return max(NVME_DEFAULT_BUFFER, -(-shard // 2**20) * 2**20)  # rounded up to a whole Mi-element


def nvme_layout(
    params: float,
    gpus: int,
    *,
    largest_module: float = 0.0,
    largest_weight: float = 0.0,
    recipe: str = memory.DEFAULT_RECIPE,
) -> Layout:
    """ZeRO-Infinity with NVMe: ZeRO-3 whose shards (16-bit weights, fp32 optimizer state and
    gradients) live on the drive; the host keeps only pinned staging buffers (``buffer_count``
    buffers of :func:`nvme_buffer_elements` 16-bit values, and the optimizer swapper's).

    Per step each GPU's process reads its 16-bit shard for forward and again for backward while the
    passes run, then reads its fp32 state, updates it on the CPU and writes the state and the new
    16-bit shard back (DeepSpeed's default: reading, updating and writing one after another).
    """
    cpu = layout(
        "zero3", "optimizer+parameters", params, gpus, largest_module=largest_module, recipe=recipe
    )
    kinds = memory.get_recipe(recipe).bytes_per_param
    w = kinds["weights"]
    state = cpu.host_bytes - w * params / gpus  # fp32 optimizer state and gradient partition
    shard = params / gpus
    staging = (
        NVME_BUFFER_COUNT * nvme_buffer_elements(largest_weight, gpus) * 2 + _OPTIMIZER_SWAP_BYTES
    )
    return Layout(
        cpu.strategy,
        cpu.offload,
        gpus,
        cpu.gpu_bytes,
        cpu.gathered_bytes,
        staging,
        cpu.interconnect_overlapped,
        cpu.interconnect_after,
        cpu.h2d_bytes,
        cpu.d2h_bytes,
        cpu.cpu_params,
        nvme_bytes=cpu.host_bytes,
        nvme_during_passes=2 * w * shard,
        nvme_after=2 * state + w * shard,
    )


def deepspeed_estimate(
    stage: int,
    offload: str,
    params: float,
    largest_module: float,
    gpus: int,
    zero_init: bool = True,
    nodes: int = 1,
) -> dict:
    """DeepSpeed's estimate of model-state memory (its
    ``estimate_zero{2,3}_model_states_mem_needs``) for ``nodes`` nodes of ``gpus`` GPUs, rebuilt
    from :func:`layout` plus the three terms where the two differ, each named.

    1. DeepSpeed multiplies host memory by ``additional_buffer_factor`` = 1.5 (pinned buffers,
       allocator slack); :func:`layout` counts the state itself.
    2. Host memory is per *node* in DeepSpeed (all ``gpus`` ranks' shares, for one node);
       :func:`layout` gives one GPU's share.
    3. Loading the model: each process first materialises the full fp32 model (4 B per parameter)
       on the host. DeepSpeed counts that peak where it can exceed the training state — without
       offload, and with ZeRO-2 offload as ``max(4 × GPUs, 16)`` bytes per parameter; ZeRO-3's
       ``zero_init`` builds the model already partitioned and avoids it. Training-time state has
       no such term.

    DeepSpeed's ZeRO-2 estimate has no ZeRO-1 counterpart and ignores ZeRO-2's gradient buckets;
    ZeRO-3's counts the largest module's 16-bit weights and gradients (4 B per parameter) as the
    gathered set, as :func:`layout` does. Returns {'gpu_bytes', 'host_bytes_per_node', 'terms'}.
    """
    if stage not in (2, 3):
        raise ValueError(f"stage: expected 2 or 3 (DeepSpeed estimates those); got {stage!r}")
    strategy = {2: "zero2", 3: "zero3"}[stage]
    parts = layout(strategy, offload, params, gpus * nodes, largest_module=largest_module)
    host_node = parts.host_bytes * gpus
    load_peak = 4 * params * gpus  # every process on the node holds the fp32 model once
    terms = []
    if offload == "none":
        host_node = largest_module * 4 * gpus if stage == 3 and zero_init else load_peak
        terms.append("host: the model-loading peak (fp32 model per process), not training state")
    elif stage == 2:
        if nodes > 1:
            # DeepSpeed's ZeRO-2 estimate puts the whole state, and every rank's fp32 model,
            # on each node
            host_node, load_peak = parts.host_bytes * gpus * nodes, load_peak * nodes
            terms.append("host: DeepSpeed's ZeRO-2 estimate counts every node's ranks on each")
        if load_peak > host_node:
            terms.append(
                f"host: the loading peak (fp32 model in each of {gpus * nodes} processes) exceeds "
                f"the offloaded state"
            )
        host_node = max(host_node, load_peak)
    elif not zero_init and load_peak > host_node:
        terms.append("host: the loading peak without zero_init exceeds the offloaded state")
        host_node = load_peak
    terms.append(f"host × {DEEPSPEED_BUFFER_FACTOR} buffer factor")
    return {
        "gpu_bytes": parts.gpu_bytes,
        "host_bytes_per_node": host_node * DEEPSPEED_BUFFER_FACTOR,
        "terms": terms,
    }
