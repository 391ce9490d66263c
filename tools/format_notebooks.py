"""Rewrite every chapter and lab to the text Jupytext itself writes for it (``make format``).

JupyterLab saves a Jupytext notebook by writing it out again. A source that is not already
what the writer produces (a caption wrapped by hand, a missing header field) changes on the
first save, and a reader's next ``git pull`` conflicts. This command makes each notebook under
book/ and labs/ a fixed point of Jupytext's reader and writer, with the settings of the
``jupytext.toml`` beside it, which JupyterLab uses too. It also settles the two things Lab would
otherwise rewrite or show:

- the kernelspec is the one ipykernel installs (``python3``, "Python 3 (ipykernel)"), which Lab
  writes into every notebook it runs;
- in the labs, a code cell holding a worked answer (between ``### BEGIN SOLUTION`` and
  ``### END SOLUTION``) starts with its source hidden in Lab (``jupyter.source_hidden``) and
  folded on the site (the ``hide-input`` tag), so a reader sees it only on asking;
- in chapters and labs, a code cell tagged ``remove-cell`` (a cell of checks: the site leaves it
  out, nbval still runs it) starts with its source hidden in Lab too, folded under a neutral
  label (etc/jupyterlab-custom/custom.css) rather than its first line.

It changes format and metadata only, never a cell's source, and running it twice changes
nothing the second time. ``--check`` writes nothing and exits 1 when a file would change.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import jupytext
from jupytext.config import load_jupytext_config

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIRS = ("book", "labs")
FORMAT = "md:myst"
SOLUTION_MARKER = "### BEGIN SOLUTION"
HIDE_ON_SITE = "hide-input"
LEFT_OFF_SITE = "remove-cell"


def is_text_notebook(path: Path) -> bool:
    """True for a .md whose front matter carries a jupytext header (the others are prose pages)."""
    if path.suffix != ".md":
        return False
    head = path.read_text(encoding="utf-8")[:2000]
    return head.startswith("---") and "jupytext:" in head.split("\n---", 1)[0]


def notebooks(root: Path = ROOT) -> list[Path]:
    """Every Jupytext notebook in book/ and labs/ (book/labs is a link to labs/, listed once)."""
    return sorted(
        p for folder in NOTEBOOK_DIRS for p in (root / folder).glob("*.md") if is_text_notebook(p)
    )


def lab_kernelspec() -> dict:
    """The kernelspec JupyterLab writes for ipykernel's default Python kernel, keys in Lab's
    order."""
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    spec = get_kernel_dict()
    return {"name": KERNEL_NAME, "display_name": spec["display_name"], "language": spec["language"]}


def hide_solutions(notebook) -> None:
    """Fold every code cell that holds a worked answer: hidden source in Lab, hide-input on the
    site."""
    for cell in notebook.cells:
        if cell.cell_type != "code" or SOLUTION_MARKER not in cell.source:
            continue
        cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
        tags = cell.metadata.setdefault("tags", [])
        if HIDE_ON_SITE not in tags:
            tags.append(HIDE_ON_SITE)


def hide_checks(notebook) -> None:
    """Fold every code cell the site leaves out (tag remove-cell) in Lab as well."""
    for cell in notebook.cells:
        if cell.cell_type == "code" and LEFT_OFF_SITE in cell.metadata.get("tags", []):
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True


def formatted(path: Path) -> str:
    """The text Jupytext writes for the notebook at ``path`` once its metadata is settled."""
    notebook = jupytext.reads(path.read_text(encoding="utf-8"), fmt=FORMAT)
    notebook.metadata["kernelspec"] = lab_kernelspec()
    if path.parent.name == "labs":
        hide_solutions(notebook)
    hide_checks(notebook)
    return jupytext.writes(notebook, fmt=FORMAT, config=load_jupytext_config(str(path.parent)))


def round_trip(path: Path) -> str:
    """The text JupyterLab would save for ``path``: read it and write it back, nothing else."""
    text = path.read_text(encoding="utf-8")
    config = load_jupytext_config(str(path.parent))
    return jupytext.writes(jupytext.reads(text, fmt=FORMAT), fmt=FORMAT, config=config)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step, so an interrupted run never leaves half a
    file."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(temporary, path.stat().st_mode & 0o777)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/format_notebooks.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a notebook would change"
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, help="notebooks to format (default: all in book/ and labs/)"
    )
    args = parser.parse_args(argv)
    paths = args.paths or notebooks()
    for path in paths:
        if not path.is_file() or not is_text_notebook(path):
            parser.error(f"paths: expected Jupytext .md notebooks; got {str(path)!r}")
    changed = []
    for path in paths:
        text = formatted(path)
        if text != path.read_text(encoding="utf-8"):
            changed.append(path)
            if not args.check:
                write_atomically(path, text)
    verb = "would reformat" if args.check else "reformatted"
    for path in changed:
        print(f"{verb} {os.path.relpath(path)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
