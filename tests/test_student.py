"""The student release and the nbgrader source notebooks made from the labs."""

import os
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from offloadlab_course.student import (
    BEGIN,
    BEGIN_HIDDEN,
    END,
    END_HIDDEN,
    STUB,
    SWITCH,
    TEXT_STUB,
    assignment_name,
    points,
    release_notebook,
    released_lab,
    source_notebook,
    strip_solutions,
)
from tests.conftest import ROOT
from tests.kernels import UnixSocketKernelManager

LABS = sorted((ROOT / "labs").glob("lab*.md"))
HEADER = (
    "---\njupytext:\n  text_representation:\n    extension: .md\n    format_name: myst\n---\n\n"
)


def lab(tmp_path, body: str):
    path = tmp_path / "lab09_test.md"
    path.write_text(HEADER + body, encoding="utf-8")
    return path


def code(source: str, options: str = "") -> str:
    return f"```{{code-cell}} ipython3\n{options}{source}\n```\n\n"


def test_strip_solutions_uses_nbgraders_stub_at_the_markers_indent():
    source = f"x = 1\n{BEGIN}\nanswer = 42\n{END}\ndef f():\n    {BEGIN}\n    return 1\n    {END}\n"
    stripped = strip_solutions(source)
    assert stripped == "x = 1\n" + STUB + "\ndef f():\n" + "\n".join(
        "    " + s for s in STUB.splitlines()
    )
    with pytest.raises(ValueError, match="without"):
        strip_solutions(f"{BEGIN}\nx = 1\n")
    with pytest.raises(ValueError, match="without"):
        strip_solutions(f"x = 1\n{END}\n")
    with pytest.raises(ValueError, match="inside another"):
        strip_solutions(f"{BEGIN}\n{BEGIN}\n{END}\n")


def test_answers_the_book_folds_are_unfolded_for_nbgrader_and_students(tmp_path):
    folded = "---\njupyter:\n  source_hidden: true\ntags: [hide-input, keep]\n---\n"
    path = lab(
        tmp_path, code(f"{BEGIN}\nx = 2\n{END}", folded) + code("assert x == 2", ":points: 1\n\n")
    )
    notebook = source_notebook(path)
    answer = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution"))
    assert "jupyter" not in answer.metadata and answer.metadata.tags == ["keep"]
    # the source itself is untouched
    assert jupytext_metadata(path)["jupyter"] == {"source_hidden": True}


def jupytext_metadata(path):
    import jupytext

    return jupytext.read(path).cells[0].metadata


def test_source_notebook_marks_answers_checks_and_points(tmp_path):
    path = lab(
        tmp_path,
        "# Lab\n\n"
        + code("import math")
        + code(f"{BEGIN}\nx = 2\n{END}")
        + code("assert x == 2", ":points: 3\n\n"),
    )
    notebook = source_notebook(path)
    cells = notebook.cells
    # before the first code cell
    assert cells[1].source == SWITCH and cells[1].metadata.nbgrader["locked"]
    assert cells[3].metadata.nbgrader == {
        "grade": False,
        "grade_id": "answer-1",
        "locked": False,
        "schema_version": 3,
        "solution": True,
        "task": False,
    }
    assert cells[4].metadata.nbgrader == {
        "grade": True,
        "grade_id": "check-1",
        "locked": True,
        "points": 3,
        "schema_version": 3,
        "solution": False,
        "task": False,
    }
    assert "points" not in cells[4].metadata
    # the lab's own code cell: locked, so nbgrader restores it and the screen tells it from an
    # added cell
    assert cells[2].metadata.nbgrader["locked"] and not cells[2].metadata.nbgrader["solution"]
    assert points(notebook) == 3 and [c.id for c in cells] == [f"cell-{i}" for i in range(5)]
    assert BEGIN not in "".join(c.source for c in release_notebook(notebook).cells)
    assert BEGIN in cells[3].source  # the source keeps its solution; the release is a copy
    nbformat.validate(notebook)


