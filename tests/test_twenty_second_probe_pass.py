"""Routes the twenty-second probe pass found: a lab's measurements changed through a
parameter, the package's prefetcher handed in as lab 5's, and the command lines' bad input."""

from pathlib import Path

import pytest

from offloadlab_course.guard import screen

LABS = Path(__file__).resolve().parent.parent / "labs"
LAB_NAMES = {"check", "lanes", "paths", "sharded"}


def _run(cell: str, namespace: dict) -> None:
    """An answer cell the screen lets through, run as the kernel would."""
    assert screen(cell, LAB_NAMES) == [], cell
    exec(cell, namespace)


def test_the_packages_prefetcher_is_no_answer_to_lab_5s_challenge():
    """Twenty-second pass F8: ``yield from Prefetcher(items, link, buffers=3)`` met the
    challenge's share and budget; the exercise is to build one."""
    from offloadlab.link import open_link
    from offloadlab.prefetch import Prefetcher
    from offloadlab_course import grading

    def borrowed(items, link):
        yield from Prefetcher(items, link, buffers=3)

    with open_link(emulated=True) as link:
        with pytest.raises(AssertionError, match="calls prefetch.Prefetcher"):
            grading.lab05_challenge(borrowed, link, items=4, work_seconds=0.005)


@pytest.mark.parametrize(
    "attack",
    [
        "def squash(d):\n    d['H2D'] = []\nsquash(lanes)",
        "import operator\noperator.setitem(lanes, 'H2D', [])",
        "def shift(lane):\n    lane[0] = (0.0, 9.0, '')\nshift(lanes['compute'])",
        "def zero(d):\n    d['all-gather'] = 0\nzero(sharded['tensor_bytes'])",
        "def forget(l):\n    l.clear()\nforget(paths)",
    ],
)
def test_a_labs_measurements_cannot_be_changed_through_a_parameter(attack):
    """Twenty-second pass: lab 6's ``lanes``, lab 7's ``paths`` and lab 8's ``sharded`` were a
    dict of lists, a list and a dict of dicts; changed through a function's parameter or
    ``operator.setitem``, a wrong answer passed the check that reads them."""
    from offloadlab_course.check import read_only

    namespace = {
        "lanes": read_only({"compute": [(0.0, 1.0, "")], "H2D": [(1.0, 2.0, "")]}),
        "sharded": read_only({"tensor_bytes": {"all-gather": 8}, "losses": [1.0]}),
        "paths": tuple(["a.bin", "b.bin"]),
    }
    before = {name: repr(value) for name, value in namespace.items()}
    with pytest.raises((TypeError, AttributeError)):
        _run(attack, namespace)
    assert {name: repr(namespace[name]) for name in before} == before


def test_labs_6_to_8_bind_their_measurements_read_only():
    """The labs' own cells, where the attacks above would reach."""
    bound = {
        "lab06_plan_your_run.md": ["lanes = check.read_only(lanes)"],
        "lab07_one_tier_further.md": ["paths = tuple("],
        "lab08_shard_or_offload.md": ["sharded = check.read_only(", "offloaded = check.read_only("],
    }
    for name, needles in bound.items():
        text = (LABS / name).read_text(encoding="utf-8")
        assert all(needle in text for needle in needles), name


