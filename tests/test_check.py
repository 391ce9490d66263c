"""The labs' answer checks: tolerances that mean what they print, and no answers leaked to
students."""

import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from offloadlab_course import check


@pytest.fixture
def book(monkeypatch):
    monkeypatch.delenv(check.STUDENT_VARIABLE, raising=False)


@pytest.fixture
def student(monkeypatch):
    monkeypatch.setenv(check.STUDENT_VARIABLE, "1")


def test_tolerance_is_relative_to_the_expected_value(book):
    # isclose against the larger value accepted this
    assert not check.answer("x", 133, 100, rel_tol=0.25)
    assert not check.answer("x", 200, 100, rel_tol=0.5)
    assert check.answer("x", 125, 100, rel_tol=0.25) and check.answer("x", 75, 100, rel_tol=0.25)
    assert not check.answer("x", 74.9, 100, rel_tol=0.25)
    assert check.answer("x", 150, 100, rel_tol=0.5) and check.answer("x", -1.04, -1, rel_tol=0.05)


def test_zero_tolerance_means_exact(book):
    assert check.answer("bytes", 2**40 + 1, 2**40 + 1, rel_tol=0)
    assert not check.answer("bytes", 2**40, 2**40 + 1, rel_tol=0)
    assert check.answer("zero", 0, 0.0, rel_tol=0) and not check.answer(
        "zero", 1e-300, 0, rel_tol=0.5
    )


@pytest.mark.parametrize(
    "bad",
    [
        True,
        False,
        np.bool_(True),
        torch.tensor(True),
        "3",
        b"3",
        float("nan"),
        float("inf"),
        -float("inf"),
        np.float64("nan"),
        torch.ones(3),
        np.ones(2),
        1j,
        [3],
    ],
)
def test_answers_that_are_not_finite_real_numbers_fail_with_a_clear_line(book, bad, capsys):
    verdict = check.answer("the answer", bad, 1, rel_tol=0.5)
    assert not verdict
    assert verdict.message.startswith(
        "✗ the answer: expected a finite real number as the answer; got "
    )
    assert capsys.readouterr().out.strip() == verdict.message


@pytest.mark.parametrize(
    "good", [3, 3.0, np.int64(3), np.float32(3), torch.tensor(3), torch.tensor([3.0]), Fraction(3)]
)
def test_numbers_of_every_kind_are_accepted(book, good):
    assert check.answer("x", good, 3, rel_tol=0)


def test_huge_integers_are_compared_exactly_without_overflow(book):
    assert check.answer("x", 10**400, 10**400 + 10**397, rel_tol=0.01)
    verdict = check.answer("x", 10**400, 1, rel_tol=0.01)
    assert (
        not verdict
        and "1e+400" in verdict.message
        and "more than a factor of 1000" in verdict.message
    )
    assert not check.answer("x", 1.0, 10**400)


def test_no_answer_yet(book):
    assert check.answer("x", None, 1).message == "✗ x: no answer yet"
    assert check.answer("x", ..., 1).message == "✗ x: no answer yet"


def test_bad_arguments_of_the_lab_author_raise():
    with pytest.raises(ValueError, match=r"^rel_tol: expected a fraction in \[0, 1\); got 1"):
        check.answer("x", 1, 1, rel_tol=1)
    with pytest.raises(ValueError, match="^rel_tol"):
        check.answer("x", 1, 1, rel_tol=True)
    with pytest.raises(ValueError, match=r"^expected: expected a finite real number; got nan"):
        check.answer("x", 1, float("nan"))
    with pytest.raises(ValueError, match="^expected"):
        check.answer("x", 1, True)


def test_the_book_shows_the_expected_value_and_which_way(book):
    verdict = check.answer("bandwidth", 1.4e9, 1e9, rel_tol=0.25, hint="bytes over seconds")
    assert verdict.message == (
        "✗ bandwidth: 1,400,000,000, but 1,000,000,000 was expected (within 25 %); "
        "yours is too high by 10 % to 50 %. Hint: bytes over seconds"
    )
    assert check.answer("bandwidth", 1.1e9, 1e9, rel_tol=0.25).message == (
        "✓ bandwidth: 1,100,000,000 agrees with 1,000,000,000 (within 25 %)"
    )


