"""What the labs' graded checks expect, and how the grader tells a computed answer from a copied
one.

The expected values a check compares with are computed here, from the lab's own measurements,
so that no check cell shows the formula the exercise asks for (a student reads the cell; the
package is one step further away).

:func:`recomputed` is for nbgrader's hidden tests. A number typed into an answer cell, read
from a visible check or from an expected value shown with ``OFFLOADLAB_STUDENT=0``, passes that
check in the run it came from. The hidden test runs the student's own answer cell once more,
with other inputs put in place of the lab's measurements, and asks that the answer follow
them: a computed answer does, a typed-in number does not. To find that cell it keeps the
source of every cell the kernel runs after this module is imported (IPython's own history is
empty when a runner such as nbval executes without storing it); importing it outside IPython
does nothing.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import math
import numbers
import os
import random
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from offloadlab import experiment
from offloadlab.link import EmulatedLink, Link, check_link, open_link
from offloadlab.models import GPTConfig, TinyGPT
from offloadlab.nvme import FileTier
from offloadlab.offload import CPUOffloadAdam
from offloadlab.prefetch import Prefetcher
from offloadlab.sharding import ring_bytes
from offloadlab.streaming import StreamedModel
from offloadlab_course import crashes, watch
from offloadlab_course.check import ReadOnlyClass, sealed
from offloadlab_course.guard import untimed
from offloadlab.units import (
    check_integer,
    check_non_negative,
    check_positive,
    is_number,
    plain_scalar,
)

__all__ = [
    "recomputed",
    "refusing",
    "PACKAGE_PREFETCHER",
    "exchange_seconds",
    "one_buffer_pass_seconds",
    "disk_step_seconds",
    "ADAM_STATE_BYTES",
    "Outcome",
    "lab01_challenge",
    "lab04_challenge",
    "lab06_challenge",
    "lab02_challenge",
    "lab02_hidden_challenge",
    "lab02_hidden_rate",
    "lab03_challenge",
    "lab05_challenge",
    "lab07_challenge",
    "lab07_commit",
    "lab08_challenge",
]

# Lab 1's counter reads the state with torch's functions as they were when this module was
# imported, before any answer cell ran: a trainer that rebinds torch's own (inside a function,
# where the screen lets it) changes nothing the counter sees.
_REGISTER_AFTER_GRADIENT = torch.Tensor.register_post_accumulate_grad_hook
_GRAD = torch._C.TensorBase.grad.__get__
_PARAMETERS = torch.nn.Module.parameters
_IS_TENSOR = torch.is_tensor
_NUMEL, _ELEMENT_SIZE = torch.Tensor.numel, torch.Tensor.element_size
_STORAGE, _OFFSET = torch.Tensor.untyped_storage, torch.Tensor.storage_offset
_DATA_PTR = torch.UntypedStorage.data_ptr


class _Kept(TorchDispatchMode):
    """While on, every tensor an operation makes is noted by weak reference; ``alive()`` lists
    those something still holds: a gradient a trainer copied into a list of its own, say."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def note(self, tensor) -> None:
        if tensor is not None:
            self.made.append(weakref.ref(tensor))

    def alive(self) -> list:
        tensors = [ref() for ref in self.made]
        self.made = [ref for ref, t in zip(self.made, tensors) if t is not None]
        return [t for t in tensors if t is not None]


