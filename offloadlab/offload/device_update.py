"""The share of CPUOffloadAdam's parameters whose update runs on the device.

Chapter 4's budget gives two answers when offloading everything costs more link time than the
step has: keep part of the optimizer on the device (``offload_fraction`` below 1: those
parameters' fp32 master weights and moments stay in device memory), or *park* it
(``update_on="device"``: master and moments live in pinned host memory between steps and come up
a bucket at a time for the update, then go back down). Either way the update is torch's AdamW
(fused on a GPU) on the device, and gradients never cross the link: they stay in ``.grad``, as
under torch.optim.AdamW, and accumulate there over micro-batches.

A parked step moves each bucket's state once up and once down, whatever the number of
micro-batches: 12 bytes a parameter each way for bf16 or fp16 weights (fp32 master and two
moments), 8 for fp32 weights, which are their own master. Three device slots (fewer when there are
fewer buckets) hold three buckets' state: bucket j + 1 comes up while bucket j is updated and
bucket j − 1 goes down.

Beyond its state, an update holds for a moment an fp32 copy of one run of a bucket's gradients
(and, for 16-bit weights, a comparison of each parameter with its master: weights set by hand are
taken, as AdamW takes them).

:func:`kept_on_device` chooses the parameters that stay: the first ones given (for
``model.parameters()``, those forward uses first, so those whose gradients arrive last in
backward). Their CPU update could overlap nothing: it would start after the last gradient landed.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from .. import _torch_compat
from ..link import Link
from .bucket import Bucket, make_buckets
from .host_state import same_bits

__all__ = ["DeviceUpdate", "kept_on_device", "SLOTS"]

SLOTS = 3  # parked buckets on the device at once: one coming up, one updating, one going down


def kept_on_device(params: list, offload_fraction: float) -> set[int]:
    """Ids of the parameters whose state stays on the device: in the order given, each that still
    fits in (1 − offload_fraction) of all their bytes (whole tensors: never more than that)."""
    nbytes = [p.numel() * p.element_size() for p in params]
    budget = (1.0 - offload_fraction) * sum(nbytes) * (1 + 1e-12)
    kept, used = set(), 0
    for p, size in zip(params, nbytes):
        if used + size <= budget:
            kept.add(id(p))
            used += size
    return kept


class DeviceUpdate:
    """AdamW on the device for ``params`` (of ``param_groups``), with their state in device memory
    or, ``parked``, in pinned host memory between steps (see the module docstring)."""

    def __init__(
        self,
        link: Link,
        param_groups: list,
        params: list,
        dtype: torch.dtype,
        parked: bool,
        bucket_bytes: int,
    ):
        self.link, self.dtype, self.parked = link, dtype, parked
        self.device = link.device
        self.fused = self.device.type == "cuda"
        # fp32 weights are their own master; others keep an fp32 one
        self.parts = 2 if dtype == torch.float32 else 3
        self.buckets: list[Bucket] = []
        self.numel = 0
        # each bucket's [master | exp_avg | exp_avg_sq], fp32: on the device, or parked on the host
        self.state: torch.Tensor | None = None
        self.slots: list[torch.Tensor] = []
        self._steps: dict[int, torch.Tensor] = {}  # AdamW's step count per parameter, as torch's
        self._down: list = []  # parked: copies down the host does not yet know are done
        self.extend(param_groups, params, bucket_bytes)

    # ------------------------------------------------------------------ memory

    def extend(self, param_groups: list, params: list, bucket_bytes: int) -> None:
        """Take ``params`` on: places in new buckets, state from their weights, moments zero."""
        if not params:
            return
        self.finish_down()
        buckets = make_buckets(
            param_groups,
            bucket_bytes,
            start_index=len(self.buckets),
            start=self.numel,
            only={id(p) for p in params},
        )
        numel = buckets[-1].end
        old = self.state
        size = self.parts * numel
        self.state = self.link.host_buffer(size) if self.parked else self.link.device_buffer(size)
        if old is not None:
            self.state[: old.numel()].copy_(old)
        with torch.no_grad():
            for bucket in buckets:
                master, exp_avg, exp_avg_sq = self.views(self.state, bucket)
                if master is not None:
                    for p, (s, e) in self.local_ranges(bucket):
                        master[s:e].copy_(p.detach().reshape(-1))
                exp_avg.zero_()
                exp_avg_sq.zero_()
                for p in bucket.params:
                    where = self.device if self.fused else torch.device("cpu")
                    self._steps[id(p)] = torch.zeros((), dtype=torch.float32, device=where)
        self.buckets += buckets
        self.numel = numel
        if self.parked:
            slot = self.parts * max(b.numel for b in self.buckets)
            count = min(SLOTS, len(self.buckets))
            if len(self.slots) < count or self.slots[0].numel() < slot:
                self.link.synchronize()  # (the old slots may still be read by queued work)
                self.slots = [self.link.device_buffer(slot) for _ in range(count)]

    def views(self, buffer: torch.Tensor, bucket: Bucket, in_slot: bool = False) -> tuple:
        """(master or None, exp_avg, exp_avg_sq) of ``bucket``, flat, in ``buffer`` (the state, or
        a slot holding the bucket alone)."""
        n = bucket.numel
        base = 0 if in_slot else self.parts * bucket.start
        parts = [buffer[base + i * n : base + (i + 1) * n] for i in range(self.parts)]
        return (parts[0] if self.parts == 3 else None, parts[-2], parts[-1])

    def block(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's whole state in :attr:`state`: what moves as one copy each way."""
        return self.state[self.parts * bucket.start : self.parts * bucket.end]

    @staticmethod
    def local_ranges(bucket: Bucket):
        """(parameter, (first, stop)) with the elements counted from the bucket's start."""
        return [
            (p, (s - bucket.start, e - bucket.start))
            for p, (s, e) in zip(bucket.params, bucket.ranges)
        ]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``parked_state`` (pinned host) or ``device_state``, and ``device_slots``."""
        if self.state is None:
            return {}
        held = {("parked_state" if self.parked else "device_state"): self.state.numel() * 4}
        if self.slots:
            held["device_slots"] = sum(s.numel() * 4 for s in self.slots)
        return held

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._steps

    @property
    def params(self) -> list:
        return [p for b in self.buckets for p in b.params]

    # ------------------------------------------------------------------ the step

    def sum_of_squares(self) -> float:
        """Sum of the squares of this share's gradients (as they are in ``.grad``: loss-scaled).
        Reading it makes the host wait for the device."""
        norms = [
            torch.linalg.vector_norm(p.grad, dtype=torch.float32)
            for p in self.params
            if p.grad is not None
        ]
        if not norms:
            return 0.0
        self.link.traffic.blocked()
        return float(torch.stack(norms).double().square().sum())

    @torch.no_grad()
    def step(self, grad_scale: float) -> None:
        """One AdamW step of every parameter here that has a gradient, each gradient multiplied by
        ``grad_scale`` (1 / loss scale × clipping factor). Resident state is updated in place;
        parked state comes up, is updated and goes down, bucket by bucket, overlapped."""
        self.check_params()
        ready = [b for b in self.buckets if any(p.grad is not None for p in b.params)]
        if not self.parked:
            for bucket in ready:
                self._update(bucket, self.views(self.state, bucket), grad_scale)
            return
        self.finish_down()  # the last step's state is home before it comes up again
        ups, downs, slots = [], [], len(self.slots)

        def up(j: int) -> None:
            size = self.parts * ready[j].numel
            ups.append(
                self.link.to_device(
                    self.slots[j % slots][:size],
                    self.block(ready[j]),
                    after=self.link.mark(timed=False),
                    label=f"state up {ready[j].index}",
                )
            )

        if ready:
            up(0)
        for j, bucket in enumerate(ready):
            if j + 1 < len(ready):
                if j + 1 >= slots:
                    # the next bucket's slot is free once the state it held has gone down
                    downs[j + 1 - slots].wait()
                up(j + 1)
            ups[j].wait()
            slot = self.slots[j % slots][: self.parts * bucket.numel]
            self._update(bucket, self.views(slot, bucket, in_slot=True), grad_scale)
            downs.append(
                self.link.to_host(
                    self.block(bucket),
                    slot,
                    after=self.link.mark(timed=False),
                    label=f"state down {bucket.index}",
                )
            )
        self._down = downs

    def _update(self, bucket: Bucket, views: tuple, grad_scale: float) -> None:
        master, exp_avg, exp_avg_sq = views
        counts = [int(p.grad is not None) for p in bucket.params]
        ranges = self.local_ranges(bucket)
        for first, stop in bucket.runs(counts):
            params = bucket.params[first:stop]
            spans = [r for _, r in ranges[first:stop]]
            weights = [p.data.view(-1) for p in params]
            if master is None:
                targets = weights
            else:
                targets = [master[s:e] for s, e in spans]
                for target, weight in zip(targets, weights):
                    # an element set by hand (not the rounding of its master) is taken as is
                    target.copy_(
                        torch.where(target.to(weight.dtype) == weight, target, weight.float())
                    )
            group = bucket.groups[first]
            beta1, beta2 = group["betas"]
            adam(
                targets,
                [self._gradient(p, grad_scale) for p in params],
                [exp_avg[s:e] for s, e in spans],
                [exp_avg_sq[s:e] for s, e in spans],
                [],
                [self._steps[id(p)] for p in params],
                foreach=None if self.fused else False,
                fused=True if self.fused else None,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            if master is not None:
                _torch_compat.foreach_copy_(weights, targets)
            bucket.advance(first, stop, bucket.steps[first] + 1)

    @staticmethod
    def _gradient(p: torch.Tensor, grad_scale: float) -> torch.Tensor:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        grad = grad.reshape(-1).float()
        return grad if grad_scale == 1.0 else grad * grad_scale

    def check_params(self) -> None:
        """RuntimeError before anything is done for a parameter the update cannot write: made
        non-contiguous, or moved or converted since the optimizer was made."""
        for p in self.params:
            if p.device.type != self.device.type or p.dtype != self.dtype:
                raise RuntimeError(
                    f"CPUOffloadAdam: a parameter of shape {tuple(p.shape)} is now {p.dtype} on "
                    f"{p.device}; it was {self.dtype} on {self.device} when the optimizer was "
                    "made: make the optimizer again after converting the model"
                )
            if not p.is_contiguous():
                raise RuntimeError(
                    f"CPUOffloadAdam: a parameter of shape {tuple(p.shape)} is no longer "
                    "contiguous; make it contiguous again first: p.data = p.data.contiguous()"
                )

    def finish_down(self) -> None:
        """Parked: wait until the last step's state is back in host memory."""
        for transfer in self._down:
            transfer.synchronize()
        self._down = []

    # ------------------------------------------------------------------ state dict

    def entry(self, bucket: Bucket, k: int) -> dict:
        """Live views of parameter ``k`` of ``bucket``'s state, shaped like it (AdamW's keys)."""
        self.finish_down()
        p = bucket.params[k]
        s, e = bucket.ranges[k][0] - bucket.start, bucket.ranges[k][1] - bucket.start
        master, exp_avg, exp_avg_sq = self.views(self.state, bucket)
        step = torch.tensor(float(bucket.steps[k]))
        return {
            "step": step,
            "exp_avg": exp_avg[s:e].view(p.shape),
            "exp_avg_sq": exp_avg_sq[s:e].view(p.shape),
            "master": (p.detach() if master is None else master[s:e].view(p.shape)),
            "master_step": step.clone(),
        }

    @torch.no_grad()
    def load(self, entries: dict) -> int:
        """Set every parameter's state from ``entries`` (as :meth:`HostState.load` does); returns
        how many saved masters were passed over for not rounding to the weights."""
        self.finish_down()
        self.link.synchronize()
        passed_over = 0
        for bucket in self.buckets:
            steps = [entries.get(p, {}).get("step", 0) for p in bucket.params]
            bucket.restore_steps(steps)
            master, exp_avg, exp_avg_sq = self.views(self.state, bucket)
            for (p, (s, e)), step in zip(self.local_ranges(bucket), steps):
                entry = entries.get(p, {})
                self._steps[id(p)].fill_(float(step))
                exp_avg[s:e].copy_(entry["exp_avg"].reshape(-1) if entry else 0)
                exp_avg_sq[s:e].copy_(entry["exp_avg_sq"].reshape(-1) if entry else 0)
                if master is None:
                    continue
                weights = p.detach().reshape(-1)
                saved = entry.get("master")
                saved = None if saved is None else saved.reshape(-1).to(weights.device)
                if saved is not None and not same_bits(saved.to(weights.dtype), weights):
                    saved, passed_over = None, passed_over + 1
                master[s:e].copy_(weights if saved is None else saved)
        return passed_over

    def release(self) -> None:
        """Drop the state and the slots (after :meth:`finish_down`)."""
        self.finish_down()
        self.state, self.slots = None, []
