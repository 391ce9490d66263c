"""Sphinx configuration for the offloadlab book: chapters in book/, labs through book/labs -> ../labs.

Every chapter and lab is a Jupytext MyST notebook that myst-nb executes during the build;
a cell that raises fails the build. The build needs no network.
"""

import os
import shutil
import sys
from pathlib import Path

import yaml
from docutils import nodes

import offloadlab

BOOK = Path(__file__).resolve().parent
PDF = BOOK / "_build" / "pdf" / "offloadlab.pdf"  # written by `make pdf`; linked when present

project = "offloadlab"
author = "the offloadlab authors"
copyright = "2026, the offloadlab authors"
release = offloadlab.__version__

sys.path.insert(0, str(BOOK / "_ext"))  # the book's own extensions: calculators
extensions = [
    "myst_nb",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx_exercise",
    "sphinx_togglebutton",
    "sphinxcontrib.bibtex",
    "calculators",  # book/_ext/calculators.py: the live calculators of chapters 1, 3, 4, 5 and 9
]

root_doc = "index"
exclude_patterns = ["_build", "student", "**/.ipynb_checkpoints", "**/README.md", ".jupyter_cache"]
templates_path = ["_templates"]

myst_enable_extensions = ["amsmath", "colon_fence", "deflist", "dollarmath", "substitution"]
myst_heading_anchors = 3

# One source, two builds: the reader's site shows solutions in dropdowns that
# sphinx-togglebutton keeps collapsed until clicked; the student site (OFFLOADLAB_STUDENT=1,
# `make book-student`) leaves them out — the exercises' solutions, the labs' worked answers (each
# answer cell shows the stub students get) and the downloadable sources that hold them.
hide_solutions = bool(os.environ.get("OFFLOADLAB_STUDENT"))

# Execute every notebook; a failing cell fails the build. The cache keeps rebuilds fast. The
# student site has a cache of its own: its labs run in student mode, where a check never shows
# the expected value.
nb_execution_mode = "cache"
nb_execution_cache_path = str(Path(__file__).parent / "_build" /
                              (".jupyter_cache-student" if hide_solutions else ".jupyter_cache"))
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 900
nb_merge_streams = True
nb_render_markdown_format = "myst"  # Markdown outputs with tables, as the chapters print them

numfig = True
bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"

# Everything a page loads comes from the site itself: MathJax is vendored into _static by
# `make book` (see the Makefile), and no widget JavaScript is pulled from a CDN.
html_static_path = ["_static"]
html_css_files = ["offloadlab.css"]  # code wraps at the column, on screen and in print
mathjax_path = "mathjax/tex-chtml.js"
nb_ipywidgets_js = {}

# Build-time settings for the reader's tools (empty means: no such button).
REPOSITORY_URL = os.environ.get("OFFLOADLAB_REPOSITORY_URL", "")
html_theme = "sphinx_book_theme"
html_context = {"default_mode": "light"}  # a stated mode: the theme logs an error for an empty one
html_favicon = "_static/favicon.svg"
html_title = "offloadlab: training beyond GPU memory"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "repository_url": REPOSITORY_URL,
    "repository_branch": os.environ.get("OFFLOADLAB_REPOSITORY_BRANCH", "main"),
    "path_to_docs": "book",
    "use_repository_button": bool(REPOSITORY_URL),
    # The theme's footer, with the version, "how to cite" and the PDF in place of its empty extra.
    "footer_content_items": ["author.html", "copyright.html", "last-updated.html", "offloadlab-footer.html"],
    # Launch buttons need the repository; without one the theme must not be given any.
    "launch_buttons": {
        "notebook_interface": "jupyterlab",
        "jupyterhub_url": os.environ.get("OFFLOADLAB_JUPYTERHUB_URL", ""),
        "binderhub_url": os.environ.get("OFFLOADLAB_BINDERHUB_URL", "https://mybinder.org"),
        "colab_url": "https://colab.research.google.com",
    } if REPOSITORY_URL else {},
}

html_copy_source = not hide_solutions  # the .md sources hold the labs' worked answers

# Copy buttons copy the code, not the prompts of shell or REPL examples.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True


