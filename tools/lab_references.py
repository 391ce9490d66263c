"""Give every {ref} to a heading its link text, so JupyterLab shows words, not a warning (``make format``).

jupyterlab-myst (2.7) renders each notebook on its own: a ``{ref}`ch-ladder``` to a heading in
another chapter (or even in the same one) has no target there and shows an orange warning sign
and the bare label. The same reference written with its text, ``{ref}`2. The memory-tier ladder
<ch-ladder>```, shows the text as a link in Lab, and on the site Sphinx prints the same words it
would have taken from the heading. This rewrites each ``{ref}`` without text whose label marks a
heading (``(label)=`` on the line above it) in book/ or labs/, and refreshes the text of one it
wrote before when the heading has changed since; other references are left alone, except that a
reference broken across lines is put back on one (Lab's parser reads a role on one line only).
Idempotent; ``--check`` writes nothing and exits 1 when a file would change.

Not fixable this way, and left as they are: ``{numref}`` to a figure drawn by a code cell (Lab
does not number code-cell outputs) and ``{cite}`` (jupyterlab-myst reads no bibliography; Lab
shows the key with a warning sign, the site the numbered reference).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from format_notebooks import notebooks, write_atomically  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = re.compile(r"^\(([^()\s]+)\)=\n#+ +(.+)$", re.M)
BARE_REF = re.compile(r"\{ref\}`([^`<>]+)`")
# A reference this tool gave its heading's text earlier ("6. CPU Adam: …", "Lab 4: …"): refreshed
# when the heading changes, so no stale title stays behind. Hand-written link texts are left alone.
HEADING_REF = re.compile(r"\{ref\}`((?:\d+\.|Lab \d+:) [^`<>]+) <([^`<>]+)>`")
# A cross-reference role whose text runs over a line end: jupyterlab-myst's role pattern stops at the
# line end, so Lab shows the raw text instead of a link (Sphinx does not mind). Put back on one line.
WRAPPED_ROLE = re.compile(r"\{(ref|numref|doc|eq|term)\}`([^`{}]*\n[^`{}]*)`")


def heading_titles(paths) -> dict[str, str]:
    """label -> heading text, for every ``(label)=`` placed right above a heading."""
    titles = {}
    for path in paths:
        for label, title in TARGET.findall(path.read_text(encoding="utf-8")):
            if not set(title) & set("`<>"):
                titles[label] = title.strip()
    return titles


def with_link_text(text: str, titles: dict[str, str]) -> str:
    text = WRAPPED_ROLE.sub(lambda m: f"{{{m[1]}}}`{' '.join(m[2].split())}`", text)
    text = BARE_REF.sub(lambda m: f"{{ref}}`{titles[m[1]]} <{m[1]}>`" if m[1] in titles else m[0], text)
    return HEADING_REF.sub(lambda m: f"{{ref}}`{titles[m[2]]} <{m[2]}>`" if m[2] in titles else m[0], text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/lab_references.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    prose = [p for d in ("book", "labs") for p in sorted((ROOT / d).glob("*.md"))]
    titles = heading_titles(prose)
    changed = []
    for path in sorted(set(notebooks()) | set(prose)):
        text = path.read_text(encoding="utf-8")
        fixed = with_link_text(text, titles)
        if fixed != text:
            changed.append(path)
            if not args.check:
                write_atomically(path, fixed)
    verb = "would give link text to references in" if args.check else "gave link text to references in"
    for path in changed:
        print(f"{verb} {os.path.relpath(path)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
