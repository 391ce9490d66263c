"""Lab 7's commit check (grading.lab07_commit) and the crash replay under it (crashes): the lab's
worked commit passes, each way of getting the order wrong fails with its own line, and the
replay lists what a kill and a power cut can leave."""

import os

import pytest

from offloadlab_course import crashes, grading
from tests.test_chapter_cores import two_slot_module


@pytest.fixture
def two_slot_file(tmp_path):
    """The lab's TwoSlotFile, as its %%writefile cell writes it."""
    return two_slot_module(tmp_path).TwoSlotFile


def worked(state, data):
    idle = 1 - state.slot
    state.write_slot(idle, data)
    state.flush()
    state.write_header(idle, state.step + 1)
    state.flush()
    state.step, state.slot = state.step + 1, idle


def header_first(state, data):
    idle = 1 - state.slot
    state.write_header(idle, state.step + 1)
    state.write_slot(idle, data)
    state.flush()
    state.step, state.slot = state.step + 1, idle


def one_flush(state, data):
    idle = 1 - state.slot
    state.write_slot(idle, data)
    state.write_header(idle, state.step + 1)
    state.flush()
    state.step, state.slot = state.step + 1, idle


def in_place(state, data):
    slot = state.slot if state.step >= 0 else 0
    state.write_slot(slot, data)
    state.flush()
    state.write_header(slot, state.step + 1)
    state.flush()
    state.step, state.slot = state.step + 1, slot


def no_last_flush(state, data):
    idle = 1 - state.slot
    state.write_slot(idle, data)
    state.flush()
    state.write_header(idle, state.step + 1)
    state.step, state.slot = state.step + 1, idle


def no_advance(state, data):
    idle = 1 - state.slot
    state.write_slot(idle, data)
    state.flush()
    state.write_header(idle, state.step + 1)
    state.flush()


def by_hand(state, data):
    """The worked commit through os itself, os.write after a seek for the data: recorded too."""
    idle = 1 - state.slot
    os.lseek(state.fd, 2 * 4096 + idle * state.nbytes, os.SEEK_SET)
    os.write(state.fd, data)
    os.fdatasync(state.fd)
    state.write_header(idle, state.step + 1)
    os.fsync(state.fd)
    state.step, state.slot = state.step + 1, idle


def test_the_worked_commit_passes_and_so_does_one_written_with_os_itself(
    two_slot_file, tmp_path, capsys
):
    assert grading.lab07_commit(worked, two_slot_file, tmp_path)
    assert grading.lab07_commit(by_hand, two_slot_file, tmp_path)
    assert capsys.readouterr().out.count("✓ commit: 31 crashes replayed over 3 commits") == 2
    assert [path.name for path in tmp_path.iterdir()] == ["two_slot.py"]  # its scratch removed


@pytest.mark.parametrize(
    "commit, line",
    [
        (header_first, "a kill in commit 1, after 1 of its writes: the file reopens at step 0 "),
        (one_flush, "a power cut in commit 1, after 2 of its writes, only the second of the 2 "),
        (in_place, "a kill in commit 2, after 1 of its writes: the file reopens at step 0 "),
        (no_last_flush, "a power cut just after commit 1 returned, none of the 1 not yet flushed"),
        (no_advance, "after commit 1 the state says step -1"),
    ],
    ids=lambda value: getattr(value, "__name__", "line"),
)
def test_each_wrong_order_fails_on_the_crash_that_shows_it(
    commit, line, two_slot_file, tmp_path, capsys
):
    assert not grading.lab07_commit(commit, two_slot_file, tmp_path)
    out = capsys.readouterr().out
    assert out.startswith("✗ commit: ") and line in out and out.count("\n") == 1
    assert "write_slot" not in out and "flush()" not in out  # says what broke, not the answer


def test_os_is_given_back_whatever_the_commit_does(two_slot_file, tmp_path):
    real = os.pwrite, os.write, os.fsync, os.fdatasync

    def broken(state, data):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        grading.lab07_commit(broken, two_slot_file, tmp_path)
    assert (os.pwrite, os.write, os.fsync, os.fdatasync) == real


