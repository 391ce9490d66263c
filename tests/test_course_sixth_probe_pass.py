"""The course kit's findings of issue 37's sixth and seventh probe passes: each wrong result or
unclear message a user met, reproduced as they met it. Each test failed before its fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from offloadlab.models import GPTConfig
from offloadlab_course import capacity, check, grading, student
from offloadlab_course.limits import UserLimits
from tests.conftest import ROOT

TINY = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32)


def student_command(capsys, *arguments) -> tuple[int, list[str]]:
    status = student.main([str(argument) for argument in arguments])
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("labs", ["missing", "a file"])
def test_the_student_command_names_labs_dir_as_its_help_does(tmp_path, capsys, labs):
    """X21, X22: the error named source_dir, an argument the command does not have."""
    labs_dir = tmp_path / "labs"
    if labs == "a file":
        labs_dir.write_text("not a folder", encoding="utf-8")
    status, error = student_command(capsys, labs_dir, tmp_path / "out")
    assert status == 2 and len(error) == 1, error
    assert error[0].startswith("offloadlab_course.student: error: labs_dir: expected a folder")


@pytest.mark.parametrize("target", ["a file", "below a file"])
def test_the_student_command_says_target_dir_must_be_a_folder(tmp_path, capsys, target):
    """X23: a file as target_dir gave "[Errno 17] File exists: '/tmp/afile'"."""
    afile = tmp_path / "afile"
    afile.write_text("mine", encoding="utf-8")
    target_dir = afile if target == "a file" else afile / "out"
    status, error = student_command(capsys, ROOT / "labs", target_dir)
    assert status == 2 and len(error) == 1, error
    assert error[0].startswith("offloadlab_course.student: error: target_dir: expected a folder")
    assert str(afile) in error[0] and afile.read_text(encoding="utf-8") == "mine"


@pytest.mark.parametrize("rel_tol", [np.float32(0.05), np.float64(0.05)])
def test_a_numpy_tolerance_is_a_tolerance(rel_tol, capsys):
    """G7: rel_tol=np.float32(0.05) was refused as not "a fraction in [0, 1)"."""
    assert check.answer("x", 104, 100, rel_tol=rel_tol)
    assert not check.answer("x", 106, 100, rel_tol=rel_tol)
    with pytest.raises(ValueError, match=r"^rel_tol: expected a fraction in \[0, 1\)"):
        check.answer("x", 100, 100, rel_tol=np.float32("nan"))


@pytest.mark.parametrize(
    "copies, computes, name",
    [
        ([(0, math.inf)], [(0, 1)], "copies"),
        ([(0, 1)], [(-math.inf, 1)], "computes"),
        ([(0, 1)], [(0.5, math.nan)], "computes"),
    ],
)
def test_hidden_share_refuses_an_interval_without_a_finite_end(copies, computes, name):
    """G34: a copy that never ended hid a share of 0.0 (inf / inf arithmetic)."""
    with pytest.raises(ValueError, match=rf"^{name}: expected .*finite"):
        grading.hidden_share(copies, computes)


@pytest.mark.parametrize(
    "copies, computes, name",
    [
        (None, [], "copies"),
        ([(0, 1, 2)], [], "copies"),
        ([(0, 1)], [0, 1], "computes"),
        ([(0, 1)], [("0", "1")], "computes"),
        ([(True, 1)], [], "copies"),
    ],
)
def test_hidden_share_says_it_takes_start_end_pairs(copies, computes, name):
    """G35, G36: None gave "'NoneType' object is not iterable", a triple "too many values to
    unpack"; neither named the argument."""
    with pytest.raises(ValueError, match=rf"^{name}: expected \(start, end\) pairs"):
        grading.hidden_share(copies, computes)


