"""When CPUOffloadAdam's update runs: one small object per schedule, asked by ``step()``.

- :class:`AtStep` (the default): ``step()`` hands every bucket with gradients to the worker and
  returns once each bucket's update is done and its new weights are on their way up.
- :class:`Eager` (``accumulation_steps=k``): a bucket is handed over during backward, the moment
  its k-th micro-batch has landed; ``step()`` hands over the stragglers and waits as AtStep does.
- :class:`Delayed` (``delayed_update=True``, ZeRO-Offload's delayed parameter update): ``step()``
  first applies the last step's update — waits for it and sends its weights up — then hands this
  step's over and returns; it runs during the next forward and backward.

``step()`` calls :meth:`before_update` first and :meth:`after_handing_over` last; ``finish``
(the engine's) waits for buckets' updates and, with ``upload=True``, sends their weights up.
"""

from __future__ import annotations

__all__ = ["AtStep", "Eager", "Delayed", "choose"]


class AtStep:
    """The update runs inside step()."""

    eager_after: int | None = None  # micro-batches after which a bucket is handed over in backward
    # the worker sends each bucket's weights up as soon as it is updated
    upload_after_update = True
    name = "at step"

    def before_update(self, finish, submitted: list) -> None:
        """Before this step's gradients are handed over (``submitted``: buckets still with the
        worker)."""

    def after_handing_over(self, finish, submitted: list) -> None:
        """After: wait for every update, so the new weights are on their way up when step()
        returns."""
        finish(submitted, upload=False)

    def pending_upload(self) -> bool:
        """Whether a bucket's weights still have to be sent up once its update is done."""
        return False


class Eager(AtStep):
    """A bucket's update starts during backward, once its ``micro_batches``-th gradients have
    landed."""

    name = "eager"

    def __init__(self, micro_batches: int):
        self.eager_after = micro_batches


class Delayed:
    """The update of step t runs during step t + 1's forward and backward and is applied at its
    step()."""

    eager_after = None
    upload_after_update = False
    name = "delayed"

    def before_update(self, finish, submitted: list) -> None:
        """Apply the last step's update: wait for it and send its weights up."""
        finish(submitted, upload=True)

    def after_handing_over(self, finish, submitted: list) -> None:
        """Return at once: the update runs behind the next forward and backward."""

    def pending_upload(self) -> bool:
        return True


def choose(accumulation_steps: int | None, delayed_update: bool, clipping: bool, fp16: bool):
    """The schedule the constructor's arguments ask for. Clipping and fp16 loss scaling need
    every gradient before any update starts, so accumulation_steps then only declares, and runs
    at step."""
    if delayed_update:
        return Delayed()
    if accumulation_steps is not None and not clipping and not fp16:
        return Eager(accumulation_steps)
    return AtStep()
