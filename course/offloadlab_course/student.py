"""The labs as assignments: nbgrader source notebooks, and the student release without nbgrader.

The labs are Jupytext notebooks with three kinds of code cell:

- an *answer* cell holds the worked answer between a ``### BEGIN SOLUTION`` line and a
  ``### END SOLUTION`` line (nbgrader's own markers); the book folds it (``hide-input``), and a
  folded code cell without the markers stops the release;
- a *graded* cell checks the answer; its MyST options say what it is worth (``:points: 2``). It
  may hold nbgrader's hidden tests (between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN
  TESTS``), which only the grader runs;
- a *reflection* is a Markdown cell with points (``+++ {"points": 1}``): a question graded by
  hand, whose text in the lab is a model answer (the book folds it in a dropdown) and in a
  release nbgrader's "YOUR ANSWER HERE"; a dropdown anywhere else stops the release;
- every other cell sets up, measures or explains, and is the same for everybody.

From them this module makes two things:

- :func:`source_notebook` — the lab as an nbgrader *source* notebook: solutions kept, answer
  and graded cells carrying nbgrader's metadata (ids, points), answer cells unfolded (the book
  may fold them), and a first code cell that puts the answer checks in the student release
  (see :mod:`offloadlab_course.check`).
  ``nbgrader generate_assignment`` turns it into what students get.
- :func:`release_notebook` — the same notebook with each solution replaced by nbgrader's own
  stub, exactly as ``generate_assignment`` does it, for instructors who hand labs out with
  nbgitpuller and no nbgrader. Both releases have the same cells (tests/test_nbgrader.py).

References to the book's chapters and labs (``{ref}``), which Lab cannot follow from a lone
notebook, become ordinary links: to the published site when a base URL is given
(``--book-url``, or ``OFFLOADLAB_BOOK_URL``), else to the chapter's file when the notebooks land
inside the checkout (``make lab``'s ``book/student``), else to nothing (the words stay, and no
link is dead).

``python -m offloadlab_course.student LABS_DIR TARGET_DIR`` writes the student release of every lab
as ``TARGET_DIR/<lab>.ipynb``; with ``--nbgrader`` it writes the source notebooks as
``TARGET_DIR/<assignment>/<lab>.ipynb``, ready to be an nbgrader course's ``source/`` folder
(each lab is one assignment, named by its number: ``lab01``). Existing notebooks are replaced
only with ``--force``; ``--keep`` writes only the missing ones. Each file is written whole
(a new file renamed into place), and a link or pipe found at its name is replaced, never
written through.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import warnings
from pathlib import Path

from offloadlab import files
from .check import STUDENT_VARIABLE
from offloadlab.units import is_number

__all__ = [
    "BEGIN",
    "END",
    "BEGIN_HIDDEN",
    "END_HIDDEN",
    "STUB",
    "SWITCH",
    "assignment_name",
    "find_labs",
    "strip_solutions",
    "strip_hidden_tests",
    "source_notebook",
    "released_lab",
    "unfold",
    "release_notebook",
    "write_release",
    "write_sources",
    "points",
]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# nbgrader's markers for checks that only the grader runs (graded cells only; gone from releases).
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
DROPDOWN = ":::{dropdown}"  # a reflection's model answer, folded
# the opening fence of a dropdown in any of MyST's spellings: three or more colons or backticks
DROPDOWN_FENCE = re.compile(r"^(?P<fence>:{3,}|`{3,})\{dropdown\}")
# a model answer's forms in MyST, reST or HTML: a dropdown, toggle or solution directive spelt
# any way, a dropdown or toggle class (as an option or in an option block), <details>
FOLDED_TEXT = re.compile(
    r"\{\s*(dropdown|toggle|solution(-start)?)\s*\}|\bclass:[^\n]*\b(dropdown|toggle)\b"
    r"|<details\b|^\s*\.\.\s+(dropdown|toggle|solution)::",
    re.IGNORECASE | re.MULTILINE,
)
# nbgrader's default ClearSolutions.code_stub for Python and text_stub, so both releases are the
# same text.
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"
BOOK_URL_VARIABLE = "OFFLOADLAB_BOOK_URL"
# A reference with its link text, as tools/lab_references.py writes them: {ref}`text <label>`.
REFERENCE = re.compile(r"\{ref\}`([^`<>]+?)\s+<([^`<>]+)>`")
# A reference to another page's heading, as tools/lab_references.py writes them for Lab:
# [text](../06_cpu_adam.md#ch-cpu-adam); and a citation, [(Ren et al., 2021)](cite:key).
HEADING_LINK = re.compile(r"\[([^\]`<>]+)\]\([^()\s#]+\.md#([^()\s]+)\)")
CITATION_LINK = re.compile(r"\[(\([^\]]*\))\]\(cite:[^()\s]+\)")
TARGET = re.compile(r"^\(([^()\s]+)\)=$", re.M)
# The first code cell of every student notebook: checks stop showing expected values.
SWITCH = (
    "# Student release: the answer checks say which way an answer is off, not what it should be.\n"
    "import os\n"
    f'os.environ["{STUDENT_VARIABLE}"] = "1"'
)
NBGRADER_SCHEMA = 3


def strip_solutions(source: str) -> str:
    """``source`` with every solution region replaced by :data:`STUB`, indented like its marker."""
    out, inside = [], False
    for lineno, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"source: line {lineno}: {BEGIN} inside another solution")
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + stub_line for stub_line in STUB.splitlines()]
            inside = True
        elif marker == END:
            if not inside:
                raise ValueError(f"source: line {lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"source: {BEGIN} without {END}")
    return "\n".join(out)


def strip_hidden_tests(source: str) -> str:
    """``source`` without its hidden-test regions, markers included, as nbgrader's release
    removes them."""
    out, inside = [], False
    for lineno, line in enumerate(source.splitlines(), 1):
        marker = line.strip()
        if marker == BEGIN_HIDDEN:
            if inside:
                raise ValueError(
                    f"source: line {lineno}: {BEGIN_HIDDEN} inside another hidden region"
                )
            inside = True
        elif marker == END_HIDDEN:
            if not inside:
                raise ValueError(f"source: line {lineno}: {END_HIDDEN} without {BEGIN_HIDDEN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"source: {BEGIN_HIDDEN} without {END_HIDDEN}")
    return "\n".join(out)


def assignment_name(path: Path) -> str:
    """The nbgrader assignment a lab becomes: its number, ``lab03`` for
    ``lab03_hide_a_transfer.md``."""
    return Path(path).stem.split("_", 1)[0]


def source_notebook(path: Path):
    """The lab at ``path`` (a Jupytext notebook) as an nbgrader source notebook; ValueError names
    the cell of a lab that nbgrader would reject or grade wrongly."""
    import jupytext
    import nbformat

    path = Path(path)
    try:
        notebook = jupytext.reads(_text(path), fmt="md:myst")
    except ValueError:
        raise
    except Exception as error:  # (a front matter YAML cannot parse, say: named, not a traceback)
        raise ValueError(
            f"{path.name}: not a Jupytext notebook ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    notebook.cells = [part for cell in notebook.cells for part in _reflection_apart(cell)]
    answers = checks = 0
    waiting_for_check = None  # the answer cell no graded cell has followed yet
    for index, cell in enumerate(notebook.cells, 1):
        where = f"{path.name}: cell {index}"
        _refuse_stray_markers(cell, where)
        _refuse_misplaced_points(cell, where)
        graded = "points" in cell.metadata  # (a points of null is points missing: refused below)
        points_given = cell.metadata.pop("points", None)
        if graded:
            _check_points(points_given, where)
        if cell.cell_type == "markdown" and points_given is not None:
            if FOLDED_TEXT.search(cell.source) and _dropdown_span(cell.source.splitlines()) is None:
                raise ValueError(
                    f"{where}: a reflection's model answer is folded in a `:::{{dropdown}}` block "
                    "starting a line; in another form the release would replace the whole cell, "
                    "question and all"
                )
            cell.source = reflection_answer(cell.source)
            cell.metadata["nbgrader"] = _nbgrader(
                f"reflection-{index}", solution=True, grade=True, points=points_given
            )
            continue
        is_answer = cell.cell_type == "code" and BEGIN in cell.source
        if END in cell.source:  # (an END whose BEGIN is missing would release the solution)
            _balanced(strip_solutions, cell.source, where)
        _refuse_unmarked_answer(cell, where, graded)
        if BEGIN_HIDDEN in cell.source or END_HIDDEN in cell.source:
            if points_given is None:
                raise ValueError(
                    f"{where}: hidden tests are allowed only in a graded cell (`:points:`)"
                )
            _balanced(strip_hidden_tests, cell.source, where)
        if is_answer:
            _balanced(strip_solutions, cell.source, where)
            if waiting_for_check is not None:
                raise ValueError(
                    f"{path.name}: cell {waiting_for_check}: an answer cell with no graded cell "
                    "(`:points:`) after it"
                )
            answers += 1
            waiting_for_check = index
            unfold(cell)
            cell.metadata["nbgrader"] = _nbgrader(f"answer-{answers}", solution=True)
        if points_given is not None:
            if is_answer:
                raise ValueError(
                    f"{where}: points: expected on a code cell that checks an answer, "
                    "not on an answer cell"
                )
            _check_points(points_given, where)
            checks += 1
            waiting_for_check = None
            cell.metadata["nbgrader"] = _nbgrader(
                f"check-{checks}", grade=True, points=points_given
            )
        elif cell.cell_type == "code" and not is_answer:
            # the lab's own cell: nbgrader puts it back as written before grading, and the
            # answer screen (guard.py) reads every code cell not marked so, added ones too
            cell.metadata["nbgrader"] = _nbgrader(f"lab-cell-{index}", locked=True)
    if waiting_for_check is not None:
        raise ValueError(
            f"{path.name}: cell {waiting_for_check}: an answer cell with no graded cell "
            "(`:points:`) after it"
        )
    if not checks:
        raise ValueError(
            f"{path.name}: expected at least one graded cell (`:points:` in its options)"
        )
    first_code = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")
    switch = nbformat.v4.new_code_cell(SWITCH)
    switch.metadata["nbgrader"] = _nbgrader("student-release", locked=True)
    notebook.cells.insert(first_code, switch)
    for number, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{number}"  # jupytext draws random ids; these make releases reproducible
    return notebook


def _check_points(points_given, where: str) -> None:
    if not is_number(points_given) or points_given <= 0:
        raise ValueError(f"{where}: points: expected a positive number; got {points_given!r}")


def _dropdown_span(lines: list[str]) -> tuple[int, int] | None:
    """The first and last line (its fences) of the first dropdown in ``lines``, or None."""
    for first, line in enumerate(lines):
        opening = DROPDOWN_FENCE.match(line)
        if opening:
            closing = opening["fence"]
            last = next(
                (i for i in range(first + 1, len(lines)) if lines[i].strip() == closing), None
            )
            return None if last is None else (first, last)
    return None


def _reflection_apart(cell) -> list:
    """``cell``, or a reflection cell split around its model answer: Jupytext runs a Markdown
    cell on to the next code cell, so a question written above a reflection's dropdown, or the
    text after it (a lab's "On your own", say), would be replaced by the student's answer too."""
    import nbformat

    if cell.cell_type != "markdown" or "points" not in cell.metadata:
        return [cell]
    lines = cell.source.splitlines()
    span = _dropdown_span(lines)
    if span is None:
        return [cell]
    first, last = span
    before, after = ("\n".join(part).strip() for part in (lines[:first], lines[last + 1 :]))
    cell.source = "\n".join(lines[first : last + 1])
    return [
        *([nbformat.v4.new_markdown_cell(before)] if before else []),
        cell,
        *([nbformat.v4.new_markdown_cell(after)] if after else []),
    ]


def reflection_answer(source: str) -> str:
    """The model answer of a reflection cell, without the dropdown the book folds it in."""
    lines = source.strip().splitlines()
    if _dropdown_span(lines) == (0, len(lines) - 1):
        lines = lines[1:-1]
    return "\n".join(lines).strip()


def unfold(cell) -> None:
    """Show an answer cell: the book folds its worked answers, but nbgrader copies a cell's metadata
    into the release, and a student's stub must not start hidden."""
    jupyter = cell.metadata.get("jupyter", {})
    jupyter.pop("source_hidden", None)
    if "jupyter" in cell.metadata and not jupyter:
        del cell.metadata["jupyter"]
    tags = [t for t in cell.metadata.get("tags", []) if t != "hide-input"]
    if tags:
        cell.metadata["tags"] = tags
    else:
        cell.metadata.pop("tags", None)


def _balanced(strip, source: str, where: str) -> None:
    """ValueError naming ``where`` (the lab and cell) if ``strip`` finds its markers unbalanced."""
    try:
        strip(source)
    except ValueError as error:
        raise ValueError(f"{where}: {str(error).removeprefix('source: ')}") from None


def release_notebook(source):
    """The student notebook of a source notebook: each solution replaced by :data:`STUB`, each
    hidden-test region removed (the grader restores graded cells from the source)."""
    notebook = copy.deepcopy(source)
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = TEXT_STUB
        if cell.cell_type == "code" and BEGIN in cell.source:
            cell.source = strip_solutions(cell.source)
        if cell.cell_type == "code" and BEGIN_HIDDEN in cell.source:
            cell.source = strip_hidden_tests(cell.source)
    return notebook


def points(notebook) -> float:
    """Total points of a source notebook's graded cells."""
    return sum(
        c.metadata.get("nbgrader", {}).get("points", 0)
        for c in notebook.cells
        if c.metadata.get("nbgrader", {}).get("grade")
    )


def find_labs(labs_dir: Path) -> list[Path]:
    """The Jupytext labs in ``labs_dir``, in order."""
    labs_dir = Path(labs_dir)
    if not labs_dir.is_dir():
        raise ValueError(f"labs_dir: expected a folder of labs; got {str(labs_dir)!r}")
    for odd in sorted(labs_dir.glob("lab*.md")):
        if odd.is_symlink() and not odd.exists():  # dangling, or a loop
            warnings.warn(f"labs_dir: {odd.name} is a broken link; skipped", stacklevel=2)
        elif odd.exists() and not odd.is_file():  # a folder, a FIFO, a socket
            warnings.warn(f"labs_dir: {odd.name} is not a regular file; skipped", stacklevel=2)
    named = [p for p in sorted(labs_dir.glob("lab*.md")) if p.is_file()]
    found = [p for p in named if _is_a_lab(p)]
    skipped = [p.name for p in named if p not in found]
    if not found:
        why = f": {', '.join(skipped)} has no Jupytext front matter" if skipped else ""
        raise ValueError(
            f"labs_dir: expected Jupytext labs (lab*.md) in {str(labs_dir)!r}; found none{why}"
        )
    for name in skipped:
        warnings.warn(
            f"labs_dir: {name} is not a Jupytext lab (no 'jupytext:' in its front matter); skipped",
            stacklevel=2,
        )
    return found


def _text(path: Path) -> str:
    """The file's text; ValueError naming it when it is no UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig")  # (a byte-order mark is no text)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def _is_a_lab(path: Path) -> bool:
    """A Jupytext lab: a regular file (a FIFO named lab*.md would block the read) whose YAML front
    matter, however long, names Jupytext; ValueError naming a file that is no UTF-8 text."""
    if not path.is_file():
        return False
    try:
        text = _text(path)
    except ValueError:
        raise ValueError(f"labs_dir: {path.name} is not UTF-8 text") from None
    if not text.startswith("---"):
        return False
    end = text.find("\n---", 3)
    return "jupytext:" in text[: None if end < 0 else end]


def _target_folder(target_dir: Path) -> Path:
    """``target_dir`` as a Path, if it is a folder or one can be made there (the nearest thing on
    its path that exists is a folder)."""
    target_dir = Path(target_dir)
    present = next(p for p in (target_dir, *target_dir.parents) if p.exists() or p.is_symlink())
    if not present.is_dir():
        raise ValueError(
            f"target_dir: expected a folder, or a path where one can be made; got "
            f"{str(target_dir)!r} ({str(present)!r} is not a folder)"
        )
    return target_dir


def write_release(
    labs_dir: Path,
    target_dir: Path,
    overwrite: bool = False,
    keep: bool = False,
    book_url: str | None = None,
) -> list[Path]:
    """Write the student notebook of every lab in ``labs_dir`` as ``target_dir/<lab>.ipynb``."""
    labs, target_dir = find_labs(labs_dir), _target_folder(target_dir)
    notebooks = {
        target_dir / path.with_suffix(".ipynb").name: released_lab(path, target_dir, book_url)
        for path in labs
    }
    return _write(notebooks, overwrite, keep)


def released_lab(path: Path, target_dir: Path, book_url: str | None = None):
    """The student notebook of the lab at ``path`` as :func:`write_release` writes it into
    ``target_dir``: :func:`release_notebook`, with the book's references made links."""
    links = _Links(
        Path(path).parent, Path(target_dir), book_url, lambda label_path: label_path.stem + ".ipynb"
    )
    return links.apply(release_notebook(source_notebook(path)))


def write_sources(
    labs_dir: Path,
    target_dir: Path,
    overwrite: bool = False,
    keep: bool = False,
    book_url: str | None = None,
) -> list[Path]:
    """Write every lab's nbgrader source notebook as ``target_dir/<assignment>/<lab>.ipynb``."""
    labs, target_dir = find_labs(labs_dir), _target_folder(target_dir)
    links = _Links(
        Path(labs_dir),
        target_dir,
        book_url,
        lambda label_path: f"../{assignment_name(label_path)}/{label_path.stem}.ipynb",
    )
    notebooks = {
        target_dir / assignment_name(path) / path.with_suffix(".ipynb").name: links.apply(
            source_notebook(path)
        )
        for path in labs
    }
    return _write(notebooks, overwrite, keep, made_below=target_dir)


class _Links:
    """Turns the labs' references to the book (``{ref}`` roles and links to a heading of a chapter
    file) into Markdown links that work where the notebooks land; citations into their words."""

    def __init__(self, labs_dir: Path, target_dir: Path, book_url: str | None, sibling):
        self.labs_dir, self.target_dir, self.sibling = labs_dir.resolve(), target_dir, sibling
        self.book_url = (
            book_url if book_url is not None else os.environ.get(BOOK_URL_VARIABLE, "")
        ).rstrip("/")
        if self.book_url and not re.fullmatch(r"https?://[^\s()<>\[\]]+", self.book_url):
            raise ValueError(
                f"--book-url (or ${BOOK_URL_VARIABLE}): expected an http:// or https:// address "
                f"with no spaces or brackets; got {self.book_url!r}"
            )
        self.pages = {}  # label -> (folder on the site, the .md file that defines it)
        for folder, site_folder in ((self.labs_dir.parent / "book", ""), (self.labs_dir, "labs/")):
            for page in sorted(folder.glob("*.md")):
                if not page.is_file():  # (a FIFO would block the read)
                    continue
                for label in TARGET.findall(_text(page)):
                    self.pages.setdefault(label, (site_folder, page))

    def url(self, label: str) -> str | None:
        if label not in self.pages:
            return None
        site_folder, page = self.pages[label]
        if self.book_url:
            return f"{self.book_url}/{site_folder}{page.stem}.html#{label}"
        if page.parent == self.labs_dir:  # another lab: its release beside this one
            return self.sibling(page)
        folder = Path(os.path.abspath(self.target_dir))
        if self.sibling(page).startswith("../"):  # nbgrader's layout: one folder per assignment
            folder = folder / "assignment"
        if self.labs_dir.parent in folder.parents:  # inside the checkout: the chapter's own file
            return os.path.relpath(page, folder)
        return None

    def apply(self, notebook):
        for cell in notebook.cells:
            if cell.cell_type == "markdown":
                source = REFERENCE.sub(self._link, cell.source)
                source = HEADING_LINK.sub(self._link, source)
                cell.source = CITATION_LINK.sub(r"\1", source)  # the site has the bibliography
        return notebook

    def _link(self, match) -> str:
        text, label = match[1], match[2]
        url = self.url(label)
        return f"[{text}]({url})" if url else f"*{text}*"


def _write(
    notebooks: dict, overwrite: bool, keep: bool = False, made_below: Path | None = None
) -> list[Path]:
    """Write every notebook, or none: an existing file (a student's work, an instructor's edits)
    is replaced only with ``overwrite``, or left as it is with ``keep``. Each is written whole,
    and whatever lies at its name (a link planted there, say) is replaced, never written through.
    The folders below ``made_below`` are this module's (an assignment's): a link in place of one
    is refused, whatever the options, rather than followed."""
    import nbformat

    if made_below is not None:
        for out in notebooks:
            for folder in reversed(out.parent.relative_to(made_below).parents[:-1]):
                _refuse_link(made_below / folder)
            _refuse_link(out.parent)
    existing = [out for out in notebooks if out.exists() or out.is_symlink()]
    if keep:
        notebooks = {out: notebook for out, notebook in notebooks.items() if out not in existing}
    elif existing and not overwrite:
        raise ValueError(
            f"target_dir: {existing[0]} exists; remove it or pass overwrite=True (--force)"
        )
    for out, notebook in notebooks.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(out, nbformat.writes(notebook) + "\n", replace=True, follow=False)
    return list(notebooks)


def _refuse_link(folder: Path) -> None:
    if folder.is_symlink():
        raise ValueError(
            f"target_dir: {folder} is a symbolic link (to {os.readlink(folder)!r}), where an "
            "assignment's folder is made; remove it, or choose another target folder"
        )


def _nbgrader(
    grade_id: str,
    solution: bool = False,
    grade: bool = False,
    points: float = 0,
    locked: bool = False,
) -> dict:
    """nbgrader's cell metadata (schema 3). Graded cells are locked: nbgrader restores them
    before grading."""
    metadata = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked or (grade and not solution),
        "schema_version": NBGRADER_SCHEMA,
        "solution": solution,
        "task": False,
    }
    if grade:
        metadata["points"] = points
    return metadata


