"""Print the single-page build of the book to one PDF with headless Chromium (``make pdf``).

``make pdf`` first builds the whole book as one HTML page (Sphinx's singlehtml builder, with
the executed outputs of the site build); this script serves that folder on a local port, opens
it in Debian's Chromium through Playwright, waits until MathJax has typeset every formula, and
prints it to A4. Before printing it turns the page into a book:

- a title page, then a table of contents (chapters, labs and back matter, with their sections)
  whose page numbers come from a first printing: the second printing fills them in, and the
  script checks that they came out where the first said;
- each chapter and lab on its own pages, its title as the running head (a named CSS page per
  document, with a margin box), and page numbers at the foot;
- PDF bookmarks for every chapter, lab, section and subsection, nested as the book is: Chromium's
  own (``outline=True``) say where each heading landed, and pypdf writes them again with the
  headings' text and nesting;
- code that neither wraps nor is cut: a block whose longest line is wider than the page gets a
  smaller font, just enough to fit, never under 7 pt; an output (or a block in the text) still
  too wide at 7 pt wraps its long lines, each continuation indented under its line; a code cell
  that cannot fit fails the build;
  a short block is kept on one page, a long one may break between lines;
- collapsed solutions and folded lab answers printed open; figures stay vector (SVG).

The print stylesheet (book/_static/offloadlab.css) does the rest.

    python tools/print_pdf.py book/_build/singlehtml book/_build/pdf/offloadlab.pdf
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TEXT_WIDTH_PX = round((210 - 2 * 16) / 25.4 * 96)  # A4 less the 16 mm margins @page sets, in CSS px
SMALLEST_CODE_PX = 9.4  # a block is never printed smaller than this to make it fit (7.05 pt)
SHORT_BLOCK_LINES = 24  # a block this long or shorter is kept on one page

# Runs in the page before the first printing: builds the title page and the table of contents,
# names each document's pages for its running head, and fits each code block to the page.
# Returns the headings Chromium will put in the outline, in order, with the id the contents
# link to.
PREPARE = r"""
({title, subtitle, version, authors, smallestCodePx, shortBlockLines, bookCss}) => {
  const text = e => e.textContent.replace(/[#¶]\s*$/, "").replace(/\s+/g, " ").trim();
  const article = document.querySelector("article.bd-article");
  // The theme's print-only title and "Contents" heading, and the landing page's own "Contents"
  // heading, under which the documents follow: the front matter below replaces them.
  document.querySelectorAll("#jb-print-docs-body").forEach(e => e.remove());
  // before any move
  const documents = [...article.querySelectorAll('span[id^="document-"] + section')];
  const landing = article.querySelector(":scope > section");
  landing.querySelectorAll(":scope > section").forEach(s => {
    if (s.querySelector('span[id^="document-"]')) s.querySelector(":scope > h2")?.remove();
  });

  // singlehtml nests every document two levels under the landing page (its title an h3):
  // each becomes a top-level part again, its title an h1, so that the bookmarks and the
  // contents list chapters and labs first, their sections under them.
  const promote = (section, by) => section.querySelectorAll("h3, h4, h5, h6").forEach(h => {
    const level = Math.max(1, Number(h.tagName[1]) - by);
    const promoted = document.createElement(`h${level}`);
    [...h.attributes].forEach(a => promoted.setAttribute(a.name, a.value));
    promoted.append(...h.childNodes);
    h.replaceWith(promoted);
  });
  documents.forEach(section => promote(section, 2));

  // Running heads: each document's pages are a named page whose top margin holds its title.
  const rules = [bookCss,
    "@page { size: A4; margin: 20mm 16mm 18mm 16mm;",
    "  @bottom-center { content: counter(page); font: 9pt sans-serif; color: #555; } }",
    "@page :first { @bottom-center { content: none; } }",
  ];
  documents.forEach((section, i) => {
    const heading = section.querySelector("h1");
    if (!heading) return;
    // The document's anchor moves inside it: between two named pages it would take a blank page.
    section.prepend(section.previousElementSibling);
    section.style.page = `document-${i}`;
    rules.push(`@page document-${i} { @top-left { content: ${JSON.stringify(text(heading))};`
               + " font: 9pt sans-serif; color: #555; } }");
  });
  const style = document.createElement("style");
  style.textContent = rules.join("\n");
  document.head.append(style);

  // The title page and the contents, before everything else.
  const front = document.createElement("section");
  front.className = "offloadlab-front";
  const cover = document.createElement("div");
  cover.className = "offloadlab-title-page";
  const titleRows = [["title", title], ["subtitle", subtitle], ["version", `version ${version}`],
                 ["authors", authors]];
  for (const [name, value] of titleRows) {
    const line = cover.appendChild(document.createElement("p"));
    line.className = `offloadlab-${name}`;
    line.textContent = value;
  }
  const contents = document.createElement("nav");
  contents.className = "offloadlab-contents";
  contents.innerHTML = "<h1>Contents</h1>";
  let counter = 0;
  const entry = (heading, level) => {
    if (!heading.id) heading.id = `offloadlab-heading-${++counter}`;
    const line = contents.appendChild(document.createElement("a"));
    line.className = `offloadlab-contents-${level}`;
    line.href = `#${heading.closest("section")?.id || heading.id}`;
    line.dataset.target = heading.id;
    line.innerHTML = '<span class="offloadlab-contents-title"></span>'
      + '<span class="offloadlab-contents-leader"></span>'
      + '<span class="offloadlab-contents-page">000</span>';
    line.querySelector(".offloadlab-contents-title").textContent = text(heading);
  };
  entry(landing.querySelector("h1"), 1);
  documents.forEach(section => {
    const heading = section.querySelector("h1");
    if (!heading) return;
    entry(heading, 1);
    section.querySelectorAll(":scope > section > h2").forEach(h2 => entry(h2, 2));
  });
  front.append(cover, contents);
  article.prepend(front);
  document.title = `${title}: ${subtitle}`;

  // Code: never wrapped, never cut. A block wider than the page gets a smaller font, down to
  // the smallest the book prints; an output (or a block of the text) wider still wraps, line by
  // line, each continuation indented under its line's start. A code cell's lines (at most 88
  // characters) always fit.
  // The widest line against the room inside the padding, less 5 %: printed, glyphs come out a
  // little wider than on the screen this measures (a block fitted exactly lost its last letter).
  const fits = pre => {
    const style = getComputedStyle(pre), text = document.createRange();
    text.selectNodeContents(pre);
    const room = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return text.getBoundingClientRect().width <= 0.95 * room;
  };
  const blocks = [...document.querySelectorAll("div.highlight pre, div.cell_output pre")];
  for (const pre of blocks) {
    const lines = pre.textContent.replace(/\n$/, "").split("\n");
    // A short block is kept on one page with its frame (the cell around it), not left behind empty.
    if (lines.length <= shortBlockLines) {
      (pre.closest(".cell_input, .cell_output") || pre).classList.add("offloadlab-keep-whole");
    }
    const size = parseFloat(getComputedStyle(pre).fontSize);
    if (!fits(pre)) {
      let fitted = Math.max(smallestCodePx,
                            Math.floor(0.95 * size * pre.clientWidth / pre.scrollWidth * 10) / 10);
      pre.style.fontSize = `${fitted}px`;
      while (!fits(pre) && fitted > smallestCodePx) {  // glyphs do not scale exactly with size
        fitted = Math.max(smallestCodePx, Math.round(fitted * 10 - 1) / 10);
        pre.style.fontSize = `${fitted}px`;
      }
    }
    if (!fits(pre) && !pre.closest("div.cell_input")) {
      pre.classList.add("offloadlab-wrapped");
      pre.replaceChildren(...lines.map(line => {
        const row = document.createElement("span");
        row.textContent = line || " ";  // a blank line keeps its height
        return row;
      }));
    }
  }
  // What still runs past the page's edge would be cut: print_pdf() refuses to print it.
  const cut = blocks.filter(pre => !pre.classList.contains("offloadlab-wrapped") && !fits(pre))
    .map(pre => pre.textContent.trim().split("\n")[0].slice(0, 80));
  // The headings Chromium turns into bookmarks, in document order.
  const headings = [...document.querySelectorAll("h1, h2, h3, h4, h5, h6")]
    .filter(h => h.getClientRects().length)
    .map(h => ({id: h.id, title: text(h), level: Number(h.tagName[1])}));
  return {headings, cut};
}
"""

# The book's own print style, on top of the site's (book/_static/offloadlab.css): the title page
# and contents, and what the theme does for a page printed alone but a book must not do (hide
# the first h1 of the article, which here is every chapter's title; indent the text).
BOOK_CSS = """
.bd-main .bd-content .bd-article h1:first-of-type { display: block; }
.bd-main .bd-content { margin-left: 0; }
.bd-main .bd-content .bd-article h1 { margin-top: 0; }
.offloadlab-title-page { break-after: page; padding-top: 35%; text-align: center; }
pre.offloadlab-wrapped { white-space: normal; }
pre.offloadlab-wrapped > span {
  display: block; white-space: pre-wrap; overflow-wrap: anywhere;
  padding-left: 4ch; text-indent: -4ch;
}
.offloadlab-title-page p { margin: 0 0 0.6em; }
.offloadlab-title { font-size: 36pt; font-weight: bold; }
.offloadlab-subtitle { font-size: 18pt; }
.offloadlab-version, .offloadlab-authors { font-size: 12pt; color: #444; }
.offloadlab-contents { break-after: page; }
.offloadlab-contents a { display: flex; align-items: baseline; color: inherit;
  text-decoration: none; break-inside: avoid; }
.offloadlab-contents-1 { font-weight: bold; margin-top: 0.8em; break-after: avoid; }
.offloadlab-contents-2 { padding-left: 1.5em; font-size: 0.92em; }
/* A dotted leader from the title to its page number: a dotted border, which prints as evenly
   spaced vector dots (a gradient of dots was rasterised unevenly). */
.offloadlab-contents-leader {
  flex: 1; min-width: 1em; margin: 0 0.4em; border-bottom: 1.5px dotted #888;
  position: relative; top: -0.25em;
}
/* Three digits' room whatever the number, so that filling the numbers in moves no title. */
.offloadlab-contents-page { font-variant-numeric: tabular-nums; min-width: 3ch; text-align: right; }
"""

START_A_PAGE = """ids => ids.forEach(id => {
  document.getElementById(id).style.breakBefore = "page";
})"""

FILL_PAGES = """pages => document.querySelectorAll(".offloadlab-contents a").forEach(line => {
  const page = pages[line.dataset.target];
  line.querySelector(".offloadlab-contents-page").textContent = String(page ?? "");
})"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``folder`` on a free local port (MathJax loads its fonts over HTTP, not file://)."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def pages_of(places: list[tuple[int, float, float]]) -> list[int]:
    return [place[0] for place in places]


def heading_places(headings: list[dict], pdf: bytes) -> list[tuple[int, float, float]]:
    """Where each heading is printed, (page index, left, top), from the bookmarks Chromium made.

    Chromium writes one bookmark per heading, in document order; their titles are not always
    the heading's text (a heading moved to the next page is named twice), so only their number
    and order are relied on, and the places they point to.
    """
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(pdf))
    places = []

    def walk(items):
        for item in items:
            if isinstance(item, list):
                walk(item)
            else:
                places.append(
                    (
                        reader.get_destination_page_number(item),
                        float(item.left or 0),
                        float(item.top or 0),
                    )
                )

    walk(reader.outline)
    if len(places) != len(headings):
        raise RuntimeError(f"Chromium made {len(places)} bookmarks for {len(headings)} headings")
    return places


def with_bookmarks(pdf: bytes, headings: list[dict], places: list, metadata: dict) -> bytes:
    """``pdf`` with bookmarks of our own: each heading down to level 3, under the heading above
    it (chapters and labs at the top, their sections and subsections below), named by its text
    and opening at its place on the page; and the book's title and authors in its properties."""
    from pypdf import PdfWriter
    from pypdf.generic import Fit

    writer = PdfWriter(clone_from=io.BytesIO(pdf))
    writer.root_object.pop("/Outlines", None)
    parents = {}
    for heading, (page, left, top) in zip(headings, places):
        level = heading["level"]
        if level > 3:
            continue
        parent = next(
            (parents[above] for above in range(level - 1, 0, -1) if above in parents), None
        )
        parents[level] = writer.add_outline_item(
            title=heading["title"],
            page_number=page,
            parent=parent,
            fit=Fit.xyz(left, top),
            is_open=False,
        )
        for deeper in [k for k in parents if k > level]:
            del parents[deeper]
    writer.add_metadata(
        {
            "/Title": f"{metadata['title']}: {metadata['subtitle']}",
            "/Author": metadata["authors"],
            "/Subject": f"version {metadata['version']}",
        }
    )
    writer.page_mode = "/UseOutlines"
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def book_metadata(root: Path = Path(__file__).resolve().parent.parent) -> dict:
    """Title, subtitle, version and authors for the title page, from CITATION.cff."""
    import yaml

    cff = yaml.safe_load((root / "CITATION.cff").read_text(encoding="utf-8"))
    title, _, subtitle = cff["title"].partition(":")
    authors = ", ".join(
        a.get("name") or f"{a['given-names']} {a['family-names']}" for a in cff["authors"]
    )
    return {
        "title": title.strip(),
        "subtitle": subtitle.strip(),
        "version": str(cff["version"]),
        "authors": authors,
        "smallestCodePx": SMALLEST_CODE_PX,
        "shortBlockLines": SHORT_BLOCK_LINES,
        "bookCss": BOOK_CSS,
    }


def print_pdf(site: Path, target: Path, chromium: str) -> None:
    """Print ``site``/index.html to ``target``; the file appears only once it is complete."""
    from playwright.sync_api import sync_playwright

    server, base = serve(site)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
            # As wide as the printed text (A4 less the margins), so that what is measured before
            # printing (which code blocks are too wide) is what will be printed.
            page = browser.new_page(viewport={"width": TEXT_WIDTH_PX, "height": 1400})
            page.goto(f"{base}/index.html", wait_until="networkidle", timeout=300_000)
            if page.locator("span.math, div.math").count():
                page.wait_for_function(
                    "() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                    timeout=120_000,
                )
                page.evaluate("() => MathJax.startup.promise")
            # Folded lab answers and collapsed solutions are printed open.
            page.evaluate(
                "() => document.querySelectorAll('details').forEach(d => { d.open = true; })"
            )
            page.emulate_media(media="print")
            metadata = book_metadata()
            prepared = page.evaluate(PREPARE, metadata)
            if prepared["cut"]:
                raise RuntimeError(
                    f"code wider than the page at {SMALLEST_CODE_PX} px would be cut: "
                    + "; ".join(repr(first) for first in prepared["cut"])
                )
            headings = prepared["headings"]
            options = {
                "print_background": True,
                "prefer_css_page_size": True,
                "outline": True,
                "tagged": True,
            }
            # first printing: where everything falls
            places = heading_places(headings, page.pdf(**options))
            seen = [pages_of(places)]
            for _ in range(4):
                page.evaluate(
                    FILL_PAGES, {h["id"]: place[0] + 1 for h, place in zip(headings, places)}
                )
                pdf = page.pdf(**options)
                printed = heading_places(headings, pdf)
                if pages_of(printed) == pages_of(places):
                    break
                if pages_of(printed) in seen:
                    # A heading on a page break that flips between the two pages with the
                    # numbers filled in (it did: bottom of one page, top of the next, and back)
                    # starts the next page.
                    moved = [h["id"] for h, a, b in zip(headings, places, printed) if a[0] != b[0]]
                    page.evaluate(START_A_PAGE, moved)
                seen.append(pages_of(printed))
                places = printed  # the numbers moved a heading; print again with the new ones
            else:
                raise RuntimeError("the table of contents did not settle in four printings")
            pdf = with_bookmarks(pdf, headings, printed, metadata)
            browser.close()
    finally:
        server.shutdown()
    write_atomically(target, pdf)


def write_atomically(target: Path, data: bytes) -> None:
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # mkstemp makes it private; the PDF is for publishing
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/print_pdf.py", description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the singlehtml build folder (holding index.html)")
    parser.add_argument("target", type=Path, help="the PDF to write")
    parser.add_argument(
        "--chromium",
        default=shutil.which("chromium") or shutil.which("chromium-browser"),
        help="the Chromium executable (default: chromium on PATH)",
    )
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        parser.error(
            "site: expected a folder holding index.html (make pdf builds one); got "
            f"{str(args.site)!r}"
        )
    if not args.chromium:
        parser.error(
            "--chromium: expected Chromium's executable; got none on PATH (apt-get install "
            "chromium)"
        )
    args.target.parent.mkdir(parents=True, exist_ok=True)
    print_pdf(args.site, args.target, args.chromium)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
