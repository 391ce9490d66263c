"""The overlap-vs-stall condition: for one stage, a pipeline of stages, and a whole offloaded step.

A stage moves X bytes over a link of bandwidth B (t_transfer = latency + X / B) while
t_compute of independent work runs. If t_transfer ≤ t_compute the transfer is hidden;
otherwise the GPU stalls for the difference. :func:`pipeline` chains such stages through a
prefetch buffer; :func:`offload_step` lays out a training step whose optimizer lives in host
memory, with what waits for what. Pure arithmetic: seconds, bytes, bytes/s.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from .units import (
    check_integer,
    check_non_negative,
    check_positive,
    parse_bandwidth,
    parse_duration,
    parse_flops,
    parse_size,
)

__all__ = [
    "Stage",
    "stage",
    "PipelineStep",
    "pipeline",
    "crossover_batch",
    "crossover_tokens",
    "activation_round_trip",
    "OffloadStep",
    "offload_step",
]


@dataclass(frozen=True)
class Stage:
    """One stage: its transfer and compute times, the step time and the stall (seconds)."""

    t_transfer: float
    t_compute: float

    @property
    def hidden(self) -> bool:
        """True when the transfer fits inside the compute (no stall)."""
        return self.t_transfer <= self.t_compute

    @property
    def stall(self) -> float:
        """Seconds the compute waits for the transfer: max(0, t_transfer − t_compute)."""
        return max(0.0, self.t_transfer - self.t_compute)

    @property
    def step(self) -> float:
        """Seconds for the stage with perfect overlap: max(t_transfer, t_compute)."""
        return max(self.t_transfer, self.t_compute)

    @property
    def regime(self) -> str:
        return "compute-bound (transfer hidden)" if self.hidden else "bandwidth-bound (stalls)"


def stage(nbytes, bandwidth, t_compute, latency=0.0) -> Stage:
    """The overlap condition for moving ``nbytes`` over ``bandwidth`` during ``t_compute``
    seconds."""
    size = parse_size(nbytes, "nbytes", allow_zero=True)
    rate = parse_bandwidth(bandwidth, "bandwidth")
    compute = parse_duration(t_compute, "t_compute", allow_zero=True)
    delay = parse_duration(latency, "latency", allow_zero=True)
    return Stage((delay + size / rate) if size else 0.0, compute)


@dataclass(frozen=True)
class PipelineStep:
    """A simulated pipeline: when each transfer and each compute ran (seconds from 0)."""

    transfers: list[tuple[float, float]]
    computes: list[tuple[float, float]]

    @property
    def step(self) -> float:
        return self.computes[-1][1] if self.computes else 0.0

    @property
    def stall(self) -> float:
        """Seconds the compute sat idle waiting for data."""
        return self.step - sum(end - start for start, end in self.computes)


def pipeline(transfer_seconds, compute_seconds, depth: int = 1) -> PipelineStep:
    """Layer i's data must arrive before layer i computes; the link moves one item at a time.

    ``depth`` is how many items may be fetched ahead of the one being computed, with
    ``depth + 1`` buffers: 0 is no prefetch (each fetch starts only when the previous
    layer's compute is done, so transfers serialise with compute); 1 is double buffering.
    A buffer is refilled only after the compute that used it has finished.
    """
    for name, values in (
        ("transfer_seconds", transfer_seconds),
        ("compute_seconds", compute_seconds),
    ):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ValueError(
                f"{name}: expected a sequence of seconds, one per layer; got {values!r}"
            )
    transfers = [check_non_negative(t, "transfer_seconds") for t in transfer_seconds]
    computes = [check_non_negative(c, "compute_seconds") for c in compute_seconds]
    if len(transfers) != len(computes):
        raise ValueError(
            f"compute_seconds: expected {len(transfers)} values, one per transfer; got "
            f"{len(computes)}"
        )
    check_integer(depth, "depth", 0)
    fetched, computed = [], []
    for i, (t, c) in enumerate(zip(transfers, computes)):
        link_free = fetched[-1][1] if fetched else 0.0
        # With depth d, item i may be fetched once item i-d-1 is computed (its buffer is free);
        # with no prefetch (d = 0) that is once the previous item is computed.
        buffer_free = computed[i - depth - 1][1] if i - depth - 1 >= 0 else 0.0
        if depth == 0 and computed:
            buffer_free = computed[-1][1]
        start = max(link_free, buffer_free)
        fetched.append((start, start + t))
        begin = max(fetched[-1][1], computed[-1][1] if computed else 0.0)
        computed.append((begin, begin + c))
    return PipelineStep(fetched, computed)


def crossover_batch(traffic_bytes, bandwidth, compute_seconds_per_sample, latency=0.0) -> int:
    """The smallest batch whose compute (batch × seconds per sample) hides the step's transfer."""
    per_sample = parse_duration(compute_seconds_per_sample, "compute_seconds_per_sample")
    t_transfer = stage(traffic_bytes, bandwidth, 0, latency).t_transfer
    return max(1, math.ceil(t_transfer / per_sample - 1e-9))


def activation_round_trip(saved_bytes, bandwidth, forward_seconds, backward_seconds) -> float:
    """Seconds offloading ``saved_bytes`` of activations adds to a step: they go down over the
    link (``bandwidth`` bytes/s one way) beside forward and come back up beside backward; what
    either copy takes beyond its pass is exposed. Recomputing instead adds one more forward."""
    down = stage(saved_bytes, bandwidth, forward_seconds).stall
    up = stage(saved_bytes, bandwidth, backward_seconds).stall
    return down + up


def crossover_tokens(flops, bandwidth, bytes_per_param=2.0, flops_per_param_token=6.0) -> float:
    """T*: the tokens per step from which a step's compute can hide its offload's copies.

    A step of T tokens computes for T × ``flops_per_param_token`` × P / R seconds on a GPU that
    sustains R = ``flops`` FLOP/s: 6 for forward and backward (two FLOPs per multiply–add
    forward, four backward), 4 when only backward can cover the copies. Meanwhile the offload
    moves ``bytes_per_param`` × P bytes each way over a link of B = ``bandwidth`` bytes/s per
    direction, both directions at once (full duplex). The parameter count P cancels:

        T* = bytes_per_param × R / (flops_per_param_token × B)

    For optimizer offload of mixed-precision training — each 16-bit gradient down and each
    16-bit weight up, 2 bytes per parameter each way — that is R / (3B), and R / (2B) behind
    backward alone. A real number of tokens: a step hides the copies from ⌈T*⌉ tokens.
    """
    rate = parse_flops(flops, "flops")
    link = parse_bandwidth(bandwidth, "bandwidth")
    moved = check_positive(bytes_per_param, "bytes_per_param")
    work = check_positive(flops_per_param_token, "flops_per_param_token")
    return moved * rate / (work * link)


@dataclass(frozen=True)
class OffloadStep:
    """One simulated training step with offloaded state: what each resource did, and when.

    ``lanes`` maps "compute", "D2H", "CPU" and "H2D" to (start, end, label) intervals in seconds
    from the start of the step; ``step`` is the seconds from this step's first forward layer to
    the next step's (in steady state).
    """

    lanes: dict[str, list[tuple[float, float, str]]]
    step: float

    def busy(self, lane: str) -> float:
        """Seconds ``lane`` worked during the step."""
        return sum(end - start for start, end, _ in self.lanes.get(lane, []))

    @property
    def waiting(self) -> float:
        """Seconds of the step in which the GPU computes nothing: what offloading costs."""
        return self.step - self.busy("compute")


class _Schedule:
    """Tasks with dependencies on resources that run one task at a time.

    A resource starts, among the tasks whose dependencies are done, the one that became ready
    first (ties: the one added first) — as a copy stream or a worker thread serves work in the
    order it is handed over.
    """

    def __init__(self):
        self.tasks: list[tuple[str, float, str | None, str]] = []  # resource, seconds, lane, label
        self.deps: list[list[int]] = []

    def add(
        self, resource: str, seconds: float, deps=(), lane: str | None = None, label: str = ""
    ) -> int:
        self.tasks.append((resource, seconds, lane, label))
        self.deps.append(sorted(set(deps)))
        return len(self.tasks) - 1

    def run(self) -> tuple[list[float], list[float]]:
        """Start and end time of every task."""
        count = len(self.tasks)
        start, end = [0.0] * count, [0.0] * count
        missing = [len(d) for d in self.deps]
        dependents: list[list[int]] = [[] for _ in range(count)]
        for task, deps in enumerate(self.deps):
            for dep in deps:
                dependents[dep].append(task)
        ready: dict[str, list] = {}
        for task in range(count):
            if not missing[task]:
                heapq.heappush(ready.setdefault(self.tasks[task][0], []), (0.0, task))
        busy: set[str] = set()
        running: list[tuple[float, int]] = []
        now, finished = 0.0, 0
        while finished < count:
            for resource, queue in ready.items():
                if resource not in busy and queue:
                    _, task = heapq.heappop(queue)
                    start[task], end[task] = now, now + self.tasks[task][1]
                    busy.add(resource)
                    heapq.heappush(running, (end[task], task))
            if not running:
                raise RuntimeError("the schedule has a dependency cycle")
            now = running[0][0]
            # everything ending now, before anything new starts
            while running and running[0][0] == now:
                _, task = heapq.heappop(running)
                busy.discard(self.tasks[task][0])
                finished += 1
                for after in dependents[task]:
                    missing[after] -= 1
                    if not missing[after]:
                        heapq.heappush(ready.setdefault(self.tasks[after][0], []), (now, after))
        return start, end


def offload_step(
    layers: int,
    forward,
    backward,
    *,
    gradient=0.0,
    update=0.0,
    upload=0.0,
    fetch=0.0,
    duplex: str = "full",
    delayed: bool = False,
    after_backward: bool = False,
) -> OffloadStep:
    """Simulate a training step whose optimizer (and perhaps parameters) live in host memory.

    Per layer, in seconds: ``forward`` and ``backward`` compute; ``gradient``, the copy of its
    gradient down; ``update``, the CPU's update of its state; ``upload``, the copy of its
    refreshed weights up; ``fetch``, the copy of its weights up before forward and again before
    backward (parameter offload: then ``upload`` is 0, as the CPU writes the host copy that the
    next fetch reads).

    What waits for what (the schedule of :class:`offloadlab.offload.CPUOffloadAdam`):

    - the GPU computes forward layers first to last, then backward last to first;
    - a layer's gradient goes down once its backward is done, its CPU update starts once the
      gradient has landed, its weights go up once updated; the D2H engine, the CPU and the H2D
      engine each handle one layer at a time;
    - fetched weights are double-buffered: a fetch starts once the compute two items earlier
      has freed its buffer;
    - ``duplex="full"``: a copy engine per direction; ``"half"``: one for both, in the order
      the copies become ready;
    - without ``delayed``, the next step starts once every update and upload has finished, so
      whatever the CPU and the copies cannot fit behind backward is exposed;
    - ``after_backward``: no update starts before every gradient has landed, as global-norm
      clipping and fp16 overflow checks require (the norm needs them all);
    - with ``delayed`` (ZeRO-Offload's delayed parameter update), step t's update runs during
      step t+1's forward and backward, which use weights one step older. At the end of
      backward the step waits for that update, then uploads its weights: the weights they
      replace are in use until then, so the upload is exposed (double-buffered weights would
      hide it, for 2 B per parameter of GPU memory). A layer's gradient cannot land before the
      previous update has read the one before it, which can hold up backward.
    """
    check_integer(layers, "layers")
    for name, flag in (("delayed", delayed), ("after_backward", after_backward)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected True or False; got {flag!r}")
    seconds = {
        name: parse_duration(value, name, allow_zero=True)
        for name, value in (
            ("forward", forward),
            ("backward", backward),
            ("gradient", gradient),
            ("update", update),
            ("upload", upload),
            ("fetch", fetch),
        )
    }
    if duplex not in ("full", "half"):
        raise ValueError(f"duplex: expected 'full' or 'half'; got {duplex!r}")
    if delayed and seconds["fetch"]:
        raise ValueError(
            "delayed: expected False with fetched parameters (the update would rewrite weights "
            "the next step is fetching); got True"
        )
    down, up = ("link", "link") if duplex == "half" else ("D2H", "H2D")
    s = _Schedule()
    # a delayed update settles into its steady rhythm after a step or two
    steps = 5 if delayed else 1
    gate: list[int] = []  # what the next step's first compute waits for
    first: list[int] = []  # each step's first compute
    previous_updates: list[int] = []
    for _ in range(steps):
        order = [("F", j) for j in range(layers)] + [("B", j) for j in reversed(range(layers))]
        computes, last, downs = [], None, {}
        for i, (kind, j) in enumerate(order):
            deps = gate + ([last] if last is not None else [])
            if seconds["fetch"]:
                buffer_free = [computes[i - 2]] if i >= 2 else gate
                deps.append(s.add(up, seconds["fetch"], buffer_free, "H2D", f"w{j}"))
            last = s.add(
                "compute",
                seconds["forward" if kind == "F" else "backward"],
                deps,
                "compute",
                f"{kind}{j}",
            )
            computes.append(last)
            if kind == "B":
                # The gradient hook runs on the compute thread; a delayed update still reading this
                # layer's host gradient holds it (and so the rest of backward) up.
                held = [previous_updates[layers - 1 - j]] if delayed and previous_updates else []
                last = s.add("compute", 0.0, [last] + held)
                downs[j] = s.add(down, seconds["gradient"], [last], "D2H", f"g{j}")
        first.append(computes[0])
        end_of_backward = last
        if delayed:
            uploads = (
                [
                    s.add(
                        up, seconds["upload"], [end_of_backward] + previous_updates, "H2D", f"w{j}"
                    )
                    for j in reversed(range(layers))
                ]
                if previous_updates
                else []
            )
            updates = [
                s.add(
                    "CPU", seconds["update"], [downs[j], end_of_backward] + uploads, "CPU", f"u{j}"
                )
                for j in reversed(range(layers))
            ]
            gate = uploads or [end_of_backward]
            previous_updates = updates
        else:
            wait = [end_of_backward] + list(downs.values()) if after_backward else []
            updates = [
                s.add("CPU", seconds["update"], [downs[j]] + wait, "CPU", f"u{j}")
                for j in reversed(range(layers))
            ]
            uploads = (
                [
                    s.add(up, seconds["upload"], [u], "H2D", f"w{j}")
                    for u, j in zip(updates, reversed(range(layers)))
                ]
                if seconds["upload"]
                else []
            )
            gate = [end_of_backward] + updates + uploads
    starts, ends = s.run()
    if delayed:
        begin, finish = starts[first[-2]], starts[first[-1]]
    else:
        begin, finish = 0.0, max(ends[t] for t in gate)
    lanes: dict[str, list[tuple[float, float, str]]] = {
        "compute": [],
        "D2H": [],
        "CPU": [],
        "H2D": [],
    }
    for task, (_, duration, lane, label) in enumerate(s.tasks):
        if lane is None or duration == 0:
            continue
        a, b = max(starts[task], begin), min(ends[task], finish)  # the part inside this step
        if b > a:
            lanes[lane].append((a - begin, b - begin, label))
    return OffloadStep({k: sorted(v) for k, v in lanes.items()}, finish - begin)
