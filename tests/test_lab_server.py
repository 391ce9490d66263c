"""JupyterLab as `make lab` starts it: lands on chapter 1, shows the reader's material, and
saving changes nothing."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.nbval_markdown import is_text_notebook
from tests.test_site import BROWSER_ARGS, CHROMIUM, SCREENSHOTS

TOKEN = "offloadlab-test"
SERVER_CONFIG = ROOT / "etc" / "jupyter_server_config.json"
NOTEBOOKS = sorted(
    p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """A running JupyterLab: its base URL, the lines it has logged so far, and where it keeps
    checkpoints."""

    def __init__(self, base: str, log: list[str], checkpoints: Path):
        self.base, self.log, self.checkpoints = base, log, checkpoints

    def request(self, path: str, body: dict | None = None, method: str = "GET") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab started with the Makefile's configuration and the settings `make env` installs."""
    settings, workspaces = (
        tmp_path_factory.mktemp("lab-settings"),
        tmp_path_factory.mktemp("lab-workspaces"),
    )
    # a save makes one; none may land in the checkout
    checkpoints = tmp_path_factory.mktemp("lab-checkpoints")
    shutil.copy(ROOT / "etc" / "jupyterlab-overrides.json", settings / "overrides.json")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--config={SERVER_CONFIG}",
        f"--IdentityProvider.token={TOKEN}",
        "--ServerApp.open_browser=False",
        f"--LabApp.app_settings_dir={settings}",
        f"--LabApp.workspaces_dir={workspaces}",
        f"--FileCheckpoints.checkpoint_dir={checkpoints}",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(process.stderr), daemon=True)
    reader.start()
    server = LabServer(f"http://127.0.0.1:{port}", log, checkpoints)
    try:
        for _ in range(240):
            try:
                server.request("/api/status")
                break
            except OSError:
                if process.poll() is not None:
                    reader.join(5)
                    pytest.fail("JupyterLab exited:\n" + "".join(log)[-2000:])
                time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer within 120 s")
        yield server
    finally:
        # JupyterLab's shutdown took over 30 s with three busy processes beside the suite: what
        # is tested here is served, not stopped, so a server slow to stop is stopped by force
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def lab_path(path) -> str:
    """The path JupyterLab, rooted at book/, gives a chapter or lab (labs through the book/labs
    link)."""
    relative = path.relative_to(ROOT)
    return (
        relative.relative_to("book").as_posix()
        if relative.parts[0] == "book"
        else relative.as_posix()
    )


def test_the_printed_url_opens_chapter_one(lab_server):
    urls = [line for line in lab_server.log if "http://127.0.0.1" in line]
    assert urls and "/lab/tree/01_memory_wall.md?token=" in urls[0], lab_server.log[-5:]
    model = lab_server.request("/api/contents/01_memory_wall.md?type=notebook&content=1")
    assert model["type"] == "notebook"
    assert any(
        c["cell_type"] == "code" and "state_bytes(10e9" in c["source"]
        for c in model["content"]["cells"]
    )


def test_the_file_browser_shows_the_readers_material_only(lab_server):
    names = {item["name"] for item in lab_server.request("/api/contents/")["content"]}
    assert {"01_memory_wall.md", "09_wrong_tool.md", "labs", "glossary.md"} <= names
    kit = {"conf.py", "_static", "_build", "_templates", "figures", "references.bib"}
    assert not names & (kit | {"jupytext.toml"}), names
    labs = {item["name"] for item in lab_server.request("/api/contents/labs")["content"]}
    assert "lab01_account_for_every_byte.md" in labs and "jupytext.toml" not in labs