def _refuse_unmarked_answer(cell, where: str, graded: bool) -> None:
    """The book folds a lab's worked answers (``hide-input``): a folded code cell whose markers
    were both lost or reworded would ship its answer."""
    tags = cell.metadata.get("tags", [])
    hidden = cell.metadata.get("jupyter", {}).get("source_hidden")
    folded = {"hide-input", "hide-cell"} & set(tags) or (hidden and "remove-cell" not in tags)
    if cell.cell_type == "code" and folded and not graded and BEGIN not in cell.source:
        raise ValueError(
            f"{where}: a code cell folded as a worked answer with no {BEGIN!r} line, so the "
            f"release would keep all of it: mark the answer ({BEGIN} … {END}) or unfold the cell"
        )


def _refuse_misplaced_points(cell, where: str) -> None:
    """Points misspelt or nested, or a dropdown in a cell without them, would ship a
    reflection's model answer."""
    for key in cell.metadata:
        if key != "points" and (key.lower().rstrip("s") == "point" or key == "nbgrader"):
            raise ValueError(
                f"{where}: {key!r} in the cell's options: a graded cell gives `points` (lower "
                "case, at the top level); the release writes nbgrader's metadata itself"
            )
    if (
        cell.cell_type == "markdown"
        and FOLDED_TEXT.search(cell.source)
        and "points" not in cell.metadata
    ):
        raise ValueError(
            f"{where}: a dropdown, toggle or solution in a cell with no points: in a lab it holds "
            "a reflection's model answer, which the release replaces only in a cell with points "
            "(one dropdown a cell)"
        )


