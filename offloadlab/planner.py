"""What to offload, and in what order: rank the candidates, choose the least offload that fits.

Given a model, a GPU, a host↔GPU link, host memory, a CPU-Adam throughput and a compute rate,
:func:`plan` builds every plan in the natural order — nothing, then optimizer states, then
gradients, then parameters, each with activations kept or recomputed — predicts each plan's
memory and step time, and picks the least offload that fits. It says which constraint binds,
what the runner-up would cost, when offload is the wrong tool and when nothing fits.

Bytes per parameter come from the training recipe (:mod:`offloadlab.memory`) and the traffic of
each offload level from :mod:`offloadlab.budget`, so a correction there reaches every plan. The
step is not max(compute, transfer) plus the CPU time: an update needs its gradient and an upload
its update, so :func:`offloadlab.overlap.offload_step` lays the step out layer by layer — gradients
going down during backward, each layer's CPU update once its gradient has landed, its weights
going up once updated, the next step once every weight is back — and the plan reads its length
off that schedule, with and without a delayed parameter update. Units: bytes, bytes/s, seconds,
FLOP/s, parameters/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import budget, memory, overlap
from .units import (format_bandwidth, format_duration, format_size, parse_bandwidth, parse_count, parse_size,
                    check_positive)

__all__ = ["Workload", "Hardware", "Candidate", "Plan", "PlanReport", "candidates", "plan", "schedule",
           "deepspeed_config", "fsdp_snippet", "ASSUMED_COMPUTE", "ASSUMED_CPU_ADAM"]

# Used only when the reader gives no measurement; every report names them as assumptions.
ASSUMED_COMPUTE = 200e12    # FLOP/s a modern training GPU sustains on bf16 matrix products
ASSUMED_CPU_ADAM = 100e9 / 28  # params/s: 100 GB/s of host memory at 28 B moved per parameter
WORKSPACE_FRACTION = 0.10   # of GPU memory kept back for the framework, kernels and fragmentation
HIDDEN_FRACTION = 0.10      # a plan whose GPU waits less than this share of its step counts as hidden
OFFLOAD_LEVELS = ("nothing", "optimizer", "optimizer+gradients", "optimizer+gradients+parameters")


@dataclass(frozen=True)
class Workload:
    """The model and the step: parameters, optional transformer shape, batch and sequence."""

    params: float
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    batch: int = 1
    seq: int = 2048
    shape_assumed: bool = field(default=False, init=False)

    def __post_init__(self):
        object.__setattr__(self, "params", parse_count(self.params, "params"))
        for name in ("batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer; got {value!r}")
        shape = (self.layers, self.hidden, self.heads)
        if all(v is None for v in shape):
            object.__setattr__(self, "shape_assumed", True)
            for name, value in zip(("layers", "hidden", "heads"), typical_shape(self.params)):
                object.__setattr__(self, name, value)
        elif not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
            raise ValueError(f"layers: expected layers, hidden and heads given together as positive integers; "
                             f"got {shape}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def activation_bytes(self, recompute: bool) -> float:
        """Activation memory of the whole model, per Korthikanti et al. (16-bit activations)."""
        full = memory.activation_bytes_per_layer(self.batch, self.seq, self.hidden, self.heads, "none")
        if not recompute:
            return self.layers * full
        kept = memory.activation_bytes_per_layer(self.batch, self.seq, self.hidden, self.heads, "full")
        return self.layers * kept + full  # checkpoints, plus one layer rebuilt at a time

    def layer_params(self) -> float:
        return self.params / self.layers


def typical_shape(params: float) -> tuple[int, int, int]:
    """A GPT-like (layers, hidden, heads) for ``params``: P ≈ 12·L·h² with h ≈ 128·L, heads of 128.

    The aspect ratio of GPT-3 175B (96 layers, h = 12,288); used only when no shape is given.
    """
    layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    hidden = max(128, round((params / (12 * layers)) ** 0.5 / 128) * 128)
    return layers, hidden, hidden // 128


@dataclass(frozen=True)
class Hardware:
    """The machine: GPU memory, link, host memory, CPU-Adam and compute rates (None = assumed)."""

    gpu_memory: float
    link: float
    host_memory: float | None = None
    cpu_adam: float | None = None
    compute: float | None = None
    comm_fraction: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "gpu_memory", parse_size(self.gpu_memory, "gpu_memory"))
        object.__setattr__(self, "link", parse_bandwidth(self.link, "link"))
        if self.host_memory is not None:
            object.__setattr__(self, "host_memory", parse_size(self.host_memory, "host_memory"))
        for name in ("cpu_adam", "compute"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_positive(getattr(self, name), name))
        if not (isinstance(self.comm_fraction, (int, float)) and 0 <= self.comm_fraction < 1):
            raise ValueError(f"comm_fraction: expected a fraction in [0, 1); got {self.comm_fraction!r}")

    @property
    def assumptions(self) -> list[str]:
        """What the plan assumed because it was not given."""
        said = []
        if self.compute is None:
            said.append(f"compute {ASSUMED_COMPUTE / 1e12:.0f} TFLOP/s (assumed; measure yours or pass --compute)")
        if self.cpu_adam is None:
            said.append(f"CPU Adam {ASSUMED_CPU_ADAM / 1e9:.1f} G params/s (assumed; pass --cpu-adam)")
        if self.host_memory is None:
            said.append("host memory unlimited (not given)")
        return said


@dataclass(frozen=True)
class Candidate:
    """One kind of state: what offloading it frees on the GPU and the traffic it adds each step."""

    name: str
    frees_bytes: float
    traffic_bytes: float
    note: str

    @property
    def payoff_per_traffic(self) -> float:
        """Bytes of GPU memory freed per byte it adds to each step's traffic (inf when it adds none)."""
        return self.frees_bytes / self.traffic_bytes if self.traffic_bytes else float("inf")


