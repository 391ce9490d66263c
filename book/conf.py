"""Sphinx configuration for the offloadlab book: chapters in book/, labs through book/labs -> ../labs.

Every chapter and lab is a Jupytext MyST notebook that myst-nb executes during the build;
a cell that raises fails the build. The build needs no network.
"""

from pathlib import Path

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

numfig = True
bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"

html_theme = "sphinx_book_theme"
html_title = "offloadlab: training beyond GPU memory"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
}
