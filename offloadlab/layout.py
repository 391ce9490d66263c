"""Where each of a group of tensors sits in one flat byte buffer, so the group moves as one copy.

A :class:`Layout` is computed once per group (a streamed block's weights, an optimizer bucket's
gradients); :meth:`Layout.views` gives every tensor's place in a flat buffer as a view. Building
a view costs a few microseconds (a slice and two reinterpretations), so code that runs once per
gradient, inside backward, builds a buffer's views once and keeps them: real decoders have
hundreds of tensors.
"""

from __future__ import annotations

import bisect

import torch

__all__ = ["Layout", "ALIGN"]

# bytes: every tensor in a flat buffer starts on a 64-byte boundary (vector loads, cuBLAS)
ALIGN = 64


class Layout:
    """Where each of ``tensors`` sits in one flat byte buffer (sizes and offsets in bytes).

    By default every tensor starts on a multiple of :data:`ALIGN` bytes, for tensors that compute
    reads (vector loads, cuBLAS); ``packed=True`` puts them end to end (each still on a multiple
    of its element size), for buffers that only copies touch.

    ``specs[i]`` is tensor ``i``'s (shape, dtype, byte offset) and ``ranges[i]`` its (start, end)
    in bytes; ``nbytes`` is the size of the flat buffer, padding included.
    """

    def __init__(self, tensors, packed: bool = False):
        tensors = list(tensors)
        align = max((t.element_size() for t in tensors), default=1) if packed else ALIGN
        self.specs: list[tuple[torch.Size, torch.dtype, int]] = []
        self.ranges: list[tuple[int, int]] = []
        offset = 0
        for t in tensors:
            offset = (offset + align - 1) // align * align
            self.specs.append((t.shape, t.dtype, offset))
            self.ranges.append((offset, offset + t.numel() * t.element_size()))
            offset = self.ranges[-1][1]
        self.nbytes = (offset + align - 1) // align * align
        self._starts = [start for start, _ in self.ranges]  # ascending: for which_holds

    def __len__(self) -> int:
        return len(self.specs)

    def byte_range(self, which: int) -> tuple[int, int]:
        """Where tensor ``which`` starts and ends in the flat buffer, in bytes."""
        return self.ranges[which]

    def view(self, flat: torch.Tensor, which: int) -> torch.Tensor:
        """Tensor ``which`` as a view into ``flat`` (a uint8 tensor of at least ``nbytes``)."""
        shape, dtype, _ = self.specs[which]
        start, end = self.ranges[which]
        return flat[start:end].view(dtype).view(shape)

    def views(self, flat: torch.Tensor) -> tuple:
        """Every tensor of the group as a view into ``flat``."""
        return tuple(self.view(flat, which) for which in range(len(self.specs)))

    def pack(self, tensors, flat: torch.Tensor) -> None:
        """Copy ``tensors`` into their places in ``flat``."""
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)

    def which_holds(self, byte: int) -> int | None:
        """The tensor whose bytes include offset ``byte`` of the flat buffer (None: padding)."""
        which = bisect.bisect_right(self._starts, byte) - 1
        if which < 0 or byte >= self.ranges[which][1]:
            return None
        return which