def test_hidden_tests_stay_in_the_source_and_leave_the_release(tmp_path):
    """nbgrader's hidden tests: what only the grader runs is in no student notebook."""
    check = f"assert x > 0\n{BEGIN_HIDDEN}\nassert x == 2\n{END_HIDDEN}"
    notebook = source_notebook(
        lab(tmp_path, "# Lab\n\n" + code(f"{BEGIN}\nx = 2\n{END}") + code(check, ":points: 1\n\n"))
    )
    assert notebook.cells[-1].source == check
    released = release_notebook(notebook).cells[-1].source
    assert released == "assert x > 0" and "x == 2" not in released
    with pytest.raises(ValueError, match="hidden tests are allowed only in a graded cell"):
        source_notebook(
            lab(
                tmp_path,
                code(f"{BEGIN_HIDDEN}\nassert True\n{END_HIDDEN}")
                + code("assert 1", ":points: 1\n\n"),
            )
        )


@pytest.mark.parametrize(
    "body, complaint",
    [
        (
            "Write it between `### BEGIN SOLUTION` and the end.\n\n"
            + code("assert True", ":points: 1\n\n"),
            "cell 1: line 1: 'BEGIN SOLUTION' outside a marker line",
        ),
        (
            code(f"x = 1  # {BEGIN}\n{END}") + code("assert x", ":points: 1\n\n"),
            "outside a marker line",
        ),
        (
            code(f"{BEGIN}\nx = 1\n{END}")
            + code(f"{BEGIN}\ny = 1\n{END}")
            + code("assert x", ":points: 1\n\n"),
            "cell 1: an answer cell with no graded cell",
        ),
        (code(f"{BEGIN}\nx = 1\n{END}"), "cell 1: an answer cell with no graded cell"),
        (code("x = 1"), "expected at least one graded cell"),
        (code("assert True", ":points: 0\n\n"), "points: expected a positive number; got 0"),
        (
            code("assert True", ":points: many\n\n"),
            "points: expected a positive number; got 'many'",
        ),
        (code(f"{BEGIN}\nx = 1\n{END}", ":points: 1\n\n"), "not on an answer cell"),
        (
            '+++ {"points": -1}\n\nWhy?\n\n' + code("assert True", ":points: 1\n\n"),
            "points: expected a positive number; got -1",
        ),
    ],
)
def test_source_notebook_refuses_what_nbgrader_would_cut_or_grade_wrongly(
    tmp_path, body, complaint
):
    with pytest.raises(
        ValueError, match="lab09_test.md: " if "cell" in complaint else complaint
    ) as info:
        source_notebook(lab(tmp_path, body))
    assert complaint in str(info.value)


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_every_lab_is_a_valid_assignment(path):
    notebook = source_notebook(path)
    nbformat.validate(notebook)
    assert points(notebook) > 0 and assignment_name(path) == path.stem[:5]
    released = release_notebook(notebook)
    sources = "\n".join(c.source for c in released.cells)
    assert BEGIN not in sources and END not in sources and STUB in sources
    assert (
        released.cells[
            next(i for i, c in enumerate(released.cells) if c.cell_type == "code")
        ].source
        == SWITCH
    )
    for cell in released.cells:  # nothing a student must write starts folded (checks may: issue 28)
        if cell.metadata.get("nbgrader", {}).get("solution"):
            assert not cell.metadata.get("jupyter", {}).get(
                "source_hidden"
            ) and "hide-input" not in cell.metadata.get("tags", [])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    target = tmp_path_factory.mktemp("student")
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab_course.student", "labs", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return target


def test_every_lab_is_released_without_solutions(release):
    assert sorted(p.stem for p in release.glob("*.ipynb")) == [p.stem for p in LABS]
    for path in LABS:
        released = nbformat.read(release / f"{path.stem}.ipynb", as_version=4)
        assert released == released_lab(path, release), path.name
        assert [c.source for c in released.cells if c.cell_type == "code"] == [
            c.source for c in release_notebook(source_notebook(path)).cells if c.cell_type == "code"
        ]
        worked = "\n".join(
            line.strip()
            for cell in source_notebook(path).cells
            for line in cell.source.splitlines()
        )
        inside = worked.split(BEGIN)[1].split(END)[0].strip()  # the first worked answer's text
        assert inside and inside not in "\n".join(c.source for c in released.cells), path.name
        # the checks stay
        assert any("check." in c.source or "assert" in c.source for c in released.cells)