@pytest.mark.parametrize(
    "computes",
    [[(0, 1), (0, 1)], [(0, 0.75), (0.25, 1)], [(0.25, 1), (0, 0.5)]],
    ids=["repeated", "overlapping", "unsorted"],
)
def test_hidden_share_counts_time_under_overlapping_computes_once(computes):
    """G38: a compute interval recorded twice hid the whole of a copy half under it (1.0, not
    0.5)."""
    assert grading.hidden_share([(0, 2)], computes) == 0.5
    assert grading.hidden_share([(np.float32(0), np.float64(2))], computes) == 0.5


@pytest.mark.parametrize("batch", [0, -3, True, 2.0, "2"])
def test_the_device_need_refuses_a_batch_that_is_not_one(batch):
    """G48, G49: batch=0 gave a need, batch=-3 torch's "negative dimension" error."""
    with pytest.raises(ValueError, match=r"^batch: expected a positive integer; got"):
        capacity.offloaded_need(TINY, batch)


def test_the_device_need_takes_a_numpy_batch():
    assert capacity.offloaded_need(TINY, np.int64(2)) == capacity.offloaded_need(TINY, 2)


@pytest.mark.parametrize(
    "memory_bytes, cpus, name",
    [("4G", 1, "memory_bytes"), (-1, 1, "memory_bytes"), (2**30, math.nan, "cpus")],
)
def test_user_limits_refuse_what_is_not_a_cap(tmp_path, memory_bytes, cpus, name):
    """G50, G51: '4G' gave "invalid literal for int()"; -1 bytes and nan cores were taken."""
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive number; got"):
        UserLimits(memory_bytes, cpus, root=tmp_path)


def test_user_limits_take_numpy_numbers_and_a_parsed_size(tmp_path):
    limits = UserLimits(np.int64(2**30), np.float32(1.5), root=tmp_path)
    assert (limits.memory_bytes, limits.cpus) == (2**30, 1.5)
    assert type(limits.memory_bytes) is int and type(limits.cpus) is float
    assert UserLimits(4.0 * 2**30, 2, root=tmp_path).memory_bytes == 4 * 2**30


# --- The seventh pass's


def test_hidden_share_names_an_end_beyond_any_float():
    """G11: hidden_share([(0, 10**400)], []) raised a bare OverflowError."""
    with pytest.raises(ValueError, match=r"^copies: expected \(start, end\) pairs of finite"):
        grading.hidden_share([(0, 10**400)], [])


def test_the_device_need_names_a_bad_config_or_bucket_size():
    """G35, G38: bucket_bytes=0 gave a result; config=None an AttributeError."""
    with pytest.raises(ValueError, match=r"^config: expected a GPTConfig; got NoneType"):
        capacity.offloaded_need(None, 2)
    with pytest.raises(ValueError, match=r"^bucket_bytes: expected a positive whole number"):
        capacity.offloaded_need(TINY, 2, bucket_bytes=0)
    assert capacity.offloaded_need(TINY, 2, bucket_bytes=np.int64(2**20)).total > 0


def test_user_limits_refuse_a_memory_cap_under_a_byte(tmp_path):
    """G41: UserLimits(0.5, 1) set a cap of 0 bytes."""
    with pytest.raises(ValueError, match=r"^memory_bytes: expected at least one byte"):
        UserLimits(0.5, 1, root=tmp_path)


# --- The eighth pass's


def test_a_small_numpy_bucket_size_does_not_overflow():
    """G15, G16: bucket_bytes=np.int16(30000) reported 24,464 bytes of buffers, not 90,000."""
    need = capacity.offloaded_need(TINY, 2, bucket_bytes=np.int16(30000))
    assert need.buffers == 90000 and type(need.buffers) is int


def test_user_limits_name_a_cap_beyond_any_float(tmp_path):
    """G27: UserLimits(10**400, 1) raised a bare OverflowError."""
    with pytest.raises(ValueError, match=r"^memory_bytes: expected a positive number"):
        UserLimits(10**400, 1, root=tmp_path)


# The ninth probe pass.
def test_two_users_whose_names_differ_only_in_replaced_characters_get_two_groups():
    """C2: jo@x.com and jo_x.com shared one control group and one cap."""
    from offloadlab_course.limits import group_name

    names = ["jo@x.com", "jo_x.com", "a b", "a_b", "plain"]
    assert len({group_name(n) for n in names}) == len(names)
    assert group_name("plain") == "offloadlab-plain"  # (names that need nothing keep it)


