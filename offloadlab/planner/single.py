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

import dataclasses
from dataclasses import dataclass, field

from . import budget, memory, overlap, sharding
from .architectures import Architecture
from .units import (format_bandwidth, format_duration, format_size, parse_bandwidth, parse_count, parse_size,
                    check_positive)

__all__ = ["Workload", "Hardware", "Candidate", "Plan", "NodePlan", "PlanReport", "candidates", "plan", "schedule",
           "ASSUMED_COMPUTE", "ASSUMED_CPU_ADAM", "ASSUMED_INTERCONNECT",
           "ASSUMED_NVME"]

# Used only when the reader gives no measurement; every report names them as assumptions.
ASSUMED_COMPUTE = 200e12    # FLOP/s a modern training GPU sustains on bf16 matrix products
ASSUMED_CPU_ADAM = 100e9 / 28  # params/s: 100 GB/s of host memory at 28 B moved per parameter
WORKSPACE_FRACTION = 0.10   # of GPU memory kept back for the framework, kernels and fragmentation
HIDDEN_FRACTION = 0.10      # a plan whose GPU waits less than this share of its step counts as hidden
MAX_SIMULATED_LAYERS = 128  # planner.schedule simulates deeper models as this many groups of layers
OFFLOAD_LEVELS = ("nothing", "optimizer", "optimizer+gradients", "optimizer+gradients+parameters")
ASSUMED_INTERCONNECT = 450e9  # bytes/s each way per GPU: NVLink inside a node, from the book's link table
# Sustained bytes/s of a data-centre NVMe drive, the lower of read and write (writes sustain less than
# the 7 GB/s read figure drives are sold on; chapter 8): used only to say what the next tier would
# give when nothing fits in host memory and no drive was given.
ASSUMED_NVME = 2e9
BYTES_MOVED_PER_ADAM_PARAM = 28  # host bytes one fused AdamW update reads and writes per parameter


