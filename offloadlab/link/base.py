"""The link's contract: what a host↔device link offers, whichever machine it drives.

:class:`Link` is the interface — exact-size pinned host buffers, device buffers, asynchronous
copies ordered after points of the compute stream, the compute stream itself — and
:class:`Transfer` and :class:`Marker` are what it hands out. Fresh buffers hold poison
(:data:`POISON_BYTE` in every byte). The two implementations are
:class:`~offloadlab.link.emulated.EmulatedLink` and :class:`~offloadlab.link.cuda.CudaLink`; the
package's docstring (:mod:`offloadlab.link`) states the contract in full.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from abc import ABC, abstractmethod

import torch

from .._torch_compat import in_backward, issuing_backward
from ..units import check_integer

__all__ = [
    "Link",
    "Transfer",
    "Marker",
    "Recording",
    "Traffic",
    "POISON_BYTE",
    "poison",
    "pinned_allocation_bytes",
]

# What fresh buffers hold: all-ones bytes are a NaN in fp32, fp16, bf16 and fp64 alike (exponent
# all ones, mantissa not zero), so flat byte buffers later viewed as floats are poisoned too.
POISON_BYTE = 0xFF


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill contiguous ``t`` with :data:`POISON_BYTE` in every byte (in place) and return it."""
    if t.numel():
        t.view(-1).view(torch.uint8).fill_(POISON_BYTE)
    return t


