"""Answer checks for the labs: does the reader's answer agree with the measurement?

Each check prints one line — a tick, or a cross with the expected value and a hint — and
returns a truthy :class:`Verdict` only when the answer agrees, so a lab cell can
``assert check.answer(...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Verdict", "answer"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: whether it passed, and the line shown to the reader."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed


def answer(name: str, yours, expected, rel_tol: float = 0.05, hint: str = "") -> Verdict:
    """Compare ``yours`` with ``expected`` within a relative tolerance ``rel_tol`` (0.05 = 5 %)."""
    if not (isinstance(rel_tol, (int, float)) and 0 <= rel_tol < 1):
        raise ValueError(f"rel_tol: expected a fraction in [0, 1); got {rel_tol!r}")
    if yours is None or yours is Ellipsis:
        verdict = Verdict(False, f"✗ {name}: no answer yet")
    else:
        try:
            value = float(yours)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected a number as the answer; got {yours!r}") from None
        ok = math.isclose(value, float(expected), rel_tol=rel_tol, abs_tol=0.0)
        if ok:
            verdict = Verdict(True, f"✓ {name}: {value:.4g} agrees with {float(expected):.4g}")
        else:
            extra = f" Hint: {hint}" if hint else ""
            verdict = Verdict(False, f"✗ {name}: {value:.4g}, but the measurement says "
                                     f"{float(expected):.4g} (tolerance {rel_tol:.0%}).{extra}")
    print(verdict.message)
    return verdict