@dataclass(frozen=True)
class Workload:
    """The model and the step: parameters, optional transformer shape, batch and sequence."""

    params: float
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    batch: int = 1
    seq: int = 2048
    architecture: Architecture | None = None
    shape_assumed: bool = field(default=False, init=False)

    @classmethod
    def of_model(cls, architecture: Architecture, batch: int = 1, seq: int = 2048) -> "Workload":
        """A workload of a real model's exact parameter count and shape (see :mod:`offloadlab.architectures`)."""
        return cls(architecture.params, architecture.layers, architecture.hidden, architecture.heads, batch, seq,
                   architecture)

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
        elif self.hidden % self.heads:
            raise ValueError(f"heads: expected a divisor of hidden={self.hidden} (each head gets an equal slice); "
                             f"got {self.heads}")

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
        """Parameters of one transformer layer: exact for a real model, else an equal share of all."""
        return self.architecture.layer_params if self.architecture else self.params / self.layers

    def root_params(self) -> float:
        """Parameters outside the layers (embeddings, final norm, head): 0 when only a count is known."""
        return self.params - self.layers * self.layer_params() if self.architecture else 0.0

    def largest_module_params(self) -> float:
        """The largest single module (ZeRO-3 gathers one at a time): exact for a real model, else a
        layer's MLP input projection, 4 h² of the GPT-like shape."""
        return self.architecture.largest_module_params if self.architecture else 4 * self.hidden ** 2


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
    gpus_per_node: int = 1
    interconnect: float | None = None
    gpus_per_link: int = 1
    nvme: float | None = None  # sustained NVMe bandwidth (the lower of read and write); None: no NVMe tier
    sources: tuple[str, ...] = ()

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
        for name in ("gpus_per_node", "gpus_per_link"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer; got {value!r}")
        if self.gpus_per_node % self.gpus_per_link:
            raise ValueError(f"gpus_per_link: expected a divisor of gpus_per_node={self.gpus_per_node} (GPUs share "
                             f"links in equal groups); got {self.gpus_per_link}")
        if self.interconnect is not None:
            object.__setattr__(self, "interconnect", parse_bandwidth(self.interconnect, "interconnect"))
        if self.nvme is not None:
            object.__setattr__(self, "nvme", parse_bandwidth(self.nvme, "nvme"))

    def share(self) -> "Hardware":
        """What one GPU of the node gets when every GPU trains at once: an Nth of host memory and of
        the CPU-Adam throughput (the cores and their memory bandwidth), and its link divided among
        the GPUs that share it. On a one-GPU node, the machine itself."""
        n = self.gpus_per_node
        if n == 1 and self.gpus_per_link == 1:
            return self
        return Hardware(self.gpu_memory, self.link / self.gpus_per_link,
                        None if self.host_memory is None else self.host_memory / n,
                        (self.cpu_adam or ASSUMED_CPU_ADAM) / n, self.compute, self.comm_fraction)

    @classmethod
    def from_probe(cls, record: dict, **given) -> "Hardware":
        """Hardware from an ``offloadlab probe --json`` record; values in ``given`` (not None) win.

        Taken from the record: GPU memory (the accelerator's reported capacity), host memory, the
        host → GPU link (the α–β fit of the pinned sweep) and a CPU-Adam rate derived from the
        measured host memory bandwidth at 28 bytes moved per parameter. ``sources`` says where each
        came from; an emulated link (a machine without a GPU) is labelled so.
        """
        try:
            machine, ladder = record["machine"], record["ladder"]
            links = {row["name"]: row for row in ladder["links"]}
            tiers = {row["name"]: row for row in ladder["tiers"]}
            if not isinstance(machine, dict) or not all(isinstance(r, dict) for r in (*links.values(), *tiers.values())):
                raise TypeError
        except (KeyError, TypeError):
            raise ValueError("measured: expected an `offloadlab probe --json` record with 'machine' and 'ladder'; "
                             "got something else") from None
        values, sources = {}, {}

        def number(value, what: str, low: float, high: float) -> float:
            """A figure of the record, refused unless a number in [low, high] (a damaged or hand-edited file)."""
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"measured: expected {what} between {low:g} and {high:g} in the record; got {value!r}")
            return float(value)

        up = links.get("host → GPU")
        if up and up.get("bandwidth_bytes_per_s") is not None:
            values["link"] = number(up["bandwidth_bytes_per_s"], "the host → GPU bandwidth (B/s)", 1, 1e15)
            sources["link"] = f"link {format_bandwidth(values['link'])} ({up['source']}: α–β fit of the probe's sweep)"
        gpu = (machine.get("accelerator") or {}).get("memory_bytes")
        if gpu is not None:
            values["gpu_memory"] = gpu = number(gpu, "the GPU memory (bytes)", 1, 1e18)
            sources["gpu_memory"] = f"GPU memory {format_size(gpu)} (as the card reports it)"
        if machine.get("host_memory_bytes") is not None:
            values["host_memory"] = number(machine["host_memory_bytes"], "the host memory (bytes)", 1, 1e18)
            sources["host_memory"] = f"host memory {format_size(values['host_memory'])} (the probed machine's)"
        host = tiers.get("host memory") or {}
        if host.get("bandwidth_bytes_per_s") is not None:
            values["cpu_adam"] = number(host["bandwidth_bytes_per_s"], "the host memory bandwidth (B/s)", 1, 1e15) \
                / BYTES_MOVED_PER_ADAM_PARAM
            sources["cpu_adam"] = (f"CPU Adam {values['cpu_adam'] / 1e9:.2f} G params/s (derived: measured host "
                                   f"memory bandwidth ÷ {BYTES_MOVED_PER_ADAM_PARAM} B per parameter)")
        for name, value in given.items():
            if value is not None:
                values[name] = value
                sources.pop(name, None)  # given explicitly: not from the record
        for name in ("gpu_memory", "link"):
            if name not in values:
                raise ValueError(f"measured: the record has no {name.replace('_', ' ')}; "
                                 f"pass --{name.replace('_', '-')}")
        return cls(**values, sources=tuple(sources.values()))

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
        if self.gpus_per_node > 1 and self.interconnect is None:
            said.append(f"interconnect {format_bandwidth(ASSUMED_INTERCONNECT)} each way per GPU (assumed: NVLink; "
                        f"pass --interconnect)")
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
    # Deep models are simulated as at most MAX_SIMULATED_LAYERS equal groups of layers: the step
    # changes by a fraction of one group's time, and the simulation stays fast for any depth.
    layers = min(work.layers, MAX_SIMULATED_LAYERS)
    per_token = work.params * work.tokens / rate / layers
    per_layer = dict(layers=layers, forward=2 * per_token, backward=(6 if recompute else 4) * per_token,
                     duplex="half" if label == "half" else "full", delayed=delayed, after_backward=clipping)
    if level:
        moved = budget.traffic(_STREAMED[level], recipe)
        layer = work.params / layers
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


