"""Prefetch and double buffering: host-resident tensors, delivered to the device ahead of use.

:class:`Prefetcher` walks a sequence of host tensors (or groups of tensors, such as one layer's
weights) and yields each one resident on the device while the next ``depth`` are already
copying on the link's copy stream into their own staging buffers. Every buffer has two events:
its copy's (the consumer waits for that one only) and its release, recorded on the compute
stream when the consumer asks for the next item (the producer's copy into the buffer waits
for that one). Three switches reproduce the classic mistakes: ``synchronous=True`` (a blocking
copy that waits for compute and makes the host wait for it), ``pinned=False`` (pageable
sources) and ``buffers=1`` (nothing can be fetched ahead).

:func:`stream_parameters` applies the same machinery to a model: each layer's weights live
in pinned host memory and are fetched for forward and, again, for backward.
"""

from __future__ import annotations

import torch
from torch import nn

from .link import Link

__all__ = ["Prefetcher", "stream_parameters", "StreamedModel"]

_ALIGN = 64  # bytes: every tensor in a staging buffer starts on a 64-byte boundary


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Prefetcher:
    """Iterate over ``items`` (host tensors or tuples of them), yielding device copies ahead of use.

    ``buffers`` device staging buffers (≥ 1; 2 is double buffering) each hold one item;
    ``depth`` items are fetched ahead of the one in use (default ``buffers - 1``, at most that).
    Iterating again starts a new pass over the same buffers. After a pass, :meth:`timeline`
    gives the recorded copies and consumer intervals in seconds on the link's clock.
    """

    def __init__(self, items, link: Link, buffers: int = 2, depth: int | None = None,
                 synchronous: bool = False, pinned: bool = True):
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
            raise ValueError(f"buffers: expected a positive integer; got {buffers!r}")
        depth = buffers - 1 if depth is None else depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < buffers:
            raise ValueError(f"depth: expected an integer in [0, buffers - 1] = [0, {buffers - 1}]; got {depth!r}")
        self.link, self.buffers, self.depth = link, buffers, 0 if synchronous else depth
        self.synchronous, self.pinned = bool(synchronous), bool(pinned)
        self._single = [isinstance(item, torch.Tensor) for item in items]
        groups = [(item,) if single else tuple(item) for item, single in zip(items, self._single)]
        if not groups:
            raise ValueError("items: expected at least one tensor or group of tensors")
        for i, group in enumerate(groups):
            if not group or not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in group):
                raise ValueError(f"items: expected host (cpu) tensors or groups of them; item {i} is not")
        self.sources = [tuple(self._host_copy(t) for t in group) for group in groups]
        self.slot_bytes = max(sum(_aligned(_nbytes(t)) for t in group) for group in self.sources)
        self._slots = [link.device_buffer(self.slot_bytes, torch.uint8) for _ in range(buffers)]
        self._released = [None] * buffers
        self._records: list = []

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        if not self.pinned:
            return t if not self.link.is_pinned(t) else t.clone()
        if self.link.is_pinned(t):
            return t
        pinned = self.link.host_buffer(t.shape, t.dtype)
        pinned.copy_(t)
        return pinned

    @property
    def device_bytes(self) -> int:
        """Device memory of the staging buffers: the most the prefetcher ever holds."""
        return self.buffers * self.slot_bytes

    def __len__(self) -> int:
        return len(self.sources)

    def _views(self, slot: int, group) -> tuple:
        views, offset = [], 0
        for t in group:
            n = _nbytes(t)
            views.append(self._slots[slot][offset:offset + n].view(t.dtype).view(t.shape))
            offset += _aligned(n)
        return tuple(views)

    def _issue(self, index: int):
        slot = index % self.buffers
        group = self.sources[index]
        after = "compute" if self.synchronous else self._released[slot]
        transfers = [self.link.to_device(view, src, after=after) for view, src in zip(self._views(slot, group), group)]
        return slot, transfers

    def __iter__(self):
        count = len(self.sources)
        self._records = []
        self._released = [None] * self.buffers
        pending = {}
        for index in range(min(self.depth + 1, count)):
            pending[index] = self._issue(index)
        for index in range(count):
            if index not in pending:
                pending[index] = self._issue(index)
            slot, transfers = pending.pop(index)
            for transfer in transfers:
                transfer.synchronize() if self.synchronous else transfer.wait()
            views = self._views(slot, self.sources[index])
            begin = self.link.mark()
            yield views[0] if self._single[index] else views
            # The consumer has issued its work on this item: the buffer is free once that work is done.
            self._released[slot] = end = self.link.mark()
            self._records.append((index, transfers, begin, end))
            ahead = index + self.depth + 1
            if self.depth and ahead < count:
                pending[ahead] = self._issue(ahead)

    def timeline(self) -> dict:
        """{'H2D': [...], 'compute': [...]} of the last pass: (start, end, label) in seconds."""
        lanes = {"H2D": [], "compute": []}
        for index, transfers, begin, end in self._records:
            lanes["H2D"].append((min(t.start for t in transfers), max(t.end for t in transfers), str(index)))
            lanes["compute"].append((begin.time, end.time, str(index)))
        return lanes


