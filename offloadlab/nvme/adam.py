"""AdamW over optimizer state kept in files: :func:`adam_from_file`, and :func:`open_state`.

The CPU AdamW step over master weights and moments in three :class:`~offloadlab.nvme.tier.FileTier`
files — read a chunk, update it, write it back, the next chunk's reads and the last chunk's writes
in flight meanwhile — the way ZeRO-Infinity keeps optimizer state on NVMe; the three commit as one
transaction.
"""

from __future__ import annotations

import time

import torch

from .. import cpu_adam
from ..units import check_adamw_settings, is_integer, plain_scalar
from .aio import all_of
from .direct_io import aligned_empty, round_up
from .tier import FileTier

__all__ = ["adam_from_file", "open_state"]


def open_state(*paths, queue_depth: int = 8) -> list[FileTier]:
    """Open the files of one optimizer state (e.g. master, exp_avg, exp_avg_sq) at the newest
    step they all hold: the step a crash between two of :func:`adam_from_file`'s commits left
    complete."""
    if not paths:
        raise ValueError(
            "paths: expected the files of one optimizer state (e.g. master, exp_avg, exp_avg_sq); "
            "got none"
        )
    tiers = []
    try:
        for path in paths:
            tiers.append(FileTier.open(path, queue_depth=queue_depth))
        common = set.intersection(*(set(t.steps) for t in tiers))
        if not common:
            raise ValueError(
                "paths: the files hold no common step: "
                + ", ".join(f"{t.path} {t.steps}" for t in tiers)
            )
        step = max(common)
        for i, tier in enumerate(tiers):
            if tier.step != step:
                tier.close()
                tiers[i] = FileTier.open(
                    paths[i], step=step, queue_depth=queue_depth, replace_newer=True
                )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


# What adam_from_file passes on to cpu_adam.adamw_step besides step and lr.
_ADAMW_KEYWORDS = {"betas", "eps", "weight_decay", "grad_scale", "threads", "variant"}


def adam_from_file(
    master: FileTier,
    exp_avg: FileTier,
    exp_avg_sq: FileTier,
    grad: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    step: int | None = None,
    lr: float,
    chunk: int | None = None,
    **adam,
) -> dict:
    """One AdamW step over fp32 state kept in three tiers, ``chunk`` elements at a time, as one
    transaction.

    ``step`` (1-based, for bias correction) must be one more than the tiers' committed step, which
    it is by default. While chunk i is updated, the reads of chunk i+1 and the writes of chunk i-1
    are in flight (two buffer sets). All three files commit at the end; after any error, or an
    interrupt, all three are at the previous step again (``out`` may hold part of the new weights).

    Returns seconds: 'read' (waiting for reads), 'update' (the CPU step), 'write' (waiting for
    writes, including the commit's syncs) and 'other' (the rest: handing blocks to the I/O
    threads, invalidating each file's old header before its first write). They add up to the
    step's time; 'read' + 'write' is the disk time the update did not hide.
    """
    unknown = sorted(set(adam) - _ADAMW_KEYWORDS)
    if unknown:
        raise ValueError(
            f"{unknown[0]}: adam_from_file takes no such keyword; it takes "
            f"{', '.join(sorted(_ADAMW_KEYWORDS))}"
        )
    check_adamw_settings(
        lr,
        adam.get("betas", (0.9, 0.999)),
        adam.get("eps", 1e-8),
        adam.get("weight_decay", 1e-2),
    )
    tiers = (master, exp_avg, exp_avg_sq)
    for name, tier in zip(("master", "exp_avg", "exp_avg_sq"), tiers):
        if not isinstance(tier, FileTier) or tier.dtype != torch.float32:
            raise ValueError(f"{name}: expected a FileTier of torch.float32; got {tier!r}")
        tier._check_open()
    if len({id(t) for t in tiers}) != 3:
        raise ValueError(
            "exp_avg: expected three different tiers for master, exp_avg and exp_avg_sq; got one "
            "twice"
        )
    if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
        raise ValueError(f"grad: expected a floating-point torch tensor; got {type(grad).__name__}")
    if not (master.numel == exp_avg.numel == exp_avg_sq.numel == grad.numel()):
        raise ValueError("grad: expected as many elements as each state file holds")
    if out is not None and (not isinstance(out, torch.Tensor) or out.numel() != master.numel):
        got = out.numel() if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: expected {master.numel} elements to match master; got {got}")
    if len({t.step for t in tiers}) != 1:
        raise ValueError(
            f"exp_avg: expected the three files at one step; got steps {[t.step for t in tiers]} "
            "(open_state reopens them at the step they all hold)"
        )
    step = master.step + 1 if step is None else plain_scalar(step)  # (numpy's as Python's)
    if step != master.step + 1:
        raise ValueError(
            f"step: expected {master.step + 1}, one more than the files' committed step; got "
            f"{step!r}"
        )
    block = master.block
    if exp_avg.block != block or exp_avg_sq.block != block:
        raise ValueError(
            f"exp_avg: expected the three files to share one block size; got "
            f"{[t.block for t in tiers]} elements"
        )
    # reads of one chunk + writes of another fill the depth
    chunk = block * max(1, master.queue_depth // 2) if chunk is None else plain_scalar(chunk)
    if not is_integer(chunk) or chunk <= 0 or chunk % block:
        raise ValueError(
            f"chunk: expected a positive multiple of the tiers' block ({block} elements); got "
            f"{chunk!r}"
        )
    n = master.numel
    chunk = min(chunk, round_up(n, block))
    starts = list(range(0, n, chunk))
    sets = [[aligned_empty(chunk) for _ in tiers] for _ in range(2)]
    seconds = {"read": 0.0, "update": 0.0, "write": 0.0, "other": 0.0}
    started = time.perf_counter()

    def transfer(i, method):
        begin, end = starts[i], min(starts[i] + chunk, n)
        return all_of(
            [
                getattr(tier, method)(begin, buffer[: end - begin])
                for tier, buffer in zip(tiers, sets[i % 2])
            ]
        )

    def waited(future, key):
        begin = time.perf_counter()
        future.result()
        seconds[key] += time.perf_counter() - begin

    committed, reads, writes = [], {}, {}
    try:
        reads[0] = transfer(0, "read_async")
        for i, begin in enumerate(starts):
            waited(reads.pop(i), "read")
            if i + 1 < len(starts):
                if i - 1 in writes:  # chunk i+1 reads into the buffers chunk i-1 is written from
                    waited(writes.pop(i - 1), "write")
                reads[i + 1] = transfer(i + 1, "read_async")
            end = min(begin + chunk, n)
            p, m, v = (buffer[: end - begin] for buffer in sets[i % 2])
            t0 = time.perf_counter()
            cpu_adam.adamw_step(
                p,
                m,
                v,
                grad[begin:end],
                None if out is None else out[begin:end],
                step=step,
                lr=lr,
                **adam,
            )
            seconds["update"] += time.perf_counter() - t0
            writes[i] = transfer(i, "write_async")
        t0 = time.perf_counter()
        for future in writes.values():
            future.result()
        for tier in tiers:
            tier.commit()
            committed.append(tier)
        seconds["write"] += time.perf_counter() - t0
        seconds["other"] = (
            time.perf_counter() - started - seconds["read"] - seconds["update"] - seconds["write"]
        )
    except BaseException:
        for future in list(reads.values()) + list(writes.values()):
            future.exception()  # let the transfers into and out of our buffers finish first
        for tier in tiers:
            if tier in committed:
                tier._rewind()
            else:
                tier.abort()
        raise
    return seconds
