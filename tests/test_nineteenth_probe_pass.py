"""Findings of the nineteenth probe pass (command line, files, course), each with the test that
failed before its fix."""

import os
import subprocess
import sys

import pytest

from offloadlab.link import EmulatedLink
from offloadlab_course import grading


def _offloadlab(*arguments, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "offloadlab", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def test_count_with_a_bare_parameter_count_is_refused():
    """F1: `plan --params 7e9 --count transformers` planned a guessed shape and said nothing."""
    done = _offloadlab(
        "plan", "--params", "7e9", "--gpu-memory", "80 GB", "--link", "25 GB/s",
        "--count", "transformers",
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("offloadlab: error: --count: "), done.stderr


def test_an_empty_reference_name_is_blamed_on_reference(tmp_path):
    """F2: `--reference ''` was reported as '--reference-dir: give it with --reference NAME'."""
    done = _offloadlab("probe", "--quick", "--reference", "", "--reference-dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("offloadlab: error: --reference: expected"), done.stderr


def test_a_reference_folder_that_is_a_file_is_a_usage_error(tmp_path):
    """F3: $OFFLOADLAB_REFERENCE_DIR naming a file exited 1 with 'File exists'."""
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    environment = {**os.environ, "OFFLOADLAB_REFERENCE_DIR": str(a_file)}
    done = _offloadlab("probe", "--quick", "--reference", "r1", env=environment)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "not a folder" in done.stderr and str(a_file) in done.stderr, done.stderr
    assert a_file.read_text() == "x"


def test_json_to_dev_stdout_redirected_to_a_file_lands_beside_the_printed_results(tmp_path):
    """F4: with stdout redirected to a file, `--json /dev/stdout` was refused as a link, and with
    --force the file was renamed over: the printed results were lost."""
    out = tmp_path / "o.txt"
    with open(out, "w") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "offloadlab", "bench", "link", "--quick"]
            + ["--json", "/dev/stdout"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("{") and '"benchmark": "link"' in text, text[:300]  # the JSON
    assert "wrote the result to /dev/stdout" in text, text[-300:]  # and what was printed


@pytest.mark.parametrize("rel_tol", [1.0, 5, -0.1])
def test_a_challenges_tolerance_is_a_fraction_below_one(rel_tol):
    """F5: lab02_challenge(..., rel_tol=1.0) passed any probe answer within [0, 2 beta]."""
    with pytest.raises(ValueError, match=r"^rel_tol: expected a fraction in \[0, 1\)"):
        grading.lab02_challenge(lambda link: 1.0, EmulatedLink(reserve_core=False), 1e9,
                                rel_tol=rel_tol)  # fmt: skip


def test_a_json_name_too_long_is_a_usage_error(tmp_path):
    """F6: `bench link --json <300 characters>` exited 1 ('File name too long'), where
    `--reference` gives the same error exit 2."""
    done = _offloadlab("bench", "link", "--quick", "--json", str(tmp_path / ("x" * 300)))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("offloadlab: error: --json: the name is too long"), done.stderr


def test_a_file_size_function_changed_by_an_answer_is_seen():
    """F11: `os.path.getsize` replaced through a parameter faked lab 7's footprint: posixpath was
    not among the modules the checks' watch notes."""
    code = (
        "import os\nfrom offloadlab_course import check, watch\nwatch.remember()\n"
        "os.path.getsize = lambda path: 1\nprint(watch.changed())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "posixpath.getsize" in done.stdout, done.stdout + done.stderr
