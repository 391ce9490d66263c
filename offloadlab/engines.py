"""Configurations for the engines that run a plan at scale: a DeepSpeed config and an FSDP2 script.

A :class:`Setup` says what to run in engine-neutral terms — how the state is sharded, what is
offloaded and where, which layers recompute their activations, the batch and the optimizer —
and :func:`deepspeed_config` / :func:`deepspeed_snippet` / :func:`fsdp_snippet` write it for each
engine. :func:`plan_for` picks the plan an engine runs for a planner report — the chosen plan
when that engine runs it, otherwise the engine's fastest plan that fits by its own account, said
in one line — and :func:`setup` reads a :class:`Setup` off it.

Everything emitted runs as written, and the suite checks it: each DeepSpeed config passes
DeepSpeed's own ``DeepSpeedConfig`` in a gloo world of 1, 4 and 8 processes, and the FSDP2 script
trains under ``torchrun`` on two CPU processes, both TinyGPT and a transformers model.
"""

from __future__ import annotations


from types import MappingProxyType
from dataclasses import dataclass, replace

from . import sharding
from .units import (
    check_adamw_settings,
    check_integer,
    format_duration,
    format_size,
    is_integer,
    is_number,
    plain_scalar,
)

__all__ = [
    "Setup",
    "ENGINES",
    "plan_for",
    "setup",
    "offered",
    "deepspeed_config",
    "deepspeed_snippet",
    "zenflow_block",
    "fsdp_snippet",
    "NVME_PATH_PLACEHOLDER",
    "MODEL_PLACEHOLDER",
]

NVME_PATH_PLACEHOLDER = "/local_nvme"  # written when the plan goes to NVMe and no path was given
MODEL_PLACEHOLDER = "/path/to/model"  # written when no model folder or hub id was given
ENGINES = MappingProxyType({"deepspeed": "DeepSpeed", "fsdp": "FSDP2"})
_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
# The planner's single-GPU offload levels as DeepSpeed runs them (partitioning is a no-op on one
# GPU).
_LEVEL_STRATEGY = {
    "nothing": ("ddp", "none"),
    "optimizer": ("zero2", "optimizer"),
    "optimizer+gradients": ("zero2", "optimizer"),
    "optimizer+gradients+parameters": ("zero3", "optimizer+parameters"),
}


def offered(strategy: str, offload: str) -> bool:
    """Whether DeepSpeed and FSDP2 run this combination: they offload only sharded state (FSDP2's
    optimizer alone with offloadlab's CPUOffloadAdam)."""
    return sharding.valid(strategy, offload) and not (strategy == "ddp" and offload != "none")


