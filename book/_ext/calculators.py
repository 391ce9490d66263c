"""Live calculators: the package's own estimates, run in the reader's browser by Pyodide.

A chapter asks for a calculator with an ordinary admonition of class ``calculator`` whose text
names the command it stands for, pre-filled with the book's running example::

    :::{admonition} Try it with your numbers
    :class: calculator

    The cell above reads the running example. For your own link, window and offload,
    `offloadlab budget --link "32 GB/s" --window "250 ms" --params 10e9 --offload optimizer`
    prints the verdict; on the book's website, the form here runs that command in your browser.
    :::

JupyterLab and the PDF show that note as it is. On the HTML site this extension adds, inside
the note, a form with one field per flag of the command. Nothing loads until the reader asks
("Try it with your numbers"): then the page fetches Pyodide's core (CPython for WebAssembly,
served from the site's _static) and an archive of the package's estimates layer, taken from the
checkout being built, and runs ``offloadlab <command>`` in the browser, through the command line's
own argument parsing. The answer is the command's own text; its ``--json`` is shown beside it, and
a bad field gets the command's exit-2 message under it. No figure is computed in JavaScript.

The build refuses (fails) when the estimates layer stops being portable: every module of it
imports, at module level, only the standard library and other modules of the layer. Inside a
function a module may import an optional library named in ``OPTIONAL_IMPORTS`` (the calculators
never reach those functions); anything else fails the build, saying where. And before any page is
written, every note's example runs from the archive alone, by a Python without site-packages:
whatever the command imports on a calculator's path must be in the archive.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import html
import io
import json
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from docutils import nodes
from sphinx.errors import ExtensionError

BOOK = Path(__file__).resolve().parent.parent
PACKAGE = BOOK.parent / "offloadlab"
PYODIDE = BOOK / "_static" / "pyodide"
PYODIDE_FILES = ("pyodide.js", "pyodide.asm.js", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
RUNTIME = Path(__file__).resolve().parent / "calculator_runtime.py"  # runs the command inside Pyodide
ARCHIVE = "calculators/offloadlab.zip"  # under the site's _static
WORKER = "pyodide-cache.js"  # the service worker, at the site's root (its template beside this file)

# The estimates layer and the base under it (design.md's table of layers): pure arithmetic on the
# standard library. Each name is a module or a sub-package of offloadlab, walked whole.
ESTIMATES_LAYER = ("units", "files", "cores", "memory", "overlap", "budget", "planner", "sharding", "architectures",
                   "model_count", "engines")
# Data the layer reads, folders of offloadlab shipped with it: the shipped model configs.
LAYER_DATA = ("model_configs",)
# The command line, which the calculators run: its module-level imports must be portable too (its
# probe and bench commands import the measurement layer inside their handlers, and are not offered).
FACE = ("cli",)
# Libraries a module of the layer may import inside a function, never at module level: optional
# extras of a host with them installed, never on a calculator's path (Pyodide has neither).
OPTIONAL_IMPORTS = {
    "torch": "memory.measure_state counts the bytes of a live torch model",
    "transformers": "an exact parameter count on the meta device, where transformers is installed",
    "huggingface_hub": "the error transformers raises for a config field of the wrong type",
}


# --- The estimates layer: which files, and whether they stay portable ------------------------------

def layer_files(package: Path = PACKAGE) -> dict[str, Path]:
    """The files the calculators ship, by their path in the archive (``offloadlab/budget.py``):
    the package's ``__init__``, every module of the estimates layer and of each of its sub-packages,
    the layer's data folders, and the command line."""
    found = {"offloadlab/__init__.py": package / "__init__.py"}
    for name in ESTIMATES_LAYER + FACE + LAYER_DATA:
        module, folder = package / f"{name}.py", package / name
        if module.is_file():
            found[f"offloadlab/{name}.py"] = module
        elif folder.is_dir():
            for path in sorted(folder.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so"):
                    found[f"offloadlab/{path.relative_to(package).as_posix()}"] = path
        elif name in ESTIMATES_LAYER + FACE:
            raise ExtensionError(f"calculators: the estimates layer names offloadlab.{name}, which {package} lacks")
    return found


def _pyodide_leaves_out(lock_file: Path = PYODIDE / "pyodide-lock.json") -> set[str]:
    """Standard-library modules that Pyodide ships as separate packages (ssl, sqlite3, lzma, …),
    which its core — all the calculators load — lacks; read from the lock file served."""
    if not lock_file.exists():
        return set()
    packages = json.loads(lock_file.read_text(encoding="utf-8"))["packages"].values()
    return {name for p in packages if p.get("package_type") == "cpython_module" for name in p["imports"]}


def _imports(tree: ast.Module, module: str):
    """(absolute module name, line, inside a function) for each import in ``tree``, relative ones
    resolved against ``module`` (``offloadlab.planner.fit``), ``importlib.import_module("x")`` too.
    Imports under ``if TYPE_CHECKING:`` never run, and are left out."""
    package = module.rsplit(".", 1)[0]

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        return f"{base}.{node.module}" if node.module else base

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, inside
            elif isinstance(child, ast.ImportFrom):
                origin = absolute(child)
                yield origin, child.lineno, inside
                if origin == "offloadlab":  # from . import memory, units: each is a module
                    for alias in child.names:
                        yield f"offloadlab.{alias.name}", child.lineno, inside
            elif (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                  and getattr(child.func, "attr", getattr(child.func, "id", None)) in ("import_module", "__import__")
                  and child.args and isinstance(child.args[0], ast.Constant) and isinstance(child.args[0].value, str)):
                yield child.args[0].value, child.lineno, inside
            yield from visit(child, inside)

    yield from visit(tree, False)


def portability_problems(package: Path = PACKAGE) -> list[str]:
    """Where the shipped modules import what Pyodide's core cannot give them; [] when none does.

    Allowed: the standard library (less what Pyodide leaves out), ``offloadlab`` itself and the
    modules of the layer. Inside a function, also the ``OPTIONAL_IMPORTS``. The command line's
    own imports inside functions are its handlers' business (the calculators run four of them).
    """
    missing_in_pyodide = _pyodide_leaves_out()
    layer = set(ESTIMATES_LAYER)
    problems = []
    for name, path in layer_files(package).items():
        if path.suffix != ".py":
            continue
        module = name.removesuffix(".py").replace("/", ".")  # offloadlab.planner.__init__: its package
        face = module.split(".")[1] in FACE
        for imported, line, in_function in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), module):
            top = imported.split(".")[0]
            if top == "__future__" or (top in sys.stdlib_module_names and top not in missing_in_pyodide):
                continue
            if imported == "offloadlab" or (top == "offloadlab" and imported.split(".")[1] in layer):
                continue
            if in_function and (face or top in OPTIONAL_IMPORTS):
                continue
            where = "inside a function" if in_function else "at module level"
            why = (" (Pyodide's core leaves it out)" if top in missing_in_pyodide else
                   f" (optional imports such as {', '.join(OPTIONAL_IMPORTS)} go inside the function that needs "
                   f"them)" if top in OPTIONAL_IMPORTS else "")
            problems.append(f"offloadlab/{path.relative_to(package).as_posix()}:{line}: imports {imported} {where}, "
                            f"which is neither the standard library nor the estimates layer{why}")
    return problems


