"""`make pdf`: the whole book, every chapter and lab, as one PDF with its math, figures and code,
a title page, contents with page numbers, bookmarks and running heads. Read back with poppler's
pdfinfo and pdftotext (and pypdf for the bookmarks, which this pdfinfo does not list)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.nbval_markdown import is_text_notebook
from tests.test_site import CHROMIUM, code_lines

PDFTOTEXT = shutil.which("pdftotext")
NOTEBOOKS = sorted(
    p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
)


def require(tool, name: str, package: str):
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: .ci/run installs Debian's {package} package")
        pytest.skip(f"{name} is not installed (apt-get install {package})")


@pytest.fixture(scope="module")
def book_pdf(built_site, tmp_path_factory):
    """The PDF, made as `make pdf` makes it (the site build before it has executed every
    notebook)."""
    require(CHROMIUM, "chromium", "chromium")
    require(PDFTOTEXT, "pdftotext", "poppler-utils")
    out = tmp_path_factory.mktemp("pdf")
    single = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "singlehtml",
        "book",
        str(out / "singlehtml"),
    ]
    result = subprocess.run(single, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    pdf = out / "offloadlab.pdf"
    result = subprocess.run(
        [sys.executable, "tools/print_pdf.py", str(out / "singlehtml"), str(pdf)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return pdf


def pdf_pages(pdf) -> list[str]:
    """The text of each page, laid out as printed (pdftotext -layout), one string per page."""
    text = subprocess.run(
        [PDFTOTEXT, "-layout", str(pdf), "-"], capture_output=True, text=True, check=True
    ).stdout
    return text.split("\f")[:-1]


def pdf_text(pdf) -> str:
    return " ".join("\n".join(pdf_pages(pdf)).split())


def title(path) -> str:
    return next(
        line[2:].strip()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("# ")
    )


def squeeze(text: str) -> str:
    return " ".join(text.split())


def test_every_chapter_and_lab_is_in_the_pdf(book_pdf):
    text = pdf_text(book_pdf)
    missing = [title(p) for p in NOTEBOOKS if squeeze(title(p)) not in text]
    assert not missing, f"not in the PDF: {missing}"
    assert len(pdf_pages(book_pdf)) > 50


def test_math_figures_code_and_solutions_are_intact(book_pdf):
    text = pdf_text(book_pdf)
    assert "state_bytes(10e9" in text  # code
    assert "which fits only the 141 GB card" in text  # a collapsed solution, printed open
    assert "\\times" not in text and "$$" not in text  # math typeset, not left as TeX


def test_figures_are_vector(book_pdf):
    """The figures are SVG, printed as vector graphics with their text as text: no raster image in
    the PDF, and the words of a plot and of a diagram can be found in it."""
    images = subprocess.run(
        ["pdfimages", "-list", str(book_pdf)], capture_output=True, text=True, check=True
    ).stdout
    assert len(images.splitlines()) - 2 == 0, images  # two header lines, no image
    text = pdf_text(book_pdf)
    assert "persistent training state (GB)" in text  # chapter 1's plot, its axis label
    assert "PCIe root complex" in text and "copy engine" in text  # chapter 4's diagram


def test_title_page_and_metadata(book_pdf):
    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    info = subprocess.run(
        ["pdfinfo", str(book_pdf)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^Title:\s+" + re.escape(cff["title"]) + r"\s*$", info, re.M), info
    first = squeeze(pdf_pages(book_pdf)[0])
    assert cff["title"].split(":")[0] in first and f"version {cff['version']}" in first
    assert "Contents" not in first  # the contents start on a page of their own


ENTRY = re.compile(r"^(\s*)(\S.*?\S)\s{2,}(\d+)\s*$")  # "3. The overlap-vs-stall condition      27"


def contents(book_pdf, parts_only: bool = False) -> dict[str, int]:
    """Title -> page number, as the printed table of contents gives them: the page headed
    "Contents" and the pages after it that are mostly such entries. ``parts_only``: only the
    chapters, labs and back matter, which stand at the left margin (their sections are indented)."""
    pages = pdf_pages(book_pdf)
    start = next(i for i, page in enumerate(pages) if page.lstrip().startswith("Contents"))
    entries = {}
    for i, page in enumerate(pages[start:]):
        lines = [line for line in page.splitlines() if line.strip()]
        found = [ENTRY.match(line) for line in lines]
        if i and sum(map(bool, found)) < 0.6 * len(lines):
            break
        margin = min(len(m[1]) for m in found if m)
        entries.update(
            {
                squeeze(m[2]): int(m[3])
                for m in found
                if m and (not parts_only or len(m[1]) == margin)
            }
        )
    return entries


def test_contents_give_the_page_each_chapter_and_lab_starts_on(book_pdf):
    pages, listed = pdf_pages(book_pdf), contents(book_pdf)
    for path in NOTEBOOKS:
        name = squeeze(title(path))
        entry = next(
            (
                page
                for text, page in listed.items()
                if name.startswith(text) or text.startswith(name)
            ),
            None,
        )
        assert entry is not None, f"{name} is not in the contents: {sorted(listed)[:10]}"
        assert name.split(":")[0] in squeeze(pages[entry - 1]), (
            f"{name}: the contents say page {entry}"
        )


def test_bookmarks_for_every_chapter_lab_and_section(book_pdf):
    from pypdf import PdfReader

    reader = PdfReader(str(book_pdf))

    def flat(items, depth=0):
        for item in items:
            if isinstance(item, list):
                yield from flat(item, depth + 1)
            else:
                yield depth, item.title, reader.get_destination_page_number(item) + 1

    bookmarks = list(flat(reader.outline))
    titles = [squeeze(t).rstrip("#¶ ") for _, t, _ in bookmarks]
    for path in NOTEBOOKS:
        assert squeeze(title(path)) in titles, f"no bookmark for {title(path)}"
    assert any(depth >= 1 for depth, _, _ in bookmarks), "no bookmarks for sections"
    assert "Exercises" in titles or any("Exercise" in t for t in titles)
    assert len(bookmarks) >= 3 * len(NOTEBOOKS)


def test_running_heads_name_the_chapter(book_pdf):
    """Every page of a chapter or lab after its first carries its title at the top, and a page
    number."""
    pages, listed = pdf_pages(book_pdf), contents(book_pdf, parts_only=True)
    # every part: chapters, labs, back matter
    starts = sorted((page, name) for name, page in listed.items())
    checked = 0
    for (start, name), (end, _) in zip(starts, starts[1:]):
        if not re.match(r"^(\d+\.|Lab \d+:) ", name):
            continue  # the landing page runs on unheaded; the back matter is headed too, unchecked
        for number in range(start + 1, end):
            lines = [line for line in pages[number - 1].splitlines() if line.strip()]
            assert lines and squeeze(lines[0]).startswith(name[:30]), (number, name, lines[:1])
            assert lines[-1].strip() == str(number), (number, lines[-1])
            checked += 1
    assert checked > 30


def test_code_is_never_wrapped(book_pdf):
    """Each long line of code the book shows is one line in the PDF: it is neither wrapped nor cut
    (print_pdf.py shrinks the font of a block too wide for the page)."""
    printed = {squeeze(line) for page in pdf_pages(book_pdf) for line in page.splitlines()}
    long_lines = {
        squeeze(line)
        for path in NOTEBOOKS
        for line in code_lines(path, printed_only=True)
        if len(line.strip()) > 70
    }
    broken = [
        line for line in long_lines if not any(line in printed_line for printed_line in printed)
    ]
    assert len(long_lines) > 50 and not broken, (
        f"{len(broken)} of {len(long_lines)} long lines are wrapped: {broken[:5]}"
    )


def printed_sizes(pdf) -> list[tuple[int, float, str]]:
    """(page, size in points, text) for every run of text the PDF draws: the font's size scaled
    by the text and graphics matrices, as a reader's viewer draws it at 100 %."""
    import pypdf

    def times(a, b):
        return [
            a[0] * b[0] + a[1] * b[2],
            a[0] * b[1] + a[1] * b[3],
            a[2] * b[0] + a[3] * b[2],
            a[2] * b[1] + a[3] * b[3],
        ]

    runs = []
    for number, page in enumerate(pypdf.PdfReader(pdf).pages, 1):

        def visit(text, cm, tm, font, size, number=number):
            if text.strip():
                m = times(tm, cm)
                runs.append((number, size * (m[2] ** 2 + m[3] ** 2) ** 0.5, text.strip()))

        page.extract_text(visitor_text=visit)
    return runs