@dataclass(frozen=True)
class Setup:
    """One training configuration, engine-neutral.

    ``strategy`` and ``offload`` are :mod:`offloadlab.sharding`'s names; ``offload_device`` is
    'cpu' or 'nvme' (with ``nvme_path``, ZeRO-3 only; ``nvme_buffer`` is DeepSpeed's
    ``offload_param.buffer_size``, elements of the largest parameter shard); ``micro_batch`` is
    per GPU and ``accumulation`` the micro-batches per optimizer step, so a step sees
    micro_batch × accumulation × gpus sequences of ``seq`` tokens (``gpus``: every node's, over
    ``nodes`` nodes). ``recompute`` checkpoints the
    first ``checkpointed`` blocks (None: all of them); ``blocks`` is the Python expression that
    names the model's list of blocks (``model.model.layers`` for Hugging Face Llama).
    ``clipping`` is the gradient norm both engines clip to (0: none). ``offload_ratio`` is the
    share of the optimizer offloaded (DeepSpeed's ``offload_optimizer.ratio``, ZeRO-3 only).
    ``model`` is what transformers loads (a hub id or a snapshot folder). ``build`` (an
    expression, with the ``imports`` it needs) and ``initialise`` (a statement), when given,
    replace the FSDP2 script's transformers lines: how a model of your own is built on the meta
    device and its shards filled.
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
    checkpointed: int | None = None
    nvme_buffer: int = sharding.NVME_DEFAULT_BUFFER
    clipping: float = 1.0
    offload_ratio: float = 1.0
    seq: int = 2048
    model: str = MODEL_PLACEHOLDER
    imports: str | None = None
    build: str | None = None
    initialise: str | None = None
    nodes: int = 1

    def __post_init__(self):
        if (
            self.strategy not in sharding.STRATEGIES
            or self.offload not in sharding.OFFLOADS
            or not offered(self.strategy, self.offload)
        ):
            raise ValueError(
                f"offload: expected a combination the engines offer; got {self.strategy} with "
                f"offload {self.offload!r}"
            )
        for name in ("gpus", "micro_batch", "accumulation", "nvme_buffer", "seq", "nodes"):
            value = plain_scalar(getattr(self, name))  # (numpy's integers as Python's)
            object.__setattr__(self, name, check_integer(value, name))
        # what the configurations write for the optimizer, checked as AdamW checks it, as the
        # plain numbers JSON and Python source take (a tensor lr would write 'tensor(0.0003)')
        for name in ("lr", "eps", "weight_decay", "clipping", "offload_ratio"):
            value = getattr(self, name)
            if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
                value = value.item()  # (a one-element tensor; torch is not imported here)
            object.__setattr__(self, name, plain_scalar(value))
        check_adamw_settings(self.lr, self.betas, self.eps, self.weight_decay)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if not isinstance(self.recompute, bool):  # ("no" is true to Python)
            raise ValueError(f"recompute: expected True or False; got {self.recompute!r}")
        if self.gpus % self.nodes:
            raise ValueError(
                f"nodes: expected a divisor of gpus={self.gpus} (each node the same GPUs); got "
                f"{self.nodes}"
            )
        if self.checkpointed is not None:  # (numpy's integers as Python's)
            object.__setattr__(self, "checkpointed", plain_scalar(self.checkpointed))
        if self.checkpointed is not None and (
            not is_integer(self.checkpointed) or self.checkpointed < 1 or not self.recompute
        ):
            raise ValueError(
                f"checkpointed: expected a positive number of blocks, with recompute; got "
                f"{self.checkpointed!r}"
            )
        if not (is_number(self.clipping) and self.clipping >= 0):
            raise ValueError(
                f"clipping: expected a gradient norm ≥ 0 (0: no clipping); got {self.clipping!r}"
            )
        if not (is_number(self.offload_ratio) and 0 <= self.offload_ratio <= 1):
            raise ValueError(
                f"offload_ratio: expected a share from 0 to 1; got {self.offload_ratio!r}"
            )
        if self.offload_ratio < 1 and (self.strategy != "zero3" or self.offload == "none"):
            raise ValueError(
                f"offload_ratio: DeepSpeed offloads a share of the optimizer only with ZeRO-3 "
                f"optimizer offload; expected 1 for {self.strategy} with offload "
                f"{self.offload!r}; got {self.offload_ratio!r}"
            )
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"precision: expected 'bf16' or 'fp16'; got {self.precision!r}")
        if self.offload_device not in ("cpu", "nvme"):
            raise ValueError(
                f"offload_device: expected 'cpu' or 'nvme'; got {self.offload_device!r}"
            )
        if self.offload_device == "nvme":
            if not self.nvme_path:
                raise ValueError(
                    "nvme_path: expected the folder on the NVMe drive to offload to; got nothing"
                )
            if self.strategy != "zero3":
                raise ValueError(
                    f"offload_device: DeepSpeed offloads to NVMe only with ZeRO-3; the plan uses "
                    f"{self.strategy}"
                )

    @property
    def stage(self) -> int:
        return _STAGE[self.strategy]

    @property
    def recomputed_blocks(self) -> str:
        """The blocks to checkpoint, as a Python expression."""
        return self.blocks if self.checkpointed is None else f"{self.blocks}[:{self.checkpointed}]"


def _runs(engine: str, plan) -> bool:
    """Whether ``engine`` runs this node plan (DeepSpeed: ZeRO-1/2/3; FSDP2: fully_shard)."""
    strategy = plan.layout.strategy
    return strategy == "fsdp2" if engine == "fsdp" else strategy in ("zero1", "zero2", "zero3")


def plan_for(report, engine: str):
    """The plan ``engine`` ('deepspeed' or 'fsdp') runs for ``report``, and a note when it is not
    the chosen one.

    The chosen plan itself when the engine runs it; otherwise the engine's plans for the same
    hardware (one GPU's included: the engines' accounts, updates after backward), the one that
    matches the chosen sharding and offload if it fits, else the fastest that fits. ValueError
    naming the closest plan and what binds it when none of the engine's plans fits.
    """
    from . import planner  # the estimates layer: configurations are written from its plans

    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}; got {engine!r}")
    chosen, name = report.chosen, ENGINES[engine]
    if chosen is None:
        raise ValueError("report: nothing fits, so there is no configuration to emit")
    if isinstance(chosen, planner.NodePlan) and _runs(engine, chosen):
        return chosen, _split_note(chosen, name)
    pool = [p for p in report.plans if isinstance(p, planner.NodePlan)]  # a node's, and any on NVMe
    if report.hardware.gpus_per_node == 1:  # the engines' own plans for this one GPU
        pool += planner.node_plans(report.work, report.hardware, report.duplex, report.recipe)
    mine = [p for p in pool if _runs(engine, p)]
    fitting = sorted((p for p in mine if p.fits), key=lambda p: p.step)
    if not fitting:
        closest = min(
            mine, key=lambda p: (not p.fits_gpu, p.host_need if p.fits_gpu else p.gpu_bytes)
        )
        raise ValueError(
            f"engine: no {name} configuration fits this hardware: the closest, {closest.name}, "
            f"does not fit ({closest.binding}); the plan ({chosen.name}) is not one {name} runs"
        )
    wanted = _wanted(chosen)
    same = [
        p
        for p in fitting
        if (p.layout.strategy, p.layout.offload) == wanted[:2] and p.checkpointed == wanted[2]
    ]
    picked = same[0] if same else fitting[0]
    if isinstance(chosen, planner.NodePlan):
        whose, why = chosen.name, ""
    else:
        whose = f"offloadlab's own offload ({chosen.name}, its updates overlapping backward)"
        why = (
            "; its update waits for the end of backward, where the gradients' norm and overflow "
            "are checked"
        )
    note = (
        f"the plan is {whose}; {name} runs {picked.name}: step ≈ {format_duration(picked.step)} "
        f"({picked.step / chosen.step:.2f}× the plan's{why}), host {format_size(picked.host_need)} "
        f"for the node by {name}'s own account"
    )
    return picked, "; ".join(n for n in (note, _split_note(picked, name)) if n)


def _split_note(plan, name: str) -> str | None:
    """What the emitted setup leaves out of a plan that splits each sequence over GPUs."""
    if getattr(plan, "context", 1) == 1:
        return None
    return (
        f"the plan splits each sequence over {plan.context} GPUs (context parallelism), which "
        f"this {name} setup does not do: add it (torch's context_parallel for FSDP2, Ulysses "
        f"sequence parallelism for DeepSpeed), the data-parallel groups {plan.context}× fewer"
    )


def _wanted(chosen) -> tuple[str, str, int]:
    """The engine strategy, offload and recomputed layers nearest to ``chosen``."""
    if hasattr(chosen, "layout"):
        strategy, offload = chosen.layout.strategy, chosen.layout.offload
        if strategy == "ddp":
            strategy, offload = ("zero1", offload) if offload != "none" else ("zero1", "none")
    else:
        strategy, offload = _LEVEL_STRATEGY[chosen.offload]
        if strategy == "ddp":
            strategy = "zero1"
    return strategy, offload, chosen.checkpointed


def setup(report, engine: str | None = None, **options) -> Setup:
    """The :class:`Setup` of a planner report's plan for ``engine`` (see :func:`plan_for`); with no
    engine, of the chosen plan as it is. ``options`` set the rest (batch, optimizer, paths…)."""
    chosen = report.chosen
    if chosen is None:
        raise ValueError("report: nothing fits, so there is no configuration to emit")
    if engine is not None:
        chosen, _ = plan_for(report, engine)
    layout = getattr(chosen, "layout", None)  # a node plan carries its sharding layout
    if layout is None:  # a single-GPU offload level
        strategy, offload = _LEVEL_STRATEGY[chosen.offload]
    else:
        strategy, offload = layout.strategy, layout.offload
    # engines shard what they offload: less host memory, same GPU
    if strategy == "ddp" and offload != "none":
        strategy = "zero1"
    work = report.work
    gpus = getattr(report.hardware, "gpus_per_node", 1)
    nodes = getattr(report.hardware, "nodes", 1)
    checkpointed = chosen.checkpointed if 0 < chosen.checkpointed < work.layers else None
    options = {
        "micro_batch": work.batch,
        "seq": work.seq,
        "checkpointed": checkpointed,
        "nvme_buffer": sharding.nvme_buffer_elements(work.largest_weight_params(), gpus * nodes),
        **options,
    }
    if layout is not None and layout.nvme_bytes:  # ZeRO-Infinity on the drive
        options.update(
            offload_device="nvme", nvme_path=options.get("nvme_path") or NVME_PATH_PLACEHOLDER
        )
    elif options.get("nvme_path") is not None:
        options.pop("nvme_path")
    return Setup(strategy, offload, chosen.recompute, gpus * nodes, nodes=nodes, **options)


def with_share(config: Setup, share) -> tuple[Setup, str | None]:
    """``config`` offloading the planner's share of the optimizer (a
    :class:`~offloadlab.planner.share.OptimizerShare`) where DeepSpeed can, and a note where it
    cannot."""
    f = share.offload_fraction
    if share.update_on == "device":
        return config, (
            f"the plan parks {f:g} of the optimizer state (updated on the GPU); DeepSpeed's "
            "equivalents are DeepCompile's offload passes and engine.offload_states() / "
            "reload_states() around the step, which this configuration does not set up"
        )
    if f == 1:
        return config, None
    if config.stage == 3 and config.offload != "none":
        return replace(config, offload_ratio=f), None
    return config, (
        f"the plan offloads {f:g} of the optimizer; DeepSpeed's offload_optimizer.ratio does that "
        f"only with ZeRO-3, and this configuration runs ZeRO-{config.stage}, so it offloads all "
        f"of it (Megatron-Core: --optimizer-cpu-offload --optimizer-offload-fraction {f:g})"
    )


def deepspeed_config(config: Setup) -> dict:
    """A complete DeepSpeed config for ``config`` (pass it to ``deepspeed.initialize(config=...)``).

    With optimizer offload the ``optimizer`` block is required: DeepSpeed then builds its own
    DeepSpeedCPUAdam, where a client torch optimizer is refused (``zero_force_ds_cpu_optimizer``).
    Recomputation is not a config setting — DeepSpeed's ``activation_checkpointing`` section only
    tunes ``deepspeed.checkpointing`` for a model that calls it — so the config has no such
    section and :func:`deepspeed_snippet` turns recomputation on in the model itself. NVMe
    parameter offload sizes its swap buffers to the largest parameter shard (DeepSpeed asserts
    that each fits one buffer).
    """
    zero: dict = {"stage": config.stage}
    if config.stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=True, reduce_scatter=True)
    if config.offload != "none":
        target = {"device": config.offload_device, "pin_memory": True}
        if config.offload_device == "nvme":
            target["nvme_path"] = config.nvme_path
        zero["offload_optimizer"] = dict(target)
        if config.offload_ratio < 1:  # the rest of the optimizer stays on the GPU
            zero["offload_optimizer"]["ratio"] = config.offload_ratio
        if config.offload == "optimizer+parameters":
            zero["offload_param"] = dict(target)
            if config.offload_device == "nvme":
                zero["offload_param"].update(
                    buffer_count=sharding.NVME_BUFFER_COUNT, buffer_size=config.nvme_buffer
                )
    if config.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    precision = (
        {"bf16": {"enabled": True}}
        if config.precision == "bf16"
        else {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}
    )
    result = {
        "train_batch_size": config.micro_batch * config.accumulation * config.gpus,
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.accumulation,
        "gradient_clipping": float(config.clipping),
        **precision,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": config.lr,
                "betas": list(config.betas),
                "eps": config.eps,
                "weight_decay": config.weight_decay,
            },
        },
        "zero_optimization": zero,
    }
    if config.offload_device == "nvme":  # asynchronous I/O for the NVMe tier (see chapter 8)
        result["aio"] = {
            "block_size": 1048576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
            # DeepSpeed 0.19's names and defaults (swap_tensor/constants.py)
            "intra_op_parallelism": 1,
        }
    return result


def zenflow_block(update_interval: int = 4) -> dict:
    """DeepSpeed's optional ZenFlow settings for a ZeRO plan that offloads the optimizer.

    ZenFlow updates the most important tenth of each gradient's columns on the GPU every step and
    the rest on the CPU every ``update_interval`` steps, in the background (``overlap_step``): the
    GPU stops waiting for the CPU update, and most weights lag that many steps behind.
    """
    return {
        "topk_ratio": 0.1,
        "select_strategy": "auto",
        "select_interval": "auto",
        "update_interval": update_interval,
        "overlap_step": True,
    }


def _recompute_lines(config: Setup) -> list[str]:
    which = (
        "every block's"
        if config.checkpointed is None
        else f"the first {config.checkpointed} blocks'"
    )
    return [
        f"for block in {config.recomputed_blocks}:  # recompute {which} activations in backward",
        "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)",
    ]


def deepspeed_snippet(config: Setup) -> str:
    """The Python that goes with :func:`deepspeed_config`: build the model as the config expects,
    recompute if the plan does, then initialize.

    Under ZeRO-3 the model must be built already partitioned — ``HfDeepSpeedConfig`` makes
    transformers' ``from_pretrained`` do it, ``deepspeed.zero.Init`` any other model — or every
    process first holds the whole fp32 model, which the host estimate does not allow for.
    Recomputation uses ``torch.utils.checkpoint`` (non-reentrant, which ZeRO-3 supports and which
    passes keyword arguments through, as Hugging Face blocks need).
    """
    per_node = config.gpus // config.nodes
    launch = (
        [
            f"# DeepSpeed on {config.nodes} nodes: launch once, from the first, with `deepspeed "
            f"--hostfile hostfile",
            f"# --num_nodes {config.nodes} --num_gpus {per_node} train.py` (the hostfile names "
            f"each node: 'host slots={per_node}';",
            "# one process per GPU, every node reached by ssh); ds_config.json is the JSON above.",
        ]
        if config.nodes > 1
        else [
            "# DeepSpeed: launch with `deepspeed --num_gpus N train.py` (one process per GPU); "
            "ds_config.json",
            "# is the JSON above.",
        ]
    )
    lines = [
        *launch,
        *(["import functools"] if config.recompute else []),
        "import json",
        "",
        "import deepspeed",
        *(["from torch.utils.checkpoint import checkpoint"] if config.recompute else []),
        "from transformers import AutoModelForCausalLM",
    ]
    if config.stage == 3:
        lines.append("from transformers.integrations import HfDeepSpeedConfig")
    lines += [
        "",
        f"MODEL = {config.model!r}  # a Hugging Face model id, or the folder of its snapshot",
        'ds_config = json.load(open("ds_config.json"))',
    ]
    if config.stage == 3:
        lines += [
            "# Before the model is built, and kept alive: from_pretrained then builds it already "
            "partitioned",
            "# (deepspeed.zero.Init), so no process holds the whole model. For a model of your "
            "own:",
            "#     with deepspeed.zero.Init(config_dict_or_path=ds_config): model = build()",
            "zero_init = HfDeepSpeedConfig(ds_config)",
        ]
    lines.append("model = AutoModelForCausalLM.from_pretrained(MODEL)")
    if config.recompute:
        lines += _recompute_lines(config)
    if config.offload == "optimizer":
        block = zenflow_block()
        lines += [
            "# Optional, ZenFlow (DeepSpeed ≥ 0.18): the GPU updates the most important tenth of "
            "each",
            "# gradient's columns every step and the CPU the rest every "
            f"{block['update_interval']} steps in the background, so the",
            "# GPU stops waiting for the CPU update and most weights lag up to that many steps "
            "behind (the",
            "# step the planner predicts is without it):",
            f"#     ds_config['zero_optimization']['zenflow'] = {block!r}",
        ]
    lines += [
        "engine, optimizer, _, _ = deepspeed.initialize(model=model, "
        "model_parameters=model.parameters(),",
        "                                                config=ds_config)",
        "# each micro-batch: loss = engine(input_ids=batch, labels=batch).loss; "
        "engine.backward(loss);",
        "# engine.step() (which clips to gradient_clipping and updates once per accumulated step)",
    ]
    return "\n".join(lines)


def _backward(config: Setup, ours: bool) -> str:
    """The backward call of the emitted loop: the loss over the micro-batches, and scaled by
    CPUOffloadAdam's loss scale for fp16 shards (it scales its own, and divides it out)."""
    loss = "loss" if config.accumulation == 1 else f"(loss / {config.accumulation})"
    if ours and config.precision == "fp16":
        return f"optimizer.scale_loss({loss.strip('()')}).backward()"
    return f"{loss}.backward()"