def test_markdown_opens_as_a_notebook_and_no_news(lab_server):
    viewers = lab_server.request("/lab/api/settings/@jupyterlab/docmanager-extension:plugin")
    assert (
        viewers["schema"]["properties"]["defaultViewers"]["default"].get("markdown")
        == "Jupytext Notebook"
    )
    news = lab_server.request("/lab/api/settings/@jupyterlab/apputils-extension:notification")[
        "schema"
    ]["properties"]
    assert news["fetchNews"]["default"] == "false" and news["checkForUpdates"]["default"] is False


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saving_through_the_contents_api_changes_no_byte(lab_server, path):
    """What the Lab frontend saves: the notebook it was given, with the running kernel's metadata
    added."""
    original = path.read_bytes()
    spec = lab_server.request("/api/kernelspecs")["kernelspecs"]["python3"]["spec"]
    model = lab_server.request(f"/api/contents/{lab_path(path)}?type=notebook&content=1")
    notebook = model["content"]
    notebook["metadata"]["kernelspec"] = {
        "name": "python3",
        "display_name": spec["display_name"],
        "language": spec["language"],
    }
    notebook["metadata"]["language_info"] = {
        "name": "python",
        "version": sys.version.split()[0],
        "mimetype": "text/x-python",
        "file_extension": ".py",
        "pygments_lexer": "ipython3",
        "codemirror_mode": {"name": "ipython", "version": 3},
        "nbconvert_exporter": "python",
    }
    try:
        lab_server.request(
            f"/api/contents/{lab_path(path)}",
            {"type": "notebook", "format": "json", "content": notebook},
            "PUT",
        )
        assert path.read_bytes() == original, (
            f"saving {path.name} in Lab rewrites it: run `make format`"
        )
    finally:
        if path.read_bytes() != original:
            path.write_bytes(original)


@pytest.fixture(scope="module")
def lab_page(lab_server):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        yield page
        browser.close()


def checkpoint_files() -> dict:
    """JupyterLab's checkpoint copies in the checkout, with their modification times."""
    return {
        p: p.stat().st_mtime_ns
        for d in ("book", "labs")
        for p in (ROOT / d).glob(".ipynb_checkpoints/*")
    }


def scroll_to(locator, attempts: int = 10) -> None:
    """Scroll ``locator`` into view. Lab draws a notebook's cells lazily and may draw a Markdown
    cell again while it settles (its kernel starting), detaching the element found a moment before:
    find it again, and scroll at once rather than wait for it to hold still (Playwright's own
    scroll waits for a stable element, which a cell drawn again and again never is on a busy
    machine)."""
    from playwright.sync_api import Error

    for attempt in range(attempts):
        try:
            locator.evaluate("e => e.scrollIntoView({block: 'center'})", timeout=30_000)
            locator.wait_for(state="visible", timeout=10_000)
            return
        except Error:  # (playwright's TimeoutError is one)
            if attempt == attempts - 1:
                raise
            locator.page.wait_for_timeout(250)


def open_in_lab(page, base: str, path: str) -> None:
    """Open ``path`` in Lab as a reader does, alone (a reset workspace), and wait until its
    kernel is idle."""
    page.goto(
        f"{base}/lab/tree/{path}?reset&token={TOKEN}",
        wait_until="domcontentloaded",
        timeout=120_000,
    )
    page.wait_for_selector(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownCell", timeout=120_000
    )
    page.wait_for_selector(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator[data-status='idle']",
        timeout=120_000,
    )


def settled(path, seconds: float = 30) -> bytes:
    """The file's bytes once a save has finished writing them: the server writes in place, so a
    read just after the file's time changed can find it empty or half written (it once did)."""
    deadline = time.monotonic() + seconds
    last = path.read_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = path.read_bytes()
        if now == last and now:
            return now
        last = now
    return last


@pytest.mark.parametrize(
    "path",
    [ROOT / "book" / "03_overlap_condition.md", ROOT / "labs" / "lab02_measure_your_link.md"],
    ids=lambda p: p.name,
)
def test_open_and_save_in_the_browser_leaves_the_file_alone(lab_server, lab_page, path):
    original = path.read_bytes()
    before = path.stat().st_mtime_ns
    checkpoints_in_checkout = checkpoint_files()
    try:
        open_in_lab(lab_page, lab_server.base, lab_path(path))
        lab_page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").click()
        lab_page.keyboard.press("Control+s")
        lab_page.wait_for_function(
            "() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden).jp-mod-dirty, "
            ".lm-TabBar-tab.lm-mod-current.jp-mod-dirty')",
            timeout=60_000,
        )
        deadline = time.monotonic() + 30
        while path.stat().st_mtime_ns == before and time.monotonic() < deadline:
            time.sleep(0.2)  # the save reached the disk (no timing is asserted)
        assert path.stat().st_mtime_ns != before, "Lab did not save the file"
        assert settled(path) == original, f"saving {path.name} in Lab rewrote it"
        # Lab's checkpoint went to the test's folder: none is left for the next `make test` to
        # collect.
        assert checkpoint_files() == checkpoints_in_checkout
        assert (lab_server.checkpoints / f"{path.stem}-checkpoint{path.suffix}").exists()
    finally:
        if path.read_bytes() != original:
            path.write_bytes(original)


