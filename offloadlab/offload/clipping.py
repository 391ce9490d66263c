"""The usual clipping call, refused where it would silently do nothing.

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

from .engine import managed

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


_wrap_torch_clipping()
