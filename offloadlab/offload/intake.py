"""How CPUOffloadAdam's gradients reach host memory, bucket by bucket.

A post-accumulate-grad hook on every device parameter hands its gradient, the moment autograd
has finished it, to a :class:`~offloadlab.gather.GradientGather`, which copies it into the
bucket's place in a device gather buffer and frees the parameter's ``.grad``; a complete bucket
goes down in one copy into its range of the host gradient buffer. Streamed parameters'
gradients come the same way from their :class:`~offloadlab.streaming.StreamedModel`. Both
deliver to this intake through one protocol, :class:`~offloadlab.ownership.GradientSink` (a
group is a bucket's index). At the end of each backward pass, buckets that got only some of
their gradients (unused parameters) are sent as they are.

Several backward passes before a step (gradient accumulation) need nothing declared: before a
newer gradient lands over an older one, the older one is folded into an fp32 sum
(:meth:`~offloadlab.offload.host_state.HostState.fold`), and the update at step() uses the sum.
Declaring ``accumulation_steps`` lets a bucket's update start as soon as its last micro-batch's
gradients are in (the eager schedule).
"""

from __future__ import annotations

import functools

import torch

from .. import _torch_compat
from ..gather import GradientGather
from ..layout import Layout
from ..link import Link, Marker
from .bucket import Bucket
from .host_state import HostState

__all__ = ["GradientIntake", "check_unconverted"]


