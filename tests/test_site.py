"""The built site: offline, rendered without errors in a real browser, and a student build
without solutions."""

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
import html as htmllib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

SCREENSHOTS = ROOT / "book" / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class _Sources(HTMLParser):
    """Every URL a page would load: scripts, stylesheets, fonts, images, frames."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "video", "audio") and attrs.get("src"):
            self.urls.append(attrs["src"])
        if (
            tag == "link"
            and attrs.get("href")
            and (attrs.get("rel") or "") in ("stylesheet", "preload", "icon", "modulepreload")
        ):
            self.urls.append(attrs["href"])


def pages(site: Path) -> list[Path]:
    return sorted(
        p for p in site.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts
    )


def test_no_page_loads_anything_from_another_host(built_site):
    external = re.compile(r"^(https?:)?//", re.I)
    offenders = []
    for page in pages(built_site):
        parser = _Sources()
        parser.feed(page.read_text(encoding="utf-8"))
        offenders += [
            f"{page.relative_to(built_site)}: {url}" for url in parser.urls if external.match(url)
        ]
        for css in re.findall(r'href="([^"]+\.css)[^"]*"', page.read_text(encoding="utf-8")):
            if not external.match(css):
                sheet = (page.parent / css.split("?")[0]).resolve()
                if sheet.exists():
                    offenders += [
                        f"{sheet.name}: {u}"
                        for u in re.findall(
                            r"url\(['\"]?(https?://[^)'\"]+)", sheet.read_text(errors="ignore")
                        )
                    ]
    assert not offenders, "external resources:\n" + "\n".join(sorted(set(offenders)))
    assert (built_site / "_static" / "mathjax" / "tex-chtml.js").exists()


def test_reader_tools_and_execution_status(built_site):
    chapter = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert "_sources/01_memory_wall.md" in chapter  # download the page's source (.md)
    assert "01_memory_wall.ipynb" in chapter  # download as a notebook
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


# The widths a reader brings: a phone, a tablet held upright, a laptop.
WIDTHS = {390: 844, 768: 1024, 1280: 900}


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's)."""
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def browser_page(browser):
    """A page of headless Chromium, 1280 px wide."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    yield page
    page.close()


@pytest.fixture(params=sorted(WIDTHS), ids=lambda width: f"{width}px")
def page_at_width(request, browser):
    """A page as wide as a phone, a tablet or a laptop screen, that takes taps (a touch screen)."""
    width = request.param
    page = browser.new_page(viewport={"width": width, "height": WIDTHS[width]}, has_touch=True)
    yield page
    page.close()


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
        page.on(
            "response",
            lambda r, f=failed: f.append(f"{r.url} ({r.status})") if r.status >= 400 else None,
        )
        page.goto(url, wait_until="networkidle")
        if page.locator("span.math, div.math").count():
            page.wait_for_function(
                "() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=20000
            )
            page.evaluate("() => MathJax.startup.promise")
            unrendered = page.evaluate(
                "() => [...document.querySelectorAll('span.math, div.math')]"
                ".filter(e => !e.querySelector('mjx-container')).length"
            )
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


# Whether what a sidebar button controls can be seen: the chapter list or the page contents,
# inside the viewport and neither hidden nor squeezed to nothing.
SHOWN = """selector => {
  const e = document.querySelector(selector);
  if (!e) return false;
  const r = e.getBoundingClientRect(), style = getComputedStyle(e);
  return r.width > 1 && r.height > 1 && r.right > 0 && r.left < innerWidth
    && style.visibility !== "hidden";
}"""
PANELS = {"primary": "nav.bd-docs-nav", "secondary": "#pst-page-toc-nav"}


def tap_outside(page, kind: str) -> None:
    """Tap the page beside an open drawer (the chapter list slides in from the left, the
    contents from the right), as a phone reader dismisses it."""
    width, height = page.viewport_size["width"], page.viewport_size["height"]
    page.touchscreen.tap(width - 4 if kind == "primary" else 4, height - 4)


@pytest.mark.parametrize("kind", sorted(PANELS))
def test_sidebar_buttons_open_and_close_at_every_width(built_site, served, page_at_width, kind):
    """☰ opens and closes the chapter list, the list button the page contents: as drawers on a
    phone or tablet (closed again by a tap beside them), as columns on a laptop (closed and
    opened again by the button)."""
    page, panel = page_at_width, PANELS[kind]
    page.goto(f"{served}/01_memory_wall.html", wait_until="networkidle")
    button = page.locator(f".bd-header-article .{kind}-toggle")
    assert button.is_visible(), f"no {kind} button the reader can see"
    shown_at_first = page.evaluate(SHOWN, panel)
    drawer = page.viewport_size["width"] < (992 if kind == "primary" else 1200)
    assert shown_at_first is not drawer  # a drawer starts closed, a column open

    button.tap()
    page.wait_for_function(
        f"s => ({SHOWN})(s) === {str(not shown_at_first).lower()}", arg=panel, timeout=5000
    )
    assert button.get_attribute("aria-expanded") == str(not shown_at_first).lower()
    if not shown_at_first:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{kind}_open_{page.viewport_size['width']}px.png"))

    if drawer:
        tap_outside(page, kind)
    else:
        button.tap()
    page.wait_for_function(
        f"s => ({SHOWN})(s) === {str(shown_at_first).lower()}", arg=panel, timeout=5000
    )
    assert button.get_attribute("aria-expanded") == str(shown_at_first).lower()
    if drawer:  # and the button opens it again
        button.tap()
        page.wait_for_function(f"s => ({SHOWN})(s)", arg=panel, timeout=5000)
        page.keyboard.press("Escape")
        page.wait_for_function(f"s => !({SHOWN})(s)", arg=panel, timeout=5000)
    if drawer and kind == "secondary":  # a heading chosen in the drawer closes it (it stayed)
        button.tap()
        page.wait_for_function(f"s => ({SHOWN})(s)", arg=panel, timeout=5000)
        link = page.locator(f"{panel} a[href^='#']").nth(2)
        target = link.get_attribute("href")
        link.tap()
        page.wait_for_function(f"s => !({SHOWN})(s)", arg=panel, timeout=5000)
        assert button.get_attribute("aria-expanded") == "false"
        page.wait_for_function(
            """id => { const r = document.getElementById(id).getBoundingClientRect();
                       return r.top >= -2 && r.top < innerHeight / 2; }""",
            arg=target[1:],
            timeout=5000,
        )


def test_a_tap_on_a_solutions_title_opens_it_rather_than_leaving_for_the_exercise(
    built_site, served, browser
):
    """ "Solution to Exercise 1" holds a link to the exercise; on a phone the tap that should open
    the solution followed it instead."""
    page = browser.new_page(viewport={"width": 390, "height": 844}, has_touch=True)
    try:
        page.goto(f"{served}/03_overlap_condition.html", wait_until="networkidle")
        solution = page.locator("div.solution.dropdown").first
        solution.scroll_into_view_if_needed()
        body = solution.locator(":scope > :not(.admonition-title)").first
        assert not body.is_visible()
        # where the reader's finger lands: on "Exercise 1", inside the title
        box = solution.locator(".admonition-title a").bounding_box()
        page.touchscreen.tap(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        body.wait_for(state="visible", timeout=5000)
        assert "#" not in page.url
    finally:
        page.close()


# Each visible code block or output whose lines are broken: its text is taller as laid out than
# with every line kept whole (white-space: pre). Each one wider than its column must scroll.
WRAPPED_OR_CUT = r"""() => {
  const height = e => {
    const r = document.createRange();
    r.selectNodeContents(e);
    return r.getBoundingClientRect().height;
  };
  const found = [];
  for (const pre of document.querySelectorAll("div.highlight pre, div.cell_output pre")) {
    if (!pre.getClientRects().length || !pre.textContent.trim()) continue;
    const laidOut = height(pre);
    const before = pre.style.getPropertyValue("white-space");
    pre.style.setProperty("white-space", "pre", "important");
    const whole = height(pre);
    pre.style.removeProperty("white-space");
    if (before) pre.style.setProperty("white-space", before);
    const line = pre.textContent.split("\n").sort((a, b) => b.length - a.length)[0].slice(0, 70);
    if (laidOut > whole + 1) found.push(`wraps: ${line}`);
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(pre).overflowX);
    if (pre.scrollWidth > pre.clientWidth + 1 && !scrolls) found.push(`cut off: ${line}`);
  }
  return found;
}"""


def test_no_code_line_wraps(built_site, served, page_at_width):
    """Code and printed outputs keep their lines at every width: a long one scrolls sideways."""
    page, problems = page_at_width, []
    for path in pages(built_site):
        page.goto(f"{served}/{path.relative_to(built_site).as_posix()}", wait_until="load")
        problems += [f"{path.name}: {problem}" for problem in page.evaluate(WRAPPED_OR_CUT)]
    assert not problems, f"{len(problems)} code blocks wrap or are cut off:\n" + "\n".join(
        problems[:20]
    )


def test_wide_tables_scroll_inside_their_column_with_a_visible_edge(built_site, served, browser):
    """Chapter 1's table of recipes is wider than a phone: it scrolls inside the column, and a
    shadow at its right edge says there is more."""
    page = browser.new_page(viewport={"width": 390, "height": 844})
    try:
        page.goto(f"{served}/01_memory_wall.html", wait_until="load")
        table = page.evaluate("""() => {
          const box = document.querySelector("div.cell_output table")
            .closest(".pst-scrollable-table-container");
          const article = document.querySelector("article.bd-article").getBoundingClientRect();
          const r = box.getBoundingClientRect(), style = getComputedStyle(box);
          return {wider: box.scrollWidth > box.clientWidth, inside: r.right <= article.right + 1,
                  scrolls: ["auto", "scroll"].includes(style.overflowX),
                  edge: style.backgroundImage.includes("gradient")
                        && style.backgroundAttachment.includes("local")};
        }""")
        assert table == {"wider": True, "inside": True, "scrolls": True, "edge": True}, table
    finally:
        page.close()


def test_header_has_the_title_one_search_box_and_follows_the_os_colour_scheme(
    built_site, served, page_at_width
):
    page = page_at_width
    for scheme in ("dark", "light"):
        page.emulate_media(color_scheme=scheme)
        page.goto(f"{served}/03_overlap_condition.html", wait_until="networkidle")
        assert page.evaluate("() => document.documentElement.dataset.theme") == scheme
    header = page.locator("header.bd-header")
    assert header.is_visible() and "offloadlab" in header.inner_text()
    searches = page.locator(".search-button-field, .search-button, form.bd-search")
    visible = [i for i in range(searches.count()) if searches.nth(i).is_visible()]
    assert len(visible) == 1, f"{len(visible)} search boxes at {page.viewport_size['width']} px"
    # built without a repository address: no repository link, rather than a placeholder
    assert page.locator("a.offloadlab-repository").count() == 0


def test_no_page_scrolls_sideways_on_a_phone(built_site, served, browser):
    """Long inline code widened chapters 1 and 5 and the course page to 431–801 px on a 390 px
    phone, so the whole page slid sideways; a displayed formula wider than the column (chapter
    3's condition) was cut at the edge with no cue. Now inline code breaks, and a formula scrolls
    in its own box, with the shadow that says so."""
    page = browser.new_page(viewport={"width": 390, "height": 844}, has_touch=True)
    wide = []
    try:
        for html in sorted(built_site.glob("*.html")) + sorted(built_site.glob("labs/*.html")):
            name = html.relative_to(built_site).as_posix()
            if name in ("genindex.html", "search.html"):
                continue
            page.goto(f"{served}/{name}", wait_until="load")
            width = page.evaluate("() => document.documentElement.scrollWidth")
            if width > 391:
                wide.append(f"{name}: {width} px")
        page.goto(f"{served}/03_overlap_condition.html", wait_until="networkidle")
        formulas = page.evaluate("""() => [...document.querySelectorAll(
            'article div.math mjx-container[display="true"]')]
          .filter((box) => box.scrollWidth > box.clientWidth + 1)
          .map((box) => {
            const style = getComputedStyle(box);
            return ["auto", "scroll"].includes(style.overflowX)
              && style.backgroundImage.includes("gradient");
          })""")
    finally:
        page.close()
    assert not wide, "pages wider than the phone: " + ", ".join(wide)
    assert formulas and all(formulas), formulas


def test_a_labs_answers_and_checks_are_folded_and_named(built_site):
    """Each check printed the value it expects ("✓ predicted crossover batch: 6 agrees with 6")
    in plain sight under the folded answer, and the fold said "Show code cell source"."""
    for page in sorted((built_site / "labs").glob("lab*.html")):
        html = page.read_text(encoding="utf-8")
        outside = re.sub(r"<details.*?</details>", "", html, flags=re.S)
        assert not re.search(r"<pre><span></span>[✓✗]", outside), page.name
        assert "Show the worked answer" in html and "Show the check" in html, page.name
        assert "Show code cell source" not in html, page.name


def _contrast(foreground: str, background: str) -> float:
    """WCAG's contrast ratio of two CSS rgb()/rgba() colours."""

    def luminance(colour: str) -> float:
        red, green, blue = (int(v) / 255 for v in re.findall(r"[\d.]+", colour)[:3])
        linear = [
            c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (red, green, blue)
        ]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    lighter, darker = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def test_rule_boxes_stay_readable_in_both_colour_schemes(built_site, served, page_at_width):
    """The rule boxes had a light background under dark mode's light text: 1.40:1 in the body,
    1.24:1 in the title, where WCAG AA asks 4.5:1."""
    page = page_at_width
    for scheme in ("dark", "light"):
        page.emulate_media(color_scheme=scheme)
        page.goto(f"{served}/03_overlap_condition.html", wait_until="networkidle")
        colours = page.evaluate("""() => {
          const box = document.querySelector("div.admonition.rule");
          const title = box.querySelector(".admonition-title");
          const text = box.querySelector("p:not(.admonition-title)");
          const style = (e) => getComputedStyle(e);
          return {body: [style(text).color, style(box).backgroundColor],
                  title: [style(title).color, style(title).backgroundColor]};
        }""")
        for part, (foreground, background) in colours.items():
            assert _contrast(foreground, background) >= 4.5, (scheme, part, foreground, background)


def test_without_a_repository_address_the_header_shows_no_placeholder(built_site):
    """Every page's header once said "Repository (address not set)": a site built without the
    address has no repository link at all, and its landing page says why."""
    for name in ("index.html", "labs/lab01_account_for_every_byte.html"):
        html = (built_site / name).read_text(encoding="utf-8")
        assert "offloadlab-repository" not in html and "address not set" not in html, name
    landing = re.sub(r"<[^>]+>", "", (built_site / "index.html").read_text(encoding="utf-8"))
    assert "clone the repository (this copy of the site was built without its address" in " ".join(
        landing.split()
    )


def test_the_repository_address_reaches_the_header_and_the_landing_page(tmp_path):
    url = "https://github.com/example/offloadlab"
    env = {**os.environ, "OFFLOADLAB_REPOSITORY_URL": url}
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-n",
        "-q",
        "-b",
        "html",
        "book",
        str(tmp_path / "site"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("index.html", "labs/lab01_account_for_every_byte.html"):
        html = (tmp_path / "site" / name).read_text(encoding="utf-8")
        assert re.search(
            r'<a class="offloadlab-repository nav-link" href="' + re.escape(url) + '"', html
        ), name
    assert f'clone <a class="reference external" href="{url}">the repository</a>' in (
        tmp_path / "site" / "index.html"
    ).read_text(encoding="utf-8")


def test_references_link_to_their_doi_or_arxiv_entry(built_site):
    """Every paper in the bibliography links to its DOI or its arXiv page, and every other entry
    (a datasheet, a tool, a file of a project at a release) to its address."""
    from pybtex.database import parse_file

    html = (built_site / "references.html").read_text(encoding="utf-8")
    entries = re.findall(
        r'<div class="citation" id="[^"]+" role="doc-biblioentry">(.*?)</div>', html, re.S
    )
    assert len(entries) >= 8
    cited = 0
    for key, entry in parse_file(str(ROOT / "book" / "references.bib")).entries.items():
        # the style lowercases titles
        title = re.sub(r"[{}]", "", entry.fields["title"])[:30].lower()
        rendered = next(
            (e for e in entries if title in " ".join(re.sub(r"<[^>]+>", "", e).split()).lower()),
            None,
        )
        if rendered is None:
            continue  # not cited anywhere, so not listed
        cited += 1
        paper = entry.type in ("article", "inproceedings")
        link = (
            r'href="https://(doi\.org/10\.|arxiv\.org/abs/\d{4}\.\d{4,5})'
            if paper
            else r'href="https?://'
        )
        assert re.search(link, rendered), f"{key}: no {'DOI or arXiv' if paper else ''} link"
    assert cited >= 8


# The smallest figure text a reader gets: on a phone (its 342 px column), and on anything wider.
SMALLEST_FIGURE_TEXT_PX = {390: 9.0, 768: 11.0, 1280: 11.0}
VISIBLE_IMAGES = """() => [...document.querySelectorAll("article.bd-article img")]
  .filter(i => i.getClientRects().length && i.getBoundingClientRect().width > 0)
  .map(i => ({src: i.getAttribute("src"), shown: i.getBoundingClientRect().width,
              opens: i.closest("a") && i.closest("a").href === i.src}))"""


def smallest_text(svg: str) -> tuple[float, float]:
    """An SVG's smallest font size and its width, both in its own user units."""
    view_box = re.search(r'<svg[^>]*viewBox="[\d.]+ [\d.]+ ([\d.]+) [\d.]+"', svg)
    sizes = [float(size) for size in re.findall(r"font-size: ?([\d.]+)px", svg)]
    return (min(sizes) if sizes else float("inf")), float(view_box.group(1))


def test_figures_are_vector_with_readable_text_at_every_width(built_site, served, page_at_width):
    """Every figure on the site is SVG with its text kept as text, and its smallest text, as drawn
    at this width, is at least 9 CSS px on a phone and 11 px on a tablet or a laptop."""
    page, width = page_at_width, page_at_width.viewport_size["width"]
    minimum, problems, measured = SMALLEST_FIGURE_TEXT_PX[width], [], []
    for path in pages(built_site):
        page.goto(f"{served}/{path.relative_to(built_site).as_posix()}", wait_until="load")
        for image in page.evaluate(VISIBLE_IMAGES):
            file = (path.parent / image["src"]).resolve()
            if file.suffix != ".svg":
                problems.append(f"{path.name}: {file.name} is not vector")
                continue
            if not image["opens"]:  # a tap opens it alone, where a phone can zoom it
                problems.append(f"{path.name}: {file.name} does not open on its own when tapped")
            font, view_width = smallest_text(file.read_text(encoding="utf-8"))
            shown = font * image["shown"] / view_width
            measured.append(shown)
            if shown < minimum:
                problems.append(f"{path.name}: {file.name}: smallest text {shown:.1f} px")
    assert len(measured) >= 20, f"only {len(measured)} figures seen"
    assert not problems, f"at {width} px (minimum {minimum} px):\n" + "\n".join(problems)
    (SCREENSHOTS / f"figure_text_{width}px.txt").parent.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / f"figure_text_{width}px.txt").write_text(
        f"{len(measured)} figures; smallest text {min(measured):.1f} px\n"
    )


def host_paths() -> list[str]:
    """Absolute paths of this machine that must never appear in a page built on it."""
    candidates = {
        str(ROOT),
        str(Path.home()),
        tempfile.gettempdir(),
        "/root/",
        "/home/",
        "/tmp/",
        "/var/folders/",
        os.environ.get("VIRTUAL_ENV") or "",
        sys.prefix,
    }
    return sorted(c for c in candidates if len(c) > 1)


def written_by_the_authors() -> str:
    """The text of every chapter, lab and page source: a path named there (for example the
    course page's ``/root/.pyenv``, a home no student may read) is an example, not a leak."""
    return "\n".join(
        p.read_text(encoding="utf-8") for d in ("book", "labs") for p in (ROOT / d).glob("*.md")
    )


def test_no_page_shows_a_path_of_the_build_machine(built_site):
    written, found = written_by_the_authors(), []
    documents = pages(built_site) + sorted((built_site / "_sources").rglob("*.ipynb"))
    for document in documents:
        text = document.read_text(encoding="utf-8", errors="replace")
        if document.suffix == ".ipynb":  # only what the reader sees: sources and outputs
            notebook = json.loads(text)
            text = json.dumps([(c.get("source"), c.get("outputs")) for c in notebook["cells"]])
        for path in host_paths():
            for match in re.finditer(re.escape(path), text):
                named = re.match(r"[^\s\"'<>`\\]+", text[match.start() :]).group(0)
                if len(named) > len(path) and named in written:
                    continue
                found.append(
                    f"{document.relative_to(built_site)}: "
                    f"...{text[max(0, match.start() - 40) : match.end() + 40]!r}"
                )
    assert not found, "host paths in the built pages:\n" + "\n".join(found[:20])


def test_exercises_are_numbered_from_one_on_each_page(built_site):
    numbered = 0
    for page in pages(built_site):
        titles = re.findall(
            r'<span class="caption-number">Exercise (\d+)\s*</span>',
            page.read_text(encoding="utf-8"),
        )
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
            if (
                not alt
                or not alt.group(1).strip()
                or (src and Path(src.group(1)).name in alt.group(1))
                or ".png" in alt.group(1)
            ):
                bad.append(f"{page.name}: {tag[:160]}")
    assert figures > 10 and not bad, "\n".join(bad)
    chapter = (built_site / "01_memory_wall.html").read_text(encoding="utf-8")
    assert 'alt="Persistent training state against parameter count' in chapter


def test_version_and_how_to_cite_on_the_site(built_site):
    import offloadlab

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    pyproject = re.search(
        r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M
    )
    assert cff["version"] == offloadlab.__version__ == pyproject.group(1)
    for page in ("index.html", "07_prefetch.html", "labs/lab01_account_for_every_byte.html"):
        html = (built_site / page).read_text(encoding="utf-8")
        footer = re.search(r'<p class="offloadlab-footer">(.*?)</p>', html, re.S)
        assert footer and f"offloadlab {offloadlab.__version__}" in footer.group(1), page
        assert re.search(r'href="(\.\./)?citation.html"', footer.group(1)), page
    cite = re.sub(r"<[^>]+>", "", (built_site / "citation.html").read_text(encoding="utf-8"))
    assert (
        "cff-version" in cite
        and "@software{offloadlab" in cite
        and cff["title"].split(":")[0] in cite
    )


def test_student_site_has_no_solutions(tmp_path):
    target = tmp_path / "student"
    env = {**os.environ, "OFFLOADLAB_STUDENT": "1"}
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
        str(target),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    chapter = (target / "01_memory_wall.html").read_text(encoding="utf-8")
    # (test_book.py finds this solution in the reader's site, folded)
    assert "ex-mw-7b" in chapter and "which fits only the 141 GB card" not in chapter
    # The labs' worked answers are stubs there, and no download holds them either.
    lab = re.sub(
        r"<[^>]+>",
        "",
        (target / "labs" / "lab05_build_a_double_buffer.html").read_text(encoding="utf-8"),
    )
    assert "NotImplementedError" in lab and "released[i % 2] = link.mark()" not in lab
    assert not list(target.rglob("_sources/**/*.md")) and not list(
        target.rglob("_sources/**/*.ipynb")
    )
    # no check's result under a stub ("✓ … agrees" printed under NotImplementedError), nor the
    # value it expected (the site reads the reader's executions, where checks state it), and
    # the stubs in sight, not folded
    verdict = re.compile(r"agrees with|was expected|your answer (agrees|is)|is not it")
    for page in sorted((target / "labs").glob("lab*.html")):
        html = page.read_text(encoding="utf-8")
        assert not verdict.search(html), page.name
        assert not re.search(r"<pre><span></span>[✓✗]", html), page.name
        assert "Show the worked answer" not in html, page.name


# Checks for the content pass of issue 28 (asserts moved into hidden cells, code kept to 88
# characters), written before it: each runs now and, while the sources still fail it, is skipped
# saying how far they are. The lead sets this True once the pass is merged; from then on a
# failure fails.
CONTENT_PASS_MERGED = True
LONGEST_CODE_LINE = 88


def skip_until_the_content_pass(problems: list[str], what: str) -> None:
    if problems and not CONTENT_PASS_MERGED:
        pytest.skip(
            f"{len(problems)} {what} today; this check is enforced once issue 28's content pass "
            f"is merged (CONTENT_PASS_MERGED in tests/test_site.py). First: {problems[0]}"
        )


def code_lines(path: Path, printed_only: bool = False) -> list[str]:
    """Every line of code in a notebook: code cells and fenced code in the text. ``printed_only``:
    leave out the cells the site and the PDF do not show (tags remove-cell, remove-input)."""
    import jupytext

    lines = []
    for cell in jupytext.read(path).cells:
        left_out = {"remove-cell", "remove-input"} & set(cell.metadata.get("tags", []))
        if cell.cell_type == "code" and not (printed_only and left_out):
            lines += cell.source.splitlines()
        elif cell.cell_type == "markdown":
            fences = []  # open fences, innermost last: (marker, holds code)
            for line in cell.source.splitlines():
                stripped = line.strip()
                opening = re.match(r"^(`{3,}|~{3,})(.*)$", stripped)
                if fences and stripped == fences[-1][0]:
                    fences.pop()
                elif opening and not (fences and fences[-1][1]):
                    fences.append((opening[1], not opening[2].strip().startswith("{")))
                elif fences and fences[-1][1]:
                    lines.append(line)
    return lines


def test_no_code_line_is_longer_than_88_characters():
    from tests.nbval_markdown import is_text_notebook

    notebooks = sorted(
        p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
    )
    long_lines = [
        f"{p.relative_to(ROOT)}: {len(line)} characters: {line.strip()[:50]}…"
        for p in notebooks
        for line in code_lines(p)
        if len(line) > LONGEST_CODE_LINE
    ]
    skip_until_the_content_pass(
        long_lines, f"code lines longer than {LONGEST_CODE_LINE} characters"
    )
    assert not long_lines, "\n".join(long_lines[:30])


def visible_asserts(html: str) -> list[str]:
    """The ``assert`` statements in a page's code cells that a reader sees without unfolding
    anything."""
    # folded cells
    shown = re.sub(r'<details class="hide[^"]*">.*?</details>', "", html, flags=re.S)
    found = []
    for cell in re.findall(r'<div class="cell_input[^"]*"[^>]*>(.*?)</pre>', shown, flags=re.S):
        code = htmllib.unescape(re.sub(r"<[^>]+>", "", cell))
        found += [line.strip() for line in code.splitlines() if re.match(r"\s*assert\b", line)]
    return found


def test_no_assert_is_visible_on_the_site(built_site):
    found = [
        f"{page.relative_to(built_site)}: {line[:60]}"
        for page in pages(built_site)
        for line in visible_asserts(page.read_text(encoding="utf-8"))
    ]
    pages_with_asserts = sorted({line.split(":")[0] for line in found})
    skip_until_the_content_pass(found, f"visible asserts on {len(pages_with_asserts)} pages")
    assert not found, "\n".join(found[:30])


def test_a_build_removes_the_traces_it_wrote_and_keeps_the_readers(tmp_path, monkeypatch):
    """Executing the chapters writes *.trace.json beside them; a build left a dozen in Lab's file
    browser. The build removes those it added, never one the reader had made before it."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("offloadlab_book_conf", ROOT / "book" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    monkeypatch.setattr(conf, "BOOK", tmp_path)
    (tmp_path / "overlap.trace.json").write_text("{}")  # the reader's own run
    app = types.SimpleNamespace()
    conf.note_the_readers_traces(app)
    (tmp_path / "overlap.trace.json").write_text('{"traceEvents": []}')  # rewritten by the build
    (tmp_path / "prefetch.trace.json").write_text("{}")  # written by the build
    conf.remove_the_builds_traces(app, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overlap.trace.json"]


def test_the_chapters_link_their_terms_to_the_glossary(built_site):
    """The glossary was linked from no chapter: each chapter links a term or more to its entry
    (written as a link Lab opens, a term reference on the site), and each such link lands on an
    entry that exists."""
    entries = set(
        re.findall(
            r'id="(term-[\w-]+)"', (built_site / "glossary.html").read_text(encoding="utf-8")
        )
    )
    unlinked, broken = [], []
    for page in sorted(built_site.glob("0*.html")):
        anchors = re.findall(
            r'href="glossary\.html#(term-[\w-]+)"', page.read_text(encoding="utf-8")
        )
        if not anchors:
            unlinked.append(page.name)
        broken += [f"{page.name}: {anchor}" for anchor in anchors if anchor not in entries]
    assert len(entries) >= 20 and not unlinked and not broken, (unlinked, broken)
