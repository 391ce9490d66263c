"""Optimizer offload: AdamW with its state in host memory and its update on the CPU.

:class:`CPUOffloadAdam` is the optimizer (a ``torch.optim.Optimizer``); the modules behind it
each do one job — :mod:`~offloadlab.offload.bucket` (parameters that move and update together,
and how far each bucket has got), :mod:`~offloadlab.offload.host_state` (the flat host buffers
and the state-dict mapping), :mod:`~offloadlab.offload.edits` (weights changed by hand, found by a
fingerprint on the device), :mod:`~offloadlab.offload.intake` (gradients down),
:mod:`~offloadlab.offload.worker` (the CPU update and the weights back up),
:mod:`~offloadlab.offload.loss_scaler` (fp16 loss scaling),
:mod:`~offloadlab.offload.device_update` (the share updated on the device: kept there, or parked
in host memory between steps), :mod:`~offloadlab.offload.sharded` (FSDP2's shards, one rank's
each) and
:mod:`~offloadlab.offload.engine` (when the update runs, what ties them together and owns their
lifetime). Importing it changes nothing in torch.
"""

from .loss_scaler import LossScaler
from .optimizer import CPUOffloadAdam, managed

__all__ = ["CPUOffloadAdam", "LossScaler", "managed"]
