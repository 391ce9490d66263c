"""The transfer engine: asynchronous copies between host memory and the device, with events.

One small interface, two implementations:

- :class:`CudaLink` drives a real GPU: one copy stream per direction (a GPU has a copy engine
  for each, and PCIe is full duplex), exact-size pinned host buffers, CUDA events for ordering
  and timing.
- :class:`EmulatedLink` stands in on a machine without a GPU. It emulates the whole contract,
  not only the timing: a paced copy engine per direction that really moves the bytes, and an
  asynchronous compute stream (:meth:`Link.launch`), so a copy ordered after a point of the
  compute stream really waits for it, and a copy that is *not* ordered after the compute that
  still reads its buffer really overwrites it — as on a GPU.

Both hand out :class:`Transfer` objects (wait for one, ask whether it is done, read when it
ran) and :class:`Marker` objects (a point in the compute stream, for ordering and timelines).

The ordering contract, identical on both links:

- ``to_device``/``to_host(dst, src, after=...)`` starts a copy on its direction's engine once the
  compute stream has reached ``after``: ``"compute"`` (everything issued to it so far), a
  :class:`Marker`, or ``None`` (nothing). Copies in one direction run in the order issued; the two
  directions run at the same time.
- :meth:`Transfer.wait` orders the compute that follows after the copy.
- Pinned host memory from :meth:`Link.host_buffer` belongs to whoever asked for it: it is
  unpinned and freed when the last tensor using it is dropped. :attr:`Link.pinned_bytes` says
  how much is alive. The link keeps the tensors of a copy alive until the copy has finished.
- Fresh buffers from :meth:`Link.host_buffer` and :meth:`Link.device_buffer` hold poison
  (:data:`POISON_BYTE` in every byte: NaN in every floating-point format, -1 or the maximum in
  integers), on both links: on a GPU an uninitialised buffer holds whatever was there before, so
  a read before the first write must show on a CPU too, not pass because memory came zeroed.

Times are seconds on the link's own clock, which starts when the link is made. Sizes are
bytes, bandwidths bytes per second. Use :func:`open_link` to get the right link for this machine.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
import warnings
import weakref
from abc import ABC, abstractmethod

import torch

from . import cores
from .units import parse_bandwidth, parse_duration

__all__ = [
    "Link",
    "CudaLink",
    "EmulatedLink",
    "Transfer",
    "Marker",
    "Recording",
    "open_link",
    "pinned_allocation_bytes",
    "DEFAULT_EMULATED_BANDWIDTH",
    "DEFAULT_EMULATED_LATENCY",
    "POISON_BYTE",
    "poison",
]

# The emulated link is scaled to CPU compute, which is about a hundred times slower than a
# GPU's: 2 GB/s against a CPU's matrix products keeps the compute/transfer ratios of a
# real GPU on a PCIe link (~25 GB/s against tens of TFLOP/s) in the same regime.
DEFAULT_EMULATED_BANDWIDTH = 2e9
DEFAULT_EMULATED_LATENCY = 20e-6
_CHUNK_BYTES = 1 << 20  # the emulated engines move and pace data a MiB at a time
_DIRECTIONS = ("h2d", "d2h")
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
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: expected a whole number of bytes ≥ 0; got {nbytes!r}")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Marker:
    """A point in the compute stream, recorded by :meth:`Link.mark`."""

    def __init__(self, link: "Link", event=None, stream=None, anchor=None):
        self._link, self._event, self._stream, self._anchor = link, event, stream, anchor
        self._when: float | None = None
        self._reached = threading.Event()  # the emulated compute stream sets it

    def reached(self) -> bool:
        """True once the compute stream has run everything issued before this point (never blocks)."""
        return self._event.query() if self._event is not None else self._reached.is_set()

    @property
    def time(self) -> float:
        """Seconds since the link was made at which compute reached this point (blocks until then)."""
        if self._when is None:
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

    def wait(self) -> None:
        """Order the compute that follows after this copy.

        On a GPU the compute stream waits and the host goes on; on the emulated link the calling
        thread waits too, so host code that reads the data right after ``wait()`` is also safe.
        """
        raise NotImplementedError

    @property
    def start(self) -> float:
        """Seconds since the link was made at which the copy began moving bytes (blocks until done)."""
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
            raise RuntimeError(f"Transfer.bandwidth: the {self.direction} copy {self.label!r} of {self.nbytes} bytes "
                               f"took {elapsed:.3g} s, below the resolution of the link's clock "
                               f"({self.link.resolution:.3g} s); time a larger copy, or several")
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
            entry = self._live.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
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
    """Asynchronous copies between host and device memory, and the compute stream they order against."""

    emulated: bool
    device: torch.device

    def __init__(self):
        self._ledger = _PinnedLedger()
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
        (``cudaHostRegister``, exact size), ``"caching allocator"`` (PyTorch's pinned allocator,
        rounded up to a power of two) or ``"emulated"``; None for memory the link did not hand out."""
        return self._ledger.pinning(tensor)

    #: Seconds: the finest duration the link's clock tells apart (CUDA events: about 0.5 µs).
    resolution: float = 0.5e-6

    def device_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A tensor on the link's device, uninitialised: it holds poison (see the module docstring)."""
        return poison(torch.empty(shape, dtype=dtype, device=self.device))

    @abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in page-locked host memory the copy engines can use."""

    # ------------------------------------------------------------------ copies and compute

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after="compute", label: str = "") -> Transfer:
        """Start copying host tensor ``src`` into device tensor ``dst`` on the host→device engine.

        ``after`` says what the copy must wait for: ``"compute"`` (everything the compute
        stream has been given so far), a :class:`Marker`, or ``None`` (nothing). ``label``
        names the copy in timelines.
        """
        return self._copy("h2d", dst, src, after, label)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after="compute", label: str = "") -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst`` on the device→host engine;
        ``after`` and ``label`` as in :meth:`to_device`."""
        return self._copy("d2h", dst, src, after, label)

    def to_device_scattered(self, targets, src: torch.Tensor, staging: torch.Tensor, after="compute",
                            label: str = "") -> Transfer:
        """Copy flat host ``src`` into device ``staging`` in one transfer, then scatter it.

        ``targets`` is a list of (device tensor, view of ``staging``) pairs: after the bytes land,
        each view is copied into its tensor on the same engine, so the returned transfer is done
        once every target holds its bytes. Many small tensors (an optimizer bucket's weights)
        then cost one transfer's latency, not one each. ``after`` and ``label`` as in
        :meth:`to_device`; ``staging`` must not be reused before the transfer is done (copies on
        one engine run in order, so a later scattered copy through it is safe).
        """
        self._check_open()
        self._check_after(after)
        nbytes = self._check_pair(staging, src, "h2d")
        base = staging.untyped_storage().data_ptr()
        for dst, view in targets:
            if view.untyped_storage().data_ptr() != base:
                raise ValueError("targets: expected (device tensor, view of staging) pairs")
            if dst.device.type != self.device.type or dst.shape != view.shape or dst.dtype != view.dtype:
                raise ValueError(f"targets: expected device tensors shaped like their views of staging; "
                                 f"got {tuple(dst.shape)} {dst.dtype} for {tuple(view.shape)} {view.dtype}")
            if dst.requires_grad:
                raise ValueError("targets: expected tensors autograd does not track (a parameter's .data)")
        transfer = self._issue("h2d", staging, src, nbytes, self.is_pinned(src), after, str(label), list(targets))
        for recording in self._recordings:
            recording.transfers.append(transfer)
        return transfer

    def _copy(self, direction, dst, src, after, label) -> Transfer:
        self._check_open()
        self._check_after(after)
        nbytes = self._check_pair(dst, src, direction)
        host = src if direction == "h2d" else dst
        transfer = self._issue(direction, dst, src, nbytes, self.is_pinned(host), after, str(label))
        for recording in self._recordings:
            recording.transfers.append(transfer)
        return transfer

    @abstractmethod
    def _issue(self, direction, dst, src, nbytes, pinned, after, label, scatter=()) -> Transfer:
        """Start one checked copy (then, for to_device_scattered, the scatter of ``dst`` into targets)."""

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
    def mark(self) -> Marker:
        """Record the current point of the compute stream (on a GPU: the calling thread's current stream)."""

    @abstractmethod
    def mark_on(self, marker: Marker) -> Marker:
        """Record the current point of the stream ``marker`` was recorded on, from any thread.

        A worker thread's own current stream is not the one training runs on; this is how it
        orders a copy after everything training has issued so far.
        """

    @abstractmethod
    def now(self) -> float:
        """The host's current time on the link's clock (seconds since the link was made)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy and all compute issued so far have finished."""

    @contextlib.contextmanager
    def record(self):
        """``with link.record() as recording:`` collects every copy issued inside (a :class:`Recording`)."""
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
            raise ValueError(f"dst: expected {src.numel()} elements to match src; got {dst.numel()}")
        host, device = (src, dst) if direction == "h2d" else (dst, src)
        host_name, device_name = ("src", "dst") if direction == "h2d" else ("dst", "src")
        if host.device.type != "cpu":
            raise ValueError(f"{host_name}: expected a host (cpu) tensor; got one on {host.device}")
        if device.device.type != self.device.type:
            raise ValueError(f"{device_name}: expected a tensor on {self.device}; got one on {device.device}")
        return _nbytes(src)


