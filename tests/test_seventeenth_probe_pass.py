"""Findings of the seventeenth probe pass (issue 37), each with the test that failed before its
fix. The guard's (F1-F3) are in tests/test_guard.py's ATTACKS."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

LAB = ROOT / "labs" / "lab01_account_for_every_byte.md"


def _release(tmp_path, text, nbgrader):
    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "lab01_x.md").write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "offloadlab_course.student", str(labs), str(tmp_path / "out")]
    done = subprocess.run(command + ["--nbgrader"] * nbgrader, capture_output=True, text=True)
    released = [p.read_text() for p in (tmp_path / "out").rglob("*.ipynb")]
    return done, released


@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_hidden_test_markers_with_words_after_them_stop_the_release(nbgrader, tmp_path):
    """F4: '### BEGIN HIDDEN TESTS  # grader only' (and its END alike) was neither stripped nor
    refused: the student release shipped the hidden tests, while nbgrader, which cuts any line
    holding a marker, stripped them, so the two releases differed."""
    lines = LAB.read_text(encoding="utf-8").splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "### BEGIN HIDDEN TESTS")
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "### END HIDDEN TESTS")
    hidden = lines[first + 1].strip()
    lines[first] = "### BEGIN HIDDEN TESTS  # grader only\n"
    lines[last] = "### END HIDDEN TESTS  # grader only\n"
    done, released = _release(tmp_path, "".join(lines), nbgrader)
    assert done.returncode == 2 and "lab01_x.md: cell" in done.stderr, done.stderr
    assert "'BEGIN HIDDEN TESTS' outside a marker line" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not any(hidden in text for text in released)


MODEL_ANSWER = "The gradients. AdamW reads a parameter's gradient once"


@pytest.mark.parametrize(
    "form",
    ["four colons", "backticks", "question first"],
)
@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_a_reflections_other_text_survives_the_release(form, nbgrader, tmp_path):
    """F5: a reflection cell fenced with four colons or backticks, or with its question before
    the dropdown, was replaced whole by the stub, with exit 0: the lab's own text after the
    answer, or its question, silently gone. Now only the folded answer is replaced."""
    text = LAB.read_text(encoding="utf-8")
    start = text.index('+++ {"points": 1}\n\n:::{dropdown} A model answer')
    end = text.index("\n:::\n", start) + len("\n:::\n")
    block = text[start:end]
    if form == "four colons":
        new = block.replace(":::{dropdown}", "::::{dropdown}").replace("\n:::\n", "\n::::\n")
        new += "\nOn your own: try it with three micro-batches.\n"
    elif form == "backticks":
        new = block.replace(":::{dropdown}", "```{dropdown}").replace("\n:::\n", "\n```\n")
        new += "\nOn your own: try it with three micro-batches.\n"
    else:
        new = block.replace(
            "\n\n:::{dropdown}", "\n\nWhich bytes come back, and why?\n\n:::{dropdown}"
        )
    text = text[:start] + new + text[end:]
    kept = "On your own: try it" if form != "question first" else "Which bytes come back, and why?"
    done, released = _release(tmp_path, text, nbgrader)
    assert done.returncode == 0, done.stderr
    cells = json.loads(released[0])["cells"]
    (kept_in,) = [c for c in cells if kept in "".join(c["source"])]
    (answered_in,) = [
        c
        for c in cells
        if "points" in str(c["metadata"].get("nbgrader", {}))
        and c["cell_type"] == "markdown"
        and "reflection" in str(c["metadata"])
    ]
    assert kept_in is not answered_in and MODEL_ANSWER not in "".join(kept_in["source"])
    # the release for students holds the stub; nbgrader's source the answer, which it strips
    shown = "".join(answered_in["source"])
    assert (MODEL_ANSWER in shown) if nbgrader else (shown == "YOUR ANSWER HERE"), shown


def test_plan_measured_on_a_pipe_nobody_writes_to_is_refused_not_waited_on(tmp_path):
    """F6: `plan --measured FIFO` with no writer blocked in open() forever (still waiting at
    130 s). It now reads the pipe as empty and says so; `<(cat probe.json)` still
    works, its writer being there from the start."""
    fifo = tmp_path / "probe.json"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "offloadlab", "plan", "--params", "7e9"]
    done = subprocess.run(
        command + ["--measured", str(fifo)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--measured" in done.stderr and "empty" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    recorded = tmp_path / "recorded.json"
    probe = subprocess.run(
        [sys.executable, "-m", "offloadlab", "probe", "--quick", "--json", str(recorded)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr
    through_a_pipe = subprocess.run(
        [
            "bash",
            "-c",
            '"$0" -m offloadlab plan --params 7e9 --gpu-memory "80 GB" --measured <(cat "$1")',
            sys.executable,
            str(recorded),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert through_a_pipe.returncode == 0, through_a_pipe.stderr