def _held_by(roots, limit: int = 200_000) -> list:
    """Every tensor, numpy array and storage reachable from ``roots`` through closures, bound
    methods, objects' attributes and containers (never through a module, a class or a function's
    globals): what a trainer keeps between steps, wherever it keeps it."""
    import numpy as np

    found, seen, todo = [], set(), list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray, torch.UntypedStorage)):
            found.append(obj)
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo += list(obj)
        elif isinstance(obj, types.MethodType):
            todo += [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            todo += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif not isinstance(obj, (types.ModuleType, type, str, bytes, numbers.Number)):
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                todo.append(attributes)
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


def _extent(thing) -> tuple[int, int]:
    """(first address, bytes) of a tensor, numpy array or storage: one key for views of one
    memory, however reached."""
    if isinstance(thing, torch.UntypedStorage):
        return _DATA_PTR(thing), thing.nbytes()
    if isinstance(thing, torch.Tensor):
        return (
            _DATA_PTR(_STORAGE(thing)) + _OFFSET(thing) * _ELEMENT_SIZE(thing),
            _NUMEL(thing) * _ELEMENT_SIZE(thing),
        )
    return thing.__array_interface__["data"][0], thing.nbytes


# Bytes per parameter that one AdamW step reads from disk and writes back: fp32 master weights
# and both moments (lab 7, chapter 8).
ADAM_STATE_BYTES = 12


def _number(value, name: str, zero: bool = False) -> float:
    """``value`` as a float: a finite number > 0 (≥ 0 with ``zero``; numpy's scalars too), else
    ValueError naming ``name``."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        expected = "a number ≥ 0" if zero else "a positive number"
        raise ValueError(f"{name}: expected {expected}; got {value!r}")
    value = value if type(value) in (int, float) else float(value)  # as typed, in the message
    return float((check_non_negative if zero else check_positive)(value, name))


def _whole(value, name: str, low: int = 1, expected: str | None = None) -> int:
    """``value`` as an int ≥ ``low`` (numpy's integers too), else ValueError naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_integer(value, name, low, expected=expected)


def _tolerance(rel_tol) -> float:
    """``rel_tol`` as a float, a fraction in [0, 1) as check.answer takes it (a tolerance of 100 %
    passes any positive answer below twice the reference)."""
    real = isinstance(rel_tol, numbers.Real) and not isinstance(rel_tol, bool)
    if not (real and 0 <= rel_tol < 1):  # (NaN too)
        raise ValueError(f"rel_tol: expected a fraction in [0, 1); got {rel_tol!r}")
    return float(rel_tol)


def _config(config) -> None:
    """ValueError unless ``config`` is a GPTConfig (the lab's model)."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config: expected the lab's GPTConfig; got {config!r}")


def _share(value, name: str) -> float:
    """A fraction in (0, 1]."""
    if _number(value, name) > 1:
        raise ValueError(f"{name}: expected a fraction in (0, 1]; got {value!r}")
    return float(value)


def _unanswered(answer, name: str, call: str):
    """A failed challenge saying what is missing when ``answer`` is not a function, else None."""
    if callable(answer):
        return None
    return Outcome(
        False,
        f"✗ challenge: {name}: expected your function {call} (run its answer cell first); got "
        f"{answer!r}",
    )


def _watched(answer):
    """``answer``, a function of an answer cell that a challenge calls, noting what is changed
    each time it returns (:func:`watch.note`); so does what it returns, when that is a function,
    a generator or a tuple or list of them."""

    @functools.wraps(answer)
    def call(*args, **kwargs):
        try:
            returned = answer(*args, **kwargs)
        finally:
            _note()
        if isinstance(returned, (tuple, list)):
            return type(returned)(map(_noted, returned))
        return _noted(returned)

    return call


def _noted(returned):
    if isinstance(returned, types.GeneratorType):
        return _noting(returned)
    return _watched(returned) if isinstance(returned, _FUNCTIONS) else returned


_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def _note() -> None:
    """:func:`watch.note`, with a refusal's profile (:func:`refusing`) held off meanwhile: the
    course's own comparisons are not the answer's calls, and noted call by call they would slow
    a timed pass several-fold."""
    import sys

    hook = sys.getprofile()
    sys.setprofile(None)
    try:
        watch.note()
    finally:
        sys.setprofile(hook)


def _noting(generator):
    """``generator``'s items, noting what is changed after each."""
    try:
        for item in generator:
            _note()
            yield item
    finally:
        _note()


def exchange_seconds(nbytes: float, h2d_rate: float, d2h_rate: float) -> float:
    """Seconds to send ``nbytes`` each way when both directions run at once, each at its own rate
    (bytes/s, measured while the other direction ran): the slower direction sets the time."""
    nbytes = _number(nbytes, "nbytes", zero=True)
    h2d_rate, d2h_rate = _number(h2d_rate, "h2d_rate"), _number(d2h_rate, "d2h_rate")
    return max(nbytes / h2d_rate, nbytes / d2h_rate)


def one_buffer_pass_seconds(items: int, copy_seconds: float, work_seconds: float) -> float:
    """Seconds for one pass of a prefetcher with a single buffer: nothing overlaps, each item's
    copy waits for the work on the one before."""
    items = _whole(items, "items", 0, expected="a whole number of items ≥ 0")
    copy_seconds = _number(copy_seconds, "copy_seconds", zero=True)
    return items * (copy_seconds + _number(work_seconds, "work_seconds", zero=True))


def disk_step_seconds(params: float, read_rate: float, write_rate: float) -> float:
    """Seconds of disk transfer in one AdamW step on state kept in files, reads and writes taking
    turns on the drive, at the rates (bytes/s) measured for each."""
    state = ADAM_STATE_BYTES * _number(params, "params", zero=True)
    return state / _number(read_rate, "read_rate") + state / _number(write_rate, "write_rate")


@sealed
class Outcome(metaclass=ReadOnlyClass):
    """A challenge's result: truthy when it met its bar; its line is printed when it is made."""

    def __init__(self, passed: bool, line: str):
        if passed and (why := watch.why_not_checked()):
            passed, line = False, f"✗ challenge: {why}"
        self.passed, self.line = passed, line
        print(line)

    def __bool__(self) -> bool:
        return self.passed


def lab01_challenge(
    trainer, config, device, budget: float = 6, steps: int = 5, rel_tol: float = 0.01
) -> Outcome:
    """Lab 1's challenge, measured: train a bf16 TinyGPT of ``config`` with ``trainer(model) ->
    (step, optimizers)`` and fp32 AdamW from the same weights on the same tokens; the set-up
    passes when every step's loss is within ``rel_tol`` of AdamW's, every parameter has AdamW's
    two moments, and the persistent state is at most ``budget`` bytes a parameter at its peak:
    counted each time a gradient is complete inside backward (after the trainer's own hooks) and
    after each step (weights, gradients and optimizer state, each storage counted once; step
    counters left out). Counted after the step alone, an AdamW that frees its gradients only
    then would pass, though it held them all at the end of backward. Also counted: every
    gradient backward made and every tensor the trainer's gradient hooks and ``step`` made, while
    anything still holds them (a gradient kept in the trainer's own list, or a copy of it, is
    state too). A gradient the counter did not see (a trainer removed its hooks) fails the
    challenge."""
    missing = _unanswered(trainer, "trainer", "trainer(model) -> (step, optimizers)")
    if missing is not None:
        return missing
    trainer = _watched(trainer)
    _number(budget, "budget"), _whole(steps, "steps"), _tolerance(rel_tol)
    _config(config)

    torch.manual_seed(0)
    reference = TinyGPT(config).to(device)
    model = TinyGPT(config).to(device, torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    params = list(_PARAMETERS(model))  # (before the trainer runs)
    kept, noting = _Kept(), []

    def before_the_trainers_hooks(p):  # registered first, so it runs first
        kept.note(_GRAD(p))
        kept.__enter__()
        noting.append(p)

    for p in params:
        _REGISTER_AFTER_GRADIENT(p, before_the_trainers_hooks)
    with kept:  # (what the set-up makes is followed too)
        made = trainer(model)
    if not (
        isinstance(made, (tuple, list))
        and len(made) == 2
        and callable(made[0])
        and isinstance(made[1], (list, tuple))
        and all(isinstance(getattr(o, "state", None), dict) for o in made[1])
    ):
        return Outcome(
            False,
            f"✗ challenge: trainer(model) must return (step, optimizers), a function and a list "
            f"of optimizers; got {made!r:.200}",
        )
    step, optimizers = made

    def trainers_hooks() -> list:
        """The gradient hooks the trainer put on the parameters (not the counter's)."""
        hooks = []
        for p in params:
            for table in (p._post_accumulate_grad_hooks, p._backward_hooks):
                hooks += [h for h in (table or {}).values() if h not in ours]
        return hooks

    def held_bytes() -> int:
        """The state held now: weights, gradients, what the optimizers and the trainer keep
        (however it keeps it: reachable from its step, its optimizers, the model or its hooks),
        and what the trainer made that something still holds."""
        gradients = [_GRAD(p) for p in params]
        things = [*params, *(g for g in gradients if g is not None)]
        things += _held_by([step, optimizers, model, *trainers_hooks()]) + kept.alive()
        extents = {_extent(thing) for thing in things}
        return sum(nbytes for _, nbytes in extents if nbytes > 8)  # (step counters left out)

    peak, counted = 0, 0

    def count_at_this_gradient(_):
        nonlocal peak, counted
        if noting:  # (a trainer may have removed the hook before its own)
            kept.__exit__(None, None, None)
            noting.clear()
        peak, counted = max(peak, held_bytes()), counted + 1

    ours = (before_the_trainers_hooks, count_at_this_gradient)
    for p in params:  # after the trainer's hooks: what they free is not counted
        _REGISTER_AFTER_GRADIENT(p, count_at_this_gradient)
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab, (2, config.seq), generator=generator).to(device)
        expected = reference(tokens[:, :-1], tokens[:, 1:])
        expected.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        with kept:
            step()
        peak = max(peak, held_bytes())
        worst = max(worst, abs(loss.item() - expected.item()) / expected.item())
    moments = {  # AdamW's two moments, each a tensor shaped like its parameter
        id(p)
        for optimizer in optimizers
        for p, state in optimizer.state.items()
        if isinstance(state, dict)
        and all(
            _IS_TENSOR(state.get(k)) and _IS_TENSOR(p) and _NUMEL(state[k]) == _NUMEL(p)
            for k in ("exp_avg", "exp_avg_sq")
        )
    }
    per_param = peak / sum(_NUMEL(p) for p in params)
    if counted < steps * len(params):
        return Outcome(
            False,
            f"✗ challenge: the counter saw {counted} of the {steps * len(params)} gradients "
            "backward made: leave the hooks on the parameters you did not register in place",
        )
    if len(moments) < len(params):
        return Outcome(
            False,
            f"✗ challenge: {len(params) - len(moments)} of {len(params)} parameters have no AdamW "
            "moments in the optimizers you returned",
        )
    if worst > rel_tol:
        return Outcome(
            False,
            f"✗ challenge: the loss left fp32 AdamW's by up to {worst:.1%} (at most {rel_tol:.0%} "
            "allowed): is it AdamW with lr=1e-3?",
        )
    verdict = "✓" if per_param <= budget else "✗"
    return Outcome(
        per_param <= budget,
        f"{verdict} challenge: {per_param:.2f} bytes of state a parameter at the peak, inside "
        f"backward or after a step (measured; at most {budget:g}), loss within {worst:.2%} of "
        "fp32 AdamW",
    )


def lab04_challenge(
    offload,
    config,
    device,
    dtype=None,
    budget: float = 0.4,
    copies: int = 16,
    steps: int = 4,
    rel_tol: float = 0.01,
) -> Outcome:
    """Lab 4's challenge, measured: ``offload(model, link)`` builds the optimizer of a TinyGPT of
    ``config`` (weights in ``dtype``, fp32 by default) on ``link``; the grader trains it and fp32
    torch.optim.AdamW (lr 1e-3) from the same weights on the same tokens for ``steps`` steps. It
    passes when every step's loss is within ``rel_tol`` of AdamW's, the optimizer's device buffers
    (what it asked ``link`` for: the gradients' gather buffers) hold at most ``budget`` times the
    model's gradient bytes, and each step sends its gradients down in at most ``copies``
    device→host copies (each pays the link's fixed cost): counted by the link, not timed."""
    missing = _unanswered(offload, "offload", "offload(model, link) -> optimizer")
    if missing is not None:
        return missing
    offload = _watched(offload)
    _number(budget, "budget"), _whole(copies, "copies"), _whole(steps, "steps")
    _tolerance(rel_tol), _config(config)

    dtype = torch.float32 if dtype is None else dtype
    torch.manual_seed(0)
    reference = TinyGPT(config).to(device)
    model = TinyGPT(config).to(device, dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in reference.state_dict().items()})
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    worst, most_copies = 0.0, 0
    with open_link() as link:
        watched = _WatchedLink(link)
        optimizer = offload(model, watched)
        if not all(callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")):
            return Outcome(
                False,
                f"✗ challenge: offload(model, link) must return an optimizer (with step and "
                f"zero_grad); got {optimizer!r:.200}",
            )
        try:
            for _ in range(steps):
                tokens = torch.randint(0, config.vocab, (2, config.seq), generator=generator).to(
                    device
                )
                expected = reference(tokens[:, :-1], tokens[:, 1:])
                expected.backward()
                adamw.step()
                adamw.zero_grad(set_to_none=True)
                with link.record() as recording:
                    loss = model(tokens[:, :-1], tokens[:, 1:])
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    link.synchronize()
                # (gradients only: the byte per bucket that says whether a weight was edited by
                # hand is the optimizer's own check, not the bucket size's cost)
                most_copies = max(
                    most_copies,
                    sum(
                        t.direction == "d2h" and not t.label.endswith("edits")
                        for t in recording.transfers
                    ),
                )
                worst = max(worst, abs(loss.item() - expected.item()) / expected.item())
        finally:
            close = getattr(optimizer, "close", None)
            if close is not None:
                close()
    if most_copies == 0:
        return Outcome(
            False,
            "✗ challenge: no gradient went down the link: build the optimizer on the link you "
            "are given",
        )
    if worst > rel_tol:
        return Outcome(
            False,
            f"✗ challenge: the loss left fp32 AdamW's by up to {worst:.1%} (at most {rel_tol:.0%} "
            "allowed): is it AdamW with lr=1e-3?",
        )
    share = watched.device_bytes / gradient_bytes
    passed = share <= budget and most_copies <= copies
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: device buffers of {share:.0%} of the gradients' "
        f"bytes (counted; at most {budget:.0%}), {most_copies} device→host copies a step "
        f"(counted by the link; at most {copies}), loss within {worst:.2%} of fp32 AdamW",
    )


def lab08_challenge(choose, tensor_bytes: float, ranks: int, down: float, up: float) -> Outcome:
    """Lab 8's challenge, graded on bytes counted by the lab's runs: ``tensor_bytes`` (bytes of
    tensors through the sharded run's all-gathers and reduce-scatters per step, on a ring of
    ``ranks``) and ``down``, ``up`` (bytes the offloaded run's host link carried each way per
    step). ``choose(tensor_bytes, ranks, down, up, interconnect, host_link, duplex)`` answers
    "shard" or "offload" for a node whose interconnect and host link move ``interconnect`` and
    ``host_link`` bytes/s each way, the host link in ``duplex`` "full" (both directions at once)
    or "half" (taking turns). Right is the one whose traffic takes less time a step; the grader
    asks for nodes on both sides of the crossover, in both duplexes, at two scales, and passes
    when every answer is right."""
    missing = _unanswered(
        choose, "choose", "choose(tensor_bytes, ranks, down, up, interconnect, host_link, duplex)"
    )
    if missing is not None:
        return missing
    choose = _watched(choose)
    tensor_bytes = _number(tensor_bytes, "tensor_bytes")
    ranks = _whole(ranks, "ranks", 2, expected="a whole number of ranks ≥ 2 (a ring to shard on)")
    down, up = _number(down, "down", zero=True), _number(up, "up", zero=True)
    if down == up == 0:
        raise ValueError("down, up: expected the bytes the host link carried; got 0 both ways")

    # a rank's share; reduce-scatter's is the same
    sent = ring_bytes("all-gather", tensor_bytes, ranks)
    link_bytes = {"full": max(down, up), "half": down + up}
    nodes = []
    for interconnect in (25e9, 200e9):
        # the host link at which full duplex ties
        crossover = interconnect * link_bytes["full"] / sent
        for factor in (0.6, 1.5, 2.5):
            for duplex in ("full", "half"):
                nodes.append((interconnect, factor * crossover, duplex))
    wrong = []
    for interconnect, host_link, duplex in nodes:
        expected = "shard" if sent / interconnect <= link_bytes[duplex] / host_link else "offload"
        answer = choose(tensor_bytes, ranks, down, up, interconnect, host_link, duplex)
        if getattr(answer, "shape", None) == () and hasattr(answer, "item"):
            answer = answer.item()  # np.where over scalars: a 0-d array of one string
        # judged by its text, read past any __eq__ or __str__ of its own: an object equal to
        # everything would pass `in` and `!=` alike (numpy's strings, an Enum of str are text)
        text = str.__str__(answer) if isinstance(answer, str) else None
        if text not in ("shard", "offload"):
            return Outcome(
                False,
                f"✗ challenge: the choice for a node was {answer!r}; expected 'shard' or 'offload'",
            )
        answer = text
        if answer != expected:
            wrong.append(
                f"{interconnect / 1e9:g} GB/s between ranks, {host_link / 1e9:.3g} GB/s {duplex} "
                f"duplex to the host"
            )
    if wrong:
        return Outcome(
            False,
            f"✗ challenge: {len(wrong)} of {len(nodes)} nodes chosen wrong, e.g. {wrong[0]}: "
            "compare the seconds each configuration's bytes take on its own wire",
        )
    return Outcome(
        True,
        f"✓ challenge: all {len(nodes)} nodes chosen right, from the bytes your runs counted "
        f"({tensor_bytes / 2**20:.2f} MiB of tensors on {ranks} ranks, {down / 2**20:.2f} MiB down "
        f"and {up / 2**20:.2f} MiB up the host link, per step)",
    )


def _streams_elsewhere(streaming, model, link) -> str | None:
    """What keeps ``streaming`` from being counted: a link of its own, or blocks of ``model`` it
    leaves on the device (their weights would take device memory no buffer shows)."""
    if streaming.link is not link:
        return "the StreamedModel runs on a link of its own; build it on the link you are given"
    streamed = set(map(id, streaming.blocks))
    left = sum(id(block) not in streamed for block in model.blocks)
    if left:
        return f"{left} of the model's {len(model.blocks)} blocks are not streamed; stream them all"
    return None


def lab06_challenge(stream, config, device, dtype, budget: int) -> Outcome:
    """Lab 6's challenge, counted by the link: ``stream(model, link, budget)`` streams the blocks
    of a TinyGPT of ``config`` (weights in ``dtype`` on ``device``) with a StreamedModel on
    ``link``; the grader trains it with CPUOffloadAdam for a warm-up step and a recorded one. It
    passes when the device buffers the streaming asked ``link`` for hold at most ``budget`` bytes
    and the recorded step's host→device copies carry no more bytes than those of a StreamedModel
    with as many weight buffers as ``budget`` holds, run by the grader the same way."""
    missing = _unanswered(stream, "stream", "stream(model, link, budget) -> StreamedModel")
    if missing is not None:
        return missing
    stream = _watched(stream)
    budget = _whole(budget, "budget", expected="a whole number of bytes ≥ 1")
    _config(config)

    def run(make):
        """(the streaming, device bytes it asked for, bytes up in the recorded step)."""
        torch.manual_seed(0)
        model = TinyGPT(config).to(device, dtype)
        tokens = torch.randint(
            0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(1)
        )
        tokens = tokens.to(device)
        with open_link() as link:
            watched = _WatchedLink(link)
            streaming = make(model, watched, budget)
            if not isinstance(streaming, StreamedModel):
                return streaming, None, None
            wrong = _streams_elsewhere(streaming, model, watched)
            if wrong:
                streaming.remove()
                return wrong, None, None
            optimizer = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link, accumulation_steps=1)
            try:
                for _ in range(2):  # a warm-up step, then the step that counts
                    with link.record() as recording:
                        model(tokens[:, :-1], tokens[:, 1:]).backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        link.synchronize()
            finally:
                optimizer.close()
                streaming.remove()
        return (
            streaming,
            watched.device_bytes,
            sum(t.nbytes for t in recording.transfers if t.direction == "h2d"),
        )

    yours, held, up = run(stream)
    if isinstance(yours, str):
        return Outcome(False, f"✗ challenge: {yours}")
    if held is None:
        return Outcome(
            False,
            f"✗ challenge: my_stream returned {type(yours).__name__}; expected a StreamedModel",
        )
    smallest = yours.device_budget - (yours.buffers - 2) * yours.block_bytes  # two weight buffers
    if budget < smallest:
        raise ValueError(
            f"budget: expected at least {smallest} bytes, what two weight buffers need"
        )
    most = 2 + int((budget - smallest) // yours.block_bytes)
    _, _, best = run(lambda model, link, _: StreamedModel(model, link, buffers=most))
    passed = held <= budget and up <= best
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: {held / 2**20:.2f} MiB of device buffers "
        f"(counted; at most {budget / 2**20:.2f} MiB), {up / 2**20:.2f} MiB up in a step "
        f"(counted by the link; {best / 2**20:.2f} MiB with the most buffers that fit)",
    )