def test_lab_solutions_are_folded_until_asked_for(lab_server, lab_page):
    open_in_lab(lab_page, lab_server.base, "labs/lab01_account_for_every_byte.md")
    notebook = lab_page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    hidden = notebook.locator(".jp-CodeCell .jp-Cell-inputWrapper .jp-InputPlaceholder")
    shown_answers = notebook.locator(".jp-CodeCell .cm-content", has_text="BEGIN SOLUTION")
    assert scroll_until_shown(lab_page, hidden), "no worked answer is folded"
    assert shown_answers.count() == 0  # of the cells Lab has drawn so far
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    scroll_to(hidden.first)
    lab_page.screenshot(path=str(SCREENSHOTS / "lab01_in_jupyterlab.png"))
    # The fold shows a neutral label, not the cell's first line ("### BEGIN SOLUTION •••").
    label = hidden.first.locator(".jp-PlaceholderText").evaluate(
        "e => ({drawn: getComputedStyle(e).fontSize, label: getComputedStyle(e, "
        "'::before').content})"
    )
    assert label == {"drawn": "0px", "label": '"hidden code: click to show"'}, label
    hidden.first.click()  # a reader asks for the answer
    shown_answers.first.wait_for(timeout=10_000)


def test_references_read_as_text_in_lab(lab_server, lab_page):
    """jupyterlab-myst resolves no reference across notebooks (it still logs "Cross reference target
    was not found"); a reference given its text shows that text as a link, not the label with a
    warning sign."""
    open_in_lab(lab_page, lab_server.base, "labs/lab03_hide_a_transfer.md")
    notebook = lab_page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    link = notebook.locator(".jp-MarkdownCell a", has_text="3. The overlap-vs-stall condition")
    # (scrolled to, not waited for: Lab draws a cell once it comes into view, and drawing the
    # ones out of view in idle time took over 30 s on a busy machine)
    assert scroll_until_shown(lab_page, link), "the reference is not a link with its text"
    scroll_to(link.first)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    lab_page.screenshot(path=str(SCREENSHOTS / "lab03_references_in_jupyterlab.png"))
    # what the reader sees, in every cell
    assert "ch-overlap" not in rendered_markdown(lab_page)


DIRTY = (
    "() => !!document.querySelector('.lm-TabBar-tab.lm-mod-current.jp-mod-dirty, "
    ".jp-NotebookPanel:not(.lm-mod-hidden).jp-mod-dirty')"
)


@pytest.mark.parametrize(
    "path",
    [ROOT / "book" / "01_memory_wall.md", ROOT / "labs" / "lab02_measure_your_link.md"],
    ids=lambda p: p.name,
)
def test_a_notebook_opened_and_closed_unedited_asks_nothing(lab_server, lab_page, path):
    """JupyterLab wrote the kernel's language_info into every text notebook as its kernel started,
    so each chapter showed as edited on opening and closing it asked "Save your work?"."""
    open_in_lab(lab_page, lab_server.base, lab_path(path))
    lab_page.locator(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-KernelName", has_text="Python 3"
    ).wait_for(timeout=60_000)
    # the kernel's info has arrived by now; nothing is timed, only waited for
    lab_page.wait_for_timeout(3000)
    assert not lab_page.evaluate(DIRTY), f"{path.name} is marked edited the moment it opens"
    tab = lab_page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    tab.locator(".lm-TabBar-tabCloseIcon").click()
    lab_page.wait_for_function(
        "() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') "
        "|| !!document.querySelector('.jp-Dialog')",
        timeout=30_000,
    )
    assert lab_page.locator(".jp-Dialog").count() == 0, lab_page.locator(
        ".jp-Dialog"
    ).all_inner_texts()


