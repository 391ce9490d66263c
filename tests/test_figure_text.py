"""Diagrams stay readable at the site's column width: no text under 11 CSS px.

The book's pages show a figure at most as wide as the text column, 672 CSS px on a desktop
browser (sphinx-book-theme, measured in Chromium at a 1280 px window), and at its natural size
(1 pt = 4/3 px) when that is narrower. The text of an SVG drawn by tools/diagrams.py is in the
SVG's own units (points), so its size on the page is its font size times the scale. Captions
belong in the chapter, not in the image.
"""

import re

import pytest

from tests.conftest import ROOT

FIGURES = ROOT / "book" / "figures"
COLUMN_PX = 672  # the text column of a chapter page at a 1280 px window
SMALLEST_PX = 11  # the smallest text a reader should have to read
CHECKED = ["nvme_path.svg", "two_slot_commit.svg"]  # diagrams drawn to this rule


def rendered_sizes(svg: str) -> list[float]:
    """Font sizes of every text element, in CSS px as the page shows the figure."""
    width = float(re.search(r'viewBox="0 0 ([\d.]+) [\d.]+"', svg).group(1))
    scale = min(4 / 3, COLUMN_PX / width)
    return [float(size) * scale for size in re.findall(r"<text[^>]*font-size: ([\d.]+)px", svg)]


@pytest.mark.parametrize("name", CHECKED)
def test_text_is_readable_at_column_width(name):
    sizes = rendered_sizes((FIGURES / name).read_text(encoding="utf-8"))
    assert sizes, f"{name} has no text elements (drawn without svg.fonttype 'none'?)"
    assert min(sizes) >= SMALLEST_PX, f"{name}: text of {min(sizes):.1f} px at column width"


def test_the_rule_catches_small_text():
    tiny = '<svg viewBox="0 0 1000 100"><text style="font-size: 8px">a</text></svg>'
    assert rendered_sizes(tiny) == [pytest.approx(8 * 0.672)]