def candidates(work: Workload, recipe: str = memory.DEFAULT_RECIPE) -> list[Candidate]:
    """The offload candidates in the natural order, each priced given the ones before it.

    Optimizer state first: the most bytes (12 of mixed-precision Adam's 16) for 4 B moved.
    Gradients then cost nothing more — they go down for the CPU update anyway. Parameters add
    2 B (each layer comes up for forward and for backward, where it came up once after the
    update) for 2 B freed. Offloading activations moves twice what it frees; recomputing them
    moves nothing.
    """
    p, r = work.params, memory.get_recipe(recipe)
    levels = [budget.traffic(["optimizer", "gradients", "parameters"][:n], recipe).per_param for n in (1, 2, 3)]
    act_kept, act_recomputed = work.activation_bytes(False), work.activation_bytes(True)
    return [
        Candidate("optimizer states", r.optimizer_bytes * p, levels[0] * p,
                  "master weights and moments, touched once per step; updated on the CPU"),
        Candidate("gradients", r.gradient_bytes * p, (levels[1] - levels[0]) * p,
                  "they go down for the CPU update anyway: offloading them moves nothing more"),
        Candidate("parameters", r.weight_bytes * p, (levels[2] - levels[1]) * p,
                  "each layer comes up for forward and again for backward instead of once after the update"),
        # Offloading activations moves what recomputation would rebuild: down in forward, up in backward.
        Candidate("activations (offload)", act_kept - act_recomputed, 2 * (act_kept - act_recomputed),
                  "recomputing them instead costs one extra forward (+1/3 compute) and no traffic"),
    ]