def lab07_challenge(
    folder,
    block_bytes: int,
    queue_depth: int,
    reference_rate: float,
    share: float = 0.5,
    params: int = 8 * 2**20,
    repeats: int = 5,
    patience_s: float = 5.0,
) -> Outcome:
    """Lab 7's challenge, measured: a FileTier of ``params`` fp32 values in ``folder`` with the
    given request size and queue depth, made between two reference tiers of the package's
    defaults (1 MiB requests, depth 8) holding the same values. The three are read whole, taking
    turns in an order that reverses each round, at least ``repeats`` times, and each keeps its
    fastest read; it passes when the student's tier reads at ``share`` or more of the slower
    reference's rate. The references on either side cancel what the disk does to a file for
    where it lies or when it was written (on CI a tier made first read at half the speed of an
    identical one made after it, in 129 rounds), and a tier still short of the bar goes on for
    up to ``patience_s`` more seconds, so a busy spell over its first reads is not its verdict.
    All are measured in this call, so a disk slowed by other work slows all three: a rate taken
    earlier (``reference_rate``, bytes/s: the lab's step 1) is only shown beside them."""
    import tempfile

    block_bytes = _whole(block_bytes, "block_bytes", expected="a whole number of bytes ≥ 1")
    queue_depth = _whole(queue_depth, "queue_depth")
    _number(reference_rate, "reference_rate"), _share(share, "share")
    _whole(params, "params"), _whole(repeats, "repeats")
    _number(patience_s, "patience_s", zero=True)
    import time
    from pathlib import Path

    if not isinstance(folder, (str, Path)) or not Path(folder).is_dir():
        raise ValueError(f"folder: expected an existing folder on the disk to test; got {folder!r}")

    values = torch.randn(params)
    with tempfile.TemporaryDirectory(dir=folder, prefix="lab07-challenge-") as scratch:
        tiers = []
        try:
            tiers.append(FileTier(Path(scratch) / "reference-before.bin", params, init=values))
            tiers.append(
                FileTier(
                    Path(scratch) / "yours.bin",
                    params,
                    init=values,
                    block_bytes=block_bytes,
                    queue_depth=queue_depth,
                )
            )
            tiers.append(FileTier(Path(scratch) / "reference-after.bin", params, init=values))
            before, yours, after = tiers
            fastest = dict.fromkeys(tiers, math.inf)
            rounds, deadline = 0, math.inf
            while True:
                for tier in tiers if rounds % 2 == 0 else tiers[::-1]:
                    start = time.perf_counter()
                    tier.read(0, values)
                    fastest[tier] = min(fastest[tier], time.perf_counter() - start)
                rounds += 1
                reference = max(fastest[before], fastest[after])  # the slower one's seconds
                passed = fastest[yours] * share <= reference
                if rounds == repeats:
                    deadline = time.perf_counter() + patience_s
                if rounds >= repeats and (passed or time.perf_counter() >= deadline):
                    break
        finally:
            for tier in tiers:
                tier.close()
    rate, reference_now = 4 * params / fastest[yours], 4 * params / reference
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: your tier read at {rate / 1e9:.3g} GB/s, "
        f"{rate / reference_now:.0%} of the slower of two 1 MiB, depth-8 tiers made before and "
        f"after it (measured, fastest of {rounds} reads each, taking turns; at least "
        f"{share:.0%} needed); step 1 measured {reference_rate / 1e9:.3g} GB/s",
    )


