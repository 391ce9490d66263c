"""CPUOffloadAdam's host memory: the flat buffers that hold every bucket's state, and its state
dict.

Every trainable parameter has a place in one *bucket* (:mod:`~offloadlab.offload.bucket`) — a run of
parameters whose gradients go down, whose CPU update runs and whose new weights go up together — and
every bucket a range of the flat, exact-size host buffers: fp32 master weights and both moments,
the gradients as they land (in the parameters' dtype), the outgoing low-precision weights. A
bucket's parameters sit end to end, in the same order and layout (a packed
:class:`~offloadlab.layout.Layout`) as in the device buffers that gather and scatter them, so
each bucket moves as one copy each way.

Only what a copy engine touches is pinned: the landing gradients and the outgoing weights (the
master, when it is itself what goes up, in fp32). With a delayed update gradients land in two
buffers, alternate steps in each, so that a step's land while the last step's update reads its
own. The moments, a low-precision model's master, the fp32 sum of several micro-batches and (with
a delayed update) a copy of the weights last sent stay in ordinary memory: only the CPU reads
them.

:func:`export_state` and :func:`check_state` map this state to and from
``torch.optim.AdamW``'s state-dict layout (per parameter: ``step``, ``exp_avg``,
``exp_avg_sq``, shaped like the parameter), plus the fp32 ``master`` weights and the step they
were saved at (``master_step``), so a master copy that went through another optimizer (which
keeps it but moves ``step`` on) is recognised as stale and rebuilt from the weights.
"""

from __future__ import annotations

import threading

import torch

from ..link import Link
from ..units import check_adamw_settings, is_number, plain_scalar
from .bucket import Bucket, Received

__all__ = [
    "HostState",
    "same_bits",
    "export_state",
    "check_state",
    "check_hyperparameters",
    "check_group",
    "UNSUPPORTED_FLAGS",
]

# AdamW options CPUOffloadAdam does not implement: a state dict or group that turns one on is
# refused.
UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one floating dtype hold the same bit patterns (NaNs and signed zeros
    included, where ``torch.equal`` calls NaN unequal to itself and -0 equal to +0)."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


