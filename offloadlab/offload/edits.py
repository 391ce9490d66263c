"""Weights changed by hand, found without reading the weights back.

torch.optim.AdamW updates whatever the parameters hold, so CPUOffloadAdam must take in weights a
user changed since it last wrote them (``p.data.fill_``, a checkpoint's ``copy_``, ``p.data =
…``), even through ``.data``, which a version counter does not see. Reading every weight down each
step would cost as much link traffic as the gradients. Instead the device reduces a bucket's
weights to a :func:`fingerprint` of three integers, compares it with the fingerprint of what was
last sent, and one byte comes down. Only a bucket whose byte says "changed", or whose parameters'
memory was swapped (``p.data = …``: a new pointer, strides or shape), is read down and compared
exactly, parameter by parameter.
"""

from __future__ import annotations

import contextlib

import torch

from ..link import Link
from .bucket import Bucket
from .host_state import HostState

__all__ = ["fingerprint", "EditWatch", "WIDTH"]

WIDTH = 1024  # 8-byte words per row of the fingerprint's grid


def fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """Three int64 on ``flat``'s device that change when any of its bits change, almost surely.

    ``flat``'s bytes, read as 8-byte integers ("words", the few bytes past the last whole word
    each a word of its own) and laid out in rows of :data:`WIDTH` words: their sum, the row sums
    weighted by row number and the column sums weighted by column number. Integer sums are exact
    (modulo 2⁶⁴) in any order, so the same bytes give the same three numbers on the GPU and the
    CPU. A change of one word or a swap of two unequal ones always shows; an edit whose changes
    cancel in the total and in every row and column at once (+d, -d, +d, -d in four words at the
    corners of a rectangle) does not. Cost: two reads of ``flat`` (no widening, no copy, unless
    it starts off an 8-byte boundary).
    """
    raw = flat.view(-1).view(torch.uint8)
    if raw.storage_offset() % 8:
        raw = raw.clone()  # (an int64 view needs 8-byte alignment)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    rows = words.numel() // WIDTH
    grid = words[: rows * WIDTH].view(rows, WIDTH)
    tail = torch.cat([words[rows * WIDTH :], raw[whole:].to(torch.int64)])
    row_sums, column_sums = grid.sum(1), grid.sum(0)
    total = row_sums.sum() + tail.sum()
    by_row = (row_sums * _counting(rows, flat.device)).sum() + (rows + 1) * tail.sum()
    by_column = (column_sums * _counting(WIDTH, flat.device)).sum() + (
        tail * _counting(tail.numel(), flat.device)
    ).sum()
    return torch.stack([total, by_row, by_column])


def _counting(n: int, device) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device)


class EditWatch:
    """For each bucket of ``host``: the fingerprint of the weights last sent to its parameters (on
    the device), and the check in flight.

    :meth:`start` (on the training thread, where the weights are current) queues the device's
    comparison and its one-byte copy down on the training stream (``training()``: a marker on
    it, or None for the caller's current stream); :meth:`finish` (on any thread) waits for that
    byte and, only if it says so, reads the bucket down and takes changed parameters into the
    master copy.
    :meth:`sent` is called by the copy engine, right after a bucket's weights land.
    """

    def __init__(self, link: Link, host: HostState, training=lambda: None):
        self.link, self.host, self._training = link, host, training
        self._sent = None  # (buckets, 3) int64 on the device
        self._flags = None  # one pinned byte per bucket: the device's answer
        self._pending: dict[int, tuple] = {}  # bucket index → (copy of the byte, or "swapped")
        self._generation: dict[int, int] = {}  # bucket index → its weights' generation seen
        self.extend(host.buckets)

    def extend(self, buckets: list[Bucket]) -> None:
        """Room for the host's buckets, and a first fingerprint of each new one's weights."""
        total = len(self.host.buckets)
        sent, flags = (
            self.link.device_buffer((total, 3), torch.int64),
            self.link.host_buffer(total, torch.uint8),
        )
        if self._sent is not None:
            sent[: self._sent.shape[0]].copy_(self._sent)
        self._sent, self._flags = sent, flags
        for bucket in buckets:
            if bucket.streamed is None:
                self._sent[bucket.index].copy_(fingerprint(_joined(bucket.weights()[1])))
            self._generation[bucket.index] = bucket.generation

    def sent(self, bucket: Bucket, weights: torch.Tensor) -> None:
        """``weights`` (device, the bucket's parameters end to end) have just been written to
        them."""
        self._sent[bucket.index].copy_(fingerprint(weights))

    def start(self, bucket: Bucket) -> None:
        """Compare the bucket's weights, as they are now, with those last sent (the answer comes
        down later)."""
        flat = bucket.weights()[1]
        if bucket.streamed is not None or bucket.generation != self._generation[bucket.index]:
            self._pending[bucket.index] = "exact"  # (host memory, or swapped: compare exactly)
            return
        i, training = bucket.index, self._training()
        with contextlib.nullcontext() if training is None else self.link.on_stream_of(training):
            now = fingerprint(_joined(flat))
            changed = (now != self._sent[i]).any().to(torch.uint8).view(1)
            self._sent[i].copy_(now)  # (what the master copy holds once the check is finished)
            flag = self._flags[i : i + 1]
            self._pending[i] = (self.link.to_host(flag, changed, label=f"b{i} edits"), flag)

    def finish(self, bucket: Bucket) -> int:
        """Wait for the bucket's check and take changed weights in; how many parameters changed."""
        check = self._pending.pop(bucket.index, None)
        if check is None:
            return 0
        if check != "exact":
            copy, flag = check
            copy.synchronize()
            if not flag[0]:
                return 0
        self._generation[bucket.index] = bucket.generation
        return self.host.take_changed(bucket, self._read_down(bucket))

    def _read_down(self, bucket: Bucket) -> list:
        """Host copies of the bucket's weights (the rare path: a bucket found changed)."""
        flat = bucket.weights()[1]
        if bucket.streamed is not None:
            return flat  # (a streamed block's weights live in host memory)
        copies = [torch.empty(w.numel(), dtype=w.dtype) for w in flat]
        for copy, weights in zip(copies, flat):
            last = self.link.to_host(copy, weights, label=f"b{bucket.index} read")
        last.synchronize()  # (one engine, in order: the last landing means all have)
        return copies


def _joined(flat: list) -> torch.Tensor:
    """The tensors end to end (the one tensor itself, if there is only one)."""
    return flat[0] if len(flat) == 1 else torch.cat(flat)