def _refuse_stray_markers(cell, where: str) -> None:
    """nbgrader treats any line *containing* a marker as one, even in prose: allow only marker
    lines in code. A comment that is nearly a marker (``### begin solution``, ``### BEGIN
    SOLUTON``) is refused too: neither this module nor nbgrader would strip what follows it."""
    import difflib

    markers = (BEGIN, END, BEGIN_HIDDEN, END_HIDDEN)
    for lineno, line in enumerate(cell.source.splitlines(), 1):
        for marker in markers:
            bare = marker.removeprefix("### ")
            if bare in line and not (cell.cell_type == "code" and line.strip() == marker):
                raise ValueError(
                    f"{where}: line {lineno}: {bare!r} outside a marker line of a code cell "
                    "(nbgrader would cut the cell there)"
                )
        letters = re.sub(r"[^a-z]", "", line.lower())
        if cell.cell_type != "code" or not line.strip().startswith("#") or line.strip() in markers:
            continue
        for marker in markers:
            wanted = re.sub(r"[^a-z]", "", marker.lower())
            if difflib.SequenceMatcher(None, letters, wanted).ratio() >= 0.85:
                raise ValueError(
                    f"{where}: line {lineno}: {line.strip()!r} is nearly the marker {marker!r} "
                    "but not it, so the release would keep what it marks: write the marker exactly"
                )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m offloadlab_course.student",
        description="Write the labs as student notebooks or as nbgrader source notebooks.",
    )
    parser.add_argument("labs_dir", type=_folder, help="the folder of Jupytext labs (labs/)")
    parser.add_argument("target_dir", type=_folder, help="where the notebooks go")
    parser.add_argument(
        "--nbgrader",
        action="store_true",
        help="write nbgrader source notebooks (solutions kept) as "
        "TARGET_DIR/<assignment>/<lab>.ipynb",
    )
    replacing = parser.add_mutually_exclusive_group()
    replacing.add_argument(
        "--force", action="store_true", help="replace notebooks that already exist"
    )
    replacing.add_argument(
        "--keep", action="store_true", help="write only the notebooks that do not exist yet"
    )
    parser.add_argument(
        "--book-url",
        default=None,
        help="the published book's address, for links to its chapters (default: "
        f"${BOOK_URL_VARIABLE})",
    )
    options = parser.parse_args(argv)

    def one_line(message, *_):  # a notice, not Python's file:line and source line
        print(f"offloadlab_course.student: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = one_line
        return _release(options)


def _release(options) -> int:
    try:
        write = write_sources if options.nbgrader else write_release
        for path in write(
            options.labs_dir,
            options.target_dir,
            overwrite=options.force,
            keep=options.keep,
            book_url=options.book_url,
        ):
            print(f"wrote {path}")
    except ValueError as error:
        print(f"offloadlab_course.student: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # (named by the folder it happened in, without its errno)
        path = Path(error.filename or options.target_dir)  # (no name: a file being written)
        where = "labs_dir" if options.labs_dir in (path, *path.parents) else "target_dir"
        said = re.sub(r"^\[Errno \d+\] ", "", str(error))
        print(f"offloadlab_course.student: error: {where}: {said}", file=sys.stderr)
        return 2
    return 0


def _folder(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder name; got {text!r}")
    return Path(text)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