def module_archive(package: Path = PACKAGE) -> bytes:
    """A zip of the shipped files and the runtime, the same bytes for the same checkout."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        entries = {**layer_files(package), "calculator_runtime.py": RUNTIME}
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, entries[name].read_bytes())
    return buffer.getvalue()


# --- The forms ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """One input of a calculator: a flag of the command, what the form calls it, and its widget."""

    flag: str
    label: str
    widget: str = "text"        # text, select (from ``choices``) or config (a pasted config.json)
    source: bool = False        # one of the model's sources in ``plan``: exactly one is given


def _recipes() -> list[str]:
    from offloadlab import memory

    return list(memory.RECIPES)


def _shipped_models() -> list[str]:
    from offloadlab import architectures

    return architectures.shipped()


FORMS: dict[str, tuple[Field, ...]] = {
    "state": (Field("--params", "Parameters"), Field("--recipe", "Recipe", "select")),
    "overlap": (Field("--link", "Link, one direction"), Field("--compute", "GPU compute, sustained FLOP/s"),
                Field("--bytes", "Bytes one way, per step"), Field("--window", "Compute window")),
    "budget": (Field("--link", "Link, one direction"), Field("--window", "Compute window"),
               Field("--params", "Parameters"), Field("--offload", "Offload"), Field("--duplex", "Duplex"),
               Field("--recipe", "Recipe", "select")),
    "plan": (Field("--model", "Model", source=True), Field("--model-config", "config.json", "config", source=True),
             Field("--params", "Parameters", source=True), Field("--gpu-memory", "GPU memory"),
             Field("--link", "Host link, one direction"), Field("--host-memory", "Host memory"),
             Field("--gpus-per-node", "GPUs in the node"), Field("--interconnect", "GPU to GPU, one direction"),
             Field("--compute", "GPU compute, sustained FLOP/s"), Field("--batch", "Micro-batch"),
             Field("--seq", "Sequence length"), Field("--cpu-adam", "CPU Adam, parameters/s")),
}
SUGGESTIONS = {"--duplex": lambda: ["full", "half"], "--model": _shipped_models,
               "--offload": lambda: ["optimizer", "optimizer,gradients", "optimizer,gradients,parameters"]}
CHOICES = {"--recipe": _recipes}
SOURCE_NAMES = {"--model": "a shipped model", "--model-config": "a config.json", "--params": "a parameter count"}


def _help(command: str) -> dict[str, tuple[str, bool, object]]:
    """Each flag of ``offloadlab <command>``: (its --help text, required, default), from the CLI's parser."""
    from offloadlab import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # argparse keeps them here
    return {a.option_strings[0]: (a.help or "", a.required, a.default) for a in sub._actions if a.option_strings}


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    from offloadlab import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


