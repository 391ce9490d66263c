"""FSDP2's sharded parameters: each rank offloads and updates its own shard.

``fully_shard`` turns each parameter into a DTensor whose local tensor is this rank's rows
(``Shard(0)`` over one mesh dimension). The engine works on plain tensors, so each sharded
parameter gets a *local* stand-in: a leaf tensor over the same memory as its shard. FSDP2 runs the
sharded parameter's post-accumulate-grad hooks once the reduced gradient is in ``.grad``; the
hook here hands that shard to the engine as the stand-in's gradient. New weights written into a
stand-in land in the shard FSDP2 gathers at the next forward. Only the gradient norm (clipping,
an fp16 overflow) needs the other ranks: one all-reduce of a number, in ``step()``, never in
backward. Chapter 9b tells the story.
"""

from __future__ import annotations

import collections
import os

import torch
import torch.distributed as dist

from .. import _torch_compat

if dist.is_available():  # (a torch built without distributed has no DTensor either)
    from torch.distributed.tensor import DTensor, Shard
else:
    DTensor, Shard = (), None

__all__ = ["LocalShards", "is_sharded", "ranks_on_this_host"]


# each sharded parameter's stand-in, kept while the parameter lives: a second optimizer over the
# same model gets the same stand-ins, so it takes them over from the first (as for any parameter)
_STAND_INS = _torch_compat.WeakIdKeyDictionary()


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (FSDP2 made it one)."""
    return isinstance(p, DTensor)


def ranks_on_this_host() -> int:
    """Processes of this job sharing this process's cores: torchrun's ``LOCAL_WORLD_SIZE``, unless
    this rank was pinned to cores of its own (its affinity mask differs from its launcher's, the
    parent process; a container's or Slurm job's cpuset alone narrows both alike)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        pinned = os.sched_getaffinity(0) != os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):
        pinned = False
    return 1 if pinned else max(1, local)


