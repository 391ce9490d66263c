"""The transfer engine: asynchronous copies between host memory and the device, with events.

One small interface, two implementations:

- :class:`CudaLink` drives a real GPU: a dedicated copy stream, exact-size pinned host
  buffers, CUDA events for ordering and timing.
- :class:`EmulatedLink` stands in on a machine without a GPU: a background copy thread
  per direction really moves the bytes and paces each transfer to a configured bandwidth
  and latency, so transfers take real time and overlap real compute on the main thread.

Both hand out :class:`Transfer` objects (wait for one, ask whether it is done, read when it
ran) and :class:`Marker` objects (a point in the compute stream, for ordering and for
timelines). Times are seconds on the link's own clock, which starts when the link is made.
Sizes are bytes, bandwidths bytes per second.

Use :func:`open_link` to get the right one for this machine.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from abc import ABC, abstractmethod

import torch

from .units import parse_bandwidth, parse_duration

__all__ = [
    "Link",
    "CudaLink",
    "EmulatedLink",
    "Transfer",
    "Marker",
    "open_link",
    "pinned_allocation_bytes",
    "DEFAULT_EMULATED_BANDWIDTH",
    "DEFAULT_EMULATED_LATENCY",
]

# The emulated link is scaled to CPU compute, which is about a hundred times slower than a
# GPU's: 2 GB/s against a CPU's matrix products keeps the compute/transfer ratios of a
# real GPU on a PCIe link (~25 GB/s against tens of TFLOP/s) in the same regime.
DEFAULT_EMULATED_BANDWIDTH = 2e9
DEFAULT_EMULATED_LATENCY = 20e-6
_CHUNK_BYTES = 1 << 20  # the emulated link moves and paces data a MiB at a time


def pinned_allocation_bytes(nbytes: int) -> int:
    """Bytes PyTorch's caching pinned allocator reserves for an ``nbytes`` request.

    ``torch.empty(..., pin_memory=True)`` rounds every request up to a power of two
    (pytorch#95823): 1.1 GiB of pinned weights cost 2 GiB of page-locked memory. The links
    here register exact-size buffers instead.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: expected a whole number of bytes ≥ 0; got {nbytes!r}")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


class Marker:
    """A point in the compute stream, recorded by :meth:`Link.mark`."""

    def __init__(self, link: "Link", event=None, when: float | None = None):
        self._link, self._event, self._when = link, event, when

    @property
    def time(self) -> float:
        """Seconds since the link was made at which compute reached this point."""
        if self._when is None:
            self._event.synchronize()
            self._when = self._link._epoch.elapsed_time(self._event) / 1e3
        return self._when


class Transfer:
    """One copy in flight or done: ``direction`` is 'h2d' or 'd2h', ``nbytes`` its size."""

    def __init__(self, link: "Link", direction: str, nbytes: int, pinned: bool):
        self.link, self.direction, self.nbytes, self.pinned = link, direction, nbytes, pinned
        self.emulated = link.emulated

    # Implementations fill these in.
    def done(self) -> bool:
        """True once the bytes have landed (never blocks)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the calling thread until the bytes have landed."""
        raise NotImplementedError

    def wait(self) -> None:
        """Order the compute that follows after this copy (on a GPU, without blocking the host)."""
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
        """Seconds the copy took."""
        return self.end - self.start

    @property
    def bandwidth(self) -> float:
        """Achieved bytes per second."""
        return self.nbytes / self.elapsed


class Link(ABC):
    """Asynchronous copies between host and device memory."""

    emulated: bool
    device: torch.device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @abstractmethod
    def host_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        """An exact-size host tensor that DMA can read and write (pinned on a GPU).

        It stays valid, and page-locked, until the link is closed.
        """

    def device_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        """An uninitialised tensor on the link's device."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    @abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in page-locked host memory the copy engine can use."""

    @abstractmethod
    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after="compute") -> Transfer:
        """Start copying host tensor ``src`` into device tensor ``dst``.

        ``after`` says what the copy must wait for: ``"compute"`` (everything the compute
        stream has been given so far), a :class:`Marker`, or ``None`` (nothing).
        """

    @abstractmethod
    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after="compute") -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst``; ``after`` as in :meth:`to_device`."""

    @abstractmethod
    def mark(self) -> Marker:
        """Record the current point of the compute stream."""

    @abstractmethod
    def now(self) -> float:
        """The host's current time on the link's clock (seconds since the link was made)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy and all compute issued so far have finished."""

    def close(self) -> None:
        """Wait for outstanding copies and release the link's resources."""
        self.synchronize()

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
        return src.numel() * src.element_size()