# ----------------------------------------------------------------------------- emulated

class _EmulatedTransfer(Transfer):
    def __init__(self, link, direction, nbytes, pinned, label):
        super().__init__(link, direction, nbytes, pinned, label)
        self._landed = threading.Event()
        self._start = self._end = None
        self._error: BaseException | None = None  # a copy that failed on its engine: raised to whoever waits

    def done(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        self._landed.wait()
        if self._error is not None:
            raise RuntimeError(f"the {self.direction} copy {self.label!r} failed: {self._error!r}") from self._error

    wait = synchronize  # see Transfer.wait: the emulation makes the host wait as well

    @property
    def start(self) -> float:
        self.synchronize()
        return self._start

    @property
    def end(self) -> float:
        self.synchronize()
        return self._end


def _as_bytes(t: torch.Tensor):
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _EmulatedStream:
    """An in-order queue of work served by one thread: the emulated compute stream or a copy engine.

    Work items are callables; :meth:`mark` returns a :class:`Marker` reached when every item put
    before it has run (at once, if the stream is idle).
    """

    def __init__(self, link: "EmulatedLink", name: str):
        self._link = weakref.ref(link)  # its thread must not keep a dropped link alive
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def put(self, job) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    def mark(self) -> Marker:
        link = self._link()  # (alive: its caller holds it)
        marker = Marker(link)
        with self._lock:
            if self._pending == 0:
                marker._reach(link.now())
                return marker
            self._pending += 1
        def reach():
            marker._when = marker._link.now()
            return marker._reached.set  # (set once the job is let go: see _serve)

        self._jobs.put(reach)
        return marker

    def drain(self) -> None:
        """Block until every item put so far has run."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def stop(self) -> None:
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:  # (a finalizer may run on this very thread)
            self._thread.join()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            announce = None
            try:
                announce = job()  # a job may return what tells its waiters it is done
            except BaseException as error:  # kept for the host, like a CUDA error
                if self.error is None:
                    self.error = error
            finally:
                # Let go of the job (its tensors, and the link it names) before anyone hears it is done:
                # a waiter that then drops the link must hold its last reference, so that the link's
                # finalizer runs on the waiter's thread, where torch's thread count is restored.
                job = None
                if announce is not None:
                    announce()
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()


class _CoreReservation:
    """One core kept free of torch's threads while any emulated link is open (a count, so that
    links opened and closed in any order — a notebook cell run twice — leave torch as they found it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = None

    def take(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._restore = torch.get_num_threads()
                torch.set_num_threads(max(1, min(self._restore, cores.worker_threads())))
            self._holders += 1

    def give_back(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                torch.set_num_threads(self._restore)


_CORE_RESERVATION = _CoreReservation()


class EmulatedLink(Link):
    """A host↔device link for machines without a GPU, paced to a bandwidth and latency.

    What it models: a copy engine per direction (full duplex) that moves bytes asynchronously,
    each transfer taking ``latency + nbytes / bandwidth`` and starting only once the compute
    stream has reached what it is ordered after; an asynchronous compute stream for work given
    to :meth:`launch` (the "device"), so host code runs ahead of compute as it does with a GPU;
    page-locked buffers from :meth:`host_buffer` versus ordinary (pageable) tensors, whose copies
    run synchronously on the calling thread at ``pageable_fraction`` of the bandwidth — as CUDA
    does with pageable memory.

    Compute that the host runs directly (not through :meth:`launch`), such as an ordinary
    forward pass on the CPU, is finished by the time the host records a marker after it, so it
    is ordered like compute on a GPU that the host synchronised with.

    What it does not model: contention between the two directions for host memory or the PCIe
    root complex, DMA setup costs beyond a fixed latency, the GPU's own memory, or anything
    faster than this machine's memcpy (the pacing can only slow copies down).

    The "device" is host memory too. For the overlap to be faithful the copy threads need a
    core of their own: with ``reserve_core=True`` (the default) the link sets torch to use one
    thread fewer than there are cores while it is open, and restores the setting on
    :meth:`close`. The copies themselves run in numpy, single-threaded, outside the GIL.
    """

    emulated = True
    device = torch.device("cpu")
    resolution = time.get_clock_info("perf_counter").resolution

    def __init__(self, bandwidth=DEFAULT_EMULATED_BANDWIDTH, latency=DEFAULT_EMULATED_LATENCY,
                 pageable_fraction: float = 0.5, reserve_core: bool = True):
        super().__init__()
        self.bandwidth = parse_bandwidth(bandwidth, "bandwidth")
        self.latency = parse_duration(latency, "latency", allow_zero=True)
        if not (isinstance(pageable_fraction, (int, float)) and not isinstance(pageable_fraction, bool)
                and 0 < pageable_fraction <= 1):
            raise ValueError(f"pageable_fraction: expected a fraction in (0, 1]; got {pageable_fraction!r}")
        self.pageable_fraction = float(pageable_fraction)
        self._epoch = time.perf_counter()
        self._reserving = reserve_core and cores.usable_cores() > 1
        if self._reserving:
            _CORE_RESERVATION.take()
        self._compute = _EmulatedStream(self, "emulated-compute")
        self._engines = {d: _EmulatedStream(self, f"emulated-{d}") for d in _DIRECTIONS}
        # Dropped without close() (a notebook cell run again): its threads stop and its core comes back.
        self._shutdown = weakref.finalize(self, _shut_down, [self._compute, *self._engines.values()],
                                          self._reserving)

    def __repr__(self) -> str:
        return f"EmulatedLink(bandwidth={self.bandwidth:.3g} B/s, latency={self.latency:.3g} s)"

    def now(self) -> float:
        return time.perf_counter() - self._epoch

    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        # Page-locked memory is resident: the poison faults its pages in now, not during the first copy.
        buffer = poison(torch.empty(shape, dtype=dtype))
        if _nbytes(buffer):
            self._ledger.add(buffer, _nbytes(buffer), "emulated")
        return buffer

    def device_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        return poison(torch.empty(shape, dtype=dtype))  # (the poison also faults the pages in now)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._ledger.holds(tensor)

    def launch(self, fn, *args, **kwargs) -> None:
        self._check_open()
        self._raise_compute_error()
        threads = torch.get_num_threads()
        self._compute.put(lambda: _with_threads(threads, fn, *args, **kwargs))

    def mark(self) -> Marker:
        return self._compute.mark()

    def mark_on(self, marker: Marker) -> Marker:
        return self._compute.mark()  # the emulation has one compute stream

    def synchronize(self) -> None:
        self._compute.drain()
        for engine in self._engines.values():
            engine.drain()
        self._raise_compute_error()

    def _raise_compute_error(self) -> None:
        error, self._compute.error = self._compute.error, None
        if error is not None:
            raise RuntimeError(f"work launched on the emulated compute stream failed: {error!r}") from error

    def close(self) -> None:
        if self._closed:
            return
        try:
            super().close()
        finally:
            self._closed = True
            self._shutdown()

    def _issue(self, direction, dst, src, nbytes, pinned, after, label, scatter=()) -> Transfer:
        transfer = _EmulatedTransfer(self, direction, nbytes, pinned, label)
        marker = self._compute.mark() if after == "compute" else after
        engine = self._engines[direction]
        if pinned:
            engine.put(lambda: self._move(transfer, dst, src, self.bandwidth, marker, scatter))
        else:
            # Pageable memory: the driver stages the copy, the caller waits, and it runs slower.
            engine.drain()
            self._move(transfer, dst, src, self.bandwidth * self.pageable_fraction, marker, scatter)()
        return transfer

    def _move(self, transfer: _EmulatedTransfer, dst, src, bandwidth: float, after: Marker | None,
              scatter=()):
        """Run one copy; returns what announces it (landed or failed) to its waiters."""
        try:
            self._paced_copy(transfer, dst, src, bandwidth, after, scatter)
        except BaseException as error:  # the copy's waiter gets it (as a failed CUDA copy raises)
            transfer._error = error
            transfer._start = transfer._end = self.now()
            if not isinstance(error, Exception):
                transfer._landed.set()
                raise  # Ctrl-C while the caller's own thread copies (pageable memory): the caller stops
        return transfer._landed.set

    def _paced_copy(self, transfer: _EmulatedTransfer, dst, src, bandwidth: float, after: Marker | None,
                    scatter) -> None:
        if after is not None:
            after._reached.wait()  # the engine does not start before the compute it is ordered after
        started = time.perf_counter()
        transfer._start = started - self._epoch
        _sleep_until(started + self.latency)
        out, data = _as_bytes(dst), _as_bytes(src)
        for offset in range(0, data.size, _CHUNK_BYTES):
            end = min(offset + _CHUNK_BYTES, data.size)
            out[offset:end] = data[offset:end]
            _sleep_until(started + self.latency + end / bandwidth)
        with torch.no_grad():  # device-to-device copies: at device memory speed, not paced
            for target, view in scatter:
                target.copy_(view)
        transfer._end = time.perf_counter() - self._epoch


def _shut_down(streams: list, reserving: bool) -> None:
    """Stop an emulated link's threads and give its core back (once: close() or the finalizer)."""
    for stream in streams:
        stream.stop()
    if reserving:
        _CORE_RESERVATION.give_back()


def _with_threads(threads: int, fn, *args, **kwargs) -> None:
    """Run ``fn`` with the intra-op thread count the launching thread had: OpenMP keeps one per
    thread, and a new thread's is every core — which would leave none to the copy engines."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    fn(*args, **kwargs)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


# ----------------------------------------------------------------------------- CUDA

class _Anchor:
    """A reference event of an :class:`_EventClock` and its offset from the clock's epoch.

    The offset is resolved on first use, as the previous anchor's offset plus the interval from
    it (both events done by then), summed in float64: every step is a short interval, so float32's
    rounding never grows with the link's age.
    """

    def __init__(self, event, previous: "_Anchor | None", offset: float | None = None):
        self.event, self._previous, self._offset = event, previous, offset

    def offset(self) -> float:
        chain, anchor = [], self
        while anchor._offset is None:  # (a loop, not recursion: the chain may be long)
            chain.append(anchor)
            anchor = anchor._previous
        for anchor in reversed(chain):
            anchor.event.synchronize()
            anchor._offset = anchor._previous._offset + anchor._previous.event.elapsed_time(anchor.event) / 1e3
            anchor._previous = None  # resolved: the older anchors are no longer needed
        return self._offset

    def seconds_to(self, event) -> float:
        """Seconds from the clock's epoch to ``event`` (which must be done)."""
        return self.offset() + self.event.elapsed_time(event) / 1e3


class _EventClock:
    """Times of CUDA events in seconds since an epoch, precise however long the link lives.

    ``cudaEventElapsedTime`` answers in float32 milliseconds: measured from one epoch event, its
    step is 7.8 µs two minutes on and a quarter of a millisecond after an hour, so an 8 µs copy
    would read 0 or 15.6 µs and timelines would be quantised. Instead every event is timed from an
    *anchor* recorded just before it: a new anchor is recorded, on an idle stream of the clock's
    own (so it completes at once), when the last is ``every`` seconds old in host time.
    ``record()`` records and returns an event on that stream.
    """

    def __init__(self, record, every: float = 1.0, now=time.perf_counter):
        self._record, self._every, self._now = record, every, now
        epoch = record()
        epoch.synchronize()
        self._latest, self._when = _Anchor(epoch, None, 0.0), now()
        self._lock = threading.Lock()

    def anchor(self) -> _Anchor:
        """The anchor to time an event recorded from now on against."""
        with self._lock:
            now = self._now()
            if now - self._when >= self._every:
                previous = self._latest
                self._latest, self._when = _Anchor(self._record(), previous), now
                if previous.event.query():
                    previous.offset()  # keep the chain short while nobody asks for times
            return self._latest


class _CudaTransfer(Transfer):
    def __init__(self, link, direction, nbytes, pinned, label, tensors, anchor: _Anchor):
        super().__init__(link, direction, nbytes, pinned, label)
        self._begin = torch.cuda.Event(enable_timing=True)
        self._finish = torch.cuda.Event(enable_timing=True)
        self._anchor = anchor
        self._tensors = tensors  # kept alive until the copy is known to be done

    def done(self) -> bool:
        if self._finish.query():
            self._tensors = None
            return True
        return False

    def synchronize(self) -> None:
        self._finish.synchronize()
        self._tensors = None

    def wait(self) -> None:
        torch.cuda.current_stream(self.link.device).wait_event(self._finish)

    @property
    def elapsed(self) -> float:
        """Seconds from the copy's begin event to its finish event, measured between the two."""
        self.synchronize()
        return self._begin.elapsed_time(self._finish) / 1e3

    @property
    def start(self) -> float:
        self.synchronize()
        return self._anchor.seconds_to(self._begin)

    @property
    def end(self) -> float:
        return self.start + self.elapsed


class CudaLink(Link):
    """A real host↔GPU link: a copy stream per direction, exact-size pinned buffers, CUDA events.

    Stream discipline: a copy runs on its direction's copy stream (``h2d_stream`` or
    ``d2h_stream``; both persistent, so the caching allocator keeps one pool per stream, not one
    per step), after what ``after`` names, and device tensors it touches are recorded on that
    stream so the caching allocator does not hand their memory out while the copy still uses it.
    The link keeps the host tensors of a copy alive until the copy is done. The consumer orders
    its compute after a copy with :meth:`Transfer.wait`; the host buffer a copy reads must not be
    rewritten until the copy is :meth:`Transfer.done`.

    Pinned buffers are ordinary host allocations registered with ``cudaHostRegister`` (exact
    size, no power-of-two rounding; portable across contexts) and unregistered when their memory
    is freed. Where the driver refuses a registration (the host cannot lock that much memory — a
    container's memory limit, or too little free RAM — or the platform does not support it), the
    link clears CUDA's error state, falls back to PyTorch's pinned allocator, which rounds each
    buffer up to a power of two, and says so in a UserWarning naming CUDA's reason;
    :meth:`pinning_of` tells which way a buffer was pinned.

    Times: each transfer's duration is the interval between its own begin and finish events; its
    start, and a marker's time, are measured from a recent anchor event (see :class:`_EventClock`).
    """

    emulated = False

    def __init__(self, device="cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaLink needs a CUDA device; use EmulatedLink or open_link() on this machine")
        super().__init__()
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._streams = {"h2d": self.h2d_stream, "d2h": self.d2h_stream}
        self._in_flight: collections.deque = collections.deque()
        self._issuing = threading.Lock()  # copies are issued from several threads (an optimizer's worker)
        self._warned_fallback = False
        clock_stream = torch.cuda.Stream(self.device)  # idle but for the clock's anchors
        self._clock = _EventClock(lambda: self._event_on(clock_stream))
        self._epoch_host = time.perf_counter()  # host time of the epoch, to place CPU work on the same clock

    def __repr__(self) -> str:
        return f"CudaLink({torch.cuda.get_device_name(self.device)})"

    @staticmethod
    def _event_on(stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        buffer = poison(torch.empty(shape, dtype=dtype))  # (its pages faulted in before they are pinned)
        nbytes = _nbytes(buffer)
        if nbytes == 0:
            return buffer
        cudart = torch.cuda.cudart()
        address = buffer.data_ptr()
        # Flag 1 (cudaHostRegisterPortable): pinned for every CUDA context, as PyTorch pins.
        status = cudart.cudaHostRegister(address, nbytes, 1)
        if int(status) == 0:
            self._ledger.add(buffer, nbytes, "registered", release=lambda: cudart.cudaHostUnregister(address))
            return buffer
        # A refused call leaves CUDA's per-thread "last error" set, and the next kernel launch on this
        # thread would report it as its own failure: clear it before going on.
        _clear_cuda_error()
        rounded = pinned_allocation_bytes(nbytes)
        if not self._warned_fallback:
            warnings.warn(_fallback_warning(nbytes, rounded, int(status), _cuda_error_text(cudart, status)),
                          UserWarning, stacklevel=3)
            self._warned_fallback = True
        buffer = poison(torch.empty(shape, dtype=dtype, pin_memory=True))
        self._ledger.add(buffer, rounded, "caching allocator")
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def _issue(self, direction, dst, src, nbytes, pinned, after, label, scatter=()) -> Transfer:
        with self._issuing:
            return self._issue_locked(direction, dst, src, nbytes, pinned, after, label, scatter)

    def _issue_locked(self, direction, dst, src, nbytes, pinned, after, label, scatter) -> Transfer:
        stream = self._streams[direction]
        if after == "compute":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        elif isinstance(after, Marker):
            stream.wait_event(after._event)
        transfer = _CudaTransfer(self, direction, nbytes, pinned, label, (dst, src, scatter), self._clock.anchor())
        with torch.cuda.stream(stream):
            transfer._begin.record(stream)
            dst.copy_(src, non_blocking=True)
            if scatter:
                with torch.no_grad():
                    torch._foreach_copy_([t for t, _ in scatter], [v for _, v in scatter])
            transfer._finish.record(stream)
        (dst if direction == "h2d" else src).record_stream(stream)
        for target, _ in scatter:
            target.record_stream(stream)
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft()
        self._in_flight.append(transfer)
        return transfer

    def launch(self, fn, *args, **kwargs) -> None:
        self._check_open()
        fn(*args, **kwargs)

    def now(self) -> float:
        return time.perf_counter() - self._epoch_host

    def mark(self) -> Marker:
        return self._record(torch.cuda.current_stream(self.device))

    def mark_on(self, marker: Marker) -> Marker:
        return self._record(marker._stream)

    def _record(self, stream) -> Marker:
        anchor = self._clock.anchor()
        return Marker(self, event=self._event_on(stream), stream=stream, anchor=anchor)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self._in_flight.clear()


def _cuda_error_text(cudart, status) -> str:
    try:
        return str(cudart.cudaGetErrorString(status))
    except Exception:  # an old binding: the number is still said
        return "no description"


# cudaError_t values cudaHostRegister returns, with what each means for the person running it.
_REGISTER_REFUSALS = {
    2: "the host could not lock that much memory: it has less free RAM than asked, or the process's "
       "memory limit (a container's, a job's cgroup) is lower",
    712: "the memory was already registered",
    801: "this platform does not support registering ordinary host memory (some virtualised GPUs, WSL)",
}


def _fallback_warning(nbytes: int, rounded: int, code: int, text: str) -> str:
    """The warning for a refused cudaHostRegister: CUDA's own reason, what it means, what it costs."""
    meaning = _REGISTER_REFUSALS.get(code, "see CUDA's description")
    return (f"cudaHostRegister refused {nbytes} bytes with CUDA error {code} ({text}): {meaning}. Pinned buffers "
            f"now come from PyTorch's caching allocator, which rounds each up to a power of two (this one: "
            f"{nbytes} → {rounded} bytes) and keeps freed blocks; link.pinned_bytes counts the rounded sizes")


def _clear_cuda_error() -> None:
    """Reset CUDA's per-thread last error after a refused registration (best effort: through the
    CUDA runtime library torch has loaded, found by its usual names)."""
    import ctypes

    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            # RTLD_NOLOAD: only a library already in the process (torch's), never a second copy
            ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LOCAL).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def open_link(emulated: bool | None = None, **emulation) -> Link:
    """A :class:`CudaLink` when a CUDA GPU is present, else an :class:`EmulatedLink`.

    ``emulated=True`` forces the emulation (keyword arguments go to :class:`EmulatedLink`).
    """
    if emulated is None:
        emulated = not torch.cuda.is_available()
    if emulated:
        return EmulatedLink(**emulation)
    if emulation:
        raise ValueError(f"{next(iter(emulation))}: only the emulated link takes emulation settings")
    return CudaLink()

