"""CPUOffloadAdam: AdamW with its state in host memory and its update on the CPU.

The parameters stay on the device in their dtype (bf16, fp16 with loss scaling, or fp32); fp32
master weights and both moments live in flat host buffers. Gradients go down a bucket at a time
during backward, a worker thread updates each bucket with :mod:`offloadlab.cpu_adam`'s kernel,
and the new weights come back one copy per bucket. The update runs at ``step()`` (the default),
during backward (``accumulation_steps=k``, the eager schedule) or behind the next step
(``delayed_update=True``).

Two other answers to a link too slow for all of that (:mod:`~offloadlab.offload.device_update`):
``offload_fraction=F`` offloads only a share F of the parameters' bytes and keeps the rest's
state and update on the device; ``update_on="device"`` parks the state in host memory between
steps and runs the update on the device, so its bytes cross once a step whatever the number of
micro-batches. Gradients of parameters updated on the device stay in ``.grad``.

Gradients leave the model during backward, so clipping (``max_grad_norm``, or
``optimizer.clip_grad_norm_``) and discarding them (``optimizer.zero_grad()``) go to the
optimizer: ``torch.nn.utils.clip_grad_norm_`` over the model finds none of the offloaded ones (a
norm of 0, or with ``offload_fraction`` < 1 the device share's norm alone), ``model.zero_grad()``
does not reach them, and a post-accumulate-grad hook of yours sees ``.grad`` as None unless it
was registered before the optimizer was made (hooks run in that order). Under the eager schedule
an update that began in backward stands: ``zero_grad()`` or ``close()`` before ``step()`` says
so. Where a user does by hand what AdamW allows (weights
edited, Ctrl-C in step(), a reload mid-accumulation, a state dict in another order) it does what
AdamW does or says at once that it cannot: chapter 6 lists the cases, and
tests/test_offload_contract.py holds each one.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping

import torch

from .. import _torch_compat
from ..link import check_link
from ..units import check_integer, is_number, plain_scalar
from .engine import OffloadEngine, interrupts_held, managed
from .host_state import check_group, check_hyperparameters, check_state, export_state
from .sharded import LocalShards, is_sharded, ranks_on_this_host

__all__ = ["CPUOffloadAdam", "managed"]

DEFAULT_BUCKET_BYTES = 32 * 2**20


def _close(engine: OffloadEngine, shards: LocalShards, reason: str) -> None:
    shards.detach()
    engine.close(reason)


class _LiveEntry(dict):
    """One parameter's state: views of its host buffers. Assigning a key would only replace the
    view in this dict (torch.optim.AdamW would use the new tensor), so it is refused."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            "optimizer.state[p]: its entries are live views of the host state; write into one "
            "(optimizer.state[p]['exp_avg'].copy_(new)) or load a state dict"
        )

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):  # (a copy or a pickle is a plain dict of its tensors)
        return dict, (dict(self),)


class _StateView(Mapping):
    """``optimizer.state``: per parameter updated so far, live views of its host state (AdamW's
    keys)."""

    def __init__(self, engine: OffloadEngine, shards: LocalShards):
        self._engine, self._shards = engine, shards

    def _entries(self):
        engine = self._engine
        if engine.closed is not None:
            return {}
        return {
            self._shards.sharded.get(id(p), p): (holder, bucket, k)
            for holder in (engine.host, *engine.on_device)
            for bucket in holder.buckets
            for k, p in enumerate(bucket.params)
            if bucket.steps[k]
        }

    def __getitem__(self, param):
        entries = self._entries()
        if param not in entries:
            # as torch.optim's defaultdict(dict) answers for a parameter without state yet
            return _LiveEntry()
        holder, bucket, k = entries[param]
        return _LiveEntry(holder.entry(bucket, k))

    def __iter__(self):
        return iter(self._entries())

    def __len__(self):
        return len(self._entries())


