"""Sizes, bandwidths and times: parsing, validation and formatting.

Every quantity in offloadlab is held in base SI units: sizes in bytes, bandwidths in
bytes per second, times in seconds. This module turns what people write ("80 GB",
"32 GB/s", "250 ms") into those numbers, refuses anything malformed with a
``ValueError`` that names the argument and the accepted forms, and formats numbers
back for display.

Decimal and binary prefixes stay distinct: "1 GB" is 10**9 bytes, "1 GiB" is 2**30.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "parse_size",
    "parse_bandwidth",
    "parse_duration",
    "parse_count",
    "check_positive",
    "check_non_negative",
    "format_size",
    "format_bandwidth",
    "format_duration",
    "format_count",
]

_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_SIZE_UNITS = {f"{p}B": f for p, f in {**_DECIMAL, **_BINARY}.items()}
_BANDWIDTH_UNITS = {f"{u}/s": f for u, f in _SIZE_UNITS.items()}
_TIME_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-zµ/]*)\s*$")

SIZE_FORMS = "a number of bytes or a string such as '80 GB', '512 MiB', '1.5 TB'"
BANDWIDTH_FORMS = "bytes per second or a string such as '32 GB/s', '900 MiB/s'"
DURATION_FORMS = "seconds or a string such as '250 ms', '1.5 s', '40 us'"
COUNT_FORMS = "a number such as 10e9, 7000000000 or '1.3e9'"


def _fail(name: str, value, forms: str, why: str = "") -> ValueError:
    reason = f" ({why})" if why else ""
    return ValueError(f"{name}: expected {forms}; got {value!r}{reason}")


def _split(value, name: str, forms: str) -> tuple[float, str]:
    """Split a number-with-unit into (number, unit); a bare number has unit ''."""
    if isinstance(value, bool):
        raise _fail(name, value, forms)
    if isinstance(value, (int, float)):
        return float(value), ""
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


def _parse(value, name: str, units: dict, forms: str, allow_zero: bool) -> float:
    """A number with an optional unit from ``units`` (unit → factor), scaled and validated."""
    number, unit = _split(value, name, forms)
    if unit:
        if unit not in units:
            raise _fail(name, value, forms, f"unknown unit {unit!r}" if units else "it takes no unit")
        number *= units[unit]
    return _checked(number, name, value, forms, allow_zero)


def parse_size(value, name: str = "size", allow_zero: bool = False) -> float:
    """Bytes from a number of bytes or a string like '80 GB' / '512 MiB'."""
    return _parse(value, name, _SIZE_UNITS, SIZE_FORMS, allow_zero)


def parse_bandwidth(value, name: str = "bandwidth") -> float:
    """Bytes per second from a number or a string like '32 GB/s'. Zero is refused."""
    return _parse(value, name, _BANDWIDTH_UNITS, BANDWIDTH_FORMS, allow_zero=False)


def parse_duration(value, name: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from a number of seconds or a string like '250 ms'."""
    return _parse(value, name, _TIME_UNITS, DURATION_FORMS, allow_zero)


def parse_count(value, name: str = "count") -> float:
    """A finite count of at least 1, such as a number of parameters (10e9 or '1.3e9')."""
    count = _parse(value, name, {}, COUNT_FORMS, allow_zero=False)
    if count < 1:  # a fraction of a parameter is a slip (a missing exponent), not a model
        raise _fail(name, value, COUNT_FORMS, "must be at least 1")
    return count


def check_positive(value, name: str) -> float:
    """``value`` as a float if it is a finite number greater than zero, else ValueError."""
    return _parse(value, name, {}, "a positive number", allow_zero=False)


def check_non_negative(value, name: str) -> float:
    """``value`` as a float if it is a finite number ≥ 0, else ValueError."""
    return _parse(value, name, {}, "a number ≥ 0", allow_zero=True)


def _scaled(number: float, steps: list[tuple[float, str]], digits: int) -> str:
    for factor, suffix in steps:
        if abs(number) >= factor:
            return f"{number / factor:.{digits}g} {suffix}"
    factor, suffix = steps[-1]
    return f"{number / factor:.{digits}g} {suffix}"


def format_size(num_bytes: float, binary: bool = False, digits: int = 3) -> str:
    """'160 GB' for 160e9; binary=True gives '149 GiB' instead."""
    if binary:
        steps = [(2**50, "PiB"), (2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")]
    else:
        steps = [(1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")]
    return _scaled(num_bytes, steps, digits)


def format_bandwidth(bytes_per_s: float, binary: bool = False, digits: int = 3) -> str:
    """'32 GB/s' for 32e9."""
    return format_size(bytes_per_s, binary=binary, digits=digits) + "/s"


def format_duration(seconds: float, digits: int = 3) -> str:
    """'250 ms' for 0.25."""
    steps = [(3600.0, "h"), (60.0, "min"), (1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")]
    return _scaled(seconds, steps, digits)


def format_count(count: float, digits: int = 3) -> str:
    """'10 B' for 10e9 parameters, '125 M' for 125e6."""
    steps = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"), (1, "")]
    return _scaled(count, steps, digits).rstrip()
