"""Routes the twentieth probe pass, and the nineteenth's leftovers, found to a passing check."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from offloadlab import experiment, probe
from offloadlab import planner
from offloadlab_course.guard import screen

LABS = Path(__file__).resolve().parent.parent / "labs"
# The names lab 2's, 3's and 6's own cells bind that their checks read an expected value from.
LAB_NAMES = {"check", "cross", "record", "report"}


def _crossover():
    overlaps = [
        experiment.OverlapResult(1000, compute, 0.02, 0.021 if compute > 0.02 else 0.03, "emulated")
        for compute in (0.01, 0.04)
    ]
    return experiment.CrossoverResult(1000, [1, 4], overlaps, 0.01, "emulated")


def _run(cell: str, namespace: dict) -> None:
    """An answer cell the screen lets through, run as the kernel would."""
    assert screen(cell, LAB_NAMES) == [], cell
    exec(cell, namespace)


def test_a_crossover_cannot_be_changed_through_an_alias():
    """``b = cross.batches; b.clear()`` emptied lab 3's crossover: an answer of None passed."""
    cross = _crossover()
    assert cross.measured_batch == 4
    with pytest.raises(AttributeError):
        _run("b = cross.batches\nb.clear()\nmeasured_batch = None", {"cross": cross})
    assert cross.measured_batch == 4 and isinstance(cross.results, tuple)


def test_a_crossover_cannot_be_changed_through_a_parameter():
    cross = _crossover()
    with pytest.raises(dataclasses.FrozenInstanceError):
        _run("def forget(c):\n    c.batches = []\nforget(cross)", {"cross": cross})
    with pytest.raises(dataclasses.FrozenInstanceError):
        _run("def stall(r):\n    r.t_both = 1.0\nstall(cross.results[1])", {"cross": cross})
    assert cross.measured_batch == 4


def test_a_measurement_cannot_be_changed_through_a_parameter():
    """``def f(r): r.value = my_bandwidth`` then ``f(record)`` passed lab 2's first check."""
    record = probe.Measurement("bandwidth", 2e10, "B/s", "measured", "copy")
    with pytest.raises(dataclasses.FrozenInstanceError):
        _run("def mine(r):\n    r.value = 1.0\nmine(record)", {"record": record})
    assert record.value == 2e10


def test_a_plan_report_cannot_be_changed_through_a_parameter():
    """``def f(r): r.chosen = …`` then ``f(report)`` made lab 6's predicted step any number."""
    work = planner.Workload(13e9, batch=1, seq=512)
    report = planner.plan(work, planner.Hardware("80 GB", "4 GB/s", host_memory="2 TB"))
    assert report.chosen.offload == "optimizer" and report.share is not None
    step = report.chosen.step
    with pytest.raises(dataclasses.FrozenInstanceError):
        _run("def pick(r):\n    r.chosen = r.runner_up\npick(report)", {"report": report})
    with pytest.raises(AttributeError):
        _run("w = report.warnings\nw.clear()", {"report": report})
    assert report.chosen.step == step


def test_no_check_reads_its_expected_value_from_an_item_of_a_container():
    """A function an answer defines owns its parameters, so ``def f(d): d["h2d"] = my_up`` then
    ``f(moved)`` rewrote lab 6's expected bytes: a check reads a number, a call's result or a
    read-only record's attribute, never an item of a dict or list the lab's cells bound."""
    import ast

    import jupytext

    found = []
    for path in sorted(LABS.glob("lab*.md")):
        for cell in jupytext.read(path).cells:
            if cell.cell_type != "code" or "check." not in cell.source:
                continue
            source = "\n".join(
                line for line in cell.source.splitlines() if not line.lstrip().startswith("%")
            )
            for node in ast.walk(ast.parse(source)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("answer", "exact")
                    and len(node.args) >= 3
                    and any(isinstance(n, ast.Subscript) for n in ast.walk(node.args[2]))
                ):
                    found.append(f"{path.name}: {ast.unparse(node.args[2])}")
    assert found == []


