"""Configurations for the engines that run a plan at scale: a DeepSpeed config and an FSDP2 snippet.

A :class:`Setup` says what to run in engine-neutral terms — how the state is sharded, what is
offloaded and where, whether activations are recomputed, the batch and the optimizer — and
:func:`deepspeed_config` / :func:`fsdp_snippet` write it for each engine. Both are complete
enough to run as written: the suite validates the DeepSpeed config with DeepSpeed's own
``DeepSpeedConfig`` and runs the FSDP2 snippet under ``torchrun`` on two CPU processes.
:func:`setup` reads a :class:`Setup` off a planner report's chosen plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import sharding

__all__ = ["Setup", "setup", "offered", "deepspeed_config", "deepspeed_snippet", "fsdp_snippet"]

NVME_PATH_PLACEHOLDER = "/local_nvme"  # written when the plan goes to NVMe and no path was given
_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
# The planner's single-GPU offload levels as DeepSpeed runs them (partitioning is a no-op on one GPU).
_LEVEL_STRATEGY = {"nothing": ("ddp", "none"), "optimizer": ("zero2", "optimizer"),
                   "optimizer+gradients": ("zero2", "optimizer"),
                   "optimizer+gradients+parameters": ("zero3", "optimizer+parameters")}


def offered(strategy: str, offload: str) -> bool:
    """Whether DeepSpeed and FSDP2 run this combination: they offload only sharded state."""
    return sharding.valid(strategy, offload) and not (strategy == "ddp" and offload != "none")


@dataclass(frozen=True)
class Setup:
    """One training configuration, engine-neutral.

    ``strategy`` and ``offload`` are :mod:`offloadlab.sharding`'s names; ``offload_device`` is
    'cpu' or 'nvme' (with ``nvme_path``, ZeRO-3 only); ``micro_batch`` is per GPU and
    ``accumulation`` the micro-batches per optimizer step, so a step sees
    micro_batch × accumulation × gpus sequences. ``blocks`` is the Python expression that names
    the model's list of transformer blocks (``model.model.layers`` for Hugging Face Llama).
    """

    strategy: str = "zero2"
    offload: str = "none"
    recompute: bool = False
    gpus: int = 1
    micro_batch: int = 1
    accumulation: int = 1
    precision: str = "bf16"
    offload_device: str = "cpu"
    nvme_path: str | None = None
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    blocks: str = "model.model.layers"

    def __post_init__(self):
        if self.strategy not in sharding.STRATEGIES or self.offload not in sharding.OFFLOADS \
                or not offered(self.strategy, self.offload):
            raise ValueError(f"offload: expected a combination the engines offer; got {self.strategy} with "
                             f"offload {self.offload!r}")
        for name in ("gpus", "micro_batch", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer; got {value!r}")
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"precision: expected 'bf16' or 'fp16'; got {self.precision!r}")
        if self.offload_device not in ("cpu", "nvme"):
            raise ValueError(f"offload_device: expected 'cpu' or 'nvme'; got {self.offload_device!r}")
        if self.offload_device == "nvme":
            if not self.nvme_path:
                raise ValueError("nvme_path: expected the folder on the NVMe drive to offload to; got nothing")
            if self.strategy != "zero3":
                raise ValueError(f"offload_device: DeepSpeed offloads to NVMe only with ZeRO-3; the plan uses "
                                 f"{self.strategy}")

    @property
    def stage(self) -> int:
        return _STAGE[self.strategy]


def setup(report, **options) -> Setup:
    """The :class:`Setup` of a planner report's chosen plan; ``options`` set the rest (batch, optimizer…)."""
    chosen = report.chosen
    if chosen is None:
        raise ValueError("report: nothing fits, so there is no configuration to emit")
    layout = getattr(chosen, "layout", None)  # a node plan carries its sharding layout
    if layout is None:  # a single-GPU offload level
        strategy, offload = _LEVEL_STRATEGY[chosen.offload]
    else:
        strategy, offload = layout.strategy, layout.offload
    if strategy == "ddp" and offload != "none":  # engines shard what they offload: less host memory, same GPU
        strategy = "zero1"
    gpus = getattr(report.hardware, "gpus_per_node", 1)
    options = {"micro_batch": report.work.batch, **options}
    if layout is not None and layout.nvme_bytes:  # ZeRO-Infinity on the drive
        options.update(offload_device="nvme", nvme_path=options.get("nvme_path") or NVME_PATH_PLACEHOLDER)
    return Setup(strategy, offload, chosen.recompute, gpus, **options)


