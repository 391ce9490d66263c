"""What the host may assume about copies under CUDA's rules, tracked on top of the emulated link.

On a GPU, ``Transfer.wait()`` orders the compute stream after a copy and tells the host nothing;
the host knows a copy has finished only after ``synchronize()`` or a ``done()`` that said True —
of that copy, of a later copy on the same engine (engines run in order), or of a copy ordered
after compute that had waited for it. The emulation makes ``wait()`` block the host, so host code
that rewrites pinned memory while a copy may still read it can never fail there.
:class:`CudaOrderLink` keeps the ledger of what the host knows under CUDA's rules, so a test can
ask, at the moment the package writes host memory, whether a copy might still be reading it.
"""

from __future__ import annotations

import itertools

from offloadlab.link import EmulatedLink


class CudaOrderLink(EmulatedLink):
    """An EmulatedLink that also records, per copy, whether the host may know it has finished."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._position = itertools.count()  # order of events on the (single) compute stream
        self._waits: list = []               # (position, transfer) of each Transfer.wait()
        self._last = {"h2d": None, "d2h": None}
        self.transfers: list = []

    def mark(self):
        marker = super().mark()
        marker._position = next(self._position)
        return marker

    def mark_on(self, marker):
        return self.mark()

    def synchronize(self):
        super().synchronize()
        for transfer in self.transfers:
            transfer._known = True

    def _issue(self, direction, dst, src, nbytes, pinned, after, label, scatter=()):
        transfer = super()._issue(direction, dst, src, nbytes, pinned, after, label, scatter)
        host = src if direction == "h2d" else dst
        transfer._host_range = (host.data_ptr(), host.data_ptr() + host.numel() * host.element_size())
        position = next(self._position) if after == "compute" else getattr(after, "_position", -1)
        transfer._known = False
        # What finishing this copy proves finished before it: the copies the compute waited for
        # before the point it is ordered after, and the previous copy on its engine.
        transfer._before = [t for p, t in self._waits if p < position]
        if self._last[direction] is not None:
            transfer._before.append(self._last[direction])
        self._last[direction] = transfer
        self.transfers.append(transfer)
        real_synchronize, real_done = transfer.synchronize, transfer.done

        def synchronize():
            real_synchronize()
            _learn(transfer)

        def done():
            finished = real_done()
            if finished:
                _learn(transfer)
            return finished

        def wait():  # CUDA: the compute stream waits; the host learns nothing
            real_synchronize()  # (the emulation's data must still be right)
            self._waits.append((next(self._position), transfer))

        transfer.synchronize, transfer.done, transfer.wait = synchronize, done, wait
        return transfer

    def unknown_reads_of(self, tensor) -> list:
        """Copies to the device that read ``tensor``'s memory and the host cannot know have finished."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return [t for t in self.transfers if t.direction == "h2d" and not t._known
                and t._host_range[0] < end and start < t._host_range[1]]


def _learn(transfer) -> None:
    stack = [transfer]
    while stack:
        t = stack.pop()
        if not t._known:
            t._known = True
            stack += t._before
