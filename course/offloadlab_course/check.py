"""Answer checks for the labs: does the reader's answer agree with what their machine produced?

Each check prints one line — a tick, or a cross that says which way the answer is off and
roughly by how much — and returns a :class:`Verdict` that is truthy only when the answer
agrees, so a lab cell can ``assert check.answer(...)``.

Two releases, one source. In the self-study book a failed check also shows the expected
value, because a reader working alone learns from seeing it. In the student release (the
notebooks ``make student`` and nbgrader hand out) it never does: the expected value is the
answer to the exercise. A check knows it is in the student release when the environment
variable ``OFFLOADLAB_STUDENT`` is set to anything but ``""`` or ``"0"``. An environment
variable rather than an argument, because the release converter writes it into each student
notebook (so a notebook is safe wherever it is opened), a JupyterHub can set it for every
student at once, and ``make book-student`` already sets it for the student site.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from types import MappingProxyType
from decimal import Decimal
from fractions import Fraction

from offloadlab.units import is_number, plain_scalar
from offloadlab_course import watch

__all__ = ["Verdict", "answer", "exact", "read_only", "student_release", "STUDENT_VARIABLE"]

STUDENT_VARIABLE = "OFFLOADLAB_STUDENT"

# Ratios between an answer and the expected value that usually mean a unit slipped, not a
# wrong idea. Matched within UNIT_SLIP_WINDOW (relative), in either direction.
UNIT_SLIPS = (
    (8.0, "bits against bytes"),
    (2**20 / 1e6, "MB against MiB"),
    (2**30 / 1e9, "GB against GiB"),
    (1e3, "a decimal prefix (kilo or milli)"),
    (1e6, "a decimal prefix (mega or micro)"),
    (1e9, "a decimal prefix (giga or nano)"),
    (2.0**10, "a binary prefix (KiB)"),
    (2.0**20, "a binary prefix (MiB)"),
    (2.0**30, "a binary prefix (GiB)"),
)
UNIT_SLIP_WINDOW = 0.001

# How far off an answer is, told roughly: (largest factor, words), first match wins.
ROUGHLY = (
    (1.1, "by less than 10 %"),
    (1.5, "by 10 % to 50 %"),
    (3.0, "by a factor of 1.5 to 3"),
    (10.0, "by a factor of 3 to 10"),
    (1000.0, "by a factor of 10 to 1000"),
    (math.inf, "by more than a factor of 1000"),
)


class ReadOnlyClass(type):
    """The class of a course class that a notebook cannot change once :func:`sealed`: a property
    set on a check's result class would make every check pass."""

    def __setattr__(cls, name, value):
        if vars(cls).get("_sealed_class"):
            raise AttributeError(f"{cls.__name__}.{name}: the course's classes are read-only here")
        super().__setattr__(name, value)

    def __delattr__(cls, name):
        if vars(cls).get("_sealed_class"):
            raise AttributeError(f"{cls.__name__}.{name}: the course's classes are read-only here")
        super().__delattr__(name)


def sealed(cls):
    """``cls`` (made with :class:`ReadOnlyClass`), its attributes read-only from now on."""
    type.__setattr__(cls, "_sealed_class", True)
    return cls


