"""One GPU: what to offload, in what order, and the step each choice gives.

Every plan here is one offload level — nothing, then optimizer states, then gradients, then
parameters — run as offloadlab's own :class:`~offloadlab.offload.CPUOffloadAdam` runs it, with
activations kept, recomputed in every layer, or recomputed in as few layers as make it fit.

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

from .. import budget, memory, overlap
from ..units import check_integer, format_duration, format_size
from .workload import ASSUMED_COMPUTE, ASSUMED_CPU_ADAM, Hardware, Workload, usable_host

__all__ = [
    "Candidate",
    "candidates",
    "Plan",
    "schedule",
    "single_gpu_plans",
    "OFFLOAD_LEVELS",
    "HIDDEN_FRACTION",
    "MAX_SIMULATED_LAYERS",
    "RECOMPUTE_CHOICES",
    "recompute_choices",
    "gpu_binding",
    "offloaded_activations",
]

# a plan whose GPU waits less than this share of its step counts as hidden
HIDDEN_FRACTION = 0.10
# offloading activations is offered where it is at least this much faster than recomputing them
OFFLOAD_GAIN = 0.05
MAX_SIMULATED_LAYERS = 128  # schedule simulates deeper models as this many groups of layers
OFFLOAD_LEVELS = ("nothing", "optimizer", "optimizer+gradients", "optimizer+gradients+parameters")


@dataclass(frozen=True)
class Candidate:
    """One kind of state: what offloading it frees on the GPU and the traffic it adds each step."""

    name: str
    frees_bytes: float
    traffic_bytes: float
    note: str

    @property
    def payoff_per_traffic(self) -> float:
        """Bytes of GPU memory freed per byte it adds to each step's traffic (inf when it adds
        none)."""
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
    levels = [
        budget.traffic(["optimizer", "gradients", "parameters"][:n], recipe).per_param
        for n in (1, 2, 3)
    ]
    element = int(r.weight_bytes)
    act_kept, act_recomputed = (
        work.activation_bytes(False, element),
        work.activation_bytes(True, element),
    )
    return [
        Candidate(
            "optimizer states",
            r.optimizer_bytes * p,
            levels[0] * p,
            "master weights and moments, touched once per step; updated on the CPU",
        ),
        Candidate(
            "gradients",
            r.gradient_bytes * p,
            (levels[1] - levels[0]) * p,
            "they go down for the CPU update anyway: offloading them moves nothing more",
        ),
        Candidate(
            "parameters",
            r.weight_bytes * p,
            (levels[2] - levels[1]) * p,
            "each layer comes up for forward and again for backward instead of once after the "
            "update",
        ),
        # Offloading activations moves what recomputation would rebuild: down in forward, up in
        # backward.
        Candidate(
            "activations (offload)",
            act_kept - act_recomputed,
            2 * (act_kept - act_recomputed),
            "recomputing them instead costs one extra forward (+1/3 compute) and no traffic",
        ),
    ]


def gpu_binding(terms: dict[str, float], usable: float) -> str:
    """What a plan that does not fit on the GPU runs out on: its largest term, and what acts on
    it."""
    worst = max(terms, key=terms.get)
    levers = {
        "activations of the layers": "recompute them (activation checkpointing), a smaller "
        "micro-batch (--batch), or shorter sequences per GPU (sequence or context parallelism)",
        "logits and loss": "a smaller micro-batch, or a loss computed in chunks (a fused linear "
        "cross-entropy) that never holds the whole logits",
        "model state": "offload more of it, or shard it across more GPUs",
        "gathered weights": "smaller modules to gather, or more GPUs to shard across",
    }[worst]
    spelled = ", ".join(f"{name} {format_size(size)}" for name, size in terms.items() if size)
    return (
        f"{worst} ({format_size(terms[worst])} of {spelled}) against {format_size(usable)} "
        f"usable: {levers}"
    )


@dataclass(frozen=True)
class Plan:
    """One plan's memory, traffic and predicted step (bytes, seconds).

    ``t_compute`` is forward and backward (with recomputation, if chosen), ``t_transfer`` the
    link time of the step's traffic under the duplex assumption, ``t_cpu`` the CPU update.
    ``t_step`` comes from :func:`offloadlab.overlap.offload_step`, which knows what waits for
    what: a layer's update waits for its gradient, its upload for its update, and the next step
    for every upload. ``t_step_delayed`` is the same with a delayed parameter update (None where
    there is no CPU update to delay, or parameters are fetched). ``checkpointed`` layers of
    ``layers`` recompute their activations; ``gpu_terms`` split ``gpu_bytes`` by what holds it.
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
    checkpointed: int = 0
    layers: int = 0
    gpu_terms: dict = field(default_factory=dict, compare=False)
    activations_offloaded: bool = False  # every layer's saved activations to host memory

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_bytes <= self.gpu_usable

    @property
    def fits_host(self) -> bool:
        return self.host_memory is None or self.host_bytes <= usable_host(self.host_memory)

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
            return (
                f"GPU memory: needs {format_size(self.gpu_bytes)} of the "
                f"{format_size(self.gpu_usable)} usable"
            )
        if not self.fits_host:
            return (
                f"host memory: needs {format_size(self.host_bytes)} of the "
                f"{format_size(usable_host(self.host_memory))} usable of "
                f"{format_size(self.host_memory)}"
            )
        if self.level == 0:
            return "nothing: it fits on the GPU without offload"
        if self.waiting <= HIDDEN_FRACTION * self.t_step:
            return "GPU memory: offload is hidden behind compute"
        share = (
            f"of a {format_duration(self.t_step)} step, {format_duration(self.t_compute)} of "
            "it compute"
        )
        if self.t_transfer >= self.t_cpu:
            return f"the link: transfers take {format_duration(self.t_transfer)} {share}"
        return f"the CPU: its update takes {format_duration(self.t_cpu)} {share}"

    @property
    def name(self) -> str:
        activations = (
            "activations offloaded"
            if self.activations_offloaded
            else activations_name(self.checkpointed, self.layers)
        )
        return f"offload {self.offload}, {activations}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "offload": self.offload,
            "recompute": self.recompute,
            "checkpointed_layers": self.checkpointed,
            "activations_offloaded": self.activations_offloaded,
            "gpu_bytes": self.gpu_bytes,
            "gpu_terms": self.gpu_terms,
            "host_bytes": self.host_bytes,
            "traffic_bytes": self.traffic_bytes,
            "bytes_per_direction": {"h2d": self.h2d_bytes, "d2h": self.d2h_bytes},
            "t_compute_s": self.t_compute,
            "t_transfer_s": self.t_transfer,
            "t_cpu_s": self.t_cpu,
            "step_s": self.step,
            "step_delayed_update_s": self.t_step_delayed,
            "waiting_s": self.waiting,
            "fits": self.fits,
            "fits_gpu": self.fits_gpu,
            "fits_host": self.fits_host,
            "binding": self.binding,
        }


