"""Parameter streaming: a model's blocks keep their weights in pinned host memory and borrow
device memory only while they run — in forward, and again in backward.

:class:`StreamedModel` moves each chosen block's weights (``model.blocks`` by default) into one
flat pinned host buffer per block; the device holds ``buffers`` block-sized weight buffers and two
gradient buffers, allocated once. Calling a block takes a buffer holding its weights and prefetches
the next ``buffers - 1``; backward fetches them again (saved-tensor hooks keep a reference, not the
device copy); each block's gradients go down in one copy, straight into a CPUOffloadAdam's host
buffer when one manages the parameters, else into ``.grad`` at the end of backward, where the host
waits for them and nowhere earlier.

Blocks may run in any order (skipped, recomputed under checkpointing, twice in one forward) and
always get their own weights; what it cannot do it refuses by name: every buffer held, parameters
replaced after streaming began (``load_state_dict(assign=True)``), ``torch.autograd.grad`` with a
streamed input, ``fullgraph=True`` under ``torch.compile`` (each block's forward is compiled; the
fetches run outside the graph), a gradient hook (``register_hook``) on a streamed weight, a
backward with ``create_graph=True``. Two other
kinds still run but see None: ``register_post_accumulate_grad_hook`` (CPUOffloadAdam's own intake
uses it) and a hook on the weight's AccumulateGrad node, where DDP and DeepSpeed place theirs; read
``.grad`` after backward instead. Code that writes the host weights in place itself calls
``link.synchronize()`` first, as for any pinned buffer a copy may still read. Under autocast,
backward keeps where to find a trainable weight's cast copy, not the copy, and casts again. Under
``torch.compile`` a block's forward is one graph all blocks share, with the gradients of the plain
model; a loop over the blocks and the layers around it run uncompiled, and a checkpointed block
is not compiled. Chapter 7 explains the design.
"""

from __future__ import annotations

import collections
import functools
import itertools

import torch
from torch import nn

from . import _torch_compat, ownership
from .gather import GradientGather
from .layout import ALIGN, Layout
from .link import Link, Marker, check_link
from .ownership import GradientSink
from .units import check_integer, plain_scalar

__all__ = ["StreamedModel", "streamed_model_of"]

_EAGER = "StreamedModel fetches and releases a block's weights outside the graph"


def streamed_model_of(param: torch.Tensor) -> "StreamedModel | None":
    """The :class:`StreamedModel` that streams ``param``, or None."""
    return ownership.streamer_of(param)


