"""Sizes, bandwidths and times: parsing, validation and formatting.

Every quantity in offloadlab is held in base SI units: sizes in bytes, bandwidths in
bytes per second, times in seconds. This module turns what people write ("80 GB",
"32 GB/s", "250 ms") into those numbers, refuses anything malformed with a
``ValueError`` that names the argument and the accepted forms, and formats numbers
back for display.

Decimal and binary prefixes stay distinct: "1 GB" is 10**9 bytes, "1 GiB" is 2**30. Units are
read without regard to case where that is unambiguous ("gb" is "GB"), except that "Gb" — a
capital prefix and a small b — is gigabits by convention, so it is refused with a note (write
"GB", or "Gbit" to mean bits). A string must carry its unit: "80" could be bytes or gigabytes,
so it is refused with the reading most likely meant ("did you mean '80 GB'?"). A Python number
is in base units, as computed values are.
"""

from __future__ import annotations

import math
import numbers
import re

__all__ = [
    "parse_size",
    "parse_bandwidth",
    "parse_duration",
    "parse_count",
    "parse_flops",
    "check_positive",
    "check_non_negative",
    "check_integer",
    "is_integer",
    "is_number",
    "format_size",
    "format_bandwidth",
    "format_duration",
    "format_count",
]

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
# A size's unit, read without regard to case: an SI or binary prefix, then bytes or bits.
_SIZE_UNIT = re.compile(
    r"^(?P<prefix>[kmgtp]?)(?P<binary>i?)(?P<base>bytes?|bits?|b)$", re.IGNORECASE
)
_TIME_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
_DIGITS = r"\d(?:_?\d)*"  # (grouped with single underscores, as Python writes 10_000)
_NUMBER = rf"[+-]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?{_DIGITS})?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-zµμ/]*)\s*$")  # (the micro sign, or Greek mu)

# (In Python a number is taken in base units: bytes, bytes/s, seconds.)
SIZE_FORMS = "a size with its unit, such as '80 GB', '512 MiB', '1.5 TB'"
BANDWIDTH_FORMS = "a rate with its unit, such as '32 GB/s', '900 MiB/s', '400 Gbit/s'"
DURATION_FORMS = "a time with its unit, such as '250 ms', '1.5 s', '40 us'"
COUNT_FORMS = "a number such as 10e9, 7000000000, 7_000_000_000 or '1.3e9'"


def _fail(name: str, value, forms: str, why: str = "") -> ValueError:
    reason = f" ({why})" if why else ""
    return ValueError(f"{name}: expected {forms}; got {value!r}{reason}")


def _split(value, name: str, forms: str) -> tuple[float, str | None]:
    """Split a number-with-unit into (number, unit); a Python number has unit None, a bare string
    ''."""
    if isinstance(value, bool):
        raise _fail(name, value, forms)
    value = plain_scalar(value)  # (numpy's numbers as Python's)
    if isinstance(value, (int, float)):
        if isinstance(value, int) and abs(value) > 10**308:  # beyond any float
            raise _fail(name, value, forms, "must be finite")
        return float(value), None
    if not isinstance(value, str):
        raise _fail(name, value, forms)
    match = _QUANTITY.match(value)
    if not match:
        raise _fail(name, value, forms, "not a number with a unit")
    return float(match.group(1)), match.group(2)


def _checked(number: float, name: str, value, forms: str, allow_zero: bool) -> float:
    if math.isnan(number) or math.isinf(number):
        raise _fail(name, value, forms, "must be finite")
    if number < 0:
        raise _fail(name, value, forms, "must not be negative")
    if number == 0 and not allow_zero:
        raise _fail(name, value, forms, "must be greater than zero")
    return number


def _size_factor(unit: str, name: str, value, forms: str) -> float:
    """Bytes per ``unit`` ('GB', 'gb', 'GiB', 'Gbit'); 'Gb' is refused: by convention it means
    gigabits."""
    match = _SIZE_UNIT.match(unit)
    if not match or (match["binary"] and not match["prefix"]):
        raise _fail(name, value, forms, f"unknown unit {unit!r}")
    prefix, base = match["prefix"], match["base"]
    if base == "b" and prefix.isupper():  # 'Gb', 'Mb': the networking convention for bits
        names = _BINARY_NAMES if match["binary"] else _PREFIX_NAMES
        raise _fail(
            name,
            value,
            forms,
            f"{unit!r} means {names[prefix.lower()]}bits; write '{prefix}{match['binary']}B' for "
            f"bytes, or '{prefix}{match['binary']}bit' for bits",
        )
    factor = (_BINARY if match["binary"] else _DECIMAL)[prefix.lower()]
    return factor / 8 if base.lower().startswith("bit") else factor


