import math
import re

import pytest

from offloadlab import units


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80 GB", 80e9),
        ("80GB", 80e9),
        ("1 GiB", 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5 TB", 1.5e12),
        ("4 kB", 4000),
        ("4 KiB", 4096),
        ("100 B", 100),
        (" 2.5e3 MB ", 2.5e9),
        (1024, 1024),
        (3.5, 3.5),
    ],
)
def test_parse_size(text, expected):
    assert units.parse_size(text) == pytest.approx(expected)


def test_decimal_and_binary_prefixes_stay_distinct():
    assert units.parse_size("1 GB") == 10**9
    assert units.parse_size("1 GiB") == 2**30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("32 GB/s", 32e9),
        ("900 MiB/s", 900 * 2**20),
        ("3350 GB/s", 3.35e12),
        (5e9, 5e9),
        ("1 TB/s", 1e12),
    ],
)
def test_parse_bandwidth(text, expected):
    assert units.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("250 ms", 0.25),
        ("1.5 s", 1.5),
        ("40 us", 40e-6),
        ("40 µs", 40e-6),
        ("3 ns", 3e-9),
        ("2 min", 120),
        ("1 h", 3600),
        (0.25, 0.25),
    ],
)
def test_parse_duration(text, expected):
    assert units.parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "parse, bad, fragment",
    [
        (units.parse_size, "-1 GB", "negative"),
        (units.parse_size, "0 GB", "greater than zero"),
        (units.parse_size, "80 GX", "unknown unit"),
        (units.parse_size, "eighty GB", "not a number"),
        (units.parse_size, float("nan"), "finite"),
        (units.parse_size, float("inf"), "finite"),
        (units.parse_size, None, "expected"),
        (units.parse_size, True, "expected"),
        (units.parse_bandwidth, "0 GB/s", "greater than zero"),
        (units.parse_bandwidth, "32 GB", "unknown unit"),
        (units.parse_bandwidth, "32 GB/h", "unknown unit"),
        (units.parse_bandwidth, "32 Gb/s/s", "unknown unit"),
        (units.parse_bandwidth, "32 GB/ s", "not a number"),
        (units.parse_bandwidth, -5, "negative"),
        (units.parse_duration, "250 mss", "unknown unit"),
        (units.parse_duration, "-3 ms", "negative"),
        (units.parse_duration, "0 s", "greater than zero"),
        (units.parse_count, "10 GB", "takes no unit"),
        (units.parse_count, 0, "greater than zero"),
        (units.parse_count, "1e-3", "at least 1"),
        (units.parse_count, 0.5, "at least 1"),
        (units.check_positive, "5 GB", "takes no unit"),
        (units.check_non_negative, "0.5 s", "takes no unit"),
    ],
)
def test_bad_input_names_argument_and_forms(parse, bad, fragment):
    with pytest.raises(ValueError) as info:
        parse(bad, name="my_arg")
    message = str(info.value)
    assert message.startswith("my_arg: expected ")
    assert fragment in message


def test_zero_allowed_where_meaningful():
    assert units.parse_size("0 B", allow_zero=True) == 0
    assert units.parse_duration(0, allow_zero=True) == 0
    assert units.check_non_negative(0, "x") == 0
    with pytest.raises(ValueError, match="^x: "):
        units.check_positive(0, "x")


@pytest.mark.parametrize("value", [True, False, 1.0, "3", None, float("nan")])
def test_an_integer_argument_refuses_bools_floats_and_strings(value):
    with pytest.raises(
        ValueError, match=rf"^count: expected a positive integer; got {re.escape(repr(value))}$"
    ):
        units.check_integer(value, "count")


def test_an_integer_arguments_bounds_and_their_message():
    assert (
        units.check_integer(0, "depth", 0) == 0
        and units.check_integer(1024, "depth", 1, 1024) == 1024
    )
    with pytest.raises(ValueError, match="^depth: expected an integer ≥ 0; got -1$"):
        units.check_integer(-1, "depth", 0)
    with pytest.raises(ValueError, match="^depth: expected an integer from 1 to 1024; got 1025$"):
        units.check_integer(1025, "depth", 1, 1024)
    with pytest.raises(ValueError, match="^step: expected the 1-based step count; got 0$"):
        units.check_integer(0, "step", expected="the 1-based step count")


