"""Pytest plugin: run every Jupytext MyST notebook (.md) under book/ and labs/ with nbval.

nbval only collects ``.ipynb``. This plugin hands it the text notebooks directly: the
``.md`` is read with jupytext in memory, so no generated ``.ipynb`` is left in the tree
and nothing can go stale. Text notebooks store no outputs, so outputs are not compared
(nbval's lax mode); the chapters check their own numbers with ``assert``. A Markdown file
without a jupytext header is plain prose and is not collected.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import jupytext
import nbformat
from nbval.plugin import IPyNbFile

NOTEBOOK_DIRS = ("book", "labs")


def is_text_notebook(path: Path) -> bool:
    """True for a .md whose front matter carries a jupytext header."""
    if path.suffix != ".md":
        return False
    with path.open(encoding="utf-8") as f:
        head = f.read(2000)
    return head.startswith("---") and "jupytext:" in head.split("\n---", 1)[0]


def _read_text_notebook(path, as_version=4, **_kwargs):
    return jupytext.read(path, as_version=as_version)


class TextNotebook(IPyNbFile):
    """nbval's notebook collector, reading a jupytext text notebook, outputs not compared."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compare_outputs = False

    def collect(self):
        with mock.patch.object(nbformat, "read", _read_text_notebook):
            return list(super().collect())


def pytest_collect_file(file_path: Path, parent):
    root = Path(parent.config.rootpath)
    try:
        top = file_path.relative_to(root).parts[0]
    except ValueError:
        return None
    if top in NOTEBOOK_DIRS and is_text_notebook(file_path):
        return TextNotebook.from_parent(parent, path=file_path)
    return None