@dataclass(frozen=True)
class Plan:
    """One plan's memory, traffic and predicted step (bytes, seconds).

    ``t_compute`` is forward and backward (with recomputation, if chosen), ``t_transfer`` the
    link time of the step's traffic under the duplex assumption, ``t_cpu`` the CPU update.
    ``t_step`` comes from :func:`offloadlab.overlap.offload_step`, which knows what waits for
    what: a layer's update waits for its gradient, its upload for its update, and the next step
    for every upload. ``t_step_delayed`` is the same with a delayed parameter update (None where
    there is no CPU update to delay, or parameters are fetched).
    """

    offload: str
    recompute: bool
    gpu_bytes: float
    host_bytes: float
    h2d_bytes: float
    d2h_bytes: float
    t_compute: float
    t_transfer: float
    t_cpu: float
    t_step: float
    t_step_delayed: float | None
    gpu_usable: float
    host_memory: float | None

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_bytes <= self.gpu_usable

    @property
    def fits_host(self) -> bool:
        return self.host_memory is None or self.host_bytes <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def traffic_bytes(self) -> float:
        return self.h2d_bytes + self.d2h_bytes

    @property
    def step(self) -> float:
        """Predicted seconds per step (without a delayed update)."""
        return self.t_step

    @property
    def waiting(self) -> float:
        """Seconds per step the GPU waits on the link or the CPU."""
        return self.t_step - self.t_compute

    @property
    def level(self) -> int:
        return OFFLOAD_LEVELS.index(self.offload)

    @property
    def binding(self) -> str:
        """What limits this plan: the memory it does not fit, or what its step waits on."""
        if not self.fits_gpu:
            return (f"GPU memory: needs {format_size(self.gpu_bytes)} of the "
                    f"{format_size(self.gpu_usable)} usable")
        if not self.fits_host:
            return f"host memory: needs {format_size(self.host_bytes)} of {format_size(self.host_memory)}"
        if self.level == 0:
            return "nothing: it fits on the GPU without offload"
        if self.waiting <= HIDDEN_FRACTION * self.t_step:
            return "GPU memory: offload is hidden behind compute"
        share = f"of a {format_duration(self.t_step)} step, {format_duration(self.t_compute)} of it compute"
        if self.t_transfer >= self.t_cpu:
            return f"the link: transfers take {format_duration(self.t_transfer)} {share}"
        return f"the CPU: its update takes {format_duration(self.t_cpu)} {share}"

    @property
    def name(self) -> str:
        return f"offload {self.offload}, activations {'recomputed' if self.recompute else 'kept'}"

    def to_dict(self) -> dict:
        return {"name": self.name, "offload": self.offload, "recompute": self.recompute,
                "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "traffic_bytes": self.traffic_bytes,
                "bytes_per_direction": {"h2d": self.h2d_bytes, "d2h": self.d2h_bytes},
                "t_compute_s": self.t_compute, "t_transfer_s": self.t_transfer, "t_cpu_s": self.t_cpu,
                "step_s": self.step, "step_delayed_update_s": self.t_step_delayed, "waiting_s": self.waiting,
                "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
                "binding": self.binding}


_STREAMED = {0: [], 1: ["optimizer"], 2: ["optimizer", "gradients"], 3: ["optimizer", "gradients", "parameters"]}


def schedule(work: Workload, hw: Hardware, offload: str, recompute: bool = False, *, duplex="full",
             recipe: str = memory.DEFAULT_RECIPE, delayed: bool = False,
             clipping: bool = False) -> overlap.OffloadStep:
    """The step of one plan laid out layer by layer (:func:`offloadlab.overlap.offload_step`).

    Each of the workload's layers gets an equal share of the parameters and of the compute
    (forward 2 and backward 4 FLOP per parameter per token, 2 more with recomputation).
    ``clipping``: no update starts before every gradient is in. A measured ``duplex`` rate runs
    both copy engines at the rate each keeps while the other is busy: the cautious reading.
    """
    if offload not in OFFLOAD_LEVELS:
        raise ValueError(f"offload: expected one of {', '.join(OFFLOAD_LEVELS)}; got {offload!r}")
    level, r = OFFLOAD_LEVELS.index(offload), memory.get_recipe(recipe)
    both, label = budget.both_directions_rate(hw.link, duplex)
    engine = both if label == "measured" else hw.link
    rate = hw.compute or ASSUMED_COMPUTE
    per_token = work.params * work.tokens / rate / work.layers
    per_layer = dict(layers=work.layers, forward=2 * per_token, backward=(6 if recompute else 4) * per_token,
                     duplex="half" if label == "half" else "full", delayed=delayed, after_backward=clipping)
    if level:
        moved = budget.traffic(_STREAMED[level], recipe)
        layer = work.layer_params()
        per_layer["gradient"] = moved.d2h * layer / engine
        per_layer["update"] = layer / (hw.cpu_adam or ASSUMED_CPU_ADAM)
        if level == 3:
            per_layer["fetch"] = r.weight_bytes * layer / engine
        else:
            per_layer["upload"] = moved.h2d * layer / engine
    return overlap.offload_step(**per_layer)


