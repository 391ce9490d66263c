"""Routes the twentieth probe pass, and the nineteenth's leftovers, found to a passing check."""

import dataclasses
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