def test_a_check_not_checked_keeps_its_whole_name(monkeypatch, capsys):
    """The name was read back from the passing line up to its first colon: "a: b" lost ": b"."""
    from offloadlab_course import check, watch

    monkeypatch.setattr(watch, "why_not_checked", lambda: "not checked: an answer changed x")
    assert not check.answer("bytes: up", 1.0, 1.0) and not check.exact("pick: one", "a", "a")
    assert capsys.readouterr().out.splitlines() == [
        "✗ bytes: up: not checked: an answer changed x",
        "✗ pick: one: not checked: an answer changed x",
    ]


# A choice that is right, from a callback that changes what the checks rely on while the grader
# runs between its calls, and puts it back on its last call.
TRANSIENT = """
import fractions
from offloadlab.sharding import ring_bytes
from offloadlab_course import grading, watch
watch.remember()
kept, calls = fractions.Fraction.limit_denominator, []

def my_choose(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):
    calls.append(1)
    fractions.Fraction.limit_denominator = (
        kept if len(calls) == 12 else lambda self, *a: self
    )
    sent = ring_bytes("all-gather", tensor_bytes, ranks)
    link = max(down, up) if duplex == "full" else down + up
    return "shard" if sent / interconnect <= link / host_link else "offload"

outcome = grading.lab08_challenge(my_choose, 2**20, 4, 2**20, 2**20)
print(len(calls), watch.changed(), bool(outcome))
"""


