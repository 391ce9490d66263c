"""The static site builds offline, executes every notebook, and lists chapters and labs."""

import re

from tests.nbval_markdown import is_text_notebook
from tests.conftest import ROOT


def notebooks():
    return sorted(
        p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
    )


def test_every_notebook_is_rendered_and_in_the_navigation(built_site):
    index = (built_site / "index.html").read_text(encoding="utf-8")
    for path in notebooks():
        relative = path.relative_to(ROOT).with_suffix(".html")
        page = built_site / (
            relative.relative_to("book") if relative.parts[0] == "book" else relative
        )
        assert page.exists(), f"{path.name} was not rendered"
        assert f'href="{page.relative_to(built_site).as_posix()}"' in index, (
            f"{path.name} missing from navigation"
        )


def test_chapter_one_shows_executed_outputs_and_numbered_figure(built_site):
    html = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert "160 GB" in html  # printed by an executed cell, not written in the prose
    assert re.search(r"Fig\. 1", html)
    assert "cell_output" in html
    assert 'class="admonition solution dropdown' in html or "solution dropdown" in html


def test_the_readers_site_holds_the_solutions_folded(built_site):
    """The same solution that the student site leaves out (test_site.py), in a dropdown."""
    html = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert "which fits only the 141 GB card" in html and "dropdown" in html


def test_no_source_holds_a_control_character():
    """A "\\text" written through a Python string became a tab and "ext" in chapter 3's math:
    no chapter, lab or page holds a control character but the line end."""
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "book").glob("*.md")) + sorted((ROOT / "labs").glob("*.md"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"[\x00-\x08\x0b-\x1f\x7f]|\t", line)
    ]
    assert not found, found
