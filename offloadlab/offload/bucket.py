"""Buckets: runs of parameters whose gradients go down, whose CPU update runs and whose new
weights go up together — where each sits in the flat host buffers, and how far it has got.

A bucket's state changes only through its methods, on two threads: the training thread receives
gradients (:meth:`Bucket.receive`) and hands a step's over to the update worker
(:meth:`Bucket.hand_over`); the worker counts the update (:meth:`Bucket.advance`) and says when
it is done (:meth:`Bucket.update_done`). One step's gradients are a :class:`Received`: the
training thread fills the bucket's current one while the worker reads the one it was handed.
"""

from __future__ import annotations

import threading

from ..layout import Layout
from ..ownership import streamer_of

__all__ = ["Bucket", "Received", "make_buckets"]


class Received:
    """A bucket's gradients of one step: per parameter how many micro-batches arrived
    (``counts``) and how many of those are in the fp32 sum (``folded``), the copies bringing them
    down, and the compute-stream point after the backward that produced the newest."""

    def __init__(self, n: int, slot: int = 0):
        self.slot = slot  # which landing buffer they land in (HostState.landing)
        self.counts = [0] * n
        self.folded = [0] * n
        self.copies: list[tuple[list, list]] = []  # (transfers, positions) of each copy down
        self.marker = None

    def add(self, transfers: list, positions: list, marker) -> None:
        self.copies.append((transfers, positions))
        for k in positions:
            self.counts[k] += 1
        self.marker = marker

    def any(self) -> bool:
        return any(self.counts)

    def landed(self, copies: list | None = None) -> None:
        """Block until every copy (or those of ``copies``) has landed in host memory."""
        for transfers, _ in self.copies if copies is None else copies:
            for transfer in transfers:
                transfer.synchronize()