def lab07_commit(commit, two_slot_file, folder=".", commits: int = 3) -> Outcome:
    """Lab 7's commit, crashed at every point: ``commits`` steps of a ``two_slot_file`` (the
    lab's TwoSlotFile class) made with ``commit(state, data)``, every write and flush to the file
    recorded, then every file a kill or a power cut could have left (:mod:`crashes`, emulated)
    reopened by this module's own reader of the lab's format. It passes when each reopens at one
    step, holding exactly that step's data, and never before a commit that had returned."""
    import tempfile
    from pathlib import Path

    missing = _unanswered(commit, "my_commit", "my_commit(state, data)")
    if missing is not None:
        return missing
    commit = _watched(commit)
    if not isinstance(two_slot_file, type):
        raise ValueError(
            f"two_slot_file: expected the lab's TwoSlotFile class; got {two_slot_file!r}"
        )
    _whole(commits, "commits", 2)
    if not isinstance(folder, (str, Path)) or not Path(folder).is_dir():
        raise ValueError(f"folder: expected an existing folder; got {folder!r}")
    nbytes = 64 * 2**10
    with tempfile.TemporaryDirectory(dir=folder, prefix="lab07-commit-") as scratch:
        path = Path(scratch) / "state.bin"
        state = two_slot_file(path, nbytes)
        try:
            with crashes.record(path) as recording:
                for step in range(commits):
                    commit(state, bytes([step + 1]) * nbytes)
                    recording.mark(step)
                    if state.step != step:
                        return Outcome(
                            False,
                            f"✗ commit: after commit {step + 1} the state says step "
                            f"{state.step!r}; a commit must leave it at the step it made, "
                            f"{step}, so that the next one writes the other slot",
                        )
        finally:
            state.close()
        on_disk = path.read_bytes()
    if on_disk != crashes.final_image(recording):
        return Outcome(
            False,
            "✗ commit: the file ends other than its recorded writes leave it: a change the "
            "grader could not see (through a file object, mmap, os.pwritev, a truncation or "
            "another process) cannot be crashed and replayed; write with TwoSlotFile's methods",
        )
    tried = 0
    for crash in crashes.crashes(recording):
        tried += 1
        returned = len(crash.marks)
        step, data = _two_slot_reopened(crash.image, nbytes)
        if step is None and returned == 0:
            continue  # nothing committed yet, nothing promised
        wrong = None
        if step is None or step < returned - 1:
            wrong = (
                f"reopens at {'no step' if step is None else f'step {step}'}, though commit "
                f"{returned} had returned: a returned commit must survive a power cut"
            )
        elif data != bytes([step + 1]) * nbytes:
            held = "a mixture of steps" if len(set(data)) > 1 else "bytes that are not its own"
            wrong = f"reopens at step {step} holding {held}"
        if wrong:
            where = f"in commit {returned + 1}, after {crash.after} of its writes"
            if crash.after == 0 and returned:
                where = f"just after commit {returned} returned"
            if crash.kind == "power cut":
                where += f", {crash.held} of the {crash.pending} not yet flushed on the drive"
            return Outcome(
                False,
                f"✗ commit: a {crash.kind} {where}: the file {wrong}",
            )
    return Outcome(
        True,
        f"✓ commit: {tried} crashes replayed over {commits} commits (emulated: every kill, and "
        f"every power cut that keeps none, one or half of one unflushed write), each file "
        f"reopens at one whole step, none before a commit that had returned",
    )