def test_what_a_challenges_callback_changes_and_restores_is_seen():
    """Changed in one call and put back in the last, before the outcome, the watch saw nothing:
    the grader ran between the calls with the change in place."""
    done = subprocess.run(
        [sys.executable, "-c", TRANSIENT], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "12 [] False", done.stdout + done.stderr
    assert "not checked: an answer cell changed fractions.Fraction.limit_denominator" in (
        done.stdout
    )


STAND_IN = """
import os
from offloadlab_course import crashes, watch
watch.remember()
open("state.bin", "wb").close()
with crashes.record("state.bin"):
    recorder = os.fsync
    print(watch.changed())
    os.fsync = lambda fd: None  # an answer's, in place of the grader's recorder
    print(watch.changed())
    os.fsync = recorder
print(watch.changed())
"""


def test_the_graders_own_stand_ins_are_no_answers_change_but_what_replaces_them_is(tmp_path):
    """Lab 7's commit challenge records writes and flushes by putting its own ``os.fsync`` in
    place while the answer's commit runs: noted after each call, that was the answer's change."""
    done = subprocess.run(
        [sys.executable, "-c", STAND_IN], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.stdout.splitlines() == ["[]", "['os.fsync']", "[]"], done.stdout + done.stderr


def test_no_module_of_the_library_or_the_course_holds_a_table_an_answer_could_change():
    """``def f(s): s.add("numerator")`` then ``f(check.watch.CACHES)`` blinded the watch, and
    ``memory.RECIPES`` or ``budget.TRAFFIC`` handed to a function could rewrite what a check's
    expected value is computed from: their public tables are read-only."""
    import importlib
    import pkgutil

    import offloadlab
    import offloadlab_course

    changeable = []
    for package in (offloadlab, offloadlab_course):
        for found in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if found.name.endswith(("__main__", "_cpu_adam")):
                continue
            module = importlib.import_module(found.name)
            changeable += [
                f"{found.name}.{name}"
                for name, value in vars(module).items()
                if not name.startswith("_") and type(value) in (list, dict, set, bytearray)
            ]
    assert changeable == []


TIMED = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab_course import grading")
shell.run_cell("P = 10")
shell.run_cell("%%time\\nmy_x = 16 * P")
shell.run_cell("%time my_y = 4 * P")
shell.run_cell("print(grading.recomputed('my_x', P=20), grading.recomputed('my_y', P=20))")
"""


def test_a_timed_answer_is_recomputed_as_it_stands():
    """F6: under ``%%time`` the cell became a magic call, and the hidden test found no cell
    assigning the answer ("no cell assigns it"): an honest answer failed."""
    done = subprocess.run(
        [sys.executable, "-c", TIMED], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "320 80", done.stdout + done.stderr


KEPT = """
from offloadlab.memory import state_bytes
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab import memory\\nfrom offloadlab_course import grading")
shell.run_cell("P = 10\\nmy_tools = [memory.state_bytes]")
shell.run_cell("def my_f(p, f=memory.state_bytes):\\n    return f(p, 'fp32-adam').total_bytes")
shell.run_cell("my_x = my_tools[0](P, 'fp32-adam').total_bytes")
shell.run_cell("my_y = my_f(P)")
shell.run_cell("my_z = 16 * P")
for name in ("my_x", "my_y", "my_z"):
    try:
        print(grading.recomputed(name, P=20, refusing=[state_bytes]))
    except AssertionError as error:
        print("refused:", str(error).split(",")[0])
"""


def test_a_refused_function_is_refused_through_any_alias():
    """F2: kept in a list or as a default argument in an earlier cell, the function the hidden
    test refuses was out of its reach, and the copied expression passed."""
    code = KEPT.replace("grading.recomputed", "shell.user_ns['grading'].recomputed")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-3:] == [
        "refused: my_x: the answer calls memory.state_bytes",
        "refused: my_y: the answer calls memory.state_bytes",
        "320",
    ], done.stdout + done.stderr


@pytest.mark.parametrize(
    "argv, said",
    [
        (["probe", "--quick", "--reference", "r1", "--reference-dir", ""], "--reference-dir: "),
        (
            ["plan", "--params", "7e9", "--gpu-memory", "80GB", "--link", "25GB/s"]
            + ["--emit", "deepspeed", "--nvme-path", ""],
            "--nvme-path: ",
        ),
    ],
    ids=["reference-dir", "nvme-path"],
)
def test_an_empty_folder_name_is_a_usage_error(argv, said, tmp_path, monkeypatch, capsys):
    """F9, F10: an empty --reference-dir wrote the reference into the current folder
    (Path("") is "."), an empty --nvme-path was taken for none given."""
    from offloadlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"offloadlab: error: {said}")
    assert list(tmp_path.iterdir()) == []


def test_a_recipes_bytes_cannot_be_changed_through_a_parameter():
    """What memory.state_bytes, and so a check's expected value, reads from."""
    from offloadlab import memory

    with pytest.raises(TypeError):
        exec(
            "def mine(b):\n    b['weights'] = 0\nmine(r.bytes_per_param)",
            {"r": memory.RECIPES["fp32-adam"]},
        )
    assert memory.RECIPES["fp32-adam"].weight_bytes == 4


NESTED = """
from offloadlab.memory import state_bytes
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab_course import grading\\nfrom offloadlab.cpu_adam import threading")
shell.run_cell("from offloadlab.memory import state_bytes")
shell.run_cell("P = 10")
shell.run_cell("if P > 0:\\n    my_a = 16 * P")
shell.run_cell("for my_i in range(1):\\n    my_b = 16 * P")
shell.run_cell("print(my_c := 16 * P)")
shell.run_cell("my_box = []\\nmy_t = threading.Thread(target=lambda: my_box.append("
               "state_bytes(P, 'fp32-adam').total_bytes))\\nmy_t.start()\\nmy_t.join()\\n"
               "my_d = my_box[0]")
grading = shell.user_ns["grading"]
for name in ("my_a", "my_b", "my_c", "my_d"):
    try:
        print(grading.recomputed(name, P=20, refusing=[state_bytes]))
    except AssertionError as error:
        print("refused:", str(error).split(",")[0])
"""


def test_an_answer_assigned_in_a_block_is_recomputed_and_a_thread_is_no_way_around():
    """Twenty-first pass: an answer assigned inside ``if``/``for`` or by a walrus found "no cell
    assigns it"; the refused function called from a thread the answer started went through."""
    done = subprocess.run(
        [sys.executable, "-c", NESTED], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-4:] == [
        "320",
        "320",
        "320",
        "refused: my_d: the answer calls memory.state_bytes",
    ], done.stdout + done.stderr


ACROSS = """
from offloadlab.memory import state_bytes
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab_course import grading\\nfrom offloadlab.memory import state_bytes")
shell.run_cell("P = 10\\nmy_k = 16")
shell.run_cell("my_parts = [4 * P, 4 * P]")
shell.run_cell("my_parts.append(4 * P)")
shell.run_cell("my_parts += [4 * P]")
shell.run_cell("def my_weights():\\n    return 4 * P")
shell.run_cell("my_from_parts = sum(my_parts)")
shell.run_cell("my_sum = 0")
shell.run_cell("my_sum += 16 * P")
shell.run_cell("my_from_helper = 4 * my_weights()")
shell.run_cell("my_from_constant = my_k * P")
shell.run_cell("my_copied = state_bytes(P, 'fp32-adam').total_bytes")
shell.run_cell("my_from_copy = my_copied")
grading = shell.user_ns["grading"]
for name in ("my_from_parts", "my_sum", "my_from_helper", "my_from_constant", "my_from_copy"):
    try:
        print(grading.recomputed(name, P=20, refusing=[state_bytes]))
    except AssertionError as error:
        print("refused:", str(error).split(",")[0])
print(shell.user_ns["my_parts"], shell.user_ns["my_sum"], shell.user_ns["my_weights"]())
"""


def test_an_answer_built_across_cells_is_recomputed_with_the_cells_it_reads():
    """F7: the hidden test ran again only the cell that assigns the answer, so a list filled or
    a helper defined in an earlier cell kept the notebook's inputs and an honest answer failed;
    the cells it reads that depend on the inputs run again too, on copies."""
    done = subprocess.run(
        [sys.executable, "-c", ACROSS], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-6:] == [
        "320",
        "320",
        "320",
        "320",
        "refused: my_from_copy: the answer calls memory.state_bytes",
        "[40, 40, 40, 40] 160 40",
    ], done.stdout + done.stderr


OUT_OF_SIGHT = """
import sys
from offloadlab.memory import state_bytes
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab_course import grading\\nfrom offloadlab.memory import state_bytes")
shell.run_cell("import sys\\nimport threading\\nP = 10")
shell.run_cell("my_a = [sys.setprofile(None), state_bytes(P, 'fp32-adam').total_bytes][1]")
shell.run_cell("my_b = len([grading][0].untimed('')) + 16 * P")
grading = shell.user_ns["grading"]


def ask(name):
    try:
        print(grading.recomputed(name, P=20, refusing=[state_bytes]))
    except AssertionError as error:
        print("refused:", str(error).split(";")[0])


ask("my_a")
ask("my_b")
shell.run_cell(
    "if 'my_box' not in dir():\\n"
    "    my_box = [None, None, threading.Event(), threading.Event()]\\n"
    "    def my_serve(box):\\n"
    "        while True:\\n"
    "            box[2].wait(); box[2].clear(); box[1] = box[0](); box[3].set()\\n"
    "    threading.Thread(target=my_serve, args=(my_box,), daemon=True).start()\\n"
    "my_box[0] = lambda: state_bytes(P, 'fp32-adam').total_bytes\\n"
    "my_box[2].set(); my_box[3].wait(); my_box[3].clear()\\n"
    "my_c = my_box[1]"
)
ask("my_c")
print(sys.getprofile())
"""


def test_a_refused_call_cannot_be_made_out_of_the_graders_sight():
    """Twenty-second pass F1, F2: ``sys.setprofile(None)`` (reached through pickle) switched the
    notes off; a thread started on the answer's first run called the refused function for the
    recompute; ``[grading][0].f(…)`` asked the course for the answer past the bare-name test."""
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_SIGHT], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-4:] == [
        "refused: my_a: the answer switched off the grader's notes of its calls",
        "refused: my_b: the answer asks the course's checks instead of computing it",
        "refused: my_c: a thread the answer started is still running",
        "None",
    ], done.stdout + done.stderr
