"""The machinery behind CPUOffloadAdam, kept apart from the torch.optim.Optimizer façade.

:class:`OffloadEngine` owns the host state, the gradient intake (and its hooks), the update
worker (and its thread), the loss scaler and the timeline. Nothing in it refers back to the
optimizer object, so when a user drops the optimizer without closing it (re-running a notebook
cell), a finalizer on the optimizer can close the engine: hooks removed, thread stopped.

Parameters belong to one engine at a time (:mod:`offloadlab.ownership` keeps the record): a new
engine over parameters that a live one still manages closes the old one (with a warning) and
takes them over.

When the update runs is one of three schedules (:func:`when_update_runs`): at step, eager
(during backward, with ``accumulation_steps``) or delayed (behind the next forward and backward).
A share kept on the device, or parked (:mod:`~offloadlab.offload.device_update`), updates at
step, right after the CPU's buckets are handed over; the norm and the loss scale cover both.
``_step`` reads straight down: gradients in, a delayed update's weights sent, this step's scale or
a skip, each bucket handed to the worker, the wait (unless delayed).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import warnings

import torch

from .. import _torch_compat, cpu_adam, ownership
from ..link import Link, open_link
from ..link.cuda import shared_cuda_link
from ..ownership import streamer_of
from .bucket import make_buckets
from .device_update import DeviceUpdate, kept_on_device
from .edits import EditWatch
from .host_state import HostState, check_group
from .intake import GradientIntake, check_unconverted
from .loss_scaler import LossScaler
from .worker import UpdateWorker

__all__ = [
    "OffloadEngine",
    "StepTimeline",
    "check_disjoint",
    "managed",
    "owner",
    "when_update_runs",
    "DEVICE_DTYPES",
]

DEVICE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def when_update_runs(
    accumulation_steps: int | None, delayed_update: bool, clipping: bool, fp16: bool
) -> tuple[int | None, bool]:
    """``(eager_after, delayed)``: the micro-batches after which a bucket's update starts during
    backward (None: at step), and whether step() applies the last step's update and returns
    without waiting for its own (ZeRO-Offload's delayed parameter update). Clipping and fp16 loss
    scaling need every gradient before any update starts: accumulation_steps then only declares."""
    if delayed_update:
        return None, True
    if accumulation_steps is not None and not clipping and not fp16:
        return accumulation_steps, False
    return None, False


# the packages a warning looks past for the user's line (a step is several calls deep in each)
_INTERNAL = tuple(
    os.path.dirname(package.__file__) + os.sep for package in (sys.modules["offloadlab"], torch)
)


def warn_user(message: str) -> None:
    """A UserWarning that names the user's line: the first caller outside offloadlab and torch."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def managed(param: torch.Tensor) -> bool:
    """True when a live (not closed) CPUOffloadAdam manages ``param``."""
    return owner(param) is not None


def owner(param: torch.Tensor) -> "OffloadEngine | None":
    """The live engine that manages ``param``, or None."""
    engine = ownership.optimizer_of(param)
    return engine if engine is not None and engine.closed is None else None


@contextlib.contextmanager
def interrupts_held():
    """Hold a SIGINT (Ctrl-C, a notebook's interrupt) that arrives inside the block and deliver
    it to the handler there was before, once the block is done; off the main thread, nothing is
    held."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None
    ):
        yield  # (None: a handler installed outside Python, which could not be put back)
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, held[0])  # Python's own handler raises KeyboardInterrupt here
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)  # the default: the process ends, as it would have


def check_disjoint(params: list) -> None:
    """ValueError if two parameters share memory (``nn.Parameter(b)`` beside
    ``nn.Parameter(b[:4])``): each has its own master copy and update here, so the shared
    elements would get two updates and end as whichever landed last; torch.optim.AdamW applies
    both to the one memory."""
    spans = sorted(
        (p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size(), p.nbytes, i)
        for i, p in enumerate(params)
    )
    for (start, nbytes, i), (next_start, _, j) in zip(spans, spans[1:]):
        if next_start < start + nbytes:
            a, b = sorted((i, j))
            raise ValueError(
                f"params: two trainable parameters share memory (shapes {tuple(params[a].shape)} "
                f"and {tuple(params[b].shape)}), as views of one tensor do; CPUOffloadAdam keeps a "
                "master copy per parameter and cannot update shared elements as AdamW does. Make "
                f"one parameter and derive the other from it in forward, or clone one of them"
            )


class StepTimeline:
    """The copies and CPU updates of each step, as {lane: [(start, end, label)]} in seconds.

    Intervals are kept per step (the gradients of step t may still be landing while the update
    of step t − 1 runs, with a delayed update) and resolved into :attr:`lanes` when the step is
    complete; only the last complete step is kept.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.lanes: dict | None = {} if enabled else None
        self._open: dict[int, list] = {}
        self._lock = threading.Lock()

    def record(self, lane: str, interval, label: str, step: int) -> None:
        if self.enabled:
            with self._lock:
                self._open.setdefault(step, []).append((lane, interval, label))

    def close(self, step: int) -> None:
        """Resolve step ``step``'s intervals (waiting for its copies) into :attr:`lanes`."""
        if not self.enabled:
            return
        with self._lock:
            recorded = self._open.pop(step, [])
            for older in [s for s in self._open if s < step]:
                del self._open[older]
        if not recorded:
            return
        lanes: dict = {"D2H": [], "CPU": [], "H2D": []}
        for lane, interval, label in recorded:
            start, end = interval if isinstance(interval, tuple) else (interval.start, interval.end)
            lanes[lane].append((start, end, label))
        self.lanes = lanes


class OffloadEngine:
    """Everything CPUOffloadAdam does for ``param_groups`` (see the optimizer's docstring)."""

    def __init__(
        self,
        param_groups: list,
        *,
        link: Link | None,
        threads: int | None,
        max_grad_norm,
        accumulation_steps: int | None,
        delayed_update: bool,
        loss_scale,
        bucket_bytes: int,
        record_timeline: bool,
        offload_fraction: float = 1.0,
        update_on: str = "cpu",
        ranks_on_host: int = 1,
        sum_across_ranks=None,
    ):
        self.closed: str | None = None
        # (sharded parameters: a rank's share of the host's cores, and its gradients' sum of
        # squares summed with the other ranks')
        self.ranks_on_host, self.sum_across_ranks = ranks_on_host, sum_across_ranks
        # the optimizer's own list of groups (the engine does not refer to it)
        self.param_groups = param_groups
        # What torch.optim.AdamW would find in each parameter's .grad, by id: a tensor at all (it
        # had a gradient since the last zero_grad(set_to_none=True)), and an all-zero one (zero_grad
        # kept it, zeroed). AdamW steps a parameter with a zero gradient and skips one with None.
        self._has_grad: set[int] = set()
        self._zero_grad: set[int] = set()
        trainable = [p for g in param_groups for p in g["params"] if p.requires_grad]
        self.device, self.dtype = self._check_params(trainable, link)
        check_disjoint(trainable)
        streamed = next((m for p in trainable if (m := streamer_of(p)) is not None), None)
        if link is None and streamed is not None:
            # its gradient copies land in our buffers: one link, one set of engines
            link = streamed.link
        if link is not None and link.device.type != self.device.type:
            raise ValueError(
                f"link: expected a link to {self.device.type} for parameters there; "
                f"got one to {link.device.type}"
            )
        # (a GPU's link is shared by every optimizer given none; an emulated one is its own)
        self._own_link = link is None and self.device.type != "cuda"
        self.link = (
            link
            if link is not None
            else (
                shared_cuda_link(self.device)
                if self.device.type == "cuda"
                else open_link(emulated=True)
            )
        )
        self.update_on = update_on
        if streamed is not None and (update_on == "device" or offload_fraction < 1):
            raise ValueError(
                "offload_fraction, update_on: streamed parameters are updated where their weights "
                "live, on the CPU; expected offload_fraction=1 and update_on='cpu' for them"
            )
        kept = kept_on_device(trainable, offload_fraction)
        try:
            self._build(
                param_groups,
                trainable,
                accumulation_steps,
                max_grad_norm,
                threads,
                delayed_update,
                loss_scale,
                bucket_bytes,
                record_timeline,
                kept,
            )
        except BaseException:
            if self._own_link:
                self.link.close()
            raise
        if self.scaler is not None:  # (once built: a failed optimizer claims nothing)
            self.scaler.claim(self)

    def _build(
        self,
        param_groups,
        trainable,
        accumulation_steps,
        max_grad_norm,
        threads,
        delayed_update,
        loss_scale,
        bucket_bytes,
        record_timeline,
        kept,
    ) -> None:
        self.threads = threads or cpu_adam.default_threads(
            gpu=not self.link.emulated, ranks=self.ranks_on_host
        )
        self.max_grad_norm = max_grad_norm
        self.fp16 = self.dtype == torch.float16
        # checked whatever the dtype: a typo is a typo
        scaler = LossScaler.from_argument(loss_scale)
        self.scaler = scaler if self.fp16 else None
        if self.scaler is not None:
            self.scaler.check_free(self)  # (claimed once the engine is built)
        self.bucket_bytes = bucket_bytes
        self.eager_after, self.delayed = when_update_runs(
            accumulation_steps, delayed_update, clipping=max_grad_norm is not None, fp16=self.fp16
        )
        self.accumulation_steps = accumulation_steps
        # optimizer steps taken (the step whose gradients are arriving is step_count + 1)
        self.step_count = 0
        # clip_grad_norm_'s (factor, norm was finite, gradients it saw, norm after it) for this
        # step: the factor is the product of its calls, as torch's in-place scaling composes
        self._clip: tuple | None = None
        self._device_steps: list = []  # the device's shares still to update in the step taken
        # (buckets, scale) of a step taken but not yet done (see _to_step_boundary)
        self._taken: tuple | None = None
        self._checked_edits: set[int] = set()
        # Whether zero_grad() came since the last step: AdamW's next step would add that step's
        # gradients to its own without it; this optimizer's step consumes them, and says so once.
        self._zeroed_since_step, self._said_not_zeroed = True, False
        # the groups' hyperparameters when this step's first update began during backward
        self._hyperparameters_at_eager = None
        # find or build the kernel now, not on the worker in the middle of a backward
        cpu_adam.load()

        # The CPU updates the offloaded share (update_on="cpu"); the rest updates on the device,
        # its state kept there (the share that is not offloaded) or parked in host memory.
        offloaded = [p for p in trainable if id(p) not in kept]
        on_cpu = offloaded if self.update_on == "cpu" else []
        buckets = make_buckets(  # (checks streamed blocks first)
            param_groups, bucket_bytes, only={id(p) for p in on_cpu}
        )
        # an earlier optimizer finishes before we copy the weights
        self._take_over(trainable)
        self.on_device = [
            DeviceUpdate(self.link, param_groups, share, self.dtype, parked, bucket_bytes)
            for share, parked in (
                ([p for p in trainable if id(p) in kept], False),
                ([] if self.update_on == "cpu" else offloaded, True),
            )
            if share
        ]
        self.timeline = StepTimeline(record_timeline)
        self.host = HostState(self.link, self.dtype, buckets, delayed=self.delayed)
        self.edits = EditWatch(self.link, self.host, training=lambda: self.intake.training)
        self.intake = GradientIntake(
            self.link,
            self.host,
            self.eager_after,
            accumulation_steps,
            ready=self._ready,
            fold=lambda bucket, positions, copies: self.worker.fold(bucket, positions, copies),
            record=self._record_arrival,
            usable=self._usable,
        )
        self.worker = UpdateWorker(
            self.link,
            self.host,
            self.edits,
            self.threads,
            upload_after_update=not self.delayed,
            record=self.timeline.record,
        )
        for p in trainable:
            ownership.hold(p, optimizer=self)

    # ------------------------------------------------------------------ parameters

    def _check_params(self, trainable: list, link: Link | None):
        devices = {p.device for p in trainable if streamer_of(p) is None}
        if len(devices) > 1:
            raise ValueError(
                f"params: expected every parameter on one device (or streamed); "
                f"got {sorted(map(str, devices))}"
            )
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) > 1 or not dtypes <= set(DEVICE_DTYPES):
            raise ValueError(
                f"params: expected one dtype of bf16, fp16 or fp32 for all trainable parameters; "
                f"got {sorted(map(str, dtypes))}"
            )
        if any(not p.is_contiguous() for p in trainable):
            raise ValueError("params: expected contiguous parameters")
        if any(p.is_meta for p in trainable):
            raise ValueError(
                "params: a parameter is on the meta device (it has a shape but no values); "
                "materialise the model first (model.to_empty(device=...) and initialise it, or "
                "load its weights)"
            )
        if devices:
            device = devices.pop()
        else:  # only streamed parameters: they compute on their StreamedModel's device
            device = next((streamer_of(p).link.device for p in trainable), torch.device("cpu"))
        return device, (dtypes.pop() if dtypes else torch.float32)

    def _take_over(self, trainable: list) -> None:
        """Close live engines that manage any of ``trainable``; the warning names the user's line
        (CPUOffloadAdam(...), add_param_group(...) or the step that found a new parameter)."""
        previous = {id(e): e for p in trainable if (e := owner(p)) is not None}
        # (gradients they hold for a step not yet taken come back to .grad)
        for engine in previous.values():
            engine.close(
                reason="its parameters were taken over by a newer CPUOffloadAdam",
                return_gradients=True,
            )
        if previous:
            warn_user(
                f"CPUOffloadAdam: closed {len(previous)} earlier optimizer(s) over the same "
                f"parameters and took their parameters over"
            )

    def _params(self) -> list:
        """Every parameter this engine manages, on either side."""
        return [p for b in self.host.buckets for p in b.params] + [
            p for part in self.on_device for p in part.params
        ]

    def add_group(self, group: dict) -> None:
        """Manage a new parameter group (torch.optim.Optimizer.add_param_group)."""
        self.check_usable()
        check_group(group, f"param_groups[{len(self.param_groups) - 1}]: ")
        trainable = [p for p in group["params"] if p.requires_grad]
        if not trainable:
            return
        device, dtype = self._check_params(trainable, self.link)
        if device.type != self.device.type or dtype != self.dtype:
            raise ValueError(
                f"params: expected {self.dtype} parameters on {self.device} like the others; "
                f"got {dtype} on {device}"
            )
        self._manage([group], trainable)

    def _manage(self, groups: list, trainable: list) -> None:
        """Give ``trainable`` (parameters of ``groups``) host state, hooks and a place in new
        buckets."""
        check_disjoint(self._params() + trainable)
        self.synchronize()
        if self.update_on == "device":  # parked, as the others not kept on the device
            self._take_over(trainable)
            parked = next((part for part in self.on_device if part.parked), None)
            if parked is None:
                parked = DeviceUpdate(self.link, groups, [], self.dtype, True, self.bucket_bytes)
                self.on_device.append(parked)
            parked.extend(groups, trainable, self.bucket_bytes)
            for p in trainable:
                ownership.hold(p, optimizer=self)
            return
        self.intake.settle()
        # every gradient in flight has landed before the buffers are copied over
        self.link.synchronize()
        self._take_over(trainable)
        buckets = make_buckets(
            groups,
            self.bucket_bytes,
            start_index=len(self.host.buckets),
            start=self.host.numel,
            only={id(p) for p in trainable},
        )
        self.host.extend(buckets)
        self.edits.extend(buckets)
        self.intake.add(buckets)
        self.worker.resize()
        # gradients they got before they were ours (AdamW would use them)
        self.intake.take_existing(trainable)
        for p in trainable:
            ownership.hold(p, optimizer=self)

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        """One optimizer step, under its schedule (see :func:`when_update_runs`): the contract
        checked, then :meth:`_step` with interrupts held.

        A step is whole or not at all, whatever interrupts it: a Ctrl-C (SIGINT on the main thread)
        is held until the step is done and then raised; a KeyboardInterrupt raised inside it (by a
        hook, say) first brings the optimizer to a step boundary (:meth:`_to_step_boundary`).
        """
        self.check_usable()
        for i, group in enumerate(self.param_groups):  # a scheduler's bad value is refused, not run
            check_group(group, f"param_groups[{i}]: ")
        self._check_params_as_made()
        self._warn_if_changed_since_eager()
        with interrupts_held():
            try:
                self._step()
            except KeyboardInterrupt:
                self._to_step_boundary()
                raise

    def _check_params_as_made(self) -> None:
        """RuntimeError, before anything is done, for a parameter whose weights can no longer be
        copied as they were when the optimizer was made: converted (``model.to(…)``), or made
        non-contiguous (``p.data = p.data.t()``; its new weights go up as one flat block)."""
        for part in self.on_device:
            part.check_params()
        for bucket in self.host.buckets:
            for p in bucket.params:
                check_unconverted(
                    p, self.dtype, self.device if bucket.streamed is None else p.device
                )
                if not p.is_contiguous():
                    raise RuntimeError(
                        f"CPUOffloadAdam: a parameter of shape {tuple(p.shape)} is no longer "
                        f"contiguous (its .data was set to a transposed or strided view since the "
                        f"optimizer was made), and its new weights are copied up as one flat "
                        f"block; make it contiguous again first: p.data = p.data.contiguous()"
                    )

    def _step(self) -> None:
        self._checked_edits = set()  # buckets checked for weights edited by hand, this step
        self._take_in_gradients()
        if self._device_gradients_edited_since_clip():
            self._refuse_device_edit("step")
        if self._clip is not None and self._clip[2] != self._gradients_received():
            raise RuntimeError(
                "step: gradients arrived after clip_grad_norm_ in this step; torch would have "
                "clipped only those before it, and here the step's sum is clipped as one: call "
                "clip_grad_norm_ after the step's last backward (zero_grad() drops this step)"
            )
        if self.delayed:  # the last step's update, applied now: its weights go up
            self._finish(self._submitted(), upload=True)
        self._take_zero_gradients()
        ready = [b for b in self.host.buckets if b.received.any() and not b.submitted]
        scale = self._grad_scale(ready)  # None: an fp16 overflow, the step is skipped
        self._clip = None
        self._warn_unless_zeroed(ready)
        if ready or self._submitted():  # (a step that took no gradient leaves nothing to zero)
            self._zeroed_since_step = False
        # from here on the step is taken: an interrupt finishes it rather than undoing it
        self._taken = (ready, scale)
        self._device_steps = list(self.on_device)
        if scale is not None:
            self.step_count += 1
        self._complete_step()

    def _complete_step(self) -> None:
        """Hand the taken step's buckets not yet handed over to the worker and wait for their
        updates (unless delayed); or, for a skipped step, drop their gradients."""
        ready, scale = self._taken
        if scale is None:
            for bucket in ready:
                bucket.discard()
            self._taken = None
            self.scaler.update(overflowed=True)  # (raises when no scale is left)
            return
        while ready:
            if not ready[0].submitted:  # (an interrupt may have come after it was)
                self.worker.submit(
                    ready[0],
                    scale,
                    self.step_count,
                    check_edits=ready[0].index not in self._checked_edits,
                )
            ready.pop(0)
        # while the CPU updates its share, the device updates its own
        while self._device_steps:
            self._device_steps[0].step(scale)
            self._device_steps.pop(0)
        if not self.delayed:
            self._finish(self._submitted(), upload=False)
        if self.scaler is not None:
            self.scaler.update(overflowed=False)
        self._taken = None

    def _warn_unless_zeroed(self, ready: list) -> None:
        """AdamW adds gradients until zero_grad(); this optimizer's step consumes those it takes
        off the model (the CPU's share): say so, once, where the two differ."""
        if not self.host.buckets:
            return
        if (
            not self._zeroed_since_step
            and not self._said_not_zeroed
            and (ready or self._submitted())
        ):
            self._said_not_zeroed = True
            warn_user(
                "CPUOffloadAdam: step() without zero_grad() since the last step; torch.optim.AdamW "
                "would add the last step's gradients to this one's, but here each step() consumes "
                "its gradients: this step uses only those received since the last. Call "
                "optimizer.zero_grad() every step to say so (model.zero_grad() does not reach the "
                "optimizer)"
            )
        if not self._zeroed_since_step and not ready and not self._submitted() and self.step_count:
            effect = (
                "adds no update of its own, but applies now the update the last step left "
                "pending, which the next step would have applied (delayed_update)"
                if self.delayed
                else "changes nothing"
            )
            warn_user(
                "CPUOffloadAdam: step() again with no backward and no zero_grad() since the last "
                "step: torch.optim.AdamW would apply the last step's gradients a second time (they "
                f"stay in .grad until zero_grad()), but this optimizer consumed them, so this step "
                f"{effect}"
            )

    def _to_step_boundary(self) -> None:
        """After a KeyboardInterrupt inside step(): a step already taken (counted, or with
        accumulation_steps, its update started during backward) is finished; otherwise nothing of
        it happens — this step's gradients stay received, as AdamW's stay in ``.grad`` — but the
        update an earlier step left pending (delayed_update) is applied, as step() began to."""
        if self._taken is not None:
            self._complete_step()
        elif self.eager_after is not None and self._submitted():
            self._step()
        elif self.delayed:
            self._finish(self._submitted(), upload=True)

    def _take_in_gradients(self) -> None:
        """Before a step or a clip: close a backward pass that raised, and take in gradients left in
        ``.grad`` (see :meth:`GradientIntake.take_existing`)."""
        self.intake.settle()
        self.check_groups_as_made()
        self._check_unmanaged_gradients()
        self.intake.take_loose()

    def _submitted(self) -> list:
        return [b for b in self.host.buckets if b.submitted]

    def _ready(self, bucket) -> None:  # eager: the bucket's last micro-batch is in
        # A parameter made non-contiguous cannot be sent up: its bucket waits for step(), which
        # refuses it before anything happens (refused here, inside backward, the pass would stop
        # half done).
        if all(p.is_contiguous() for p in bucket.params):
            if self._hyperparameters_at_eager is None:
                self._hyperparameters_at_eager = self._hyperparameters()
            self.worker.submit(bucket, 1.0, self.step_count + 1)

    def _hyperparameters(self) -> list[tuple]:
        return [
            (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in self.param_groups
        ]

    def _warn_if_changed_since_eager(self) -> None:
        """With accumulation_steps, a bucket's update runs with the hyperparameters of the moment
        its last gradient landed: a change made after that, before step(), is said to wait."""
        began, self._hyperparameters_at_eager = self._hyperparameters_at_eager, None
        now = self._hyperparameters()
        if began is not None and began != now:
            changed = [i for i, values in enumerate(now) if i >= len(began) or began[i] != values]
            warn_user(
                f"CPUOffloadAdam: the lr, betas, eps or weight_decay of param group(s) {changed} "
                f"changed after this step's update began during backward (accumulation_steps="
                f"{self.eager_after}): this step used the values of then, and the new ones apply "
                f"from the next step. Set them before the last backward pass of a step"
            )

    def _record_arrival(self, lane, interval, label) -> None:
        self.timeline.record(lane, interval, label, self.step_count + 1)

    def check_groups_as_made(self) -> None:
        """AdamW stops updating a parameter taken out of its groups, and updates one moved to
        another group with that group's settings; this optimizer's buckets are laid out once, so
        it refuses either instead of going on as before."""
        group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        buckets = [*self.intake.buckets, *(b for part in self.on_device for b in part.buckets)]
        removed = moved = 0
        for bucket in buckets:
            for p, made_in in zip(bucket.params, bucket.groups):
                now_in = group_of.get(id(p))
                removed += now_in is None
                moved += now_in is not None and now_in is not made_in
        if removed or moved:
            raise RuntimeError(
                f"CPUOffloadAdam: {removed} parameter(s) left param_groups and {moved} moved to "
                "another group after the optimizer was made; torch.optim.AdamW would stop "
                "updating them or use the new group's settings, but this optimizer's buckets are "
                "fixed. Freeze a parameter instead (p.requires_grad_(False)), set a group's "
                "values, or make the optimizer again"
            )

    def _check_unmanaged_gradients(self) -> None:
        """AdamW updates every parameter of its groups that has a gradient: one that did not require
        grad when the optimizer was made gets its host state now, and trains from this step on. (A
        streamed one cannot: its block's gradient layout is fixed when it is streamed.)"""
        unmanaged = [
            (i, j, p)
            for i, group in enumerate(self.param_groups)
            for j, p in enumerate(group["params"])
            if p.grad is not None
            and self.intake.position(p) is None
            and not any(part.holds(p) for part in self.on_device)
        ]
        for i, j, p in unmanaged:
            if streamer_of(p) is not None:
                raise RuntimeError(
                    f"CPUOffloadAdam: param_groups[{i}]['params'][{j}] has a gradient, but it did "
                    "not require grad when the optimizer was made, and it is streamed, so its "
                    "block has no place for it; make the optimizer again (it takes the parameters "
                    f"over; load the old one's state_dict() into it to keep the state)"
                )
        if unmanaged:
            params = [p for _, _, p in unmanaged]
            device, dtype = self._check_params(params, self.link)
            if device.type != self.device.type or dtype != self.dtype:
                raise ValueError(
                    f"params: expected {self.dtype} parameters on {self.device} like the others; "
                    f"got {dtype} on {device}"
                )
            self._manage(self.param_groups, params)

    def _take_zero_gradients(self) -> None:
        """Note which parameters got a gradient this step; give a zero one to each that got none but
        whose gradient zero_grad(set_to_none=False) kept as zeros: AdamW steps it with that (its
        weight decay and momentum move it), and skips a parameter whose gradient is None."""
        for bucket in self.host.buckets:
            if bucket.submitted:
                continue
            counts = bucket.received.counts
            for k, p in enumerate(bucket.params):
                if counts[k]:
                    self._has_grad.add(id(p))
                    self._zero_grad.discard(id(p))
                elif id(p) in self._zero_grad:
                    s, e = bucket.ranges[k]
                    self.host.gradients(bucket)[s - bucket.start : e - bucket.start].zero_()
                    bucket.give_zero_gradient(k)

    def _note_zero_grad(self, params, set_to_none: bool) -> None:
        """What zero_grad does to these parameters' .grad under AdamW: None, or (for those that have
        one, including a gradient received since the last step) zeros."""
        for p in params:
            if set_to_none:
                self._has_grad.discard(id(p))
                self._zero_grad.discard(id(p))
            elif id(p) in self._has_grad or self._received(p):
                self._has_grad.add(id(p))
                self._zero_grad.add(id(p))

    def _received(self, p) -> bool:
        bucket, k = self.intake.position(p)
        return not bucket.submitted and bucket.received.counts[k] > 0

    def _finish(self, buckets: list, upload: bool) -> None:
        """Wait for the buckets' CPU updates; with ``upload``, send their weights up now; order the
        compute stream after the copies."""
        for bucket in buckets:
            bucket.updated.wait()
        if self.worker.error is not None:
            self._fail()
        edited, late = 0, {"overwritten": 0, "kept": 0}
        if upload:
            # (delayed update: weights set by hand while it ran win) Every bucket's check is
            # queued before the first answer is waited for.
            for bucket in buckets:
                self.edits.start(bucket)
        for bucket in buckets:
            if upload:
                self.worker.announce(bucket)
                edited += self.edits.finish(bucket)
                self.worker.upload(bucket, self._after_training(), self.step_count, announced=True)
                self._checked_edits.add(bucket.index)
            if bucket.upload is not None:
                bucket.upload.wait(on=self.intake.training)
            if self.eager_after is not None and bucket.streamed is None:
                self._count_late_edits(bucket, late)
            bucket.take_back()
        if buckets:
            self.timeline.close(self.step_count)
        if late["overwritten"] or late["kept"]:
            warn_user(
                f"CPUOffloadAdam: weights were changed by hand between backward and step() with "
                f"accumulation_steps={self.eager_after}: their update had started in the "
                f"last backward pass, from the weights as they were then ({late['overwritten']} "
                f"change(s) overwritten by it, {late['kept']} kept without this step's update; a "
                f"change through .data before the new weights land goes unseen). Change weights "
                f"before the last backward pass, or leave accumulation_steps unset (the update "
                f"then runs in step(), as torch.optim.AdamW's does)"
            )
        if edited:
            warn_user(
                f"CPUOffloadAdam: {edited} parameter(s) were changed outside the optimizer while a "
                "delayed update was pending; they keep the values set, and that update is dropped "
                f"for them (call optimizer.synchronize() before changing weights by hand)"
            )

    def _after_training(self):
        """What a copy up is ordered after: everything the training stream (the one backward ran
        on, wherever step() is called from) has been given so far."""
        training = self.intake.training
        return "compute" if training is None else self.link.mark_on(training, timed=False)

    def _count_late_edits(self, bucket, late: dict) -> None:
        """Eager: count the bucket's parameters changed by hand after their update was announced
        (in backward), once the new weights are in: a change that lands later differs from them
        and is kept (the master takes it); an in-place change that the new weights overwrote
        shows in the version counter."""
        moved = [_torch_compat.version(p) != v for p, v in zip(bucket.params, bucket.versions)]
        self.edits.start(bucket)
        kept = self.edits.finish(bucket)
        late["kept"] += kept
        late["overwritten"] += max(0, sum(moved) - kept)
        bucket.announced([_torch_compat.version(p) for p in bucket.params])

    def _grad_scale(self, ready: list) -> float | None:
        """1 / loss scale × clipping factor; None when an fp16 overflow means skip the step."""
        scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        if self._clip is not None:  # clip_grad_norm_'s, then max_grad_norm's over what it left
            factor, finite, _, clipped_norm = self._clip
            if self.scaler is not None and not finite:
                return None
            scale *= factor
            limit = self.max_grad_norm
            if limit is not None and finite and clipped_norm > limit:
                scale *= limit / (clipped_norm + 1e-6)
            return scale
        max_norm = self.max_grad_norm
        if max_norm is None and self.scaler is None:
            return scale
        norm = self.gradient_norm(ready)
        if not math.isfinite(norm):
            if self.scaler is not None:
                return None
            # clipping a non-finite norm: torch scales by nan; error_if_nonfinite is the check
            return scale
        if max_norm is not None and norm > max_norm:
            scale *= max_norm / (norm + 1e-6)
        return scale

    def _gradients_received(self) -> tuple:
        """What gradients this step holds so far: micro-batches landed per host bucket, and the
        version of each gradient kept on the device (a backward adds to it in place)."""
        device = tuple(
            (id(p.grad), _torch_compat.version(p.grad)) if p.grad is not None else None
            for part in self.on_device
            for p in part.params
        )
        return tuple(tuple(b.received.counts) for b in self.host.buckets), device

    def _device_gradients_edited_since_clip(self) -> bool:
        """Whether only the device share's gradients changed since this step's clip (an in-place
        edit of a .grad, or a backward that reached no host bucket)."""
        if self._clip is None:
            return False
        host, device = self._gradients_received()
        return host == self._clip[2][0] and device != self._clip[2][1]

    def _refuse_device_edit(self, caller: str) -> None:
        raise RuntimeError(
            f"{caller}: a .grad of the share updated on the device changed after clip_grad_norm_ "
            "(an in-place edit, or a backward that reached only that share); the clip applies to "
            "the update, not to .grad, so the change would be clipped where torch would not clip "
            "it: change gradients before clip_grad_norm_ (zero_grad() drops this step)"
        )

    def gradient_norm(self, buckets: list | None = None) -> float:
        """The global L2 norm of this step's gradients (loss scale divided out), once they have
        landed."""
        # (with a delayed update the last step's are handed over: this step's are received)
        if buckets is None:
            buckets = [b for b in self.host.buckets if b.received.any()]
        total = sum(part.sum_of_squares() for part in self.on_device)
        for bucket in buckets:
            received = self._fold_here(bucket)
            for first, stop in bucket.runs(received.counts):
                grad = self.host.gradient(bucket, first, stop, received)
                total += cpu_adam.grad_sum_of_squares(grad, self.threads)
        if self.sum_across_ranks is not None:
            total = self.sum_across_ranks(total)
        return math.sqrt(total) / (self.scaler.scale if self.scaler is not None else 1.0)

    def _fold_here(self, bucket):
        """The bucket's received gradients summed on this thread, after the fold the worker may
        have queued for them (two folds at once lose a micro-batch); returns its record."""
        received = bucket.received
        received.landed()
        if bucket.folding is not None:
            bucket.folding.wait()
            bucket.folding = None
        self.host.fold(bucket, received, final=True)
        return received

    def clip(self, max_norm: float, error_if_nonfinite: bool) -> float:
        """Clip this step's update to a global gradient norm of ``max_norm``; returns the norm."""
        self.check_usable()
        if self.eager_after is not None:
            raise RuntimeError(
                "clip_grad_norm_: with accumulation_steps set (and no max_grad_norm) the update "
                "starts during backward, before anything can be clipped; pass max_grad_norm=… to "
                "the constructor instead"
            )
        self._take_in_gradients()
        # the gradients as torch would hold them now: scaled by the clips before this one
        earlier = self._clip[0] if self._clip is not None else 1.0
        norm = self.gradient_norm() * earlier
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of the gradients is {norm}; "
                f"set error_if_nonfinite=False to clip anyway"
            )
        if self._device_gradients_edited_since_clip():
            self._refuse_device_edit("clip_grad_norm_")
        if self._clip is not None and self._clip[2] != self._gradients_received():
            raise RuntimeError(
                "clip_grad_norm_: gradients arrived since the last clip_grad_norm_ of this step; "
                "torch would clip the earlier ones twice and the new ones once, and here the "
                "step's sum is clipped as one: clip once, after the step's last backward"
            )
        # (a non-finite norm clips nothing, as before: torch would scale by nan)
        finite = math.isfinite(norm)
        factor = max_norm / (norm + 1e-6) if finite and norm > max_norm else 1.0
        self._clip = (earlier * factor, finite, self._gradients_received(), norm * factor)
        return norm

    # ------------------------------------------------------------------ lifecycle

    def _usable(self) -> bool:
        return self.closed is None and self.worker.error is None

    def check_usable(self) -> None:
        if self.worker.error is not None and self.closed is None:
            self._fail()
        if self.closed is not None:
            raise RuntimeError(
                f"CPUOffloadAdam: closed ({self.closed}); make a new optimizer (and load a "
                f"checkpoint into it) to go on training"
            )

    def _fail(self) -> None:
        error, step = self.worker.error, self.worker.failed_step
        self.close(
            reason=f"the CPU update of step {step} failed, and the step may have been partly "
            f"applied: {error!r}"
        )
        raise RuntimeError(
            f"CPUOffloadAdam: the CPU update failed ({error!r}); the optimizer is closed, because "
            f"step {step} may have been only partly applied — reload a checkpoint"
        ) from error

    def discard(self, set_to_none: bool = True) -> None:
        """Forget gradients received since the last step (zero_grad)."""
        if self.closed is not None:
            return
        if self.eager_after is not None and self._submitted():
            # updates that started during backward: their step is finished, not left half-done
            self.say_if_update_began("zero_grad()")
            self.step()
        self._zeroed_since_step = True
        self._clip = None  # a clip of the gradients dropped here
        self._note_zero_grad(
            [p for bucket in self.host.buckets for p in bucket.params], set_to_none
        )
        for streamed in {
            id(b.streamed): b.streamed for b in self.host.buckets if b.streamed is not None
        }.values():
            # a backward that raised: what it gathered reaches us first, to be discarded
            streamed.settle()
        self.intake.settle()
        for bucket in self.host.buckets:
            # (a submitted bucket, its delayed update pending, has handed that step's gradients
            # over: what it holds now are the next step's)
            bucket.discard()

    def say_if_update_began(self, call: str, effect: str | None = None) -> None:
        """Warn when ``call`` comes between a backward pass whose eager update began and step()."""
        if self.eager_after is None or not self._submitted():
            return
        began, buckets = len(self._submitted()), len(self.host.buckets)
        effect = effect or (
            "an update cannot be taken back, so those buckets' update stands as this step, where "
            "torch.optim.AdamW would drop the gradients. Under the eager schedule, drop a batch "
            "before its last backward pass"
        )
        warn_user(
            f"CPUOffloadAdam: {call} without step() after a backward pass whose update had begun "
            f"(accumulation_steps={self.eager_after}; {began} of {buckets} bucket(s)): {effect}"
        )

    def synchronize(self) -> None:
        """Finish every pending update and weight copy (for a delayed update: apply it now)."""
        self.check_usable()
        if self.delayed and self._submitted():
            self._check_params_as_made()
        self._finish(self._submitted(), upload=self.delayed)
        for bucket in self.host.buckets:
            if bucket.upload is not None:
                bucket.upload.synchronize()
        for part in self.on_device:
            part.finish_down()

    def upload_all(self) -> None:
        """Send every bucket's current weights up (after a state dict was loaded) and wait for
        them."""
        for bucket in self.host.buckets:
            self.worker.upload(bucket, after="compute")
        for bucket in self.host.buckets:
            if bucket.upload is not None:
                bucket.upload.wait()
                bucket.upload.synchronize()

    def close(self, reason: str = "close() was called", return_gradients: bool = False) -> None:
        """Finish pending work (unless the worker failed), remove hooks, stop the thread, free host
        memory. With ``return_gradients``, gradients received for a step not yet taken go back to
        the parameters' ``.grad``, where torch.optim.AdamW (or a new CPUOffloadAdam) finds them."""
        if self.closed is not None:
            return
        try:
            if self.worker.error is None:
                self.say_if_update_began("close()")
                self.synchronize()
                if return_gradients:
                    self._return_gradients()
        finally:
            self.closed = reason
            self.intake.close()
            self.worker.stop()
            if self._own_link:
                self.link.close()
            self.host.release()
            for part in self.on_device:
                part.release()
            for p in self._params():
                ownership.release(p, self)

    @torch.no_grad()
    def _return_gradients(self) -> None:
        """Put this step's gradients so far (the fp32 sum of several micro-batches, in the
        parameter's dtype) into ``.grad``, added to any gradient already there; a parameter whose
        gradient zero_grad(set_to_none=False) kept as zeros gets zeros, as AdamW would see it."""
        self.intake.settle()
        self.intake.take_loose()
        for bucket in self.host.buckets:
            received = self._fold_here(bucket)
            for k, p in enumerate(bucket.params):
                if received.counts[k]:
                    grad = self.host.gradient(bucket, k, k + 1, received)
                    grad = grad.view(p.shape).to(device=p.device, dtype=p.dtype)
                elif id(p) in self._zero_grad:
                    grad = torch.zeros_like(p)
                else:
                    continue
                p.grad = grad if p.grad is None else p.grad + grad