def citation(cff_path: Path = BOOK.parent / "CITATION.cff") -> dict:
    """The "how to cite" text and BibTeX entry, from CITATION.cff (one source for GitHub and the site)."""
    cff = yaml.safe_load(cff_path.read_text(encoding="utf-8"))
    authors = " and ".join(a.get("name") or f"{a['given-names']} {a['family-names']}" for a in cff["authors"])
    year = str(cff.get("date-released", copyright.split(",")[0]))[:4]
    text = f"{authors} ({year}). *{cff['title']}*, version {cff['version']}."
    bibtex = (f"```bibtex\n@software{{offloadlab,\n  author  = {{{{{authors}}}}},\n  title   = {{{{{cff['title']}}}}},\n"
              f"  version = {{{cff['version']}}},\n  year    = {{{year}}},\n  license = {{{cff['license']}}}\n}}\n```")
    return {"version": cff["version"], "citation": text, "bibtex": bibtex}


myst_substitutions = citation()


def publish_notebook_download(app, pagename, templatename, context, doctree):
    """Offer each executed chapter and lab as an .ipynb download beside its .md source.

    The theme does this itself only when launch buttons are configured; this runs just before
    its header buttons are built and does the same for every build.
    """
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if hide_solutions or not executed.exists() or context.get("ipynb_source"):
        return  # (the student site offers no executed notebook: it would hold the worked answers)
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def stub_lab_answers(app, doctree):
    """On the student site, show each lab answer cell as students receive it: the worked answer
    between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` replaced by the stub."""
    from docutils import nodes

    from offloadlab.student import BEGIN, strip_solutions

    for block in doctree.findall(nodes.literal_block):
        text = block.astext()
        if any(line.strip() == BEGIN for line in text.splitlines()):
            stubbed = strip_solutions(text)
            block.rawsource = stubbed  # what the highlighter reads
            block.children = [nodes.Text(stubbed)]


def number_exercises_per_page(app, env):
    """Number each page's exercises from 1, as JupyterLab numbers them in the notebook.

    Sphinx numbers enumerable nodes across the whole book ("Exercise 17" in chapter 7); this
    runs after it has assigned the numbers and renumbers sphinx-exercise's within each page,
    in their order there, so titles, solutions and {numref} all say the page's own number.
    """
    for numbers in env.toc_fignumbers.values():
        exercises = numbers.get("exercise")
        if exercises:
            in_order = sorted(exercises, key=exercises.get)
            numbers["exercise"] = {label: (i,) for i, label in enumerate(in_order, 1)}
    return []


def alt_text_from_captions(app, doctree, docname):
    """Give each figure's image its caption as alt text (the default is the image's file path)."""
    for figure in doctree.findall(nodes.figure):
        captions = list(figure.findall(nodes.caption))
        text = " ".join(captions[0].astext().split()) if captions else ""
        for image in figure.findall(nodes.image):
            if text and (not image.get("alt") or image["alt"] == image.get("uri")):
                image["alt"] = text
    for image in doctree.findall(nodes.image):
        if not image.get("alt"):
            image["alt"] = "A figure drawn by the code cell above it"


def link_the_pdf(app, pagename, templatename, context, doctree):
    """Tell the footer where the PDF is: only on the HTML site, and only when `make pdf` has made it."""
    context["offloadlab_pdf"] = PDF.name if app.builder.name == "html" and PDF.exists() else ""


def ship_the_pdf(app):
    if app.builder.name == "html" and PDF.exists():
        app.config.html_extra_path.append(str(PDF))


def setup(app):
    # myst-nb draws folded cells (the labs' answers, tag hide-input) for the html builder only;
    # the single-page build that `make pdf` prints uses the same HTML for them.
    from myst_nb.sphinx_ import HideCodeCellNode, depart_HideCellInput, visit_HideCellInput

    app.add_node(HideCodeCellNode, override=True, html=(visit_HideCellInput, depart_HideCellInput),
                 singlehtml=(visit_HideCellInput, depart_HideCellInput))
    app.connect("builder-inited", ship_the_pdf)
    app.connect("env-get-updated", number_exercises_per_page, priority=900)  # after Sphinx numbers them
    app.connect("doctree-resolved", alt_text_from_captions)
    if hide_solutions:
        app.connect("doctree-read", stub_lab_answers)
    app.connect("html-page-context", link_the_pdf)
    app.connect("html-page-context", publish_notebook_download, priority=502 if REPOSITORY_URL else 500)