@sealed
@dataclass(frozen=True)
class Verdict(metaclass=ReadOnlyClass):
    """The outcome of one check: whether it passed, and the line shown to the reader."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed


def read_only(value):
    """``value`` with every dict made a read-only mapping and every list a tuple, all the way
    down: a lab's measurements, out of reach of an answer that would change what a check reads
    (``def f(d): d["H2D"] = []``, ``operator.setitem``, ``paths.clear()``)."""
    if isinstance(value, (dict, MappingProxyType)):
        return MappingProxyType({key: read_only(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(read_only(item) for item in value)
    return value


def student_release() -> bool:
    """True when checks must not show expected values (``OFFLOADLAB_STUDENT`` is set)."""
    return os.environ.get(STUDENT_VARIABLE, "") not in ("", "0")


def answer(name: str, yours, expected, rel_tol: float = 0.05, hint: str = "") -> Verdict:
    """Check that ``yours`` is within ``rel_tol`` of ``expected``, relative to ``expected``.

    The answer passes when ``|yours - expected| <= rel_tol * |expected|``: with
    ``rel_tol=0.25`` an expected 100 accepts 75 to 125, so 133 fails. ``rel_tol=0`` asks for
    the exact value. Numbers are compared exactly (integers of any size, floats as the
    binary fractions they are). An answer that is not a finite real number — a bool, a
    string, NaN, infinity, a tensor of several elements — fails with a line saying so.
    ``expected`` must be a finite real number, since the lab computes it.
    """
    if not (is_number(plain_scalar(rel_tol)) and 0 <= rel_tol < 1):  # (numpy's numbers too)
        raise ValueError(f"rel_tol: expected a fraction in [0, 1); got {rel_tol!r}")
    rel_tol = float(rel_tol)
    target = _number(expected)
    if target is None:
        raise ValueError(f"expected: expected a finite real number; got {expected!r}")
    if yours is None or yours is Ellipsis:
        return _report(name, Verdict(False, f"✗ {name}: no answer yet"))
    value = _number(yours)
    if value is None:
        return _report(
            name,
            Verdict(False, f"✗ {name}: expected a finite real number as the answer; got {yours!r}"),
        )
    tolerance = "exactly" if rel_tol == 0 else f"within {_percent(rel_tol)}"
    if abs(value - target) <= Fraction(rel_tol) * abs(target):
        if student_release():
            line = f"✓ {name}: your answer agrees ({tolerance})"
        else:
            line = f"✓ {name}: {_show(value)} agrees with {_show(target)} ({tolerance})"
        return _report(name, Verdict(True, line))
    if student_release():
        must = "match exactly" if rel_tol == 0 else f"be {tolerance}"
        line = f"✗ {name}: your answer is {_how_far_off(value, target)} (it must {must})."
    else:
        yours, expected = _show(value), _show(target)
        if yours == expected:  # (0.1 + 0.2 against 0.3: six figures do not tell them apart)
            yours, expected = _show(value, digits=17), _show(target, digits=17)
        line = (
            f"✗ {name}: {yours}, but {expected} was expected ({tolerance}); yours is "
            f"{_how_far_off(value, target)}."
        )
    return _report(
        name, Verdict(False, line + _unit_slip(value, target) + (f" Hint: {hint}" if hint else ""))
    )


def exact(name: str, yours, expected, hint: str = "") -> Verdict:
    """Check an answer that is not a quantity — a batch from a list, a name, ``None`` — for
    equality.

    Numbers go through :func:`answer` with ``rel_tol=0``, so the reader still learns which way
    a number is off. In the student release a wrong answer is not shown the expected one.
    """
    if _number(yours) is not None and _number(expected) is not None:
        return answer(name, yours, expected, rel_tol=0, hint=hint)
    if yours is Ellipsis:
        return _report(name, Verdict(False, f"✗ {name}: no answer yet"))
    if _not_finite(yours):
        return _report(
            name,
            Verdict(False, f"✗ {name}: expected a finite real number as the answer; got {yours!r}"),
        )
    bad = next(filter(_not_finite, yours), None) if isinstance(yours, (list, tuple)) else None
    if bad is not None:
        return _report(
            name, Verdict(False, f"✗ {name}: {yours!r:.200} holds {bad!r}, which is no answer")
        )
    if _same(yours, expected):
        shown = "your answer agrees" if student_release() else f"{yours!r} agrees"
        return _report(name, Verdict(True, f"✓ {name}: {shown}"))
    shown = (
        f"{yours!r} is not it" if student_release() else f"{yours!r}, but {expected!r} was expected"
    )
    return _report(name, Verdict(False, f"✗ {name}: {shown}." + (f" Hint: {hint}" if hint else "")))


def _not_finite(x) -> bool:
    """A float (numpy's too) that is nan or infinite; an int never is."""
    real = isinstance(x, numbers.Real) and not isinstance(x, (bool, numbers.Integral))
    return real and not math.isfinite(x)


def _same(yours, expected) -> bool:
    """Equal, and of one type (but numbers, equal in value: 1 and 1.0); arrays and tensors element
    by element, shapes included (their ``==`` is an array, whose truth is ambiguous)."""
    if yours is expected:  # (as Python's == does first: a list that holds itself)
        return True
    values = _number(yours), _number(expected)
    if None not in values:
        return values[0] == values[1]
    if type(yours) is not type(expected):
        return False
    if isinstance(yours, dict):
        return yours.keys() == expected.keys() and all(_same(yours[k], expected[k]) for k in yours)
    if isinstance(yours, (list, tuple)):
        return len(yours) == len(expected) and all(map(_same, yours, expected))
    try:
        return bool(yours == expected)
    except (ValueError, RuntimeError, NotImplementedError):
        import numpy as np

        try:
            if hasattr(yours, "equal") and callable(yours.equal):  # a torch tensor
                dense = getattr(yours, "is_sparse", False)
                return bool(
                    yours.to_dense().equal(expected.to_dense()) if dense else yours.equal(expected)
                )
            return bool(np.array_equal(yours, expected))
        except (ValueError, RuntimeError, NotImplementedError):  # (meta tensors hold no values)
            return False


def _number(x) -> Fraction | None:
    """``x`` as an exact Fraction when it is a finite real number, else None.

    Booleans are refused (``True`` is not the answer 1), and so are strings (``"3"`` is text).
    Integers stay exact however large; anything with ``__float__`` (numpy and one-element
    torch scalars) goes through float, unless its dtype is boolean.
    """
    if isinstance(x, (bool, str, bytes)) or "bool" in str(getattr(x, "dtype", "")):
        return None
    if isinstance(x, int):  # int's own value: a subclass could redefine __int__
        return Fraction(int.__int__(x))
    if isinstance(x, numbers.Integral):
        return Fraction(int(x))
    if isinstance(x, Fraction):  # rebuilt: a subclass could redefine its arithmetic
        return Fraction(int(x.numerator), int(x.denominator))
    try:
        value = float.__float__(x) if isinstance(x, float) else float(x)  # (the same for float)
    # torch raises RuntimeError for many elements
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None
    return Fraction(value) if math.isfinite(value) else None


def _show(x: Fraction, digits: int = 6) -> str:
    """Whole numbers in full (byte counts), others to ``digits`` significant figures, at any size
    (through Decimal: a float would overflow past 1e308)."""
    if x.denominator == 1 and abs(x.numerator) < 10**15:
        return f"{x.numerator:,}"
    quotient = Decimal(x.numerator) / Decimal(x.denominator)
    mantissa, _, exponent = f"{quotient:.{digits}g}".partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return mantissa + (f"e{exponent}" if exponent else "")


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g} %"