def fsdp_snippet(config: Setup) -> str:
    """A complete FSDP2 training script for ``config`` (``torchrun --nproc-per-node N train.py``).

    It sets each process's GPU from ``LOCAL_RANK``; builds the model on the meta device in fp32
    (shapes only, so no process holds the whole model, and the shards each rank keeps are the fp32
    master weights), shards each block and the root, then allocates and initialises the shards;
    gathers weights and reduce-scatters gradients in 16 bits (``MixedPrecisionPolicy`` with
    ``reduce_dtype`` equal to ``param_dtype``: 2 bytes a parameter, as chapter 9b counts them; an
    fp32 reduction would double those bytes); and updates with ``torch.optim.AdamW(fused=True)``,
    on the CPU's shards with ``CPUOffloadPolicy`` (the unfused loop is several times slower than
    the CPU-Adam rate the planner assumes), which moves parameters, gradients and the update to
    the CPU. A plan that offloads only the optimizer gets offloadlab's ``CPUOffloadAdam`` on each
    rank's shard instead: 16-bit shards on the GPU, the fp32 master weights and moments on the
    host, clipping in its ``step()``.
    """
    dtype = "torch.bfloat16" if config.precision == "bf16" else "torch.float16"
    offloads = config.offload == "optimizer+parameters"  # FSDP2's own CPUOffloadPolicy
    ours = config.offload == "optimizer"  # offloadlab's CPUOffloadAdam on each rank's shard
    per_node = config.gpus // config.nodes
    lines = (
        [
            f"# FSDP2, one process per GPU, on each of the {config.nodes} nodes: torchrun "
            f"--nnodes {config.nodes} --nproc-per-node {per_node}",
            "#     --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:29500 train.py",
        ]
        if config.nodes > 1
        else [f"# FSDP2, one process per GPU: torchrun --nproc-per-node {config.gpus} train.py"]
    )
    if config.offload_device == "nvme":
        lines += [
            "# The plan keeps the state on NVMe; FSDP2 cannot offload there, only to host memory, "
            "which the",
            "# plan found too small: use DeepSpeed (ZeRO-Infinity) for this run.",
        ]
    if ours:
        lines += [
            "# The plan offloads only the optimizer: offloadlab's CPUOffloadAdam keeps each rank's "
            "16-bit shard",
            "# on its GPU and its fp32 master weights and moments in host memory, updated on its "
            "share of",
            "# the CPU as each shard's gradient arrives (pip install offloadlab on every node).",
        ]
    if config.strategy != "fsdp2" and config.offload == "none" and config.stage < 3:
        lines += [
            f"# The plan shards less ({config.strategy}); FSDP2 shards everything, which needs "
            "less GPU memory",
            "# and one more all-gather of the weights per step.",
        ]
    lines += [
        *(["import functools"] if config.recompute else []),
        "import os",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard"
        if offloads
        else "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
        *(["from torch.utils.checkpoint import checkpoint"] if config.recompute else []),
        *(["", "from offloadlab import CPUOffloadAdam"] if ours else []),
    ]
    if config.build is None:
        lines += [
            "from transformers import AutoConfig, AutoModelForCausalLM",
            "",
            f"MODEL = {config.model!r}  # a Hugging Face model id, its snapshot's folder or config",
        ]
    elif config.imports:
        lines += config.imports.splitlines()
    lines += [
        "",
        'local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun: this process\'s GPU on its '
        "node",
        "if torch.cuda.is_available():",
        "    torch.cuda.set_device(local_rank)",
        '    device = torch.device("cuda", local_rank)',
        "else:  # no GPU: the same script on CPU processes",
        '    device = torch.device("cpu")',
        'dist.init_process_group("nccl" if device.type == "cuda" else "gloo")',
        "",
        *(
            [
                "# Shapes only, no storage: no process builds the whole model. Cast to 16 bits "
                "below: the fp32",
                "# master weights are the optimizer's, in host memory.",
            ]
            if ours
            else [
                "# Shapes only, no storage: no process builds the whole model. In fp32, so that "
                "the shards each rank",
                "# keeps are the master weights the optimizer updates; computing happens in 16 "
                "bits (below).",
            ]
        ),
        'with torch.device("meta"):',
    ]
    lines.append(
        f"    model = {config.build}"
        if config.build
        else "    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL), "
        "dtype=torch.float32)"
    )
    if ours:
        lines += [
            f"model.to({dtype})  # the shards in 16 bits: the fp32 master copy is the "
            "optimizer's, on the host"
        ]
    if config.recompute:
        lines += _recompute_lines(config)
    lines += [f"mixed = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={dtype})"]
    if offloads:
        lines += [
            "# Pinned host memory needs a GPU; on a CPU-only machine the policy runs unpinned.",
            "options = dict(mp_policy=mixed, "
            'offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))',
        ]
    else:
        lines.append("options = dict(mp_policy=mixed)")
    lines += [
        f"for block in {config.blocks}:",
        "    fully_shard(block, **options)",
        "fully_shard(model, **options)  # the root: embeddings, final norm and head",
        "",
        "# Allocate this rank's shards "
        + ("in host memory" if offloads else "on its GPU")
        + ", then fill them: fresh weights here. To start from a",
        "# checkpoint, load it into the shards instead (torch.distributed.checkpoint).",
        'model.to_empty(device="cpu")' if offloads else "model.to_empty(device=device)",
        "with torch.no_grad():",
    ]
    lines.append(
        f"    {config.initialise}" if config.initialise else "    model.initialize_weights()"
    )
    fused = "  # fused: the CPU-Adam rate the plan assumes" if offloads else ""
    if ours:
        clipping = f", max_grad_norm={float(config.clipping)!r}" if config.clipping else ""
        lines += [
            f"optimizer = CPUOffloadAdam(model.parameters(), lr={config.lr!r}, "
            f"betas={tuple(config.betas)!r}, eps={config.eps!r},",
            f"                           weight_decay={config.weight_decay!r}{clipping})",
        ]
    else:
        lines += [
            f"optimizer = torch.optim.AdamW(model.parameters(), lr={config.lr!r}, "
            f"betas={tuple(config.betas)!r}, eps={config.eps!r},",
            f"                              weight_decay={config.weight_decay!r}, fused=True)"
            f"{fused}",
        ]
    lines += [
        "",
        "",
        "def train_step(input_ids, labels):",
        f"    for micro in range({config.accumulation}):  # micro-batches per optimizer step",
        "        loss = model(input_ids=input_ids[micro], labels=labels[micro]).loss",
        f"        {_backward(config, ours)}",
    ]
    if config.clipping and not ours:  # (CPUOffloadAdam clips in step(): the gradients are its)
        lines.append(
            f"    torch.nn.utils.clip_grad_norm_(model.parameters(), {float(config.clipping)!r})"
        )
    lines += [
        "    optimizer.step()",
        "    optimizer.zero_grad()",
        "    return loss.detach()",
        "",
        "",
        'if __name__ == "__main__":',
        "    # A stand-in batch of random tokens, the same every step, so that the loss falls if "
        "training",
        "    # works: replace it with your data loader (each rank its own "
        + (f"{config.accumulation} micro-batches" if config.accumulation > 1 else "micro-batch")
        + f" of {config.micro_batch} × {config.seq} tokens).",
        "    torch.manual_seed(dist.get_rank())",
        f"    tokens = torch.randint(0, model.config.vocab_size, ({config.accumulation}, "
        f"{config.micro_batch}, {config.seq}), device=device)",
        "    for step in range(10):",
        "        loss = train_step(tokens, tokens)",
        "        if dist.get_rank() == 0:",
        '            print(f"step {step}: loss {loss.item():.4f}", flush=True)',
        "    dist.destroy_process_group()",
    ]
    return "\n".join(lines)
