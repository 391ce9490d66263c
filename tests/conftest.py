"""Shared fixtures: the repository root, the built static site, small disks and the optimizer's
links."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "book" / "_build" / "html"


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


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` cleanly when no CUDA device is present."""
    import torch

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
