"""A real nbgrader round trip: release every lab, autograde a solved and an unsolved submission.

The course is built the way the course page (book/course.md) tells an instructor to, with the
course's shared ``course/nbgrader_config.py``: ``python -m offloadlab_course.student --nbgrader labs
<course>/source`` (what ``make student`` runs), then ``nbgrader generate_assignment`` for each
lab, then submissions under ``submitted/<student>/<lab>/`` and ``nbgrader autograde``. The solved
submission is the source notebook itself (the worked answers); the unsolved one is the released
notebook as a student receives it.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from offloadlab_course.student import (
    BEGIN,
    BEGIN_HIDDEN,
    END,
    STUB,
    assignment_name,
    find_labs,
    points,
    release_notebook,
    source_notebook,
)
from tests.conftest import ROOT

LABS = find_labs(ROOT / "labs")


def course_config() -> str:
    """The course's shared nbgrader settings, which `make course` installs for every server and
    nbgrader command (course/nbgrader_config.py): the test's course runs with them."""
    return (ROOT / "course" / "nbgrader_config.py").read_text(encoding="utf-8") + "\n"


# nbgrader runs the `alembic` command to set up its gradebook: the environment's bin folder must be
# on PATH, as it is in an activated environment (CI and `make test` call the interpreter by its
# path).
ENVIRONMENT = {
    **os.environ,
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
}


def nbgrader(course, *arguments):
    """Run the nbgrader command line in ``course``; its output when it succeeds."""
    result = subprocess.run(
        [sys.executable, "-m", "nbgrader", *arguments],
        cwd=course,
        capture_output=True,
        text=True,
        env=ENVIRONMENT,
    )
    assert result.returncode == 0, (
        f"nbgrader {' '.join(arguments)} failed:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """An nbgrader course with every lab generated as an assignment."""
    root = tmp_path_factory.mktemp("course")
    (root / "nbgrader_config.py").write_text(
        course_config() + f"c.CourseDirectory.root = {str(root)!r}\n", encoding="utf-8"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab_course.student",
            "--nbgrader",
            str(ROOT / "labs"),
            str(root / "source"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    for path in LABS:
        nbgrader(root, "generate_assignment", assignment_name(path))
    return root


def released(course, path):
    return nbformat.read(
        course / "release" / assignment_name(path) / f"{path.stem}.ipynb", as_version=4
    )


def cells(notebook):
    """Each cell's kind, and the source of code cells and of answers graded by hand (the prose
    around them differs only in the links a release makes of the book's references)."""
    return [
        (
            c.cell_type,
            c.source
            if c.cell_type == "code" or c.metadata.get("nbgrader", {}).get("solution")
            else "",
        )
        for c in notebook.cells
    ]


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_nbgrader_releases_what_make_student_releases_and_no_solution(course, path):
    release = released(course, path)
    assert cells(release) == cells(release_notebook(source_notebook(path)))
    text = "\n".join(c.source for c in release.cells)
    assert BEGIN not in text and END not in text and STUB in text
    worked = [
        c.source.split(BEGIN)[1].split(END)[0].strip()
        for c in source_notebook(path).cells
        if BEGIN in c.source
    ]
    assert worked and not any(answer in text for answer in worked)


def submit(course, student, path, notebook):
    folder = course / "submitted" / student / assignment_name(path)
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / f"{path.stem}.ipynb")


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_autograde_gives_full_points_to_the_solved_lab_and_zero_to_the_unsolved(course, path):
    from nbgrader.api import Gradebook

    lab = assignment_name(path)
    submit(
        course,
        "solved",
        path,
        nbformat.read(course / "source" / lab / f"{path.stem}.ipynb", as_version=4),
    )
    submit(course, "unsolved", path, released(course, path))
    log = nbgrader(course, "autograde", lab, "--create")
    # nbgrader stores a graded cell's checksum with its hidden tests and compares it with the
    # released cell, which has none: it warns about every cell with hidden tests
    # (jupyter/nbgrader#1961) and grades it right all the same, from the stored source.
    hidden = {
        c.metadata.nbgrader["grade_id"]
        for c in source_notebook(path).cells
        if BEGIN_HIDDEN in c.source
    }
    complaints = [
        line
        for line in log.splitlines()
        if ("App | ERROR]" in line or "App | WARNING]" in line)
        and not any(f"Attribute 'checksum' for cell {cell} has changed" in line for cell in hidden)
    ]
    assert not complaints, "\n".join(complaints)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        solved = gradebook.find_submission_notebook(path.stem, lab, "solved")
        unsolved = gradebook.find_submission_notebook(path.stem, lab, "unsolved")
        checks = gradebook.find_notebook(path.stem, lab).grade_cells
        assert (
            solved.max_score
            == sum(c.max_score for c in checks)
            == points(source_notebook(path))
            > 0
        )
        # reflections wait for the instructor
        by_hand = {c.name for c in checks if c.cell_type == "markdown"}
        automatic = [g for g in solved.grades if g.cell.name not in by_hand]
        lost = {g.cell.name: g.score for g in automatic if g.score != g.max_score}
        assert not lost and not solved.failed_tests, f"the solved {lab} lost points: {lost}"
        assert solved.needs_manual_grade == bool(by_hand)
        assert unsolved.score == 0, {g.cell.name: g.score for g in unsolved.grades if g.score}
        assert len(unsolved.grades) == len(checks)
        assert all(g.failed_tests for g in unsolved.grades if g.cell.name not in by_hand)
        assert not unsolved.needs_manual_grade  # an untouched reflection scores zero by itself
        for submission in (solved, unsolved):
            assert not submission.flagged
    for student in ("solved", "unsolved"):
        graded = nbformat.read(
            course / "autograded" / student / lab / f"{path.stem}.ipynb", as_version=4
        )
        assert all(c.get("execution_count") for c in graded.cells if c.cell_type == "code"), student
    shutil.rmtree(course / "submitted")  # the next lab starts with no submissions


