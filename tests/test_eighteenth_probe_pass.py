"""Findings of the eighteenth probe pass (issue 37), each with the test that failed before its
fix. The screen's new refusals are in tests/test_guard.py's ATTACKS."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT
from tests.test_student import _release

# Each runs in a fresh interpreter with the course's modules sealed, as in a lab's kernel: what
# it patches would otherwise stay patched in the test process.
SEALED = """
import math, random
from offloadlab_course import check, grading
from offloadlab_course.guard import seal_course_modules
seal_course_modules()
"""


def _run(code: str) -> subprocess.CompletedProcess:
    source = SEALED + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True)


def test_a_checks_result_class_cannot_be_made_to_pass():
    """F1: `V = (lambda: check.Verdict)(); V.passed = property(lambda s: True, ...)` inside a
    function passed the screen (a call's result counted as the function's own) and every check
    passed with a wrong answer; grading.Outcome alike."""
    done = _run("""
        refused = []
        for cls in (check.Verdict, grading.Outcome):
            try:
                cls.passed = property(lambda s: True, lambda s, v: None)
            except AttributeError as error:
                refused.append("read-only" in str(error))
        print(refused, bool(check.answer("beta", 1.0, 12e9)))
    """)
    assert done.stdout.strip().endswith("[True, True] False"), done.stdout + done.stderr


def test_patching_random_or_math_does_not_choose_lab_2s_hidden_rate():
    """F2: `random.SystemRandom.uniform = lambda *a: math.log(5e8)` made every hidden rate
    5e8, so a probe returning 5e8 passed lab 2's hidden challenge."""
    done = _run("""
        random.SystemRandom.uniform = lambda *a: math.log(5e8)
        math.exp = lambda x: 5e8
        rates = {round(grading.lab02_hidden_rate()) for _ in range(5)}
        print(len(rates) == 5 and 5e8 not in rates)
    """)
    assert done.stdout.strip().endswith("True"), done.stdout + done.stderr


@pytest.mark.parametrize(
    "folded",
    [
        "<details><summary>A model answer</summary>The gradients.</details>",
        ":::{admonition} A model answer\n:class: dropdown\nThe gradients.\n:::",
        "  :::{dropdown} A model answer\n  The gradients.\n  :::",
    ],
    ids=["details", "admonition", "indented"],
)
def test_a_reflection_folded_another_way_stops_the_release(folded, tmp_path):
    """F5: a reflection whose model answer is a <details> block, a dropdown admonition or an
    indented dropdown was replaced whole by the stub, its question and the text after it lost
    with exit 0. Now the release stops and says how to fold it."""
    text = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text(encoding="utf-8")
    start = text.index('+++ {"points": 1}\n\n:::{dropdown} A model answer')
    end = text.index("\n:::\n", start) + len("\n:::\n")
    cell = f'+++ {{"points": 1}}\n\nWhich bytes come back?\n\n{folded}\n\nOn your own: try k = 3.\n'
    done, _ = _release(tmp_path, text[:start] + cell + text[end:], nbgrader=False)
    assert done.returncode == 2 and "lab01_x.md: cell" in done.stderr, done.stderr
    assert "`:::{dropdown}` block" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_probe_json_to_a_pipe_nobody_reads_is_refused_not_waited_on(tmp_path):
    """F6: `probe --quick --json FIFO` with no reader blocked in open() for good; a pipe now has
    a while to find a reader, then the results go to standard output and the pipe is named."""
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", "probe", "--quick", "--disk", str(tmp_path)]
        + ["--json", str(fifo)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "a pipe nobody read from" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and '"records"' in done.stdout


@pytest.mark.parametrize(
    "config, says",
    [
        ("{bad", "expected a readable JSON config"),
        ("", "expected a JSON config of at most 16 MiB"),
        ('{"model_type": "llama"}', "expected the field 'hidden_size'"),
    ],
    ids=["not JSON", "empty", "a field missing"],
)
def test_a_bad_model_config_is_named_by_its_flag(config, says, tmp_path):
    """F7: the error named the file ('/tmp/c.json: expected …'), not the flag that gave it."""
    path = tmp_path / "config.json"
    path.write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", "plan", "--model-config", str(path)]
        + ["--gpu-memory", "80 GB", "--link", "25 GB/s"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("offloadlab: error: --model-config: "), done.stderr
    assert says in done.stderr and path.name in done.stderr, done.stderr


def test_budgets_help_says_params_and_offload_go_together():
    """F8: `budget --params 7e9` without --offload is refused, and --help did not say why."""
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", "budget", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert " ".join(done.stdout.split()).count("with --offload") == 1, done.stdout
    assert " ".join(done.stdout.split()).count("with --params") == 1, done.stdout