class Bucket:
    """Parameters that move and update together, their place in the host buffers, their progress.

    Place: ``start`` is the bucket's first element in the flat host buffers and parameter ``k``
    occupies elements ``ranges[k]``, packed as ``layout`` (the layout of the device buffers that
    gather and scatter them). ``streamed`` is the :class:`~offloadlab.ownership.Streamer` whose
    block ``block`` these parameters are (their gradients come from the streaming, their new
    weights go to its host memory), or None for parameters on the device.

    Progress: ``received`` (this step's gradients so far), ``submitted`` (handed to the worker;
    ``updated`` is set whenever no update of the bucket runs), ``steps`` (AdamW's step count per
    parameter), ``upload`` (the copy taking the newest weights up) and ``versions`` (the
    parameters' version counters when their update was announced).
    """

    def __init__(
        self, index: int, params: list, groups: list, start: int, streamed=None, block=None
    ):
        self.index, self.params, self.groups = index, params, groups
        self.layout = Layout(params, packed=True)
        itemsize = params[0].element_size()
        self.start = start
        self.ranges = [
            (start + a // itemsize, start + b // itemsize) for a, b in self.layout.ranges
        ]
        self.numel = self.layout.nbytes // itemsize
        self.streamed, self.block = streamed, block
        self.steps = [0] * len(params)
        self.received = Received(len(params))
        self._buffers = 1  # landing buffers its steps alternate between
        self.upload = None
        self.versions: list[int] = []
        self.submitted = False
        self.updated = threading.Event()
        self.updated.set()
        # set whenever the copy of the weights last sent (delayed update) is complete
        self.sent_kept = threading.Event()
        self.sent_kept.set()
        self.folding: threading.Event | None = None  # a fold queued on the worker, set when done
        self._weights: tuple = ((), [], [])  # (what they were built for, .data, flattened)
        self.generation = 0  # counts rebuilds of those: a parameter's memory was swapped

    @property
    def end(self) -> int:
        return self.start + self.numel

    def weights(self) -> tuple[list, list]:
        """(each parameter's ``.data``, the same flattened): tensors over the parameters' memory
        that autograd does not track, built once and rebuilt only when a parameter's memory or
        its layout was swapped (``p.data = …``). Building them costs a few microseconds per
        parameter, which a step of hundreds of small tensors feels; a non-contiguous ``.data``
        is flattened into a fresh copy at every call (good for reading only)."""
        key = [(p.data_ptr(), p.stride(), p.shape) for p in self.params]
        built, data, flat = self._weights
        if key != built:
            self.generation += 1
            data = [p.data for p in self.params]
            # (None: not contiguous, so not cached)
            flat = [d.view(-1) if d.is_contiguous() else None for d in data]
            self._weights = (key, data, flat)
        if any(f is None for f in flat):  # (`None in flat` would compare tensors with None)
            flat = [d.reshape(-1) if f is None else f for d, f in zip(data, flat)]
        return data, flat

    def span(self, first: int, stop: int) -> tuple[int, int]:
        """Elements of the host buffers that parameters ``first`` … ``stop - 1`` occupy."""
        return self.ranges[first][0], self.ranges[stop - 1][1]

    # ------------------------------------------------------------------ the training thread

    def receive(self, transfers: list, positions: list, marker) -> None:
        """Gradients of the parameters at ``positions`` are on their way down (``transfers``)."""
        self.received.add(transfers, positions, marker)

    def give_zero_gradient(self, k: int) -> None:
        """Parameter ``k`` takes part in this step with a zero gradient (already written to its
        place)."""
        self.received.counts[k], self.received.folded[k] = 1, 0

    def use_landing_buffers(self, count: int) -> None:
        """Alternate steps' gradients between ``count`` landing buffers."""
        self._buffers = count

    def hand_over(self) -> Received:
        """This step's gradients, for the worker; the bucket starts receiving the next step's (in
        the next landing buffer)."""
        taken = self.received
        self.received = Received(len(self.params), (taken.slot + 1) % self._buffers)
        self.submitted = True
        self.updated.clear()
        return taken

    def discard(self) -> None:
        """Forget this step's gradients (once their copies have landed: nothing writes there
        after)."""
        taken = self.received
        self.received = Received(len(self.params), taken.slot)
        taken.landed()

    def take_back(self) -> None:
        """The update handed over has been waited for: the bucket is no longer submitted."""
        self.submitted = False

    # ------------------------------------------------------------------ the update worker

    def runs(self, counts: list):
        """Consecutive parameters that one kernel call can update: each received a gradient
        (``counts`` micro-batches of it), same group, same step count, same micro-batches.
        Yields (first, last + 1) positions."""
        first = previous = None
        for k in (k for k, n in enumerate(counts) if n):
            if first is not None and (
                k != previous + 1
                or self.groups[k] is not self.groups[first]
                or self.steps[k] != self.steps[first]
                or counts[k] != counts[first]
            ):
                yield first, previous + 1
                first = None
            if first is None:
                first = k
            previous = k
        if first is not None:
            yield first, previous + 1

    def advance(self, first: int, stop: int, step: int) -> None:
        """Parameters ``first`` … ``stop - 1`` have had AdamW's update number ``step``."""
        for k in range(first, stop):
            self.steps[k] = step

    def restore_steps(self, steps: list[int]) -> None:
        """Each parameter's step count, from a state dict."""
        self.steps = list(steps)

    def weights_sent(self, upload) -> None:
        """The new weights have been written: into the parameters' host memory (``upload`` None) or
        on their way up in the copy ``upload``."""
        self.upload = upload

    def announced(self, versions: list[int]) -> None:
        """The parameters' version counters just after their update was announced."""
        self.versions = versions

    def update_done(self) -> None:
        self.updated.set()


def make_buckets(
    param_groups,
    bucket_bytes: int,
    start_index: int = 0,
    start: int = 0,
    only: set[int] | None = None,
) -> list[Bucket]:
    """Buckets of at most ``bucket_bytes`` gradient bytes over the trainable parameters of
    ``param_groups`` (those whose ids are in ``only``, if given), in the reverse of the order given
    (the order backward produces gradients for ``model.parameters()``). Streamed blocks make one
    bucket each, as they are streamed."""
    buckets, blocks_done = [], set()
    group_of = {id(p): g for g in param_groups for p in g["params"]}
    for group in param_groups:
        current, current_bytes = [], 0
        for p in reversed(
            [p for p in group["params"] if p.requires_grad and (only is None or id(p) in only)]
        ):
            streamed = streamer_of(p)
            if streamed is not None:
                block = streamed.block_of(p)
                if (id(streamed), block) in blocks_done:
                    continue
                blocks_done.add((id(streamed), block))
                params, _ = streamed.gradient_layout(block)
                if any(id(q) not in group_of for q in params):
                    raise ValueError(
                        f"params: block {streamed.names[block]!r} is streamed; give the optimizer "
                        f"all of its trainable parameters or none of them"
                    )
                bucket = Bucket(
                    start_index + len(buckets),
                    params,
                    [group_of[id(q)] for q in params],
                    start,
                    streamed,
                    block,
                )
                buckets.append(bucket)
                start = bucket.end
                continue
            nbytes = p.numel() * p.element_size()
            if current and current_bytes + nbytes > bucket_bytes:
                buckets.append(
                    Bucket(start_index + len(buckets), current, [group] * len(current), start)
                )
                start = buckets[-1].end
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            buckets.append(
                Bucket(start_index + len(buckets), current, [group] * len(current), start)
            )
            start = buckets[-1].end
    return buckets
