"""Activation offload: saved tensors go to host memory as forward makes them and come back ahead
of backward, on the link's copy engines, overlapped with compute.

``with offload_activations(link):`` around a forward pass installs saved-tensor hooks. A saved
tensor of at least ``min_bytes`` on the link's device is copied down on the device→host engine
into a pinned host buffer, ordered after the kernels that made it; the device copy is let go once
the copy is done, so forward holds at most ``in_flight`` such tensors beyond what it uses. In
backward, asking for a saved tensor brings it up on the host→device engine if it is not already
there, makes the compute stream wait for it, and starts the copies up of the ``prefetch`` saved
tensors that backward will ask for next (those saved just before it): chapter 7's double buffer,
the next item arriving while the current one is used. Small tensors, tensors that are parameters
or views of them, and tensors on another device stay as they are.

``torch.autograd.graph.save_on_cpu`` does the same bookkeeping with blocking copies on the
compute stream: each copy down and up stops the GPU. A tensor saved by two nodes is two saved
tensors here, copied down twice (as autograd sees them). Pinned buffers come from a pool kept by
the context object (reused by later passes, freed with it); a buffer returns to the pool when
autograd drops its saved tensor (after backward, or when the graph is freed unused).

Units: bytes.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from . import _torch_compat
from .link import Link, check_link, open_link
from .link.cuda import shared_cuda_link
from .units import check_integer

__all__ = ["ActivationOffload", "offload_activations", "DEFAULT_MIN_BYTES"]

DEFAULT_MIN_BYTES = 1 << 20  # smaller saved tensors cost more in a copy's latency than they free
_LOOK_BACK = 64  # saved tensors searched for the next ones backward asks for


class _Saved:
    """One saved tensor: on the device as it was (``kept``), or its bytes on the host (``host``)
    with the copy down (``down``), and the copy up in flight with the device memory it lands in
    (``up``, ``arriving``); ``source`` (a weak reference) and ``version`` tell an in-place edit
    made after it was saved."""

    __slots__ = (
        "kept",
        "shape",
        "dtype",
        "host",
        "down",
        "up",
        "arriving",
        "index",
        "read",
        "taken",
        "source",
        "version",
        "__weakref__",
    )

    def __init__(self, source: torch.Tensor):
        self.kept = source.detach()
        self.source, self.version = weakref.ref(source), _torch_compat.version(source)
        self.host = self.down = self.up = self.arriving = None
        self.read = [None]  # the last copy up from ``host``, shared with the pool
        self.taken = False  # backward has asked for it


_EMULATED: list = []  # the emulated link every ActivationOffload made without one shares


def _process_link() -> Link:
    """The link of an ActivationOffload given none: one per process, as for CPUOffloadAdam (a
    GPU's shared link, else one emulated link), never closed. A link of its own, made at every
    ``with`` and closed by no one, kept its copy threads and pinned pool alive for good."""
    if torch.cuda.is_available():
        return shared_cuda_link("cuda")
    if not _EMULATED or _EMULATED[0].closed:
        _EMULATED[:] = [open_link(emulated=True)]
    return _EMULATED[0]


class ActivationOffload:
    """Saved-tensor hooks that offload activations through ``link`` (see the module docstring).

    ``min_bytes``: the smallest saved tensor offloaded. ``prefetch``: saved tensors brought up
    ahead of the one backward asks for (≥ 1). ``in_flight``: copies down forward may have
    outstanding before it waits for the oldest (each holds its device tensor until done).
    """

    def __init__(
        self,
        link: Link | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        prefetch: int = 1,
        in_flight: int = 4,
    ):
        check_link(link, optional=True)
        check_integer(min_bytes, "min_bytes", 0, expected="a whole number of bytes ≥ 0")
        check_integer(prefetch, "prefetch", expected="a positive integer")
        check_integer(in_flight, "in_flight", expected="a positive integer")
        self.link = _process_link() if link is None else link
        self.min_bytes, self.prefetch, self.in_flight = min_bytes, prefetch, in_flight
        self._saved: dict = {}  # number → weak reference, of every offloaded _Saved, in order
        self._count = 0
        # nbytes → [(pinned host buffer, [its last copy up])] free for reuse
        self._pool: dict[int, list] = {}
        self._down: list = []  # offloaded _Saved whose copy down may still read their tensor
        self._hooks = None
        self.offloaded_bytes = 0  # bytes sent down since made
        self.kept_tensors = 0  # saved tensors left on the device since made
        self.kept_bytes = 0  # their bytes (of the link's device), as saved

    # ------------------------------------------------------------------ the context

    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("offload_activations: already entered; use one `with` at a time")
        self._saved = {n: ref for n, ref in self._saved.items() if ref() is not None}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
        if exc[0] is not None:  # a forward that raised: its graph is dropped, and its buffers
            self.finish()

    def finish(self) -> None:
        """Wait for every copy down and let go of the device tensors they read."""
        for saved in self._down:
            saved.down.synchronize()
            saved.kept = None
        self._down = []

    def close(self) -> None:
        """Finish and drop the pool of pinned buffers (the link stays open: it is the caller's,
        or the process's)."""
        self.finish()
        self._pool.clear()

    # ------------------------------------------------------------------ forward: down

    def _offloaded(self, t: torch.Tensor) -> bool:
        if t.device.type != self.link.device.type or not t.is_contiguous() or t.is_sparse:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        base = _torch_compat.view_base(t)
        owner = t if base is None else base
        # a parameter (a leaf that trains) stays: its memory is the model's, not the pass's
        return not (owner.is_leaf and owner.requires_grad)

    def _pack(self, t: torch.Tensor):
        if not self._offloaded(t):
            self.kept_tensors += 1
            if t.device.type == self.link.device.type:
                self.kept_bytes += t.numel() * t.element_size()
            # (_Saved keeps it detached: a saved output would otherwise hold its own node, a
            # cycle no collector sees through; autograd gives the unpacked tensor its place again)
            return _Saved(t)
        self._settle_down()
        saved = _Saved(t)  # its device tensor held until its copy down is done
        saved.shape, saved.dtype = t.shape, t.dtype
        nbytes = t.numel() * t.element_size()
        saved.host = self._buffer(nbytes)
        saved.index, self._count = self._count, self._count + 1
        saved.down = self.link.to_host(
            saved.host,
            saved.kept.view(-1).view(torch.uint8),
            after=self.link.mark(timed=False),
            label=f"saved {saved.index}",
        )
        self._saved[saved.index] = weakref.ref(saved)
        self._down.append(saved)
        weakref.finalize(saved, self._give_back, saved.host, saved.read)
        self.offloaded_bytes += nbytes
        return saved

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of ``nbytes`` from the pool that no copy up still reads, else a new
        one."""
        free = self._pool.get(nbytes, [])
        for i, (host, read) in enumerate(free):
            if read[0] is None or read[0].done():
                del free[i]
                return host
        return self.link.host_buffer(nbytes, torch.uint8)

    def _give_back(self, host: torch.Tensor, read: list) -> None:
        self._pool.setdefault(host.numel(), []).append((host, read))

    def _settle_down(self) -> None:
        """Let go of the device tensors whose copies down are done; wait for the oldest while more
        than ``in_flight`` are outstanding."""
        still = []
        for saved in self._down:
            if saved.down.done():
                saved.kept = None
            else:
                still.append(saved)
        while len(still) >= self.in_flight:
            oldest = still.pop(0)
            oldest.down.synchronize()
            oldest.kept = None
        self._down = still

    # ------------------------------------------------------------------ backward: up

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        source = saved.source()
        now = None if source is None else _torch_compat.version(source)
        if now is not None and now != saved.version:
            raise RuntimeError(
                "offload_activations: a tensor saved for backward was modified in place after it "
                f"was saved (shape {tuple(source.shape)}, version {saved.version} then {now}); "
                "torch refuses this without offload too: edit a copy"
            )
        if saved.host is None:
            return saved.kept
        self._bring_up(saved)
        saved.up.wait()  # the compute stream waits for it, not the host
        for earlier in self._next_asked(saved):
            self._bring_up(earlier)
        tensor, saved.up, saved.arriving, saved.taken = saved.arriving, None, None, True
        return tensor.view(saved.dtype).view(saved.shape)

    def _next_asked(self, saved: _Saved) -> list:
        """The ``prefetch`` live offloaded tensors saved just before ``saved``: those backward asks
        for next."""
        found = []
        for number in range(saved.index - 1, max(-1, saved.index - _LOOK_BACK), -1):
            ref = self._saved.get(number)
            earlier = ref() if ref is not None else None
            if earlier is not None and earlier.up is None and not earlier.taken:
                found.append(earlier)
                if len(found) == self.prefetch:
                    break
        return found

    def _bring_up(self, saved: _Saved) -> None:
        """Start the copy up of ``saved`` into fresh device memory, unless it is under way."""
        if saved.up is not None:
            return
        if not saved.down.done():
            # ordered on the device after its copy down (the host need not know it is done)
            saved.down.wait()
        saved.arriving = self.link.device_buffer(saved.host.numel(), torch.uint8)
        saved.up = saved.read[0] = self.link.to_device(
            saved.arriving,
            saved.host,
            after=self.link.mark(timed=False),
            label=f"saved {saved.index}",
        )


@contextlib.contextmanager
def offload_activations(
    link: Link | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    prefetch: int = 1,
    in_flight: int = 4,
):
    """``with offload_activations(link) as offload:`` around forward; backward may run after the
    block. Yields the :class:`ActivationOffload` (its ``offloaded_bytes`` count what went down).
    """
    offload = ActivationOffload(link, min_bytes, prefetch, in_flight)
    with offload:
        yield offload