_STREAMED = {
    0: [],
    1: ["optimizer"],
    2: ["optimizer", "gradients"],
    3: ["optimizer", "gradients", "parameters"],
}


def schedule(
    work: Workload,
    hw: Hardware,
    offload: str,
    recompute=False,
    *,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    delayed: bool = False,
    clipping: bool = False,
) -> overlap.OffloadStep:
    """The step of one plan laid out layer by layer (:func:`offloadlab.overlap.offload_step`).

    Each of the workload's layers gets an equal share of the parameters and of each pass's
    compute (:meth:`Workload.pass_flops`). ``clipping``: no update starts before every gradient is
    in. A measured ``duplex`` rate runs both copy engines at the rate each keeps while the other is
    busy: the cautious reading.
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
    forward, backward = work.pass_flops(recompute)
    per_layer = dict(
        layers=layers,
        forward=forward / rate / layers,
        backward=backward / rate / layers,
        duplex="half" if label == "half" else "full",
        delayed=delayed,
        after_backward=clipping,
    )
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


RECOMPUTE_CHOICES = ("auto", "none", "all")


def activations_name(checkpointed: int, layers: int) -> str:
    """How a plan keeps its activations, for its name: ``checkpointed`` of ``layers`` recomputed."""
    if not checkpointed:
        return "activations kept"
    if checkpointed == layers:
        return "activations recomputed"
    return f"activations recomputed in {checkpointed} of {layers} layers"


def recompute_choices(work: Workload, fits_with, recompute="auto") -> list[int]:
    """Layers to checkpoint worth planning: with ``recompute`` 'auto', none, every layer, and — when
    keeping every activation does not fit but recomputing all of them does — the fewest that fit
    (``fits_with(k)``); 'none', 'all' or a number of layers plans only that."""
    everything = work.layers
    if recompute != "auto":
        if recompute in ("none", "all"):
            return [0 if recompute == "none" else everything]
        return [
            check_integer(
                recompute,
                "recompute",
                0,
                everything,
                expected=f"'auto', 'none', 'all' or a number of layers from 0 to {everything}",
            )
        ]
    choices = [0, everything]
    if not fits_with(0) and fits_with(everything):
        low, high = 0, everything  # fits_with(high) holds, fits_with(low) does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits_with(middle) else (middle, high)
        if high not in choices:
            choices.append(high)
    return choices


def offloaded_activations(work: Workload, element: int) -> tuple[float, float]:
    """(bytes each way per step, activation bytes on the GPU at the peak) when every layer's saved
    activations go to host memory (:func:`offloadlab.offload_activations`): down in forward, up
    in backward one layer ahead, so two layers' worth are on the GPU at a time, beside the logits
    and the rest that stay."""
    kept = work.activations(0, element)
    per_layer = kept.layers / work.layers
    return kept.layers, 2 * per_layer + kept.logits + kept.other


def _gpu(
    work: Workload, level: int, checkpointed: int, recipe: str, offloaded: bool = False
) -> tuple[float, dict]:
    """GPU bytes of an offload level, and their terms: model state, activations, logits and loss
    (``offloaded``: the layers' activations in host memory, two layers' worth in flight)."""
    r = memory.get_recipe(recipe)
    w, g, p, layer = r.weight_bytes, r.gradient_bytes, work.params, work.layer_params()
    state = {0: r.total, 1: w + g, 2: w, 3: 0.0}[level] * p
    # One gradient bucket (a layer's worth) waiting for its trip down; with parameters fetched,
    # two layers of weights in flight: the one computing, the one arriving.
    in_flight = (g * layer if level >= 2 else 0.0) + (2 * w * layer if level == 3 else 0.0)
    activations = work.activations(checkpointed, int(w))
    if offloaded:
        _, on_gpu = offloaded_activations(work, int(w))
        terms = {
            "activations of the layers": on_gpu - activations.logits - activations.other,
            "logits and loss": activations.logits,
        }
        return state + in_flight + on_gpu, {"model state": state + in_flight, **terms}
    return state + in_flight + activations.total, {
        "model state": state + in_flight,
        **activations.terms(),
    }


def _plan(
    work: Workload,
    hw: Hardware,
    offload: str,
    checkpointed: int,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    clipping: bool = False,
    offloaded: bool = False,
) -> Plan:
    """One plan; ``offloaded``: with every layer's activations in host memory (their copies are
    laid beside the optimizer's: each direction's must fit its pass, down in forward and up in
    backward, at the rate it keeps while the other runs; what does not is added to the step)."""
    p, r = work.params, memory.get_recipe(recipe)
    level = OFFLOAD_LEVELS.index(offload)
    w, g = r.weight_bytes, r.gradient_bytes
    gpu, terms = _gpu(work, level, checkpointed, recipe, offloaded)
    # Host: the optimizer state, a landing buffer for gradients, and a copy of the weights in their
    # device dtype — what the update writes and the uploads (or, with parameters offloaded, the
    # fetches) read; without fp32 master weights it is also what the update reads.
    host = (r.optimizer_bytes + g + w) * p if level else 0.0
    moved = budget.traffic(_STREAMED[level], recipe) if level else None
    h2d, d2h = (moved.h2d * p, moved.d2h * p) if moved else (0.0, 0.0)
    both, _ = budget.both_directions_rate(hw.link, duplex)
    forward, backward = work.pass_flops(checkpointed)
    t_forward, t_compute = (
        flops / (hw.compute or ASSUMED_COMPUTE) for flops in (forward, forward + backward)
    )
    activation_bytes, exposed = 0.0, 0.0
    if offloaded:
        activation_bytes, _ = offloaded_activations(work, int(w))
        h2d, d2h = h2d + activation_bytes, d2h + activation_bytes
        exposed = overlap.activation_round_trip(
            activation_bytes, both, t_forward, t_compute - t_forward
        )
    t_cpu = p / (hw.cpu_adam or ASSUMED_CPU_ADAM) if level else 0.0
    laid_out = dict(duplex=duplex, recipe=recipe, clipping=clipping)
    t_step = schedule(work, hw, offload, checkpointed, **laid_out).step if level else t_compute
    t_delayed = (
        schedule(work, hw, offload, checkpointed, delayed=True, **laid_out).step + exposed
        if level in (1, 2)
        else None
    )
    t_step += exposed
    return Plan(
        offload,
        checkpointed > 0,
        gpu,
        host,
        h2d,
        d2h,
        t_compute,
        budget.link_seconds(h2d, d2h, hw.link, both),
        t_cpu,
        t_step,
        t_delayed,
        hw.usable_gpu_memory,
        hw.host_memory,
        checkpointed,
        work.layers,
        terms,
        offloaded,
    )


def single_gpu_plans(
    work: Workload,
    hw: Hardware,
    duplex="full",
    recipe: str = memory.DEFAULT_RECIPE,
    clipping: bool = False,
    recompute="auto",
) -> list[Plan]:
    """Every offload level with activations kept, recomputed, recomputed in the fewest layers that
    fit (or only as ``recompute`` says: see :func:`recompute_choices`), and, with 'auto',
    offloaded to host memory where their copies hide behind the passes."""
    plans = []
    for index, level in enumerate(OFFLOAD_LEVELS):

        def fits_with(k, index=index):
            return _gpu(work, index, k, recipe)[0] <= hw.usable_gpu_memory

        plans += [
            _plan(work, hw, level, k, duplex, recipe, clipping)
            for k in recompute_choices(work, fits_with, recompute)
        ]
        if recompute == "auto":
            level_plans = [plan for plan in plans if plan.offload == level]
            kept = next(plan for plan in level_plans if plan.checkpointed == 0)
            offloaded = _plan(work, hw, level, 0, duplex, recipe, clipping, offloaded=True)
            # offered where its copies hide (no slower than keeping) and it saves time over
            # recomputing: where the CPU or the link binds anyway, recomputing moves no bytes
            recomputed = [plan.step for plan in level_plans if plan.checkpointed and plan.fits]
            if offloaded.step <= kept.step * (1 + 1e-9) and all(
                offloaded.step < (1 - OFFLOAD_GAIN) * step for step in recomputed
            ):
                plans.append(offloaded)
    return plans
