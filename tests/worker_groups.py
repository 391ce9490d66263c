"""Pytest plugin: what runs together when pytest-xdist spreads the suite over cores (`make test`,
`make test-fast`). Each group goes whole to one worker, in collection order: a notebook's cells
share a kernel and its interrupt test reads their times (tests/nbval_markdown.py); a module's
tests share its fixtures, made once; the modules that build the reader's site from book/ share
that build and its execution cache, and the student site's build runs after it (the chapters
write their traces beside themselves and read them back: two builds at once trade files).
The longest groups go first, and each worker's processes share the cores with the others rather
than each using all of them.

(xdist's own ``--dist loadgroup`` marks a group by rewriting each test's id, which pytest 9 no
longer reads; this scheduler groups by the id instead.)
"""

from __future__ import annotations

import os

import pytest

from tests.nbval_markdown import RUN_AFTER_THE_NOTEBOOKS as INTERRUPT_TEST

SITE_MODULES = {"test_book.py", "test_calculators.py", "test_pdf.py", "test_site.py"}


def worker_group(nodeid: str) -> str:
    """The group of the test with this id: a notebook's path, a module's path, or the sites'."""
    if nodeid.startswith(INTERRUPT_TEST):  # (its id is the notebook's path)
        return nodeid[nodeid.index("[") + 1 : -1]
    path = nodeid.split("::")[0]
    if path.rpartition("/")[2] in SITE_MODULES:
        return "the sites"
    return path


# The groups that take longest (make test --durations, on 2 cores), handed out first so that no
# worker is left alone with one at the end while the others idle.
LONGEST_FIRST = (
    "the sites",
    "tests/test_gpucheck.py",
    "tests/test_hub.py",
    "tests/test_nbgrader.py",
    "tests/test_lab_checks.py",
)
# A site build executes every notebook: on a busy machine it outlasts pytest's usual limit.
SITE_BUILD_TIMEOUT = 2700  # seconds


@pytest.hookimpl(trylast=True)  # (after tests/nbval_markdown.py's order within a notebook)
def pytest_collection_modifyitems(config, items):
    """The longest groups first (the scheduler hands groups out in this order); the site builds'
    own time limit."""
    rank = {group: index for index, group in enumerate(LONGEST_FIRST)}
    group = {item.nodeid: worker_group(item.nodeid) for item in items}
    items.sort(key=lambda item: rank.get(group[item.nodeid], len(rank)))
    for item in items:
        if group[item.nodeid] == "the sites":
            item.add_marker(pytest.mark.timeout(SITE_BUILD_TIMEOUT))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedStateScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # (xdist's order, most tests first, would undo ours)
    return SharedStateScheduling(config, log)


def pytest_configure(config):
    """On a worker, torch (here and in every kernel, build and command the tests start) uses this
    worker's share of the cores (OMP_NUM_THREADS, unless set): two workers each using both cores
    of a 2-core machine ran two labs in 57 s where one thread each took 27 s."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    from offloadlab.cores import usable_cores

    threads = max(1, usable_cores() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
