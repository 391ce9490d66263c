"""What to offload, and in what order: rank the candidates, choose the least offload that fits.

Given a model, a GPU, a host↔GPU link, host memory, a CPU-Adam throughput and a compute rate,
:func:`plan` builds every plan in the natural order — nothing, then optimizer states, then
gradients, then parameters, each with activations kept or recomputed — predicts each plan's
memory and step time, and picks the least offload that fits. It says which constraint binds,
what the runner-up would cost, when offload is the wrong tool and when nothing fits. Units:
bytes, bytes/s, seconds, FLOP/s, parameters/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import budget, memory
from .units import (format_bandwidth, format_duration, format_size, parse_bandwidth, parse_count, parse_size,
                    check_positive)

__all__ = ["Workload", "Hardware", "Candidate", "Plan", "PlanReport", "candidates", "plan",
           "deepspeed_config", "fsdp_snippet", "ASSUMED_COMPUTE", "ASSUMED_CPU_ADAM"]

# Used only when the reader gives no measurement; every report names them as assumptions.
ASSUMED_COMPUTE = 200e12    # FLOP/s a modern training GPU sustains on bf16 matrix products
ASSUMED_CPU_ADAM = 100e9 / 28  # params/s: 100 GB/s of host memory at 28 B moved per parameter
WORKSPACE_FRACTION = 0.10   # of GPU memory kept back for the framework, kernels and fragmentation
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
    """One kind of state: what offloading it frees on the GPU and what it costs per step."""

    name: str
    frees_bytes: float
    traffic_bytes: float
    note: str

    @property
    def payoff_per_traffic(self) -> float:
        return self.frees_bytes / self.traffic_bytes if self.traffic_bytes else float("inf")


def candidates(work: Workload) -> list[Candidate]:
    """Every offload candidate, ranked best first: most bytes freed per byte moved each step."""
    p = work.params
    act_kept, act_recomputed = work.activation_bytes(False), work.activation_bytes(True)
    found = [
        Candidate("optimizer states", 12 * p, budget.traffic_bytes(p, "optimizer"),
                  "master weights and both moments, touched once per step; updated on the CPU"),
        Candidate("gradients", 2 * p, budget.traffic_bytes(p, "gradients"),
                  "streamed down as backward produces them (free once the optimizer is offloaded)"),
        Candidate("parameters", 2 * p, budget.traffic_bytes(p, "parameters"),
                  "needed by every layer in forward and again in backward"),
        # Offloading activations moves what recomputation would rebuild: down in forward, up in backward.
        Candidate("activations (offload)", act_kept - act_recomputed, 2 * (act_kept - act_recomputed),
                  "recomputing them instead costs one extra forward (+1/3 compute) and no traffic"),
    ]
    return sorted(found, key=lambda c: -c.payoff_per_traffic)


@dataclass(frozen=True)
class Plan:
    """One plan's memory, traffic and predicted step time."""

    offload: str
    recompute: bool
    gpu_bytes: float
    host_bytes: float
    traffic_bytes: float
    t_compute: float
    t_transfer: float
    t_cpu: float
    fits_gpu: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def step(self) -> float:
        """Predicted seconds per step: compute and transfer overlap; the CPU update follows backward."""
        return max(self.t_compute, self.t_transfer) + self.t_cpu

    @property
    def level(self) -> int:
        return OFFLOAD_LEVELS.index(self.offload)

    @property
    def binding(self) -> str:
        stall = max(0.0, self.t_transfer - self.t_compute)
        if self.level == 0:
            return "nothing: it fits on the GPU without offload"
        if stall > 0 and stall >= self.t_cpu:
            return "the link: transfers outlast the compute that should hide them"
        if self.t_cpu > 0.25 * self.t_compute:
            return "the CPU: its Adam update is a large part of the step"
        return "GPU memory: offload is hidden behind compute"

    @property
    def name(self) -> str:
        return f"offload {self.offload}, activations {'recomputed' if self.recompute else 'kept'}"

    def to_dict(self) -> dict:
        return {"name": self.name, "offload": self.offload, "recompute": self.recompute,
                "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "traffic_bytes": self.traffic_bytes,
                "t_compute_s": self.t_compute, "t_transfer_s": self.t_transfer, "t_cpu_s": self.t_cpu,
                "step_s": self.step, "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
                "binding": self.binding}


