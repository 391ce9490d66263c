"""CPUOffloadAdam: AdamW with its state in host memory and its update on the CPU.

The model's parameters stay on the device in their low-precision dtype (bf16 by default,
fp16 with dynamic loss scaling, or fp32). Everything else — fp32 master weights, both
moments — lives in flat, exact-size, pinned host buffers. During backward each gradient
streams down over the link's copy stream as soon as autograd has accumulated it, and its
device memory is released. On the last micro-batch the CPU update of a parameter starts as
soon as its gradient has landed, on a worker thread running the fused kernel of
:mod:`offloadlab.cpu_adam`, and the refreshed weights go back on the copy stream parameter
by parameter — so gradient copies, CPU updates and weight copies overlap each other and the
rest of backward. ``step()`` only waits for the stragglers.

Global-norm clipping and fp16 overflow checks need every gradient first: with either on,
the updates start once the norm is known. With the eager update, the backward of the last
micro-batch commits the step: call ``step()`` after it, as usual. ``delayed_update=True`` applies each step's
update one step late (as ZeRO-Offload's delayed parameter update does), so the CPU update
of step t overlaps forward and backward of step t+1.
"""

from __future__ import annotations

import math
import queue
import threading

import torch

from . import cpu_adam
from .link import Link, open_link

__all__ = ["CPUOffloadAdam"]

_DEVICE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _Slot:
    """One trainable parameter's place in the flat host buffers and its progress this step."""

    def __init__(self, index: int, param: torch.Tensor, group: dict, start: int):
        self.index, self.param, self.group = index, param, group
        self.start, self.end = start, start + param.numel()
        self.step = 0                 # updates applied so far (AdamW's per-parameter step)
        self.arrivals = 0             # gradients received since the last step
        self.download = None          # the gradient's copy to the host in flight
        self.upload = None            # the refreshed weights' copy to the device in flight
        self.submitted = False        # handed to the update worker this step
        self.updated = threading.Event()
        self.updated.set()


class _Landed:
    """A gradient that needed no copy (it was produced in host memory): already done."""

    def __init__(self, link: Link):
        self.start = self.end = link.now()

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    wait = synchronize


