"""Two usual torch calls made to hold under CPUOffloadAdam, where they would silently do nothing.

``module.zero_grad()`` (instead of ``optimizer.zero_grad()``) also forgets the gradients a live
CPUOffloadAdam has already taken from the module's parameters, as it would with torch.optim.AdamW,
where they stay in ``.grad`` until then. And the usual clipping call is refused:

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` clips the gradients the model
holds; under :class:`~offloadlab.offload.CPUOffloadAdam` the gradients have left the model by
then, so the call would find nothing and clip nothing. Importing :mod:`offloadlab.offload`
wraps ``clip_grad_norm_`` and ``clip_grad_value_`` of ``torch.nn.utils`` (and of
``torch.nn.utils.clip_grad``) so that, given parameters a live CPUOffloadAdam manages, they
raise an error naming the call to make instead (``optimizer.clip_grad_norm_``); for every other
parameter they behave exactly as before. Code that bound the functions by name before importing
offloadlab keeps the unwrapped ones.
"""

from __future__ import annotations

import functools

import torch

from ..streaming import streamed_model_of
from .engine import managed, owner

__all__ = []


def _refusing_managed_parameters(clip):
    """Wrap a torch.nn.utils clipping function so it refuses parameters a CPUOffloadAdam manages."""

    @functools.wraps(clip)
    def checked(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(managed(p) for p in params):
            raise RuntimeError(f"{clip.__name__}: these parameters belong to a CPUOffloadAdam, which has already "
                               f"moved their gradients to host memory, so this call would change nothing; call "
                               f"optimizer.clip_grad_norm_(max_norm) instead")
        return clip(params, *args, **kwargs)

    checked.__wrapped_by_offloadlab__ = True
    return checked


def _wrap_torch_clipping() -> None:
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            original = getattr(module, name)
            if not getattr(original, "__wrapped_by_offloadlab__", False):
                setattr(module, name, _refusing_managed_parameters(original))


def _zero_grad_forgetting_taken_gradients(zero_grad):
    """Wrap nn.Module.zero_grad so it also forgets the gradients an offloaded optimizer holds for the module."""

    @functools.wraps(zero_grad)
    def checked(self, set_to_none: bool = True) -> None:
        params = list(self.parameters())
        for streamed in {id(m): m for p in params if (m := streamed_model_of(p)) is not None}.values():
            streamed.settle()  # a backward that raised: its gradients land first, to be zeroed with the rest
        zero_grad(self, set_to_none)
        engines: dict[int, tuple] = {}
        for p in params:
            engine = owner(p)
            if engine is not None:
                engines.setdefault(id(engine), (engine, []))[1].append(p)
        for engine, held in engines.values():
            engine.forget(held, set_to_none)

    checked.__wrapped_by_offloadlab__ = True
    return checked


_wrap_torch_clipping()
if not getattr(torch.nn.Module.zero_grad, "__wrapped_by_offloadlab__", False):
    torch.nn.Module.zero_grad = _zero_grad_forgetting_taken_gradients(torch.nn.Module.zero_grad)