def _plan(work: Workload, hw: Hardware, offload: str, recompute: bool, duplex="full",
          recipe: str = memory.DEFAULT_RECIPE, clipping: bool = False) -> Plan:
    p, r = work.params, memory.get_recipe(recipe)
    level = OFFLOAD_LEVELS.index(offload)
    w, g, layer = r.weight_bytes, r.gradient_bytes, work.layer_params()
    on_gpu_per_param = {0: r.total, 1: w + g, 2: w, 3: 0.0}[level]
    gpu = on_gpu_per_param * p + work.activation_bytes(recompute)
    if level >= 2:  # one gradient bucket (a layer's worth) waits on the GPU for its trip down
        gpu += g * layer
    if level == 3:  # two layers of weights in flight: the one computing, the one arriving
        gpu += 2 * w * layer
    # Host: the optimizer state, a landing buffer for gradients, and a copy of the weights in their
    # device dtype — what the update writes and the uploads (or, with parameters offloaded, the
    # fetches) read; without fp32 master weights it is also what the update reads.
    host = (r.optimizer_bytes + g + w) * p if level else 0.0
    moved = budget.traffic(_STREAMED[level], recipe) if level else None
    h2d, d2h = (moved.h2d * p, moved.d2h * p) if moved else (0.0, 0.0)
    both, _ = budget.both_directions_rate(hw.link, duplex)
    t_compute = (8 if recompute else 6) * p * work.tokens / (hw.compute or ASSUMED_COMPUTE)
    t_cpu = p / (hw.cpu_adam or ASSUMED_CPU_ADAM) if level else 0.0
    laid_out = dict(duplex=duplex, recipe=recipe, clipping=clipping)
    t_step = schedule(work, hw, offload, recompute, **laid_out).step if level else t_compute
    t_delayed = schedule(work, hw, offload, recompute, delayed=True, **laid_out).step if level in (1, 2) else None
    usable = hw.gpu_memory * (1 - WORKSPACE_FRACTION)
    return Plan(offload, recompute, gpu, host, h2d, d2h, t_compute, budget.link_seconds(h2d, d2h, hw.link, both),
                t_cpu, t_step, t_delayed, usable, hw.host_memory)


@dataclass
class PlanReport:
    """The chosen plan, the runner-up, every plan considered, and what to say about them."""

    work: Workload
    hardware: Hardware
    plans: list[Plan]
    chosen: Plan | None
    runner_up: Plan | None
    ranking: list[Candidate]
    warnings: list[str] = field(default_factory=list)
    duplex: str = "full"
    recipe: str = memory.DEFAULT_RECIPE

    def explain(self) -> str:
        if self.duplex in ("full", "half"):
            sharing = f"{self.duplex} duplex"
        else:
            both, _ = budget.both_directions_rate(self.hardware.link, self.duplex)
            sharing = f"{format_bandwidth(both)} each way while both run (measured)"
        lines = [f"model: {self.work.params / 1e9:g} B parameters ({self.recipe}), batch {self.work.batch} × "
                 f"seq {self.work.seq}; GPU {format_size(self.hardware.gpu_memory)} "
                 f"({format_size(self.hardware.gpu_memory, binary=True)}); link "
                 f"{format_bandwidth(self.hardware.link)} per direction, {sharing}"]
        if self.work.shape_assumed:
            lines.append(f"assumed: a GPT-like shape of {self.work.layers} layers, hidden {self.work.hidden}, "
                         f"{self.work.heads} heads (pass --layers/--hidden/--heads)")
        lines += [f"assumed: {a}" for a in self.hardware.assumptions]
        lines.append("candidates in the natural order (bytes freed; traffic added each step):")
        lines += [f"  {c.name:<22} frees {format_size(c.frees_bytes):>9}, adds {format_size(c.traffic_bytes):>9}"
                  f"/step — {c.note}" for c in self.ranking]
        if self.chosen is None:
            lines.append("plan: nothing fits")
        else:
            c = self.chosen
            lines.append(f"plan: {c.name}")
            lines.append(f"  GPU {format_size(c.gpu_bytes)} of {format_size(c.gpu_usable)} usable, "
                         f"host {format_size(c.host_bytes)}, traffic {format_size(c.h2d_bytes)} up and "
                         f"{format_size(c.d2h_bytes)} down per step")
            lines.append(f"  step ≈ {format_duration(c.step)}: compute {format_duration(c.t_compute)}, then the GPU "
                         f"waits {format_duration(c.waiting)} (link {format_duration(c.t_transfer)}, "
                         f"CPU update {format_duration(c.t_cpu)}, overlapped where the order allows)")
            if c.t_step_delayed is not None:
                lines.append(f"  with a delayed parameter update (weights one step old): step ≈ "
                             f"{format_duration(c.t_step_delayed)}")
            lines.append(f"  binding constraint: {c.binding}")
            if self.runner_up is not None:
                r = self.runner_up
                lines.append(f"runner-up: {r.name}: step ≈ {format_duration(r.step)} "
                             f"({r.step / c.step:.2f}× the plan), GPU {format_size(r.gpu_bytes)}")
        lines += [f"note: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen.to_dict() if self.chosen else None,
                "runner_up": self.runner_up.to_dict() if self.runner_up else None,
                "plans": [p.to_dict() for p in self.plans],
                "ranking": [c.__dict__ for c in self.ranking],
                "duplex": self.duplex, "recipe": self.recipe,
                "assumptions": self.hardware.assumptions, "warnings": self.warnings}


