"""CPUOffloadAdam's update worker: the CPU AdamW step of each bucket, then its weights back up.

One thread takes buckets in the order they are handed over. For each it waits for the bucket's
gradients to land, adds the last micro-batch into the fp32 sum where there were several, runs
the fused kernel of :mod:`offloadlab.cpu_adam` once per run of parameters that share a group and
a step count (one OpenMP region for a whole bucket, usually), with the hyperparameters the groups
had when the bucket was handed over, and — unless the update is delayed — sends the bucket's new
weights up: one transfer into a device staging buffer, scattered into the parameters on the same
engine (a bucket of one tensor goes straight into it). The copy is ordered after everything
issued on the training stream so far, and the parameters' version counters move at once, so a
part of backward that would still read the old weights (through a ``.detach()``ed alias) fails
with autograd's in-place error instead of reading half-written weights. A streamed bucket's new
weights are copied into its block's pinned host memory instead, once no copy reads it.

An exception in the thread is kept and the remaining work skipped; the optimizer re-raises it.
"""

from __future__ import annotations

import queue
import threading

import torch

from .. import _torch_compat, cpu_adam
from ..link import Link
from .bucket import Bucket, Received
from .edits import EditWatch
from .host_state import HostState

__all__ = ["UpdateWorker"]


class UpdateWorker:
    """Runs bucket updates on a thread of its own with ``threads`` OpenMP threads for the kernel."""

    def __init__(
        self,
        link: Link,
        host: HostState,
        edits: EditWatch,
        threads: int,
        upload_after_update: bool,
        record,
    ):
        self.link, self.host, self.edits, self.threads = link, host, edits, threads
        self.upload_after_update, self._record = upload_after_update, record
        self.error: BaseException | None = None
        self.failed_step: int | None = None  # the step whose update raised
        self._staging = None  # device buffer the weights of one bucket land in before the scatter
        # bucket index → its parameters' views of staging (built once; again when staging grows)
        self._staging_views: dict[int, tuple] = {}
        self.resize()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="cpu-adam")
        self._thread.start()

    def resize(self) -> None:
        """(Re)allocate the staging buffer for the largest bucket of several device tensors.

        Called on the optimizer's thread, at construction and when buckets are added: on a GPU the
        buffer's memory comes from the caching allocator on that thread's stream, and the first
        copy into it is ordered after the first bucket's gradients — later on that same stream.
        """
        sizes = [
            b.layout.nbytes for b in self.host.buckets if b.streamed is None and len(b.params) > 1
        ]
        if sizes and (self._staging is None or self._staging.numel() < max(sizes)):
            self._staging = self.link.device_buffer(max(sizes), torch.uint8)
            self._staging_views = {}

    def submit(
        self, bucket: Bucket, grad_scale: float, step: int, check_edits: bool = True
    ) -> None:
        """Hand this step's gradients of ``bucket`` to the thread (``grad_scale`` multiplies them
        first), with its groups' hyperparameters as they are now (a scheduler may change them
        next). Weights changed by hand are taken in first (the device checks them now, the
        thread takes them in), unless ``check_edits`` is False (they were, just now)."""
        if check_edits:
            # weights changed since the optimizer last wrote them are the ones to update
            self.edits.start(bucket)
        if self.upload_after_update:
            self.announce(bucket)  # (the copy up may land at any time from now on)
        hyper = {
            id(g): (
                float(g["lr"]),
                tuple(map(float, g["betas"])),
                float(g["eps"]),
                float(g["weight_decay"]),
            )
            # (a tensor lr, as AdamW allows, is read now: a scheduler may change it)
            for g in bucket.groups
        }
        self._jobs.put((bucket, bucket.hand_over(), grad_scale, step, hyper))

    def fold(self, bucket: Bucket, positions: list, copies: list) -> None:
        """Queue the fold of the bucket's gradients at ``positions`` (brought by ``copies``) into
        the fp32 sum: the thread waits for the copies, not the autograd thread.
        ``bucket.folding`` is set when it is done."""
        bucket.folding = threading.Event()
        self._jobs.put(("fold", bucket, bucket.received, positions, copies, bucket.folding))

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "fold":
                self._fold(*job[1:])
                continue
            if job[0] == "sent":
                self._sent(job[1])
                continue
            bucket, step = job[0], job[3]
            try:
                if self.error is None:
                    self._update(*job)
            except BaseException as error:  # re-raised on the caller's thread by the optimizer
                self.error, self.failed_step = error, step
            finally:
                bucket.update_done()

    def _sent(self, bucket: Bucket) -> None:
        try:
            if self.error is None:
                self.host.weights_sent(bucket)
        except BaseException as error:  # re-raised on the caller's thread by the optimizer
            self.error, self.failed_step = error, None
        finally:
            bucket.sent_kept.set()

    def _fold(self, bucket: Bucket, received: Received, positions, copies, done) -> None:
        try:
            if self.error is None:
                received.landed(copies)
                self.host.fold(bucket, received, final=False, positions=positions)
        except BaseException as error:  # re-raised on the caller's thread by the optimizer
            self.error, self.failed_step = error, None
        finally:
            done.set()

    def _update(
        self, bucket: Bucket, received: Received, grad_scale: float, step: int, hyper: dict
    ) -> None:
        received.landed()
        self.host.fold(bucket, received, final=True)
        if bucket.upload is not None:
            # the last copy of these weights up has read them: overwrite now
            bucket.upload.synchronize()
        self.edits.finish(bucket)
        host, out = self.host, self.host.weights_out
        started = self.link.now()
        for first, stop in bucket.runs(received.counts):
            s, e = bucket.span(first, stop)
            count = bucket.steps[first] + 1
            lr, betas, eps, weight_decay = hyper[id(bucket.groups[first])]
            cpu_adam.adamw_step(
                host.master[s:e],
                host.exp_avg[s:e],
                host.exp_avg_sq[s:e],
                host.gradient(bucket, first, stop, received),
                None if out is None else out[s:e],
                step=count,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                grad_scale=grad_scale,
                threads=self.threads,
            )
            bucket.advance(first, stop, count)
        self._record("CPU", (started, self.link.now()), f"b{bucket.index}", step)
        if self.upload_after_update:
            self.upload(
                bucket,
                after=self.link.mark_on(received.marker, timed=False),
                step=step,
                announced=True,
            )

    def announce(self, bucket: Bucket) -> None:
        """Say, on the caller's thread, that the bucket's weights change from now on: a graph that
        saved them before fails autograd's in-place check in its backward, however late the copy up
        lands, instead of computing with a mix of old and new values."""
        if bucket.streamed is None:
            torch.autograd.graph.increment_version(bucket.params)
            bucket.announced([_torch_compat.version(p) for p in bucket.params])

    def upload(
        self, bucket: Bucket, after="compute", step: int | None = None, announced: bool = False
    ) -> None:
        """Send the bucket's current weights to its parameters (device) or its block's host memory
        (``announced``: :meth:`announce` was called for them when the update was handed over);
        the device fingerprints what landed, for the next check of weights changed by hand."""
        outgoing = self.host.outgoing()
        if bucket.streamed is not None:
            bucket.streamed.write_host_weights(
                bucket.block, [outgoing[s:e] for s, e in bucket.ranges]
            )
            bucket.weights_sent(None)
            self._keep_sent(bucket)
            return
        if not announced:
            self.announce(bucket)
        label = f"b{bucket.index}"
        if len(bucket.params) == 1:
            s, e = bucket.ranges[0]
            landed = bucket.params[0].data.view(-1)
            transfer = self.link.to_device(
                landed,
                outgoing[s:e],
                after=after,
                label=label,
                then=lambda: self.edits.sent(bucket, landed),
            )
        else:
            staging = self._staging[: bucket.layout.nbytes]
            landed = staging.view(self.host.dtype)
            transfer = self.link.to_device_scattered(
                self._scatter_targets(bucket, staging),
                outgoing[bucket.start : bucket.end].view(torch.uint8),
                staging,
                after=after,
                label=label,
                then=lambda: self.edits.sent(bucket, landed),
            )
        bucket.weights_sent(transfer)
        self._keep_sent(bucket)
        self._record("H2D", transfer, label, step)

    def _keep_sent(self, bucket: Bucket) -> None:
        """Keep a copy of the weights just sent (delayed update), made by the worker: a pass over
        the bucket's weights that step() on the training thread need not wait for. The bucket's
        next update is queued after it, so it copies what was sent."""
        if self.host.sent is None:
            return
        if threading.current_thread() is self._thread:  # (queued behind itself, it would deadlock)
            self.host.weights_sent(bucket)
            return
        bucket.sent_kept.clear()
        self._jobs.put(("sent", bucket))

    def _scatter_targets(self, bucket: Bucket, staging: torch.Tensor) -> list:
        """The bucket's (parameter's ``.data``, its view of ``staging``) pairs; the views are built
        once per bucket: building 400 views costs more than the update of 400 small tensors."""
        views = self._staging_views.get(bucket.index)
        if views is None:
            views = self._staging_views[bucket.index] = bucket.layout.views(staging)
        return list(zip(bucket.weights()[0], views))