def parse_command(text: str) -> tuple[str, dict[str, str]]:
    """(command, {flag: value}) from a note's ``offloadlab <command> --flag value …``; ValueError
    for a command without a calculator, a flag its form lacks, or arguments the CLI refuses."""
    words = shlex.split(text)
    if len(words) < 2 or words[0] != "offloadlab" or words[1] not in FORMS:
        raise ValueError(f"expected `offloadlab {'|'.join(FORMS)} …`; got {text!r}")
    command, rest = words[1], words[2:]
    fields = {f.flag for f in FORMS[command]}
    values: dict[str, str] = {}
    for flag, value in zip(rest[::2], rest[1::2]):
        if flag not in fields:
            raise ValueError(f"{flag}: the {command} calculator has no such field (it has {', '.join(sorted(fields))})")
        values[flag] = value
    if len(rest) % 2:
        raise ValueError(f"expected a value after each flag; got {text!r}")
    status, _, err = _run_cli([command, *rest])
    if status != 0:
        raise ValueError(f"the command line refuses it: {err.strip()}")
    return command, values


class calculator_form(nodes.General, nodes.Element):
    """A calculator's form inside its note, drawn on the HTML site only."""


def _attributes(**pairs) -> str:
    """HTML attributes from keywords (data_flag → data-flag); True gives a bare one, None or False none."""
    return " ".join(key.replace("_", "-") if value is True else
                    f'{key.replace("_", "-")}="{html.escape(str(value), quote=True)}"'
                    for key, value in pairs.items() if value is not None and value is not False)