class _Fetch(torch.autograd.Function):
    """Host parameter → its device copy; the gradient comes back to the host parameter."""

    @staticmethod
    def forward(ctx, host_param, device_copy):
        return device_copy

    @staticmethod
    def backward(ctx, grad):
        return grad.to("cpu"), None


class StreamedModel:
    """Handle returned by :func:`stream_parameters`: the layers, the link, and a way to undo."""

    def __init__(self, model, layers, link, handles, buffers):
        self.model, self.layers, self.link, self._handles, self.buffers = model, layers, link, handles, buffers
        self.layer_bytes = max(sum(_nbytes(p) for p in layer.parameters()) for layer in layers)

    @property
    def device_budget(self) -> int:
        """Bytes of streamed weights the device holds at most: ``buffers`` layers in flight."""
        return self.buffers * self.layer_bytes

    def remove(self) -> None:
        """Restore the layers' ordinary forward (their weights stay in host memory)."""
        for layer, original in self._handles:
            layer.forward = original


def stream_parameters(model: nn.Module, link: Link, layers=None, buffers: int = 2) -> StreamedModel:
    """Keep each layer's weights in pinned host memory and stream them to the device per use.

    ``layers`` (default: ``model.blocks``), called once each and in order per forward, are the
    modules streamed; everything else stays where it is. In forward, layer i's weights are
    fetched while the next ``buffers - 1`` layers' are already in flight (a
    :class:`Prefetcher` over the layers). Tensors autograd saves from a streamed weight are
    saved as a reference to the host weight, so in backward each layer's weights are fetched
    again when first needed, and the layer before it is fetched ahead, in reverse order —
    device memory holds only the layers in flight. The parameters become host tensors: any
    optimizer, including :class:`~offloadlab.offload.CPUOffloadAdam` on the host, updates the
    host copy. Gradients come back to the host as each layer's backward finishes.
    """
    chosen = list(layers if layers is not None else getattr(model, "blocks", []))
    if not chosen:
        raise ValueError("layers: expected the modules to stream (the model has no .blocks)")
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2:
        raise ValueError(f"buffers: expected an integer ≥ 2 (one layer computing, one arriving); got {buffers!r}")
    for layer in chosen:
        for p in layer.parameters():
            p.data = link.host_buffer(p.shape, p.dtype).copy_(p.data)
    hosts = [list(layer.parameters()) for layer in chosen]
    state = {"forward": None, "backward": {}}

    def fetch_for_backward(index: int):
        """Start copying layer ``index``'s weights to fresh device memory (kept until backward drops them)."""
        if index < 0 or index in state["backward"]:
            return
        copies = [link.device_buffer(h.shape, h.dtype) for h in hosts[index]]
        transfers = [link.to_device(c, h.data) for c, h in zip(copies, hosts[index])]
        state["backward"][index] = (copies, transfers)

    def unpack(packed):
        if not (isinstance(packed, tuple) and len(packed) == 5 and packed[0] == "streamed"):
            return packed
        _, index, which, size, stride = packed
        fetch_for_backward(index)
        fetch_for_backward(index - 1)  # the layer backward reaches next, fetched ahead
        copies, transfers = state["backward"][index]
        transfers[which].wait()
        for done in [i for i in state["backward"] if i > index + 1]:
            del state["backward"][done]  # layers whose backward is over
        return copies[which].as_strided(size, stride)

    def make_forward(index: int, layer: nn.Module):
        names = [name for name, _ in layer.named_parameters()]

        def streamed_forward(*args, **kwargs):
            if index == 0 or state["forward"] is None:
                items = [tuple(h.data for h in layer_hosts) for layer_hosts in hosts]
                state["forward"] = iter(Prefetcher(items, link, buffers=buffers))
                state["backward"] = {}
            device_weights = next(state["forward"])
            starts = {d.data_ptr(): i for i, d in enumerate(device_weights)}

            def pack(t):
                which = starts.get(t.data_ptr()) if t.device.type == link.device.type else None
                if which is None or t.storage_offset() != device_weights[which].storage_offset():
                    return t
                return ("streamed", index, which, t.size(), t.stride())

            fetched = {n: _Fetch.apply(h, d) for n, h, d in zip(names, hosts[index], device_weights)}
            layer.forward = original  # functional_call runs the layer's own forward with `fetched`
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    return torch.func.functional_call(layer, fetched, args, kwargs)
            finally:
                layer.forward = streamed_forward

        original = layer.forward
        return streamed_forward

    handles = []
    for index, layer in enumerate(chosen):
        handles.append((layer, layer.forward))
        layer.forward = make_forward(index, layer)
    return StreamedModel(model, chosen, link, handles, buffers)
