"""How CPUOffloadAdam's gradients reach host memory, bucket by bucket, and how micro-batches add up.

A post-accumulate-grad hook on every device parameter hands its gradient, the moment autograd
has finished it, to a :class:`~offloadlab.gather.GradientGather`, which copies it into the
bucket's place in a device gather buffer and frees the parameter's ``.grad``; a complete bucket
goes down in one copy into its range of the host gradient buffer. Streamed parameters'
gradients come the same way from their :class:`~offloadlab.streaming.StreamedModel`, which this
intake serves as a sink. At the end of each backward pass, buckets that got only some of their
gradients (unused parameters) are sent as they are.

Several backward passes before a step (gradient accumulation) need nothing declared: before a
newer gradient lands over an older one, the older one is folded into an fp32 sum, and the update
at :meth:`step` uses the sum. Declaring ``accumulation_steps`` lets a bucket's update start as
soon as its last micro-batch's gradients are in (the eager overlap).
"""

from __future__ import annotations

import torch

from ..gather import GradientGather
from ..link import Link
from ..prefetch import Layout
from .host_state import Bucket, HostState

__all__ = ["GradientIntake"]


class GradientIntake:
    """Hooks, gather buffers and micro-batch folding for ``buckets``.

    ``ready(bucket)`` is called when a bucket has all ``eager_after`` micro-batches' gradients
    (only when ``eager_after`` is set); ``record(lane, interval, label)`` receives each copy for
    the timeline; ``usable()`` says whether gradients should still be taken.
    """

    def __init__(self, link: Link, host: HostState, eager_after: int | None, ready, record, usable):
        self.link, self.host, self.eager_after = link, host, eager_after
        self._ready, self._record, self._usable = ready, record, usable
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}   # id(param) → (bucket, position)
        self._sinks: dict[int, _BlockSink] = {}  # streamed buckets' sinks, by bucket
        self._hooks: list = []
        self._gather = GradientGather(link, [], self._destination, self._arrived,
                                      names=lambda i: f"bucket {i}")
        self._armed: int | None = None  # the backward pass (graph task) whose end is awaited
        self.add(host.buckets)

    def add(self, buckets: list[Bucket]) -> None:
        """Take in the gradients of new buckets (hooks for device ones, a sink for streamed ones)."""
        self._gather.extend([Layout([]) if b.streamed is not None else b.layout for b in buckets])
        for bucket in buckets:
            self.buckets.append(bucket)
            for k, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, k)
            if bucket.streamed is not None:
                self._sinks[bucket.index] = sink = _BlockSink(self, bucket)
                bucket.streamed.attach_sink(bucket.block, sink)
            else:
                self._hooks += [p.register_post_accumulate_grad_hook(self._on_gradient) for p in bucket.params]

    def take_existing(self, params) -> None:
        """Take in gradients that reached these parameters' ``.grad`` without passing through their
        hooks — left by a backward run before the optimizer was made, assigned by hand, or from
        ``torch.autograd.grad`` — as the hooks would have: torch.optim.AdamW uses them too."""
        for p in params:
            if p.grad is None or id(p) not in self._where:
                continue
            bucket, k = self._where[id(p)]
            if p.grad.is_sparse:
                raise ValueError("params: CPUOffloadAdam does not support sparse gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(f"CPUOffloadAdam: a parameter of shape {tuple(p.shape)} has a gradient of "
                                   f"shape {tuple(p.grad.shape)}")
            self._check_not_submitted(bucket)
            if bucket.streamed is None:
                self._gather.add(bucket.index, k, p.grad)
            else:  # a streamed parameter's .grad is a host tensor: it goes straight into its place
                s, e = bucket.ranges[k]
                self._destination(bucket.index, [k])
                with torch.no_grad():
                    self.host.grads[s:e].copy_(p.grad.reshape(-1))
                self._arrived(bucket.index, [], [k])
            p.grad = None
        self._gather.flush()

    def take_loose(self) -> None:
        """Before a step or a clip: take in every gradient that sits in a managed ``.grad`` (see
        :meth:`take_existing`; gradients from backward never stay there)."""
        loose = [p for bucket in self.buckets for p in bucket.params if p.grad is not None]
        if loose:
            self.take_existing(loose)

    def close(self) -> None:
        """Remove the hooks and leave the streamed blocks' gradients to their StreamedModel again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for bucket in self.buckets:
            if bucket.streamed is not None:
                bucket.streamed.detach_sink(bucket.block, self._sinks[bucket.index])

    # ------------------------------------------------------------------ arrivals

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._usable():
            return  # a failed or closed optimizer leaves gradients where autograd put them
        bucket, k = self._where[id(param)]
        grad = param.grad
        if grad.is_sparse:
            raise ValueError("params: CPUOffloadAdam does not support sparse gradients")
        self._check_not_submitted(bucket)
        self._arm()
        self._gather.add(bucket.index, k, grad)
        param.grad = None  # its copy into the gather buffer is ordered on the compute stream

    def _check_not_submitted(self, bucket: Bucket) -> None:
        if bucket.submitted and self.eager_after is not None:
            raise RuntimeError(f"CPUOffloadAdam: more backward passes than accumulation_steps={self.eager_after} "
                               f"before step(); declare the number of micro-batches you run, or leave "
                               f"accumulation_steps unset")

    def _arm(self) -> None:
        """Have the end of this backward pass call :meth:`_end_backward` (once per pass)."""
        task = torch._C._current_graph_task_id()
        if self._armed is not None and self._armed != task:
            self._end_backward()  # an earlier pass raised before its end: close it now
        if self._armed is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._armed = task

    def _end_backward(self) -> None:
        self._armed = None
        self._gather.flush()  # buckets some of whose parameters got no gradient go down as they are

    def settle(self) -> None:
        """Outside backward: close a pass that raised before its end (so its gradients go down)."""
        if self._armed is not None and torch._C._current_graph_task_id() == -1:
            self._end_backward()

    def _destination(self, index: int, positions: list) -> torch.Tensor:
        """Where bucket ``index``'s gradients at ``positions`` land — once what is there is safe to
        overwrite: no (delayed) update reads it any more, and an earlier micro-batch's gradient of
        the same parameter is in the fp32 sum."""
        bucket = self.buckets[index]
        bucket.updated.wait()
        if any(bucket.arrivals[k] > bucket.folded[k] for k in positions):
            self.landed(bucket.downloads)
            self.fold(bucket, bucket.arrivals, bucket.folded, final=False, only=positions)
        return self.host.gradient_bytes(bucket)

    def _arrived(self, index: int, transfers: list, positions: list) -> None:
        bucket = self.buckets[index]
        bucket.marker = self.link.mark()  # the backward that produced them has been issued up to here
        bucket.downloads.append((transfers, positions))
        for k in positions:
            bucket.arrivals[k] += 1
        for transfer in transfers:
            self._record("D2H", transfer, f"b{index}")
        if self.eager_after is not None and all(a == self.eager_after for a in bucket.arrivals):
            self._ready(bucket)

    # ------------------------------------------------------------------ micro-batches

    @staticmethod
    def landed(downloads: list) -> None:
        """Block until the gradient copies in ``downloads`` (a bucket's list) have landed."""
        for transfers, _ in downloads:
            for transfer in transfers:
                transfer.synchronize()

    def fold(self, bucket: Bucket, arrivals: list, folded: list, final: bool, only=None) -> None:
        """Add landed gradients of parameters that have several micro-batches into the fp32 sum.

        Not final: before a newer gradient lands over the landed one. Final: the last
        micro-batch, before the update reads the sum. ``arrivals`` and ``folded`` are the
        bucket's counts for the step concerned (``folded`` is updated); ``only`` limits the fold to
        some positions. A parameter with a single micro-batch is updated from the landed gradient
        itself and never touches the sum.
        """
        pending = [k for k, n in enumerate(arrivals) if folded[k] < n and (n > 1 or not final)
                   and (only is None or k in only)]
        if not pending:
            return
        total = self.host.accumulation()
        for k in pending:
            s, e = bucket.ranges[k]
            if folded[k] == 0:
                total[s:e].copy_(self.host.grads[s:e])
            else:
                total[s:e].add_(self.host.grads[s:e])
            folded[k] = arrivals[k]

    def gradient(self, bucket: Bucket, first: int, stop: int, arrivals: list) -> torch.Tensor:
        """The host gradient of parameters ``first`` … ``stop - 1`` (a run): landed, or the fp32 sum."""
        s, e = bucket.span(first, stop)
        return self.host.accumulated[s:e] if arrivals[first] > 1 else self.host.grads[s:e]

    def take(self, bucket: Bucket) -> tuple[list, list, list]:
        """Hand this step's gradients of ``bucket`` over: (arrivals, folded, downloads); the bucket
        starts counting the next step's."""
        taken = (bucket.arrivals, bucket.folded, bucket.downloads)
        bucket.arrivals, bucket.folded, bucket.downloads = [0] * len(bucket.params), [0] * len(bucket.params), []
        return taken

    def discard(self, bucket: Bucket) -> None:
        """Forget the gradients received since the last step (after their copies have landed)."""
        self.landed(self.take(bucket)[2])

    def position(self, param) -> tuple[Bucket, int] | None:
        """The bucket that holds ``param`` and its place in it (None: not one of ours)."""
        return self._where.get(id(param))

    def discard_params(self, params) -> None:
        """Forget the gradients of these parameters received since the last step (``module.zero_grad``)."""
        for p in params:
            where = self._where.get(id(p))
            if where is not None and not where[0].submitted:
                bucket, k = where
                self.landed(bucket.downloads)
                bucket.arrivals[k] = bucket.folded[k] = 0


class _BlockSink:
    """What a StreamedModel sends one streamed block's gradients to: this intake's bucket for it."""

    def __init__(self, intake: GradientIntake, bucket: Bucket):
        self._intake, self._bucket = intake, bucket

    def gradient_destination(self, block: int, positions: list) -> torch.Tensor:
        return self._intake._destination(self._bucket.index, positions)

    def gradient_arriving(self, block: int, transfers: list, positions: list) -> None:
        self._intake._check_not_submitted(self._bucket)
        self._intake._arrived(self._bucket.index, transfers, positions)