_NVME_NOTE = ("host memory cannot hold the offloaded state, so the plan keeps it on NVMe (ZeRO-Infinity): each "
              "step reads and writes it at the drive's speed, and a drive rated for a few full writes a day wears "
              "out in weeks at that rate (chapter 8)")

# The node's candidates, simplest first: on a tie the simpler one is chosen.
NODE_CANDIDATES = [(strategy, offload) for strategy in sharding.STRATEGIES for offload in sharding.OFFLOADS
                   if sharding.valid(strategy, offload)]


@dataclass(frozen=True)
class NodePlan:
    """One plan for one GPU of an N-GPU node: how state is sharded and offloaded, and its step.

    Bytes are per GPU (``host_bytes`` is this GPU's share; the node holds N times as much). The
    step model: collectives that run during forward and backward (weight gathers, gradient
    reductions) and the link's traffic in those passes overlap compute, each on its own wire;
    after backward come the CPU update of this GPU's shard on its Nth of the cores — DeepSpeed
    copies each updated tile up while the next is computed, so that phase lasts as long as the
    longer of the two — and ZeRO-1/2's all-gather of the new weights. The GPU's own Adam update
    (memory-bound, milliseconds) is left out.
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
    t_step_delayed = None

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def offload(self) -> str:
        return self.layout.offload

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
        return self.host_memory is None or self.host_bytes <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def step(self) -> float:
        """Predicted seconds per step: the overlapped passes, then the update and what follows it."""
        passes = max(self.t_compute, self.t_interconnect, self.t_transfer, self.t_nvme_passes)
        return passes + max(self.t_cpu + self.t_nvme_after, self.t_upload_after) + self.t_interconnect_after

    @property
    def waiting(self) -> float:
        return self.step - self.t_compute

    @property
    def binding(self) -> str:
        """What limits this plan: the memory it does not fit, or what its step waits on."""
        if not self.fits_gpu:
            return f"GPU memory: needs {format_size(self.gpu_bytes)} of the {format_size(self.gpu_usable)} usable"
        if not self.fits_host:
            return (f"host memory: needs {format_size(self.host_bytes)} per GPU of the "
                    f"{format_size(self.host_memory)} that is each GPU's share")
        if self.waiting <= HIDDEN_FRACTION * self.step:
            return "compute: collectives and transfers hide behind it"
        share = f"of a {format_duration(self.step)} step, {format_duration(self.t_compute)} of it compute"
        waits = {"the interconnect": max(0.0, self.t_interconnect - self.t_compute) + self.t_interconnect_after,
                 "the link": max(0.0, self.t_transfer - max(self.t_compute, self.t_interconnect))
                 + max(0.0, self.t_upload_after - self.t_cpu),
                 "the CPU": self.t_cpu,
                 "the NVMe drive": max(0.0, self.t_nvme_passes - max(self.t_compute, self.t_interconnect,
                                                                      self.t_transfer)) + self.t_nvme_after}
        worst = max(waits, key=waits.get)
        what = {"the interconnect": f"collectives take {format_duration(self.t_interconnect + self.t_interconnect_after)}",
                "the link": f"transfers take {format_duration(self.t_transfer + self.t_upload_after)}",
                "the CPU": f"its update of this GPU's shard takes {format_duration(self.t_cpu)} on an Nth of the cores",
                "the NVMe drive": f"reading and writing the state takes "
                                  f"{format_duration(self.t_nvme_passes + self.t_nvme_after)}"}
        return f"{worst}: {what[worst]} {share}"

    @property
    def name(self) -> str:
        return f"{self.layout.name}, activations {'recomputed' if self.recompute else 'kept'}"

    def to_dict(self) -> dict:
        return {"name": self.name, "strategy": self.strategy, "offload": self.offload, "recompute": self.recompute,
                "gpus": self.layout.gpus, "gpu_bytes": self.gpu_bytes, "host_bytes_per_gpu": self.host_bytes,
                "host_bytes_per_node": self.host_bytes * self.layout.gpus,
                "bytes_per_direction": {"h2d": self.h2d_bytes, "d2h": self.d2h_bytes},
                "interconnect_bytes_per_gpu": self.layout.interconnect_bytes,
                "t_compute_s": self.t_compute, "t_interconnect_s": self.t_interconnect + self.t_interconnect_after,
                "t_transfer_s": self.t_transfer + self.t_upload_after, "t_cpu_s": self.t_cpu,
                "nvme_bytes_per_gpu": self.layout.nvme_bytes, "t_nvme_s": self.t_nvme_passes + self.t_nvme_after,
                "step_s": self.step,
                "waiting_s": self.waiting, "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
                "binding": self.binding}


def _node_plan(work: Workload, hw: Hardware, strategy: str, offload: str, recompute: bool, duplex="full",
               recipe: str = memory.DEFAULT_RECIPE, nvme: bool = False) -> NodePlan:
    """One GPU's plan on an N-GPU node (data parallel: each GPU its own micro-batch of ``work``);
    with ``nvme``, ZeRO-Infinity's layout on the node's NVMe drive (shared by its GPUs)."""
    n, mine = hw.gpus_per_node, hw.share()
    if nvme:
        parts = sharding.nvme_layout(work.params, n, largest_module=work.largest_module_params(), recipe=recipe)
    else:
        parts = sharding.layout(strategy, offload, work.params, n, largest_module=work.largest_module_params(),
                                block_params=work.layer_params(), root_params=work.root_params(), recipe=recipe)
    gpu = parts.gpu_bytes + work.activation_bytes(recompute)
    net = hw.interconnect or ASSUMED_INTERCONNECT
    both, _ = budget.both_directions_rate(mine.link, duplex)
    # With only the optimizer offloaded the new weights go up after the update; with parameters
    # offloaded they stay on the host and come up with the next step's gathers.
    after_update = parts.h2d_bytes if offload == "optimizer" else 0.0
    t_compute = (8 if recompute else 6) * work.params * work.tokens / (hw.compute or ASSUMED_COMPUTE)
    drive = (hw.nvme or float("inf")) / n  # the drive's sustained rate, shared by the node's GPUs
    return NodePlan(parts, recompute, gpu, t_compute, parts.interconnect_overlapped / net,
                    parts.interconnect_after / net,
                    budget.link_seconds(parts.h2d_bytes - after_update, parts.d2h_bytes, mine.link, both),
                    after_update / mine.link, parts.cpu_params / (mine.cpu_adam or ASSUMED_CPU_ADAM),
                    hw.gpu_memory * (1 - WORKSPACE_FRACTION), mine.host_memory,
                    parts.nvme_during_passes / drive, parts.nvme_after / drive)


def _nvme_plans(work: Workload, hw: Hardware, duplex: str, recipe: str) -> list[NodePlan]:
    """ZeRO-Infinity on NVMe, activations kept or recomputed: the tier after host memory."""
    return [_node_plan(work, hw, "zero3", "optimizer+parameters", recompute, duplex, recipe, nvme=True)
            for recompute in (False, True)]


def _plan_node(work: Workload, hw: Hardware, duplex: str, recipe: str) -> tuple[list[NodePlan], NodePlan | None,
                                                                                  NodePlan | None, list[str]]:
    """Every sharding and offload choice on the node; the fastest that fits (the simpler on a tie)."""
    plans = [_node_plan(work, hw, strategy, offload, recompute, duplex, recipe)
             for strategy, offload in NODE_CANDIDATES for recompute in (False, True)]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
    warnings = []
    if not fitting and hw.nvme:  # the next tier: NVMe, at its speed
        plans += _nvme_plans(work, hw, duplex, recipe)
        fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
        if fitting:
            warnings.append(_NVME_NOTE)
    chosen = fitting[0] if fitting else None
    runner_up = fitting[1] if len(fitting) > 1 else None
    if chosen is None:  # name the plan closest to fitting: the least host memory among those the GPUs hold
        on_gpus = [p for p in plans if p.fits_gpu]
        least = min(on_gpus, key=lambda p: p.host_bytes) if on_gpus else min(plans, key=lambda p: p.gpu_bytes)
        warnings.append(f"nothing fits on {hw.gpus_per_node} GPUs: {least.binding} even with {least.name}; "
                        f"add GPUs or nodes, or offload to NVMe")
    else:
        alone = [p for p in fitting if p.strategy == "ddp"]
        if alone and chosen.strategy != "ddp":
            warnings.append(f"offloading alone ({alone[0].name}) would take {format_duration(alone[0].step)} a step "
                            f"and {format_size(alone[0].host_bytes * hw.gpus_per_node)} of host memory: every GPU "
                            f"keeps and updates a whole copy")
        if chosen.t_cpu:
            warnings.append("each rank's CPU update runs on its Nth of the cores: bind its threads and its pinned "
                            "buffers to the NUMA node next to its GPU (numactl, or DeepSpeed's --bind_cores_to_rank); "
                            "across sockets both slow down")
        if hw.comm_fraction >= 0.3 and chosen.offload != "none":
            warnings.append(f"offload is the wrong tool here: the run already spends {hw.comm_fraction:.0%} of its "
                            f"step on communication; offload adds traffic — move less instead")
    return plans, chosen, runner_up, warnings


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
            nvme_s = getattr(c, "t_nvme_passes", 0.0) + getattr(c, "t_nvme_after", 0.0)
            nvme = f", NVMe {format_duration(nvme_s)}" if nvme_s else ""
            lines.append(f"  step ≈ {format_duration(c.step)}: compute {format_duration(c.t_compute)}, then the GPU "
                         f"waits {format_duration(c.waiting)} (link {format_duration(c.t_transfer)}, "
                         f"CPU update {format_duration(c.t_cpu)}{nvme}, overlapped where the order allows)")
            if isinstance(c, NodePlan):
                n, net = c.layout.gpus, self.hardware.interconnect or ASSUMED_INTERCONNECT
                if n > 1:
                    lines.append(f"  each of the {n} GPUs: collectives carry {format_size(c.layout.interconnect_bytes)} "
                                 f"per step ((N−1)/N of each gathered or reduced tensor) over {format_bandwidth(net)}: "
                                 f"{format_duration(c.t_interconnect + c.t_interconnect_after)}; host "
                                 f"{format_size(c.host_bytes * n)} for the node")
                if c.layout.nvme_bytes:
                    lines.append(f"  NVMe: {format_size(c.layout.nvme_bytes * n)} on the drive, "
                                 f"{format_duration(c.t_nvme_passes + c.t_nvme_after)} of reads and writes per step")
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
    if hw.gpus_per_node > 1:
        node_plans, chosen, runner_up, warnings = _plan_node(work, hw, duplex, recipe)
        return PlanReport(work, hw, node_plans, chosen, runner_up, candidates(work, recipe), warnings, duplex, recipe)
    plans = [_plan(work, hw, level, recompute, duplex, recipe, clipping)
             for level in OFFLOAD_LEVELS for recompute in (False, True)]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.level, p.step))
    if not fitting and hw.nvme and any(p.fits_gpu for p in plans):  # host memory is short: the next tier, NVMe
        on_drive = [p for p in _nvme_plans(work, hw, duplex, recipe) if p.fits]
        if on_drive:
            plans += on_drive
            best, *rest = sorted(on_drive, key=lambda p: p.step)
            return PlanReport(work, hw, plans, best, rest[0] if rest else None, candidates(work, recipe),
                              [_NVME_NOTE], duplex, recipe)
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
                            f"{format_size(hw.host_memory)}; the next tier, NVMe, can hold it at a lower speed"
                            + ("" if hw.nvme else " (give the drive's bandwidth, --nvme, to plan on it)"))
        if not hw.nvme and any(p.fits_gpu for p in plans):  # what the next tier would give, at an assumed rate
            on_drive = [p for p in _nvme_plans(work, dataclasses.replace(hw, nvme=ASSUMED_NVME), duplex, recipe)
                        if p.fits]
            if on_drive:
                best = min(on_drive, key=lambda p: p.step)
                warnings.append(f"on an NVMe drive sustaining {format_bandwidth(ASSUMED_NVME)} (an assumption) it "
                                f"would fit, at {format_duration(best.step)} a step ({best.name}); pass --nvme with "
                                f"your drive's rate (`offloadlab probe --disk FOLDER` measures it) to plan on it")
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
