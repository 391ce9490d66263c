"""Write references and citations so that JupyterLab shows words, not warnings (``make format``).

jupyterlab-myst (2.7) renders each notebook on its own, with no bibliography and no knowledge of
the other chapters. A ``{ref}`` to a heading in another chapter showed the bare label with a
warning sign and logged "Cross reference target was not found" in the browser console; a
``{cite}`` showed the BibTeX key with a warning sign. This rewrites both into forms that read in
Lab and still build the same links on the site:

- a ``{ref}`` to a heading in another document (a ``(label)=`` on the line above a heading in
  book/ or labs/) becomes a Markdown link to that document's label,
  ``[2. The memory-tier ladder](02_memory_tier_ladder.md#ch-ladder)``: Lab shows the text and
  opens the chapter when clicked; on the site book/conf.py turns it back into the ``{ref}``
  before MyST reads the page. A ``{ref}`` to a heading of the same document stays a role, which
  Lab resolves within the notebook. A reference without text gets its heading's; a text
  written by hand is kept.
- a ``{cite}`` becomes a link whose text is the author-year citation and whose address names the
  keys, ``[(Ren et al., 2021)](cite:ren2021zerooffload)``. Lab shows the text; on the site
  book/conf.py turns it back into ``{cite:p}`` before MyST reads the page, so sphinxcontrib-bibtex
  renders, numbers and lists the citation as before.

Links and citations this tool wrote before are refreshed when a heading, a path or an entry of
references.bib changes; anything else is left alone. Idempotent; ``--check`` writes nothing and
exits 1 when a file would change.

Not fixable this way: ``{numref}`` to a figure drawn by a code cell, and ``{ref}`` to an
exercise (Lab numbers neither, shows a warning sign and logs one warning in the console): the
chapters say "the figure above", and link an exercise as
``[an exercise](01_memory_wall.md#ex-mw-idle)``, which the site reads as a reference with that
text.
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
BIBLIOGRAPHY = ROOT / "book" / "references.bib"
TARGET = re.compile(r"^\(([^()\s]+)\)=\n#+ +(.+)$", re.M)
BARE_REF = re.compile(r"\{ref\}`([^`<>]+)`")
REF_WITH_TEXT = re.compile(r"\{ref\}`([^`<>]+?)\s+<([^`<>]+)>`")
HEADING_LINK = re.compile(r"\[([^\]`<>]+)\]\(([^()\s#]+\.md)#([^()\s]+)\)")
# The text this tool gives a reference, its heading's ("6. CPU Adam: …", "Lab 4: …"): refreshed
# when the heading changes. A text written by hand is kept as it is.
TOOL_TEXT = re.compile(r"^(?:\d+\.|Lab \d+:) ")
CITE_ROLE = re.compile(r"\{cite(?::p)?\}`([^`]+)`")
CITE_LINK = re.compile(r"\[\(([^\]]*)\)\]\(cite:([^()\s]+)\)")


def heading_targets(paths) -> dict[str, tuple[Path, str]]:
    """label -> (document, heading text), for every ``(label)=`` placed right above a heading."""
    targets = {}
    for path in paths:
        for label, title in TARGET.findall(path.read_text(encoding="utf-8")):
            if not set(title) & set("`<>[]"):
                targets[label] = (path.resolve(), title.strip())
    return targets


def citation_texts(bibliography: Path = BIBLIOGRAPHY) -> dict[str, str]:
    """key -> "Ren et al., 2021": the author-year text sphinxcontrib-bibtex prints for
    ``{cite:p}``."""
    from pybtex.database import parse_file

    texts = {}
    for key, entry in parse_file(str(bibliography)).entries.items():
        people = entry.persons.get("author", [])
        names = [" ".join(person.last_names).replace("{", "").replace("}", "") for person in people]
        names = [re.sub(r"\\['`^\"~]?", "", name) for name in names]  # R{\'e} -> Re
        if len(names) > 2:
            who = f"{names[0]} et al."
        else:
            # (a standard or a manual names its body: PCI-SIG, not its key)
            body = entry.fields.get("organization", "").replace("{", "").replace("}", "")
            who = " and ".join(names) or body or key
        texts[key] = f"{who}, {entry.fields.get('year', 'n.d.')}"
    return texts


def _in_the_book(path: Path) -> Path:
    """Where the site and Lab see a file: book/ is the root, labs/ is book/labs (a link)."""
    relative = path.resolve().relative_to(ROOT)
    return relative.relative_to("book") if relative.parts[0] == "book" else relative


def _link_path(source: Path, target: Path) -> str:
    """The relative link from ``source`` to ``target`` as the site and Lab resolve it."""
    return Path(os.path.relpath(_in_the_book(target), _in_the_book(source).parent)).as_posix()


def rewritten(path: Path, text: str, targets: dict, citations: dict) -> str:
    """``text`` of ``path`` with its references and citations in the forms Lab reads."""
    here = path.resolve()

    def reference(label: str, original: str, text: str | None = None) -> str:
        if label not in targets:
            return original
        document, title = targets[label]
        shown = title if text is None or TOOL_TEXT.match(text) else text
        shown = " ".join(shown.split())  # Lab's parser reads a role on one line only
        if document == here:
            return f"{{ref}}`{shown} <{label}>`"
        return f"[{shown}]({_link_path(path, document)}#{label})"

    def citation(keys: str, original: str) -> str:
        split = [k.strip() for k in keys.split(",")]
        if not all(k in citations for k in split):
            return original
        return f"[({'; '.join(citations[k] for k in split)})](cite:{','.join(split)})"

    text = BARE_REF.sub(lambda m: reference(m[1], m[0]), text)
    text = REF_WITH_TEXT.sub(lambda m: reference(m[2], m[0], m[1]), text)
    text = HEADING_LINK.sub(lambda m: reference(m[3], m[0], m[1]), text)
    text = CITE_ROLE.sub(lambda m: citation(m[1], m[0]), text)
    return CITE_LINK.sub(lambda m: citation(m[2], m[0]), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/lab_references.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file would change"
    )
    args = parser.parse_args(argv)
    prose = [p for d in ("book", "labs") for p in sorted((ROOT / d).glob("*.md"))]
    targets, citations = heading_targets(prose), citation_texts()
    changed = []
    for path in sorted(set(notebooks()) | set(prose)):
        text = path.read_text(encoding="utf-8")
        fixed = rewritten(path, text, targets, citations)
        if fixed != text:
            changed.append(path)
            if not args.check:
                write_atomically(path, fixed)
    verb = "would rewrite references in" if args.check else "rewrote references in"
    for path in changed:
        print(f"{verb} {os.path.relpath(path)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