class _Buffer:
    """A device weight buffer: which block it holds, the copy filling it, who holds it, when
    released."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self.block: int | None = None
        # the block's parameters' version counters when it was filled
        self.versions: tuple = ()
        self.fill: list = []  # the transfer(s) bringing self.block's weights in
        self.holds = 0  # users (a running forward, a backward in progress)
        self.released: Marker | None = None  # compute-stream point after its last user's work
        self.last_use = 0


# The block's parameters swapped for its fetched weights and back, eagerly even where the block
# itself is compiled (block.compile(fullgraph=True) would trace torch's context manager and fail).
@_torch_compat.eager_under_compile(_EAGER)
def _swap_in(block: nn.Module, fetched: dict):
    swapped = _torch_compat.reparametrize_module(block, fetched)
    swapped.__enter__()
    return swapped


@_torch_compat.eager_under_compile(_EAGER)
def _swap_out(swapped) -> None:
    swapped.__exit__(None, None, None)


class _SavedWeight:
    """What backward keeps instead of a streamed weight (or, under autocast, its cast): where to
    find it again, and the dtype it was cast to (None: not cast)."""

    __slots__ = ("block", "which", "size", "stride", "offset", "version", "cast")

    def __init__(self, block, which, size, stride, offset, version, cast=None):
        self.block, self.which, self.size, self.stride, self.offset = (
            block,
            which,
            size,
            stride,
            offset,
        )
        self.version = version  # the host weight's version counter when forward saved it
        self.cast = cast


class _Fetch(torch.autograd.Function):
    """Host parameter → its device copy; the gradient goes to the StreamedModel, not to autograd."""

    @staticmethod
    def forward(ctx, host_param, device_copy, streamed, block, which):
        ctx.streamed, ctx.block, ctx.which = streamed, block, which
        return device_copy

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.next_functions[0][0]  # (the host parameter's AccumulateGrad)
        if _torch_compat.grad_captures(weight):
            ctx.streamed._refuse_autograd_grad(ctx.block, ctx.which)
        if weight.variable._backward_hooks:  # (one registered after forward)
            ctx.streamed._refuse_hook(ctx.block, ctx.which)
        ctx.streamed._gradient(ctx.block, ctx.which, grad)
        return None, None, None, None, None


class StreamedModel:
    """Stream ``blocks`` (default ``model.blocks``) of ``model`` from pinned host memory over
    ``link``.

    ``buffers`` (≥ 2) device weight buffers, each the size of the largest block: one block
    computing while the next arrives. See the module docstring for what happens when.
    """

    def __init__(self, model: nn.Module, link: Link, blocks=None, buffers: int = 2):
        check_link(link)
        if blocks is None:
            chosen = list(getattr(model, "blocks", []))
            given = "none given, and model.blocks holds none"
        else:
            iterable = hasattr(blocks, "__iter__")
            chosen = list(blocks) if iterable else []
            given = f"got {type(blocks).__name__}" + (f" of {len(chosen)} item(s)" * iterable)
        if not chosen or not all(isinstance(b, nn.Module) for b in chosen):
            raise ValueError(f"blocks: expected a non-empty list of the modules to stream; {given}")
        if len({id(b) for b in chosen}) != len(chosen):
            raise ValueError("blocks: expected each block once")
        inside = {id(m) for m in model.modules()}
        foreign = next((i for i, b in enumerate(chosen) if id(b) not in inside), None)
        if foreign is not None:
            raise ValueError(
                f"blocks: block {foreign} is not a module of the model; expected the model's own "
                "modules to stream"
            )
        buffers = check_integer(
            plain_scalar(buffers),
            "buffers",
            2,
            expected="an integer ≥ 2 (one block computing, one arriving)",
        )
        names = {id(m): n for n, m in model.named_modules()}
        self.model, self._link, self._blocks, self.buffers = model, link, tuple(chosen), buffers
        self.names = [names.get(id(b), f"block {i}") for i, b in enumerate(chosen)]
        self._params = [list(b.named_parameters()) for b in chosen]
        for index, named in enumerate(self._params):
            meta = [name for name, p in named if p.is_meta]
            if meta:
                raise ValueError(
                    f"blocks: {self.names[index]!r} has parameters on the meta device ({meta[0]!r}"
                    f"{' and more' if len(meta) > 1 else ''}): shapes without values; materialise "
                    f"the model first (model.to_empty(device='cpu') and initialise it, or load its "
                    "weights)"
                )
        self._check_ownership()

        self.layouts = [Layout([p for _, p in named]) for named in self._params]
        self._trainable = [
            [k for k, (_, p) in enumerate(named) if p.requires_grad] for named in self._params
        ]
        self._gradient_position = [
            {k: position for position, k in enumerate(ks)} for ks in self._trainable
        ]
        self.gradient_layouts = [
            Layout([named[k][1] for k in ks], packed=True)
            for named, ks in zip(self._params, self._trainable)
        ]
        self._host = []
        with torch.no_grad():
            for named, layout in zip(self._params, self.layouts):
                flat = link.host_buffer(layout.nbytes, torch.uint8)
                for (_, p), view in zip(named, layout.views(flat)):
                    view.copy_(p)
                    p.data = view
                self._host.append(flat)
        self._addresses = [[p.data_ptr() for _, p in named] for named in self._params]
        self._block_of = {
            id(p): index for index, named in enumerate(self._params) for _, p in named
        }
        for named in self._params:
            for _, p in named:
                ownership.hold(p, streamer=self)

        self._block_bytes = max(layout.nbytes for layout in self.layouts)
        self._weights = [
            _Buffer(link.device_buffer(self._block_bytes, torch.uint8)) for _ in range(buffers)
        ]
        # the first fill of each buffer waits for what used its memory before
        allocated = link.mark(timed=False)
        for buffer in self._weights:
            buffer.released = allocated
        self._gather = GradientGather(
            link,
            self.gradient_layouts,
            sink=self,
            names=lambda index: f"block {self.names[index]!r}",
        )
        # pinned, a region per block for the gradients that go to .grad
        self._landing_at = [0]
        for layout in self.gradient_layouts:
            self._landing_at.append(self._landing_at[-1] + -(-layout.nbytes // ALIGN) * ALIGN)
        self._landing_buffer: torch.Tensor | None = None
        self._allocate_landing()
        # block → the sink attached to it, and its group there
        self._sinks: dict[int, tuple[GradientSink, int]] = {}
        self._backward = _torch_compat.EndOfBackward(self._end_backward)
        self._reading: dict[int, list] = {}  # block → copies that may still read its host weights
        self._uses = itertools.count(1)
        self._reset_backward()
        self._load_hooks = []
        for index, block in enumerate(chosen):
            block.forward = functools.partial(self._forward, index)  # shadows the class's forward
            # load_state_dict copies into the host weights in place: not while a copy still reads
            # them
            self._load_hooks.append(
                block.register_load_state_dict_pre_hook(
                    lambda *_, index=index: self._quiesce(index)
                )
            )
        # model.zero_grad() after a backward that raised: that pass's gradients land first, to be
        # cleared with the rest, as autograd's would be (this model's zero_grad only, not torch's)
        # (another StreamedModel's, on the same model)
        self._outer_zero_grad = model.__dict__.get("zero_grad")
        model.zero_grad = self._zero_grad

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a streamed model cannot be copied or pickled (its blocks' weights live in this "
            "process's pinned memory and stream over its link): remove() the streaming, copy the "
            "model, and stream the copy with a StreamedModel of its own"
        )

    @property
    def link(self) -> Link:
        """The link the blocks stream over, fixed when the model was streamed."""
        return self._link

    @property
    def block_bytes(self) -> int:
        """Bytes of one device weight buffer: the largest block's weights, fixed when the model
        was streamed."""
        return self._block_bytes

    @property
    def blocks(self) -> tuple:
        """The streamed blocks in order, fixed when the model was streamed: their hooks and
        buffers were made for these."""
        return self._blocks

    def __repr__(self) -> str:
        return f"StreamedModel({len(self.blocks)} blocks, {self.buffers} buffers, {self.link!r})"

    @property
    def device_budget(self) -> int:
        """Bytes of device memory streaming holds, all allocated up front: ``buffers`` weight
        buffers of the largest block and two gather buffers for its trainable weights' gradients."""
        return self.buffers * self.block_bytes + self._gather.device_bytes

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes of the streamed weights, and of the gradients' landing buffer while
        some block's gradients go to ``.grad``."""
        landing = 0 if self._landing_buffer is None else self._landing_buffer.numel()
        return sum(h.numel() for h in self._host) + landing

    def remove(self) -> None:
        """Give the blocks back their own forward; the weights stay in (pinned) host memory.

        Refused while an optimizer takes the streamed blocks' gradients (close it first): the
        blocks' gradients would land in ``.grad``, where that optimizer never looks.
        """
        if self._sinks:
            raise RuntimeError(
                f"StreamedModel.remove: an optimizer still takes the gradients of "
                f"{len(self._sinks)} streamed blocks; close() it first"
            )
        self.link.synchronize()
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        if self.model.__dict__.get("zero_grad") == self._zero_grad:
            if self._outer_zero_grad is None:
                del self.model.zero_grad
            else:
                self.model.zero_grad = self._outer_zero_grad
        for hook in self._load_hooks:
            hook.remove()
        for named in self._params:
            for _, p in named:
                ownership.release(p, self)

    # ------------------------------------------------- optimizers (the ownership.Streamer protocol)

    def block_of(self, param: torch.Tensor) -> int:
        """The index of the streamed block ``param`` belongs to; ValueError for a parameter this
        model does not stream."""
        if id(param) not in self._block_of:
            raise ValueError(
                f"param: expected a parameter of a streamed block; got one of shape "
                f"{tuple(getattr(param, 'shape', ()))} that this StreamedModel does not stream"
            )
        return self._block_of[id(param)]

    def gradient_layout(self, block: int) -> tuple[list[torch.Tensor], Layout]:
        """Block ``block``'s trainable parameters and where their gradients sit in its gradient
        buffer."""
        return [self._params[block][k][1] for k in self._trainable[block]], self.gradient_layouts[
            block
        ]

    def write_host_weights(self, block: int, values) -> None:
        """Copy new values into block ``block``'s trainable parameters (its :meth:`gradient_layout`
        order), once no copy to the device reads their host memory any more."""
        self._quiesce(block)
        with torch.no_grad():
            for p, value in zip(self.gradient_layout(block)[0], values):
                p.view(-1).copy_(value.reshape(-1))

    def _quiesce(self, block: int) -> None:
        """Wait on the host for every copy that may still read block ``block``'s host weights: on a
        GPU, the compute stream's wait for a copy tells the host nothing."""
        for transfer in self._reading.pop(block, []):
            transfer.synchronize()

    def attach_sink(self, block: int, sink: GradientSink, group: int) -> None:
        """Send block ``block``'s gradients to ``sink`` (a
        :class:`~offloadlab.ownership.GradientSink`), as its group ``group``, instead of ``.grad``;
        they are laid out as :meth:`gradient_layout`.

        Gradients already landed here go to ``.grad`` (where the sink's owner finds them), and once
        every block has a sink the landing buffer is freed.
        """
        if block in self._landing:
            self._land(block)  # (waits for their copies)
        self._sinks[block] = (sink, group)
        if all(self._sinks.get(i) is not None for i, ks in enumerate(self._trainable) if ks):
            # every gradient goes to a sink: the landing buffer is not needed
            self._landing_buffer = None

    def detach_sink(self, block: int, sink: GradientSink) -> None:
        """Put block ``block``'s gradients in ``.grad`` again (``sink`` is closing)."""
        if self._sinks.get(block, (None,))[0] is sink:
            del self._sinks[block]
            if not self.link.closed:  # (a closed link streams nothing more: nothing lands)
                self._allocate_landing()  # (outside backward: an optimizer is being closed)

    def _allocate_landing(self) -> None:
        """The pinned landing buffer, if it is not there (a model with nothing to train needs
        none)."""
        if self._landing_buffer is None and any(self._trainable):
            self._landing_buffer = self.link.host_buffer(self._landing_at[-1], torch.uint8)

    def _landing_region(self, index: int) -> torch.Tensor:
        """Block ``index``'s part of the landing buffer."""
        start = self._landing_at[index]
        return self._landing_buffer[start : start + self.gradient_layouts[index].nbytes]

    # ------------------------------------------------------------------ forward

    # torch.compile: this frame and the fetch and release it calls stay out of the graph, the
    # block's own forward (called from here) is compiled (module docstring).
    @_torch_compat.eager_under_compile(_EAGER, recursive=False)
    def _forward(self, index: int, *args, **kwargs):
        block = self.blocks[index]
        buffer, fetched, hooks = self._enter(index, args, kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                swapped = _swap_in(block, fetched)
                try:
                    return type(block).forward(block, *args, **kwargs)
                finally:
                    _swap_out(swapped)
        finally:
            self._release(buffer)

    @_torch_compat.eager_under_compile(_EAGER)
    def _enter(self, index: int, args: tuple, kwargs: dict):
        """Block ``index``'s device buffer (held), its weights as the block will see them, and the
        saved-tensor hooks that keep backward from holding them."""
        if torch.jit.is_tracing() or torch.jit.is_scripting():
            raise RuntimeError(
                "StreamedModel: torch.jit cannot trace the weight fetches (they happen outside "
                "the tensors it records); use torch.compile, or trace the model before streaming"
            )
        self._check_parameters(index)
        recomputed = _torch_compat.in_backward()  # a block recomputed by activation checkpointing
        buffer = self._acquire(index, -1 if recomputed else +1)
        try:
            views = self.layouts[index].views(buffer.memory)
            track = torch.is_grad_enabled()
            fetched = {
                name: _Fetch.apply(p, view, self, index, k) if track and p.requires_grad else view
                for k, ((name, p), view) in enumerate(zip(self._params[index], views))
            }
            # autocast's copy of a trainable weight is recognised by the node it was cast from
            nodes = {
                id(t.grad_fn): k for k, t in enumerate(fetched.values()) if t.grad_fn is not None
            }
            first = (
                next(
                    (
                        a
                        for a in (*args, *kwargs.values())
                        if isinstance(a, torch.Tensor) and a.requires_grad
                    ),
                    None,
                )
                if track
                else None
            )
            # its gradient is the block's last in backward: the buffer may go then
            if first is not None:
                first.register_hook(functools.partial(self._input_gradient_done, index))
            # Hooks already in force (activation checkpointing's) keep handling everything but the
            # streamed weights: ours would otherwise hide the block's activations from them.
            outer = _torch_compat.saved_tensors_default_hooks()
            hooks = (
                functools.partial(self._pack, index, buffer, nodes, outer),
                functools.partial(self._unpack, outer),
            )
        except BaseException:
            self._release(buffer)
            raise
        return buffer, fetched, hooks

    def _check_parameters(self, index: int) -> None:
        block = self.blocks[index]
        for which, ((name, p), address) in enumerate(
            zip(self._params[index], self._addresses[index])
        ):
            try:
                current = block.get_parameter(name)
            except AttributeError:
                current = None
            if current is not p or p.data_ptr() != address:
                raise RuntimeError(
                    f"StreamedModel: the parameter {name!r} of block {self.names[index]!r} was "
                    "replaced after streaming began (load_state_dict(assign=True), `.data = …`, "
                    ".to(), or torch.func.functional_call's swap); load weights with the default "
                    "load_state_dict(), which copies into the streamed host memory, call "
                    "functional_call on a model not streamed (remove() first), or build a new "
                    "StreamedModel"
                )
            if p._backward_hooks:  # (torch keeps a leaf's register_hook hooks there)
                self._refuse_hook(index, which)

    # ------------------------------------------------------------------ device buffers

    def _acquire(self, index: int, direction: int) -> _Buffer:
        """A device buffer holding block ``index``'s weights, held until :meth:`_release`."""
        buffer = self._resident(index)
        if buffer is None:
            buffer = self._free_buffer(avoid=set())
            if buffer is None:
                held = ", ".join(repr(self.names[b.block]) for b in self._weights if b.holds)
                raise RuntimeError(
                    f"StreamedModel: block {self.names[index]!r} needs a device buffer but all "
                    f"{self.buffers} hold blocks still in use ({held}); pass more buffers"
                )
            self._fill(buffer, index)
        buffer.holds += 1
        try:  # (a Ctrl-C while the weights arrive lets the buffer go again)
            buffer.last_use = next(self._uses)
            self._prefetch(index, direction)
            for transfer in buffer.fill:
                transfer.wait()
        except BaseException:
            self._release(buffer)
            raise
        return buffer

    @_torch_compat.eager_under_compile(_EAGER)
    def _release(self, buffer: _Buffer) -> None:
        buffer.holds -= 1
        # its user's work is issued: refill once that is done
        buffer.released = self.link.mark(timed=False)

    def _resident(self, index: int) -> _Buffer | None:
        """The buffer holding block ``index``'s current weights (None if none, or if an optimizer
        has changed the host weights since they were fetched: the version counters tell)."""
        versions = self._versions(index)
        return next((b for b in self._weights if b.block == index and b.versions == versions), None)

    def _versions(self, index: int) -> tuple:
        return tuple(_torch_compat.version(p) for _, p in self._params[index])

    def _free_buffer(self, avoid: set) -> _Buffer | None:
        """An unheld buffer to fill, preferring empty ones, then ones not holding a block in
        ``avoid``, then the LRU."""
        free = [b for b in self._weights if b.holds == 0]
        if not free:
            return None

        # lowest first: empty or stale, then not needed soon, then least recent
        def keep(b: _Buffer) -> tuple:
            current = b.block is not None and b.versions == self._versions(b.block)
            return current, current and b.block in avoid, b.last_use

        return min(free, key=keep)

    def _fill(self, buffer: _Buffer, index: int) -> None:
        nbytes = self.layouts[index].nbytes
        buffer.block, buffer.versions = index, self._versions(index)
        reading = self._reading.setdefault(index, [])
        reading[:] = [t for t in reading if not t.done()]
        buffer.fill = [
            self.link.to_device(
                buffer.memory[:nbytes],
                self._host[index],
                after=buffer.released,
                label=f"{self.names[index]}",
            )
        ]
        reading += buffer.fill

    def _prefetch(self, index: int, direction: int) -> None:
        ahead = [index + k * direction for k in range(1, self.buffers)]
        ahead = [j for j in ahead if 0 <= j < len(self.blocks)]
        for j in ahead:
            if self._resident(j) is not None:
                continue
            buffer = self._free_buffer(avoid=set(ahead) | {index})
            if buffer is None or buffer.block in ahead:
                return
            self._fill(buffer, j)
            buffer.last_use = next(self._uses)

    # ------------------------------------------------------------------ backward

    def _reset_backward(self) -> None:
        self._backward_holds: dict[int, _Buffer] = {}
        # block → [(transfers, positions)] sent to its landing region
        self._landing: dict[int, list] = {}

    def _pack(self, index: int, buffer: _Buffer, nodes: dict, outer, t: torch.Tensor):
        cast = self._cast_of_weight(index, nodes, t)
        if cast is not None:
            return cast
        if (
            t.device.type != self.link.device.type
            or t.untyped_storage().data_ptr() != buffer.memory.untyped_storage().data_ptr()
        ):
            return t if outer is None else outer[0](t)
        layout = self.layouts[index]
        which = layout.which_holds(t.storage_offset() * t.element_size())
        if which is not None and layout.specs[which][1] == t.dtype:
            offset = layout.specs[which][2]
            return _SavedWeight(
                index,
                which,
                t.size(),
                t.stride(),
                t.storage_offset() - offset // t.element_size(),
                _torch_compat.version(self._params[index][which][1]),
            )
        return t if outer is None else outer[0](t)

    def _cast_of_weight(self, index: int, nodes: dict, t: torch.Tensor) -> _SavedWeight | None:
        """A tensor autocast made from one of the block's trainable weights (or a view of one),
        saved as where to fetch and cast it again: otherwise every block's cast weights would stay
        on the device until backward."""
        base = _torch_compat.view_base(t)
        source = base if base is not None else t
        fn = source.grad_fn
        if fn is None or not _torch_compat.is_cast_node(fn) or not fn.next_functions:
            return None
        which = nodes.get(id(fn.next_functions[0][0]))
        if (
            which is None
            or source.shape != self._params[index][which][1].shape
            or not source.is_contiguous()
        ):
            return None
        return _SavedWeight(
            index,
            which,
            t.size(),
            t.stride(),
            t.storage_offset() - source.storage_offset(),
            _torch_compat.version(self._params[index][which][1]),
            cast=source.dtype,
        )

    def _unpack(self, outer, saved):
        if not isinstance(saved, _SavedWeight):
            return saved if outer is None else outer[1](saved)
        index = saved.block
        name, param = self._params[index][saved.which]
        if torch.is_grad_enabled():  # a backward that builds a graph of its own
            raise RuntimeError(
                f"StreamedModel: a backward with create_graph=True (a gradient penalty, a second "
                f"derivative) reads {name!r} of block {self.names[index]!r}, whose streamed "
                "weights it cannot put in the graph it builds, so their second-order gradients "
                "would be lost: compute it on a model that is not streamed"
            )
        self._backward.arm()
        # what autograd checks for a saved tensor modified in place
        if _torch_compat.version(param) != saved.version:
            raise RuntimeError(
                f"StreamedModel: {name!r} of block {self.names[index]!r} was modified after "
                "forward saved it for backward (an update between forward and backward, or — with "
                f"an eager optimizer — backward reading a weight after its gradient was complete)"
            )
        buffer = self._backward_holds.get(index)
        if buffer is None:
            buffer = self._backward_holds[index] = self._acquire(index, -1)
        view = self.layouts[index].view(buffer.memory, saved.which)
        if saved.cast is not None:
            cast = view.to(saved.cast)
            return cast.as_strided(saved.size, saved.stride, cast.storage_offset() + saved.offset)
        return view.as_strided(saved.size, saved.stride, view.storage_offset() + saved.offset)

    def _input_gradient_done(self, index: int, _grad) -> None:
        """Everything of block ``index``'s backward has been issued: let its buffer go."""
        buffer = self._backward_holds.pop(index, None)
        if buffer is not None:
            self._release(buffer)

    def _refuse_hook(self, index: int, which: int) -> None:
        raise RuntimeError(
            f"StreamedModel: the parameter {self._params[index][which][0]!r} of block "
            f"{self.names[index]!r} has a gradient hook (register_hook); its gradient goes to the "
            "StreamedModel in one copy per block, not through autograd, so the hook could neither "
            "see, change nor stop it: remove it, and hook the block's output or read .grad after "
            "backward"
        )

    def _refuse_autograd_grad(self, index: int, which: int) -> None:
        raise RuntimeError(
            f"StreamedModel: torch.autograd.grad cannot return the gradient of "
            f"{self._params[index][which][0]!r} of block {self.names[index]!r}: a streamed "
            "weight's gradient goes to .grad (or its optimizer) through backward(), never back "
            "to autograd; call loss.backward() and read .grad, or remove() the streaming first"
        )

    def _gradient(self, index: int, which: int, grad: torch.Tensor) -> None:
        self._backward.arm()
        self._gather.add(index, self._gradient_position[index][which], grad)

    # The GradientSink its gather delivers to: the block's attached sink, or the landing buffer.

    def gradient_destination(self, index: int, positions: list) -> torch.Tensor:
        """Where block ``index``'s gradients at ``positions`` go (see
        :class:`~offloadlab.ownership.GradientSink`)."""
        attached = self._sinks.get(index)
        if attached is not None:
            sink, group = attached
            return sink.gradient_destination(group, positions)
        if any(p in sent for _, sent in self._landing.get(index, []) for p in positions):
            # a block run twice: take in the first gradients before the next land on them (the
            # one host wait inside backward left)
            self._land(index)
        return self._landing_region(index)

    def gradients_sent(self, index: int, transfers: list, positions: list) -> None:
        """Block ``index``'s gradients at ``positions`` are on their way down."""
        attached = self._sinks.get(index)
        if attached is not None:
            sink, group = attached
            sink.gradients_sent(group, transfers, positions)
        else:  # a block may go down in parts (some parameters unused): they land in disjoint places
            self._landing.setdefault(index, []).append((transfers, positions))

    @torch.no_grad()
    def _land(self, index: int) -> None:
        """Put block ``index``'s landed gradients in the parameters' ``.grad`` (no sink
        attached)."""
        parts = self._landing.pop(index, [])
        for transfers, _ in parts:
            for transfer in transfers:
                transfer.synchronize()
        landed = self.gradient_layouts[index].views(self._landing_region(index))
        for position in sorted(p for _, positions in parts for p in positions):
            p = self._params[index][self._trainable[index][position]][1]
            if p.grad is None:
                p.grad = landed[position].clone()
            else:
                p.grad.add_(landed[position])

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """The model's zero_grad, once a backward pass that raised has put its gradients in
        place."""
        self.settle()
        if self._outer_zero_grad is not None:
            self._outer_zero_grad(set_to_none)
        else:
            type(self.model).zero_grad(self.model, set_to_none)

    def settle(self) -> None:
        """Outside backward: close a pass that raised before its end (its gradients land in .grad or
        go to the optimizer, as autograd's would have, and its buffers are released)."""
        self._backward.settle()

    def _end_backward(self) -> None:
        """Send what partly used blocks gathered, release every buffer, put landed gradients in
        .grad."""
        try:
            self._gather.flush()
            for buffer in self._backward_holds.values():
                self._release(buffer)
            for index in list(self._landing):
                self._land(index)
        finally:
            self._reset_backward()

    def _check_ownership(self) -> None:
        owner: dict[int, int] = {}
        for index, named in enumerate(self._params):
            for name, p in named:
                if owner.setdefault(id(p), index) != index:
                    raise ValueError(
                        f"blocks: parameter {name!r} is shared by blocks "
                        f"{self.names[owner[id(p)]]!r} and {self.names[index]!r}; a streamed "
                        "parameter belongs to one block"
                    )
                if streamed_model_of(p) is not None:
                    raise ValueError(f"blocks: {self.names[index]!r} is already streamed")
        # (counted with repeats: a weight tied between two layers of one block is used twice inside
        # it)
        inside = collections.Counter(
            id(p)
            for block in self.blocks
            for _, p in block.named_parameters(remove_duplicate=False)
        )
        everywhere = collections.Counter(
            id(p) for _, p in self.model.named_parameters(remove_duplicate=False)
        )
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in inside and everywhere[id(p)] > inside[id(p)]:
                raise ValueError(
                    f"blocks: parameter {name!r} is also used outside the streamed blocks (tied "
                    f"weights); stream blocks whose parameters are their own"
                )
        if any(ownership.optimizer_of(p) is not None for named in self._params for _, p in named):
            raise ValueError(
                "model: its parameters already belong to a CPUOffloadAdam; build the StreamedModel "
                "first, then the optimizer"
            )
