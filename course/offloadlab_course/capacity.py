"""Device memory of a training run under CPUOffloadAdam, known before the run: lab 4's cap.

A cap set with ``torch.cuda.set_per_process_memory_fraction`` bounds what the caching allocator
may *reserve*, and an offloaded run still needs on the device:

- its weights, in their dtype;
- the activations autograd saves for backward — counted by
  :func:`offloadlab.models.saved_activation_bytes` on the meta device (no memory, no compute); on
  a GPU, fused attention keeps less than this count (it saves no attention matrix), so the count
  errs on the side of room;
- CPUOffloadAdam's own device buffers: two gather buffers of a bucket and a staging buffer;

plus headroom for what is not saved but lives for a while: the logits' gradient at the start of
backward, cuBLAS workspaces, the allocator's rounding and fragmentation. The cap is that need
plus :data:`HEADROOM`; plain AdamW's state alone — fp32 weights, gradients and two moments,
16 bytes per parameter — must exceed it, or the lab's point (AdamW runs out of memory where the
offloaded run trains) would not hold.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from offloadlab.models import GPTConfig, saved_activation_bytes
from offloadlab.units import check_integer, plain_scalar

__all__ = [
    "HEADROOM",
    "LAB_CONFIG",
    "LAB_BATCH",
    "DeviceNeed",
    "offloaded_need",
    "lab_cap",
]

HEADROOM = 0.20  # of the need: transient tensors, workspaces, the allocator's rounding
# lab 4 and the GPU memory test
LAB_CONFIG = GPTConfig(layers=12, hidden=1024, heads=16, vocab=16384, seq=256)
LAB_BATCH = 8
PLAIN_ADAMW_BYTES_PER_PARAM = 16  # fp32 weights, gradients, exp_avg, exp_avg_sq


@dataclasses.dataclass(frozen=True)
class DeviceNeed:
    """Bytes an offloaded TinyGPT run needs on the device, by part, and the cap that leaves it
    room."""

    weights: int
    activations: int
    buffers: int
    plain_adamw_state: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.buffers

    @property
    def cap(self) -> int:
        """The need plus :data:`HEADROOM`."""
        return math.ceil(self.total * (1 + HEADROOM))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "cap": self.cap}


def offloaded_need(
    config: GPTConfig,
    batch: int,
    dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int = 16 * 2**20,
) -> DeviceNeed:
    """The device memory of training ``config`` on ``batch`` sequences under CPUOffloadAdam, with
    device weights in ``dtype`` and buckets of ``bucket_bytes`` (see the module docstring)."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config: expected a GPTConfig; got {type(config).__name__}")
    batch = check_integer(plain_scalar(batch), "batch")  # (numpy's integers as Python's)
    bucket_bytes = check_integer(
        plain_scalar(bucket_bytes), "bucket_bytes", expected="a positive whole number of bytes"
    )
    params = config.params
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch dtype; got {dtype!r}")
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buffers = 3 * bucket_bytes  # two gather buffers and the staging buffer of the weights going up
    return DeviceNeed(
        weights=params * itemsize,
        activations=saved_activation_bytes(config, batch, dtype),
        buffers=buffers,
        plain_adamw_state=PLAIN_ADAMW_BYTES_PER_PARAM * params,
    )


def lab_cap(
    config: GPTConfig = LAB_CONFIG,
    batch: int = LAB_BATCH,
    dtype: torch.dtype = torch.bfloat16,
    bucket_bytes: int = 16 * 2**20,
) -> int:
    """Lab 4's device-memory cap in bytes: room for the offloaded run, below plain AdamW's state.

    ValueError when no such cap exists for this shape (the activations alone outgrow AdamW's state:
    a smaller batch would do)."""
    need = offloaded_need(config, batch, dtype, bucket_bytes)
    if need.cap >= need.plain_adamw_state:
        raise ValueError(
            f"config: the offloaded run needs {need.cap} bytes with headroom, not less than plain "
            f"AdamW's {need.plain_adamw_state} bytes of state; choose a smaller batch or sequence"
        )
    return need.cap