@pytest.mark.parametrize("lab", ["lab01_account_for_every_byte", "lab03_hide_a_transfer"])
def test_student_notebook_runs_up_to_its_first_exercise(release, lab):
    notebook = nbformat.read(release / f"{lab}.ipynb", as_version=4)
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        kernel_manager_class=UnixSocketKernelManager,
        resources={"metadata": {"path": str(release)}},
    )
    with pytest.raises(CellExecutionError) as info:
        client.execute()
    assert "NotImplementedError" in str(info.value)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    failed = next(
        i
        for i, c in enumerate(code)
        if any(o.get("ename") == "NotImplementedError" for o in c.get("outputs", []))
    )
    assert code[failed].metadata.nbgrader["grade_id"] == "answer-1"
    assert all(c.get("execution_count") for c in code[:failed])  # everything before it ran


def test_the_text_after_a_reflection_reaches_the_student(tmp_path):
    """Jupytext runs a Markdown cell on to the next code cell: a lab's "On your own" after its
    last reflection was released inside the reflection's answer cell, as "YOUR ANSWER HERE"."""
    command = [sys.executable, "-m", "offloadlab_course.student", "labs", str(tmp_path)]
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    for path in sorted((ROOT / "labs").glob("lab*.md")):
        released = nbformat.read(tmp_path / f"{path.stem}.ipynb", as_version=4)
        text = "\n".join(c.source for c in released.cells if c.cell_type == "markdown")
        headings = [line for line in path.read_text().splitlines() if line.startswith("## ")]
        assert headings and [h for h in headings if h not in text] == [], path.name


def test_released_references_link_to_the_site_or_the_chapter_file_or_nothing(tmp_path):
    """Lab cannot follow {ref}: a release turns each into a link that works where it lands."""
    site = tmp_path / "site"
    command = [
        sys.executable,
        "-m",
        "offloadlab_course.student",
        "labs",
        str(site),
        "--book-url",
        "https://example.org/book/",
    ]
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    text = (site / "lab07_one_tier_further.ipynb").read_text(encoding="utf-8")
    assert "{ref}" not in text and "(https://example.org/book/08_nvme.html#ch-nvme)" in text
    assert "(https://example.org/book/labs/lab06_plan_your_run.html#lab-plan)" in text
    inside = ROOT / "build" / "test-release-links"
    try:
        assert (
            subprocess.run(
                command[:4] + [str(inside)], cwd=ROOT, capture_output=True, env=without_book_url()
            ).returncode
            == 0
        )
        assert (
            "[8. One tier further: NVMe](../../book/08_nvme.md)"
            in (inside / "lab07_one_tier_further.ipynb").read_text()
        )
    finally:
        shutil.rmtree(inside, ignore_errors=True)
    # neither a site nor the book's files: the words, and no dead link
    outside = tmp_path / "elsewhere"
    assert (
        subprocess.run(
            command[:4] + [str(outside)], cwd=ROOT, capture_output=True, env=without_book_url()
        ).returncode
        == 0
    )
    released = nbformat.read(outside / "lab07_one_tier_further.ipynb", as_version=4)
    prose = "\n".join(c.source for c in released.cells if c.cell_type == "markdown")
    assert "{ref}" not in prose and "*8. One tier further: NVMe*" in prose and "](../" not in prose
    # another lab: its release beside this one
    assert "[Lab 6: Plan your run](lab06_plan_your_run.ipynb)" in prose


def without_book_url():
    return {k: v for k, v in os.environ.items() if k != "OFFLOADLAB_BOOK_URL"}


def test_force_replaces_a_link_planted_at_a_release_path_and_never_writes_through_it(tmp_path):
    """Issue 24, finding 14: `make student` wrote through a symbolic link found at a release
    path."""
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours", encoding="utf-8")
    target = tmp_path / "release"
    target.mkdir()
    planted = target / f"{LABS[0].stem}.ipynb"
    planted.symlink_to(victim)
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab_course.student", "--force", "labs", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert victim.read_text(encoding="utf-8") == "not yours"
    assert not planted.is_symlink() and nbformat.read(planted, as_version=4).cells