_PREFIX_NAMES = {"k": "kilo", "m": "mega", "g": "giga", "t": "tera", "p": "peta"}
_BINARY_NAMES = {"k": "kibi", "m": "mebi", "g": "gibi", "t": "tebi", "p": "pebi"}


def _bare(number: float, name: str, value, kind: str, unit: str) -> ValueError:
    """The refusal of a number typed without its unit, with the reading most likely meant."""
    if number >= 1e5 and unit.startswith("G"):  # more likely a count of bytes than of gigabytes
        guess = f"{number:.0f} {unit.removeprefix('G')}"
    else:
        guess = f"{number:g} {unit}"
    return ValueError(
        f"{name}: expected {kind} with its unit; got {value!r}: did you mean {guess!r}?"
    )


def _parse(value, name: str, forms: str, allow_zero: bool, factor_of, guess_unit: str) -> float:
    """A number with a unit (``factor_of(unit)`` gives its scale), checked; a Python number is in
    base units."""
    number, unit = _split(value, name, forms)
    if unit == "":
        raise _bare(number, name, value, forms.split(" with ")[0], guess_unit)
    if unit is not None:
        number *= factor_of(unit)
    return _checked(number, name, value, forms, allow_zero)


def _plain(value, name: str, forms: str, allow_zero: bool) -> float:
    """A number that takes no unit (a count, a fraction); a string is read as a number."""
    number, unit = _split(value, name, forms)
    if unit:
        raise _fail(name, value, forms, "it takes no unit")
    return _checked(number, name, value, forms, allow_zero)


def parse_size(value, name: str = "size", allow_zero: bool = False) -> float:
    """Bytes from a string like '80 GB' / '512 MiB' (any case; 'Gb' is gigabits and refused), or a
    Python number of bytes. A string without a unit is refused: '80' names no size."""
    return _parse(
        value,
        name,
        SIZE_FORMS,
        allow_zero,
        lambda unit: _size_factor(unit, name, value, SIZE_FORMS),
        "GB",
    )


def parse_bandwidth(value, name: str = "bandwidth") -> float:
    """Bytes per second from a string like '32 GB/s' or '400 Gbit/s', or a Python number of B/s."""

    def factor(unit: str) -> float:
        if not unit.lower().endswith("/s") or unit.count("/") != 1:
            raise _fail(name, value, BANDWIDTH_FORMS, f"unknown unit {unit!r}")
        return _size_factor(unit[:-2], name, value, BANDWIDTH_FORMS)

    return _parse(value, name, BANDWIDTH_FORMS, False, factor, "GB/s")