class HostState:
    """The flat host buffers of every bucket (see the module docstring); sizes in
    elements."""

    def __init__(
        self, link: Link, dtype: torch.dtype, buckets: list[Bucket], delayed: bool = False
    ):
        self.link, self.dtype = link, dtype
        self.buckets: list[Bucket] = []
        self.numel = 0
        self.master = self.exp_avg = self.exp_avg_sq = self.weights_out = None
        # Where gradients land: with a delayed update, two buffers taken in turn by alternate
        # steps, so that a step's gradients land while the last step's update still reads its own.
        self.landing: list = [None] * (2 if delayed else 1)
        # With a delayed update the outgoing copy runs a step ahead of the parameters: a copy of
        # what they were last sent is kept to tell a change made by hand.
        self.sent = None
        self._keep_sent = delayed
        self.accumulated = None  # fp32 gradient sums, allocated by the first step that accumulates
        self._allocating = threading.Lock()
        self.extend(buckets)

    def extend(self, buckets: list[Bucket]) -> None:
        """Give new buckets their places: larger buffers, the existing state copied over."""
        numel = buckets[-1].end if buckets else self.numel
        for bucket in self.buckets:  # the worker's copies and folds into these buffers are done
            bucket.sent_kept.wait()
            if (folding := bucket.folding) is not None:
                folding.wait()
        old = {
            name: getattr(self, name) for name in ("master", "exp_avg", "exp_avg_sq", "accumulated")
        }
        low_precision = self.dtype != torch.float32
        self.master = self._grow(old["master"], numel, torch.float32, pinned=not low_precision)
        self.exp_avg = self._grow(old["exp_avg"], numel, torch.float32, pinned=False)
        self.exp_avg_sq = self._grow(old["exp_avg_sq"], numel, torch.float32, pinned=False)
        self.landing = [self._grow(buffer, numel, self.dtype) for buffer in self.landing]
        # fp32 weights go back straight from the master copy; low precision needs its own buffer.
        self.weights_out = (
            self._grow(self.weights_out, numel, self.dtype) if low_precision else None
        )
        if self._keep_sent:
            self.sent = self._grow(self.sent, numel, self.dtype, pinned=False)
        if old["accumulated"] is not None:
            self.accumulated = torch.empty(max(numel, 1), dtype=torch.float32)
            self.accumulated[: old["accumulated"].numel()].copy_(old["accumulated"])
        self.numel = numel
        with torch.no_grad():
            for bucket in buckets:
                bucket.use_landing_buffers(len(self.landing))
                for p, (s, e) in zip(bucket.params, bucket.ranges):
                    self.master[s:e].copy_(p.detach().reshape(-1))
                    # A bucket's weights go up whole: a parameter without a gradient this step goes
                    # up as it is, so its outgoing copy must hold it from the start (not poison).
                    if self.weights_out is not None:
                        self.weights_out[s:e].copy_(p.detach().reshape(-1))
                    if self.sent is not None:
                        self.sent[s:e].copy_(p.detach().reshape(-1))
                    self.exp_avg[s:e].zero_()
                    self.exp_avg_sq[s:e].zero_()
        self.buckets += buckets

    @torch.no_grad()
    def take_changed(self, bucket: Bucket, weights: list) -> int:
        """Take parameters whose ``weights`` (host copies, flat, one per parameter) differ bit for
        bit from what was last sent to them into the master copy, as torch.optim.AdamW, which
        updates the parameters themselves, would see them. Returns how many had changed."""
        bucket.sent_kept.wait()
        sent = self.outgoing() if self.sent is None else self.sent
        changed = 0
        for current, (s, e) in zip(weights, bucket.ranges):
            if not same_bits(current, sent[s:e]):
                changed += 1
                for buffer in (self.master, self.weights_out, self.sent):
                    if buffer is not None:
                        buffer[s:e].copy_(current)
        return changed

    def weights_sent(self, bucket: Bucket) -> None:
        """The bucket's outgoing weights have just been sent to its parameters (kept, if asked)."""
        if self.sent is not None:
            self.sent[bucket.start : bucket.end].copy_(self.outgoing()[bucket.start : bucket.end])

    def _grow(self, old, numel: int, dtype, pinned: bool = True) -> torch.Tensor:
        new = (
            self.link.host_buffer(max(numel, 1), dtype)
            if pinned
            else torch.empty(max(numel, 1), dtype=dtype)
        )
        if old is not None:
            new[: old.numel()].copy_(old)
        return new

    def accumulation(self) -> torch.Tensor:
        """The fp32 gradient-sum buffer, allocated on first use (several threads may ask at once).

        No copy reads or writes it, so it is not pinned: ``cudaHostRegister`` would run on the
        autograd thread in the middle of backward, where the second micro-batch first needs it.
        """
        with self._allocating:
            if self.accumulated is None:
                self.accumulated = torch.empty(max(self.numel, 1), dtype=torch.float32)
        return self.accumulated

    def fold(self, bucket: Bucket, received: Received, final: bool, positions=None) -> None:
        """Add landed gradients of parameters that have several micro-batches into the fp32 sum.

        Not final: before a newer gradient lands over the landed one (only ``positions``, if
        given). Final: the last micro-batch, before the update reads the sum. ``received`` is the
        bucket's record of the step concerned (its ``folded`` counts move on); its copies must
        have landed. A parameter with a single micro-batch is updated from the landed gradient
        itself and never touches the sum.
        """
        counts, folded = received.counts, received.folded
        candidates = range(len(counts)) if positions is None else positions
        pending = [k for k in candidates if folded[k] < counts[k] and (counts[k] > 1 or not final)]
        if not pending:
            return
        total, landed = self.accumulation(), self.landing[received.slot]
        for k in pending:
            s, e = bucket.ranges[k]
            if folded[k] == 0:
                total[s:e].copy_(landed[s:e])
            else:
                total[s:e].add_(landed[s:e])
            folded[k] = counts[k]

    def gradient(self, bucket: Bucket, first: int, stop: int, received: Received) -> torch.Tensor:
        """The host gradient of parameters ``first`` … ``stop - 1`` (a run) in ``received``:
        landed, or the fp32 sum."""
        s, e = bucket.span(first, stop)
        if received.counts[first] > 1:
            return self.accumulated[s:e]
        return self.landing[received.slot][s:e]

    def outgoing(self) -> torch.Tensor:
        """The buffer the device's new weights are copied from: the low-precision copy, or the
        fp32 master."""
        return self.master if self.weights_out is None else self.weights_out

    def gradients(self, bucket: Bucket) -> torch.Tensor:
        """Where the bucket's gradients of the step under way land (elements)."""
        return self.landing[bucket.received.slot][bucket.start : bucket.end]

    def gradient_bytes(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's landing gradients as a flat byte tensor (where its device→host copy
        goes)."""
        return self.gradients(bucket).view(torch.uint8)

    def nbytes(self) -> dict[str, int]:
        """Bytes of host memory held, by buffer (all exact-size; see the module docstring for which
        are pinned)."""
        buffers = {
            "master_weights": self.master,
            "first_moment": self.exp_avg,
            "second_moment": self.exp_avg_sq,
            **{
                "gradients" if i == 0 else f"gradients ({i + 1})": buffer
                for i, buffer in enumerate(self.landing)
            },
            "weights_out": self.weights_out,
            "weights_sent": self.sent,
            "accumulated_gradients": self.accumulated,
        }
        return {k: b.numel() * b.element_size() for k, b in buffers.items() if b is not None}

    @torch.no_grad()
    def load(self, entries: dict) -> int:
        """Set every parameter's state from ``entries`` ({param: entry checked by
        :func:`check_state`}); a parameter without one starts afresh, and the outgoing weights
        are made from the master weights. A saved master is taken only where it rounds to the
        parameter's current value: otherwise (none saved, or saved for other weights — a model
        not loaded yet, parameters in another order) the master comes from the parameter, which
        keeps its weights, as under torch.optim.AdamW. Returns how many saved masters were passed
        over that way."""
        passed_over = 0
        for bucket in self.buckets:
            bucket.restore_steps([entries.get(p, {}).get("step", 0) for p in bucket.params])
            for k, p in enumerate(bucket.params):
                s, e = bucket.ranges[k]
                entry = entries.get(p, {})
                self.exp_avg[s:e].copy_(entry["exp_avg"].reshape(-1) if entry else 0)
                self.exp_avg_sq[s:e].copy_(entry["exp_avg_sq"].reshape(-1) if entry else 0)
                weights = p.detach().reshape(-1).to(self.master.device)
                master = entry["master"].reshape(-1) if "master" in entry else None
                if master is not None and not same_bits(master.to(weights.dtype), weights):
                    master, passed_over = None, passed_over + 1
                self.master[s:e].copy_(weights if master is None else master)
                if self.weights_out is not None:
                    self.weights_out[s:e].copy_(self.master[s:e])
        return passed_over

    def release(self) -> None:
        """Drop every buffer (the pinned memory is freed once no view of it is left)."""
        self.master = self.exp_avg = self.exp_avg_sq = self.weights_out = self.accumulated = None
        self.landing = [None] * len(self.landing)
        self.sent = None

    def entry(self, bucket: Bucket, k: int) -> dict:
        """Live views of parameter ``k`` of ``bucket``'s state, shaped like the parameter
        (AdamW's keys)."""
        s, e = bucket.ranges[k]
        shape = bucket.params[k].shape
        step = torch.tensor(float(bucket.steps[k]))
        return {
            "step": step,
            "exp_avg": self.exp_avg[s:e].view(shape),
            "exp_avg_sq": self.exp_avg_sq[s:e].view(shape),
            "master": self.master[s:e].view(shape),
            "master_step": step.clone(),
        }


def export_state(holders: list, param_groups: list) -> dict:
    """The state dict of ``holders`` (a :class:`HostState`, and each share updated on the device)
    in torch.optim.AdamW's layout: parameters numbered in group order, an entry (cloned host
    tensors) for every parameter updated at least once, and the groups' hyperparameters with
    AdamW's flags, all off."""
    index: dict[int, int] = {}
    for group in param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    groups = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed.update(
            {flag: False for flag in UNSUPPORTED_FLAGS},
            foreach=None,
            fused=None,
            decoupled_weight_decay=True,
        )
        packed["params"] = [index[id(p)] for p in group["params"]]
        groups.append(packed)
    state = {}
    for holder in holders:
        for bucket in holder.buckets:
            for k, p in enumerate(bucket.params):
                if bucket.steps[k]:
                    state[index[id(p)]] = {
                        key: value.to("cpu", copy=True)
                        for key, value in holder.entry(bucket, k).items()
                    }
    return {"state": state, "param_groups": groups}


def check_hyperparameters(lr, betas, eps, weight_decay, where: str = "") -> None:
    """ValueError naming the first hyperparameter AdamW would not accept."""
    check_adamw_settings(lr, betas, eps, weight_decay, where)


def check_group(group: dict, where: str = "") -> None:
    """A param group's hyperparameters, and no AdamW option turned on that this class does not
    implement. (Nothing is written into the group: over FSDP2's shards it is a view whose writes
    would hide a scheduler's later changes.)"""
    for flag in UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ValueError(
                f"{where}{flag}: CPUOffloadAdam does not implement it; got {group[flag]!r}"
            )
    if not group.get("decoupled_weight_decay", True) and group.get("weight_decay"):
        raise ValueError(  # torch.optim.Adam's decay, added to the gradient
            f"{where}decoupled_weight_decay: CPUOffloadAdam decays weights as AdamW does; "
            f"expected True (or weight_decay 0); got {group['decoupled_weight_decay']!r}"
        )
    missing = [key for key in ("lr", "betas", "eps", "weight_decay") if key not in group]
    if missing:
        keys = ", ".join(map(repr, missing))
        raise ValueError(f"{where}expected {keys} in the group, as AdamW's groups have; missing")
    check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)