def test_no_text_is_printed_under_7_points(book_pdf):
    """A block too wide for the page gets a smaller font only down to 7 pt (print_pdf.py once
    went to 4.9 pt, on 14 pages, and still cut five lines: an output too wide at 7 pt now wraps,
    and a block that would still be cut fails the build)."""
    runs = printed_sizes(book_pdf)
    small = [(page, round(size, 2), text[:40]) for page, size, text in runs if size < 6.99]
    assert len(runs) > 10_000 and not small, f"{len(small)} runs under 7 pt: {small[:8]}"


def test_an_output_too_wide_for_7_points_wraps_and_loses_nothing(book_pdf, built_site):
    """Every line of every output wider than the page at 7 pt (a plan's table runs to 300
    characters) is in the PDF whole, wrapped: its text, spaces aside, in order."""
    import html

    printed = "".join(pdf_text(book_pdf).split())
    wide = []
    for page in built_site.rglob("*.html"):
        for block in re.findall(
            r'<div class="cell_output[^"]*".*?<pre>(.*?)</pre>',
            page.read_text(encoding="utf-8"),
            re.DOTALL,
        ):
            text = html.unescape(re.sub(r"<[^>]+>", "", block))
            wide += [line for line in text.splitlines() if len(line) > 130]
    lost = [line for line in wide if "".join(line.split()) not in printed]
    assert len(wide) > 10 and not lost, f"{len(lost)} of {len(wide)} lines lost: {lost[:3]}"


def test_the_site_offers_the_pdf(book_pdf, tmp_path):
    """Built with a PDF at hand, every page links it in its footer and in its download menu."""
    env = {**os.environ, "OFFLOADLAB_PDF": str(book_pdf)}
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
    assert (tmp_path / "site" / book_pdf.name).read_bytes() == book_pdf.read_bytes()
    for name, prefix in (("index.html", ""), ("labs/lab03_hide_a_transfer.html", "../")):
        html = (tmp_path / "site" / name).read_text(encoding="utf-8")
        assert f'href="{prefix}{book_pdf.name}" download>The book as a PDF</a>' in html, name
        assert re.search(
            r'href="' + re.escape(prefix + book_pdf.name) + r'"[^>]*>.*?book \.pdf', html, re.S
        ), name