def check_unconverted(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """RuntimeError naming a conversion of the model after the optimizer was made (``model.to(…)``,
    ``.double()``), which the host state cannot follow."""
    if param.dtype != dtype or param.device.type != device.type:
        raise RuntimeError(
            f"CPUOffloadAdam: a parameter is now {param.dtype} on {param.device}, but was {dtype} "
            f"on {device} when the optimizer was made (model.to(…), .half() or .double() since); "
            f"convert the model first, then make the optimizer (load optimizer.state_dict() into "
            f"the new one to keep the state)"
        )


class GradientIntake:
    """Hooks and gather buffers for the buckets of ``host``; the GradientSink their gradients go to.

    ``ready(bucket)`` is called when a bucket has all ``eager_after`` micro-batches' gradients
    (only when ``eager_after`` is set); ``fold(bucket, positions, copies)`` queues the fold of
    landed gradients into the fp32 sum on the update worker and sets ``bucket.folding``;
    ``micro_batches`` is the number declared per step (None: unknown), which tells when a fold is
    worth queuing ahead; ``record(lane, interval, label)`` receives each copy for the timeline;
    ``usable()`` says whether gradients should still be taken.
    """

    def __init__(
        self,
        link: Link,
        host: HostState,
        eager_after: int | None,
        micro_batches: int | None,
        ready,
        fold,
        record,
        usable,
    ):
        self.link, self.host, self.eager_after = link, host, eager_after
        self.micro_batches = micro_batches
        self._ready, self._fold, self._record, self._usable = ready, fold, record, usable
        self.buckets: list[Bucket] = []
        # the training stream at the newest gradient's arrival (None before the first backward):
        # the stream a step's copies up must be ordered against, wherever step() is called from
        self.training: Marker | None = None
        self._where: dict[int, tuple[Bucket, int]] = {}  # id(param) → (bucket, position)
        self._hooks: list = []
        self._accumulators: list = []  # the device parameters' AccumulateGrad nodes
        self._gather = GradientGather(link, [], sink=self, names=lambda i: f"bucket {i}")
        # buckets some of whose parameters got no gradient go down as they are at the end of
        # backward
        self._backward = _torch_compat.EndOfBackward(self._gather.flush)
        self.add(host.buckets)

    def add(self, buckets: list[Bucket]) -> None:
        """Take in the gradients of new buckets (hooks for device ones, the streaming for
        streamed ones)."""
        self._gather.extend([Layout([]) if b.streamed is not None else b.layout for b in buckets])
        for bucket in buckets:
            self.buckets.append(bucket)
            for k, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, k)
            if bucket.streamed is not None:
                bucket.streamed.attach_sink(bucket.block, self, bucket.index)
            else:
                self._hooks += [
                    p.register_post_accumulate_grad_hook(self.receive) for p in bucket.params
                ]
                # before autograd adds to .grad: one assigned since this step's gradient was sent
                for p in bucket.params:
                    node = torch.autograd.graph.get_gradient_edge(p).node
                    self._accumulators.append(node)  # (held: torch keeps a leaf's weakly)
                    self._hooks.append(
                        node.register_prehook(functools.partial(self._before_adding, p))
                    )

    def accepting(self) -> bool:
        """Whether gradients are taken (the optimizer is open and has not failed)."""
        return self._usable()

    def position(self, param) -> tuple[Bucket, int] | None:
        """The bucket that holds ``param`` and its place in it (None: not one of ours)."""
        return self._where.get(id(param))

    def close(self) -> None:
        """Remove the hooks and leave the streamed blocks' gradients to their StreamedModel
        again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._accumulators = [], []
        for bucket in self.buckets:
            if bucket.streamed is not None:
                bucket.streamed.detach_sink(bucket.block, self)

    # ------------------------------------------------------------------ gradients in

    def receive(self, param: torch.Tensor) -> None:
        """Take ``param``'s new gradient (its post-accumulate-grad hook)."""
        if not self._usable():
            return  # a failed or closed optimizer leaves gradients where autograd put them
        bucket, k = self._where[id(param)]
        grad = param.grad
        check_unconverted(
            grad, self.host.dtype, self.link.device if bucket.streamed is None else grad.device
        )
        if grad.is_sparse:
            raise ValueError("params: CPUOffloadAdam does not support sparse gradients")
        if bucket.submitted and self.eager_after is not None:
            # the extra pass is dropped, not left in .grad for the next step to take
            param.grad = None
        self._check_not_submitted(bucket)
        self._backward.arm()
        self._gather.add(bucket.index, k, grad)
        param.grad = None  # its copy into the gather buffer is ordered on the compute stream

    def _before_adding(self, param: torch.Tensor, _grad_outputs) -> None:
        """Refuse a ``.grad`` assigned after this step's gradient was sent: autograd is about to
        add to it, where the sum already holds the gradient it replaced."""
        if param.grad is not None and self._usable():
            self._refuse_assigned(param)

    def _refuse_assigned(self, param: torch.Tensor) -> None:
        bucket, k = self._where[id(param)]
        if bucket.received.counts[k]:
            raise RuntimeError(
                "CPUOffloadAdam: a .grad was assigned to a parameter after backward had sent "
                f"this step's gradient to the optimizer (shape {tuple(param.shape)}); torch.optim "
                "would use the assigned one in its place, and here it would be added: assign "
                "gradients before backward, or call zero_grad() first"
            )

    def take_existing(self, params) -> None:
        """Take in gradients that reached these parameters' ``.grad`` without passing through their
        hooks — left by a backward run before the optimizer was made, assigned by hand, or from
        ``torch.autograd.grad`` — as the hooks would have: torch.optim.AdamW uses them too. One
        assigned where backward already sent this step's gradient is refused: AdamW would step on
        it alone, and here it would be added. (A streamed weight's ``.grad`` is added: a use
        outside its block's streaming, a tied weight say, puts its share there.)"""
        for p in params:
            bucket, _ = self._where.get(id(p), (None, None))
            if p.grad is not None and bucket is not None and bucket.streamed is None:
                self._refuse_assigned(p)
        for p in params:
            if p.grad is None or id(p) not in self._where:
                continue
            bucket, k = self._where[id(p)]
            if p.grad.is_sparse:
                raise ValueError("params: CPUOffloadAdam does not support sparse gradients")
            if p.grad.shape != p.shape:
                raise RuntimeError(
                    f"CPUOffloadAdam: a parameter of shape {tuple(p.shape)} has a gradient of "
                    f"shape {tuple(p.grad.shape)}"
                )
            self._check_not_submitted(bucket)
            if bucket.streamed is None:
                self._gather.add(bucket.index, k, p.grad)
            else:  # a streamed parameter's .grad is a host tensor: it goes straight into its place
                s, e = bucket.ranges[k]
                landing = self.gradient_destination(bucket.index, [k]).view(self.host.dtype)
                with torch.no_grad():
                    landing[s - bucket.start : e - bucket.start].copy_(p.grad.reshape(-1))
                self.gradients_sent(bucket.index, [], [k])
            p.grad = None
        self._gather.flush()

    def take_loose(self) -> None:
        """Before a step or a clip: take in every gradient that sits in a managed ``.grad`` (see
        :meth:`take_existing`; gradients from backward never stay there)."""
        loose = [p for bucket in self.buckets for p in bucket.params if p.grad is not None]
        if loose:
            self.take_existing(loose)

    def settle(self) -> None:
        """Outside backward: close a pass that raised before its end (so its gradients go down)."""
        self._backward.settle()

    def _check_not_submitted(self, bucket: Bucket) -> None:
        if bucket.submitted and self.eager_after is not None:
            raise RuntimeError(
                f"CPUOffloadAdam: more backward passes than accumulation_steps={self.eager_after} "
                f"before step(); this pass's gradients are dropped, and the step of the first "
                f"{self.eager_after} stands (its updates have started): step() or zero_grad() "
                f"finishes it. Declare the number of micro-batches you run, or leave "
                f"accumulation_steps unset"
            )

    # ------------------------------------------------------------------ the GradientSink protocol

    def gradient_destination(self, group: int, positions: list) -> torch.Tensor:
        """Where bucket ``group``'s gradients at ``positions`` land — once what is there is safe to
        overwrite: no (delayed) update reads it any more, and an earlier micro-batch's gradient of
        the same parameter is in the fp32 sum. The worker folds it, off this thread (usually
        queued a whole micro-batch ahead, so this only finds it done)."""
        bucket = self.buckets[group]
        if bucket.streamed is not None:
            self._check_not_submitted(bucket)
        if len(self.host.landing) == 1:  # (else the update in flight reads the other buffer)
            bucket.updated.wait()
        received = bucket.received
        while any(received.counts[k] > received.folded[k] for k in positions):
            if bucket.folding is None:
                self._queue_fold(bucket)
            bucket.folding.wait()
            bucket.folding = None
            if not self._usable():
                break  # (the fold failed: the optimizer raises at its next call)
        return self.host.gradient_bytes(bucket)

    def _queue_fold(self, bucket: Bucket) -> None:
        received = bucket.received
        unfolded = [k for k, n in enumerate(received.counts) if n > received.folded[k]]
        self._fold(bucket, unfolded, list(received.copies))

    def _more_expected(self, bucket: Bucket) -> bool:
        """Whether another micro-batch's gradients will land over the bucket's before its update
        (declared, or seen: accumulation under way)."""
        counts = bucket.received.counts
        if self.micro_batches is not None:
            return any(0 < n < self.micro_batches for n in counts)
        return any(n > 1 for n in counts)

    def gradients_sent(self, group: int, transfers: list, positions: list) -> None:
        """Bucket ``group``'s gradients at ``positions`` are on their way down."""
        bucket = self.buckets[group]
        # (the backward that produced them is issued)
        self.training = self.link.mark(timed=False)
        bucket.receive(transfers, positions, marker=self.training)
        for transfer in transfers:
            self._record("D2H", transfer, f"b{group}")
        if self.eager_after is not None and all(
            n == self.eager_after for n in bucket.received.counts
        ):
            self._ready(bucket)
        elif bucket.folding is None and self._more_expected(bucket):
            self._queue_fold(bucket)  # (it runs while the next micro-batch computes)
