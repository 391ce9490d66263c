"""The committed diagrams are what tools/diagrams.py draws, and every chapter figure has alt text."""

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
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    drawn = sorted(tmp_path.glob("*.svg"))
    assert drawn and [p.name for p in drawn] == sorted(p.name for p in FIGURES.glob("*.svg"))
    for fresh in drawn:
        committed = (FIGURES / fresh.name).read_text(encoding="utf-8")
        # Same words in the same places; rendering details may differ between matplotlib versions.
        assert _texts(fresh.read_text(encoding="utf-8")) == _texts(committed), f"re-run tools/diagrams.py: {fresh.name}"


def test_every_diagram_is_used_with_alt_text():
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "book").glob("*.md"))
    for svg in FIGURES.glob("*.svg"):
        block = re.search(r"```\{figure\} figures/" + re.escape(svg.name) + r"\n((?::[a-z]+:.*\n)+)", sources)
        assert block, f"{svg.name} is not used in any chapter"
        assert re.search(r":alt: \S.{40,}", block.group(1)), f"{svg.name} needs alt text that describes it"