def test_force_replaces_each_notebook_whole_by_renaming_a_new_file_into_place(tmp_path):
    """A reader of the old notebook, or a crash mid-write, never sees half a notebook: the old
    file is replaced by a rename (a new inode), not rewritten where it lies."""
    command = [sys.executable, "-m", "offloadlab_course.student", "labs", str(tmp_path)]
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    old = tmp_path / f"{LABS[0].stem}.ipynb"
    with old.open("rb") as reader:
        before = os.fstat(reader.fileno()).st_ino
        assert subprocess.run(command + ["--force"], cwd=ROOT, capture_output=True).returncode == 0
        assert reader.read() and old.stat().st_ino != before
    # no scratch left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{p.stem}.ipynb" for p in LABS)


def test_keep_writes_only_what_is_missing(tmp_path):
    command = [sys.executable, "-m", "offloadlab_course.student", "--keep", "labs", str(tmp_path)]
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    mine = tmp_path / f"{LABS[0].stem}.ipynb"
    mine.write_text("a student's work", encoding="utf-8")
    (tmp_path / f"{LABS[1].stem}.ipynb").unlink()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert (
        result.returncode == 0 and result.stdout.strip() == f"wrote {tmp_path / LABS[1].stem}.ipynb"
    )
    assert mine.read_text(encoding="utf-8") == "a student's work"


def test_a_reflection_is_graded_by_hand_and_released_as_nbgraders_text_stub(tmp_path):
    body = (
        code(f"{BEGIN}\nx = 2\n{END}")
        + code("assert x == 2", ":points: 1\n\n")
        + 'Why does it work?\n\n+++ {"points": 2}\n\n:::{dropdown} A model answer\nBecause.\n:::\n'
    )
    notebook = source_notebook(lab(tmp_path, body))
    reflection = notebook.cells[-1]
    assert reflection.cell_type == "markdown" and reflection.source == "Because."
    assert reflection.metadata.nbgrader == {
        "grade": True,
        "grade_id": "reflection-4",
        "locked": False,
        "points": 2,
        "schema_version": 3,
        "solution": True,
        "task": False,
    }
    assert points(notebook) == 3 and release_notebook(notebook).cells[-1].source == TEXT_STUB


def test_existing_notebooks_are_replaced_only_with_force(tmp_path):
    command = [sys.executable, "-m", "offloadlab_course.student", "labs", str(tmp_path)]
    assert subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0
    mine = tmp_path / f"{LABS[0].stem}.ipynb"
    mine.write_text("a student's work", encoding="utf-8")
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and "exists" in refused.stderr and "--force" in refused.stderr
    assert mine.read_text(encoding="utf-8") == "a student's work"
    assert subprocess.run(command + ["--force"], cwd=ROOT, capture_output=True).returncode == 0
    assert nbformat.read(mine, as_version=4).cells


