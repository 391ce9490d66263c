"""The committed diagrams are what tools/diagrams.py draws, and every chapter figure has alt
text."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "tools" / "diagrams.py"
FIGURES = ROOT / "book" / "figures"


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def test_committed_diagrams_are_the_scripts_output(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    drawn = sorted(tmp_path.glob("*.svg"))
    assert drawn and [p.name for p in drawn] == sorted(p.name for p in FIGURES.glob("*.svg"))
    for fresh in drawn:
        committed = (FIGURES / fresh.name).read_text(encoding="utf-8")
        # Same words in the same places; rendering details may differ between matplotlib versions.
        assert _texts(fresh.read_text(encoding="utf-8")) == _texts(committed), (
            f"re-run tools/diagrams.py: {fresh.name}"
        )


def test_every_diagram_is_used_with_alt_text():
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "book").glob("*.md"))
    for svg in FIGURES.glob("*.svg"):
        block = re.search(
            r"```\{figure\} figures/" + re.escape(svg.name) + r"\n((?::[a-z]+:.*\n)+)", sources
        )
        assert block, f"{svg.name} is not used in any chapter"
        assert re.search(r":alt: \S.{40,}", block.group(1)), (
            f"{svg.name} needs alt text that describes it"
        )


def _font_sizes_pt(svg: str) -> list[float]:
    """The size of every text in a diagram, in points (matplotlib writes SVG user units in
    points)."""
    return [float(size) for size in re.findall(r"font-size: ?([\d.]+)px", svg)]


def test_diagrams_are_readable_on_a_phone():
    """Each diagram's smallest text, in the 342 px column of a 390 px screen, is at least 9 CSS px;
    at its own size (a laptop) at least 11 px. The diagrams had 6–8 px labels on a laptop."""
    for svg_path in sorted(FIGURES.glob("*.svg")):
        svg = svg_path.read_text(encoding="utf-8")
        width_pt = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', svg).group(1))
        smallest = min(_font_sizes_pt(svg))
        natural_px = width_pt * 96 / 72
        on_a_phone = smallest * 96 / 72 * min(1.0, 342 / natural_px)
        assert on_a_phone >= 9 and smallest * 96 / 72 >= 11, (svg_path.name, smallest, width_pt)


def test_captions_are_not_inside_the_diagrams():
    """The caption is the chapter's figure text; a diagram carries labels, not sentences."""
    for svg_path in sorted(FIGURES.glob("*.svg")):
        for text in _texts(svg_path.read_text(encoding="utf-8")):
            assert len(text.split()) <= 8, (svg_path.name, text)