def test_a_number_typed_in_from_the_visible_check_loses_the_hidden_points(course):
    """The student sets OFFLOADLAB_STUDENT=0, reads the expected value, and types it in: the visible
    check passes, the hidden test (in no release, restored by nbgrader) does not."""
    from nbgrader.api import Gradebook

    path = next(p for p in LABS if assignment_name(p) == "lab01")
    notebook = nbformat.read(course / "source" / "lab01" / f"{path.stem}.ipynb", as_version=4)
    from offloadlab.models import GPTConfig

    # what the check showed
    typed = GPTConfig(layers=4, hidden=256, heads=4, vocab=2048, seq=128).params * 16
    for cell in notebook.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "student-release":
            cell.source = 'import os\nos.environ["OFFLOADLAB_STUDENT"] = "0"  # show me the answers'
        if "prediction_fp32_adam =" in cell.source:
            cell.source = f"prediction_fp32_adam = {typed}"
    submit(course, "copier", path, notebook)
    nbgrader(course, "autograde", "lab01", "--create")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        copied = gradebook.find_submission_notebook(path.stem, "lab01", "copier")
        lost = {
            g.cell.name: g.max_score - g.score
            for g in copied.grades
            if g.score != g.max_score and g.auto_score is not None
        }
        hidden = [c for c in source_notebook(path).cells if "BEGIN HIDDEN TESTS" in c.source]
        assert list(lost) == [hidden[0].metadata.nbgrader["grade_id"]], lost
        assert (
            lost[hidden[0].metadata.nbgrader["grade_id"]] == hidden[0].metadata.nbgrader["points"]
        )
    graded = nbformat.read(
        course / "autograded" / "copier" / "lab01" / f"{path.stem}.ipynb", as_version=4
    )
    shown = "".join(
        o.get("text", "")
        for c in graded.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "✓ fp32 AdamW" in shown  # the visible check itself passed
    shutil.rmtree(course / "submitted")


# The attack as it was tried on lab 3: one answer cell rebinds the checks and the challenge's
# grader, the others hold made-up answers. It earned 4 of the 5 automatic points.
REBINDING = {
    "answer-1": "check.answer = lambda *a, **k: True\ncheck.exact = lambda *a, **k: True\n"
    "grading.lab03_challenge = lambda *a, **k: True\npredicted_batch = 1",
    "answer-2": "def predicted_step(b):\n    return 0.0",
    "answer-3": "measured_batch = 1",
    "answer-4": "def my_step(link, work, host, device):\n    pass",
}


def test_an_answer_cell_that_rebinds_the_checks_is_not_run_and_scores_nothing(course):
    from nbgrader.api import Gradebook

    path = next(p for p in LABS if assignment_name(p) == "lab03")
    notebook = released(course, path)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in REBINDING and cell.cell_type == "code":
            cell.source = REBINDING[grade_id]
    submit(course, "rebinder", path, notebook)
    log = nbgrader(course, "autograde", "lab03", "--create")
    assert "answer-1: screened out: changes the attribute answer" in log, log[-3000:]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        graded = gradebook.find_submission_notebook(path.stem, "lab03", "rebinder")
        earned = {g.cell.name: g.score for g in graded.grades if g.auto_score}
        assert not earned, earned
    autograded = nbformat.read(
        course / "autograded" / "rebinder" / "lab03" / f"{path.stem}.ipynb", as_version=4
    )
    screened = next(
        c for c in autograded.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer-1"
    )
    error = next(o for o in screened.outputs if o.output_type == "error")
    assert "this answer cell was not run" in error.evalue  # what the student's feedback shows
    shutil.rmtree(course / "submitted")
