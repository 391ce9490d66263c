"""Every chapter and lab is exactly what Jupytext writes for it, so saving in JupyterLab changes
nothing.

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
    expected = sorted(
        p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
    )
    assert NOTEBOOKS == expected and len(NOTEBOOKS) >= 14


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_jupytext_writes_back_the_same_bytes(path):
    text = path.read_text(encoding="utf-8")
    assert format_notebooks.round_trip(path) == text, (
        f"{path.name} changes when saved: run `make format`"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_sources_are_formatted(path):
    assert format_notebooks.formatted(path) == path.read_text(encoding="utf-8"), "run `make format`"


def test_references_to_headings_carry_their_text():
    """So that JupyterLab, which resolves none across notebooks, shows words
    (tools/lab_references.py)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "lab_references.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr + "run `make format`"


def test_a_reference_keeps_up_with_its_heading():
    sys.path.insert(0, str(ROOT / "tools"))
    from lab_references import rewritten

    chapter, lab = (
        ROOT / "book" / "06_cpu_adam.md",
        ROOT / "labs" / "lab04_offload_the_optimizer.md",
    )
    targets = {"ch-cpu-adam": (chapter, "6. CPU Adam: the update that belongs on the CPU")}
    title = targets["ch-cpu-adam"][1]
    stale = "see {ref}`6. CPU Adam: an older title <ch-cpu-adam>` and {ref}`ch-cpu-adam`"
    # From another document: a Markdown link to the label, which Lab opens and myst-parser resolves.
    assert rewritten(lab, stale, targets, {}) == (
        f"see [{title}](../06_cpu_adam.md#ch-cpu-adam) and [{title}](../06_cpu_adam.md#ch-cpu-adam)"
    )
    moved = "see [6. CPU Adam: an older title](06_cpu_adam.md#ch-cpu-adam)"
    assert rewritten(lab, moved, targets, {}) == f"see [{title}](../06_cpu_adam.md#ch-cpu-adam)"
    # Within the same document: the role, with the heading's text.
    assert (
        rewritten(chapter, stale, targets, {})
        == f"see {{ref}}`{title} <ch-cpu-adam>` and {{ref}}`{title} <ch-cpu-adam>`"
    )
    mine = "the {ref}`optimizer chapter <ch-cpu-adam>`"  # a text written by hand is kept
    assert (
        rewritten(lab, mine, targets, {})
        == "the [optimizer chapter](../06_cpu_adam.md#ch-cpu-adam)"
    )
    assert rewritten(chapter, mine, targets, {}) == mine
    # A role broken across lines is no role to jupyterlab-myst (its pattern stops at a line end):
    # Lab shows the raw text. It is put back on one line, hand-written text included.
    wrapped = (
        "see {ref}`the optimizer\nchapter <ch-cpu-adam>` and {ref}`6. CPU Adam: the "
        "update\n<ch-cpu-adam>`"
    )
    assert rewritten(chapter, wrapped, targets, {}) == (
        f"see {{ref}}`the optimizer chapter <ch-cpu-adam>` and {{ref}}`{title} <ch-cpu-adam>`"
    )


def test_citations_read_as_author_and_year():
    sys.path.insert(0, str(ROOT / "tools"))
    from lab_references import citation_texts, rewritten

    texts = citation_texts()
    assert (
        texts["ren2021zerooffload"] == "Ren et al., 2021"
        and texts["kingma2015adam"] == "Kingma and Ba, 2015"
    )
    assert texts["nvidia_h100"] == "NVIDIA Corporation, 2023"
    chapter = ROOT / "book" / "01_memory_wall.md"
    source = "as {cite}`kingma2015adam,loshchilov2019adamw` and {cite}`nokey2020`"
    assert rewritten(chapter, source, {}, texts) == (
        "as [(Kingma and Ba, 2015; Loshchilov and Hutter, 2019)]"
        "(cite:kingma2015adam,loshchilov2019adamw) and {cite}`nokey2020`"
    )
    stale = "[(Kingma, 2014)](cite:kingma2015adam)"  # the entry changed since: the text follows it
    assert rewritten(chapter, stale, {}, texts) == "[(Kingma and Ba, 2015)](cite:kingma2015adam)"


def test_the_site_reads_citation_and_reference_links_as_roles():
    """book/conf.py gives sphinxcontrib-bibtex and Sphinx their roles back before MyST reads the
    page."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("book_conf", ROOT / "book" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    source = [
        "see [(Kingma and Ba, 2015; Loshchilov and Hutter, "
        "2019)](cite:kingma2015adam,loshchilov2019adamw) and [6. CPU Adam: the update that belongs "
        "on the CPU](../06_cpu_adam.md#ch-cpu-adam), not [a file](../README.md)."
    ]
    conf.lab_links_to_roles(None, "labs/lab04_offload_the_optimizer", source)
    assert source == [
        "see {cite:p}`kingma2015adam,loshchilov2019adamw` "
        "and {ref}`6. CPU Adam: the update that belongs on the CPU <ch-cpu-adam>`, not [a "
        "file](../README.md)."
    ]


def test_one_jupytext_configuration_for_book_and_labs():
    book, labs = (ROOT / d / "jupytext.toml" for d in ("book", "labs"))
    assert book.read_bytes() == labs.read_bytes()
    assert "jupytext_version" not in next(iter(NOTEBOOKS)).read_text(encoding="utf-8")


def test_lab_solutions_and_checks_start_hidden_and_everything_else_visible():
    """Lab folds every cell of checks (tag remove-cell, which the site leaves out) and a lab's
    worked answers; in a lab, everything else shows."""
    for path in NOTEBOOKS:
        notebook = jupytext.read(path)
        for cell in notebook.cells:
            hidden = cell.metadata.get("jupyter", {}).get("source_hidden", False)
            tags = cell.metadata.get("tags", [])
            holds_answer = (
                path.parent.name == "labs"
                and cell.cell_type == "code"
                and "### BEGIN SOLUTION" in cell.source
            )
            checks = cell.cell_type == "code" and "remove-cell" in tags
            # A graded check may fold too (issue 28), with hide-input: its ✓ line shows under it.
            graded = (
                path.parent.name == "labs"
                and cell.cell_type == "code"
                and "points" in cell.metadata
            )
            folded_check = graded and hidden
            if path.parent.name == "labs":
                assert hidden == (holds_answer or checks or folded_check), (
                    f"{path.name}: {cell.source[:60]!r}"
                )
            else:  # a chapter may fold other cells too
                assert hidden or not checks, f"{path.name}: {cell.source[:60]!r}"
            assert ("hide-input" in tags) == (holds_answer or folded_check), (
                f"{path.name}: {cell.source[:60]!r}"
            )


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
    caption: A caption wrapped by hand at 95 columns, wider than the one Jupytext's writer uses.
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
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "format_notebooks.py"), str(prose)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "paths: expected Jupytext .md notebooks" in result.stderr
    assert (
        "Traceback" not in result.stderr and prose.read_text(encoding="utf-8") == "# Just prose\n"
    )