def test_user_limits_take_a_str_root_and_refuse_a_quota_below_the_kernels(tmp_path):
    """C1, C3: a str root raised a TypeError; cpus=0.001 wrote a quota the kernel refuses."""
    from offloadlab_course.limits import UserLimits

    assert UserLimits(2**30, 1, root=str(tmp_path)).root == tmp_path
    with pytest.raises(ValueError, match="cpus: expected at least 0.01 of a core"):
        UserLimits(2**30, 0.001, root=tmp_path)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_lab02_challenge_takes_a_numpy_or_tensor_bandwidth(kind, capsys):
    """C26, C28: a correct β as np.float32 or a 0-d tensor failed as 'expected a bandwidth'."""
    import numpy as np

    from offloadlab.link import EmulatedLink

    from tests.test_grading import two_size_probe

    with EmulatedLink(bandwidth=2e9) as link:
        kind_of = np.float32 if kind == "numpy" else torch.tensor
        outcome = grading.lab02_challenge(lambda link: kind_of(two_size_probe(link)), link, 2e9)
    assert outcome, outcome.line


def test_challenges_name_a_missing_link_config_or_folder():
    """C27, C29, C30: AttributeErrors from inside, and tempfile's FileNotFoundError."""
    with pytest.raises(ValueError, match="link: expected"):
        grading.lab02_challenge(lambda link: 1.0, None, 2e9)
    with pytest.raises(ValueError, match="config: expected the lab's GPTConfig"):
        grading.lab04_challenge(lambda *a: None, None, "cpu")
    with pytest.raises(ValueError, match="folder: expected an existing folder"):
        grading.lab07_challenge("/nonexistent/folder", 2**20, 8, 1e9)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_check_exact_compares_arrays_and_tensors(kind):
    """C12, C13: two arrays (or tensors) raised numpy's ambiguous-truth ValueError."""
    import numpy as np

    from offloadlab_course import check

    make = np.array if kind == "numpy" else torch.tensor
    assert check.exact("order", make([1, 2, 3]), make([1, 2, 3]))
    assert not check.exact("order", make([1, 2, 3]), make([1, 2, 4]))
    assert not check.exact("order", make([1, 2]), make([1, 2, 3]))


def test_offloaded_need_names_a_dtype_it_cannot_train_in():
    """C8: complex64 gave torch's embedding error, naming no argument."""
    config = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=8)
    with pytest.raises(ValueError, match="dtype: expected a floating-point torch dtype"):
        capacity.offloaded_need(config, 2, dtype=torch.complex64)


def test_the_release_names_a_lab_that_is_no_text_and_skips_a_fifo(tmp_path):
    """C33: a non-UTF-8 lab*.md gave a decode error naming no file; C35: a FIFO named
    lab97_fifo.md blocked the release forever."""
    import os

    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "lab01_x.md").write_text("---\njupytext:\n  formats: md:myst\n---\n# Lab 1\n")
    os.mkfifo(labs / "lab97_fifo.md")
    assert [p.name for p in student.find_labs(labs)] == ["lab01_x.md"]
    (labs / "lab02_bad.md").write_bytes(b"---\njupytext:\n\xff\xfe not text\n")
    with pytest.raises(ValueError, match="labs_dir: lab02_bad.md is not UTF-8 text"):
        student.find_labs(labs)


# The tenth probe pass.
def test_a_name_that_ends_like_a_digest_cannot_pose_as_another_user():
    """C13: group_name('a b') == group_name('a_b-c8687a08aa5d'); C18: group_name(None)."""
    from offloadlab_course.limits import group_name

    assert group_name("a b") != group_name(group_name("a b").removeprefix("offloadlab-"))
    with pytest.raises(ValueError, match="user: expected a user name"):
        group_name(None)


