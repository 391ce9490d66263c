"""Print the single-page build of the book to one PDF with headless Chromium (``make pdf``).

``make pdf`` first builds the whole book as one HTML page (Sphinx's singlehtml builder, with
the executed outputs of the site build); this script serves that folder on a local port, opens
it in Debian's Chromium through Playwright, waits until MathJax has typeset every formula, and
prints it to A4 with page numbers. The page's print stylesheet (book/_static/offloadlab.css)
starts each chapter and lab on a new page, wraps code instead of clipping it, and prints
collapsed solutions open.

    python tools/print_pdf.py book/_build/singlehtml book/_build/pdf/offloadlab.pdf
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
FOOTER = ('<div style="width:100%; font-size:8px; color:#666; text-align:center;">'
          '<span class="pageNumber"></span> / <span class="totalPages"></span></div>')


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``folder`` on a free local port (MathJax loads its fonts over HTTP, not file://)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def print_pdf(site: Path, target: Path, chromium: str) -> None:
    """Print ``site``/index.html to ``target``; the file appears only once it is complete."""
    from playwright.sync_api import sync_playwright

    server, base = serve(site)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 1400})
            page.goto(f"{base}/index.html", wait_until="networkidle", timeout=300_000)
            if page.locator("span.math, div.math").count():
                page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                       timeout=120_000)
                page.evaluate("() => MathJax.startup.promise")
            # Folded lab answers and collapsed solutions are printed open.
            page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
            page.emulate_media(media="print")
            handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
            os.close(handle)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(partial, 0o666 & ~umask)  # mkstemp makes it private; the PDF is for publishing
            try:
                page.pdf(path=partial, format="A4", print_background=True, display_header_footer=True,
                         header_template="<span></span>", footer_template=FOOTER,
                         margin={"top": "16mm", "bottom": "18mm", "left": "16mm", "right": "16mm"})
                os.replace(partial, target)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
            browser.close()
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/print_pdf.py", description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the singlehtml build folder (holding index.html)")
    parser.add_argument("target", type=Path, help="the PDF to write")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                        help="the Chromium executable (default: chromium on PATH)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        parser.error(f"site: expected a folder holding index.html (make pdf builds one); got {str(args.site)!r}")
    if not args.chromium:
        parser.error("--chromium: expected Chromium's executable; got none on PATH (apt-get install chromium)")
    args.target.parent.mkdir(parents=True, exist_ok=True)
    print_pdf(args.site, args.target, args.chromium)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