# torch.amp.GradScaler.step() then hands step() its scale instead of reading .grad (which it would
# find empty: the gradients are on the host), so step() can refuse it in plain words.
@_torch_compat.accepts_grad_scaler
class CPUOffloadAdam(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's semantics and arguments) with state and update on the CPU.

    Extra keyword arguments: ``link`` (a :class:`~offloadlab.link.Link`; default: the
    StreamedModel's link for streamed parameters, the device's shared CUDA link for CUDA
    parameters, else an emulated one, which keeps a core for its copy threads until
    :meth:`close`), ``threads``
    (OpenMP threads of the CPU update), ``max_grad_norm`` (global-norm clipping),
    ``accumulation_steps`` (declare micro-batches per step for the eager update),
    ``delayed_update``, ``bucket_bytes`` (gradient bytes per bucket, default 32 MiB),
    ``offload_fraction`` (the share of the parameters' bytes whose state leaves the device, 0 to 1;
    default 1), ``update_on`` ('cpu', the default, or 'device': the offloaded state is parked in
    host memory and updated on the device), and for
    fp16 parameters ``loss_scale`` ('dynamic', a fixed number, or a
    :class:`~offloadlab.offload.LossScaler`; scale the loss with :meth:`scale_loss`). With
    ``record_timeline=True``, :attr:`timeline` holds the last step's gradient copies, CPU
    updates and weight copies as {lane: [(start, end, label)]} in seconds on the link's clock
    (:func:`offloadlab.trace.write_chrome_trace` writes it for Perfetto).

    Parameters sharded by FSDP2's ``fully_shard``: each rank offloads and updates its own shard
    (:mod:`~offloadlab.offload.sharded`); clipping and fp16's overflow check use the norm over all
    ranks, and ``state_dict()`` holds DTensors placed like the parameters, for
    ``torch.distributed.checkpoint``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        link=None,
        threads: int | None = None,
        max_grad_norm: float | None = None,
        accumulation_steps: int | None = None,
        delayed_update: bool = False,
        loss_scale="dynamic",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        record_timeline: bool = False,
        offload_fraction: float = 1.0,
        update_on: str = "cpu",
    ):
        # numpy's scalars as the Python numbers they stand for (the hyperparameters stay as given,
        # in the groups, as AdamW keeps them)
        max_grad_norm, offload_fraction, threads, accumulation_steps, bucket_bytes = map(
            plain_scalar,
            (max_grad_norm, offload_fraction, threads, accumulation_steps, bucket_bytes),
        )
        check_hyperparameters(lr, betas, eps, weight_decay)
        # AdamW's own flags: at their defaults they ask for AdamW's update, which this is; the
        # variants they switch on are not implemented, and foreach/fused pick torch's kernels,
        # which this optimizer does not run.
        flags = dict(
            amsgrad=amsgrad, maximize=maximize, capturable=capturable, differentiable=differentiable
        )
        for flag, value in flags.items():
            if value is True:
                raise ValueError(f"{flag}: CPUOffloadAdam does not implement it; got True")
            if value:  # AdamW switches the option on for any true value ("no" is one)
                raise ValueError(f"{flag}: expected False (AdamW's default); got {value!r}")
        for flag, value in (("foreach", foreach), ("fused", fused)):
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{flag}: expected True, False or None; got {value!r}")
        for flag, value in (
            ("delayed_update", delayed_update),
            ("record_timeline", record_timeline),
        ):
            if not isinstance(value, bool):  # ("no" is true to Python)
                raise ValueError(f"{flag}: expected True or False; got {value!r}")
        check_link(link, optional=True)
        if max_grad_norm is not None and not (is_number(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(
                f"max_grad_norm: expected a positive number or None; got {max_grad_norm!r}"
            )
        for name, value in (("accumulation_steps", accumulation_steps), ("threads", threads)):
            if value is not None:
                check_integer(value, name, expected="a positive integer or None")
        check_integer(bucket_bytes, "bucket_bytes", expected="a positive whole number of bytes")
        if not (is_number(offload_fraction) and 0 <= offload_fraction <= 1):
            raise ValueError(
                f"offload_fraction: expected a number from 0 to 1; got {offload_fraction!r}"
            )
        if update_on not in ("cpu", "device"):
            raise ValueError(f"update_on: expected 'cpu' or 'device'; got {update_on!r}")
        on_device = update_on == "device" or offload_fraction < 1
        if on_device and delayed_update:
            raise ValueError(
                "delayed_update: expected False with offload_fraction < 1 or update_on='device' "
                "(the device's update is not delayed); got True"
            )
        # AdamW's keys, so that code written against its groups finds them
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        defaults.update(flags, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        seen: set[int] = set()
        for i, group in enumerate(self.param_groups):
            check_group(group, f"param_groups[{i}]: ")
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(
                        f"params: expected each parameter once; param_groups[{i}] repeats one"
                    )
                seen.add(id(p))
        # FSDP2's sharded parameters: each rank offloads its own shard (see .sharded)
        self._shards = LocalShards(self.param_groups)
        if self._shards.any and on_device:
            raise ValueError(
                "offload_fraction, update_on: over FSDP2's sharded parameters each rank offloads "
                "its whole shard and updates it on the CPU; expected offload_fraction=1 and "
                "update_on='cpu'"
            )
        self._engine_groups = (
            self._shards.groups(self.param_groups) if self._shards.any else self.param_groups
        )
        self._engine = OffloadEngine(
            self._engine_groups,
            link=link,
            threads=threads,
            max_grad_norm=max_grad_norm,
            accumulation_steps=accumulation_steps,
            delayed_update=delayed_update,
            loss_scale=loss_scale,
            bucket_bytes=bucket_bytes,
            record_timeline=record_timeline,
            offload_fraction=float(offload_fraction),
            update_on=update_on,
            ranks_on_host=ranks_on_this_host() if self._shards.any else 1,
            sum_across_ranks=self._shards.sum_across_ranks if self._shards.any else None,
        )
        if self._shards.any:
            self._shards.attach(self._engine.intake)
        self.state = _StateView(self._engine, self._shards)
        # Dropped without close() (a re-run notebook cell): the engine still gets closed, and
        # the sharded parameters' hooks removed.
        self._finalizer = weakref.finalize(
            self, _close, self._engine, self._shards, "the optimizer was garbage-collected"
        )

    def __repr__(self) -> str:
        engine = self._engine
        shards = (
            f", this rank's shards of {len(self._shards.local)} sharded, {engine.threads} "
            f"threads of {engine.ranks_on_host} ranks on this host"
            if self._shards.any
            else ""
        )
        return (
            f"CPUOffloadAdam({sum(len(b.params) for b in engine.host.buckets)} parameters in "
            f"{len(engine.host.buckets)} buckets, {engine.dtype}, {engine.link!r}{shards})"
        )

    # ------------------------------------------------------------------ what it holds

    @property
    def link(self):
        return self._engine.link

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def threads(self) -> int:
        return self._engine.threads

    @property
    def buckets(self) -> list:
        """The buckets parameters move and update in (see :mod:`offloadlab.offload.host_state`)."""
        return self._engine.host.buckets

    @property
    def timeline(self) -> dict | None:
        """The last complete step's {'D2H', 'CPU', 'H2D': [(start, end, label)]}
        (record_timeline=True), else None."""
        return self._engine.timeline.lanes

    def host_bytes(self) -> dict[str, int]:
        """Bytes of host memory this optimizer holds, by buffer (exact-size; see
        :mod:`~offloadlab.offload.host_state` for which are pinned; parked state is)."""
        held = self._engine.host.nbytes() if self._engine.host.buckets else {}
        for part in self._engine.on_device:
            held.update({k: v for k, v in part.nbytes().items() if k == "parked_state"})
        return held

    def device_bytes(self) -> dict[str, int]:
        """Bytes of device memory this optimizer's own state holds, by buffer: the state kept on
        the device, and the slots parked state is updated in (the weights and gradients are the
        model's)."""
        held: dict[str, int] = {}
        for part in self._engine.on_device:
            held.update({k: v for k, v in part.nbytes().items() if k != "parked_state"})
        return held

    @property
    def offload_fraction(self) -> float:
        """The share of the trainable parameters' bytes whose state leaves the device (whole
        tensors are kept, so it is at least the fraction asked for)."""
        engine = self._engine
        kept = [p for part in engine.on_device if not part.parked for p in part.params]
        every = engine._params()
        total = sum(p.numel() for p in every)
        return 1.0 - sum(p.numel() for p in kept) / total if total else 1.0

    @property
    def update_on(self) -> str:
        """Where the offloaded state is updated: 'cpu' or 'device' (parked)."""
        return self._engine.update_on

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless the parameters are fp16)."""
        return self._engine.scaler.scale if self._engine.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because fp16 gradients overflowed."""
        return self._engine.scaler.skipped_steps if self._engine.scaler is not None else 0

    # ------------------------------------------------------------------ training

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, as torch.optim.Optimizer does; its parameters get host state and train
        from now on."""
        engine = self.__dict__.get("_engine")
        if engine is not None:
            engine.check_usable()
        super().add_param_group(param_group)
        if engine is not None:
            added = self.param_groups[-1]
            try:
                if self._shards.any or any(map(is_sharded, added["params"])):
                    raise ValueError(
                        "add_param_group: CPUOffloadAdam over sharded (FSDP2) parameters takes "
                        "every group when it is made; make it again with all of them"
                    )
                engine.add_group(added)
            except BaseException:
                self.param_groups.pop()
                raise

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current loss scale (fp16); the loss itself otherwise."""
        return loss * self.loss_scale if self._engine.scaler is not None else loss

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip this step's gradients to a global L2 norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does over the model, and return the norm before clipping.

        Call it between the step's last backward and :meth:`step`; the clipping is applied by the
        update, not to ``.grad``: where a parameter keeps one (the share updated on the device), it
        holds the unclipped values, and changing it after the clip is refused. Calls compose as
        torch's do (a second sees the first's clipped norm); a backward after it in the same step is
        refused at :meth:`step`, since torch would clip only the micro-batches before it.
        ``max_grad_norm`` given to the constructor clips what this leaves. A non-finite norm clips
        nothing, where torch would scale every gradient by nan (a nan norm) or by 0 (an infinite
        one); ``error_if_nonfinite=True`` refuses it, as torch does. ``max_norm=inf`` only reads
        the norm.
        """
        if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
            max_norm = max_norm.item()  # (a 0-dim tensor, as torch's clip takes)
        max_norm = plain_scalar(max_norm)
        if not ((is_number(max_norm) or max_norm == float("inf")) and max_norm >= 0):
            raise ValueError(f"max_norm: expected a number ≥ 0; got {max_norm!r}")
        if norm_type != 2.0:
            raise ValueError(
                f"norm_type: expected 2.0 (CPUOffloadAdam clips by the L2 norm); got {norm_type!r}"
            )
        self._shards.settle()
        self._shards.mark_caller(self._engine.link)
        return torch.tensor(self._engine.clip(float(max_norm), error_if_nonfinite))

    @torch.no_grad()
    def step(self, closure=None):
        """Finish this step's CPU updates (or, with delayed_update, apply the previous step's)."""
        self._engine.check_usable()
        if _torch_compat.grad_scaler_stepped(self):
            raise RuntimeError(
                "CPUOffloadAdam: torch.amp.GradScaler cannot check gradients that are already on "
                "the host; this optimizer scales fp16 losses itself (loss_scale=..., then "
                "opt.scale_loss(loss).backward() and opt.step()), and bf16 or fp32 need no scaler. "
                "Call zero_grad() to drop this step's scaled gradients"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._shards.settle()
        self._shards.mark_caller(self._engine.link)
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard gradients received since the last step (device gradients are already gone)."""
        super().zero_grad(set_to_none=set_to_none)
        self._shards.discard()
        self._engine.discard(set_to_none)

    def synchronize(self) -> None:
        """Finish every pending update and weight copy (for a delayed update: apply it now)."""
        self._shards.mark_caller(self._engine.link)
        self._engine.synchronize()

    def close(self) -> None:
        """Finish pending work, remove the hooks, stop the worker, free the host memory and close an
        emulated link made here. Using the optimizer afterwards raises."""
        self._finalizer.detach()
        self._shards.detach()
        self._engine.close()

    @property
    def closed(self) -> bool:
        return self._engine.closed is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "CPUOffloadAdam cannot be pickled or copied (it holds pinned host memory, hooks and a "
            "thread); save optimizer.state_dict() instead, and load it into a new CPUOffloadAdam"
        )

    # ------------------------------------------------------------------ checkpoints

    @_torch_compat.disable_dynamo
    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout (step, exp_avg, exp_avg_sq per parameter) plus the fp32
        ``master`` weights, as host tensors shaped like each parameter; torch's state-dict hooks
        run.

        With a delayed update, the pending update is applied first.
        """
        for hook in _torch_compat.optimizer_hooks(self, "state_dict_pre"):
            hook(self)
        self._shards.settle()
        self._shards.mark_caller(self._engine.link)
        self._engine.check_groups_as_made()
        self._engine.say_if_update_began(
            "state_dict()",
            "the state holds that update, which torch.optim.AdamW's would not "
            "hold before step(). Save it after step()",
        )
        self._engine.synchronize()
        holders = [self._engine.host, *self._engine.on_device]
        state_dict = export_state(holders, self._engine_groups)
        if self._shards.any:  # each tensor a DTensor placed like its parameter
            state_dict = self._shards.to_sharded(state_dict, self._engine_groups)
        scaler = self._engine.scaler
        state_dict["offload"] = scaler.state_dict() if scaler is not None else {}
        for hook in _torch_compat.optimizer_hooks(self, "state_dict_post"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @_torch_compat.disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from this class or from torch.optim.AdamW and send the weights to the
        device.

        The fp32 master weights come from the state dict when it has current ones (saved by this
        class at the same step) that round to the parameter's current value; else from the
        current parameters (an AdamW state dict, one whose master copy went through AdamW and is
        stale, or one saved for other weights), which keep their values, as under AdamW. Saved
        masters passed over for not matching the weights are named in a warning: load the
        model's weights first, then the optimizer's state, to keep them.

        Everything is checked first — group sizes, every tensor's shape, flags this class does
        not implement (amsgrad, maximize, …) — so a refused state dict changes nothing.
        """
        for hook in _torch_compat.optimizer_hooks(self, "load_state_dict_pre"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if self._shards.any:
            state_dict = self._shards.to_local(state_dict, self._engine_groups)
        self._shards.settle()
        hyper, entries = check_state(state_dict, self._engine_groups)  # (every tensor read)
        engine = self._engine
        engine.synchronize()
        with interrupts_held():  # from here on nothing is refused: a Ctrl-C waits till the end
            scaler_state = state_dict.get("offload", {})
            if engine.scaler is not None and scaler_state:
                engine.scaler.load_state_dict(scaler_state)  # (checks it all before it sets any)
            passed_over = engine.host.load(entries)
            passed_over += sum(part.load(entries) for part in engine.on_device)
            # the settings last, once the state they go with is in
            for own, values in zip(self.param_groups, hyper):
                own.update(values)
            engine.upload_all()
        if passed_over:
            warnings.warn(
                f"CPUOffloadAdam.load_state_dict: {passed_over} saved fp32 master weight(s) do not "
                "round to the parameters' current values; those parameters keep their weights, as "
                "with torch.optim.AdamW, and start a master copy from them (load the model's "
                f"state dict first to keep the saved masters)",
                stacklevel=2,
            )
        for hook in _torch_compat.optimizer_hooks(self, "load_state_dict_post"):
            hook(self)