# ----------------------------------------------------------------------------- emulated

class _EmulatedTransfer(Transfer):
    def __init__(self, link, direction, nbytes, pinned):
        super().__init__(link, direction, nbytes, pinned)
        self._landed = threading.Event()
        self._start = self._end = None

    def done(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        self._landed.wait()

    wait = synchronize  # compute runs on the host thread, so ordering it means waiting

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


class EmulatedLink(Link):
    """A host↔device link for machines without a GPU, paced to a bandwidth and latency.

    What it models: a copy engine per direction (full duplex) that moves bytes
    asynchronously while the main thread computes, each transfer taking
    ``latency + nbytes / bandwidth``; page-locked buffers from :meth:`host_buffer` versus
    ordinary (pageable) tensors, whose copies run synchronously on the calling thread at
    ``pageable_fraction`` of the bandwidth — as CUDA does with pageable memory.

    What it does not model: contention between the two directions for host memory or the
    PCIe root complex, DMA setup costs beyond a fixed latency, the GPU's own memory, or
    anything faster than this machine's memcpy (the pacing can only slow copies down).

    The "device" is host memory too. For the overlap to be faithful the copy threads need
    a core of their own: with ``reserve_core=True`` (the default) the link sets torch to use
    one thread fewer than there are cores while it is open, and restores the setting on
    :meth:`close`. The copies themselves run in numpy, single-threaded, outside the GIL.
    """

    emulated = True
    device = torch.device("cpu")

    def __init__(self, bandwidth=DEFAULT_EMULATED_BANDWIDTH, latency=DEFAULT_EMULATED_LATENCY,
                 pageable_fraction: float = 0.5, reserve_core: bool = True):
        self.bandwidth = parse_bandwidth(bandwidth, "bandwidth")
        self.latency = parse_duration(latency, "latency", allow_zero=True)
        if not (isinstance(pageable_fraction, (int, float)) and 0 < pageable_fraction <= 1):
            raise ValueError(f"pageable_fraction: expected a fraction in (0, 1]; got {pageable_fraction!r}")
        self.pageable_fraction = float(pageable_fraction)
        self._epoch = time.perf_counter()
        self._pinned: list[torch.Tensor] = []
        self._restore_threads = None
        if reserve_core and (os.cpu_count() or 1) > 1:
            self._restore_threads = torch.get_num_threads()
            torch.set_num_threads(max(1, min(self._restore_threads, (os.cpu_count() or 2) - 1)))
        self._queues = {d: queue.Queue() for d in ("h2d", "d2h")}
        self._workers = [threading.Thread(target=self._serve, args=(q,), daemon=True, name=f"emulated-{d}")
                         for d, q in self._queues.items()]
        for worker in self._workers:
            worker.start()
        self._closed = False

    def __repr__(self) -> str:
        return f"EmulatedLink(bandwidth={self.bandwidth:.3g} B/s, latency={self.latency:.3g} s)"

    def now(self) -> float:
        return time.perf_counter() - self._epoch

    def host_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        # Page-locked memory is resident: fault its pages in now, not during the first copy.
        buffer = torch.zeros(shape, dtype=dtype)
        self._pinned.append(buffer)
        return buffer

    def device_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)  # device memory has no first-touch page faults

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        ptr = tensor.data_ptr()
        return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in self._pinned)

    def to_device(self, dst, src, after="compute") -> Transfer:
        self._check_after(after)  # compute runs on this thread: whatever it names has happened
        return self._submit("h2d", dst, src, pinned=self.is_pinned(src))

    def to_host(self, dst, src, after="compute") -> Transfer:
        self._check_after(after)
        return self._submit("d2h", dst, src, pinned=self.is_pinned(dst))

    def mark(self) -> Marker:
        return Marker(self, when=self.now())

    def synchronize(self) -> None:
        for q in self._queues.values():
            q.join()

    def close(self) -> None:
        if self._closed:
            return
        self.synchronize()
        for q in self._queues.values():
            q.put(None)
        for worker in self._workers:
            worker.join()
        if self._restore_threads is not None:
            torch.set_num_threads(self._restore_threads)
        self._pinned.clear()
        self._closed = True

    def _submit(self, direction, dst, src, pinned) -> Transfer:
        if self._closed:
            raise RuntimeError("the link is closed")
        nbytes = self._check_pair(dst, src, direction)
        transfer = _EmulatedTransfer(self, direction, nbytes, pinned)
        if pinned:
            self._queues[direction].put((transfer, dst, src))
        else:
            # Pageable memory: the driver stages the copy, the caller waits, and it runs slower.
            self._queues[direction].join()
            self._copy(transfer, dst, src, self.bandwidth * self.pageable_fraction)
        return transfer

    def _serve(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                transfer, dst, src = job
                self._copy(transfer, dst, src, self.bandwidth)
            finally:
                jobs.task_done()

    def _copy(self, transfer: _EmulatedTransfer, dst, src, bandwidth: float) -> None:
        started = time.perf_counter()
        transfer._start = started - self._epoch
        _sleep_until(started + self.latency)
        out, data = _as_bytes(dst), _as_bytes(src)
        for offset in range(0, data.size, _CHUNK_BYTES):
            end = min(offset + _CHUNK_BYTES, data.size)
            out[offset:end] = data[offset:end]
            _sleep_until(started + self.latency + end / bandwidth)
        transfer._end = time.perf_counter() - self._epoch
        transfer._landed.set()


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


# ----------------------------------------------------------------------------- CUDA

class _CudaTransfer(Transfer):
    def __init__(self, link, direction, nbytes, pinned):
        super().__init__(link, direction, nbytes, pinned)
        self._begin = torch.cuda.Event(enable_timing=True)
        self._finish = torch.cuda.Event(enable_timing=True)

    def done(self) -> bool:
        return self._finish.query()

    def synchronize(self) -> None:
        self._finish.synchronize()

    def wait(self) -> None:
        torch.cuda.current_stream(self.link.device).wait_event(self._finish)

    @property
    def start(self) -> float:
        self._finish.synchronize()
        return self.link._epoch.elapsed_time(self._begin) / 1e3

    @property
    def end(self) -> float:
        self._finish.synchronize()
        return self.link._epoch.elapsed_time(self._finish) / 1e3


class CudaLink(Link):
    """A real host↔GPU link: a dedicated copy stream, exact-size pinned buffers, CUDA events.

    Stream discipline: every copy runs on the link's copy stream, after what ``after``
    names (by default all compute issued so far), and device tensors it touches are
    recorded on the copy stream so the caching allocator does not hand their memory out
    while the copy still uses it. The consumer orders its compute after a copy with
    :meth:`Transfer.wait`; the host buffer a copy reads must not be rewritten until the
    copy is :meth:`Transfer.done`.
    """

    emulated = False

    def __init__(self, device="cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaLink needs a CUDA device; use EmulatedLink or open_link() on this machine")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copy_stream = torch.cuda.Stream(self.device)
        self._registered: list[torch.Tensor] = []
        self._epoch = torch.cuda.Event(enable_timing=True)
        self._epoch.record(torch.cuda.current_stream(self.device))
        self._epoch.synchronize()
        self._epoch_host = time.perf_counter()  # host time of the epoch, to place CPU work on the same clock

    def __repr__(self) -> str:
        return f"CudaLink({torch.cuda.get_device_name(self.device)})"

    def host_buffer(self, shape, dtype=torch.float32) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes:
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if int(status) != 0:  # registration refused (e.g. ulimit -l): the allocator's rounded block
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            self._registered.append(buffer)
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def to_device(self, dst, src, after="compute") -> Transfer:
        nbytes = self._check_pair(dst, src, "h2d")
        return self._issue("h2d", dst, src, nbytes, self.is_pinned(src), after, device_tensor=dst)

    def to_host(self, dst, src, after="compute") -> Transfer:
        nbytes = self._check_pair(dst, src, "d2h")
        return self._issue("d2h", dst, src, nbytes, self.is_pinned(dst), after, device_tensor=src)

    def _issue(self, direction, dst, src, nbytes, pinned, after, device_tensor) -> Transfer:
        self._check_after(after)
        if after == "compute":
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        elif isinstance(after, Marker):
            self.copy_stream.wait_event(after._event)
        transfer = _CudaTransfer(self, direction, nbytes, pinned)
        with torch.cuda.stream(self.copy_stream):
            transfer._begin.record()
            dst.copy_(src, non_blocking=True)
            transfer._finish.record()
        device_tensor.record_stream(self.copy_stream)
        return transfer

    def now(self) -> float:
        return time.perf_counter() - self._epoch_host

    def mark(self) -> Marker:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return Marker(self, event=event)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()
        cudart = torch.cuda.cudart()
        for buffer in self._registered:
            cudart.cudaHostUnregister(buffer.data_ptr())
        self._registered.clear()


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
