"""Sphinx configuration for the offloadlab book: chapters in book/, labs through book/labs -> ../labs.

Every chapter and lab is a Jupytext MyST notebook that myst-nb executes during the build;
a cell that raises fails the build. The build needs no network.
"""

import functools
import os
import re
import shutil
import sys
from pathlib import Path

import yaml
from docutils import nodes

import offloadlab

BOOK = Path(__file__).resolve().parent
# The book as one PDF, written by `make pdf` (which `make book` runs first when Chromium is
# there); the site ships and links it when present, and says so when not.
PDF = Path(os.environ.get("OFFLOADLAB_PDF", BOOK / "_build" / "pdf" / "offloadlab.pdf"))

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

# Execute every notebook; a failing cell fails the build. The cache keeps rebuilds fast, and
# the student site reads the reader's: the code is the same, and the only outputs student mode
# changes, the graded checks' (which state the value expected), are left out of that site
# (fold_lab_answers_and_checks below).
#
# The cache knows a notebook only by its code; its figures also depend on what draws them: the
# kernel settings (SVG in the book's style: etc/ipython_kernel_config.py, installed by `make env`)
# and course/offloadlab_course/plots.py. A change to either starts a cache of its own instead of serving the
# old figures.
def figure_settings_key() -> str:
    import hashlib

    drawn_by = [BOOK.parent / "etc" / "ipython_kernel_config.py", BOOK.parent / "course" / "offloadlab_course" / "plots.py"]
    return hashlib.sha256(b"".join(path.read_bytes() for path in drawn_by)).hexdigest()[:10]


nb_execution_mode = "cache"
nb_execution_cache_path = str(BOOK / "_build" / f".jupyter_cache-{figure_settings_key()}")
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 900
nb_merge_streams = True
nb_render_markdown_format = "myst"  # Markdown outputs with tables, as the chapters print them

numfig = True
bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"
# Citations read "(Ren et al., 2021)", in round brackets, several parted by semicolons: as
# JupyterLab shows them (see lab_links_to_roles below).
bibtex_reference_style = "author_year_round"


def _register_round_brackets():
    """sphinxcontrib-bibtex's author-year style with round brackets (its own are square), the
    way its documentation shows a custom style is made."""
    from dataclasses import dataclass, field

    import sphinxcontrib.bibtex.plugin
    from sphinxcontrib.bibtex.style.referencing import BracketStyle
    from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle

    def round_brackets() -> BracketStyle:
        return BracketStyle(left="(", right=")", sep="; ")

    @dataclass
    class RoundAuthorYear(AuthorYearReferenceStyle):
        bracket_parenthetical: BracketStyle = field(default_factory=round_brackets)
        bracket_textual: BracketStyle = field(default_factory=round_brackets)
        bracket_author: BracketStyle = field(default_factory=round_brackets)
        bracket_label: BracketStyle = field(default_factory=round_brackets)
        bracket_year: BracketStyle = field(default_factory=round_brackets)

    sphinxcontrib.bibtex.plugin.register_plugin("sphinxcontrib.bibtex.style.referencing", bibtex_reference_style,
                                                RoundAuthorYear)


_register_round_brackets()

# Everything a page loads comes from the site itself: MathJax is vendored into _static by
# `make book` (see the Makefile), and no widget JavaScript is pulled from a CDN.
html_static_path = ["_static"]
html_css_files = ["offloadlab.css"]  # code scrolls sideways, never wraps; the print layout for `make pdf`
html_js_files = ["offloadlab.js"]    # the sidebar and page-contents buttons at every width
mathjax_path = "mathjax/tex-chtml.js"
nb_ipywidgets_js = {}

