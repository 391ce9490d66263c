"""Who holds a parameter, and what parameter streaming and the optimizer promise each other.

A parameter can be *streamed* (a :class:`~offloadlab.streaming.StreamedModel` keeps its weights in
pinned host memory and moves them) and *optimized* (a :class:`~offloadlab.offload.CPUOffloadAdam`
keeps its state and takes its gradients), by one of each at a time. Neither mechanism imports the
other: both enter their parameters in the one registry here, and they meet through two small
protocols —

- :class:`GradientSink`: what takes a group's gradients as they go down to the host. A
  :class:`~offloadlab.gather.GradientGather` delivers to one; a StreamedModel is one for its
  blocks' gathers and passes them on to the sink attached to a block; CPUOffloadAdam's intake
  implements it.
- :class:`Streamer`: what an optimizer may ask of the StreamedModel that streams its parameters.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import _torch_compat

__all__ = ["GradientSink", "Streamer", "streamer_of", "optimizer_of", "hold", "release"]


class GradientSink(Protocol):
    """Takes the gradients of numbered groups of tensors (a streamed block, an optimizer bucket)."""

    def gradient_destination(self, group: int, positions: list[int]) -> torch.Tensor:
        """The flat pinned host tensor (uint8, laid out as the group's packed layout) that the
        gradients of the group's tensors at ``positions`` are about to be copied into; called
        just before the copies are issued, so the sink can first make room (wait, or fold what is
        there)."""

    def gradients_sent(self, group: int, transfers: list, positions: list[int]) -> None:
        """The copies bringing those gradients down have been issued (they may still be in
        flight)."""


class Streamer(Protocol):
    """What a StreamedModel offers an optimizer over the parameters it streams."""

    link: object  # the Link its copies go over
    names: list[str]  # each block's name in the model

    def block_of(self, param: torch.Tensor) -> int:
        """The index of the streamed block ``param`` belongs to."""

    def gradient_layout(self, block: int) -> tuple[list[torch.Tensor], object]:
        """The block's trainable parameters and their packed Layout (how its gradients go down)."""

    def attach_sink(self, block: int, sink: GradientSink, group: int) -> None:
        """Send the block's gradients to ``sink``, as group ``group``, instead of ``.grad``."""

    def detach_sink(self, block: int, sink: GradientSink) -> None:
        """Put the block's gradients in ``.grad`` again."""

    def write_host_weights(self, block: int, values) -> None:
        """Copy new values into the block's trainable parameters (their host memory)."""

    def settle(self) -> None:
        """Outside backward: finish a backward pass that raised (its gradients are sent first)."""


class _Holders:
    __slots__ = ("streamer", "optimizer")

    def __init__(self):
        self.streamer = self.optimizer = None


# parameter → its _Holders (tensors compare elementwise: keyed by identity)
_HOLDERS = _torch_compat.WeakIdKeyDictionary()


def streamer_of(param: torch.Tensor) -> Streamer | None:
    """The StreamedModel that streams ``param``, or None."""
    holders = _HOLDERS.get(param)
    return None if holders is None else holders.streamer


def optimizer_of(param: torch.Tensor):
    """The live optimizer engine that holds ``param``'s state and takes its gradients, or None."""
    holders = _HOLDERS.get(param)
    return None if holders is None else holders.optimizer


def hold(param: torch.Tensor, *, streamer=None, optimizer=None) -> None:
    """Enter ``streamer`` and/or ``optimizer`` as ``param``'s (replacing an earlier one of that
    role)."""
    holders = _HOLDERS.get(param)
    if holders is None:
        holders = _HOLDERS[param] = _Holders()
    if streamer is not None:
        holders.streamer = streamer
    if optimizer is not None:
        holders.optimizer = optimizer


def release(param: torch.Tensor, holder) -> None:
    """Remove ``holder`` (a streamer or an optimizer) from ``param``'s entry, if it is there."""
    holders = _HOLDERS.get(param)
    if holders is None:
        return
    if holders.streamer is holder:
        holders.streamer = None
    if holders.optimizer is holder:
        holders.optimizer = None
    if holders.streamer is None and holders.optimizer is None:
        del _HOLDERS[param]
