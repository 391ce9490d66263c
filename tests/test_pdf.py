"""`make pdf`: the whole book, every chapter and lab, as one PDF with its math, figures and code."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.nbval_markdown import is_text_notebook
from tests.test_site import CHROMIUM

PDFTOTEXT = shutil.which("pdftotext")


def require(tool, name: str, package: str):
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: .ci/run installs Debian's {package} package")
        pytest.skip(f"{name} is not installed (apt-get install {package})")


@pytest.fixture(scope="module")
def book_pdf(built_site, tmp_path_factory):
    """The PDF, made as `make pdf` makes it (the site build before it has executed every notebook)."""
    require(CHROMIUM, "chromium", "chromium")
    require(PDFTOTEXT, "pdftotext", "poppler-utils")
    out = tmp_path_factory.mktemp("pdf")
    single = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-b", "singlehtml", "book", str(out / "singlehtml")]
    result = subprocess.run(single, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    pdf = out / "offloadlab.pdf"
    result = subprocess.run([sys.executable, "tools/print_pdf.py", str(out / "singlehtml"), str(pdf)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return pdf


def pdf_text(pdf) -> str:
    text = subprocess.run([PDFTOTEXT, "-layout", str(pdf), "-"], capture_output=True, text=True, check=True).stdout
    return " ".join(text.split())


def title(path) -> str:
    return next(line[2:].strip() for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("# "))


def test_every_chapter_and_lab_is_in_the_pdf(book_pdf):
    text = pdf_text(book_pdf)
    notebooks = sorted(p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p))
    missing = [title(p) for p in notebooks if " ".join(title(p).split()) not in text]
    assert not missing, f"not in the PDF: {missing}"
    assert len(re.findall(r"\x0c", subprocess.run([PDFTOTEXT, str(book_pdf), "-"], capture_output=True, text=True).stdout)) > 50


def test_math_figures_code_and_solutions_are_intact(book_pdf):
    text = pdf_text(book_pdf)
    assert "state_bytes(10e9" in text                      # code
    assert "which fits only the 141 GB card" in text       # a collapsed solution, printed open
    assert "\\times" not in text and "$$" not in text      # math typeset, not left as TeX
    images = subprocess.run(["pdfimages", "-list", str(book_pdf)], capture_output=True, text=True, check=True).stdout
    assert len(images.splitlines()) - 2 >= 10              # the figures (two header lines)