def deepspeed_config(config: Setup) -> dict:
    """A complete DeepSpeed config for ``config`` (pass it to ``deepspeed.initialize(config=...)``).

    With optimizer offload the ``optimizer`` block is required: DeepSpeed then builds its own
    DeepSpeedCPUAdam, where a client torch optimizer is refused (``zero_force_ds_cpu_optimizer``).
    Recomputation is not a config setting — DeepSpeed's ``activation_checkpointing`` section only
    tunes ``deepspeed.checkpointing`` for a model that calls it — so the config has no such
    section and :func:`deepspeed_snippet` turns recomputation on in the model itself.
    """
    zero: dict = {"stage": config.stage}
    if config.stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=True, reduce_scatter=True)
    if config.offload != "none":
        target = {"device": config.offload_device, "pin_memory": True}
        if config.offload_device == "nvme":
            target["nvme_path"] = config.nvme_path
        zero["offload_optimizer"] = dict(target)
        if config.offload == "optimizer+parameters":
            zero["offload_param"] = dict(target)
    if config.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    precision = {"bf16": {"enabled": True}} if config.precision == "bf16" else \
        {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}
    result = {
        "train_batch_size": config.micro_batch * config.accumulation * config.gpus,
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.accumulation,
        "gradient_clipping": 1.0,
        **precision,
        "optimizer": {"type": "AdamW", "params": {"lr": config.lr, "betas": list(config.betas), "eps": config.eps,
                                                  "weight_decay": config.weight_decay}},
        "zero_optimization": zero,
    }
    if config.offload_device == "nvme":  # asynchronous I/O for the NVMe tier (see chapter 8)
        result["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                         "intra_op_parallelism": 1}  # DeepSpeed 0.19's names and defaults (swap_tensor/constants.py)
    return result


def _recompute_lines(config: Setup) -> list[str]:
    return [f"for block in {config.blocks}:  # recompute each block's activations in backward",
            "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)"]


def deepspeed_snippet(config: Setup) -> str:
    """The Python that goes with :func:`deepspeed_config`: recompute if the plan does, then initialize.

    Recomputation uses ``torch.utils.checkpoint`` (non-reentrant, which ZeRO-3 supports and which
    passes keyword arguments through, as Hugging Face blocks need).
    """
    lines = ["# DeepSpeed: launch with `deepspeed train.py` (or torchrun); `model` is built and `config` is",
             "# the JSON above, loaded as a dict.",
             *(["import functools", ""] if config.recompute else []),
             "import deepspeed"]
    if config.recompute:
        lines += ["from torch.utils.checkpoint import checkpoint", "", *_recompute_lines(config)]
    lines += ["", "engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),",
              "                                                config=config)",
              "# each micro-batch: loss = engine(inputs, targets); engine.backward(loss); engine.step()"]
    return "\n".join(lines)


def fsdp_snippet(config: Setup) -> str:
    """A runnable FSDP2 snippet for ``config``: shard each block and the root, then build AdamW.

    Weights are gathered and gradients reduce-scattered in 16 bits (``reduce_dtype`` equal to
    ``param_dtype``: 2 bytes a parameter, as chapter 9 counts them); an fp32 reduction would double
    the reduce-scatter's bytes for extra precision in the sum. FSDP2's only offload is
    ``CPUOffloadPolicy`` (parameters, gradients and the optimizer step all on the CPU); a plan that
    offloads only the optimizer is written as the nearest FSDP2 can do, and the snippet says so.
    """
    dtype = "torch.bfloat16" if config.precision == "bf16" else "torch.float16"
    offloads = config.offload != "none"
    lines = [
        "# FSDP2: parameters, gradients and optimizer state sharded over the ranks of the default process",
        "# group (run under torchrun, with the process group initialised and `model` built).",
    ]
    if config.offload_device == "nvme":
        lines += ["# The plan keeps the state on NVMe; FSDP2 cannot offload there, only to host memory, which the",
                  "# plan found too small: use DeepSpeed (ZeRO-Infinity) for this run."]
    if config.offload == "optimizer":
        lines += ["# The plan offloads only the optimizer; FSDP2 offloads parameters, gradients and the optimizer",
                  "# together (CPUOffloadPolicy), which needs more link traffic than the plan assumed."]
    if config.strategy != "fsdp2" and config.offload == "none" and config.stage < 3:
        lines += [f"# The plan shards less ({config.strategy}); FSDP2 shards everything, which needs less GPU memory",
                  "# and one more all-gather of the weights per step."]
    lines += (["import functools", ""] if config.recompute else []) + ["import torch"]
    lines.append("from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard"
                 if offloads else "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard")
    if config.recompute:
        lines.append("from torch.utils.checkpoint import checkpoint")
    lines += ["", f"mixed = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={dtype})"]
    if offloads:
        lines += ["# Pinned host memory needs a GPU; on a CPU-only machine the policy runs unpinned.",
                  "options = dict(mp_policy=mixed, offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()))"]
    else:
        lines.append("options = dict(mp_policy=mixed)")
    if config.recompute:
        lines += _recompute_lines(config)
    lines += [f"for block in {config.blocks}:",
              "    fully_shard(block, **options)",
              "fully_shard(model, **options)  # the root: embeddings, final norm and head",
              f"optimizer = torch.optim.AdamW(model.parameters(), lr={config.lr!r}, betas={tuple(config.betas)!r}, "
              f"eps={config.eps!r}, weight_decay={config.weight_decay!r})"]
    return "\n".join(lines)
