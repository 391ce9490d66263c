"""Shared fixtures: the repository root and the built static site."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "book" / "_build" / "html"


@pytest.fixture(scope="session")
def built_site() -> Path:
    """Build the static site as `make book` does (warnings are errors) and return its folder."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "html", "book", str(SITE)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"site build failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
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
