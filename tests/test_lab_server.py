"""JupyterLab, started as `make lab` starts it, serves chapter 1 as a notebook and opens .md as notebooks."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT

TOKEN = "offloadlab-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server():
    port = free_port()
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--IdentityProvider.token={TOKEN}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                get(base, "/api/status")
                break
            except OSError:
                if process.poll() is not None:
                    pytest.fail(f"JupyterLab exited: {process.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer within 60 s")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def get(base: str, path: str) -> dict:
    request = urllib.request.Request(base + path, headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def test_chapter_one_opens_as_a_notebook(lab_server):
    model = get(lab_server, "/api/contents/book/01_memory_wall.md?type=notebook&content=1")
    assert model["type"] == "notebook"
    cells = model["content"]["cells"]
    assert any(c["cell_type"] == "code" and "state_bytes(10e9" in c["source"] for c in cells)


def test_markdown_files_default_to_the_notebook_viewer(lab_server):
    settings = get(lab_server, "/lab/api/settings/@jupyterlab/docmanager-extension:plugin")
    viewers = settings["schema"]["properties"]["defaultViewers"]["default"]
    assert viewers.get("markdown") == "Jupytext Notebook"