def _widget(field: Field, value: str, default, values: dict[str, str], **common) -> str:
    """The input of one field: a select, a text area for a pasted config.json, or a line of text."""
    if field.widget == "select":
        chosen = value or str(default)
        options = "".join(f'<option{" selected" if c == chosen else ""}>{html.escape(c)}</option>'
                          for c in CHOICES[field.flag]())
        return f"<select {_attributes(**common)}>{options}</select>"
    if field.widget == "config":  # starts as the shipped config of the chosen model, to edit
        text = _shipped_config(values.get("--model"))
        attributes = _attributes(**common, rows=8, spellcheck="false",
                                 placeholder="paste a Hugging Face config.json here")
        return f"<textarea {attributes}>{html.escape(text)}</textarea>"
    suggestions = SUGGESTIONS.get(field.flag)
    listing = f"{common['id']}-suggestions" if suggestions else None
    attributes = _attributes(**common, value=value, list=listing,
                             placeholder=None if default in (None, False) else f"default {default}",
                             spellcheck="false", autocomplete="off", autocapitalize="off")
    if not suggestions:
        return f"<input {attributes}>"
    options = "".join(f'<option value="{html.escape(s)}">' for s in suggestions())
    return f'<input {attributes}><datalist id="{listing}">{options}</datalist>'


def form_html(command: str, values: dict[str, str], prefix: str, archive: str) -> str:
    """The form of ``offloadlab <command>`` pre-filled with ``values``; ids start with ``prefix``.
    Each field is labelled, with the flag's own --help under it and a place for its error."""
    helps = _help(command)
    fields = FORMS[command]
    sources = [f.flag for f in fields if f.source]
    chosen = next((flag for flag in sources if flag in values), sources[0] if sources else None)
    out = [f'<form class="calculator-form" {_attributes(data_command=command, data_archive=archive)} novalidate>',
           '<div class="calculator-fields">']
    if sources:
        options = "".join(f'<option value="{flag}"{" selected" if flag == chosen else ""}>'
                          f"{html.escape(SOURCE_NAMES[flag])} ({flag})</option>" for flag in sources)
        out.append(f'<div class="calculator-field"><label for="{prefix}-source">The model, from</label>'
                   f'<select id="{prefix}-source" class="calculator-source">{options}</select></div>')
    for field in fields:
        help_text, required, default = helps[field.flag]
        ident = f"{prefix}{field.flag[1:]}"
        hidden = field.source and field.flag != chosen
        widget = _widget(field, values.get(field.flag, ""), default, values, id=ident, name=field.flag[2:],
                         data_flag=field.flag, data_required="1" if required else None,
                         aria_describedby=f"{ident}-hint {ident}-error", disabled=hidden)
        out.append(f'<div class="calculator-field{" calculator-wide" if field.widget == "config" else ""}"'
                   f'{" hidden" if hidden else ""} data-field="{field.flag}">'
                   f'<label for="{ident}">{html.escape(field.label)}</label>{widget}'
                   f'<small id="{ident}-hint" class="calculator-hint"><code>{field.flag}</code>: '
                   f"{html.escape(help_text)}</small>"
                   f'<p id="{ident}-error" class="calculator-error" hidden></p></div>')
    out += ["</div>",
            '<p class="calculator-controls"><button type="submit" class="calculator-go">Try it with your numbers'
            '</button> <button type="reset" class="calculator-reset">Back to the book\'s example</button> '
            '<progress class="calculator-progress" max="3" hidden></progress> '
            '<span class="calculator-status" role="status"></span></p>',
            '<p class="calculator-error calculator-form-error" role="alert" hidden></p>',
            '<div class="calculator-result" aria-live="polite" hidden>',
            '<p class="calculator-said">The package\'s own code, run in your browser, as '
            '<code class="calculator-command"></code> prints it:</p>',
            '<pre class="calculator-answer"></pre>',
            '<details class="calculator-details"><summary>The same, as <code>--json</code> prints it</summary>'
            '<pre class="calculator-json"></pre></details>',
            "</div></form>"]
    return "\n".join(out)


