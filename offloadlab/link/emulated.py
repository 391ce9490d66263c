"""The emulated link: the whole contract of a GPU link, on a machine without one.

A paced copy engine per direction that really moves the bytes, and an asynchronous compute
stream (:meth:`~offloadlab.link.base.Link.launch`), so a copy ordered after a point of the
compute stream really waits for it, and a copy that is *not* ordered after the compute that still
reads its buffer really overwrites it — as on a GPU. See :class:`EmulatedLink`.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from .. import _torch_compat, cores
from ..units import is_number, parse_bandwidth, parse_duration, plain_scalar
from .base import Link, Marker, Transfer, _nbytes, poison

__all__ = ["EmulatedLink", "DEFAULT_EMULATED_BANDWIDTH", "DEFAULT_EMULATED_LATENCY"]

# The emulated link is scaled to CPU compute, which is about a hundred times slower than a
# GPU's: 2 GB/s against a CPU's matrix products keeps the compute/transfer ratios of a
# real GPU on a PCIe link (~25 GB/s against tens of TFLOP/s) in the same regime.
DEFAULT_EMULATED_BANDWIDTH = 2e9
DEFAULT_EMULATED_LATENCY = 20e-6
_CHUNK_BYTES = 1 << 20  # the emulated engines move and pace data a MiB at a time
_DIRECTIONS = ("h2d", "d2h")


class _EmulatedTransfer(Transfer):
    def __init__(self, link, direction, nbytes, pinned, label):
        super().__init__(link, direction, nbytes, pinned, label)
        self._landed = threading.Event()
        self._start = self._end = None
        # a copy that failed on its engine: raised to whoever waits
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        self.link.traffic.blocked()
        self._block()

    def wait(self, on=None) -> None:
        """See Transfer.wait: the emulation (one compute stream) makes the host wait as well
        (uncounted: on a GPU only the compute stream would)."""
        self._block()

    def _block(self) -> None:
        self._landed.wait()
        if self._error is not None:
            raise RuntimeError(
                f"the {self.direction} copy {self.label!r} failed: {self._error!r}"
            ) from self._error

    @property
    def start(self) -> float:
        self._block()
        return self._start

    @property
    def end(self) -> float:
        self._block()
        return self._end


def _as_bytes(t: torch.Tensor):
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _EmulatedStream:
    """An in-order queue of work served by one thread: the emulated compute stream or a copy engine.

    Work items are callables; :meth:`mark` returns a :class:`Marker` reached when every item put
    before it has run (at once, if the stream is idle). A KeyboardInterrupt can land between any
    two lines of the caller: the count of pending items may then stay one too high (the stream
    never looks idle again, and marks take the queue), never too low, and :meth:`drain` waits for
    a mark, not for the count.
    """

    def __init__(self, link: "EmulatedLink", name: str):
        self._link = weakref.ref(link)  # its thread must not keep a dropped link alive
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (put and get are single C calls)
        self._lock = threading.Lock()
        self._pending = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def put(self, job) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    def mark(self, timed: bool = True) -> Marker:
        link = self._link()  # alive while its caller holds it
        if link is None:  # collected with its caller (a generator finalised at interpreter exit)
            marker = Marker(None, timed=False)
            marker._reached.set()
            return marker
        marker = Marker(link, timed=timed)
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
        self.mark(timed=False)._reached.wait()

    def stop(self) -> None:
        self._jobs.put(None)
        # (a finalizer may run on this very thread)
        if threading.current_thread() is not self._thread:
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
                # Let go of the job (its tensors, and the link it names) before anyone hears it is
                # done: a waiter that then drops the link must hold its last reference, so that the
                # link's finalizer runs on the waiter's thread, where torch's thread count is
                # restored.
                job = None
                if announce is not None:
                    announce()
                with self._lock:
                    self._pending -= 1


class _CoreReservation:
    """One core kept free of torch's threads while any emulated link is open (a count, so that
    links opened and closed in any order — a notebook cell run twice — leave torch as they found
    it)."""

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

    def __init__(
        self,
        bandwidth=DEFAULT_EMULATED_BANDWIDTH,
        latency=DEFAULT_EMULATED_LATENCY,
        pageable_fraction: float = 0.5,
        reserve_core: bool = True,
    ):
        super().__init__()
        self._bandwidth = parse_bandwidth(bandwidth, "bandwidth")
        self._latency = parse_duration(latency, "latency", allow_zero=True)
        pageable_fraction = plain_scalar(pageable_fraction)  # (numpy's numbers as Python's)
        if not isinstance(reserve_core, bool):  # ("no" is true to Python)
            raise ValueError(f"reserve_core: expected True or False; got {reserve_core!r}")
        if not (is_number(pageable_fraction) and 0 < pageable_fraction <= 1):
            raise ValueError(
                f"pageable_fraction: expected a fraction in (0, 1]; got {pageable_fraction!r}"
            )
        self.pageable_fraction = float(pageable_fraction)
        self._epoch = time.perf_counter()
        self._reserving = reserve_core and cores.usable_cores() > 1
        if self._reserving:
            _CORE_RESERVATION.take()
        self._compute = _EmulatedStream(self, "emulated-compute")
        self._engines = {d: _EmulatedStream(self, f"emulated-{d}") for d in _DIRECTIONS}
        # Dropped without close() (a notebook cell run again): its threads stop and its core comes
        # back.
        self._shutdown = weakref.finalize(
            self, _shut_down, [self._compute, *self._engines.values()], self._reserving
        )

    @property
    def bandwidth(self) -> float:
        """Bytes/s each pinned copy is paced to."""
        return self._bandwidth

    @property
    def latency(self) -> float:
        """Seconds each copy waits before its first byte."""
        return self._latency

    def __repr__(self) -> str:
        return f"EmulatedLink(bandwidth={self._bandwidth:.3g} B/s, latency={self._latency:.3g} s)"

    def now(self) -> float:
        return time.perf_counter() - self._epoch

    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        # Page-locked memory is resident: the poison faults its pages in now, not during the first
        # copy.
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

    def mark(self, timed: bool = True) -> Marker:
        return self._compute.mark(timed)

    def mark_on(self, marker: Marker, timed: bool = True) -> Marker:
        return self._compute.mark(timed)  # the emulation has one compute stream

    def synchronize(self) -> None:
        self.traffic.blocked()
        self._compute.drain()
        for engine in self._engines.values():
            engine.drain()
        self._raise_compute_error()

    def _raise_compute_error(self) -> None:
        error, self._compute.error = self._compute.error, None
        if error is not None:
            raise RuntimeError(
                f"work launched on the emulated compute stream failed: {error!r}"
            ) from error

    def close(self) -> None:
        if self._closed:
            return
        try:
            super().close()
        finally:
            self._closed = True
            self._shutdown()

    def _issue(
        self, direction, dst, src, nbytes, pinned, after, label, scatter=(), then=None
    ) -> Transfer:
        transfer = _EmulatedTransfer(self, direction, nbytes, pinned, label)
        marker = self._compute.mark() if after == "compute" else after
        engine = self._engines[direction]
        if pinned:
            engine.put(
                lambda: self._move(transfer, dst, src, self._bandwidth, marker, scatter, then)
            )
        else:
            # Pageable memory: the driver stages the copy, the caller waits, and it runs slower.
            engine.drain()
            self._move(
                transfer, dst, src, self._bandwidth * self.pageable_fraction, marker, scatter, then
            )()
        return transfer

    def _move(
        self,
        transfer: _EmulatedTransfer,
        dst,
        src,
        bandwidth: float,
        after: Marker | None,
        scatter=(),
        then=None,
    ):
        """Run one copy; returns what announces it (landed or failed) to its waiters."""
        try:
            self._paced_copy(transfer, dst, src, bandwidth, after, scatter, then)
        except BaseException as error:  # the copy's waiter gets it (as a failed CUDA copy raises)
            transfer._error = error
            transfer._start = transfer._end = self.now()
            if not isinstance(error, Exception):
                transfer._landed.set()
                # Ctrl-C while the caller's own thread copies (pageable memory): the caller stops
                raise
        return transfer._landed.set

    def _paced_copy(
        self,
        transfer: _EmulatedTransfer,
        dst,
        src,
        bandwidth: float,
        after: Marker | None,
        scatter,
        then,
    ) -> None:
        if after is not None:
            # the engine does not start before the compute it is ordered after
            after._reached.wait()
        started = time.perf_counter()
        transfer._start = started - self._epoch
        _sleep_until(started + self._latency)
        out, data = _as_bytes(dst), _as_bytes(src)
        for offset in range(0, data.size, _CHUNK_BYTES):
            end = min(offset + _CHUNK_BYTES, data.size)
            out[offset:end] = data[offset:end]
            _sleep_until(started + self._latency + end / bandwidth)
        if scatter:  # device-to-device copies: at device memory speed, not paced
            with torch.no_grad():
                _torch_compat.foreach_copy_([t for t, _ in scatter], [v for _, v in scatter])
        if then is not None:  # (device work behind the copy, on its engine)
            with torch.no_grad():
                then()
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