def test_an_unanswered_commit_or_a_bad_argument_is_named(two_slot_file, tmp_path, capsys):
    assert not grading.lab07_commit(None, two_slot_file, tmp_path)
    assert "my_commit: expected your function my_commit(state, data)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="two_slot_file: expected the lab's TwoSlotFile class"):
        grading.lab07_commit(worked, "TwoSlotFile", tmp_path)
    with pytest.raises(ValueError, match="folder: expected an existing folder"):
        grading.lab07_commit(worked, two_slot_file, tmp_path / "missing")


def test_the_replay_lists_a_kill_and_every_power_cut_at_each_point(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"....")
    with crashes.record(path) as recording:
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, b"ab", 0)
        os.pwrite(other := os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT), b"zz", 0)
        recording.mark("first")
        os.pwrite(fd, b"cd", 2)
        os.fsync(fd)
        os.close(fd), os.close(other)
    assert path.read_bytes() == b"abcd"  # the writes reached the file
    assert recording.calls == [
        ("write", 0, b"ab"),
        ("mark", "first"),
        ("write", 2, b"cd"),
        ("flush",),
    ]
    seen = [(c.kind, c.after, c.held, c.marks, c.image) for c in crashes.crashes(recording)]
    assert seen == [  # nothing is marked between a write and the next: the promise comes after
        ("kill", 0, "all", [], b"...."),
        ("kill", 0, "all", ["first"], b"ab.."),
        ("power cut", 0, "none", ["first"], b"...."),
        ("power cut", 0, "only the first", ["first"], b"ab.."),
        ("power cut", 0, "half of the first", ["first"], b"a..."),
        ("kill", 1, "all", ["first"], b"abcd"),
        ("power cut", 1, "none", ["first"], b"...."),
        ("power cut", 1, "only the first", ["first"], b"ab.."),
        ("power cut", 1, "half of the first", ["first"], b"a..."),
        ("power cut", 1, "only the second", ["first"], b"..cd"),
        ("power cut", 1, "half of the second", ["first"], b"..c."),
        ("kill", 1, "all", ["first"], b"abcd"),
    ]


def truncating(state, data):
    """The worked commit, then the file cut short: the other slot's step is lost."""
    worked(state, data)
    os.ftruncate(state.fd, 2 * 4096 + (state.slot + 1) * state.nbytes)


def through_a_file_object(state, data):
    """The worked commit's data written through a Python file object, which the recording
    cannot see."""
    idle = 1 - state.slot
    handle = os.fdopen(os.dup(state.fd), "r+b", buffering=0)
    with handle:
        handle.seek(2 * 4096 + idle * state.nbytes)
        handle.write(data)
    state.flush()
    state.write_header(idle, state.step + 1)
    state.flush()
    state.step, state.slot = state.step + 1, idle


# Fourteenth probe pass, K14, K45, K46: writes the recording cannot see (a truncation, a file
# object) were replayed as if they had not happened: a truncating commit passed, and a right one
# through a file object failed on a crash that could not happen.
@pytest.mark.parametrize("commit", [truncating, through_a_file_object])
def test_a_change_to_the_file_the_recording_did_not_see_is_named(commit, two_slot_file, tmp_path):
    outcome = grading.lab07_commit(commit, two_slot_file, tmp_path)
    assert not outcome and "could not see" in outcome.line, outcome.line


def flushed_by_sync(state, data):
    """The worked commit, each flush the whole system's (os.sync)."""
    idle = 1 - state.slot
    state.write_slot(idle, data)
    os.sync()
    state.write_header(idle, state.step + 1)
    os.sync()
    state.step, state.slot = state.step + 1, idle


def written_durably(state, data):
    """The worked commit through a descriptor whose every write is flushed (O_DSYNC)."""
    idle = 1 - state.slot
    fd = os.open(f"/proc/self/fd/{state.fd}", os.O_RDWR | os.O_DSYNC)  # the same file
    try:
        os.pwrite(fd, data, 2 * 4096 + idle * state.nbytes)
    finally:
        os.close(fd)
    state.write_header(idle, state.step + 1)
    state.flush()
    state.step, state.slot = state.step + 1, idle


# Fourteenth probe pass, K15, K16: a right commit flushed with os.sync, or written through an
# O_DSYNC descriptor, was failed on a power cut its flushes had ruled out.
@pytest.mark.parametrize("commit", [flushed_by_sync, written_durably])
def test_a_commit_flushed_another_way_passes(commit, two_slot_file, tmp_path):
    outcome = grading.lab07_commit(commit, two_slot_file, tmp_path)
    assert outcome, outcome.line
