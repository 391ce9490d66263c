"""Shared fixtures: the repository root, the built static site, small disks and the optimizer's
links."""

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "book" / "_build" / "html"


def offloadlab(*args, cwd=None) -> subprocess.CompletedProcess:
    """The ``offloadlab`` command run in this process (a fresh Python costs a second or more each
    time): its exit status and what it printed, as ``subprocess.run`` reports them."""
    from offloadlab.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.chdir(cwd or Path.cwd()),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            status = main([str(arg) for arg in args])
        except SystemExit as exit:  # --help and argparse's own exits
            status = exit.code
    return subprocess.CompletedProcess(args, status, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="session")
def built_site() -> Path:
    """Build the static site as `make book` does (warnings are errors) and return its folder."""
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "html",
        "book",
        str(SITE),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, (
        f"site build failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return SITE


# Whole modules left out of `make test-fast` (marked ``slow``), and why; single tests elsewhere
# carry @pytest.mark.slow themselves. The notebooks (book/, labs/) are not in the fast tier either.
SLOW_MODULES = {
    "test_book.py": "builds the site",
    "test_calculators.py": "builds the site, runs Pyodide in a browser",
    "test_course_page.py": "builds the site",
    "test_cpu_adam_qemu.py": "builds the kernel for other CPUs and runs it under qemu",
    "test_figure_text.py": "builds the site",
    "test_hub.py": "starts a JupyterHub",
    "test_interrupt.py": "runs every notebook again, interrupted",
    "test_lab_checks.py": "runs every lab",
    "test_lab_server.py": "starts JupyterLab and a browser",
    "test_nbgrader.py": "runs nbgrader's release and autograding",
    "test_notebook_plugin.py": "runs notebooks through nbval",
    "test_pdf.py": "builds the site and prints the PDF",
    "test_reading_the_package.py": "builds the site",
    "test_round_trip.py": "formats and reads back every notebook",
    "test_site.py": "builds the site, reads it in a browser",
    "test_student.py": "releases every lab to students and runs their notebooks",
    "test_wheel.py": "builds and installs the package",
}


def pytest_collection_modifyitems(config, items):
    """Mark the slow modules' tests ``slow``; skip tests marked ``gpu`` cleanly when no CUDA device
    is present."""
    import torch

    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_disk(tmp_path):
    """A factory for small file systems: ``small_disk("2m")`` mounts a tmpfs of that size
    (``read_only=True`` for a read-only one) and returns its folder; unmounted afterwards.

    Filling a disk or refusing writes for real needs a file system of our own; mounting one needs
    root (or CAP_SYS_ADMIN), which CI has. Elsewhere the test is skipped, saying why.
    """
    mounted = []

    def mount(size: str, read_only: bool = False) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        if shutil.which("mount") is None:
            pytest.skip("cannot mount a small tmpfs here: no mount command")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(
                "cannot mount a small tmpfs here (needs root): "
                f"{result.stderr.strip() or result.returncode}"
            )
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture(params=["emulated", "CUDA order checker"])
def link(request):
    """The optimizer's tests (test_offload*.py) run on the emulated link, and on the same under
    CUDA's ordering rules with training on a stream of its own (tests/cuda_semantics.py): any
    violation fails the test when it ends. (A module with a ``link`` fixture of its own uses
    that.)"""
    from offloadlab.link import EmulatedLink
    from tests.cuda_semantics import CudaOrderLink

    if request.param == "emulated":
        with EmulatedLink(bandwidth="8 GB/s", latency=0) as emulated:
            yield emulated
        return
    with (
        CudaOrderLink(bandwidth="8 GB/s", latency=0) as checker,
        checker.compute_stream("training"),
    ):
        yield checker
        checker.check()
