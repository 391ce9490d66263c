"""What the labs' graded checks expect, and how the grader tells a computed answer from a copied one.

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

__all__ = ["recomputed", "exchange_seconds", "one_buffer_pass_seconds", "disk_step_seconds",
           "ADAM_STATE_BYTES", "Outcome", "lab01_challenge", "lab07_challenge"]

# Bytes per parameter that one AdamW step reads from disk and writes back: fp32 master weights
# and both moments (lab 7, chapter 8).
ADAM_STATE_BYTES = 12


def exchange_seconds(nbytes: float, h2d_rate: float, d2h_rate: float) -> float:
    """Seconds to send ``nbytes`` each way when both directions run at once, each at its own rate
    (bytes/s, measured while the other direction ran): the slower direction sets the time."""
    return max(nbytes / h2d_rate, nbytes / d2h_rate)


def one_buffer_pass_seconds(items: int, copy_seconds: float, work_seconds: float) -> float:
    """Seconds for one pass of a prefetcher with a single buffer: nothing overlaps, each item's
    copy waits for the work on the one before."""
    return items * (copy_seconds + work_seconds)


def disk_step_seconds(params: float, read_rate: float, write_rate: float) -> float:
    """Seconds of disk transfer in one AdamW step on state kept in files, reads and writes taking
    turns on the drive, at the rates (bytes/s) measured for each."""
    state = ADAM_STATE_BYTES * params
    return state / read_rate + state / write_rate


class Outcome:
    """A challenge's result: truthy when it met its bar; its line is printed when it is made."""

    def __init__(self, passed: bool, line: str):
        self.passed, self.line = passed, line
        print(line)

    def __bool__(self) -> bool:
        return self.passed


def lab01_challenge(trainer, config, device, budget: float = 6, steps: int = 5, rel_tol: float = 0.01) -> Outcome:
    """Lab 1's challenge, measured: train a bf16 TinyGPT of ``config`` with ``trainer(model) ->
    (step, optimizers)`` and fp32 AdamW from the same weights on the same tokens; the set-up passes
    when every step's loss is within ``rel_tol`` of AdamW's, every parameter has AdamW's two moments,
    and the persistent state after the last step is at most ``budget`` bytes a parameter (weights,
    gradients and optimizer state, each storage counted once; step counters left out)."""
    import torch

    from .models import TinyGPT

    torch.manual_seed(0)
    reference = TinyGPT(config).to(device)
    model = TinyGPT(config).to(device, torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    step, optimizers = trainer(model)
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
        step()
        worst = max(worst, abs(loss.item() - expected.item()) / expected.item())
    seen, held = set(), 0

    def count(tensor):
        nonlocal held
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if tensor.numel() > 1 and key not in seen:
            seen.add(key)
            held += tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    for p in params:
        count(p)
        if p.grad is not None:
            count(p.grad)
    moments = set()
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            if {"exp_avg", "exp_avg_sq"} <= set(state):
                moments.add(id(p))
            for value in state.values():
                if torch.is_tensor(value):
                    count(value)
    per_param = held / sum(p.numel() for p in params)
    if len(moments) < len(params):
        return Outcome(False, f"✗ challenge: {len(params) - len(moments)} of {len(params)} parameters have no AdamW "
                              "moments in the optimizers you returned")
    if worst > rel_tol:
        return Outcome(False, f"✗ challenge: the loss left fp32 AdamW's by up to {worst:.1%} (at most {rel_tol:.0%} "
                              "allowed): is it AdamW with lr=1e-3?")
    verdict = "✓" if per_param <= budget else "✗"
    return Outcome(per_param <= budget, f"{verdict} challenge: {per_param:.2f} bytes of state a parameter after a step "
                                        f"(measured; at most {budget:g}), loss within {worst:.2%} of fp32 AdamW")


def lab07_challenge(folder, block_bytes: int, queue_depth: int, reference_rate: float, share: float = 0.5,
                    params: int = 8 * 2**20, repeats: int = 3) -> Outcome:
    """Lab 7's challenge, measured: a FileTier of ``params`` fp32 values in ``folder`` with the given
    request size and queue depth, read whole ``repeats`` times (the median counts); it passes when it
    reads at ``share`` or more of ``reference_rate`` (bytes/s, the disk's rate as the lab measured it)."""
    import statistics
    import tempfile
    import time
    from pathlib import Path

    import torch

    from .nvme import FileTier

    with tempfile.TemporaryDirectory(dir=folder, prefix="lab07-challenge-") as scratch:
        tier = FileTier(Path(scratch) / "state.bin", params, init=torch.randn(params), block_bytes=block_bytes,
                        queue_depth=queue_depth)
        try:
            values, seconds = torch.empty(params), []
            for _ in range(repeats):
                start = time.perf_counter()
                tier.read(0, values)
                seconds.append(time.perf_counter() - start)
        finally:
            tier.close()
    rate = 4 * params / statistics.median(seconds)
    passed = rate >= share * reference_rate
    return Outcome(passed, f"{'✓' if passed else '✗'} challenge: the tier read at {rate / 1e9:.3g} GB/s (measured), "
                           f"{rate / reference_rate:.0%} of your disk's rate (at least {share:.0%} needed)")


def recomputed(name: str, **inputs):
    """The value the student's latest cell that assigns ``name`` (a variable or a function) gives
    when run again with ``inputs`` in place of the notebook's variables of those names.

    Runs in a copy of the notebook's namespace, so the lab's own variables stay as they were.
    AssertionError when no cell has assigned ``name`` yet, or when that cell asks the package's
    checks or this module for the answer instead of computing it.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("recomputed: runs in a notebook's kernel (IPython), where the answer cells ran")
    for source in reversed(_CELLS):
        code = shell.transform_cell(source)
        tree = _parse(code)
        if tree is not None and name in _assigned(tree):
            break
    else:
        raise AssertionError(f"{name}: no cell assigns it")
    asked = {node.value.id for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Name) and node.value.id in ("grading", "check")}
    assert not asked, f"{name}: the answer asks {', '.join(sorted(asked))} instead of computing it"
    namespace = {**shell.user_ns, **inputs}
    exec(compile(tree, f"<the cell that assigns {name}>", "exec"), namespace)
    return namespace[name]


_CELLS: list[str] = []  # every cell the kernel has run since the import, in order


def _remember(info) -> None:
    _CELLS.append(info.raw_cell)


def _watch_cells() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and _remember not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _remember)


def _parse(code: str):
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def _assigned(tree) -> set[str]:
    """Names a cell binds at its top level: assignments (tuples too) and definitions."""
    names = set()
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


_watch_cells()
