"""The CUDA link: a real GPU's copy engines, driven through a copy stream per direction.

Exact-size pinned buffers registered with ``cudaHostRegister``, CUDA events for ordering and
timing, and a clock that keeps those times precise however long the link lives. See
:class:`CudaLink`.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import time
import warnings

import torch

from .. import _torch_compat
from .base import Link, Marker, Transfer, _nbytes, pinned_allocation_bytes, poison

__all__ = ["CudaLink", "shared_cuda_link"]

_PAGE = mmap.PAGESIZE  # bytes: what cudaHostRegister locks, a page at a time


class _Anchor:
    """A reference event of an :class:`_EventClock` and its offset from the clock's epoch.

    The offset is resolved on first use, as the previous anchor's offset plus the interval from
    it (both events done by then), summed in float64: every step is a short interval, so float32's
    rounding never grows with the link's age.
    """

    def __init__(self, event, previous: "_Anchor | None", offset: float | None = None):
        self.event, self._previous, self._offset = event, previous, offset
        self.host = 0.0  # the host's time when it was recorded (the clock's own ``now``)

    def offset(self) -> float:
        chain, anchor = [], self
        while anchor._offset is None:  # (a loop, not recursion: the chain may be long)
            chain.append(anchor)
            anchor = anchor._previous
        for anchor in reversed(chain):
            anchor.event.synchronize()
            anchor._offset = (
                anchor._previous._offset + anchor._previous.event.elapsed_time(anchor.event) / 1e3
            )
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

    Host times (:meth:`host_seconds`, for work the CPU does) are placed on the same clock from the
    newest anchor, whose host time was noted when it was recorded: the GPU's clock and the host's
    drift apart (parts per million; a millisecond an hour at 0.3 ppm), so joining them once, when
    the link is made, would slide the CPU's lanes against the copies' as the link ages.
    """

    def __init__(self, record, every: float = 1.0, now=time.perf_counter):
        self._record, self._every, self._now = record, every, now
        epoch = record()
        epoch.synchronize()
        self._latest, self._when = _Anchor(epoch, None, 0.0), now()
        self._latest.host = self._when
        self._resolved = self._latest  # the newest anchor whose offset is known, for host times
        self._lock = threading.Lock()

    def anchor(self) -> _Anchor:
        """The anchor to time an event recorded from now on against."""
        with self._lock:
            now = self._now()
            if now - self._when >= self._every:
                previous = self._latest
                self._latest, self._when = _Anchor(self._record(), previous), now
                self._latest.host = now
                if previous.event.query():
                    previous.offset()  # keep the chain short while nobody asks for times
                    self._resolved = previous
            return self._latest

    def host_seconds(self) -> float:
        """The host's present moment on the clock: the newest resolved anchor's time plus the host
        time since it was recorded."""
        anchor = self.anchor()
        if anchor is not self._resolved and anchor.event.query():
            anchor.offset()
            self._resolved = anchor
        resolved = self._resolved
        return resolved.offset() + self._now() - resolved.host


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
        self.link.traffic.blocked()
        self._finish.synchronize()
        self._tensors = None

    def wait(self, on=None) -> None:
        stream = torch.cuda.current_stream(self.link.device) if on is None else on._stream
        stream.wait_event(self._finish)

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
    Kernels behind a copy (a scatter, ``then``) run on ``kernel_stream``, so they never hold up the
    copies queued after theirs; only a copy into memory such a kernel still reads waits for it.
    The link keeps the host tensors of a copy alive until the copy is done. The consumer orders
    its compute after a copy with :meth:`Transfer.wait`; the host buffer a copy reads must not be
    rewritten until the copy is :meth:`Transfer.done`.

    Pinned buffers are ordinary host allocations registered with ``cudaHostRegister`` (no
    power-of-two rounding; portable across contexts) and unregistered when their memory is freed.
    The driver locks whole pages and refuses a range that shares a page with one already registered,
    so each buffer starts on a page of its own and its registration, counted in
    :attr:`pinned_bytes`, is its size rounded up to whole pages (less than a page more: 4 KiB on
    most x86 hosts, 64 KiB on many Arm ones). Where the driver refuses a registration (the host
    cannot lock that much memory — a container's memory limit, or too little free RAM — or the
    platform does not support it), the link clears CUDA's error state, falls back to PyTorch's
    pinned allocator, which rounds each buffer up to a power of two, and says so in a UserWarning
    naming CUDA's reason; :meth:`pinning_of` tells which way a buffer was pinned.

    Times: each transfer's duration is the interval between its own begin and finish events; its
    start, and a marker's time, are measured from a recent anchor event (see :class:`_EventClock`).
    """

    emulated = False

    def __init__(self, device="cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaLink needs a CUDA device; use EmulatedLink or open_link() on this machine"
            )
        super().__init__()
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self._streams = {"h2d": self.h2d_stream, "d2h": self.d2h_stream}
        # the scatter and other kernels behind a copy (to_device's ``then``), off the copy queue
        self.kernel_stream = torch.cuda.Stream(self.device)
        # storage address → the event after which no such kernel reads it (a staging buffer)
        self._read_by_kernels: dict[int, object] = {}
        self._in_flight: collections.deque = collections.deque()
        # copies are issued from several threads (an optimizer's worker)
        self._issuing = threading.Lock()
        self._warned_fallback = False
        clock_stream = torch.cuda.Stream(self.device)  # idle but for the clock's anchors
        self._clock = _EventClock(lambda: self._event_on(clock_stream))

    def __repr__(self) -> str:
        return f"CudaLink({torch.cuda.get_device_name(self.device)})"

    @staticmethod
    def _event_on(stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        nbytes = _nbytes(torch.empty(shape, dtype=dtype, device="meta"))
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        # The driver locks whole pages, and refuses a range that shares a page with one already
        # registered (cudaErrorHostMemoryAlreadyRegistered): two small buffers from the ordinary
        # allocator often share one. So each buffer gets pages of its own: it starts on a page
        # boundary of an allocation at most a page larger, and its last page is its own too.
        registered = -(-nbytes // _PAGE) * _PAGE
        memory = torch.empty(registered + _PAGE - 1, dtype=torch.uint8)
        start = -memory.data_ptr() % _PAGE
        pages = poison(memory[start : start + registered])  # (faulted in before they are pinned)
        buffer = pages[:nbytes].view(dtype).view(shape)
        cudart = torch.cuda.cudart()
        address = pages.data_ptr()
        # Flag 1 (cudaHostRegisterPortable): pinned for every CUDA context, as PyTorch pins.
        status = cudart.cudaHostRegister(address, registered, 1)
        if int(status) == 0:
            self._ledger.add(
                buffer, registered, "registered", release=lambda: cudart.cudaHostUnregister(address)
            )
            return buffer
        # A refused call leaves CUDA's per-thread "last error" set, and the next kernel launch on
        # this thread would report it as its own failure: clear it before going on.
        _clear_cuda_error()
        rounded = pinned_allocation_bytes(nbytes)
        if not self._warned_fallback:
            warnings.warn(
                _fallback_warning(nbytes, rounded, int(status), _cuda_error_text(cudart, status)),
                UserWarning,
                stacklevel=3,
            )
            self._warned_fallback = True
        buffer = poison(torch.empty(shape, dtype=dtype, pin_memory=True))
        self._ledger.add(buffer, rounded, "caching allocator")
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def _issue(
        self, direction, dst, src, nbytes, pinned, after, label, scatter=(), then=None
    ) -> Transfer:
        with self._issuing:
            return self._issue_locked(
                direction, dst, src, nbytes, pinned, after, label, scatter, then
            )

    def _issue_locked(
        self, direction, dst, src, nbytes, pinned, after, label, scatter, then
    ) -> Transfer:
        stream = self._streams[direction]
        if after == "compute":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        elif isinstance(after, Marker):
            stream.wait_event(after._event)
        device_side = dst if direction == "h2d" else src
        busy = self._read_by_kernels.pop(device_side.untyped_storage().data_ptr(), None)
        if busy is not None:  # a scatter may still be reading this staging buffer
            stream.wait_event(busy)
        transfer = _CudaTransfer(
            self, direction, nbytes, pinned, label, (dst, src, scatter), self._clock.anchor()
        )
        with torch.cuda.stream(stream):
            transfer._begin.record(stream)
            dst.copy_(src, non_blocking=True)
        device_side.record_stream(stream)
        if not scatter and then is None:
            transfer._finish.record(stream)
        else:
            # Kernels behind the copy run on a stream of their own: in the copy stream's queue a
            # kernel waits for free SMs (behind a saturating GEMM), and every copy after it too.
            landed = torch.cuda.Event()
            landed.record(stream)
            self.kernel_stream.wait_event(landed)
            with torch.cuda.stream(self.kernel_stream), torch.no_grad():
                if scatter:
                    _torch_compat.foreach_copy_([t for t, _ in scatter], [v for _, v in scatter])
                if then is not None:
                    then()
                transfer._finish.record(self.kernel_stream)
            device_side.record_stream(self.kernel_stream)
            for target, _ in scatter:
                target.record_stream(self.kernel_stream)
            self._read_by_kernels[device_side.untyped_storage().data_ptr()] = transfer._finish
        while self._in_flight and self._in_flight[0].done():
            self._in_flight.popleft()
        self._in_flight.append(transfer)
        return transfer

    def launch(self, fn, *args, **kwargs) -> None:
        self._check_open()
        fn(*args, **kwargs)

    def now(self) -> float:
        return self._clock.host_seconds()

    def mark(self, timed: bool = True) -> Marker:
        return self._record(torch.cuda.current_stream(self.device), timed)

    def mark_on(self, marker: Marker, timed: bool = True) -> Marker:
        return self._record(marker._stream, timed)

    def on_stream_of(self, marker: Marker):
        return torch.cuda.stream(marker._stream)

    def _record(self, stream, timed: bool = True) -> Marker:
        if not timed:  # (ordering only: an event without timing, no anchor)
            event = torch.cuda.Event()
            event.record(stream)
            return Marker(self, event=event, stream=stream, timed=False)
        anchor = self._clock.anchor()
        return Marker(self, event=self._event_on(stream), stream=stream, anchor=anchor)

    def synchronize(self) -> None:
        self.traffic.blocked()
        torch.cuda.synchronize(self.device)
        self._in_flight.clear()


_SHARED: dict = {}  # device → the CudaLink every optimizer made without link= uses
_SHARING = threading.Lock()


def shared_cuda_link(device) -> CudaLink:
    """The one CudaLink of ``device`` for whoever was given none: each link takes four streams
    from torch's pool of 32 per device, and the caching allocator keeps a pool per stream, so an
    optimizer made in every re-run of a cell must not make its own. Never closed."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _SHARING:
        if device not in _SHARED:
            _SHARED[device] = CudaLink(device)
        return _SHARED[device]


def _cuda_error_text(cudart, status) -> str:
    try:
        return str(cudart.cudaGetErrorString(status))
    except Exception:  # an old binding: the number is still said
        return "no description"


# cudaError_t values cudaHostRegister returns, with what each means for the person running it.
_REGISTER_REFUSALS = {
    2: "the host could not lock that much memory: it has less free RAM than asked, or the "
    "process's memory limit (a container's, a job's cgroup) is lower",
    712: "the memory was already registered",
    801: "this platform does not support registering ordinary host memory (some virtualised GPUs, "
    "WSL)",
}


def _fallback_warning(nbytes: int, rounded: int, code: int, text: str) -> str:
    """The warning for a refused cudaHostRegister: CUDA's own reason, what it means, what it
    costs."""
    meaning = _REGISTER_REFUSALS.get(code, "see CUDA's description")
    return (
        f"cudaHostRegister refused {nbytes} bytes with CUDA error {code} ({text}): {meaning}. "
        "Pinned buffers now come from PyTorch's caching allocator, which rounds each up to a "
        f"power of two (this one: {nbytes} → {rounded} bytes) and keeps freed blocks; "
        f"link.pinned_bytes counts the rounded sizes"
    )


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