def pinned_allocation_bytes(nbytes: int) -> int:
    """Bytes PyTorch's caching pinned allocator reserves for an ``nbytes`` request.

    ``torch.empty(..., pin_memory=True)`` rounds every request up to a power of two
    (pytorch#95823): 1.1 GiB of pinned weights cost 2 GiB of page-locked memory. The links
    here register exact-size buffers instead.
    """
    check_integer(nbytes, "nbytes", 0, expected="a whole number of bytes ≥ 0")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Traffic:
    """What a link has cost since it was made: bytes and copies each way, and the times the host
    blocked on the device (a copy's or the link's ``synchronize()``, a marker's ``time``, a copy
    of pageable memory), counted apart when they ran inside a backward pass still issuing work,
    where they stall the thread that feeds the GPU, and when they ran in the callbacks that close
    a pass, once all its work is issued.

    :meth:`snapshot` reads the counters; subtract two to price a stretch of training.
    """

    FIELDS = (
        "h2d_bytes",
        "d2h_bytes",
        "h2d_copies",
        "d2h_copies",
        "syncs",
        "syncs_in_backward",
        "syncs_ending_backward",
    )

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    def copied(self, direction: str, nbytes: int, pinned: bool = True) -> None:
        """A copy was issued; one from or to pageable memory holds the host until it is done."""
        with self._lock:
            self._counts[f"{direction}_bytes"] += nbytes
            self._counts[f"{direction}_copies"] += 1
        if not pinned:
            self.blocked()

    def blocked(self) -> None:
        """The calling thread is about to wait for the device."""
        with self._lock:
            self._counts["syncs"] += 1
            if issuing_backward():
                self._counts["syncs_in_backward"] += 1
            elif in_backward():
                self._counts["syncs_ending_backward"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Marker:
    """A point in the compute stream, recorded by :meth:`Link.mark`."""

    def __init__(self, link: "Link", event=None, stream=None, anchor=None, timed: bool = True):
        self._link, self._event, self._stream, self._anchor = link, event, stream, anchor
        self.timed = timed  # (False: for ordering only; on a GPU its event keeps no time)
        self._when: float | None = None
        self._reached = threading.Event()  # the emulated compute stream sets it

    def reached(self) -> bool:
        """True once the compute stream has run everything issued before this point (never
        blocks)."""
        return self._event.query() if self._event is not None else self._reached.is_set()

    @property
    def time(self) -> float:
        """Seconds since the link was made at which compute reached this point (blocks until
        then)."""
        if not self.timed:
            raise RuntimeError(
                "Marker.time: this marker was recorded for ordering only (timed=False); record "
                "one with mark() to time a point"
            )
        if self._when is None:
            self._link.traffic.blocked()
            if self._event is not None:
                self._event.synchronize()
                self._when = self._anchor.seconds_to(self._event)
            else:
                self._reached.wait()
        return self._when

    def _reach(self, when: float) -> None:
        self._when = when
        self._reached.set()


class Transfer:
    """One copy in flight or done: ``direction`` is 'h2d' or 'd2h', ``nbytes`` its size."""

    def __init__(self, link: "Link", direction: str, nbytes: int, pinned: bool, label: str = ""):
        self.link, self.direction, self.nbytes, self.pinned = link, direction, nbytes, pinned
        self.label = label
        self.emulated = link.emulated

    # Implementations fill these in.
    def done(self) -> bool:
        """True once the bytes have landed (never blocks)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the calling thread until the bytes have landed."""
        raise NotImplementedError

    def wait(self, on: "Marker | None" = None) -> None:
        """Order the compute that follows after this copy: on the calling thread's current
        stream, or on the stream ``on`` (a :class:`Marker`) was recorded on.

        On a GPU the compute stream waits and the host goes on; on the emulated link the calling
        thread waits too, so host code that reads the data right after ``wait()`` is also safe.
        """
        raise NotImplementedError

    @property
    def start(self) -> float:
        """Seconds since the link was made at which the copy began moving bytes (blocks until
        done)."""
        raise NotImplementedError

    @property
    def end(self) -> float:
        """Seconds since the link was made at which the copy finished (blocks until done)."""
        raise NotImplementedError

    @property
    def elapsed(self) -> float:
        """Seconds the copy took (blocks until done)."""
        return self.end - self.start

    @property
    def bandwidth(self) -> float:
        """Achieved bytes per second (blocks until done). A copy too short for the link's clock to
        see (a duration of 0) has no bandwidth: that is an error, not a division by zero."""
        elapsed = self.elapsed
        if not elapsed > 0:
            raise RuntimeError(
                f"Transfer.bandwidth: the {self.direction} copy {self.label!r} of {self.nbytes} "
                f"bytes took {elapsed:.3g} s, below the resolution of the link's clock "
                f"({self.link.resolution:.3g} s); time a larger copy, or several"
            )
        return self.nbytes / elapsed


class Recording:
    """The copies a link issued inside ``with link.record() as recording:``, as a timeline."""

    def __init__(self):
        self.transfers: list[Transfer] = []

    def lanes(self) -> dict:
        """{'H2D': [...], 'D2H': [...]}: (start, end, label) of every recorded copy, in seconds."""
        lanes = {"H2D": [], "D2H": []}
        for t in self.transfers:
            lanes[t.direction.upper()].append((t.start, t.end, t.label))
        return lanes


class _PinnedLedger:
    """Pinned host memory a link handed out and that is still alive, by storage address.

    Each buffer's storage carries a finalizer that releases its pinning and removes it from the
    ledger when the last tensor using the storage is gone (the storage, not the tensor object:
    views and ``.numpy()`` arrays keep it alive). The ledger does not refer to its link, so a
    buffer outliving its link is fine.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, str]] = {}  # address → (bytes pinned, how)

    def add(self, tensor: torch.Tensor, nbytes: int, how: str, release=None) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        with self._lock:
            self._live[address] = (nbytes, how)
        weakref.finalize(storage, self._drop, address, release)

    def _drop(self, address: int, release) -> None:
        if release is not None:
            release()
        with self._lock:
            self._live.pop(address, None)

    def pinning(self, tensor: torch.Tensor) -> str | None:
        with self._lock:
            entry = (
                self._live.get(tensor.untyped_storage().data_ptr())
                if tensor.device.type == "cpu"
                else None
            )
        return None if entry is None else entry[1]

    def holds(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        if _nbytes(tensor) == 0:
            return True  # nothing to move: an empty tensor never needs staging
        with self._lock:
            return tensor.untyped_storage().data_ptr() in self._live

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(nbytes for nbytes, _ in self._live.values())


class Link(ABC):
    """Asynchronous copies between host and device memory, and the compute stream they order
    against."""

    emulated: bool
    device: torch.device

    def __init__(self):
        self._ledger = _PinnedLedger()
        self.traffic = Traffic()
        self._recordings: list[Recording] = []
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ memory

    def host_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        """An exact-size host tensor that DMA can read and write (page-locked), uninitialised: it
        holds poison (see the module docstring).

        It belongs to the caller: its pinning is released, and it is counted out of
        :attr:`pinned_bytes`, when the last tensor using its memory is dropped.
        """
        self._check_open()
        return self._allocate_pinned(shape, dtype)

    @abstractmethod
    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        """Allocate, pin and enter a host buffer in the ledger."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory from :meth:`host_buffer` that are still alive."""
        return self._ledger.nbytes

    def pinning_of(self, tensor: torch.Tensor) -> str | None:
        """How the memory of a buffer from :meth:`host_buffer` was pinned: ``"registered"``
        (``cudaHostRegister``, whole pages), ``"caching allocator"`` (PyTorch's pinned allocator,
        rounded up to a power of two) or ``"emulated"``; None for memory the link did not hand
        out."""
        return self._ledger.pinning(tensor)

    #: Seconds: the finest duration the link's clock tells apart (CUDA events: about 0.5 µs).
    resolution: float = 0.5e-6

    def device_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A tensor on the link's device, uninitialised: it holds poison (see the module
        docstring)."""
        return poison(torch.empty(shape, dtype=dtype, device=self.device))

    @abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in page-locked host memory the copy engines can use."""

    # ------------------------------------------------------------------ copies and compute

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, after="compute", label: str = "", then=None
    ) -> Transfer:
        """Start copying host tensor ``src`` into device tensor ``dst`` on the host→device engine.

        ``after`` says what the copy must wait for: ``"compute"`` (everything the compute
        stream has been given so far), a :class:`Marker`, or ``None`` (nothing). ``label``
        names the copy in timelines. ``then``, if given, is called with no argument to queue
        device work right behind the copy, in its order (it reads what landed); the transfer is
        done once that work is.
        """
        return self._copy("h2d", dst, src, after, label, then)

    def to_host(
        self, dst: torch.Tensor, src: torch.Tensor, after="compute", label: str = ""
    ) -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst`` on the device→host engine;
        ``after`` and ``label`` as in :meth:`to_device`."""
        return self._copy("d2h", dst, src, after, label)

    def to_device_scattered(
        self,
        targets,
        src: torch.Tensor,
        staging: torch.Tensor,
        after="compute",
        label: str = "",
        then=None,
    ) -> Transfer:
        """Copy flat host ``src`` into device ``staging`` in one transfer, then scatter it.

        ``targets`` is a list of (device tensor, view of ``staging``) pairs: after the bytes land,
        each view is copied into its tensor on the same engine, so the returned transfer is done
        once every target holds its bytes. Many small tensors (an optimizer bucket's weights)
        then cost one transfer's latency, not one each. ``after`` and ``label`` as in
        :meth:`to_device`; ``staging`` must not be reused before the transfer is done (copies on
        one engine run in order, so a later scattered copy through it is safe); ``then`` as in
        :meth:`to_device`, after the scatter.
        """
        self._check_open()
        self._check_after(after)
        nbytes = self._check_pair(staging, src, "h2d")
        base = staging.untyped_storage().data_ptr()
        for dst, view in targets:
            if view.untyped_storage().data_ptr() != base:
                raise ValueError("targets: expected (device tensor, view of staging) pairs")
            if (
                dst.device.type != self.device.type
                or dst.shape != view.shape
                or dst.dtype != view.dtype
            ):
                raise ValueError(
                    f"targets: expected device tensors shaped like their views of staging; "
                    f"got {tuple(dst.shape)} {dst.dtype} for {tuple(view.shape)} {view.dtype}"
                )
            if dst.requires_grad:
                raise ValueError(
                    "targets: expected tensors autograd does not track (a parameter's .data)"
                )
        transfer = self._issue(
            "h2d",
            staging,
            src,
            nbytes,
            self.is_pinned(src),
            after,
            str(label),
            list(targets),
            then,
        )
        return self._enter_copy(transfer)

    def _copy(self, direction, dst, src, after, label, then=None) -> Transfer:
        self._check_open()
        self._check_after(after)
        nbytes = self._check_pair(dst, src, direction)
        host = src if direction == "h2d" else dst
        transfer = self._issue(
            direction, dst, src, nbytes, self.is_pinned(host), after, str(label), (), then
        )
        return self._enter_copy(transfer)

    def _enter_copy(self, transfer: Transfer) -> Transfer:
        """Enter a copy just issued in the ledger and in every recording under way."""
        self.traffic.copied(transfer.direction, transfer.nbytes, pinned=transfer.pinned)
        for recording in self._recordings:
            recording.transfers.append(transfer)
        return transfer

    @abstractmethod
    def _issue(
        self, direction, dst, src, nbytes, pinned, after, label, scatter=(), then=None
    ) -> Transfer:
        """Start one checked copy (then, for to_device_scattered, the scatter of ``dst`` into
        targets, and ``then``'s device work)."""

    @abstractmethod
    def launch(self, fn, *args, **kwargs) -> None:
        """Run ``fn(*args, **kwargs)`` as work of the compute stream, asynchronously.

        On a GPU this simply calls ``fn``: the kernels it launches run asynchronously on the
        current stream. On the emulated link ``fn`` runs on the emulated device's compute thread,
        after everything launched before it — so the host runs ahead, as it does with a GPU, and
        the ordering of copies against compute is what the markers and events make it. ``fn``
        must not return anything the caller needs (it writes into tensors instead); an exception
        it raises is re-raised by the next :meth:`launch` or :meth:`synchronize`.
        """

    @abstractmethod
    def mark(self, timed: bool = True) -> Marker:
        """Record the current point of the compute stream (on a GPU: the calling thread's current
        stream); ``timed=False`` for a point only ever ordered against, never timed (on a GPU a
        cheaper event, and no anchor)."""

    @abstractmethod
    def mark_on(self, marker: Marker, timed: bool = True) -> Marker:
        """Record the current point of the stream ``marker`` was recorded on, from any thread
        (``timed`` as in :meth:`mark`).

        A worker thread's own current stream is not the one training runs on; this is how it
        orders a copy after everything training has issued so far.
        """

    @abstractmethod
    def now(self) -> float:
        """The host's current time on the link's clock (seconds since the link was made)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy and all compute issued so far have finished."""

    def on_stream_of(self, marker: Marker):
        """``with link.on_stream_of(marker):`` makes the stream ``marker`` was recorded on the
        calling thread's current stream inside the block (the emulation has one compute
        stream)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def record(self):
        """``with link.record() as recording:`` collects every copy issued inside (a
        :class:`Recording`)."""
        recording = Recording()
        self._recordings.append(recording)
        try:
            yield recording
        finally:
            self._recordings.remove(recording)

    def close(self) -> None:
        """Wait for outstanding copies and compute; afterwards no new copy can be issued.

        Pinned buffers already handed out stay valid until their owners drop them.
        """
        if self._closed:
            return
        self.synchronize()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ checks

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}: the link is closed")

    @staticmethod
    def _check_after(after) -> None:
        if not (after is None or after == "compute" or isinstance(after, Marker)):
            raise ValueError(f"after: expected 'compute', a Marker or None; got {after!r}")

    def _check_pair(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> int:
        for name, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor; got {type(t).__name__}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor")
        if dst.dtype != src.dtype:
            raise ValueError(f"dst: expected dtype {src.dtype} to match src; got {dst.dtype}")
        if dst.numel() != src.numel():
            raise ValueError(
                f"dst: expected {src.numel()} elements to match src; got {dst.numel()}"
            )
        host, device = (src, dst) if direction == "h2d" else (dst, src)
        host_name, device_name = ("src", "dst") if direction == "h2d" else ("dst", "src")
        if host.device.type != "cpu":
            raise ValueError(f"{host_name}: expected a host (cpu) tensor; got one on {host.device}")
        if device.device.type != self.device.type:
            raise ValueError(
                f"{device_name}: expected a tensor on {self.device}; got one on {device.device}"
            )
        return _nbytes(src)
