"""Gradients gathered on the device and sent to host memory a group at a time.

Backward produces one gradient tensor per parameter, many of them small (biases, norms). Sending
each on its own pays a transfer's fixed cost per tensor; :class:`GradientGather` copies them, as
they arrive, into their places in a flat device buffer laid out like the group's host buffer
(a :class:`~offloadlab.layout.Layout`), and sends the whole group down in one device→host
copy once its last gradient is in. A *group* is whatever the caller sends together: a streamed
block (:class:`~offloadlab.streaming.StreamedModel`) or an optimizer bucket
(:class:`~offloadlab.offload.CPUOffloadAdam`). Each arriving gradient costs the same whatever the
size of its group: one lookup of its view (built once per group and buffer), one device copy.

A group that is still incomplete when :meth:`GradientGather.flush` is called (the end of a
backward pass: some parameters got no gradient), or when every gather buffer is busy, goes down
one copy per parameter received, so a later part never overwrites an earlier one on the host.
A group of one tensor goes down straight from that tensor: no gather, and no gather buffer the
size of the largest parameter (a large embedding would otherwise cost its size three times).
"""

from __future__ import annotations

import torch

from .layout import Layout
from .link import Link
from .ownership import GradientSink

__all__ = ["GradientGather"]


class GradientGather:
    """Gather gradients of ``layouts``' groups on ``link``'s device, and send them to ``sink``.

    Group ``i`` is laid out as ``layouts[i]`` (packed) on the device and in the host tensor the
    sink gives for it (see :class:`~offloadlab.ownership.GradientSink`). ``buffers`` device gather
    buffers of the largest group of several tensors are allocated once.
    """

    def __init__(
        self, link: Link, layouts: list[Layout], sink: GradientSink, names=None, buffers: int = 2
    ):
        self.link, self.layouts, self.sink = link, list(layouts), sink
        self._names = names or (lambda group: f"group {group}")
        self._buffers = [link.device_buffer(self.buffer_bytes, torch.uint8) for _ in range(buffers)]
        # per buffer: the copies still reading it
        self._sent: list[list] = [[] for _ in range(buffers)]
        # group → (buffer, positions gathered there)
        self._gathering: dict[int, tuple[int, set]] = {}
        # (buffer, group) → the group's tensors as views into that buffer, built on first use:
        # a gradient then costs one lookup and one device copy
        self._views: dict[tuple[int, int], tuple] = {}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of each device gather buffer (the largest group of several tensors)."""
        return max([layout.nbytes for layout in self.layouts if len(layout) > 1] + [1])

    @property
    def device_bytes(self) -> int:
        return len(self._buffers) * self.buffer_bytes

    def extend(self, layouts: list[Layout]) -> None:
        """Add groups (their indices follow the existing ones); grows the buffers if a new group
        is larger."""
        self.flush()
        self.link.synchronize()
        self.layouts += layouts
        if self._buffers[0].numel() < self.buffer_bytes:
            self._buffers = [
                self.link.device_buffer(self.buffer_bytes, torch.uint8) for _ in self._buffers
            ]
            self._sent = [[] for _ in self._buffers]
            self._views = {}

    def add(self, group: int, position: int, grad: torch.Tensor) -> None:
        """Gather the gradient of tensor ``position`` of ``group``; send the group once complete.

        A tensor whose gradient comes twice (a block run twice in one forward) is summed on the
        device while its group is being gathered, and starts the group's next round once the group
        has gone down; the sink adds the rounds up.
        """
        layout = self.layouts[group]
        if len(layout) == 1:  # nothing to gather: the gradient goes down as it is
            destination = self.sink.gradient_destination(group, [position])
            start, end = layout.byte_range(0)
            transfer = self.link.to_host(
                destination[start:end],
                grad.reshape(-1).view(torch.uint8),
                after="compute",
                label=f"grad {self._names(group)}",
            )
            self.sink.gradients_sent(group, [transfer], [position])
            return
        if group not in self._gathering:
            self._gathering[group] = (self._free_buffer(), set())
        buffer, positions = self._gathering[group]
        views = self._views.get((buffer, group))
        if views is None:
            views = self._views[buffer, group] = layout.views(self._buffers[buffer])
        view = views[position]
        if position in positions:
            view.add_(grad)
        else:
            view.copy_(grad)
            positions.add(position)
        if len(positions) == len(layout):
            self._send(group)

    def flush(self) -> None:
        """Send what every incomplete group has gathered (at the end of a backward pass)."""
        for group in list(self._gathering):
            self._send(group)

    def _free_buffer(self) -> int:
        busy = {buffer for buffer, _ in self._gathering.values()}
        if len(busy) == len(self._buffers):  # send the oldest incomplete group early
            self._send(next(iter(self._gathering)))
            busy = {buffer for buffer, _ in self._gathering.values()}
        buffer = next(b for b in range(len(self._buffers)) if b not in busy)
        for transfer in self._sent[buffer]:
            transfer.wait()  # the last copies out of this buffer are done before we overwrite it
        return buffer

    def _send(self, group: int) -> None:
        buffer, positions = self._gathering.pop(group)
        layout, positions = self.layouts[group], sorted(positions)
        destination = self.sink.gradient_destination(group, positions)
        if len(positions) == len(layout):
            ranges = [(0, layout.nbytes)]
        else:  # one copy per run of neighbours (a parameter without a gradient splits a run)
            ranges = []
            for i, k in enumerate(positions):
                a, b = layout.byte_range(k)
                if i and positions[i - 1] == k - 1:
                    ranges[-1] = (ranges[-1][0], b)
                else:
                    ranges.append((a, b))
        transfers = [
            self.link.to_host(
                destination[a:b],
                self._buffers[buffer][a:b],
                after="compute",
                label=f"grad {self._names(group)}",
            )
            for a, b in ranges
        ]
        self._sent[buffer] = transfers
        self.sink.gradients_sent(group, transfers, positions)
