"""Findings of the seventeenth probe pass (issue 37), each with the test that failed before its
fix. The guard's (F1-F3) are in tests/test_guard.py's ATTACKS."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_student import _release

LAB = ROOT / "labs" / "lab01_account_for_every_byte.md"


@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_hidden_test_markers_with_words_after_them_stop_the_release(nbgrader, tmp_path):
    """F4: '### BEGIN HIDDEN TESTS  # grader only' (and its END alike) was neither stripped nor
    refused: the student release shipped the hidden tests, while nbgrader, which cuts any line
    holding a marker, stripped them, so the two releases differed."""
    lines = LAB.read_text(encoding="utf-8").splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.strip() == "### BEGIN HIDDEN TESTS")
    last = next(i for i in range(first, len(lines)) if lines[i].strip() == "### END HIDDEN TESTS")
    hidden = lines[first + 1].strip()
    lines[first] = "### BEGIN HIDDEN TESTS  # grader only\n"
    lines[last] = "### END HIDDEN TESTS  # grader only\n"
    done, released = _release(tmp_path, "".join(lines), nbgrader)
    assert done.returncode == 2 and "lab01_x.md: cell" in done.stderr, done.stderr
    assert "'BEGIN HIDDEN TESTS' outside a marker line" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not any(hidden in text for text in released)


MODEL_ANSWER = "The gradients. AdamW reads a parameter's gradient once"


@pytest.mark.parametrize(
    "form",
    ["four colons", "backticks", "question first"],
)
@pytest.mark.parametrize("nbgrader", [False, True], ids=["student", "nbgrader"])
def test_a_reflections_other_text_survives_the_release(form, nbgrader, tmp_path):
    """F5: a reflection cell fenced with four colons or backticks, or with its question before
    the dropdown, was replaced whole by the stub, with exit 0: the lab's own text after the
    answer, or its question, silently gone. Now only the folded answer is replaced."""
    text = LAB.read_text(encoding="utf-8")
    start = text.index('+++ {"points": 1}\n\n:::{dropdown} A model answer')
    end = text.index("\n:::\n", start) + len("\n:::\n")
    block = text[start:end]
    if form == "four colons":
        new = block.replace(":::{dropdown}", "::::{dropdown}").replace("\n:::\n", "\n::::\n")
        new += "\nOn your own: try it with three micro-batches.\n"
    elif form == "backticks":
        new = block.replace(":::{dropdown}", "```{dropdown}").replace("\n:::\n", "\n```\n")
        new += "\nOn your own: try it with three micro-batches.\n"
    else:
        new = block.replace(
            "\n\n:::{dropdown}", "\n\nWhich bytes come back, and why?\n\n:::{dropdown}"
        )
    text = text[:start] + new + text[end:]
    kept = "On your own: try it" if form != "question first" else "Which bytes come back, and why?"
    done, released = _release(tmp_path, text, nbgrader)
    assert done.returncode == 0, done.stderr
    cells = json.loads(released[0])["cells"]
    (kept_in,) = [c for c in cells if kept in "".join(c["source"])]
    (answered_in,) = [
        c
        for c in cells
        if "points" in str(c["metadata"].get("nbgrader", {}))
        and c["cell_type"] == "markdown"
        and "reflection" in str(c["metadata"])
    ]
    assert kept_in is not answered_in and MODEL_ANSWER not in "".join(kept_in["source"])
    # the release for students holds the stub; nbgrader's source the answer, which it strips
    shown = "".join(answered_in["source"])
    assert (MODEL_ANSWER in shown) if nbgrader else (shown == "YOUR ANSWER HERE"), shown


def test_plan_measured_on_a_pipe_nobody_writes_to_is_refused_not_waited_on(tmp_path):
    """F6: `plan --measured FIFO` with no writer blocked in open() forever (still waiting at
    130 s). It now reads the pipe as empty and says so; `<(cat probe.json)` still
    works, its writer being there from the start."""
    fifo = tmp_path / "probe.json"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "offloadlab", "plan", "--params", "7e9"]
    done = subprocess.run(
        command + ["--measured", str(fifo)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--measured" in done.stderr and "empty" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    recorded = tmp_path / "recorded.json"
    probe = subprocess.run(
        [sys.executable, "-m", "offloadlab", "probe", "--quick", "--json", str(recorded)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr
    through_a_pipe = subprocess.run(
        [
            "bash",
            "-c",
            '"$0" -m offloadlab plan --params 7e9 --gpu-memory "80 GB" --measured <(cat "$1")',
            sys.executable,
            str(recorded),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert through_a_pipe.returncode == 0, through_a_pipe.stderr


@pytest.mark.parametrize(
    "command, flag",
    [
        ("state --params 1e9 --recipe adam", "--recipe: expected one of"),
        (
            "plan --params 7e9 --gpu-memory 80GB --link 25GB/s --gpus-per-node 8 --gpus-per-link 9",
            "--gpus-per-link: expected a divisor",
        ),
        ("plan --params 7e9 --heads 3 --gpu-memory 80GB --link 25GB/s", "--layers: expected"),
        ("plan --params 7e9 --gpu-memory 80GB --link 25GB/s --nvme-path /tmp", "--nvme-path: give"),
    ],
    ids=["recipe", "gpus-per-link", "layers", "nvme-path without emit"],
)
def test_a_refused_argument_is_named_as_typed(command, flag):
    """F8, F12: errors named the package's keyword (`recipe:`, `gpus_per_link:`) where the user
    typed a flag; --nvme-path without --emit was ignored in silence."""
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", *command.split()], capture_output=True, text=True
    )
    assert done.returncode == 2 and flag in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_probe_names_the_disk_flag_and_a_too_long_reference_name_is_a_usage_error(tmp_path):
    """F9: `probe --disk /proc` did not name --disk; F10: a 300-character --reference name
    exited 1, as a fault of the machine, rather than 2."""
    command = [sys.executable, "-m", "offloadlab", "probe", "--quick"]
    disk = subprocess.run(command + ["--disk", "/proc"], capture_output=True, text=True)
    assert disk.returncode == 1 and "--disk: cannot create a scratch file" in disk.stderr
    name = subprocess.run(
        command
        + ["--disk", str(tmp_path), "--reference", "a" * 300, "--reference-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert name.returncode == 2 and "--reference: the name is too long" in name.stderr
    assert not any(tmp_path.iterdir())


def test_a_file_tier_says_when_a_tensor_is_not_contiguous(tmp_path):
    """F17: 'expected a contiguous host tensor of torch.float32; got torch.float32'."""
    import torch

    from offloadlab.nvme.tier import FileTier

    with FileTier(tmp_path / "state.bin", 16) as tier:
        with pytest.raises(ValueError, match="got a non-contiguous tensor"):
            tier.write(0, torch.zeros(4, 4).t()[0])


def test_an_int_subclass_is_checked_as_the_number_it_holds():
    """F7: `class I(int): __int__ = lambda s: 100`; `check.answer("x", I(5), 100)` agreed."""
    from offloadlab_course import check

    class Claims100(int):
        def __int__(self):
            return 100

    class ClaimsHalf(float):
        def __float__(self):
            return 100.0

    assert not check.answer("x", Claims100(5), 100)
    assert not check.answer("x", ClaimsHalf(0.5), 100)
    assert check.answer("x", Claims100(100), 100)


@pytest.mark.parametrize("url", ["javascript:alert(1)", "https://x.org/a b)c"])
def test_a_book_url_that_is_not_a_web_address_is_refused(url, tmp_path):
    """F15: --book-url was taken as given: 'javascript:alert(1)' became 26 links of the
    release, and a space or a bracket broke the Markdown of every link."""
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab_course.student", "labs", str(tmp_path / "out")]
        + ["--book-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--book-url" in done.stderr and "http" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_trace_file_gets_the_mode_open_gives_and_replaces_a_planted_link(tmp_path):
    """F16: write_chrome_trace made its file 0600 (mkstemp) where every other output of the kit
    is 0666 less the umask, and renamed over a link without saying whether it followed it."""
    from offloadlab import trace

    lanes = {"compute": [(0.0, 0.001, "a")]}
    umask = os.umask(0o022)
    os.umask(umask)
    written = trace.write_chrome_trace(lanes, tmp_path / "step.trace.json")
    assert written.stat().st_mode & 0o777 == 0o666 & ~umask
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("mine")
    (tmp_path / "planted.trace.json").symlink_to(elsewhere)
    trace.write_chrome_trace(lanes, tmp_path / "planted.trace.json")
    assert elsewhere.read_text() == "mine"
    assert not (tmp_path / "planted.trace.json").is_symlink()
    again = trace.write_chrome_trace(lanes, written)  # a cell run again: written anew
    assert again == written and json.loads(written.read_text())


def test_a_model_config_may_come_through_a_pipe(tmp_path):
    """F13: --model-config <(cat config.json) was refused with the list of shipped models
    (got '/dev/fd/63'), though --measured <(...) is read; a named pipe nobody writes to is
    refused in one line rather than waited on."""
    config = ROOT / "offloadlab" / "model_configs" / "bloom-560m.json"
    plan = '"$0" -m offloadlab plan --gpu-memory "80 GB" --link "25 GB/s" --model-config'
    piped = subprocess.run(
        ["bash", "-c", plan + ' <(cat "$1")', sys.executable, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert piped.returncode == 0, piped.stderr
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    silent = subprocess.run(
        ["bash", "-c", plan + ' "$1"', sys.executable, str(fifo)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert silent.returncode == 2 and "got nothing" in silent.stderr, silent.stderr


def test_probe_refuses_a_reference_that_is_its_json_file_before_measuring(tmp_path):
    """F11: --json D/x.json with --reference x --reference-dir D name one file: the whole
    measurement ran, then exited 1 ("appeared meanwhile"); bench refuses its like up front."""
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", "probe", "--quick", "--disk", str(tmp_path)]
        + ["--json", str(tmp_path / "x.json"), "--reference", "x"]
        + ["--reference-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2 and "--reference: names the --json file" in done.stderr
    assert "Traceback" not in done.stderr and not any(tmp_path.iterdir())