def _plan(work: Workload, hw: Hardware, offload: str, recompute: bool) -> Plan:
    p = work.params
    level = OFFLOAD_LEVELS.index(offload)
    streamed = {1: ["optimizer"], 2: ["optimizer", "gradients"], 3: ["optimizer", "gradients", "parameters"]}
    on_gpu_per_param = {0: 16, 1: 4, 2: 2, 3: 0}[level]
    gpu = on_gpu_per_param * p + work.activation_bytes(recompute)
    if level >= 2:  # one gradient bucket (a layer's worth) waits on the GPU for its trip down
        gpu += 2 * work.layer_params()
    if level == 3:  # two layers of weights in flight: the one computing, the one arriving
        gpu += 2 * 2 * work.layer_params()
    host = 0.0 if level == 0 else 12 * p + 2 * p + (2 * p if level == 3 else 0)
    traffic = budget.traffic_bytes(p, streamed[level]) if level else 0.0
    flops = 6 * p * work.tokens * (4 / 3 if recompute else 1)
    t_compute = flops / (hw.compute or ASSUMED_COMPUTE)
    t_cpu = p / (hw.cpu_adam or ASSUMED_CPU_ADAM) if level else 0.0
    usable = hw.gpu_memory * (1 - WORKSPACE_FRACTION)
    fits_host = hw.host_memory is None or host <= hw.host_memory
    return Plan(offload, recompute, gpu, host, traffic, t_compute, traffic / hw.link, t_cpu, gpu <= usable, fits_host)


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

    def explain(self) -> str:
        lines = [f"model: {self.work.params / 1e9:g} B parameters, batch {self.work.batch} × seq {self.work.seq}; "
                 f"GPU {format_size(self.hardware.gpu_memory)}, link {format_bandwidth(self.hardware.link)}"]
        if self.work.shape_assumed:
            lines.append(f"assumed: a GPT-like shape of {self.work.layers} layers, hidden {self.work.hidden}, "
                         f"{self.work.heads} heads (pass --layers/--hidden/--heads)")
        lines += [f"assumed: {a}" for a in self.hardware.assumptions]
        lines.append("candidates, best first (bytes freed per byte moved each step):")
        lines += [f"  {c.name:<22} frees {format_size(c.frees_bytes):>9}, moves {format_size(c.traffic_bytes):>9}"
                  f"/step — {c.note}" for c in self.ranking]
        if self.chosen is None:
            lines.append("plan: nothing fits")
        else:
            c = self.chosen
            lines.append(f"plan: {c.name}")
            lines.append(f"  GPU {format_size(c.gpu_bytes)} of {format_size(self.hardware.gpu_memory)}, "
                         f"host {format_size(c.host_bytes)}, traffic {format_size(c.traffic_bytes)}/step")
            lines.append(f"  step ≈ {format_duration(c.step)} (compute {format_duration(c.t_compute)}, "
                         f"transfer {format_duration(c.t_transfer)}, CPU update {format_duration(c.t_cpu)})")
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
                "assumptions": self.hardware.assumptions, "warnings": self.warnings}


def plan(work: Workload, hw: Hardware) -> PlanReport:
    """Choose the least offload that fits; within a level, the faster activation choice."""
    plans = [_plan(work, hw, level, recompute) for level in OFFLOAD_LEVELS for recompute in (False, True)]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.level, p.step))
    chosen = fitting[0] if fitting else None
    others = sorted((p for p in fitting[1:]), key=lambda p: p.step)
    runner_up = others[0] if others else None
    warnings = []
    if chosen is None:
        most = min(plans, key=lambda p: p.gpu_bytes)
        if not most.fits_gpu:
            warnings.append(f"nothing fits: even with everything offloaded and activations recomputed the GPU needs "
                            f"{format_size(most.gpu_bytes)}; shorten the sequence, shrink the batch, or shard "
                            f"across GPUs")
        else:
            warnings.append(f"nothing fits: offloading needs {format_size(most.host_bytes)} of host memory; "
                            f"the next tier, NVMe, can hold it at a lower speed")
    elif chosen.level == 0:
        warnings.append("offload is not needed: the whole state fits on the GPU")
    else:
        if hw.comm_fraction >= 0.3:
            warnings.append(f"offload is the wrong tool here: the run already spends {hw.comm_fraction:.0%} of its "
                            f"step on communication; offload adds traffic — move less instead")
        if chosen.t_transfer > 2 * chosen.t_compute:
            warnings.append("offload makes this run bandwidth-bound: a larger batch, a faster link or more GPUs "
                            "(sharding instead of offloading) would serve it better")
    return PlanReport(work, hw, plans, chosen, runner_up, candidates(work), warnings)


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
