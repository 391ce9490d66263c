"""Pytest plugin: what runs together when pytest-xdist spreads the suite over cores (`make test`,
`make test-fast`). Each group goes whole to one worker, in collection order: a notebook's cells
share a kernel and its interrupt test reads their times (tests/nbval_markdown.py); a module's
tests share its fixtures, made once; the modules that build the reader's site from book/ share
that build and its execution cache. The student site has a cache of its own and runs beside them.

(xdist's own ``--dist loadgroup`` marks a group by rewriting each test's id, which pytest 9 no
longer reads; this scheduler groups by the id instead.)
"""

from __future__ import annotations

from tests.nbval_markdown import RUN_AFTER_THE_NOTEBOOKS as INTERRUPT_TEST

READER_SITE_MODULES = {"test_book.py", "test_calculators.py", "test_pdf.py", "test_site.py"}
STUDENT_SITE_TEST = "tests/test_site.py::test_student_site_has_no_solutions"


def worker_group(nodeid: str) -> str:
    """The group of the test with this id: a notebook's path, a module's path, or a site's name."""
    if nodeid.startswith(STUDENT_SITE_TEST):
        return "student site"
    if nodeid.startswith(INTERRUPT_TEST):  # (its id is the notebook's path)
        return nodeid[nodeid.index("[") + 1 : -1]
    path = nodeid.split("::")[0]
    if path.rpartition("/")[2] in READER_SITE_MODULES:
        return "reader's site"
    return path


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedStateScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return SharedStateScheduling(config, log)