def _shipped_config(model: str | None) -> str:
    """The text of a shipped model's config.json; empty for none."""
    path = PACKAGE / "model_configs" / f"{model}.json"
    return path.read_text(encoding="utf-8") if model and path.is_file() else ""


# --- Sphinx ------------------------------------------------------------------------------------------

def _command_of(note: nodes.Element) -> str | None:
    for literal in note.findall(nodes.literal):
        if literal.astext().startswith("offloadlab "):
            return literal.astext()
    return None


def read_calculators(app, doctree):
    """Check each calculator note's command as the CLI would, and remember it on the note and in
    the environment: {page: (the digest it was read with, [(command, values), …])}."""
    examples = []
    for note in doctree.findall(nodes.admonition):
        if "calculator" not in note["classes"]:
            continue
        where = f"{app.env.doc2path(app.env.docname)}:{note.line or '?'}"
        text = _command_of(note)
        if text is None:
            raise ExtensionError(f"{where}: a calculator note names its command: `offloadlab {'|'.join(FORMS)} …`")
        try:
            command, values = parse_command(text)
        except ValueError as error:
            raise ExtensionError(f"{where}: calculator: {error}") from None
        note["calculator_command"] = command
        note["calculator_values"] = json.dumps(values)
        examples.append((command, values))
    pages = {k: v for k, v in getattr(app.env, "calculator_docs", {}).items() if k != app.env.docname}
    if examples:
        pages[app.env.docname] = (getattr(app, "calculator_digest", None), examples)
    app.env.calculator_docs = pages


def rewrite_when_the_calculators_change(app, env, added, changed, removed):
    """Pages whose forms are stale, to read again: the package, its command's help or this
    extension changed since they were read (their notebooks' outputs come from the execution cache)."""
    digest = getattr(app, "calculator_digest", None)
    pages = getattr(env, "calculator_docs", {})
    return sorted(name for name, (seen, _) in pages.items() if digest is not None and seen != digest
                  and name not in removed)


def forget_the_page(app, env, docname):
    env.calculator_docs = {k: v for k, v in getattr(env, "calculator_docs", {}).items() if k != docname}


def merge_the_pages(app, env, docnames, other):
    theirs = getattr(other, "calculator_docs", {})
    env.calculator_docs = {**getattr(env, "calculator_docs", {}), **{k: theirs[k] for k in docnames if k in theirs}}


def run_alone(archive: bytes, examples: list[tuple[str, dict[str, str]]]) -> list[dict]:
    """Each example's answer from the archive alone, unpacked and run by a Python without
    site-packages (no torch, numpy or transformers, as in Pyodide): a module the archive lacks, or
    an import it cannot satisfy, fails there as it would in the browser."""
    script = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport calculator_runtime\n"
              "for command, fields in json.loads(sys.stdin.read()):\n"
              "    print(calculator_runtime.calculate(command, json.dumps(fields)))\n")
    cases = [(command, [[flag, value, True] for flag, value in values.items()]) for command, values in examples]
    with tempfile.TemporaryDirectory() as folder:
        with zipfile.ZipFile(io.BytesIO(archive)) as unpacked:
            unpacked.extractall(folder)
        run = subprocess.run([sys.executable, "-I", "-S", "-c", script, folder], input=json.dumps(cases),
                             capture_output=True, text=True, cwd=folder)
    if run.returncode != 0:
        raise ExtensionError("calculators: the shipped modules fail on their own (as they would in the browser):\n"
                             + run.stderr[-3000:])
    return [json.loads(line) for line in run.stdout.splitlines()]


def check_the_examples_run_alone(app, env):
    """After reading, before writing: every note's example runs from the shipped archive alone."""
    if app.builder.name != "html":
        return []
    pages = getattr(env, "calculator_docs", {})
    examples = [example for name in sorted(pages) for example in pages[name][1]]
    for answer in run_alone(app.calculator_archive, examples):
        if answer["status"] != 0:
            raise ExtensionError(f"calculators: `{answer['command']}` fails from the shipped modules alone: "
                                 f"{answer['error']}")
    return []