def _two_slot_reopened(image: bytes, nbytes: int):
    """(step, data) of lab 7's two-slot file ``image``: the slot whose intact header names the
    newest step (a 4 KiB page each, ``<QQ`` step and slot, then their crc32), or (None, None)."""
    import struct
    import zlib

    page, header = 4096, struct.Struct("<QQ")
    newest = None
    for slot in (0, 1):
        raw = image[slot * page : slot * page + header.size + 4]
        if len(raw) < header.size + 4:
            continue
        step, which = header.unpack(raw[: header.size])
        intact = int.from_bytes(raw[header.size :], "little") == zlib.crc32(raw[: header.size])
        if intact and which == slot and (newest is None or step > newest[0]):
            newest = (step, slot)
    if newest is None:
        return None, None
    step, slot = newest
    return step, image[2 * page + slot * nbytes : 2 * page + (slot + 1) * nbytes]


def lab02_challenge(
    probe, link, reference: float, budget: int = 32 * 2**20, rel_tol: float = 0.15
) -> Outcome:
    """Lab 2's challenge, measured: run ``probe(link)``, which returns the link's host→device
    bandwidth β in bytes/s, while the link records every copy; it passes when the copies moved
    ``budget`` bytes or fewer (both directions, warm-ups included) and β is within ``rel_tol``
    of ``reference`` (bytes/s: the lab's full sweep, or the emulated link's own rate)."""
    missing = _unanswered(probe, "probe", "probe(link) -> bytes/s")
    if missing is not None:
        return missing
    probe = _watched(probe)
    reference = _number(reference, "reference")
    _whole(budget, "budget", expected="a whole number of bytes ≥ 1"), _tolerance(rel_tol)
    check_link(link)
    with link.record() as recording:
        beta = probe(link)
    moved = sum(t.nbytes for t in recording.transfers)
    if getattr(beta, "numel", lambda: 0)() == 1 and beta.is_floating_point():
        beta = beta.item()  # (a one-element tensor, as a measurement made with torch is)
    beta = plain_scalar(beta)  # (numpy's numbers as Python's)
    if not is_number(beta) or beta <= 0:
        return Outcome(
            False, f"✗ challenge: the probe returned {beta!r}; expected a bandwidth in bytes/s"
        )
    if moved > budget:
        return Outcome(
            False,
            f"✗ challenge: the probe moved {moved / 2**20:.1f} MiB (measured by the link); "
            f"at most {budget / 2**20:g} MiB allowed",
        )
    uploaded = sum(t.nbytes for t in recording.transfers if t.direction == "h2d")
    if uploaded < _LEAST_MEASURED:
        return Outcome(
            False,
            f"✗ challenge: the probe copied {uploaded / 2**20:.1f} MiB host→device (measured by "
            f"the link); β must come from copies, at least {_LEAST_MEASURED / 2**20:g} MiB",
        )
    error = beta / reference - 1
    passed = abs(error) <= rel_tol
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: your probe's β is {abs(error):.1%} "
        f"{'above' if error > 0 else 'below'} the reference (at most {rel_tol:.0%} allowed), "
        f"from {moved / 2**20:.1f} MiB of copies (at most {budget / 2**20:g} MiB)",
    )


# The fewest host→device bytes a probe can measure β from (one copy long against α).
_LEAST_MEASURED = 2**20


# Taken when the lab imports this module, before any answer cell runs: a cell that patches
# random's or math's functions later cannot choose the hidden rate.
_HIDDEN_DRAW = random.SystemRandom().uniform
_HIDDEN_LOW, _HIDDEN_HIGH, _EXP = math.log(0.1e9), math.log(1e9), math.exp


def lab02_hidden_rate() -> float:
    """The hidden link's rate, drawn afresh each run: bytes/s, log-uniform from 0.1 to 1 GB/s,
    so no single number known in advance passes more than about one run in eight (at 15 %), nor
    the one that passes on the student's own link."""
    return _EXP(_HIDDEN_DRAW(_HIDDEN_LOW, _HIDDEN_HIGH))


class _RateKept(EmulatedLink):
    """An emulated link that keeps its rate from a probe: only its copies tell it."""

    @property
    def bandwidth(self) -> float:
        raise AttributeError("the hidden link keeps its rate from the probe: measure it")

    @property
    def latency(self) -> float:
        raise AttributeError("the hidden link keeps its rate from the probe: measure it")

    def __repr__(self) -> str:
        return "EmulatedLink(rate kept from the probe)"