class LocalShards:
    """The local stand-ins of the sharded parameters in ``param_groups`` (a parameter that is not a
    DTensor stands for itself), the engine's view of the groups, and the relay of gradients."""

    def __init__(self, param_groups: list):
        self.local: dict[int, torch.Tensor] = {}  # id(sharded parameter) → its stand-in
        self.sharded: dict[int, DTensor] = {}  # id(stand-in) → its sharded parameter
        self.mesh = None
        for i, group in enumerate(param_groups):
            for j, p in enumerate(group["params"]):
                if is_sharded(p):
                    self._add(p, f"param_groups[{i}]['params'][{j}]")
        self._hooks: dict = {}  # id(sharded parameter) → its hook's handle
        self.intake = None  # the engine's gradient intake, set by attach()

    @property
    def any(self) -> bool:
        return bool(self.local)

    def _add(self, p: DTensor, where: str) -> None:
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"params: {where} is a DTensor placed {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh; CPUOffloadAdam takes FSDP2's sharding "
                "(fully_shard on a 1-D mesh: Shard(0))"
            )
        if self.mesh is None:
            self.mesh = p.device_mesh
        elif p.device_mesh != self.mesh:
            raise ValueError(
                f"params: {where} is sharded over another device mesh than the first sharded "
                "parameter; expected one mesh for all of them"
            )
        stand_in = _STAND_INS.get(p)
        if stand_in is None:
            with torch.no_grad():
                stand_in = p.to_local().detach().requires_grad_(p.requires_grad)
            _STAND_INS[p] = stand_in
        self.local[id(p)] = stand_in
        self.sharded[id(stand_in)] = p

    def groups(self, param_groups: list) -> list:
        """``param_groups`` as the engine sees them: the same hyperparameters (read live, so a
        scheduler's change reaches it), the stand-ins in place of sharded parameters."""
        return [self.group(g) for g in param_groups]

    def group(self, group: dict):
        params = [self.local.get(id(p), p) for p in group["params"]]
        return collections.ChainMap({"params": params}, group)

    def attach(self, intake) -> None:
        """Hand each shard's reduced gradient to the engine's ``intake`` as FSDP2 produces it."""
        self.intake = intake
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """A hook on each sharded parameter that requires grad and has none yet (one unfrozen
        later is hooked at the next step; until then FSDP2 sums its gradients in ``.grad``)."""
        for key, stand_in in self.local.items():
            p = self.sharded[id(stand_in)]
            if p.requires_grad and key not in self._hooks:
                self._hooks[key] = p.register_post_accumulate_grad_hook(self._relay)

    def detach(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks = {}

    @torch.no_grad()
    def _relay(self, p: DTensor) -> None:
        if p.grad is None or not self.intake.accepting():
            return  # (a closed optimizer leaves the gradient to whoever trains next)
        stand_in = self._follow(p)
        self._move_gradient(p, stand_in)
        if self.intake.position(stand_in) is not None:
            self.intake.receive(stand_in)
        # (else a parameter frozen when the optimizer was made: step() takes it over, as AdamW)

    @staticmethod
    def _move_gradient(p: DTensor, stand_in: torch.Tensor) -> None:
        """The shard's gradient into the stand-in's ``.grad``, added to one waiting there (a
        parameter the engine takes over at step(), over several micro-batches)."""
        grad = p.grad.to_local()
        stand_in.grad = grad if stand_in.grad is None else stand_in.grad + grad
        p.grad = None

    def discard(self) -> None:
        """zero_grad(): gradients waiting in the stand-ins are dropped too."""
        for stand_in in self.local.values():
            stand_in.grad = None

    def mark_caller(self, link) -> None:
        """Order the step's copies against the caller's stream: FSDP2 runs the hooks on its
        reduce-scatter stream, which the next forward does not wait for."""
        if self.intake is not None and self.local:
            self.intake.training = link.mark(timed=False)

    def _follow(self, p: DTensor) -> torch.Tensor:
        """The stand-in, over the shard's memory as it is now: FSDP2's first forward may move a
        shard into a padded buffer of its own."""
        stand_in = self.local[id(p)]
        shard = p.to_local()
        if stand_in.data_ptr() != shard.data_ptr() or stand_in.shape != shard.shape:
            stand_in.data = shard.detach()
        if stand_in.requires_grad != p.requires_grad:
            stand_in.requires_grad_(p.requires_grad)
        return stand_in

    @torch.no_grad()
    def settle(self) -> None:
        """Before a step, a clip or a checkpoint: stand-ins over the shards' current memory, and a
        gradient left in a sharded parameter's ``.grad`` (set by hand, or by
        ``torch.distributed.checkpoint`` to build state) moved to its stand-in."""
        for stand_in in self.local.values():
            p = self.sharded[id(stand_in)]
            self._follow(p)
            if p.grad is not None:
                self._move_gradient(p, stand_in)
        if self.intake is not None:
            self._hook_trainable()

    def sum_across_ranks(self, value: float) -> float:
        """``value`` summed over the mesh's ranks (a gradient's sum of squares)."""
        device = self.mesh.device_type
        total = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.mesh.get_group())
        return float(total.item())

    def to_sharded(self, state_dict: dict, engine_groups: list) -> dict:
        """The engine's state dict with each sharded parameter's tensors as DTensors placed like
        the parameter, still in host memory (what ``torch.distributed.checkpoint`` saves shard by
        shard)."""
        index = [p for g in engine_groups for p in g["params"]]
        for number, entry in state_dict["state"].items():
            p = self.sharded.get(id(index[number]))
            if p is None:
                continue
            for key, value in entry.items():
                if value.dim():  # (the step counts are numbers, the same on every rank)
                    entry[key] = _torch_compat.dtensor_where_it_is(value, p)
        return state_dict

    def to_local(self, state_dict: dict, engine_groups: list) -> dict:
        """A state dict whose sharded parameters' tensors are DTensors placed like them, as plain
        local shards (a copy: the caller's dict is left as it was). Its entries are matched to
        parameters by the saved groups' order, as torch.optim does (ids or, from
        ``torch.distributed.checkpoint``, names)."""
        stand_in_of = {}
        for saved, own in zip(state_dict.get("param_groups") or [], engine_groups):
            if isinstance(saved, dict) and isinstance(saved.get("params"), list):
                stand_in_of.update(zip(saved["params"], own["params"]))
        state = {}
        for key, entry in (state_dict.get("state") or {}).items():
            p = self.sharded.get(id(stand_in_of.get(key)))
            state[key] = dict(entry) if isinstance(entry, dict) else entry
            for name, value in state[key].items() if isinstance(entry, dict) else ():
                if not isinstance(value, DTensor):
                    continue
                mesh = value.device_mesh.size()
                if (
                    p is None
                    or tuple(value.placements) != tuple(p.placements)
                    or (mesh != p.device_mesh.size())
                ):
                    raise ValueError(
                        f"state_dict: state[{key!r}][{name!r}]: expected a tensor sharded like "
                        f"its parameter ({tuple(p.placements) if p is not None else 'no'} "
                        f"shards over {p.device_mesh.size() if p is not None else 1} ranks); got "
                        f"{tuple(value.placements)} over {mesh} ranks"
                    )
                state[key][name] = value.to_local()
        return {**state_dict, "state": state}