def _how_far_off(value: Fraction, target: Fraction) -> str:
    """Which way and roughly how far, without the expected value: 'too high by 10 % to 50 %'."""
    if target == 0:
        return "too high" if value > 0 else "too low"
    if value == 0 or (value > 0) != (target > 0):
        return "of the wrong sign" if value != 0 else "zero, and the answer is not"
    direction = "too high" if value > target else "too low"
    factor = max(abs(value / target), abs(target / value))
    return f"{direction} {next(words for limit, words in ROUGHLY if factor < limit)}"


def _unit_slip(value: Fraction, target: Fraction) -> str:
    """' Off by a factor of 8: bits against bytes?' when the ratio is a classic unit slip."""
    if value == 0 or target == 0:
        return ""
    ratio = float(abs(value / target)) if abs(value) < abs(target) * 10**12 else math.inf
    for factor, slip in UNIT_SLIPS:
        for candidate in (factor, 1 / factor):
            if abs(ratio / candidate - 1) <= UNIT_SLIP_WINDOW:
                if student_release():  # (the factor would give the expected value away)
                    return " Check your units."
                return f" That is a factor of {factor:.6g}: {slip}?"
    return ""


def _report(name: str, verdict: Verdict) -> Verdict:
    if verdict.passed and (why := watch.why_not_checked()):
        verdict = Verdict(False, f"✗ {name}: {why}")
    print(verdict.message)
    return verdict