def _step_count(value, where: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{where}step: expected a single number; got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    value = plain_scalar(value)  # (numpy's numbers as Python's)
    if not is_number(value) or value < 0 or value != int(value):
        raise ValueError(f"{where}step: expected a whole number of steps ≥ 0; got {value!r}")
    return int(value)


def _readable(value: torch.Tensor, where: str) -> torch.Tensor:
    """``value`` as a plain tensor whose data is known to read, so that the copies into the
    buffers cannot fail halfway: a plain tensor as it is, a subclass (a FakeTensor, a wrapper)
    copied out here, with its failure named."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value.detach()
    try:
        plain = torch.empty(value.shape, dtype=value.dtype)
        plain.copy_(value)
    except Exception as error:  # (a subclass raises whatever it likes)
        raise ValueError(
            f"{where}expected a tensor whose data can be read; reading this "
            f"{type(value).__name__} raised {type(error).__name__}: {error}"
        ) from None
    if type(plain) is not torch.Tensor:
        raise ValueError(f"{where}expected a tensor holding data; got {type(value).__name__}")
    return plain


def check_state(state_dict, param_groups) -> tuple[list[dict], dict]:
    """Validate a state dict from CPUOffloadAdam or torch.optim.AdamW against ``param_groups``
    before anything is changed. Returns (saved groups' settings, every key but the parameters;
    {param: checked entry})."""
    if (
        not isinstance(state_dict, dict)
        or not isinstance(state_dict.get("param_groups"), list)
        or not isinstance(state_dict.get("state"), dict)
    ):
        # (a dict without 'state' would reset every moment: AdamW refuses it with a KeyError)
        raise ValueError(
            "state_dict: expected a dict with 'param_groups' (a list) and 'state' (a dict), as "
            "state_dict() returns"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups) or any(
        not isinstance(s, dict)
        or not isinstance(s.get("params"), (list, tuple))
        or len(s["params"]) != len(g["params"])
        for s, g in zip(saved_groups, param_groups)
    ):
        saved = [
            len(s["params"])
            if isinstance(s, dict) and isinstance(s.get("params"), (list, tuple))
            else "?"
            for s in saved_groups
        ]
        raise ValueError(
            f"state_dict: expected {len(param_groups)} parameter groups of "
            f"{[len(g['params']) for g in param_groups]} parameters, as this optimizer has; got "
            f"{len(saved_groups)} of {saved}"
        )
    hyper, param_of = [], {}
    for i, (saved, own) in enumerate(zip(saved_groups, param_groups)):
        where = f"state_dict: param_groups[{i}]: "
        for flag in UNSUPPORTED_FLAGS:
            if saved.get(flag):
                raise ValueError(
                    f"{where}{flag}={saved[flag]!r}, which CPUOffloadAdam does not implement"
                )
        if saved.get("decoupled_weight_decay") is False and saved.get("weight_decay", 0):
            raise ValueError(
                f"{where}an Adam state with L2 weight decay (decoupled_weight_decay=False); "
                f"CPUOffloadAdam implements AdamW's decoupled weight decay"
            )
        # Every saved key but the parameters comes back, as torch.optim restores it: a scheduler's
        # initial_lr, OneCycleLR's max_lr, the user's own keys.
        values = {
            k: tuple(v) if k == "betas" else v
            for k, v in saved.items()
            if k not in ("params", "param_names")
        }
        check_hyperparameters(
            values.get("lr", own["lr"]),
            values.get("betas", own["betas"]),
            values.get("eps", own["eps"]),
            values.get("weight_decay", own["weight_decay"]),
            where,
        )
        hyper.append(values)
        param_of.update(zip(saved["params"], own["params"]))
    entries = {}
    for key, saved in state_dict["state"].items():
        where = f"state_dict: state[{key!r}]: "
        if key not in param_of:
            raise ValueError(
                f"{where}expected a parameter id of param_groups; got one that is not there"
            )
        p = param_of[key]
        if not isinstance(saved, dict):
            raise ValueError(f"{where}expected a dict of step, exp_avg and exp_avg_sq")
        if "max_exp_avg_sq" in saved:
            raise ValueError(
                f"{where}holds max_exp_avg_sq (amsgrad), which CPUOffloadAdam does not implement"
            )
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in saved]
        if missing:
            raise ValueError(
                f"{where}expected step, exp_avg and exp_avg_sq; missing {', '.join(missing)}"
            )
        checked = {"step": _step_count(saved["step"], where)}
        # A master copy is only as new as the step it was saved at: after a trip through another
        # optimizer (torch.optim.AdamW keeps unknown keys and moves "step" on) it is stale.
        fresh = (
            "master_step" in saved and _step_count(saved["master_step"], where) == checked["step"]
        )
        for name in ("exp_avg", "exp_avg_sq", "master"):
            if name == "master" and not fresh:
                continue
            value = saved.get(name)
            if value is None and name == "master":
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise ValueError(
                    f"{where}{name}: expected a floating-point tensor; got {type(value).__name__}"
                )
            if value.shape != p.shape:
                raise ValueError(
                    f"{where}{name}: expected shape {tuple(p.shape)} like its parameter; "
                    f"got {tuple(value.shape)}"
                )
            if value.is_meta or value.layout is not torch.strided:
                raise ValueError(
                    f"{where}{name}: expected a dense tensor holding data; got one on the "
                    f"{value.device} device with layout {value.layout}"
                )
            checked[name] = _readable(value, f"{where}{name}: ")
        if p.requires_grad:
            entries[p] = checked
    extra = state_dict.get("offload", {})
    if not isinstance(extra, dict):
        raise ValueError("state_dict: 'offload': expected a dict")
    return hyper, entries
