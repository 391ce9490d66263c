"""tools/lab_footprint.py: what a lab costs a hub, measured; one line for a bad argument."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TOOL = ROOT / "tools" / "lab_footprint.py"


def run(*arguments):
    return subprocess.run(
        [sys.executable, str(TOOL), *arguments], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.parametrize(
    "arguments, line",
    [
        (["--labs", "lab99"], "--labs: expected some of lab01"),
        (["--threads", "0"], "--threads: expected a whole number ≥ 1; got 0"),
    ],
)
def test_a_bad_argument_gets_one_line_and_status_2(arguments, line, tmp_path):
    result = run(*arguments, "--out", str(tmp_path / "f.json"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and line in result.stderr
    assert not (tmp_path / "f.json").exists()


def test_an_existing_record_is_kept_without_force(tmp_path):
    kept = tmp_path / "f.json"
    kept.write_text("mine")
    result = run("--labs", "lab01", "--out", str(kept))
    assert result.returncode == 2 and "--force replaces it" in result.stderr
    assert kept.read_text() == "mine"


@pytest.mark.slow  # runs lab 1 in a kernel
def test_lab_one_is_measured_in_a_kernel_of_its_own(tmp_path):
    out = tmp_path / "f.json"
    result = run("--labs", "lab01", "--threads", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    lab = record["labs"]["lab01"]
    assert lab["peak_rss_bytes"] > 2**27  # a kernel that imported torch: over 128 MiB
    assert 0 < lab["cpu_seconds"] and 0 < lab["wall_seconds"]
    assert record["threads"] == 1 and record["machine"]["cpus"] >= 1


def test_the_shipped_record_covers_every_lab():
    from offloadlab_course.student import assignment_name, find_labs

    record = json.loads((ROOT / "course" / "lab-footprint.json").read_text())
    assert set(record["labs"]) == {assignment_name(p) for p in find_labs(ROOT / "labs")}
    assert record["command"].startswith("python tools/lab_footprint.py")