@pytest.mark.parametrize(
    "argv, said",
    [
        (["labs", ""], "argument target_dir: expected a folder name; got ''"),
        (["", "out"], "argument labs_dir: expected a folder name; got ''"),
    ],
    ids=["target", "labs"],
)
def test_the_student_release_refuses_an_empty_folder_name(
    argv, said, tmp_path, monkeypatch, capsys
):
    """Twenty-second pass C-a, C-b: an empty target wrote the eight notebooks into the current
    folder and exited 0; an empty labs folder was reported as '.'."""
    from offloadlab_course.student import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_student_releases_os_errors_name_the_folder_without_an_errno(tmp_path, capsys):
    """C-d: a file where an assignment folder goes said '[Errno 17] File exists: …'."""
    from offloadlab_course.student import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "lab01").write_text("mine")
    assert main([str(LABS), str(tmp_path / "out"), "--nbgrader"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("offloadlab_course.student: error: target_dir: ") and "Errno" not in said
    assert (tmp_path / "out" / "lab01").read_text() == "mine"


def test_megaseconds_are_not_read_as_milliseconds():
    """C-f: '250 Ms' was 250 ms (units were matched in any case); 'MS', all capitals, stays
    milliseconds, as written in shouted tables."""
    from offloadlab.units import parse_duration

    assert parse_duration("250 ms") == parse_duration("250 MS") == 0.25
    with pytest.raises(ValueError, match="megaseconds"):
        parse_duration("250 Ms")


def test_an_nvme_path_naming_a_file_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """C-e: an existing regular file went into the DeepSpeed configuration as its NVMe folder."""
    from offloadlab.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "victim.txt").write_text("mine")
    argv = ["plan", "--params", "70e9", "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    argv += ["--host-memory", "100 GB", "--nvme", "3 GB/s", "--emit", "deepspeed"]
    assert main(argv + ["--nvme-path", "victim.txt"]) == 2
    assert "--nvme-path: expected a folder on the NVMe drive; 'victim.txt' is a file" in (
        capsys.readouterr().err
    )
    # twenty-third pass: a folder under a file, a dangling link, a name of blanks
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for given, said in (
        ("victim.txt/sub", "'victim.txt' is a file"),
        ("gone", "is a link to nothing"),
        (" ", "got an empty name"),
    ):
        assert main(argv + ["--nvme-path", given]) == 2, given
        assert said in capsys.readouterr().err
    assert main(argv + ["--nvme-path", "new/folder"]) == 0  # (made where the run starts)


def test_lab_2s_fit_check_takes_a_plain_least_squares_fit_of_noisy_points():
    """F10: under load, lab 2's worked answer (np.polyfit, unweighted) was once refused: the
    check compared it with the package's fit, which weighs each point by 1/t, at 15 %."""
    import re

    import jupytext
    import numpy as np

    from offloadlab import probe
    from offloadlab_course import check

    cells = [c.source for c in jupytext.read(LABS / "lab02_measure_your_link.md").cells]
    graded = next(c for c in cells if c.startswith("fit = probe.fit_alpha_beta(sizes, times)"))
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*", "", graded, flags=re.S)
    sizes = np.array([2**18, 2**20, 2**22, 2**24], dtype=float)
    times = 20e-6 + sizes / 2e9
    times[-1] *= 1.4  # one large transfer slowed by a busy host
    slope, _ = np.polyfit(sizes, times, 1)
    assert abs(1 / slope / probe.fit_alpha_beta(sizes, times).beta - 1) > 0.15  # they differ
    namespace = {"np": np, "probe": probe, "check": check, "sizes": sizes, "times": times}
    exec(visible, {**namespace, "my_beta": 1 / slope})
    with pytest.raises(AssertionError):
        exec(visible, {**namespace, "my_beta": 2e9 * 3})


RERUN = """
import sys, tempfile
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("from offloadlab_course import grading\\nimport os\\nP = 10")
shell.run_cell("again = grading.untimed('x') * P")  # a hidden test's name, bound by the course
shell.run_cell("again = 16 * P\\nmy_y = again")
shell.run_cell(f"my_file = os.path.join({tempfile.mkdtemp()!r}, 'state.bin')")
shell.run_cell("my_fd = os.open(my_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY) if P else None")
shell.run_cell("my_z = 16 * P + 0 * (my_fd is not None)")
grading = shell.user_ns["grading"]
for name in ("my_y", "my_z"):
    try:
        print(grading.recomputed(name, P=20))
    except Exception as error:
        print("refused:", type(error).__name__, error)
"""


def test_a_recompute_reruns_only_what_the_answer_reads_and_what_can_run_again():
    """Twenty-third pass R5, R6: a name the answer binds before it reads it (``again``) pulled in
    an earlier cell's binding of it (a hidden test's, which asks grading); a statement that
    cannot run twice (a file created exclusively) made the recompute fail."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", RERUN], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-2:] == ["320", "320"], done.stdout + done.stderr