def test_nbgrader_sources_are_one_assignment_per_lab(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab_course.student", "--nbgrader", "labs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    for path in LABS:
        written = nbformat.read(tmp_path / path.stem[:5] / f"{path.stem}.ipynb", as_version=4)
        source = source_notebook(path)
        assert [(c.cell_type, c.metadata) for c in written.cells] == [
            (c.cell_type, c.metadata) for c in source.cells
        ]
        assert [c.source for c in written.cells if c.cell_type == "code"] == [
            c.source for c in source.cells if c.cell_type == "code"
        ]
        assert BEGIN in "".join(c.source for c in written.cells) and "{ref}" not in "".join(
            c.source for c in written.cells
        )


@pytest.mark.parametrize(
    "arguments, complaint",
    [(["no-such-folder", "out"], "labs_dir"), (["tests", "out"], "found none"), ([], "usage")],
)
def test_bad_arguments(arguments, complaint, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab_course.student", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 2 and complaint in result.stderr and "Traceback" not in result.stderr
    )


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "--force"])
@pytest.mark.parametrize("dangling", [False, True], ids=["to a folder", "dangling"])
def test_nbgrader_refuses_a_link_planted_as_an_assignment_folder(tmp_path, dangling, force):
    """Issue 37, item 6: the instructor's notebook, solutions included, landed where a link
    planted in place of `lab01` pointed."""
    elsewhere = tmp_path / "elsewhere"
    if not dangling:
        elsewhere.mkdir()
    target = tmp_path / "source"
    target.mkdir()
    (target / assignment_name(LABS[0])).symlink_to(elsewhere)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab_course.student",
            "--nbgrader",
            *force,
            "labs",
            str(target),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "is a symbolic link" in result.stderr and "Traceback" not in result.stderr
    assert not any(elsewhere.rglob("*")) if not dangling else not elsewhere.exists()
    assert sorted(p.name for p in target.iterdir()) == [assignment_name(LABS[0])]  # none written


@pytest.mark.parametrize(
    "begin, said",
    [
        ("### BEGIN SOLUTON", "is nearly the marker '### BEGIN SOLUTION'"),
        ("### begin solution", "is nearly the marker '### BEGIN SOLUTION'"),
        (None, "### END SOLUTION without ### BEGIN SOLUTION"),
    ],
    ids=["misspelt", "lower-case", "deleted"],
)
@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_a_damaged_solution_marker_stops_the_release_rather_than_ship_the_answer(
    begin, said, nbgrader, tmp_path
):
    labs = tmp_path / "labs"
    labs.mkdir()
    text = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "### BEGIN SOLUTION")
    answer = lines[first + 1].strip()
    lines[first : first + 1] = [] if begin is None else [begin + "\n"]
    (labs / "lab01_x.md").write_text("".join(lines), encoding="utf-8")
    command = [sys.executable, "-m", "offloadlab_course.student", str(labs), str(tmp_path / "out")]
    done = subprocess.run(command + ["--nbgrader"] * nbgrader, capture_output=True, text=True)
    assert done.returncode == 2 and said in done.stderr and "lab01_x.md: cell" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    released = [p.read_text() for p in (tmp_path / "out").rglob("*.ipynb")]
    assert not any(answer in text for text in released)


def _release(tmp_path, text, nbgrader):
    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "lab01_x.md").write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "offloadlab_course.student", str(labs), str(tmp_path / "out")]
    done = subprocess.run(command + ["--nbgrader"] * nbgrader, capture_output=True, text=True)
    released = [p.read_text() for p in (tmp_path / "out").rglob("*.ipynb")]
    return done, released


@pytest.mark.parametrize(
    "begin, end",
    [(None, None), ("### START SOLUTION", "### STOP SOLUTION"), ("# BEGIN ANSWER", "# END ANSWER")],
    ids=["both-deleted", "reworded", "other-words"],
)
@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_a_folded_answer_cell_without_its_markers_stops_the_release(begin, end, nbgrader, tmp_path):
    """A lab's folded code cells are its worked answers: with both marker lines gone (or both
    reworded) nothing said where the answer was, and the release shipped it."""
    lines = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text().splitlines(True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "### BEGIN SOLUTION")
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "### END SOLUTION")
    answer = lines[first + 1].strip()
    lines[last : last + 1] = [] if end is None else [end + "\n"]
    lines[first : first + 1] = [] if begin is None else [begin + "\n"]
    done, released = _release(tmp_path, "".join(lines), nbgrader)
    assert done.returncode == 2 and "lab01_x.md: cell" in done.stderr, done.stderr
    assert "folded as a worked answer" in done.stderr and "### BEGIN SOLUTION" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not any(answer in text for text in released)


