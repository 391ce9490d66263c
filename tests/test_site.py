"""The built site: offline, rendered without errors in a real browser, and a student build without solutions."""

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

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


@pytest.fixture(scope="module")
def browser_page():
    """A page of headless Chromium (Debian's), 1280 px wide."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield browser.new_page(viewport={"width": 1280, "height": 900})
        browser.close()


def test_every_page_renders_in_chromium(built_site, served, browser_page):
    page = browser_page
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems = []
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
    assert not problems, "\n".join(problems)
    assert (SCREENSHOTS / "03_overlap_condition.png").exists()


def test_solutions_stay_collapsed_until_clicked(built_site, served, browser_page):
    page = browser_page
    page.goto(f"{served}/01_memory_wall.html", wait_until="networkidle")
    solution = page.locator("div.solution.dropdown").first
    body = solution.locator("p", has_text="which fits only the 141 GB card")
    page.wait_for_selector("div.solution.dropdown button.toggle-button")
    assert not body.is_visible(), "a solution is shown before the reader asks for it"
    solution.locator("button.toggle-button").click()
    body.wait_for(state="visible", timeout=5000)


def test_code_blocks_have_copy_buttons(built_site, served, browser_page):
    page = browser_page
    page.goto(f"{served}/03_overlap_condition.html", wait_until="networkidle")
    cells = page.locator("div.cell_input div.highlight")
    assert cells.count() > 3
    assert cells.locator("button.copybtn").count() == cells.count()


@pytest.mark.parametrize("media", ["screen", "print"])
def test_code_fits_the_column(built_site, served, browser_page, media):
    """No code block or output is wider than the text column: it wraps, it is never cut off."""
    page = browser_page
    page.emulate_media(media=media)
    too_wide = []
    try:
        for path in pages(built_site):
            page.goto(f"{served}/{path.relative_to(built_site).as_posix()}", wait_until="load")
            too_wide += [f"{path.name}: {text!r}" for text in page.evaluate(
                "() => [...document.querySelectorAll('div.highlight pre, div.cell_output pre')]"
                ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.slice(0, 60))")]
    finally:
        page.emulate_media(media="screen")
    assert not too_wide, f"{len(too_wide)} blocks wider than the column:\n" + "\n".join(too_wide[:20])


def host_paths() -> list[str]:
    """Absolute paths of this machine that must never appear in a page built on it."""
    candidates = {str(ROOT), str(Path.home()), tempfile.gettempdir(), "/root/", "/home/", "/tmp/", "/var/folders/",
                  os.environ.get("VIRTUAL_ENV") or "", sys.prefix}
    return sorted(c for c in candidates if len(c) > 1)


def test_no_page_shows_a_path_of_the_build_machine(built_site):
    found = []
    documents = pages(built_site) + sorted((built_site / "_sources").rglob("*.ipynb"))
    for document in documents:
        text = document.read_text(encoding="utf-8", errors="replace")
        if document.suffix == ".ipynb":  # only what the reader sees: sources and outputs
            notebook = json.loads(text)
            text = json.dumps([(c.get("source"), c.get("outputs")) for c in notebook["cells"]])
        for path in host_paths():
            for match in re.finditer(re.escape(path), text):
                found.append(f"{document.relative_to(built_site)}: ...{text[max(0, match.start() - 40):match.end() + 40]!r}")
    assert not found, "host paths in the built pages:\n" + "\n".join(found[:20])


def test_exercises_are_numbered_from_one_on_each_page(built_site):
    numbered = 0
    for page in pages(built_site):
        titles = re.findall(r'<span class="caption-number">Exercise (\d+)\s*</span>', page.read_text(encoding="utf-8"))
        if titles:
            numbered += 1
            assert [int(n) for n in titles] == list(range(1, len(titles) + 1)), (page.name, titles)
    assert numbered >= 5


def test_images_have_alt_text_not_file_paths(built_site):
    bad, figures = [], 0
    for page in pages(built_site):
        for tag in re.findall(r"<img [^>]*>", page.read_text(encoding="utf-8")):
            alt = re.search(r'alt="([^"]*)"', tag)
            src = re.search(r'src="([^"]*)"', tag)
            figures += 1
            if not alt or not alt.group(1).strip() or (src and Path(src.group(1)).name in alt.group(1)) or ".png" in alt.group(1):
                bad.append(f"{page.name}: {tag[:160]}")
    assert figures > 10 and not bad, "\n".join(bad)
    chapter = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert 'alt="Persistent training state against parameter count' in chapter


def test_version_and_how_to_cite_on_the_site(built_site):
    import offloadlab

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert cff["version"] == offloadlab.__version__ == pyproject.group(1)
    for page in ("index.html", "07_prefetch.html", "labs/lab01_account_for_every_byte.html"):
        html = (built_site / page).read_text(encoding="utf-8")
        footer = re.search(r'<p class="offloadlab-footer">(.*?)</p>', html, re.S)
        assert footer and f"offloadlab {offloadlab.__version__}" in footer.group(1), page
        assert re.search(r'href="(\.\./)?citation.html"', footer.group(1)), page
    cite = re.sub(r"<[^>]+>", "", (built_site / "citation.html").read_text(encoding="utf-8"))
    assert "cff-version" in cite and "@software{offloadlab" in cite and cff["title"].split(":")[0] in cite


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
    # The labs' worked answers are stubs there, and no download holds them either.
    lab = re.sub(r"<[^>]+>", "", (target / "labs" / "lab05_build_a_double_buffer.html").read_text(encoding="utf-8"))
    assert "NotImplementedError" in lab and "released[i % 2] = link.mark()" not in lab
    assert not list(target.rglob("_sources/**/*.md")) and not list(target.rglob("_sources/**/*.ipynb"))