class CPUOffloadAdam(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's semantics and arguments) with state and update on the CPU.

    Extra keyword arguments: ``link`` (a :class:`~offloadlab.link.Link`; default: a CUDA
    link for CUDA parameters, else an emulated one, which keeps a core for its copy threads
    until :meth:`close`), ``threads`` (OpenMP threads of the CPU
    update), ``max_grad_norm`` (global-norm clipping), ``accumulation_steps`` (micro-batches
    per step; the eager update starts on the last one), ``delayed_update`` and, for fp16
    parameters, ``loss_scale`` ('dynamic' or a fixed number; scale the loss with
    :meth:`scale_loss`). With ``record_timeline=True``, :attr:`timeline` holds the last step's
    gradient copies, CPU updates and weight copies as {lane: [(start, end, label)]} in seconds.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 link: Link | None = None, threads: int | None = None, max_grad_norm: float | None = None,
                 accumulation_steps: int = 1, delayed_update: bool = False, loss_scale="dynamic",
                 record_timeline: bool = False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm: expected a positive number or None; got {max_grad_norm!r}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps: expected a positive integer; got {accumulation_steps!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: expected a positive integer or None; got {threads!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

        trainable = [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]
        # Host-resident parameters (stream_parameters' layers) may sit beside one accelerator's.
        devices = {p.device for _, p in trainable}
        accelerators = {d for d in devices if d.type != "cpu"}
        if len(accelerators) > 1:
            raise ValueError(f"params: expected every parameter on one device (or the host); "
                             f"got {sorted(map(str, devices))}")
        dtypes = {p.dtype for _, p in trainable}
        if len(dtypes) > 1 or not dtypes <= set(_DEVICE_DTYPES):
            raise ValueError(f"params: expected one dtype of bf16, fp16 or fp32 for all trainable parameters; "
                             f"got {sorted(map(str, dtypes))}")
        if any(not p.is_contiguous() for _, p in trainable):
            raise ValueError("params: expected contiguous parameters")
        self.device = accelerators.pop() if accelerators else torch.device("cpu")
        self.dtype = dtypes.pop() if dtypes else torch.float32

        self._own_link = link is None
        self.link = link if link is not None else open_link(emulated=self.device.type != "cuda")
        if self.link.device.type != self.device.type:
            raise ValueError(f"link: expected a link to {self.device.type} for parameters there; "
                             f"got one to {self.link.device.type}")
        self.threads = threads or cpu_adam.default_threads()
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.delayed_update = bool(delayed_update)
        self._fp16 = self.dtype == torch.float16
        if self._fp16:
            if not (loss_scale == "dynamic" or (isinstance(loss_scale, (int, float)) and loss_scale > 0)):
                raise ValueError(f"loss_scale: expected 'dynamic' or a positive number; got {loss_scale!r}")
        self._dynamic_scale = self._fp16 and loss_scale == "dynamic"
        self.loss_scale = (2.0**16 if loss_scale == "dynamic" else float(loss_scale)) if self._fp16 else 1.0
        self._good_steps = 0
        self.skipped_steps = 0

        self._slots: list[_Slot] = []
        offset = 0
        for index, (group, p) in enumerate(trainable):
            self._slots.append(_Slot(index, p, group, offset))
            offset += p.numel()
        self.numel = offset
        self._allocate_host_state()
        self._by_param = {id(s.param): s for s in self._slots}
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_gradient) for s in self._slots]
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._serve, daemon=True, name="cpu-adam")
        self._worker.start()
        self._error: BaseException | None = None
        self._closed = False
        self.timeline = {} if record_timeline else None
        self._recording: list = []

    # ------------------------------------------------------------------ host state

    def _allocate_host_state(self) -> None:
        n, link = self.numel, self.link
        self.master = link.host_buffer(n, torch.float32)
        self.exp_avg = link.host_buffer(n, torch.float32)
        self.exp_avg_sq = link.host_buffer(n, torch.float32)
        self.grads = link.host_buffer(n, self.dtype)
        # fp32 weights go back straight from the master copy; low precision needs its own buffer.
        self.weights_out = None if self.dtype == torch.float32 else link.host_buffer(n, self.dtype)
        self._accumulated = None  # fp32, allocated on the first micro-batch that needs it
        self._allocating = threading.Lock()
        for s in self._slots:
            self.master[s.start:s.end].copy_(s.param.detach().reshape(-1))
            self.exp_avg[s.start:s.end].zero_()
            self.exp_avg_sq[s.start:s.end].zero_()

    def host_bytes(self) -> dict[str, int]:
        """Bytes of host memory this optimizer holds, by buffer (all exact-size, pinned on a GPU)."""
        buffers = {"master_weights": self.master, "first_moment": self.exp_avg, "second_moment": self.exp_avg_sq,
                   "gradients": self.grads, "weights_out": self.weights_out, "accumulated_gradients": self._accumulated}
        return {k: b.numel() * b.element_size() for k, b in buffers.items() if b is not None}

    # ------------------------------------------------------------------ backward

    def _on_gradient(self, param: torch.Tensor) -> None:
        slot = self._by_param[id(param)]
        grad = param.grad
        if grad.is_sparse:
            raise ValueError("params: CPUOffloadAdam does not support sparse gradients")
        slot.updated.wait()  # a delayed update may still be reading this parameter's host gradient
        if slot.submitted and not self.delayed_update:
            raise RuntimeError(f"more backward passes than accumulation_steps={self.accumulation_steps} before "
                               f"step(): pass accumulation_steps to match your micro-batches")
        if slot.download is not None:  # a previous micro-batch's gradient: fold it into the fp32 sum
            self._fold(slot)
        if self._on_host(slot):  # a streamed parameter: its gradient is already in host memory
            self.grads[slot.start:slot.end].copy_(grad.reshape(-1))
            slot.download = _Landed(self.link)
        else:
            slot.download = self.link.to_host(self.grads[slot.start:slot.end], grad.reshape(-1))
            self._record("D2H", slot.download, slot)
        param.grad = None  # the copy stream holds the memory until the copy is done
        slot.arrivals += 1
        if slot.arrivals == self.accumulation_steps and self._eager:
            self._submit(slot, 1.0)

    @property
    def _eager(self) -> bool:
        return self.max_grad_norm is None and not self._fp16 and not self.delayed_update

    def _fold(self, slot: _Slot) -> None:
        slot.download.synchronize()
        landed = self.grads[slot.start:slot.end]
        with self._allocating:  # the hook and the worker thread may fold at the same time
            if self._accumulated is None:
                self._accumulated = self.link.host_buffer(self.numel, torch.float32)
        total = self._accumulated[slot.start:slot.end]
        if slot.arrivals == 1:
            total.copy_(landed)
        else:
            total.add_(landed)
        slot.download = None

    def _gradient(self, slot: _Slot) -> torch.Tensor:
        """The slot's gradient on the host once it has landed (the fp32 sum after accumulation)."""
        if slot.download is not None:
            if slot.arrivals == 1:
                slot.download.synchronize()
                return self.grads[slot.start:slot.end]
            self._fold(slot)
        return self._accumulated[slot.start:slot.end]

    # ------------------------------------------------------------------ the update

    def _submit(self, slot: _Slot, grad_scale: float) -> None:
        slot.submitted = True
        slot.updated.clear()
        self._jobs.put((slot, grad_scale))

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, grad_scale = job
            try:
                self._update(slot, grad_scale)
            except BaseException as error:  # reported to the caller by step()
                self._error = error
            finally:
                slot.updated.set()
                self._jobs.task_done()

    def _update(self, slot: _Slot, grad_scale: float) -> None:
        grad = self._gradient(slot)
        slot.download, slot.arrivals = None, 0  # the next gradient may land once `updated` is set
        group, s, e = slot.group, slot.start, slot.end
        slot.step += 1
        out = None if self.weights_out is None else self.weights_out[s:e]
        started = self.link.now()
        cpu_adam.adamw_step(self.master[s:e], self.exp_avg[s:e], self.exp_avg_sq[s:e], grad, out,
                            step=slot.step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"], grad_scale=grad_scale, threads=self.threads)
        self._record("CPU", (started, self.link.now()), slot)
        if not self.delayed_update:
            self._upload(slot)

    def _on_host(self, slot: _Slot) -> bool:
        return slot.param.device.type == "cpu" and self.link.device.type != "cpu"

    def _upload(self, slot: _Slot) -> None:
        source = self.master if self.weights_out is None else self.weights_out
        if self._on_host(slot):  # the updated weights go to the host copy the layer streams from
            slot.param.data.view(-1).copy_(source[slot.start:slot.end])
            return
        slot.upload = self.link.to_device(slot.param.data.view(-1), source[slot.start:slot.end])
        self._record("H2D", slot.upload, slot)

    def _record(self, lane: str, interval, slot: _Slot) -> None:
        if self.timeline is not None:
            self._recording.append((lane, interval, f"p{slot.index}"))

    def _close_timeline(self) -> None:
        """Resolve this step's recorded intervals into :attr:`timeline`."""
        if self.timeline is None or not self._recording:
            return
        lanes: dict = {"D2H": [], "CPU": [], "H2D": []}
        for lane, interval, label in self._recording:
            start, end = interval if isinstance(interval, tuple) else (interval.start, interval.end)
            lanes[lane].append((start, end, label))
        self.timeline = lanes
        self._recording = []

    def _finish(self, slots) -> None:
        """Wait for the slots' updates and order the compute stream after their weight copies."""
        for slot in slots:
            slot.updated.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        for slot in slots:
            if slot.upload is not None:
                slot.upload.wait()
                slot.upload = None

    def _grad_scale(self, ready: list[_Slot]) -> float | None:
        """1 / loss scale × clipping factor; None when an fp16 overflow means skip the step."""
        scale = 1.0 / self.loss_scale
        if self.max_grad_norm is None and not self._fp16:
            return scale
        total = sum(cpu_adam.grad_sum_of_squares(self._gradient(s), self.threads) for s in ready)
        norm = math.sqrt(total) * scale
        if not math.isfinite(norm):
            return None
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            scale *= self.max_grad_norm / (norm + 1e-6)
        return scale

    @torch.no_grad()
    def step(self, closure=None):
        """Finish this step's CPU updates (or, with delayed_update, apply the previous step's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.delayed_update:
            pending = [s for s in self._slots if s.submitted]
            self._finish(pending)  # waits for last step's updates...
            for slot in pending:
                self._upload(slot)  # ...and sends their weights up
            self._finish(pending)
            for slot in pending:
                slot.submitted = False
            self.link.synchronize()  # the uploads have read weights_out before the next update writes it
        running = [s for s in self._slots if s.submitted]  # started eagerly during backward
        ready = [s for s in self._slots if s.arrivals > 0 and not s.submitted]
        scale = self._grad_scale(ready) if ready else 1.0
        if scale is None:
            self._skip(ready)
            return loss
        for slot in ready:
            self._submit(slot, scale)
        if not self.delayed_update:
            self._finish(running + ready)
            for slot in running + ready:
                slot.submitted = False
        if not self.delayed_update:
            self._close_timeline()
        if self._dynamic_scale:
            self._good_steps += 1
            if self._good_steps % 2000 == 0:
                self.loss_scale *= 2.0
        return loss

    def _skip(self, ready: list[_Slot]) -> None:
        """An fp16 overflow: drop this step's gradients and halve the loss scale."""
        for slot in ready:
            if slot.download is not None:
                slot.download.synchronize()
            slot.arrivals, slot.download = 0, None
        self.skipped_steps += 1
        self._good_steps = 0
        if self._dynamic_scale:
            self.loss_scale = max(self.loss_scale / 2.0, 1.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current loss scale (fp16); the loss itself otherwise."""
        return loss * self.loss_scale if self._fp16 else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard gradients received since the last step (device gradients are already gone)."""
        super().zero_grad(set_to_none=set_to_none)
        for slot in self._slots:
            if slot.submitted:  # its gradient already belongs to an update in progress
                continue
            if slot.download is not None:
                slot.download.synchronize()
            slot.arrivals, slot.download = 0, None

    def synchronize(self) -> None:
        """Finish every pending update and weight copy (for a delayed update: apply it now)."""
        pending = [s for s in self._slots if s.submitted]
        self._finish(pending)
        if self.delayed_update:
            for slot in pending:
                self._upload(slot)
            self._finish(pending)
        for slot in pending:
            slot.submitted = False
        self.link.synchronize()

    def close(self) -> None:
        """Finish pending work, remove the hooks, stop the worker and close a link made here."""
        if self._closed:
            return
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        self._jobs.put(None)
        self._worker.join()
        if self._own_link:
            self.link.close()
        self._closed = True

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout (step, exp_avg, exp_avg_sq per parameter) plus the fp32
        ``master`` weights, as host tensors shaped like each parameter."""
        self.synchronize()
        index, state = {}, {}
        for p in (p for g in self.param_groups for p in g["params"]):
            index.setdefault(id(p), len(index))
        for slot in self._slots:
            if slot.step == 0:
                continue
            shape, s, e = slot.param.shape, slot.start, slot.end
            state[index[id(slot.param)]] = {
                "step": torch.tensor(float(slot.step)),
                "exp_avg": self.exp_avg[s:e].view(shape).clone(),
                "exp_avg_sq": self.exp_avg_sq[s:e].view(shape).clone(),
                "master": self.master[s:e].view(shape).clone(),
            }
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                          fused=None)
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups,
                "offload": {"loss_scale": self.loss_scale, "good_steps": self._good_steps,
                            "skipped_steps": self.skipped_steps}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from this class or from torch.optim.AdamW (master weights are then
        taken from the current parameters) and send the master weights to the device."""
        self.synchronize()
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(own["params"]) for saved, own in zip(groups, self.param_groups)):
            raise ValueError("state_dict: expected the same number of parameter groups and parameters per group")
        for saved, own in zip(groups, self.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved:
                    own[key] = tuple(saved[key]) if key == "betas" else saved[key]
        index = {}
        for saved, own in zip(groups, self.param_groups):
            index.update({id(p): i for p, i in zip(own["params"], saved["params"])})
        state = state_dict.get("state", {})
        for slot in self._slots:
            saved = state.get(index[id(slot.param)])
            s, e = slot.start, slot.end
            if saved is None:
                slot.step = 0
                self.exp_avg[s:e].zero_()
                self.exp_avg_sq[s:e].zero_()
                self.master[s:e].copy_(slot.param.detach().reshape(-1))
                continue
            slot.step = int(saved["step"])
            self.exp_avg[s:e].copy_(saved["exp_avg"].reshape(-1))
            self.exp_avg_sq[s:e].copy_(saved["exp_avg_sq"].reshape(-1))
            master = saved.get("master")
            self.master[s:e].copy_((master if master is not None else slot.param.detach().float()).reshape(-1))
            if self.weights_out is not None:
                self.weights_out[s:e].copy_(self.master[s:e])
            self._upload(slot)
        self._finish(self._slots)
        self.link.synchronize()
        extra = state_dict.get("offload", {})
        self.loss_scale = float(extra.get("loss_scale", self.loss_scale))
        self._good_steps = int(extra.get("good_steps", 0))
        self.skipped_steps = int(extra.get("skipped_steps", 0))


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"lr: expected a number ≥ 0; got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"betas: expected two numbers in [0, 1); got {betas!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps: expected a number ≥ 0; got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay: expected a number ≥ 0; got {weight_decay!r}")