def parse_duration(value, name: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from a string like '250 ms' (any case, but 'Ms', megaseconds to SI, is refused),
    or a Python number of seconds."""

    def factor(unit: str) -> float:
        key = unit if unit in _TIME_UNITS else unit.lower()
        if key not in _TIME_UNITS:
            raise _fail(name, value, DURATION_FORMS, f"unknown unit {unit!r}")
        if unit == "Ms":
            raise _fail(name, value, DURATION_FORMS, f"{unit!r} would be megaseconds: write ms")
        return _TIME_UNITS[key]

    return _parse(value, name, DURATION_FORMS, allow_zero, factor, "s")


def parse_count(value, name: str = "count") -> float:
    """A finite count of at least 1, such as a number of parameters (10e9 or '1.3e9')."""
    count = _plain(value, name, COUNT_FORMS, allow_zero=False)
    if count < 1:  # a fraction of a parameter is a slip (a missing exponent), not a model
        raise _fail(name, value, COUNT_FORMS, "must be at least 1")
    return count


_FLOPS_RATE = re.compile(r"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]?)FLOP(?:/s|S)\s*", re.IGNORECASE)


def parse_flops(value, name: str = "flops") -> float:
    """FLOP/s from a string like '200 TFLOP/s' or '200 TFLOPS' (any case), or a Python number of
    FLOP/s."""
    match = _FLOPS_RATE.fullmatch(value) if isinstance(value, str) else None
    if match is not None:
        value = float(match[1]) * _DECIMAL[match[2].lower()]
    elif isinstance(value, str):
        raise ValueError(
            f"{name}: expected FLOP/s, a number or a string such as '200 TFLOP/s'; got {value!r}"
        )
    return check_positive(value, name)


def check_positive(value, name: str) -> float:
    """``value`` as a float if it is a finite number greater than zero, else ValueError."""
    return _plain(value, name, "a positive number", allow_zero=False)


def check_non_negative(value, name: str) -> float:
    """``value`` as a float if it is a finite number ≥ 0, else ValueError."""
    return _plain(value, name, "a number ≥ 0", allow_zero=True)


def is_integer(value) -> bool:
    """True for a Python int that is not a bool (``True`` is an int to Python, never a count
    here). numpy's integers are not: they overflow silently in later arithmetic; an argument that
    takes them converts them first (:func:`plain_scalar`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def plain_scalar(value):
    """A real scalar of another type (numpy's float32 or int64, say, which Python code passes
    around as numbers) as the Python int or float it stands for; anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_adamw_settings(lr, betas, eps, weight_decay, where: str = "") -> None:
    """ValueError naming the first of AdamW's settings it would not accept: numbers (numpy's, or a
    one-element tensor, as AdamW takes) ≥ 0, and two betas in [0, 1)."""

    def number(x):
        if hasattr(x, "item") and getattr(x, "numel", lambda: 0)() == 1:
            x = x.item()  # (a bool tensor gives a bool, which is no number)
        return is_number(plain_scalar(x))

    if not (number(lr) and lr >= 0):
        raise ValueError(f"{where}lr: expected a number ≥ 0; got {lr!r}")
    if not (
        isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(number(b) and 0 <= b < 1 for b in betas)
    ):
        raise ValueError(f"{where}betas: expected two numbers in [0, 1); got {betas!r}")
    if not (number(eps) and eps >= 0):
        raise ValueError(f"{where}eps: expected a number ≥ 0; got {eps!r}")
    if not (number(weight_decay) and weight_decay >= 0):
        raise ValueError(f"{where}weight_decay: expected a number ≥ 0; got {weight_decay!r}")


def is_number(value) -> bool:
    """True for a finite Python int or float that is not a bool."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def check_integer(
    value, name: str, low: int = 1, high: int | None = None, expected: str | None = None
) -> int:
    """``value`` if it is an integer from ``low`` to ``high`` (inclusive; unbounded when None), else
    ValueError: "{name}: expected {expected}; got {value!r}". ``expected`` defaults to 'a positive
    integer' (low 1, no high), 'an integer ≥ {low}' or 'an integer from {low} to {high}'."""
    if is_integer(value) and value >= low and (high is None or value <= high):
        return int(value)
    if expected is None:
        if high is not None:
            expected = f"an integer from {low} to {high}"
        else:
            expected = "a positive integer" if low == 1 else f"an integer ≥ {low}"
    numpy = isinstance(value, numbers.Integral) and not isinstance(value, (int, bool))
    hint = " (a numpy integer: pass int(...))" if numpy else ""
    raise ValueError(f"{name}: expected {expected}; got {value!r}{hint}")


def _scaled(number: float, steps: list[tuple[float, str]], digits: int, name: str) -> str:
    """``number`` in the largest of ``steps`` (factor, suffix; largest first) it reaches, or the
    next larger one where rounding to ``digits`` would print 1e+03 (999,999,999 B is '1 GB')."""
    if not isinstance(number, numbers.Real) or isinstance(number, bool):
        raise ValueError(f"{name}: expected a number; got {number!r}")
    check_integer(digits, "digits")
    at = next((i for i, (factor, _) in enumerate(steps) if abs(number) >= factor), len(steps) - 1)
    factor, suffix = steps[at]
    text = f"{number / factor:.{digits}g}"
    if "e+" in text and at > 0:
        factor, suffix = steps[at - 1]
        text = f"{number / factor:.{digits}g}"
    if "e+" in text:  # a thousand or more of the largest unit: whole units, grouped
        text = f"{number / factor:,.0f}"
    return f"{text} {suffix}"


def format_size(num_bytes: float, binary: bool = False, digits: int = 3) -> str:
    """'160 GB' for 160e9; binary=True gives '149 GiB' instead."""
    if binary:
        steps = [
            (2**50, "PiB"),
            (2**40, "TiB"),
            (2**30, "GiB"),
            (2**20, "MiB"),
            (2**10, "KiB"),
            (1, "B"),
        ]
    else:
        steps = [(1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")]
    return _scaled(num_bytes, steps, digits, "num_bytes")


def format_bandwidth(bytes_per_s: float, binary: bool = False, digits: int = 3) -> str:
    """'32 GB/s' for 32e9."""
    if not isinstance(bytes_per_s, numbers.Real) or isinstance(bytes_per_s, bool):
        raise ValueError(f"bytes_per_s: expected a number; got {bytes_per_s!r}")
    return format_size(bytes_per_s, binary=binary, digits=digits) + "/s"


def format_duration(seconds: float, digits: int = 3) -> str:
    """'250 ms' for 0.25."""
    steps = [(3600.0, "h"), (60.0, "min"), (1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")]
    return _scaled(seconds, steps, digits, "seconds")


def format_count(count: float, digits: int = 3) -> str:
    """'10 B' for 10e9 parameters, '125 M' for 125e6."""
    steps = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"), (1, "")]
    return _scaled(count, steps, digits, "count").rstrip()