def plan(work: Workload, hw: Hardware, *, duplex="full", recipe: str = memory.DEFAULT_RECIPE,
         clipping: bool = False) -> PlanReport:
    """Choose the least offload that fits; within a level, the faster activation choice.

    ``duplex`` is how the link's two directions share it ('full', 'half' or a measured rate;
    see :mod:`offloadlab.budget`); ``recipe`` gives the bytes per parameter of each kind of state;
    ``clipping`` (global-norm gradient clipping) holds every update until backward is done.
    """
    recipe = memory.get_recipe(recipe).name
    budget.both_directions_rate(hw.link, duplex)  # refuse a bad duplex before planning
    plans = [_plan(work, hw, level, recompute, duplex, recipe, clipping)
             for level in OFFLOAD_LEVELS for recompute in (False, True)]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.level, p.step))
    chosen = fitting[0] if fitting else None
    others = sorted((p for p in fitting[1:]), key=lambda p: p.step)
    runner_up = others[0] if others else None
    warnings = []
    if chosen is None:
        most = min(plans, key=lambda p: p.gpu_bytes)
        if not most.fits_gpu:
            warnings.append(f"nothing fits: even with everything offloaded and activations recomputed the GPU needs "
                            f"{format_size(most.gpu_bytes)} of the {format_size(most.gpu_usable)} usable; shorten "
                            f"the sequence, shrink the batch, or shard across GPUs")
        else:
            least = min((p for p in plans if p.fits_gpu), key=lambda p: p.host_bytes)
            warnings.append(f"nothing fits: the GPU holds it once {least.offload} are offloaded "
                            f"({format_size(least.gpu_bytes)} of {format_size(least.gpu_usable)}), but host memory "
                            f"does not: that needs {format_size(least.host_bytes)} of host memory against "
                            f"{format_size(hw.host_memory)}; the next tier, NVMe, can hold it at a lower speed")
    elif chosen.level == 0:
        warnings.append("offload is not needed: the whole state fits on the GPU")
    else:
        if hw.comm_fraction >= 0.3:
            warnings.append(f"offload is the wrong tool here: the run already spends {hw.comm_fraction:.0%} of its "
                            f"step on communication; offload adds traffic — move less instead")
        if chosen.t_transfer > 2 * chosen.t_compute:
            warnings.append("offload makes this run bandwidth-bound: a larger batch, a faster link or more GPUs "
                            "(sharding instead of offloading) would serve it better")
    return PlanReport(work, hw, plans, chosen, runner_up, candidates(work, recipe), warnings, duplex, recipe)


def deepspeed_config(report: PlanReport) -> dict:
    """The DeepSpeed ZeRO configuration of the chosen plan (offload_optimizer / offload_param)."""
    if report.chosen is None:
        raise ValueError("report: nothing fits, so there is no configuration to emit")
    level = report.chosen.level
    zero = {"stage": 3 if level == 3 else (2 if level else 0)}
    if level >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["contiguous_gradients"] = True
        zero["overlap_comm"] = True
    if level == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": report.work.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "activation_checkpointing": {"partition_activations": False,
                                         "contiguous_memory_optimization": False} if report.chosen.recompute else {}}


def fsdp_snippet(report: PlanReport) -> str:
    """An FSDP2 snippet with CPU offload for the chosen plan (parameters, gradients and optimizer)."""
    if report.chosen is None:
        raise ValueError("report: nothing fits, so there is no configuration to emit")
    lines = [
        "# FSDP2: shard each block and the root. CPUOffloadPolicy keeps parameters, gradients and",
        "# optimizer state in pinned host memory and runs the optimizer step on the CPU: FSDP2 has",
        "# only this all-in offload; for optimizer-only offload use DeepSpeed's offload_optimizer",
        "# or offloadlab's CPUOffloadAdam.",
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
        "",
        "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
    ]
    if report.chosen.level == 0:
        lines.append("offload = None  # the plan needs no offload")
    else:
        lines.append("offload = CPUOffloadPolicy(pin_memory=True)")
    lines += [
        "kwargs = {'mp_policy': mp} if offload is None else {'mp_policy': mp, 'offload_policy': offload}",
        "for block in model.blocks:",
        "    fully_shard(block, **kwargs)",
        "fully_shard(model, **kwargs)",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)",
    ]
    if report.chosen.recompute:
        lines.insert(3, "# activations: wrap each block with torch.utils.checkpoint (the plan recomputes them)")
    return "\n".join(lines)
