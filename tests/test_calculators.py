"""The live calculators (book/_ext/calculators.py): the package's own command, run by Pyodide in the
reader's browser, gives the command line's answer; the estimates layer stays portable; the site
stays offline and light.

The browser tests fill each chapter's form with several inputs — the running example, edge cases
and bad input — and compare what the page shows with `offloadlab <command>` run here on the same
arguments: the text, the --json output and the exit-2 message, under the field it names.
"""

import functools
import http.server
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from offloadlab import overlap
from tests.conftest import ROOT
from tests.test_site import BROWSER_ARGS, CHROMIUM, SCREENSHOTS

sys.path.insert(0, str(ROOT / "book" / "_ext"))
import calculators  # noqa: E402  (the book's extension, from book/_ext)

CHAPTERS = {
    "01_memory_wall": "state",
    "03_overlap_condition": "overlap",
    "04_bandwidth_budget": "budget",
    "05_what_to_offload": "plan",
    "09b_beyond_one_gpu": "plan",
}
SITE_BUDGET_BYTES = 15e6  # what the calculators may add to the site: 15 MB (decimal)


def offloadlab(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "offloadlab", *argv], capture_output=True, text=True, cwd=cwd
    )


# --- T* and the overlap command
# ----------------------------------------------------------------------


def test_crossover_tokens_is_r_over_3b_and_the_model_size_cancels():
    assert overlap.crossover_tokens(200e12, "25 GB/s") == pytest.approx(
        200e12 / (3 * 25e9), rel=1e-15
    )
    assert overlap.crossover_tokens(200e12, 25e9, flops_per_param_token=4) == 4000
    # Against the condition itself, for models of any size: 2 B per parameter each way, a window of
    # T tokens × 6P/R. From ⌈T*⌉ tokens the copy hides; one token fewer, it stalls.
    for params in (1e9, 10e9, 70e9, 405e9):
        for rate, link in ((200e12, 25e9), (400e12, 50e9), (82e12, 12e9)):
            whole = -(-overlap.crossover_tokens(rate, link) // 1)
            assert overlap.stage(2 * params, link, whole * 6 * params / rate).hidden
            assert not overlap.stage(2 * params, link, (whole - 1) * 6 * params / rate).hidden
    with pytest.raises(ValueError, match=r"^bandwidth: .*'25 GB'"):
        overlap.crossover_tokens(200e12, "25 GB")
    with pytest.raises(ValueError, match=r"^flops: expected a positive number"):
        overlap.crossover_tokens(0, "25 GB/s")


def test_the_overlap_command_states_the_condition_and_the_crossover():
    done = offloadlab(
        "overlap",
        "--link",
        "25 GB/s",
        "--compute",
        "200e12",
        "--bytes",
        "20 GB",
        "--window",
        "250 ms",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (
        round(result["crossover_tokens"]) == 2667
        and result["crossover_tokens_backward_only"] == 4000
    )
    assert (result["transfer_s"], result["hidden"], result["stall_s"]) == (
        0.8,
        False,
        pytest.approx(0.55),
    )
    text = offloadlab(
        "overlap",
        "--link",
        "32 GB/s",
        "--compute",
        "200e12",
        "--bytes",
        "8 GB",
        "--window",
        "250 ms",
    )
    # ⌈2083.3⌉
    assert "compute-bound (transfer hidden)" in text.stdout and "from 2,084 with" in text.stdout
    assert "R/(2B) = 200 TFLOP/s ÷ (2 × 32 GB/s): from 3,125 tokens" in text.stdout  # backward
    alone = json.loads(
        offloadlab("overlap", "--link", "25 GB/s", "--compute", "200e12", "--json").stdout
    )
    assert alone["hidden"] is None and alone["bytes"] is None
    refused = offloadlab("overlap", "--link", "25 GB/s", "--compute", "200e12", "--bytes", "8 GB")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--bytes and --window together" in refused.stderr


# --- The estimates layer stays portable
# --------------------------------------------------------------


def test_the_estimates_layer_imports_only_the_standard_library_and_itself():
    assert calculators.portability_problems() == []
    shipped = calculators.layer_files()
    # each walked, whether a module or a package
    for module in calculators.ESTIMATES_LAYER + calculators.FACE:
        assert any(
            name == f"offloadlab/{module}.py" or name.startswith(f"offloadlab/{module}/")
            for name in shipped
        )
    assert any(name.startswith("offloadlab/model_configs/") for name in shipped)
    assert not any(
        name.startswith(("offloadlab/link", "offloadlab/probe", "offloadlab/offload/"))
        for name in shipped
    )


def test_the_shipped_layer_is_the_reading_pages_estimates_and_base():
    """Two lists name the layer (the extension's, and the "Reading the package" page's): they
    agree."""
    from tests.test_reading_the_package import PAGE_NAMESPACE

    page = [
        module
        for layer, members in PAGE_NAMESPACE["LAYERS"].items()
        if layer.startswith(("estimates:", "base:"))
        for module in members
    ]
    assert sorted(page) == sorted(calculators.ESTIMATES_LAYER)
    assert calculators.FACE == ("cli",) and "cli" in next(
        m for layer, m in PAGE_NAMESPACE["LAYERS"].items() if layer.startswith("face:")
    )


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the package's shipped files, to break."""
    copy = tmp_path / "offloadlab"
    for name, path in calculators.layer_files().items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return copy


@pytest.mark.parametrize(
    "line, found",
    [
        ("import numpy", "imports numpy at module level"),
        ("from .link import open_link", "imports offloadlab.link at module level"),
        ("from . import probe", "imports offloadlab.probe at module level"),
        ("import torch", "imports torch at module level"),
        ("import sqlite3", "Pyodide's core leaves it out"),
        ("def exact():\n    import numpy", "imports numpy inside a function"),
        (
            "def exact():\n    import importlib\n    return importlib.import_module('numpy')",
            "imports numpy inside a function",
        ),
    ],
)
def test_a_module_that_stops_being_portable_is_named(package_copy, line, found):
    budget = package_copy / "budget.py"
    budget.write_text(budget.read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    problems = calculators.portability_problems(package_copy)
    assert (
        len(problems) == 1
        and problems[0].startswith("offloadlab/budget.py:")
        and found in problems[0]
    ), problems


def test_optional_imports_inside_functions_and_sub_packages(package_copy):
    # Allowed: an optional library inside a function, a typing-only import; the planner, a
    # package, is walked whole, so a module added to it is checked too.
    planner = package_copy / "planner"
    assert (planner / "__init__.py").exists()
    (planner / "meta.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import architectures\nfrom . import fit\n"
        "if TYPE_CHECKING:\n    import torch\n\n"
        "def count(config):\n    try:\n        import transformers\n    except ImportError:\n      "
        "  return None\n",
        encoding="utf-8",
    )
    (planner / "fit.py").write_text("from ..units import parse_size\n", encoding="utf-8")
    assert calculators.portability_problems(package_copy) == []
    assert "offloadlab/planner/meta.py" in calculators.layer_files(package_copy)
    (planner / "fit.py").write_text("import numpy\n", encoding="utf-8")
    assert calculators.portability_problems(package_copy) == [
        "offloadlab/planner/fit.py:1: imports numpy at module level, which is neither the standard "
        "library nor the estimates layer"
    ]


def small_book(folder: Path, package: Path | None = None, note: str | None = None) -> Path:
    """A one-page Sphinx project with one calculator note, built with the book's extension."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
        f"extensions = ['myst_parser', 'calculators']\nmyst_enable_extensions = ['colon_fence']\n"
        f"html_static_path = [{str(ROOT / 'book' / '_static')!r}]\n"
        + (f"calculators_package = {str(package)!r}\n" if package else ""),
        encoding="utf-8",
    )
    (folder / "index.md").write_text(
        "# A page\n\n:::{admonition} Try it with your numbers\n:class: calculator\n\n"
        + (
            note
            or 'The cell above computes it; `offloadlab budget --link "32 GB/s" --window "250 ms"` '
            "prints it."
        )
        + "\n:::\n",
        encoding="utf-8",
    )
    return folder


def sphinx(source: Path, builder: str, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", builder, str(source), str(target)],
        capture_output=True,
        text=True,
    )


def test_the_site_build_fails_when_the_layer_stops_being_portable(tmp_path, package_copy):
    memory = package_copy / "memory.py"
    memory.write_text("import numpy\n" + memory.read_text(encoding="utf-8"), encoding="utf-8")
    built = sphinx(small_book(tmp_path / "book", package_copy), "html", tmp_path / "html")
    assert built.returncode != 0
    assert "offloadlab/memory.py:1: imports numpy at module level" in built.stderr


def test_a_note_whose_command_the_cli_refuses_fails_the_build(tmp_path):
    note = 'Run `offloadlab budget --link "32 GB" --window "250 ms"`.'
    built = sphinx(small_book(tmp_path / "book", note=note), "html", tmp_path / "html")
    assert (
        built.returncode != 0
        and "--link: expected a rate with its unit" in built.stderr
        and "index.md" in built.stderr
    )


def test_the_pdf_and_other_builds_keep_the_note_without_a_form(tmp_path):
    source = small_book(tmp_path / "book")
    built = sphinx(source, "singlehtml", tmp_path / "single")
    assert built.returncode == 0, built.stderr
    page = (tmp_path / "single" / "index.html").read_text(encoding="utf-8")
    words = " ".join(re.sub(r"<[^>]+>", "", page).split())
    assert (
        "Try it with your numbers" in words
        and "offloadlab budget --link &quot;32 GB/s&quot;" in words
    )
    assert "calculator-form" not in page and "calculators.js" not in page
    text = sphinx(source, "text", tmp_path / "text")
    assert text.returncode == 0, text.stderr
    plain = " ".join((tmp_path / "text" / "index.txt").read_text(encoding="utf-8").split())
    assert 'offloadlab budget --link "32 GB/s"' in plain


def test_the_shipped_files_run_with_nothing_but_the_standard_library():
    """The archive the site serves, unpacked and run by a Python without site-packages (so without
    torch, numpy or transformers), answers as the installed command does; the build runs each
    note's example this way."""
    examples = [
        ("state", {"--params": "10e9", "--recipe": "mixed-adam"}),
        (
            "budget",
            {
                "--link": "32 GB/s",
                "--window": "250 ms",
                "--params": "10e9",
                "--offload": "optimizer",
                "--duplex": "half",
            },
        ),
        ("overlap", {"--link": "25 GB/s", "--compute": "200e12"}),
        (
            "plan",
            {
                "--model": "llama-3.1-70b",
                "--gpu-memory": "80 GB",
                "--link": "25 GB/s",
                "--gpus-per-node": "8",
            },
        ),
    ]
    for (command, values), answer in zip(
        examples, calculators.run_alone(calculators.module_archive(), examples)
    ):
        argv = [command] + [word for pair in values.items() for word in pair]
        assert answer["status"] == 0, answer
        assert json.loads(answer["json"]) == json.loads(offloadlab(*argv, "--json").stdout)
        assert answer["text"] == offloadlab(*argv).stdout


def test_a_module_the_archive_lacks_fails_the_build():
    """A module outside the archive that the command imports on a calculator's path (here: the
    planner, left out) fails the build before any page is written, as it would fail in the
    browser."""
    archive = zipfile.ZipFile(io.BytesIO(calculators.module_archive()))
    kept = {
        name: archive.read(name)
        for name in archive.namelist()
        if not name.startswith("offloadlab/planner/")
    }
    stripped = io.BytesIO()
    with zipfile.ZipFile(stripped, "w") as target:
        for name, data in kept.items():
            target.writestr(name, data)
    with pytest.raises(calculators.ExtensionError, match="fail on their own"):
        calculators.run_alone(
            stripped.getvalue(),
            [("plan", {"--params": "10e9", "--gpu-memory": "80 GB", "--link": "25 GB/s"})],
        )
    assert (
        calculators.run_alone(stripped.getvalue(), [("state", {"--params": "10e9"})])[0]["status"]
        == 0
    )


def test_each_calculator_chapter_has_one_note_lab_can_read():
    """One note per chapter, an admonition JupyterLab's MyST renders, naming a command the CLI
    accepts."""
    for chapter, command in CHAPTERS.items():
        text = (ROOT / "book" / f"{chapter}.md").read_text(encoding="utf-8")
        assert text.count(":class: calculator") == 1, chapter
        note = text.split(":class: calculator", 1)[1].split(":::", 1)[0]
        assert (
            text.split(":class: calculator", 1)[0]
            .rstrip()
            .endswith(":::{admonition} Try it with your numbers")
        )
        literal = next(part for part in note.split("`")[1::2] if part.startswith("offloadlab "))
        assert calculators.parse_command(literal)[0] == command


# --- In the browser
# ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_site(built_site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(built_site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def launch(playwright, *extra_args):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return playwright.chromium.launch(
        executable_path=CHROMIUM, args=BROWSER_ARGS + list(extra_args)
    )


@pytest.fixture(scope="module")
def playwright():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright):
    browser = launch(playwright)
    yield browser
    browser.close()


class Calculator:
    """A chapter's calculator in a page: fill its fields, ask, read what it shows."""

    def __init__(self, page, form):
        self.page, self.form = page, form

    def fill(self, **values):
        """``link="32 GB/s"``, ``model_config=text``; ``source="--model"`` picks the model's
        source."""
        if "source" in values:
            self.form.locator(".calculator-source").select_option(values.pop("source"))
        for name, value in values.items():
            field = self.form.locator(f"[data-flag='--{name.replace('_', '-')}']")
            if field.evaluate("e => e.tagName") == "SELECT":
                field.select_option(value)
            else:
                field.fill(value)

    def reset(self, timeout=120_000):
        """Back to the book's example: once Python runs, the page answers it again, with no
        message left from before (it once kept the old error and computed nothing)."""
        runs = int(self.form.get_attribute("data-runs") or 0)
        self.form.locator(".calculator-reset").click()
        if runs:
            self.page.wait_for_function(
                "([form, runs]) => Number(form.dataset.runs || 0) > runs",
                arg=[self.form.element_handle(), runs],
                timeout=timeout,
            )
            assert self.status == "0" and self.errors() == {}, self.errors()
            assert self.form.locator(".calculator-status").text_content() == ""
        return self

    def ask(self, timeout=120_000):
        runs = int(self.form.get_attribute("data-runs") or 0)
        self.form.locator(".calculator-go").click()
        self.page.wait_for_function(
            "([form, runs]) => Number(form.dataset.runs || 0) > runs",
            arg=[self.form.element_handle(), runs],
            timeout=timeout,
        )
        return self

    @property
    def status(self) -> str:
        return self.form.get_attribute("data-status")

    @property
    def answer(self) -> dict:
        return {
            "text": self.form.locator(".calculator-answer").text_content(),
            "json": json.loads(self.form.locator(".calculator-json").text_content()),
            "command": self.form.locator(".calculator-command").text_content(),
        }

    def errors(self) -> dict[str, str]:
        """{field's flag or "form": message} for every message shown."""
        shown = {}
        for message in self.form.locator(".calculator-error:not([hidden])").all():
            box = message.locator("xpath=ancestor::div[@data-field][1]")
            shown[box.get_attribute("data-field") if box.count() else "form"] = (
                message.text_content()
            )
        return shown

    def argv(self) -> list[str]:
        """The command line the page ran, as it shows it."""
        words = shlex.split(self.form.locator(".calculator-command").text_content())
        assert words[0] == "offloadlab"
        return words[1:]


def open_calculator(browser, served_site, chapter, **context):
    page = browser.new_page(viewport={"width": 1280, "height": 900}, **context)
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.route(
        "**/*",
        lambda route: (
            route.continue_() if route.request.url.startswith(served_site) else route.abort()
        ),
    )
    page.goto(f"{served_site}/{chapter}.html", wait_until="networkidle")
    forms = page.locator("form.calculator-form")
    assert forms.count() == 1, chapter
    return page, Calculator(page, forms.first), requests


def same_as_the_command(calculator, case, tmp_path):
    """What the page shows is what `offloadlab …` prints here, run as the page shows it in the
    kit's own environment (transformers installed, which Pyodide lacks): the text and --json, or
    the exit-2 line, under the field it names."""
    argv = calculator.argv()
    # (flag, value) as the command reads them: a value starting with '-' is joined to its flag
    pairs, words = [], argv[1:]
    while words:
        word = words.pop(0)
        pairs.append(tuple(word.split("=", 1)) if "=" in word else (word, words.pop(0)))
    flags = [flag for flag, _ in pairs]
    for name, value in case.items():  # the page ran what was filled in
        flag = f"--{name.replace('_', '-')}"
        if name not in ("source", "model_config") and value.strip():
            assert (flag, value) in pairs, (flag, value, argv)
        if name != "source" and not value.strip():
            assert flag not in flags or flag in ("--link", "--window", "--params", "--compute")
    if "model_config" in case:
        (tmp_path / "config.json").write_text(case["model_config"], encoding="utf-8")
    done = offloadlab(*argv, cwd=tmp_path)
    if done.returncode == 0:
        assert calculator.status == "0", calculator.errors()
        shown = calculator.answer
        assert shown["text"] == done.stdout
        assert shown["json"] == json.loads(offloadlab(*argv, "--json", cwd=tmp_path).stdout)
        assert calculator.errors() == {}
        return
    assert done.returncode == 2 and calculator.status == "2", done.stderr
    line = done.stderr.strip()
    assert "\n" not in line
    named = [flag for flag in re.findall(r"--[a-z][a-z-]*", line) if flag in flags]
    start = re.match(r"offloadlab: error: (?:offloadlab [a-z]+: )?([a-z_]+): ", line)
    if not named and start and f"--{start.group(1).replace('_', '-')}" in flags:
        named = [f"--{start.group(1).replace('_', '-')}"]
    assert calculator.errors() == {named[0] if named else "form": line}
    # the status line points at the message: under its field (above) or the form's (below)
    where = "above, under its field" if named else "below"
    status = calculator.form.locator(".calculator-status").text_content()
    assert status == f"Not computed: see the message {where}.", status


CONFIG_GPT2 = (ROOT / "offloadlab" / "model_configs" / "gpt2.json").read_text(encoding="utf-8")
# a family once refused on the page and planned by the command (through transformers)
CONFIG_PYTHIA = (ROOT / "offloadlab" / "model_configs" / "pythia-1.4b.json").read_text(
    encoding="utf-8"
)

CASES = {
    "01_memory_wall": [
        # the running example: 10 B, mixed-adam
        {},
        # one parameter: a fraction of a byte of scales
        {"params": "1", "recipe": "adam-8bit"},
        # the largest count the command takes
        {"params": "1e15", "recipe": "fp32-adam"},
        {"params": "10 B"},
        {"params": "1.5"},
        {"params": "-5e9"},  # refused: passed as --params=-5e9, so the number is what is refused
        {"params": ""},  # refused
    ],
    "03_overlap_condition": [
        {},  # the running example
        {"link": "32 GB/s", "bytes": "8 GB", "window": "250 ms"},  # exactly at the edge: hidden
        {"bytes": "", "window": ""},  # T* alone
        {"compute": "200 TFLOP/s"},
        {"bytes": "8 GB", "window": ""},  # refused
    ],
    "04_bandwidth_budget": [
        # the running example: 25 GB/s, 2,048 tokens
        {},
        {"link": "32 GB/s", "window": "250 ms", "duplex": "half"},  # the sources' reading: 5× over
        {"duplex": "half"},
        {"duplex": "20 GB/s"},
        {"params": "", "offload": ""},  # the budget alone
        {"offload": "optimizer,gradients,parameters", "recipe": "fp32-adam", "window": "4.9152 s"},
        # refused
        {"duplex": "40 GB/s"},
        {"offload": "optimizer,optimizer"},
        {"params": ""},
        {"window": "250"},
    ],
    "05_what_to_offload": [
        # the running example: 10 B on 80 GB, 2 TB
        {},
        {"params": "400e9"},  # nothing fits
        {"source": "--model", "model": "llama-3-8b", "gpu_memory": "24 GB", "seq": "4096"},
        {
            "source": "--model-config",
            "model_config": CONFIG_GPT2,
            "gpu_memory": "8 GB",
            "batch": "8",
        },
        {"source": "--model-config", "model_config": CONFIG_PYTHIA, "gpu_memory": "24 GB"},
        {"source": "--model-config", "model_config": "{not json"},  # refused, as for that file
        {"gpu_memory": "80 GB/s"},
        {"interconnect": "450 GB/s"},
        {"source": "--model", "model": "llama-9"},
    ],
    "09b_beyond_one_gpu": [
        {},  # Llama 3.1 70B on 8 × 80 GB
        {"host_memory": "1 TB"},
        {"gpus_per_node": "1", "interconnect": ""},
        {"gpus_per_node": "0"},  # refused
    ],
}


@pytest.mark.parametrize("chapter", list(CASES))
def test_each_calculator_answers_as_the_command_does(browser, served_site, chapter, tmp_path):
    page, calculator, requests = open_calculator(browser, served_site, chapter)
    try:
        for case in CASES[chapter]:
            calculator.reset()
            calculator.fill(**case)
            calculator.ask()
            same_as_the_command(calculator, case, tmp_path)
        elsewhere = [url for url in requests if not url.startswith(served_site)]
        assert not elsewhere, elsewhere
    finally:
        page.close()


def test_every_shipped_model_plans_on_the_page_as_the_command_plans_it(browser, served_site):
    """Chapter 5's calculator, for each model the package ships, gives the command's own text and
    JSON, as the command runs where transformers is installed (here, in-process)."""
    import contextlib

    from offloadlab import architectures, cli

    def command(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(list(argv)) == 0, argv
        return out.getvalue()

    page, calculator, _ = open_calculator(browser, served_site, "05_what_to_offload")
    differ = []
    try:
        calculator.fill(source="--model", gpu_memory="80 GB")
        for model in architectures.shipped():  # (only the model changes: no reset between)
            calculator.fill(model=model)
            calculator.ask()
            argv = calculator.argv()
            shown = calculator.answer
            if (shown["text"], shown["json"]) != (
                command(*argv),
                json.loads(command(*argv, "--json")),
            ):
                differ.append(model)
    finally:
        page.close()
    assert len(architectures.shipped()) >= 35 and not differ, differ


def test_on_a_phone_an_answer_shows_about_50_characters_a_line(browser, served_site):
    """A plan's lines run past 100 characters and scroll on a phone; 33 showed before."""
    page, calculator, _ = open_calculator(browser, served_site, "09b_beyond_one_gpu")
    try:
        page.set_viewport_size({"width": 390, "height": 844})
        calculator.ask()
        shown = calculator.form.locator(".calculator-answer").evaluate(
            """pre => { const probe = document.createElement("span");
                        probe.textContent = "0".repeat(100);
                        pre.append(probe);
                        const per = probe.getBoundingClientRect().width / 100;
                        probe.remove();
                        return pre.clientWidth / per; }"""
        )
        assert shown >= 45, shown
    finally:
        page.close()


def test_chapter_4_gives_the_running_example_and_the_sources_5x(browser, served_site):
    """Pre-filled with the chapter's canonical reading (25 GB/s each way, one 2,048-token step's
    backward, full duplex): 0.8 s, 1.95× the window. The sources' reading (32 GB/s, half duplex,
    250 ms): 1.25 s, 5× over."""
    page, calculator, requests = open_calculator(browser, served_site, "04_bandwidth_budget")
    try:
        # not before asked
        assert not [url for url in requests if "/pyodide/" in url or "offloadlab.zip" in url]
        started = time.monotonic()
        calculator.ask()
        loaded = time.monotonic() - started
        shown = calculator.answer
        assert shown["command"] == (
            "offloadlab budget --link '25 GB/s' --window '409.6 ms' --params 10e9 "
            "--offload optimizer --duplex full --recipe mixed-adam"
        )
        assert "20 GB up, 20 GB down → 800 ms on the link" in shown["text"]
        assert shown["json"]["transfer_s"] == 0.8 and round(shown["json"]["ratio"], 2) == 1.95
        calculator.fill(link="32 GB/s", window="250 ms", duplex="half")
        calculator.ask()
        sources = calculator.answer
        assert "20 GB up, 20 GB down → 1.25 s on the link" in sources["text"]
        assert "verdict: 5× over budget" in sources["text"]
        assert sources["json"]["transfer_s"] == 1.25 and sources["json"]["ratio"] == 5
        assert any(url.endswith("/_static/pyodide/pyodide.asm.wasm") for url in requests)
        assert all(url.startswith(served_site) for url in requests)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        calculator.form.screenshot(path=str(SCREENSHOTS / "04_calculator.png"))
        # A measurement for the closing note, not a bound: the first answer's wait in this browser.
        marks = page.evaluate(
            "() => Object.fromEntries(performance.getEntriesByType('mark')"
            ".filter(m => m.name.startsWith('calculators:')).map(m => [m.name, m.startTime]))"
        )
        python = marks["calculators:python-ready"] - marks["calculators:asked"]
        package = marks["calculators:package-ready"] - marks["calculators:python-ready"]
        (SCREENSHOTS / "calculator-first-load.txt").write_text(
            f"first answer {loaded:.2f} s after the click (Pyodide started in {python / 1e3:.2f} "
            f"s, the package unpacked and imported in {package / 1e3:.2f} s)\n",
            encoding="utf-8",
        )
    finally:
        page.close()


def test_a_failed_start_says_so_and_the_next_click_tries_again(browser, served_site):
    """The interpreter does not arrive (a dropped connection): one line says so, nothing hangs, and
    asking again starts it."""
    # without the service worker, whose own requests the page's routes do not see
    page, calculator, _ = open_calculator(
        browser, served_site, "01_memory_wall", service_workers="block"
    )
    try:
        page.route("**/pyodide.asm.wasm", lambda route: route.abort())
        calculator.ask()
        assert calculator.status == "failed"
        (message,) = calculator.errors().values()
        assert message.startswith("The calculator failed: ") and "\n" not in message
        assert calculator.form.locator(".calculator-go").is_enabled()
        page.unroute("**/pyodide.asm.wasm")
        calculator.ask()
        assert calculator.status == "0" and calculator.errors() == {}
        assert "160 GB" in calculator.answer["text"]
    finally:
        page.close()


def test_pyodide_is_fetched_once_a_visit_whatever_the_host_says_about_caching(browser, built_site):
    """Two calculator pages in one visit, from a host that forbids caching (no-store): the
    interpreter (8.6 MB of pyodide.asm.wasm) leaves the host once, not once a page."""
    fetched = []

    class NoStore(http.server.SimpleHTTPRequestHandler):
        def end_headers(self):
            self.send_header("Cache-Control", "no-store")
            super().end_headers()

        def do_GET(self):
            fetched.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(NoStore, directory=str(built_site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    context = browser.new_context()
    try:
        for chapter in ("01_memory_wall", "03_overlap_condition"):
            page = context.new_page()
            page.goto(
                f"http://127.0.0.1:{server.server_address[1]}/{chapter}.html",
                wait_until="networkidle",
            )
            calculator = Calculator(page, page.locator("form.calculator-form").first).ask()
            assert calculator.status == "0", calculator.errors()
            page.close()
    finally:
        context.close()
        server.shutdown()
    assert sum(path.endswith("/pyodide.asm.wasm") for path in fetched) == 1, fetched


def test_a_page_without_a_calculator_loads_none_of_it(browser, served_site):
    page = browser.new_page()
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(f"{served_site}/02_memory_tier_ladder.html", wait_until="networkidle")
        assert requests and not [
            url for url in requests if "/calculators/" in url or "/pyodide/" in url
        ]
    finally:
        page.close()


def test_without_webassembly_the_form_says_so_in_one_line(playwright, served_site):
    # V8 without its JIT offers no WebAssembly, as browsers in a locked-down mode do (Chromium 156
    # ignores --noexpose_wasm; --jitless takes WebAssembly away).
    browser = launch(playwright, "--js-flags=--jitless")
    try:
        page = browser.new_page()
        page.goto(f"{served_site}/04_bandwidth_budget.html", wait_until="networkidle")
        assert page.evaluate("() => typeof WebAssembly") == "undefined"
        form = page.locator("form.calculator-form")
        status = form.locator(".calculator-status").text_content()
        assert "WebAssembly" in status and "\n" not in status
        assert form.locator(".calculator-go").is_disabled()
    finally:
        browser.close()


def test_a_page_opened_from_disk_says_to_serve_the_site(browser, built_site):
    """Opened as file://, the page could not load Python ("Failed to fetch dynamically imported
    module") and said nothing of why: it now says how to serve the site, before any click."""
    page = browser.new_page()
    try:
        page.goto((built_site / "04_bandwidth_budget.html").as_uri(), wait_until="load")
        form = page.locator("form.calculator-form")
        status = form.locator(".calculator-status").text_content()
        assert "Opened from disk" in status and "python -m http.server" in status
        assert form.locator(".calculator-go").is_disabled()
    finally:
        page.close()


def test_the_calculators_add_at_most_15_mb_to_the_site(built_site):
    static = built_site / "_static"
    for name in calculators.PYODIDE_FILES:
        assert (static / "pyodide" / name).is_file(), name  # served from the site itself
    added = sum(
        p.stat().st_size
        for folder in ("pyodide", "calculators")
        for p in (static / folder).rglob("*")
        if p.is_file()
    )
    for chapter in CHAPTERS:
        form = re.search(
            r'<form class="calculator-form".*?</form>',
            (built_site / f"{chapter}.html").read_text(encoding="utf-8"),
            re.S,
        )
        assert form, chapter
        added += len(form.group(0).encode())
    assert added <= SITE_BUDGET_BYTES, f"{added / 1e6:.2f} MB"


# --- In JupyterLab
# -----------------------------------------------------------------------------------

# (lab_server: a fixture)
from tests.test_lab_server import (  # noqa: E402,F401
    lab_server,
    open_in_lab,
    scroll_to,
    scroll_until_shown,
)


def test_lab_hides_the_calculators_code(lab_server):  # noqa: F811
    names = {item["name"] for item in lab_server.request("/api/contents/")["content"]}
    assert "04_bandwidth_budget.md" in names and "_ext" not in names


def test_lab_shows_the_note_as_readable_text(lab_server, browser):  # noqa: F811
    """jupyterlab-myst draws the note as an admonition with its command, not as an unknown
    directive."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        open_in_lab(page, lab_server.base, "04_bandwidth_budget.md")
        notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        notes = notebook.locator(".jp-MarkdownCell aside", has_text="Try it with your numbers")
        # (scrolled to: Lab draws a cell once it comes into view; in idle time, on a busy
        # machine, not within a minute)
        assert scroll_until_shown(page, notes), "no admonition with the note's text"
        note = notes.first
        scroll_to(note)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        # Lab may draw a Markdown cell again while it settles: the page, not the element, is shot.
        page.screenshot(path=str(SCREENSHOTS / "04_calculator_in_jupyterlab.png"))
        # (its text as the page holds it: Lab may hide a cell it draws again, and a hidden
        # element has no inner text)
        text = " ".join(note.text_content().split())
        assert 'offloadlab budget --link "25 GB/s" --window "409.6 ms" --params 10e9' in text
        assert "above" in text and "Unknown" not in text and ":class:" not in text
    finally:
        page.close()