def test_numbers_are_finite_ints_and_floats_and_never_bools():
    assert units.is_number(0) and units.is_number(-2.5) and units.is_integer(7)
    assert not any(units.is_number(v) for v in (True, float("inf"), float("nan"), "1", None))
    assert not any(units.is_integer(v) for v in (True, 7.0, "7"))


def test_format_round_trips():
    assert units.format_size(160e9) == "160 GB"
    assert units.format_size(2**30, binary=True) == "1 GiB"
    assert units.format_bandwidth(32e9) == "32 GB/s"
    assert units.format_duration(0.25) == "250 ms"
    assert units.format_duration(1.25) == "1.25 s"
    assert units.format_count(10e9) == "10 B"
    assert units.format_count(7) == "7"
    for text in ("160 GB", "12.5 MB", "1 GiB"):
        size = units.parse_size(text)
        binary = "i" in text
        assert math.isclose(units.parse_size(units.format_size(size, binary=binary)), size)


@pytest.mark.parametrize(
    "parse, text, guess",
    [
        (units.parse_size, "80", "80 GB"),
        (units.parse_size, "0.5", "0.5 GB"),
        # as many digits as bytes have: bytes, surely
        (units.parse_size, "85899345920", "85899345920 B"),
        (units.parse_bandwidth, "25", "25 GB/s"),
        (units.parse_duration, "250", "250 s"),
    ],
)
def test_a_string_without_its_unit_is_refused_with_the_reading_meant(parse, text, guess):
    with pytest.raises(ValueError) as info:
        parse(text, name="gpu_memory")
    assert str(info.value).endswith(f"got {text!r}: did you mean {guess!r}?")
    assert str(info.value).startswith("gpu_memory: expected a ")


@pytest.mark.parametrize(
    "parse, text, expected",
    [
        (units.parse_size, "80 gb", 80e9),
        (units.parse_size, "80 Gb".lower(), 80e9),
        (units.parse_size, "1 gib", 2**30),
        (units.parse_size, "1 GIB", 2**30),
        (units.parse_size, "4 KB", 4000),
        (units.parse_size, "400 Gbit", 50e9),
        (units.parse_bandwidth, "25 gb/s", 25e9),
        (units.parse_bandwidth, "25 GB/S", 25e9),
        (units.parse_bandwidth, "400 Gbit/s", 50e9),
        (units.parse_bandwidth, "1 gibit/s", 2**30 / 8),
        (units.parse_duration, "250 MS", 0.25),
        (units.parse_duration, "2 MIN", 120),
    ],
)
def test_units_are_read_without_regard_to_case_where_that_is_unambiguous(parse, text, expected):
    assert parse(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "parse, text, fragment",
    [
        (
            units.parse_size,
            "80 Gb",
            "'Gb' means gigabits; write 'GB' for bytes, or 'Gbit' for bits",
        ),
        (units.parse_bandwidth, "25 Gb/s", "'Gb' means gigabits"),
        (units.parse_size, "1 Mib", "'Mib' means mebibits; write 'MiB' for bytes"),
    ],
)
def test_a_capital_prefix_with_a_small_b_is_bits_and_is_said_so(parse, text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse(text, name="x")


def test_python_numbers_stay_base_units():
    """Computed values reach the parsers as numbers: bytes, bytes/s, seconds, whatever their
    size."""
    assert (
        units.parse_size(80) == 80
        and units.parse_bandwidth(2.5e10) == 2.5e10
        and units.parse_duration(3) == 3
    )


@pytest.mark.parametrize(
    "parse, text, expected",
    [
        (units.parse_count, "10_000_000_000", 1e10),
        (units.parse_size, "1_024 MiB", 2**30),
        (units.parse_bandwidth, "12_5 GB/s", 125e9),
        (units.parse_count, "1_0e1_0", 1e11),
    ],
)
def test_digits_grouped_with_underscores_read_as_python_reads_them(parse, text, expected):
    """`--params 10_000_000_000` was refused as 'not a number with a unit'."""
    assert parse(text) == expected


@pytest.mark.parametrize("text", ["10__000", "_10", "10_", "1_.5", "1e_5"])
def test_underscores_python_refuses_are_refused(text):
    with pytest.raises(ValueError, match="^count: expected"):
        units.parse_count(text)