@pytest.mark.parametrize("root", [None, b"/sys/fs/cgroup"])
def test_user_limits_name_a_root_that_is_no_path(root):
    """C24, C25: pathlib's TypeError."""
    with pytest.raises(ValueError, match="root: expected the cgroup folder"):
        UserLimits(2**30, 1, root=root)


def test_check_exact_compares_containers_and_odd_tensors():
    """C36, C37, C39: a dict of tensors, meta and sparse tensors raised."""
    a = {"x": torch.tensor([1, 2])}
    assert check.exact("d", a, {"x": torch.tensor([1, 2])})
    assert not check.exact("d", a, {"x": torch.tensor([1, 3])})
    meta = torch.empty(2, device="meta")
    assert not check.exact("m", meta, torch.empty(2, device="meta"))
    sparse = torch.tensor([1, 0, 2]).to_sparse()
    assert check.exact("s", sparse, torch.tensor([1, 0, 2]).to_sparse())


def test_lab_three_and_five_name_a_missing_link_and_lab_four_a_missing_optimizer(capsys):
    """C59, C60: AttributeErrors on a non-link; C49: an offload that returns nothing."""
    with pytest.raises(ValueError, match="link: expected"):
        grading.lab03_challenge(lambda *a: None, None)
    with pytest.raises(ValueError, match="link: expected"):
        grading.lab05_challenge(lambda items, link: iter(items), "emulated")
    config = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=8)
    outcome = grading.lab04_challenge(lambda model, link: None, config, "cpu")
    assert not outcome and "must return an optimizer" in outcome.line