def draw_calculators(app, doctree, docname):
    """On the HTML site, add each note's form (other builders keep the note as written)."""
    if app.builder.name != "html":
        return
    notes = [n for n in doctree.findall(nodes.admonition) if n.get("calculator_command")]
    for index, note in enumerate(notes, 1):
        form = calculator_form()
        form["command"] = note["calculator_command"]
        form["values"] = json.loads(note["calculator_values"])
        form["prefix"] = f"calc{index}"
        note["classes"].append("calculator-live")
        note += form


def visit_calculator_form(self, node):
    archive = f"{Path(ARCHIVE).name}?v={self.builder.app.calculator_digest}"  # beside the script
    self.body.append(form_html(node["command"], node["values"], node["prefix"], archive))
    raise nodes.SkipNode


def skip(self, node):
    raise nodes.SkipNode


def check_the_layer(app):
    """Before an HTML build: the layer stays portable, Pyodide is there, the archive is made."""
    if app.builder.name != "html":
        return
    package = Path(app.config.calculators_package)
    problems = portability_problems(package)
    if problems:
        raise ExtensionError("the estimates layer must stay portable (the calculators run it in Pyodide):\n  "
                             + "\n  ".join(problems))
    absent = [name for name in PYODIDE_FILES if not (PYODIDE / name).is_file()]
    if absent:
        raise ExtensionError(f"calculators: {PYODIDE.relative_to(BOOK.parent)} lacks {', '.join(absent)}: "
                             f"`make book` fetches Pyodide with npm (once; after that the build needs no network)")
    app.calculator_archive = module_archive(package)
    extension = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("calculator*.py")))
    app.calculator_digest = hashlib.sha256(app.calculator_archive + extension).hexdigest()[:16]


def load_on_calculator_pages(app, pagename, templatename, context, doctree):
    """Only a page with a calculator gets its script and style; Pyodide waits for a click."""
    if app.builder.name == "html" and doctree is not None and any(doctree.findall(calculator_form)):
        app.add_css_file("calculators/calculators.css")
        app.add_js_file("calculators/calculators.js", defer="defer")


def write_the_archive(app, exception):
    """The package's archive under _static, and at the site's root the service worker that keeps
    Pyodide's files for later pages (its cache named after the Pyodide shipped)."""
    if exception is None and app.builder.name == "html":
        target = Path(app.outdir) / "_static" / ARCHIVE
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(app.calculator_archive)
        here = Path(__file__).resolve().parent
        package = here.parent / "_static" / "pyodide" / "package.json"
        version = json.loads(package.read_text(encoding="utf-8"))["version"]
        worker = (here / WORKER).read_text(encoding="utf-8")
        (Path(app.outdir) / WORKER).write_text(worker.replace("@VERSION@", version), encoding="utf-8")


def setup(app):
    app.add_config_value("calculators_package", str(PACKAGE), "env")  # the offloadlab folder to ship
    app.add_node(calculator_form, html=(visit_calculator_form, None), latex=(skip, None), text=(skip, None),
                 man=(skip, None), texinfo=(skip, None))
    app.connect("builder-inited", check_the_layer)
    app.connect("doctree-read", read_calculators)
    app.connect("env-get-outdated", rewrite_when_the_calculators_change)
    app.connect("env-purge-doc", forget_the_page)
    app.connect("env-merge-info", merge_the_pages)
    app.connect("env-updated", check_the_examples_run_alone)
    app.connect("doctree-resolved", draw_calculators)
    app.connect("html-page-context", load_on_calculator_pages)
    app.connect("build-finished", write_the_archive)
    # env_version: a new one makes Sphinx read every page again (what the env keeps changed).
    return {"version": "1", "env_version": 3, "parallel_read_safe": True, "parallel_write_safe": True}
