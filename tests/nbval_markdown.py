"""Pytest plugin: run every Jupytext MyST notebook (.md) under book/ and labs/ with nbval.

nbval only collects ``.ipynb``. This plugin hands it the text notebooks directly: the
``.md`` is read with jupytext in memory, so no generated ``.ipynb`` is left in the tree
and nothing can go stale. Text notebooks store no outputs, so outputs are not compared
(nbval's lax mode); the chapters check their own numbers with ``assert``. A Markdown file
without a jupytext header is plain prose and is not collected. The kernels listen on Unix
sockets, not TCP ports (tests/kernels.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import jupytext
import nbformat
import pytest
from nbval import kernel as nbval_kernel
from nbval.plugin import IPyNbFile

from tests.kernels import UnixSocketKernelManager

NOTEBOOK_DIRS = ("book", "labs")

# Seconds each code cell took in this run, by notebook path and code-cell index, for the cells
# that passed: tests/test_interrupt.py reads them rather than run each notebook once more to time
# it, and its notebook tests run after the notebooks (see pytest_collection_modifyitems).
CELL_SECONDS: dict[Path, dict[int, float]] = {}
RUN_AFTER_THE_NOTEBOOKS = "tests/test_interrupt.py::test_interrupting_the_slowest_cell"


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

    def setup(self):
        """nbval's kernel start, over Unix sockets (tests/kernels.py says why)."""
        with mock.patch.object(nbval_kernel, "KernelManager", UnixSocketKernelManager):
            super().setup()


def pytest_collect_file(file_path: Path, parent):
    root = Path(parent.config.rootpath)
    try:
        top = file_path.relative_to(root).parts[0]
    except ValueError:
        return None
    if top in NOTEBOOK_DIRS and is_text_notebook(file_path):
        return TextNotebook.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not isinstance(item.parent, TextNotebook):
        return (yield)
    start = time.monotonic()
    result = yield  # (raises when the cell failed: its time is not kept)
    CELL_SECONDS.setdefault(Path(item.path), {})[item.cell_num] = time.monotonic() - start
    return result


def pytest_collection_modifyitems(config, items):
    """The tests that read the notebooks' cell times run after the notebooks."""
    after = [item for item in items if item.nodeid.startswith(RUN_AFTER_THE_NOTEBOOKS)]
    if after:
        items[:] = [item for item in items if item not in after] + after