def test_the_release_skips_fifos_and_names_bad_pages_beside_the_labs(tmp_path):
    """C62, C73 (a FIFO .md in the labs folder or the book beside it blocked the release),
    C63, C72 (a non-UTF-8 .md there exited without naming it), C70 (broken front matter gave a
    yaml traceback)."""
    import os
    import subprocess
    import sys

    labs, book = tmp_path / "labs", tmp_path / "book"
    labs.mkdir(), book.mkdir()
    source = (ROOT / "labs" / "lab03_hide_a_transfer.md").read_text(encoding="utf-8")
    (labs / "lab03_hide_a_transfer.md").write_text(source, encoding="utf-8")
    os.mkfifo(labs / "notes.md")
    os.mkfifo(book / "fifo.md")
    run = [sys.executable, "-m", "offloadlab_course.student", str(labs), str(tmp_path / "out")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (book / "bad.md").write_bytes(b"\xff\xfe not text")
    done = subprocess.run([*run, "--force"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "bad.md: not UTF-8 text" in done.stderr, done.stderr
    (book / "bad.md").unlink()
    (labs / "lab91_bad.md").write_text("---\njupytext:\n  nonsense: [\n---\n")
    done = subprocess.run([*run, "--force"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "lab91_bad.md" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# The eleventh probe pass.
def test_check_exact_takes_equal_numbers_inside_containers_and_names_a_nan():
    """C23, C24: [1, 2] against [1.0, 2.0] failed, showing equal-looking values, though 1 against
    1.0 passed; C26: nan against nan said 'nan, but nan was expected'."""
    assert check.exact("x", [1, 2], [1.0, 2.0])
    assert check.exact("x", {"a": 1}, {"a": 1.0})
    assert not check.exact("x", [1, 2], [1.0, 2.5])
    assert not check.exact("x", [True], [1])  # (True is not the answer 1)
    verdict = check.exact("x", float("nan"), float("nan"))
    assert not verdict and "expected a finite real number as the answer; got nan" in verdict.message


def test_the_release_reads_a_labs_whole_front_matter_and_names_what_it_skips(tmp_path):
    """C88, C78: a lab whose front matter put 'jupytext:' past its first 2000 bytes was skipped
    in silence (or, alone, 'found none'); C89: an unclosed BEGIN SOLUTION named no lab."""
    labs = tmp_path / "labs"
    labs.mkdir()
    body = "# Lab\n\n```{code-cell} ipython3\nx = 1\n```\n"
    long = "---\ndescription: " + "x" * 2100 + "\njupytext:\n  formats: md:myst\n---\n" + body
    (labs / "lab01_long.md").write_text(long)
    assert [p.name for p in student.find_labs(labs)] == ["lab01_long.md"]
    (labs / "lab02_notes.md").write_text("# notes, not a notebook\n")
    with pytest.warns(UserWarning, match=r"lab02_notes\.md is not a Jupytext lab"):
        assert [p.name for p in student.find_labs(labs)] == ["lab01_long.md"]
    (labs / "lab01_long.md").unlink()
    with pytest.raises(ValueError, match=r"found none: lab02_notes\.md has no Jupytext front"):
        student.find_labs(labs)
    (labs / "lab02_notes.md").unlink()
    unclosed = "---\njupytext:\n  formats: md:myst\n---\n# Lab\n\n```{code-cell} ipython3\n"
    (labs / "lab03_y.md").write_text(unclosed + "### BEGIN SOLUTION\nsecret = 42\n```\n")
    with pytest.raises(ValueError, match=r"^lab03_y\.md: cell \d+: ### BEGIN SOLUTION without"):
        student.write_release(labs, tmp_path / "out")


# The twelfth probe pass.
def test_lab02s_hidden_link_does_not_print_its_rate(capsys):
    """C4: a probe read the hidden rate from repr(link)."""
    from tests.test_grading import two_size_probe

    def reading_the_repr(link):
        two_size_probe(link)  # (copies enough to pass the floor)
        return float(repr(link).split("bandwidth=")[1].split()[0])

    with pytest.raises(IndexError):  # the repr no longer holds it
        grading.lab02_hidden_challenge(reading_the_repr)
    assert "bandwidth" not in repr(grading._RateKept(bandwidth=3e8))


def test_check_exact_survives_what_python_compares(capsys):
    """C48 (a list holding itself: RecursionError), C62 (2**1100 against inf: OverflowError),
    C42 ([nan] against [nan]: 'but [nan] was expected')."""
    itself = []
    itself.append(itself)
    assert check.exact("x", itself, itself)
    assert not check.exact("x", 2**1100, float("inf"))
    verdict = check.exact("x", [float("nan")], [float("nan")])
    assert not verdict and "holds nan, which is no answer" in verdict.message


def test_lab05_names_a_prefetch_that_returns_no_iterator(capsys):
    """C76: a prefetch returning 5 got a TypeError from inside the grader."""
    from offloadlab.link import EmulatedLink

    with EmulatedLink() as link:
        outcome = grading.lab05_challenge(lambda items, link: 5, link, items=4)
    assert not outcome and "prefetch(items, link) must return an iterator" in outcome.line


def test_the_release_names_broken_links_and_a_bom_and_warns_in_one_line(tmp_path):
    """C96, C97 (a looping or dangling lab*.md link skipped in silence), C103 (a lab saved with a
    byte-order mark taken for no lab), C104 (the skip notice printed as a two-line Python
    warning)."""
    import os
    import subprocess
    import sys

    labs = tmp_path / "labs"
    labs.mkdir()
    lab = (ROOT / "labs" / "lab03_hide_a_transfer.md").read_text(encoding="utf-8")
    (labs / "lab01_bom.md").write_text("\ufeff" + lab, encoding="utf-8")
    assert [p.name for p in student.find_labs(labs)] == ["lab01_bom.md"]
    os.symlink(labs / "nowhere.md", labs / "lab02_dangling.md")
    os.symlink(labs / "lab03_loop.md", labs / "lab03_loop.md")
    (labs / "lab04_notes.md").write_text("notes\n")
    run = [sys.executable, "-m", "offloadlab_course.student", str(labs), str(tmp_path / "out")]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for name in ("lab02_dangling.md", "lab03_loop.md", "lab04_notes.md"):
        assert [line for line in lines if name in line], done.stderr
    assert all(line.startswith("offloadlab_course.student: warning: ") for line in lines), lines
