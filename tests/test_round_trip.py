"""Every chapter and lab is exactly what Jupytext writes for it, so saving in JupyterLab changes nothing.

JupyterLab (through Jupytext) saves a text notebook by writing it out again; a source that is not
a fixed point of Jupytext's reader and writer is rewritten on the first save or autosave. The
settings Lab uses are the ``jupytext.toml`` beside each notebook; these tests use the same ones.
``make format`` (tools/format_notebooks.py) rewrites the sources to their fixed point.
"""

import subprocess
import sys

import jupytext
import pytest

from tests.conftest import ROOT
from tests.nbval_markdown import is_text_notebook

sys.path.insert(0, str(ROOT / "tools"))
import format_notebooks  # noqa: E402  (tools/ is not a package)

NOTEBOOKS = format_notebooks.notebooks()


def test_every_text_notebook_is_covered():
    expected = sorted(p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p))
    assert NOTEBOOKS == expected and len(NOTEBOOKS) >= 14


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_jupytext_writes_back_the_same_bytes(path):
    text = path.read_text(encoding="utf-8")
    assert format_notebooks.round_trip(path) == text, f"{path.name} changes when saved: run `make format`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_sources_are_formatted(path):
    assert format_notebooks.formatted(path) == path.read_text(encoding="utf-8"), "run `make format`"


def test_references_to_headings_carry_their_text():
    """So that JupyterLab, which resolves none across notebooks, shows words (tools/lab_references.py)."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "lab_references.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr + "run `make format`"


def test_a_reference_keeps_up_with_its_heading():
    sys.path.insert(0, str(ROOT / "tools"))
    from lab_references import with_link_text

    titles = {"ch-cpu-adam": "6. CPU Adam: the update that belongs on the CPU"}
    stale = "see {ref}`6. CPU Adam: an older title <ch-cpu-adam>` and {ref}`ch-cpu-adam`"
    assert with_link_text(stale, titles) == ("see {ref}`6. CPU Adam: the update that belongs on the CPU <ch-cpu-adam>` "
                                            "and {ref}`6. CPU Adam: the update that belongs on the CPU <ch-cpu-adam>`")
    mine = "the {ref}`optimizer chapter <ch-cpu-adam>`"  # a text written by hand is left alone
    assert with_link_text(mine, titles) == mine
    # A role broken across lines is no role to jupyterlab-myst (its pattern stops at a line end):
    # Lab shows the raw text. It is put back on one line, hand-written text included.
    wrapped = "see {ref}`the optimizer\nchapter <ch-cpu-adam>` and {ref}`6. CPU Adam: the update that belongs on the CPU\n<ch-cpu-adam>`"
    assert with_link_text(wrapped, titles) == ("see {ref}`the optimizer chapter <ch-cpu-adam>` and "
                                               "{ref}`6. CPU Adam: the update that belongs on the CPU <ch-cpu-adam>`")


def test_one_jupytext_configuration_for_book_and_labs():
    book, labs = (ROOT / d / "jupytext.toml" for d in ("book", "labs"))
    assert book.read_bytes() == labs.read_bytes()
    assert "jupytext_version" not in next(iter(NOTEBOOKS)).read_text(encoding="utf-8")


def test_lab_solutions_start_hidden_and_everything_else_visible():
    for path in (ROOT / "labs").glob("lab*.md"):
        notebook = jupytext.read(path)
        for cell in notebook.cells:
            hidden = cell.metadata.get("jupyter", {}).get("source_hidden", False)
            holds_answer = cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source
            assert hidden == holds_answer, f"{path.name}: {cell.source[:60]!r}"
            assert ("hide-input" in cell.metadata.get("tags", [])) == holds_answer


MESSY = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
    format_version: 0.13
    jupytext_version: 1.16.0
kernelspec:
  name: python3
  display_name: Python 3
  language: python
---

# A lab

```{code-cell} ipython3
---
mystnb:
  figure:
    caption: A caption wrapped by hand at a hundred columns, which is wider than the one Jupytext's writer uses.
---
x = 1
```

```{code-cell} ipython3
### BEGIN SOLUTION
answer = 42
### END SOLUTION
```
"""


def test_format_is_idempotent_and_changes_no_cell_source(tmp_path):
    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "jupytext.toml").write_bytes((ROOT / "labs" / "jupytext.toml").read_bytes())
    messy = labs / "lab99.md"
    messy.write_text(MESSY, encoding="utf-8")
    command = [sys.executable, str(ROOT / "tools" / "format_notebooks.py")]

    check = subprocess.run(command + ["--check", str(messy)], capture_output=True, text=True)
    assert check.returncode == 1 and "would reformat" in check.stdout
    assert messy.read_text(encoding="utf-8") == MESSY  # --check writes nothing

    subprocess.run(command + [str(messy)], check=True, capture_output=True)
    once = messy.read_text(encoding="utf-8")
    second = subprocess.run(command + [str(messy)], check=True, capture_output=True, text=True)
    assert messy.read_text(encoding="utf-8") == once and second.stdout == ""
    assert subprocess.run(command + ["--check", str(messy)]).returncode == 0

    before, after = jupytext.reads(MESSY, fmt="md:myst"), jupytext.reads(once, fmt="md:myst")
    assert [c.source for c in before.cells] == [c.source for c in after.cells]
    assert "jupytext_version" not in once and "Python 3 (ipykernel)" in once
    assert after.cells[-1].metadata["jupyter"] == {"source_hidden": True}
    assert format_notebooks.round_trip(messy) == once


def test_format_refuses_what_is_not_a_notebook(tmp_path):
    prose = tmp_path / "notes.md"
    prose.write_text("# Just prose\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "format_notebooks.py"), str(prose)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "paths: expected Jupytext .md notebooks" in result.stderr
    assert "Traceback" not in result.stderr and prose.read_text(encoding="utf-8") == "# Just prose\n"