def lab02_hidden_challenge(probe, budget: int = 32 * 2**20, rel_tol: float = 0.15) -> Outcome:
    """Lab 2's hidden check: :func:`lab02_challenge` on an emulated link whose rate
    (:func:`lab02_hidden_rate`) the probe can learn only by copying."""
    rate = lab02_hidden_rate()
    with _RateKept(bandwidth=rate, latency=60e-6) as link:
        try:
            return lab02_challenge(probe, link, rate, budget, rel_tol)
        except AttributeError as error:
            if "keeps its rate from the probe" not in str(error):
                raise
            return Outcome(False, f"✗ challenge: {error}")


def lab03_challenge(
    step,
    link,
    copy_share: float = 1.25,
    share: float = 0.8,
    steps: int = 8,
    work_seconds: float | None = None,
) -> Outcome:
    """Lab 3's challenge, measured: ``steps`` training steps, each ``step(link, work, host,
    device)``, which must launch the step's compute ``work`` once and bring ``host`` into ``device``
    so that the check the grader launches next, on the compute stream, reads the new bytes. The copy
    lasts ``copy_share`` times the work. It passes when every check read its own step's bytes and at
    least ``share`` of the time that could overlap (each step's shorter side) did: copies against
    the work's own intervals on the link's timeline, not a wall clock.

    On a GPU, ``link`` itself, with a chain of matrix products of about ``work_seconds`` (default
    4 ms) and the copy sized from the link's rate measured here; on the emulated link, the
    grader's own at 0.5 GB/s and the work a wait of ``work_seconds`` (default 20 ms) on its
    compute thread, as in lab 5's challenge.
    """
    import time

    missing = _unanswered(step, "step", "step(link, work, host, device)")
    if missing is not None:
        return missing
    step = _watched(step)
    _number(copy_share, "copy_share"), _share(share, "share"), _whole(steps, "steps")
    if work_seconds is not None:
        _number(work_seconds, "work_seconds")
    check_link(link)
    if link.emulated:
        seconds = 0.02 if work_seconds is None else work_seconds
        with EmulatedLink(bandwidth=0.5e9, latency=20e-6) as own:
            intervals = []

            def waited():  # runs on the compute thread: its own clock readings are the interval
                begin = own.now()
                time.sleep(seconds)
                intervals.append((begin, own.now()))

            return _lab03_steps(
                step,
                own,
                waited,
                lambda: list(intervals),
                intervals.clear,
                seconds,
                own.bandwidth,
                copy_share,
                share,
                steps,
            )
    products, products_seconds, rate = _gpu_work_and_rate(link, work_seconds)
    marks = []

    def marked():  # on a GPU the kernels run later: events around them time them
        begin = link.mark()
        products()
        marks.append((begin, link.mark()))

    return _lab03_steps(
        step,
        link,
        marked,
        lambda: [(begin.time, end.time) for begin, end in marks],
        marks.clear,
        products_seconds,
        rate,
        copy_share,
        share,
        steps,
    )


def _lab03_steps(
    step,
    link,
    work,
    work_intervals,
    forget_work,
    seconds: float,
    rate: float,
    copy_share: float,
    share: float,
    steps: int,
) -> Outcome:
    """One pass of the steps after a warm-up; ``work_intervals()`` reads the work's (start, end)
    seconds on the link's clock once the pass is done, ``forget_work()`` starts a pass afresh."""
    elements = max(1024, int(copy_share * seconds * rate) // 4096 * 1024)  # fp32, whole 4 KiB pages
    # steps alternate
    sources = [link.host_buffer(elements).fill_(float(value)) for value in (1, 2)]
    device = link.device_buffer(elements)
    stride = 1024
    wrong = torch.zeros(steps, dtype=torch.int64, device=link.device)

    def check(i):  # on the compute stream, after the step: did this step's bytes arrive?
        wrong[i] = (device[::stride] != float(i % 2 + 1)).sum()

    def run():
        wrong.zero_()
        forget_work()
        with link.record() as recording:
            for i in range(steps):
                step(link, work, sources[i % 2], device)
                link.launch(check, i)
            link.synchronize()
        return [(t.start, t.end) for t in recording.transfers if t.direction == "h2d"]

    run()  # a warm-up: the first pass allocates
    achieved = 0.0
    # The best of up to three passes: on a machine busy with other work the emulated link's copy
    # thread can be starved for one pass; a step whose copy does not overlap misses in all three.
    for _ in range(3):
        copies = run()
        computes = work_intervals()
        if len(computes) != steps:
            return Outcome(
                False,
                f"✗ challenge: the work ran {len(computes)} times in {steps} steps; launch it once "
                "a step",
            )
        bad = wrong.cpu().nonzero()
        if len(bad):
            return Outcome(
                False,
                f"✗ challenge: step {int(bad[0])}'s check read the bytes of another step: was the "
                "copy ordered after the last use of the buffer, and the compute after the copy?",
            )
        copy_total = sum(end - start for start, end in copies)
        behind = hidden_share(copies, computes) * copy_total
        # each step's shorter side
        could = sum(min(end - start, copy_total / steps) for start, end in computes)
        achieved = max(achieved, behind / could if could > 0 else 0.0)
        if achieved >= share:
            break
    passed = achieved >= share
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: {achieved:.0%} of the time that could overlap did "
        f"({'emulated' if link.emulated else 'measured'}, from the steps' timeline: copies "
        f"against the work; at least {share:.0%} needed)",
    )


def hidden_share(copies, computes) -> float:
    """The share of the copies' time that ran while compute ran, from their intervals
    ``[(start, end), ...]`` on one clock (seconds). Time under two compute intervals at once (a
    repeated record, two streams) is hidden once. 1.0 when there were no copies."""
    copies, computes = _intervals(copies, "copies"), _merged(_intervals(computes, "computes"))
    total = sum(end - start for start, end in copies)
    behind = sum(
        max(0.0, min(end, c_end) - max(start, c_start))
        for start, end in copies
        for c_start, c_end in computes
    )
    return behind / total if total > 0 else 1.0