def test_lab_is_given_the_language_info_the_kernel_reports(lab_server):
    """Ground truth from the kernel itself: the language_info Lab would write on start is the one
    the contents manager already put in the notebook, so Lab's write changes nothing."""
    from tests.kernels import start_kernel

    model = lab_server.request("/api/contents/01_memory_wall.md?type=notebook&content=1")
    manager, client = start_kernel(kernel_name=model["content"]["metadata"]["kernelspec"]["name"])
    try:
        reported = client.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert model["content"]["metadata"]["language_info"] == reported


def scroll_until_shown(page, locator) -> bool:
    """Scroll the open notebook down from the top, half a view at a time, until Lab has drawn
    ``locator``; False if it is nowhere."""
    notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
    notebook.evaluate("e => { e.scrollTop = 0; }")
    for _ in range(400):
        page.wait_for_timeout(100)  # let Lab draw the cells now in view (nothing is timed)
        if locator.count():
            return True
        at_end = notebook.evaluate(
            "e => { e.scrollTop += e.clientHeight / 2; "
            "return e.scrollTop + e.clientHeight >= e.scrollHeight - 2; }"
        )
        if at_end:
            page.wait_for_timeout(100)
            return locator.count() > 0
    return False


def rendered_markdown(page) -> str:
    """The text of every Markdown cell of the open notebook as jupyterlab-myst renders it. Lab
    draws cells as they come into view and may drop those far out of it: scroll from the top to
    the end, collecting what each view shows."""
    notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
    notebook.evaluate("e => { e.scrollTop = 0; }")
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-MarkdownCell .myst")
    seen = {}
    for _ in range(400):
        for text in cells.all_text_contents():
            seen.setdefault(text, None)
        at_end = notebook.evaluate(
            "e => { e.scrollTop += e.clientHeight / 2; "
            "return e.scrollTop + e.clientHeight >= e.scrollHeight - 2; }"
        )
        page.wait_for_timeout(100)  # let Lab draw the cells now in view (nothing is timed)
        if at_end:
            for text in cells.all_text_contents():
                seen.setdefault(text, None)
            break
    return " ".join(seen)


@pytest.mark.parametrize(
    "path", ["01_memory_wall.md", "06_cpu_adam.md", "labs/lab06_plan_your_run.md"]
)
def test_citations_and_references_read_in_lab_without_warnings(lab_server, lab_page, path):
    """Citations show as "(Ren et al., 2021)", not as BibTeX keys with a warning sign, and no
    reference to another chapter logs "Cross reference target was not found"."""
    import re

    from tools.lab_references import citation_texts

    errors = []
    lab_page.on(
        "console",
        lambda message: (
            errors.append(message.text) if message.type in ("error", "warning") else None
        ),
    )
    open_in_lab(lab_page, lab_server.base, path)
    rendered = rendered_markdown(lab_page)
    source = (ROOT / "book" / path).read_text(encoding="utf-8")
    cited = set(re.findall(r"\(cite:([^()\s]+)\)", source))
    for keys in cited:
        assert not any(key in rendered for key in keys.split(",")), (
            f"a BibTeX key shows in Lab: {keys}"
        )
    shown = [
        text
        for key, text in citation_texts().items()
        if any(key in keys.split(",") for keys in cited)
    ]
    assert all(text in rendered for text in shown), shown
    # chapter 6 cites two papers; lab 6 links chapters
    assert len(shown) >= (2 if path == "06_cpu_adam.md" else 0)
    lost = [e for e in errors if "Cross reference target was not found" in e or "Citation" in e]
    assert not lost, lost
    # a {numref} to a figure a cell draws showed "⚠ fig-state-vs-size" in chapter 1
    assert "⚠" not in rendered and "fig-" not in rendered