@pytest.mark.parametrize(
    "yours, words",
    [
        (1.05, "too high by less than 10 %"),
        (0.7, "too low by 10 % to 50 %"),
        (2.5, "too high by a factor of 1.5 to 3"),
        (0.2, "too low by a factor of 3 to 10"),
        (150.0, "too high by a factor of 10 to 1000"),
        (1e-7, "too low by more than a factor of 1000"),
        (-1.0, "of the wrong sign"),
        (0, "zero, and the answer is not"),
    ],
)
def test_the_student_release_says_which_way_and_roughly_how_far_but_never_the_answer(
    student, yours, words
):
    expected = 1.2345678
    verdict = check.answer("time", yours * expected, expected, rel_tol=0.01, hint="t = α + n/β")
    assert not verdict
    assert (
        verdict.message
        == f"✗ time: your answer is {words} (it must be within 1 %). Hint: t = α + n/β"
    )
    assert "1.23" not in verdict.message
    passed = check.answer("time", expected * 1.001, expected, rel_tol=0.01)
    assert passed and passed.message == "✓ time: your answer agrees (within 1 %)"


def test_student_release_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv(check.STUDENT_VARIABLE, "0")
    assert "was expected" in check.answer("x", 2, 1).message
    monkeypatch.setenv(check.STUDENT_VARIABLE, "yes")
    assert "was expected" not in check.answer("x", 2, 1).message
    assert check.student_release()


def test_exact_answers_leak_nothing_to_students(student):
    assert check.exact("variant", "one buffer", "one buffer")
    verdict = check.exact("variant", "pageable source", "one buffer")
    assert not verdict and "one buffer" not in verdict.message
    assert check.exact("batch", None, None) and not check.exact("batch", 4, None)
    assert not check.exact("batch", None, 4) and "4" not in check.exact("batch", None, 4).message
    verdict = check.exact("batch", 8, 4)
    assert (
        not verdict
        and "too high" in verdict.message
        and "4" not in verdict.message.replace("(it", "")
    )
    assert not check.exact("batch", True, 1) and not check.exact("batch", ..., 1)


@pytest.mark.parametrize(
    "ratio, slip",
    [
        (8, "bits against bytes"),
        (1 / 8, "bits against bytes"),
        (2**30 / 1e9, "GB against GiB"),
        (1e-3, "kilo or milli"),
        (2**20, "binary prefix (MiB)"),
    ],
)
def test_unit_slips_are_named(book, ratio, slip):
    verdict = check.answer("size", 3e9 * ratio, 3e9, rel_tol=0.001)
    assert not verdict and slip in verdict.message


@pytest.mark.parametrize("ratio", [8, 1 / 8, 2**30 / 1e9, 1e-3, 2**20])
def test_the_student_release_says_units_without_the_factor(student, ratio):
    """Named, the factor gives the expected value away (800 / 8 then passes)."""
    verdict = check.answer("size", 3e9 * ratio, 3e9, rel_tol=0.001)
    assert not verdict and verdict.message.endswith("Check your units.")
    assert "factor of" not in verdict.message.split("(it must")[1]


def test_no_unit_slip_for_an_ordinary_miss(student):
    assert "?" not in check.answer("size", 3.3e9, 3e9, rel_tol=0.05).message


def test_messages_stay_one_line_for_any_answer(book):
    for yours in (1e-300, 1e300, 10**1000, -(10**1000), Fraction(1, 3)):
        message = check.answer("x", yours, 7).message
        assert "\n" not in message and re.match(r"^[✓✗] x: ", message)


def test_direction_is_signed(book):
    assert "too low" in check.answer("x", -1.5, -1).message
    assert "too high" in check.answer("x", -0.5, -1).message
