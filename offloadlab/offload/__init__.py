"""Optimizer offload: AdamW with its state in host memory and its update on the CPU.

:class:`CPUOffloadAdam` is the optimizer (a ``torch.optim.Optimizer``); the modules behind it
each do one job — :mod:`~offloadlab.offload.host_state` (buckets, the flat pinned buffers and the
state-dict mapping), :mod:`~offloadlab.offload.intake` (gradients down, micro-batches summed),
:mod:`~offloadlab.offload.worker` (the CPU update and the weights back up),
:mod:`~offloadlab.offload.loss_scaler` (fp16 loss scaling),
:mod:`~offloadlab.offload.torch_calls` (``module.zero_grad`` and the usual clipping call, made to hold)
and :mod:`~offloadlab.offload.engine` (what ties them together and owns their lifetime).
"""

from . import torch_calls  # noqa: F401  (module.zero_grad and clipping made to hold, see there)
from .loss_scaler import LossScaler
from .optimizer import CPUOffloadAdam, managed

__all__ = ["CPUOffloadAdam", "LossScaler", "managed"]