REFLECTION = '+++ {"points": 1}\n\n:::{dropdown} A model answer\n'


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda t: t.replace('+++ {"points": 1}', '+++ {"Points": 1}', 1), "'Points'"),
        (
            lambda t: t.replace('+++ {"points": 1}', '+++ {"nbgrader": {"points": 1}}', 1),
            "'nbgrader'",
        ),
        (lambda t: t.replace('+++ {"points": 1}\n', "+++\n", 1), "no points"),
        (lambda t: t.replace('+++ {"points": 1}', '+++ {"points": null}', 1), "got None"),
        (
            lambda t: t.replace(REFLECTION, "+++\n\n::: {Dropdown} A model answer\n", 1),
            "no points",
        ),
        (
            lambda t: t.replace(
                REFLECTION, "+++\n\n:::{admonition} A model answer\n:class: dropdown\n", 1
            ),
            "no points",
        ),
        (
            lambda t: t.replace(
                REFLECTION, "+++\n\n<details><summary>A model answer</summary>\n", 1
            ),
            "no points",
        ),
        # (the sixteenth pass, R263-R266: the chapters' own solution directive, and other folds
        # the book renders: a toggle, a class in an option block, reST's dropdown)
        (lambda t: t.replace(REFLECTION, "+++\n\n:::{solution} ex-1\n", 1), "no points"),
        (lambda t: t.replace(REFLECTION, "+++\n\n```{solution-start} ex-1\n```\n", 1), "no points"),
        (lambda t: t.replace(REFLECTION, "+++\n\n:::{toggle}\n", 1), "no points"),
        (
            lambda t: t.replace(
                REFLECTION, "+++\n\n:::{admonition} A model answer\n---\nclass: dropdown\n---\n", 1
            ),
            "no points",
        ),
        (
            lambda t: t.replace(
                ":::{dropdown} A model answer\n",
                ":::{dropdown} Hint\nThink first.\n:::\n\n:::{dropdown} A model answer\n",
                1,
            ),
            "no points",
        ),
    ],
    ids=[
        "capital-P",
        "nbgrader-key",
        "points-deleted",
        "points-null",
        "dropdown-spelt-otherwise",
        "admonition-class",
        "html-details",
        "solution-directive",
        "solution-start",
        "toggle",
        "class-in-an-option-block",
        "second-dropdown",
    ],
)
@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_a_reflection_whose_points_are_damaged_stops_the_release(damage, said, nbgrader, tmp_path):
    """A reflection's model answer is replaced only in a cell with points: misspelt, nested or
    lost points, or a second dropdown after the first, shipped a model answer."""
    text = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text(encoding="utf-8")
    assert REFLECTION in text
    start = text.index(REFLECTION) + len(REFLECTION)
    answer = text[start:].splitlines()[0].strip()
    assert len(answer) > 40
    done, released = _release(tmp_path, damage(text), nbgrader)
    assert done.returncode == 2 and "lab01_x.md: cell" in done.stderr, done.stderr
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not any(answer in text for text in released)


@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_an_answer_folded_whole_with_its_markers_deleted_stops_the_release(nbgrader, tmp_path):
    """Fifteenth probe pass, R122, R137, R180: `hide-cell` folds a cell as `hide-input` does."""
    lines = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text().splitlines(True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "### BEGIN SOLUTION")
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "### END SOLUTION")
    tag = next(i for i in range(first, 0, -1) if lines[i].strip() == "tags: [hide-input]")
    answer = lines[first + 1].strip()
    del lines[last], lines[first]
    lines[tag] = "tags: [hide-cell]\n"
    assert lines[tag - 2 : tag] == ["jupyter:\n", "  source_hidden: true\n"]
    del lines[tag - 2 : tag]  # folded by the tag alone
    done, released = _release(tmp_path, "".join(lines), nbgrader)
    assert done.returncode == 2 and "folded as a worked answer" in done.stderr, done.stderr
    assert not any(answer in text for text in released)


def test_a_folded_graded_check_is_no_worked_answer(tmp_path):
    """Fifteenth probe pass, R141: a graded cell folded like an answer is still a check."""
    text = (ROOT / "labs" / "lab01_account_for_every_byte.md").read_text(encoding="utf-8")
    graded = ":points: 1\n"
    assert graded in text
    done, released = _release(
        tmp_path, text.replace(graded, graded + "tags: [hide-input]\n", 1), False
    )
    assert done.returncode == 0, done.stderr