def _intervals(intervals, name: str) -> list[tuple[float, float]]:
    """``intervals`` as (start, end) pairs of floats: finite real numbers (numpy's too), each pair
    ending no earlier than it starts, else ValueError naming ``name``."""
    expected = f"{name}: expected (start, end) pairs of finite seconds"
    try:
        items = list(intervals)
    except TypeError:
        raise ValueError(f"{expected}; got {intervals!r}") from None
    pairs = []
    for item in items:
        try:
            start, end = item
        except (TypeError, ValueError):
            raise ValueError(f"{expected}; got {item!r}") from None
        for t in (start, end):
            try:
                real = isinstance(t, numbers.Real) and not isinstance(t, bool)
                finite = real and math.isfinite(t)
            except OverflowError:  # an int beyond any float
                finite = False
            if not finite:
                raise ValueError(f"{expected}; got {item!r}")
        if not end >= start:  # (a reversed interval would cancel real time)
            raise ValueError(f"{name}: interval ({start}, {end}) ends before it starts")
        pairs.append((float(start), float(end)))
    return pairs


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` in order, those that overlap or touch joined into one."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class _WatchedLink:
    """A link that notes the device buffers a student's code asks for; everything else is the
    link's."""

    def __init__(self, link):
        _register_watched_link()
        self._link, self.device_bytes, self.storages = link, 0, set()

    def device_buffer(self, *args, **kwargs):
        buffer = self._link.device_buffer(*args, **kwargs)
        self.device_bytes += buffer.numel() * buffer.element_size()
        self.storages.add(buffer.untyped_storage().data_ptr())
        return buffer

    def __getattr__(self, name):
        return getattr(self._link, name)


def _register_watched_link() -> None:
    """A watched link is a link to the optimizers that check (CPUOffloadAdam refuses a non-link)."""
    Link.register(_WatchedLink)


def lab05_challenge(
    prefetch,
    link,
    budget: int = 3,
    share: float = 0.85,
    items: int = 12,
    work_seconds: float | None = None,
) -> Outcome:
    """Lab 5's challenge, measured: a pass of ``prefetch(items, link)`` over uneven items, every
    fourth eight times the size of the others, with a consumer whose work on each item lasts four
    times a small item's copy and half a large one's.

    On a GPU, ``link`` itself: the work is a chain of matrix products of about ``work_seconds``
    (default 4 ms), and the sizes follow the work's and the link's times measured here. On the
    emulated link, the grader's own at 0.5 GB/s (slow enough that its copy thread's memcpy stays a
    small share of each copy on a busy host), and the work a fixed wait of ``work_seconds``
    (default 25 ms) on its compute stream, as a kernel of known length would be. It passes when
    every item arrives intact, in order, in device buffers of at most ``budget`` times the
    largest item's bytes, and at least ``share`` of the copies' time ran behind the work: read
    from the pass's own timeline (copy events against compute markers), not from a wall clock.
    """
    import time

    missing = _unanswered(prefetch, "prefetch", "prefetch(items, link)")
    if missing is not None:
        return missing
    prefetch = _watched(prefetch)
    _whole(budget, "budget"), _share(share, "share"), _whole(items, "items")
    if work_seconds is not None:
        _number(work_seconds, "work_seconds")
    check_link(link)
    if link.emulated:
        seconds = 0.025 if work_seconds is None else work_seconds
        with EmulatedLink(bandwidth=0.5e9, latency=20e-6) as own:
            return _lab05_pass(
                prefetch,
                own,
                lambda: time.sleep(seconds),
                seconds,
                own.bandwidth,
                budget,
                share,
                items,
            )
    work, seconds, rate = _gpu_work_and_rate(link, work_seconds)
    return _lab05_pass(prefetch, link, work, seconds, rate, budget, share, items)


# The package's Prefetcher, every method of it: an answer that hands it the work is refused.
PACKAGE_PREFETCHER = tuple(
    f for f in vars(Prefetcher).values() if isinstance(f, types.FunctionType)
)


def _gpu_work_and_rate(link, work_seconds: float | None) -> tuple:
    """For a challenge on a GPU: a chain of matrix products of about ``work_seconds`` (default
    4 ms), the seconds it takes (median of 3, by events around it) and the link's host-to-device
    rate in bytes/s (median of 3 copies of 16 MiB)."""
    work = experiment.overlap_work(link, 0.004 if work_seconds is None else work_seconds)
    timed = []
    for _ in range(3):
        begin = link.mark()
        link.launch(work)
        timed.append(link.mark().time - begin.time)
    host, device = link.host_buffer(2**22), link.device_buffer(2**22)
    copies = [link.to_device(device, host, after=None) for _ in range(3)]
    return work, sorted(timed)[1], 4 * 2**22 / sorted(c.elapsed for c in copies)[1]


def _lab05_pass(
    prefetch, link, work, seconds: float, rate: float, budget: int, share: float, items: int
) -> Outcome:
    small = max(1024, int(0.25 * seconds * rate) // 4096 * 1024)  # fp32 elements, whole 4 KiB pages
    sizes = [8 * small if i % 4 == 3 else small for i in range(items)]
    sources = [link.host_buffer(size).fill_(float(i + 1)) for i, size in enumerate(sizes)]
    stride = 1024
    wrong = torch.zeros(items, 2, dtype=torch.int64, device=link.device)

    # on the compute stream: check, work, check again, poison what was checked
    def consume(i, tensor):
        wrong[i, 0] = (tensor[::stride] != float(i + 1)).sum()
        work()
        wrong[i, 1] = (tensor[::stride] != float(i + 1)).sum()
        tensor[::stride].fill_(float("nan"))

    def one_pass():
        watched = _WatchedLink(link)
        computes, delivered, foreign = [], [], 0
        with link.record() as recording:
            delivering = prefetch(sources, watched)
            if not hasattr(delivering, "__iter__"):
                return Outcome(
                    False,
                    f"✗ challenge: prefetch(items, link) must return an iterator of device "
                    f"tensors; got {delivering!r:.100}",
                ), None
            for i, tensor in enumerate(delivering):
                if i >= items or tensor.numel() != sizes[i]:
                    return Outcome(
                        False,
                        f"✗ challenge: item {i} came with {tensor.numel()} elements; expected "
                        f"{sizes[i] if i < items else 'no more items'}",
                    ), None
                foreign += tensor.untyped_storage().data_ptr() not in watched.storages
                begin = link.mark()
                link.launch(consume, i, tensor)
                computes.append((begin, link.mark()))
                delivered.append(i)
            link.synchronize()
        if delivered != list(range(items)):
            return Outcome(
                False, f"✗ challenge: the items delivered were {delivered}, not 0 to {items - 1}"
            ), None
        if foreign:
            return Outcome(
                False, f"✗ challenge: {foreign} items were not in buffers from link.device_buffer"
            ), None
        bad = wrong.cpu()
        if bad.any():
            i = int(bad.sum(dim=1).nonzero()[0])
            when = "before its copy landed" if bad[i, 0] else "and overwritten while in use"
            return Outcome(False, f"✗ challenge: item {i} was delivered {when}"), None
        moved = sum(t.nbytes for t in recording.transfers if t.direction == "h2d")
        if moved < 4 * sum(sizes):
            return Outcome(
                False, f"✗ challenge: the copies moved {moved} bytes, less than the items hold"
            ), None
        return None, (
            watched.device_bytes,
            [(t.start, t.end) for t in recording.transfers],
            [(begin.time, end.time) for begin, end in computes],
        )

    with refusing("prefetch", PACKAGE_PREFETCHER):
        failed, _ = one_pass()  # a warm-up: the first pass allocates
        if failed is None:
            failed, (device_bytes, copies, computes) = one_pass()
    if failed is not None:
        return failed
    largest = 4 * max(sizes)
    achieved = hidden_share(copies, computes)
    span = computes[-1][1] - min(start for start, _ in copies)
    busier = max(sum(e - s for s, e in copies), sum(e - s for s, e in computes))
    passed = achieved >= share and device_bytes <= budget * largest
    return Outcome(
        passed,
        f"{'✓' if passed else '✗'} challenge: {achieved:.0%} of the copy time ran behind the "
        f"work ({'emulated' if link.emulated else 'measured'}, from the pass's timeline; at least "
        f"{share:.0%} needed), in {device_bytes / largest:.2g} largest items' worth of device "
        f"buffers (at most {budget}); the pass took {span / busier:.2f}× its busier side's time",
    )


def recomputed(name: str, refusing=(), **inputs):
    """The value the student's latest cell that assigns ``name`` (a variable or a function) gives
    when run again with ``inputs`` in place of the notebook's variables of those names, with
    the earlier statements it reads from that depend on them (a list filled, a helper defined).

    Runs in a copy of the notebook's namespace, so the lab's own variables stay as they were.
    AssertionError when no cell has assigned ``name`` yet, when that cell asks the package's
    checks or this module for the answer instead of computing it, or when, run again, it calls
    one of the package's functions in ``refusing``: those that compute the answer the exercise
    asks for (the visible check calls them, so its expression could be copied).
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError(
            "recomputed: runs in a notebook's kernel (IPython), where the answer cells ran"
        )
    cells = [_parse(shell.transform_cell(untimed(source))) for source in _CELLS]  # (timed: as is)
    answer = next(
        (i for i in reversed(range(len(cells))) if cells[i] and name in _assigned(cells[i])), None
    )
    if answer is None:
        raise AssertionError(f"{name}: no cell assigns it")
    rerun = _to_run(cells, answer, set(inputs))
    asked = {
        node.value.id
        for code in rerun
        for node in ast.walk(code)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("grading", "check")
    }
    assert not asked, f"{name}: the answer asks {', '.join(sorted(asked))} instead of computing it"
    namespace = {**shell.user_ns, **inputs}
    with _refused(name, refusing, set(getattr(shell.compile, "_filename_map", ()))):
        for code in rerun[:-1]:  # what the answer reads: where it cannot run again (a
            namespace.update(inputs)  # file it made exists), its value stays as it is
            with contextlib.suppress(Exception):
                exec(compile(code, f"<the code {name} reads>", "exec"), namespace)
        namespace.update(inputs)
        exec(compile(rerun[-1], f"<the code that assigns {name}>", "exec"), namespace)
        return namespace[name]


def _to_run(cells, answer: int, inputs: set[str]) -> list[ast.Module]:
    """The answer's cell and, before it, each statement that made what it reads where that
    depends on ``inputs``, and those that made what it changes in place (and so on): the code to
    run again, in order."""
    units = [ast.Module([s], []) for tree in cells[:answer] if tree for s in tree.body]
    units.append(cells[answer])
    fresh, changed, read = map(list, zip(*map(_names, units)))
    read[-1], bound = set(), set()  # (what the answer binds before it reads is its own)
    for statement in cells[answer].body:
        binds, _, reads = _names(ast.Module([statement], []))
        read[-1] |= reads - bound
        bound |= binds

    @functools.cache
    def made(name: str, before: int) -> tuple[int, ...]:
        """The statement that last bound ``name`` before unit ``before``, and those that changed
        it since."""
        bound = [j for j in range(before) if name in fresh[j]]
        since = range(bound[-1] + 1, before) if bound else ()
        return (*bound[-1:], *[k for k in since if name in changed[k]])

    @functools.cache
    def depends(name: str, before: int) -> bool:
        return name in inputs or any(depends(r, k) for k in made(name, before) for r in read[k])

    run, todo = set(), [len(units) - 1]
    while todo:
        k = todo.pop()
        if k not in run:
            run.add(k)
            todo += [j for name in read[k] - inputs if depends(name, k) for j in made(name, k)]
            todo += [j for name in changed[k] - inputs for j in made(name, k)]
    return [units[k] for k in sorted(run)]


def _names(tree) -> tuple[set[str], set[str], set[str]]:
    """The names code binds afresh, those it changes in place (``x += …``, ``x[i] = …``,
    ``x.a = …``, ``x.append(…)``) and those it reads."""
    changed, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            changed.add(node.target.id)
            read.add(node.target.id)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            changed |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            called = node.value.func
            if isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name):
                changed.add(called.value.id)
    return _assigned(tree, augmented=False), changed, read


def refusing(name: str, functions):
    """A block in which the answer ``name`` may not call ``functions`` (by their code, so through
    any alias) on this thread: AssertionError after it if it did. For a built answer (a
    prefetcher) run by a check, where the package's own version would pass."""
    return _refused(name, functions, recompute=False)


@contextlib.contextmanager
def _refused(name: str, functions, cell_files=frozenset(), recompute: bool = True):
    """While the block runs, note each call of ``functions`` by its code, so through any alias (a
    list, a default argument, a partial made in an earlier cell); AssertionError after it when
    the answer made one, or switched the notes off. When the block is a ``recompute`` (the
    answer's code alone), calls into the course's modules are refused too, and so are a thread
    running code from ``cell_files`` (the notebook's cells) before it and the threads it starts;
    else the notes keep to this thread, where they slow nothing a check times."""
    import sys
    import threading

    if recompute and _threads_running(cell_files):
        raise AssertionError(
            f"{name}: a thread the answer started is still running; compute the answer in the "
            "cell itself"
        )
    codes = {getattr(f, "__func__", f).__code__: f for f in functions}
    called, asked, own = [], [], sys._getframe().f_code  # (this generator resumes at the end)

    def note(frame, event, arg):
        if event == "call":
            if frame.f_code in codes:
                called.append(codes[frame.f_code])
            elif (
                recompute
                and frame.f_code.co_filename.startswith(_COURSE)
                and frame.f_code is not own
            ):
                asked.append(frame.f_code.co_name)

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(note)
    if recompute:
        threading.setprofile(note)  # (and every thread the answer starts meanwhile)
    try:
        yield
        switched_off = sys.getprofile() is not note
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
    if switched_off:
        raise AssertionError(f"{name}: the answer switched off the grader's notes of its calls")
    if asked:
        raise AssertionError(f"{name}: the answer asks the course's checks instead of computing it")
    if called:
        where = f"{called[0].__module__.split('.')[-1]}.{called[0].__qualname__}"
        raise AssertionError(
            f"{name}: the answer calls {where}, which computes what the exercise asks you "
            "to work out yourself"
        )


_COURSE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the course's own modules


def _threads_running(cell_files) -> bool:
    """Whether a thread other than this one is running code compiled from ``cell_files``."""
    import sys
    import threading

    for ident, frame in sys._current_frames().items():
        while ident != threading.get_ident() and frame is not None:
            if frame.f_code.co_filename in cell_files:
                return True
            frame = frame.f_back
    return False


_CELLS: list[str] = []  # every cell the kernel has run since the import, in order


def _remember(info) -> None:
    _CELLS.append(info.raw_cell)


def _watch_cells() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    from offloadlab_course.guard import seal_course_modules

    shell = get_ipython()
    if shell is not None and _remember not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _remember)
        shell.events.register("pre_run_cell", seal_course_modules)
        shell.events.register("pre_run_cell", watch.remember)


def _parse(code: str):
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def _assigned(tree, augmented: bool = True) -> set[str]:
    """Names a cell binds outside its functions and classes: assignments (tuples too, in an
    ``if``, a loop, a ``try`` or a ``with`` as well), walruses and definitions; ``x += …`` too
    unless not ``augmented``."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) or (
            augmented and isinstance(node, ast.AugAssign)
        ):
            targets = [node.target]
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.Lambda)]
    return names


_watch_cells()