# Build-time settings for the reader's tools (empty means: no such button). Without a
# repository address the header has no "Repository" link, and the landing page's "How to use
# it" says the address was not given where it tells the reader to clone the repository.
REPOSITORY_URL = os.environ.get("OFFLOADLAB_REPOSITORY_URL", "")
html_theme = "sphinx_book_theme"
html_context = {"default_mode": "auto", "offloadlab_repository": REPOSITORY_URL}  # auto: the reader's OS decides
html_favicon = "_static/favicon.svg"
html_title = "offloadlab: training beyond GPU memory"
# The header carries the title, the one search box and the repository link; the sidebar only the
# chapters and labs (the theme would put a second title and a second search box there).
html_sidebars = {"**": ["sbt-sidebar-nav.html"]}
html_theme_options = {
    "logo": {"text": "offloadlab"},  # the header's title; the page title says the rest
    "navbar_start": ["navbar-logo"],
    "navbar_center": [],
    "navbar_persistent": ["search-button-field"],
    "navbar_end": ["offloadlab-repository.html"],
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


def repository_text(url: str = REPOSITORY_URL) -> str:
    """How the landing page names the repository: a link, or a plain statement that this copy
    of the site was built without its address (OFFLOADLAB_REPOSITORY_URL)."""
    if url:
        return f"[the repository]({url})"
    return ("the repository (this copy of the site was built without its address: ask whoever "
            "gave you the site, or set `OFFLOADLAB_REPOSITORY_URL` when you build it)")


myst_substitutions = {**citation(), "repository": repository_text()}


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

    from offloadlab_course.student import BEGIN, strip_solutions

    for block in doctree.findall(nodes.literal_block):
        text = block.astext()
        if any(line.strip() == BEGIN for line in text.splitlines()):
            stubbed = strip_solutions(text)
            block.rawsource = stubbed  # what the highlighter reads
            block.children = [nodes.Text(stubbed)]


def fold_lab_answers_and_checks(app, doctree):
    """A lab's worked answer folds under "Show the worked answer", not the theme's "Show code cell
    source"; its graded check's result (which states the value expected) folds under "Show the
    check" on the reader's site, and is left out of the student site, where it would say an
    answer agrees under the stub students see."""
    from offloadlab_course.student import BEGIN

    for cell in list(doctree.findall(nodes.container)):
        if cell.get("nb_element") != "cell_code":
            continue
        source = "".join(
            block.astext() for block in cell.findall(nodes.literal_block)
            if block.parent is not None and block.parent.get("nb_element") == "cell_code_source"
        )
        if any(line.strip() == BEGIN for line in source.splitlines()):
            if hide_solutions:  # the stub students get, in sight
                cell.attributes.pop("hide_mode", None)
            else:
                cell["prompt_show"] = "Show the worked answer"
                cell["prompt_hide"] = "Hide the worked answer"
        elif "points" in cell.get("cell_metadata", {}):
            outputs = [c for c in cell.children if c.get("nb_element") == "cell_code_output"]
            if hide_solutions:
                for output in outputs:
                    cell.remove(output)
            elif outputs:
                cell["hide_mode"] = "output"
                cell["prompt_show"], cell["prompt_hide"] = "Show the check", "Hide the check"


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
    """Offer the PDF on the HTML site when `make pdf` has made it: in the footer, and in the
    download menu beside the page's .ipynb and .md (the theme's own ".pdf" prints one page)."""
    shipped = app.builder.name == "html" and PDF.exists()
    context["offloadlab_pdf"] = PDF.name if shipped else ""
    context["offloadlab_pdf_missing"] = app.builder.name == "html" and not shipped
    if not shipped:
        return
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            for button in group["buttons"]:
                if button.get("label") == "download-pdf-button":
                    button.update(text="print page", tooltip="Print this page")
            group["buttons"].append({"type": "link", "url": context["pathto"](PDF.name, 1), "text": "book .pdf",
                                     "tooltip": "The whole book as one PDF", "icon": "fas fa-book",
                                     "label": "download-book-pdf-button"})


def ship_the_pdf(app):
    if app.builder.name == "html" and PDF.exists():
        app.config.html_extra_path.append(str(PDF))


# How tools/lab_references.py writes citations and references to other chapters, so that
# JupyterLab (jupyterlab-myst, one notebook at a time, no bibliography) shows their text:
#   [(Ren et al., 2021)](cite:ren2021zerooffload)
#   [2. The memory-tier ladder](../02_memory_tier_ladder.md#ch-ladder)
# Before MyST reads a page, Sphinx gets the roles back: {cite:p}, which sphinxcontrib-bibtex
# renders and lists, and {ref}, which resolves the label wherever it is (a file link would not
# cross the book/labs symlink: Sphinx resolves it to labs/, outside the source folder).
CITE_LINK = re.compile(r"\[\([^\]]*\)\]\(cite:([^()\s]+)\)")
LABEL_LINK = re.compile(r"\[([^\]`<>]+)\]\((?:[\w.-]+/)*[\w.-]+\.md#([\w-]+)\)")


# A link to a glossary entry, written as Lab opens it: [pinned memory](glossary.md#term-pinned-memory)
GLOSSARY_LINK = re.compile(r"\[([^\]`<>]+)\]\((?:[\w.-]+/)*glossary\.md#term-([\w-]+)\)")


@functools.cache
def glossary_terms(path: Path = BOOK / "glossary.md") -> dict[str, str]:
    """{anchor: term} for each entry of the glossary ("term-pinned-memory": "pinned memory")."""
    block = path.read_text(encoding="utf-8").split("```{glossary}", 1)[1].split("```", 1)[0]
    terms = [line.strip() for line in block.splitlines() if line.strip() and not line[0].isspace()]
    return {re.sub(r"[^a-z0-9]+", "-", term.lower()).strip("-"): term for term in terms}


def lab_links_to_roles(app, docname, source):
    """Turn the Lab-readable citation, glossary and reference links of a page back into Sphinx
    roles (a glossary link whose entry does not exist is left to fail as a reference)."""
    terms = glossary_terms()
    text = CITE_LINK.sub(lambda m: f"{{cite:p}}`{m[1]}`", source[0])
    text = GLOSSARY_LINK.sub(
        lambda m: f"{{term}}`{m[1]} <{terms[m[2]]}>`" if m[2] in terms else m[0], text
    )
    source[0] = LABEL_LINK.sub(lambda m: f"{{ref}}`{m[1]} <{m[2]}>`", text)


def draw_single_page_as_html(app):
    """The single-page build that `make pdf` prints draws every node as the html builder does.

    Sphinx gives a builder the node handlers registered under its own name and falls back to
    those of its format (html) only when there are none: once any extension registers one for
    singlehtml, every node registered for html alone (myst-nb's folded cells, sphinx-design's
    dropdowns) is unknown there and the build stops. Each html handler the single-page build
    lacks is lent to it.
    """
    if app.builder.name == "singlehtml":
        handlers = app.registry.translation_handlers
        for node, visitors in handlers.get("html", {}).items():
            handlers.setdefault("singlehtml", {}).setdefault(node, visitors)


def note_the_readers_traces(app):
    """Executing the chapters writes their Chrome traces beside them (*.trace.json, as a reader's
    run does); those this build adds are removed when it finishes, so that a build leaves none in
    Lab's file browser. A trace that was there before is the reader's: it stays."""
    app.offloadlab_traces = set(BOOK.glob("*.trace.json"))


def remove_the_builds_traces(app, exception):
    for trace in set(BOOK.glob("*.trace.json")) - app.offloadlab_traces:
        trace.unlink(missing_ok=True)


def setup(app):
    app.connect("builder-inited", note_the_readers_traces)
    app.connect("build-finished", remove_the_builds_traces)
    app.connect("source-read", lab_links_to_roles)
    app.connect("builder-inited", draw_single_page_as_html)
    app.connect("builder-inited", ship_the_pdf)
    app.connect("env-get-updated", number_exercises_per_page, priority=900)  # after Sphinx numbers them
    app.connect("doctree-resolved", alt_text_from_captions)
    if hide_solutions:
        app.connect("doctree-read", stub_lab_answers)
    app.connect("doctree-read", fold_lab_answers_and_checks, priority=400)  # before the stubs
    app.connect("html-page-context", link_the_pdf, priority=510)  # after the theme's download menu (501)
    app.connect("html-page-context", publish_notebook_download, priority=502 if REPOSITORY_URL else 500)
