"""`make test` spreads the suite over cores: what shares state stays on one worker
(tests/worker_groups.py)."""

import re
import subprocess
import sys
from collections import defaultdict

from tests.conftest import ROOT
from tests.worker_groups import worker_group


def test_a_notebooks_cells_and_its_interrupt_test_share_a_group():
    cell = "labs/lab01_account_for_every_byte.md::Cell 3"
    interrupted = (
        "tests/test_interrupt.py::test_interrupting_the_slowest_cell_and_running_on_from_it"
        "[labs/lab01_account_for_every_byte.md]"
    )
    assert worker_group(cell) == worker_group(interrupted) != worker_group("book/01.md::Cell 3")


def test_the_site_builds_share_a_group():
    """They execute the same chapters in book/, which write their traces there and read them back;
    the student site's build ran beside the reader's once and read the other's trace."""
    groups = {
        worker_group(nodeid)
        for nodeid in (
            "tests/test_book.py::test_every_notebook_is_rendered_and_in_the_navigation",
            "tests/test_pdf.py::test_the_site_offers_the_pdf",
            "tests/test_site.py::test_every_page_renders_in_chromium",
            "tests/test_site.py::test_student_site_has_no_solutions",
            "tests/test_calculators.py::test_each_calculator_answers_as_the_command_does[x]",
        )
    }
    assert len(groups) == 1


def test_each_module_runs_whole_on_one_worker():
    """The finding: xdist's --dist loadgroup named the groups by rewriting test ids, which pytest 9
    ignores; every module was spread test by test, a notebook's cells over two kernels."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider"]
        + ["tests/test_units.py", "tests/test_cores.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    workers = defaultdict(set)
    for worker, module in re.findall(r"\[(gw\d+)\].*?PASSED (tests/\S+?\.py)::", done.stdout):
        workers[module].add(worker)
    assert set(workers) == {"tests/test_units.py", "tests/test_cores.py"}
    assert all(len(ran_on) == 1 for ran_on in workers.values()), dict(workers)
