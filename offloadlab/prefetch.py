"""Prefetch and double buffering: host-resident tensors, delivered to the device ahead of use.

:class:`Prefetcher` walks a sequence of host tensors (or groups of tensors, such as one layer's
weights) and yields each one resident on the device while the next ``depth`` are already
copying on the link's host→device engine into their own staging buffers. Every buffer has two
events: its copy's (the consumer waits for that one only) and its release, recorded on the
compute stream when the consumer asks for the next item (the producer's next copy into the
buffer waits for that one). Release markers outlive a pass, so the first copies of a new pass
wait for the last pass's compute. Three switches reproduce the classic mistakes:
``synchronous=True`` (a blocking copy that waits for compute and makes the host wait for it),
``pinned=False`` (copies straight from pageable memory) and ``buffers=1`` (nothing can be
fetched ahead).

:class:`~offloadlab.layout.Layout` places a group of tensors in one flat, 64-byte-aligned byte
buffer, so a group moves as one copy (it is importable from here too, where it first lived).
"""

from __future__ import annotations

import weakref

import torch

from .layout import Layout
from .link import Link, check_link
from .units import check_integer, plain_scalar

__all__ = ["Prefetcher", "Layout"]


class Prefetcher:
    """Iterate over ``items`` (host tensors or tuples of them), yielding device copies ahead of use.

    ``items`` may be any iterable (a list, a generator); it is read once, at construction.
    ``buffers`` device staging buffers (≥ 1; 2 is double buffering) each hold one item;
    ``depth`` items are fetched ahead of the one in use (default ``buffers - 1``, at most that).

    Sources are read at fetch time, every pass, so changes to them between passes are seen.
    A source in pinned memory (:meth:`Link.host_buffer`) is copied from in place: do not
    rewrite it while a pass is fetching it. With ``pinned=True`` (the default) an item whose
    tensors are not all pinned is first packed, on the calling thread, into one of ``buffers``
    pinned host staging buffers that belong to this prefetcher (so pinned memory stays at
    ``buffers`` items however many items there are, and is released with the prefetcher);
    with ``pinned=False`` it is copied straight from pageable memory, synchronously.

    An item is a view into one of the ``buffers`` device staging buffers, valid until you ask for
    the item ``buffers - depth`` places after it: with the default depth, the next one. Its
    buffer starts refilling then, while the work on the next item runs: that overlap is the
    double buffer. Use an item (issue the work that reads it) before asking for the next, or
    ``.clone()`` it to keep it. Each refill bumps the buffer's version counter, so autograd refuses
    a backward that saved an earlier item there (its in-place check) instead of reading the new
    item's data; and an item still referenced when the item that refilled its buffer is delivered
    (and the consumer has moved past it) makes iteration raise: ``list(prefetcher)`` would keep
    every item, so it is refused. That check lives within a pass: an item kept past its pass's
    end (the loop variable after a loop, one saved before a ``break``) is not followed into the
    next pass, whose refill of its buffer changes it. Clone what you keep.

    Iterating again starts a new pass over the same buffers, once the last pass is over: run to its
    end, or left with a ``break`` (its iterator dropped). Two passes at once would share the
    buffers, and are refused. On a GPU the last copies of a pass may still be reading pinned sources
    after it: ``link.synchronize()`` before rewriting them. After a pass, :meth:`timeline` gives the
    recorded copies and consumer intervals in seconds on the link's clock.
    """

    def __init__(
        self,
        items,
        link: Link,
        buffers: int = 2,
        depth: int | None = None,
        synchronous: bool = False,
        pinned: bool = True,
    ):
        buffers, depth = plain_scalar(buffers), plain_scalar(depth)  # (numpy's as Python's)
        check_integer(buffers, "buffers")
        depth = buffers - 1 if depth is None else depth
        check_integer(
            depth,
            "depth",
            0,
            buffers - 1,
            expected=f"an integer in [0, buffers - 1] = [0, {buffers - 1}]",
        )
        check_link(link)
        for flag, value in (("synchronous", synchronous), ("pinned", pinned)):
            if not isinstance(value, bool):  # ("no" is true to Python)
                raise ValueError(f"{flag}: expected True or False; got {value!r}")
        self.link, self.buffers, self.depth = link, buffers, 0 if synchronous else depth
        self.synchronous, self.pinned = synchronous, pinned
        if isinstance(items, torch.Tensor) or not hasattr(items, "__iter__"):
            # (a tensor iterates over its rows: one tensor would become many 0-dim items)
            raise ValueError(
                "items: expected a sequence of host tensors or of tuples of them; got "
                f"{type(items).__name__}"
            )
        items = list(items)
        if not items:
            raise ValueError("items: expected at least one tensor or group of tensors")
        self._single = [isinstance(item, torch.Tensor) for item in items]
        self.sources = []
        for i, (item, single) in enumerate(zip(items, self._single)):
            group = (item,) if single else tuple(item) if isinstance(item, (tuple, list)) else None
            if not group or not all(
                isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                for t in group
            ):
                raise ValueError(
                    f"items: expected contiguous host (cpu) tensors or tuples of them; item {i} is "
                    "not"
                )
            self.sources.append(group)
        self.layouts = [Layout(group) for group in self.sources]
        self.slot_bytes = max(layout.nbytes for layout in self.layouts)
        self._slots = [link.device_buffer(self.slot_bytes, torch.uint8) for _ in range(buffers)]
        staged = pinned and not all(link.is_pinned(t) for group in self.sources for t in group)
        self._staging = (
            [link.host_buffer(self.slot_bytes, torch.uint8) for _ in range(buffers)]
            if staged
            else None
        )
        # the copies still reading each staging buffer
        self._staging_reads: list = [[] for _ in range(buffers)]
        # Per buffer: the consumer's last release marker, kept across passes. It starts at a marker
        # recorded now, after the buffers were allocated: on a GPU their memory may be what kernels
        # still queued on the compute stream were using, and the first copy into them must wait.
        self._released = [link.mark()] * buffers
        self._in_use: int | None = None
        self._pass = None
        self._records: list = []

    @property
    def device_bytes(self) -> int:
        """Device memory of the staging buffers: the most the prefetcher ever holds."""
        return self.buffers * self.slot_bytes

    @property
    def host_staging_bytes(self) -> int:
        """Pinned host memory of this prefetcher's own staging buffers (0 when every source is
        pinned)."""
        return 0 if self._staging is None else self.buffers * self.slot_bytes

    def __len__(self) -> int:
        return len(self.sources)

    def __iter__(self):
        running = self._pass() if self._pass is not None else None
        in_progress = running is not None and running.gi_frame is not None
        del running  # (the refusal's traceback keeps this frame, and must not keep the pass)
        if in_progress:
            raise RuntimeError(
                "Prefetcher: a pass over its buffers is still in progress; finish it (or leave it "
                "with break) before starting another"
            )
        generator = self._run()
        # a pass left with break is dropped, and closes (its finally) at once
        self._pass = weakref.ref(generator)
        return generator

    def _issue(self, index: int):
        """Start item ``index``'s copy into its buffer, once the buffer's last consumer is done."""
        slot = index % self.buffers
        group, layout = self.sources[index], self.layouts[index]
        after = "compute" if self.synchronous else self._released[slot]
        label = str(index)
        if self.pinned and not all(self.link.is_pinned(t) for t in group):
            staging = self._staging[slot]
            for transfer in self._staging_reads[slot]:
                # the last copy out of this staging buffer must be done before we refill it
                transfer.synchronize()
            layout.pack(group, staging)
            transfers = [
                self.link.to_device(
                    self._slots[slot][: layout.nbytes],
                    staging[: layout.nbytes],
                    after=after,
                    label=label,
                )
            ]
            self._staging_reads[slot] = transfers
        else:
            transfers = [
                self.link.to_device(d, s, after=after, label=label)
                for d, s in zip(layout.views(self._slots[slot]), group)
            ]
        return slot, transfers

    def _run(self):
        count = len(self.sources)
        self._records = records = []
        pending = {}
        # weak refs to the views of items delivered, and of those since overwritten
        served, stale = {}, []
        try:

            def issue(index: int) -> None:
                # a backward that saved an earlier item of this buffer (of this pass or the last)
                # is refused from now on: the buffer is being refilled
                torch.autograd.graph.increment_version(self._slots[index % self.buffers])
                pending[index] = self._issue(index)

            for index in range(min(self.depth + 1, count)):
                issue(index)
            for index in range(count):
                if index not in pending:
                    issue(index)
                slot, transfers = pending.pop(index)
                for transfer in transfers:
                    transfer.synchronize() if self.synchronous else transfer.wait()
                views = self.layouts[index].views(self._slots[slot])
                # Only now is the work issued on the item that had this buffer surely done (this
                # copy waited for it), so a reference to it is the consumer's, not queued work's.
                if index >= self.buffers:
                    stale.append((index - self.buffers, index, served.pop(index - self.buffers)))
                stale = self._check_stale(stale, index)
                served[index] = [weakref.ref(v) for v in views]
                begin = self.link.mark()
                self._in_use = slot
                yield views[0] if self._single[index] else views
                # The consumer has issued its work on this item: the buffer is free once that work
                # is done.
                self._released[slot] = end = self.link.mark()
                self._in_use = None
                records.append((index, transfers, begin, end))
                ahead = index + self.depth + 1
                if self.depth and ahead < count:
                    issue(ahead)
        finally:
            # closed mid-item (break, or a new pass): release what it held
            if self._in_use is not None:
                self._released[self._in_use] = self.link.mark()
                self._in_use = None

    def _check_stale(self, stale: list, index: int) -> list:
        """Refuse a consumer that still holds an item whose buffer was refilled (``stale``: (item,
        the item that refilled it, weak refs to its views)), now that item ``index`` is delivered;
        the item just before ``index`` may still be the consumer's loop variable, and is checked
        at the next delivery. Returns the entries left to check."""
        left = []
        for earlier, refill, refs in stale:
            held = [v for v in (r() for r in refs) if v is not None]
            if held and earlier < index - 1:
                raise RuntimeError(
                    f"Prefetcher: item {earlier} is still referenced, but its device buffer has "
                    f"held item {refill} since; an item is valid only until you ask for the item "
                    f"{self.buffers - self.depth} places after it: use it before asking for the "
                    f"next, or .clone() it to keep it (list(prefetcher) keeps every item)"
                )
            if held:
                left.append((earlier, refill, refs))
        return left

    def timeline(self) -> dict:
        """{'H2D': [...], 'compute': [...]} of the last pass: (start, end, label) in seconds."""
        lanes = {"H2D": [], "compute": []}
        for index, transfers, begin, end in self._records:
            lanes["H2D"].append(
                (min(t.start for t in transfers), max(t.end for t in transfers), str(index))
            )
            lanes["compute"].append((begin.time, end.time, str(index)))
        return lanes
