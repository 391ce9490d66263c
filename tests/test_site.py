"""The built site: offline, rendered without errors in a real browser, and a student build without solutions."""

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.conftest import ROOT, SITE

SCREENSHOTS = ROOT / "book" / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class _Sources(HTMLParser):
    """Every URL a page would load: scripts, stylesheets, fonts, images, frames."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "video", "audio") and attrs.get("src"):
            self.urls.append(attrs["src"])
        if tag == "link" and attrs.get("href") and (attrs.get("rel") or "") in ("stylesheet", "preload", "icon", "modulepreload"):
            self.urls.append(attrs["href"])


def pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


def test_no_page_loads_anything_from_another_host(built_site):
    external = re.compile(r"^(https?:)?//", re.I)
    offenders = []
    for page in pages(built_site):
        parser = _Sources()
        parser.feed(page.read_text(encoding="utf-8"))
        offenders += [f"{page.relative_to(built_site)}: {url}" for url in parser.urls if external.match(url)]
        for css in re.findall(r'href="([^"]+\.css)[^"]*"', page.read_text(encoding="utf-8")):
            if not external.match(css):
                sheet = (page.parent / css.split("?")[0]).resolve()
                if sheet.exists():
                    offenders += [f"{sheet.name}: {u}" for u in re.findall(r"url\(['\"]?(https?://[^)'\"]+)", sheet.read_text(errors="ignore"))]
    assert not offenders, "external resources:\n" + "\n".join(sorted(set(offenders)))
    assert (built_site / "_static" / "mathjax" / "tex-chtml.js").exists()


def test_reader_tools_and_execution_status(built_site):
    chapter = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert "_sources/01_memory_wall.md" in chapter  # download the page's source (.md)
    assert "01_memory_wall.ipynb" in chapter        # download as a notebook
    status = (built_site / "execution.html").read_text(encoding="utf-8")
    assert "01_memory_wall" in status and "torch" in status


@pytest.fixture(scope="module")
def served(built_site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_page_renders_in_chromium(built_site, served):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for path in pages(built_site):
            url = f"{served}/{path.relative_to(built_site).as_posix()}"
            errors, failed = [], []
            page.on("console", lambda m, e=errors: e.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc, e=errors: e.append(str(exc)))
            page.on("requestfailed", lambda r, f=failed: f.append(r.url))
            page.on("response", lambda r, f=failed: f.append(f"{r.url} ({r.status})") if r.status >= 400 else None)
            page.goto(url, wait_until="networkidle")
            if page.locator("span.math, div.math").count():
                page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=20000)
                page.evaluate("() => MathJax.startup.promise")
                unrendered = page.evaluate("() => [...document.querySelectorAll('span.math, div.math')]"
                                           ".filter(e => !e.querySelector('mjx-container')).length")
                if unrendered:
                    problems.append(f"{url}: {unrendered} formulas left unrendered")
            problems += [f"{url}: console error: {e}" for e in errors]
            problems += [f"{url}: request failed: {f}" for f in failed]
            if path.name == "03_overlap_condition.html":
                page.screenshot(path=str(SCREENSHOTS / "03_overlap_condition.png"), full_page=True)
        browser.close()
    assert not problems, "\n".join(problems)
    assert (SCREENSHOTS / "03_overlap_condition.png").exists()


def test_student_site_has_no_solutions(tmp_path):
    target = tmp_path / "student"
    env = {**os.environ, "OFFLOADLAB_STUDENT": "1"}
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "html", "book", str(target)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    chapter = (target / "01_memory_wall.html").read_text(encoding="utf-8")
    reader = (SITE / "01_memory_wall.html").read_text(encoding="utf-8") if SITE.exists() else ""
    solution_text = "which fits only the 141 GB card"
    assert "ex-mw-7b" in chapter and solution_text not in chapter
    if reader:
        assert solution_text in reader and "dropdown" in reader
