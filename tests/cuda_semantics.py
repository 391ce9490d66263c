"""What the host may assume about copies under CUDA's rules, enforced on top of the emulated link.

On a GPU, ``Transfer.wait()`` orders the calling thread's *compute stream* after a copy and tells
the host nothing; only ``synchronize()`` orders the host. The host knows a copy has finished only
after ``synchronize()`` (the copy's, or the link's), a ``done()`` that said True, or a
compute-stream point it synchronised with (a :class:`~offloadlab.link.Marker`'s ``time``, or
``reached()`` saying True) — of that copy, of a later copy on the same engine (engines run in
order), or of a copy or point ordered after compute that had waited for it on the same stream. The
plain emulation makes ``wait()`` block the host, so host code that relies on ``wait()`` can never
fail there.

:class:`CudaOrderLink` keeps the ledger of what the host knows under those rules and makes the
emulation behave accordingly:

- **device→host**: the copy's bytes reach the host buffer only once the host knows the copy is
  done; until then the buffer holds poison (NaN), so a host read after ``wait()`` alone (or after
  nothing) reads NaN, as it would read stale or half-written bytes on a GPU. The host writing into
  such a buffer before then is a violation (the copy would land over it).
- **host→device**: the host writing a copy's source before it knows the copy is done is a
  violation (on a GPU the copy may still be reading it) when the copy's bytes are used — waited
  for or synchronised with; one whose bytes are never used (a prefetch discarded because its
  weights changed) may be torn harmlessly. The sources are compared with what they held at
  issue when the host learns of the copy.
- **several compute streams**: each thread has a current stream (``"default"``, as every CUDA
  thread starts on the device's default stream; :meth:`CudaOrderLink.compute_stream` switches
  it, as ``torch.cuda.stream(...)`` does), ``after="compute"`` and ``wait()`` concern the calling
  thread's current stream, and a marker's stream is the one it was recorded on
  (:meth:`~offloadlab.link.Link.mark_on` records on it from any thread). A wait on one stream
  tells nothing about copies ordered after another.

- **pinning inside backward**: allocating pinned memory (``cudaHostRegister`` on a GPU) while a
  backward pass runs is a violation: it stalls the autograd thread; buffers are pinned when made.
- **host synchronisation inside backward**: a copy's or the link's ``synchronize()``, or a
  marker's ``time``, on the thread running a backward pass is a violation: on a GPU the autograd
  thread would stop launching kernels until the device caught up. The callbacks that close a pass
  run once every kernel of it is issued, and may wait.

:meth:`CudaOrderLink.check` raises an AssertionError listing every violation; the test fixtures
call it when a test ends. :meth:`unknown_reads_of` and :meth:`unknown_writes_into` answer, at a
point a test chooses, which copies may still read or write a tensor's memory.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from offloadlab.link import POISON_BYTE, EmulatedLink, Marker, poison
from offloadlab._torch_compat import issuing_backward

__all__ = ["CudaOrderLink"]


class _CheckedMarker(Marker):
    """A marker whose synchronising reads tell the host what the point proves finished."""

    def reached(self) -> bool:
        reached = super().reached()
        if reached:
            self._link._learn_point(self._stream_name, self._position)
        return reached

    @property
    def time(self) -> float:
        self._link._check_not_in_backward("a marker's time")
        when = Marker.time.fget(self)
        self._link._learn_point(self._stream_name, self._position)
        return when


class CudaOrderLink(EmulatedLink):
    """An EmulatedLink that holds the host to what CUDA lets it know (see the module docstring)."""

    def __init__(self, *args, backward_syncs: str | None = None, **kwargs):
        """``backward_syncs``: why host synchronisations inside backward are allowed here (None:
        they are violations)."""
        super().__init__(*args, **kwargs)
        self._backward_syncs_allowed = backward_syncs
        self._ledger_lock = threading.RLock()
        self._positions: dict[str, itertools.count] = {}  # per compute stream: order of its events
        self._waits: list = []  # (stream, position, transfer) of each Transfer.wait()
        self._last = {"h2d": None, "d2h": None}
        self._issued = itertools.count()
        self._current = threading.local()
        self.transfers: list = []
        self.violations: list[str] = []

    # ------------------------------------------------------------------ streams

    @contextlib.contextmanager
    def compute_stream(self, name: str):
        """Make ``name`` the calling thread's current compute stream inside the block."""
        previous = self._stream()
        self._current.name = name
        try:
            yield
        finally:
            self._current.name = previous

    def on_stream_of(self, marker):
        return self.compute_stream(getattr(marker, "_stream_name", "default"))

    def _stream(self) -> str:
        return getattr(self._current, "name", "default")

    def _next(self, stream: str) -> int:
        with self._ledger_lock:
            return next(self._positions.setdefault(stream, itertools.count()))

    def _checked(self, marker: Marker, stream: str) -> Marker:
        marker.__class__ = _CheckedMarker
        marker._stream_name, marker._position = stream, self._next(stream)
        return marker

    def mark(self, timed=True):
        return self._checked(super().mark(timed), self._stream())

    def mark_on(self, marker, timed=True):
        return self._checked(
            super().mark_on(marker, timed), getattr(marker, "_stream_name", "default")
        )

    # ------------------------------------------------------------------ memory

    def _allocate_pinned(self, shape, dtype):
        # on a GPU: cudaHostRegister on the autograd thread
        if torch._C._current_graph_task_id() != -1:
            self.violations.append(
                f"pinned memory ({tuple(shape) if not isinstance(shape, int) else shape}, "
                f"{dtype}) was allocated inside a backward pass"
            )
        return super()._allocate_pinned(shape, dtype)

    # ------------------------------------------------------------------ copies

    def _issue(self, direction, dst, src, nbytes, pinned, after, label, scatter=(), then=None):
        if after == "compute":
            stream, position = self._stream(), None
        elif isinstance(after, Marker):
            stream, position = (
                getattr(after, "_stream_name", "default"),
                getattr(after, "_position", -1),
            )
        else:
            stream, position = None, -1
        with self._ledger_lock:
            if position is None:
                position = self._next(stream)
            host = src if direction == "h2d" else dst
            host_range = (host.data_ptr(), host.data_ptr() + host.numel() * host.element_size())
            if direction == "d2h":
                for other in self.unknown_writes_into(host):
                    self.violations.append(
                        f"copy {label!r} down into memory that the earlier copy {other.label!r} "
                        f"may still be writing"
                    )
            # where the engine really writes
            target = torch.empty_like(dst) if direction == "d2h" else dst
            # What finishing this copy proves finished before it: the copies its stream waited for
            # before the point it is ordered after, and the previous copy on its engine.
            before = [t for s, p, t in self._waits if s == stream and p < position]
            if self._last[direction] is not None:
                before.append(self._last[direction])
            # what the engine really reads: copies down it is ordered after have landed for it
            read = self._landed_for_device(src, before) if direction == "h2d" else src
        transfer = super()._issue(
            direction, target, read, nbytes, pinned, after, label, scatter, then
        )
        with self._ledger_lock:
            transfer._host_range, transfer._known, transfer._order = (
                host_range,
                False,
                next(self._issued),
            )
            transfer._used = transfer._torn = False
            transfer._before = before
            self._last[direction] = transfer
            if direction == "d2h":
                # copies up that this one cannot start before have read their sources by then: a
                # source it lands in (state going back where it came from) was intact if it is now
                self._settle_reads_before(transfer)
                transfer._shadow, transfer._destination = target, dst
                poison(dst)  # what the host sees there until it knows the copy is done
            else:
                # (what the source holds once the host knows of the copies down it read)
                transfer._snapshot, transfer._source = read.clone(), src
            self.transfers.append(transfer)
        real_synchronize, real_done = transfer.synchronize, transfer.done

        def synchronize():
            self._check_not_in_backward(f"synchronize() of copy {label!r}")
            real_synchronize()
            transfer._used = True
            self._learn([transfer])

        def done():
            finished = real_done()
            if finished:
                self._learn([transfer])
            return finished

        def wait(on=None):  # CUDA: a compute stream waits (the calling thread's current one, or
            # ``on``'s); the host learns nothing
            transfer._block()  # (the emulated device's data must still be right)
            transfer._used = True
            stream = self._stream() if on is None else getattr(on, "_stream_name", "default")
            with self._ledger_lock:
                self._waits.append((stream, self._next(stream), transfer))

        transfer.synchronize, transfer.done, transfer.wait = synchronize, done, wait
        if not pinned:  # pageable memory: CUDA copies it synchronously, so the caller knows
            self._learn([transfer])
        return transfer

    def _landed_for_device(self, src, before) -> torch.Tensor:
        """``src`` as a copy up ordered after ``before`` reads it: with the bytes of the copies
        down into it that it is ordered after, which the host may not know of yet (they are in
        their shadows) but the device does."""
        start = src.data_ptr()
        end = start + src.numel() * src.element_size()
        landed = [
            t
            for t in _unknown_before(before)
            if t.direction == "d2h" and t._host_range[0] < end and start < t._host_range[1]
        ]
        if not landed:
            return src
        read = src.clone()
        for t in sorted(landed, key=lambda t: t._order):
            t._landed.wait()
            first, last = max(start, t._host_range[0]), min(end, t._host_range[1])
            _bytes(read)[first - start : last - start].copy_(
                _bytes(t._shadow)[first - t._host_range[0] : last - t._host_range[0]]
            )
        return read

    def _settle_reads_before(self, transfer) -> None:
        """Check now the sources of the unknown copies up that ``transfer`` is ordered after (they
        are done before it starts, on a GPU, whatever the host knows)."""
        for t in _unknown_before(transfer._before):
            if t.direction == "h2d" and t._source is not None:
                t._torn = not torch.equal(_bytes(t._source), _bytes(t._snapshot))
                t._source = t._snapshot = None

    def synchronize(self):
        self._check_not_in_backward("link.synchronize()")
        super().synchronize()
        self._learn(list(self.transfers))

    def _check_not_in_backward(self, what: str) -> None:
        # on a GPU: the autograd thread stops feeding the device until the wait is over
        if issuing_backward() and self._backward_syncs_allowed is None:
            self.violations.append(f"{what}: a host synchronisation inside a backward pass")

    # ------------------------------------------------------------------ what the host knows

    def _learn_point(self, stream: str, position: int) -> None:
        """The host has synchronised with a point of ``stream``: the copies it waited for before
        are done."""
        with self._ledger_lock:
            waited = [t for s, p, t in self._waits if s == stream and p < position]
        self._learn(waited)

    def _learn(self, transfers) -> None:
        """The host now knows ``transfers`` have finished, and so everything they prove finished:
        device→host bytes become visible, host→device sources are checked for host writes."""
        with self._ledger_lock:
            learned, stack = [], list(transfers)
            while stack:
                t = stack.pop()
                if not t._known:
                    t._known = True
                    learned.append(t)
                    stack += t._before
            for t in sorted(learned, key=lambda t: t._order):
                if t.direction == "d2h":
                    destination, shadow = t._destination, t._shadow
                    if not _holds_poison(destination):
                        self.violations.append(
                            f"the host wrote into the destination of copy {t.label!r} "
                            f"before it knew the copy was done"
                        )
                    t._landed.wait()  # (the emulated engine has written the shadow by now)
                    destination.copy_(shadow)
                    t._destination = t._shadow = None
                elif t._source is not None:
                    t._torn = not torch.equal(_bytes(t._source), _bytes(t._snapshot))
                    t._source = t._snapshot = None

    def unknown_reads_of(self, tensor) -> list:
        """Copies to the device that read ``tensor``'s memory and the host cannot know have
        finished."""
        return self._unknown(tensor, "h2d")

    def unknown_writes_into(self, tensor) -> list:
        """Copies to the host that write ``tensor``'s memory and the host cannot know have
        finished."""
        return self._unknown(tensor, "d2h")

    def _unknown(self, tensor, direction: str) -> list:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        with self._ledger_lock:
            return [
                t
                for t in self.transfers
                if t.direction == direction
                and not t._known
                and t._host_range[0] < end
                and start < t._host_range[1]
            ]

    def check(self) -> None:
        """Raise an AssertionError listing every violation of CUDA's ordering rules seen so far."""
        self.synchronize()  # (what the host learns at the end is checked too)
        violations = self.violations + [
            f"the host wrote the source of copy {t.label!r} before it knew the copy was done, and "
            f"the copy's bytes were used (on a GPU the copy may still have been reading it)"
            for t in self.transfers
            if t._torn and t._used
        ]
        if violations:
            listed = "\n  ".join(dict.fromkeys(violations))
            raise AssertionError(
                f"{len(violations)} violations of CUDA's ordering rules:\n  {listed}"
            )


def _unknown_before(before: list) -> list:
    """The copies the host does not know are done among ``before`` and everything they are
    ordered after: done on the device before what follows them."""
    stack, seen, found = list(before), set(), []
    while stack:
        t = stack.pop()
        if id(t) in seen or t._known:
            continue
        seen.add(id(t))
        stack += t._before
        found.append(t)
    return found


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _holds_poison(t: torch.Tensor) -> bool:
    return bool((_bytes(t) == POISON_BYTE).all())
