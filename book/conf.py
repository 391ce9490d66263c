"""Sphinx configuration for the offloadlab book: chapters in book/, labs through book/labs -> ../labs.

Every chapter and lab is a Jupytext MyST notebook that myst-nb executes during the build;
a cell that raises fails the build. The build needs no network.
"""

from pathlib import Path

import os
import shutil

import offloadlab

project = "offloadlab"
author = "the offloadlab authors"
copyright = "2026, the offloadlab authors"
release = offloadlab.__version__

extensions = [
    "myst_nb",
    "sphinx_design",
    "sphinx_exercise",
    "sphinxcontrib.bibtex",
]

root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "**/README.md", ".jupyter_cache"]

myst_enable_extensions = ["amsmath", "colon_fence", "deflist", "dollarmath", "substitution"]
myst_heading_anchors = 3

# Execute every notebook; a failing cell fails the build. The cache keeps rebuilds fast.
nb_execution_mode = "cache"
nb_execution_cache_path = str(Path(__file__).parent / "_build" / ".jupyter_cache")
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
    # Launch buttons need the repository; without one the theme must not be given any.
    "launch_buttons": {
        "notebook_interface": "jupyterlab",
        "jupyterhub_url": os.environ.get("OFFLOADLAB_JUPYTERHUB_URL", ""),
        "binderhub_url": os.environ.get("OFFLOADLAB_BINDERHUB_URL", "https://mybinder.org"),
        "colab_url": "https://colab.research.google.com",
    } if REPOSITORY_URL else {},
}

# One source, two builds: the reader's site shows solutions in collapsed dropdowns; the
# student site (OFFLOADLAB_STUDENT=1, `make book-student`) leaves them out.
hide_solutions = bool(os.environ.get("OFFLOADLAB_STUDENT"))


def publish_notebook_download(app, pagename, templatename, context, doctree):
    """Offer each executed chapter and lab as an .ipynb download beside its .md source.

    The theme does this itself only when launch buttons are configured; this runs just before
    its header buttons are built and does the same for every build.
    """
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if not executed.exists() or context.get("ipynb_source"):
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def setup(app):
    app.connect("html-page-context", publish_notebook_download, priority=502 if REPOSITORY_URL else 500)
