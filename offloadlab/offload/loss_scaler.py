"""Loss scaling for fp16 weights, with torch.amp.GradScaler's knobs and semantics.

fp16 gradients underflow to zero below about 6e-8; multiplying the loss by a large scale keeps
them representable, and the update divides it out again. With a dynamic scale, a step whose
gradients overflowed (an inf or nan anywhere) is skipped and the scale multiplied by
``backoff_factor``; after ``growth_interval`` good steps in a row it grows by ``growth_factor``.
"""

from __future__ import annotations

import math
import weakref

from ..units import check_integer, is_number, plain_scalar

__all__ = ["LossScaler"]


def _positive(value, name: str) -> float:
    if not is_number(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number; got {value!r}")
    return float(value)


class LossScaler:
    """The loss scale of one fp16 training run (a fixed scale with ``dynamic=False``), for one
    optimizer at a time: each step moves it."""

    _user = None  # a weak reference to the optimizer whose steps it scales

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic: bool = True,
    ):
        init_scale, growth_factor, backoff_factor, growth_interval = map(
            plain_scalar, (init_scale, growth_factor, backoff_factor, growth_interval)
        )  # (numpy's numbers as Python's)
        if not isinstance(dynamic, bool):  # ("no" is true to Python)
            raise ValueError(f"dynamic: expected True or False; got {dynamic!r}")
        self.scale = _positive(init_scale, "init_scale")
        if not math.isfinite(1.0 / self.scale) or self.scale > 2.0**64:  # (fp16 tops at 65504)
            raise ValueError(
                f"init_scale: expected a scale from 1e-308 to 2**64; got {init_scale!r}"
            )
        self.growth_factor = _positive(growth_factor, "growth_factor")
        self.backoff_factor = _positive(backoff_factor, "backoff_factor")
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor: expected a number > 1; got {growth_factor!r}")
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor: expected a number < 1; got {backoff_factor!r}")
        self.growth_interval = check_integer(growth_interval, "growth_interval")
        self.dynamic = dynamic
        self.good_steps = 0  # steps in a row without overflow
        self.skipped_steps = 0  # steps skipped for overflow, over the whole run

    @classmethod
    def from_argument(cls, loss_scale) -> "LossScaler":
        """``'dynamic'``, a fixed positive number, or a LossScaler (as CPUOffloadAdam's
        ``loss_scale`` takes)."""
        if isinstance(loss_scale, cls):
            return loss_scale
        loss_scale = plain_scalar(loss_scale)  # (numpy's numbers as Python's)
        if isinstance(loss_scale, str) and loss_scale == "dynamic":
            return cls()
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            return cls(init_scale=_positive(loss_scale, "loss_scale"), dynamic=False)
        raise ValueError(
            f"loss_scale: expected 'dynamic', a positive number or a LossScaler; got {loss_scale!r}"
        )

    def check_free(self, user) -> None:
        """ValueError while an optimizer other than ``user`` that is not closed uses this scaler
        (both would move the scale each step, and one would unscale by the other's)."""
        other = self._user() if self._user is not None else None
        if other is not None and other is not user and getattr(other, "closed", None) is None:
            raise ValueError(
                "loss_scale: this LossScaler already scales another optimizer's steps, and each "
                "step moves it; give each optimizer its own (or close the other first)"
            )

    def claim(self, user) -> None:
        """Scale ``user``'s steps (see :meth:`check_free`)."""
        self.check_free(user)
        self._user = weakref.ref(user)

    def update(self, overflowed: bool) -> None:
        """After a step: back off and count a skip on overflow; grow after enough good steps.
        RuntimeError when backing off leaves no scale at all (every step overflowed)."""
        if overflowed:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                if not math.isfinite(1.0 / max(self.scale * self.backoff_factor, 1e-320)):
                    raise RuntimeError(
                        f"loss scale: backed off to nothing after {self.skipped_steps} skipped "
                        "steps; the gradients overflow at any scale (is the loss itself nan or "
                        "inf?)"
                    )
                self.scale *= self.backoff_factor
            return
        self.good_steps += 1
        grown = self.scale * self.growth_factor
        if self.dynamic and self.good_steps % self.growth_interval == 0 and math.isfinite(grown):
            self.scale = grown  # (never to inf, after which every step would be skipped)

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`, the scale, its counts and its knobs (validated
        before anything changes)."""
        if not isinstance(state, dict):
            raise ValueError(
                f"state_dict: offload: expected the dict LossScaler.state_dict() gives; got "
                f"{type(state).__name__}"
            )
        saved = {key: plain_scalar(value) for key, value in state.items()}
        try:
            restored = LossScaler(
                init_scale=saved.get("scale", self.scale),
                growth_factor=saved.get("growth_factor", self.growth_factor),
                backoff_factor=saved.get("backoff_factor", self.backoff_factor),
                growth_interval=saved.get("growth_interval", self.growth_interval),
                dynamic=saved.get("dynamic", self.dynamic),
            )
        except ValueError as error:  # (named by the key it came from)
            raise ValueError(
                f"state_dict: offload: {str(error).replace('init_scale:', 'scale:', 1)}"
            ) from None
        counts = {k: saved.get(k, getattr(self, k)) for k in ("good_steps", "skipped_steps")}
        for name, value in counts.items():
            counts[name] = check_integer(
                value, f"state_dict: offload: {name}", 0, expected="a whole number ≥ 0"
            )
        self.__dict__.update(restored.__dict__, **counts)
