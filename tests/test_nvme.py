"""The file-backed tier: exact round trips, Adam over files equal to Adam in memory, and the
faults a disk brings — a crash mid-step, a full disk, an I/O error, a damaged or truncated file —
each leaving the previous step or the new one, never a mixture."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

from offloadlab import cpu_adam, nvme
from offloadlab.nvme import ChecksumError, FileTier, adam_from_file, open_state
from tests.conftest import ROOT

BLOCK = 4096  # bytes: small blocks, so small tensors span many of them
NAMES = ("master", "exp_avg", "exp_avg_sq")


def _values(tier):
    out = torch.empty(tier.numel, dtype=tier.dtype)
    tier.read(0, out)
    return out


def _state(folder, n, seed=0):
    """Three tiers at step 0: random master weights, zero moments; and the same state in memory."""
    torch.manual_seed(seed)
    start = torch.randn(n)
    tiers = [
        FileTier(
            folder / f"{name}.bin",
            n,
            init=start if name == "master" else None,
            block_bytes=BLOCK,
            queue_depth=2,
        )
        for name in NAMES
    ]
    return tiers, [start.clone(), torch.zeros(n), torch.zeros(n)]


def _memory_step(memory, grad, step):
    cpu_adam.adamw_step(*memory, grad, step=step, lr=1e-2)


@pytest.fixture(params=["direct where possible", "page cache"])
def io_path(request, monkeypatch):
    """Run a test twice: with O_DIRECT as the file system allows, and as on one that refuses it."""
    if request.param == "page cache":
        monkeypatch.setattr(nvme.direct_io, "reopen_direct", lambda fd: (fd, False))
    return request.param


def test_round_trip_partial_reads_and_bounds(tmp_path, io_path):
    n = 3000  # not a whole number of blocks
    with FileTier(tmp_path / "t.bin", n, torch.bfloat16, block_bytes=BLOCK) as tier:
        assert (
            tier.step == 0
            and tier.steps == [0]
            and torch.equal(_values(tier), torch.zeros(n, dtype=torch.bfloat16))
        )
        data = torch.randn(n).to(torch.bfloat16)
        tier.write(0, data[:2048])
        tier.write(2048, data[2048:])
        assert torch.equal(_values(tier), torch.zeros(n, dtype=torch.bfloat16)), (
            "staged data must not be visible"
        )
        assert tier.commit() == 1 and tier.steps == [0, 1]
        assert torch.equal(_values(tier), data)
        part = torch.empty(10, dtype=torch.bfloat16)
        tier.read(2045, part)  # across a block boundary
        assert torch.equal(part, data[2045:2055])
        with pytest.raises(ValueError, match="^start: expected whole blocks"):
            tier.write(5, data[:100])
        with pytest.raises(ValueError, match="^start: "):
            tier.read(2995, part)
        with pytest.raises(
            ValueError, match="^src: expected a contiguous host tensor of torch.bfloat16"
        ):
            tier.write(0, torch.zeros(3))
        tier.write(0, data[:2048])
        with pytest.raises(
            ValueError, match=r"^commit: a step must write every element; blocks 1 of 2"
        ):
            tier.commit()
        tier.abort()
        assert tier.step == 1 and torch.equal(_values(tier), data)
    assert (tmp_path / "t.bin").exists(), "close() keeps the file: it is the tier's state"
    with pytest.raises(ValueError, match="is closed"):
        tier.read(0, part)
    with pytest.raises(ValueError, match="is closed"):
        tier.write(0, data)


def test_names_that_are_no_file_name_are_refused_by_name(tmp_path, monkeypatch):
    """Tenth probe pass T4, T8, T34: a name ending in '/' made a tier file under the folder's name;
    a NUL failed inside the direct I/O layer without naming the path; a relative name after the
    current folder was deleted raised a bare FileNotFoundError."""
    with pytest.raises(ValueError, match=r"^path: expected a file name; got '.*nodir/', which "):
        FileTier(f"{tmp_path}/nodir/", 10)
    with pytest.raises(ValueError, match=r"^path: expected a file name without a NUL character"):
        FileTier(f"{tmp_path}/x\0y", 10)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ValueError, match=r"^path: 'x\.bin' is relative to the current folder, "):
        FileTier("x.bin", 10)
    with pytest.raises(ValueError, match=r"^path: 'x\.bin' is relative to the current folder, "):
        FileTier.open("x.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_writing_from_an_older_step_warns_that_it_replaces_the_newer(tmp_path):
    """Eleventh probe pass T53: opened at its older step, a tier's first write replaced the newer
    step, whose number the commit then reused, without a word (lab 7 has students open the older
    step to compare)."""
    with FileTier(tmp_path / "t.bin", 1024) as tier:
        tier.write(0, torch.ones(1024))
        tier.commit()
    with FileTier.open(tmp_path / "t.bin", step=0) as older:
        assert torch.equal(_values(older), torch.zeros(1024))  # reading takes nothing
        with pytest.warns(UserWarning, match=r"replaces step 1, the newer step this file held"):
            older.write(0, torch.full((1024,), 5.0))
        assert older.commit() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from the newest step, no warning
        with FileTier.open(tmp_path / "t.bin") as newest:
            newest.write(0, torch.ones(1024))
            newest.commit()
    assert "replaces the newer" in " ".join(FileTier.open.__doc__.split())


def test_refuses_to_overwrite_and_bad_sizes_leave_nothing_behind(tmp_path):
    (tmp_path / "mine.bin").write_bytes(b"precious")
    with pytest.raises(ValueError, match="exists"):
        FileTier(tmp_path / "mine.bin", 10)
    assert (tmp_path / "mine.bin").read_bytes() == b"precious"
    with pytest.raises(ValueError, match="^numel: "):
        FileTier(tmp_path / "x.bin", 0)
    with pytest.raises(ValueError, match="^path: folder"):
        FileTier(tmp_path / "missing" / "x.bin", 10)
    with pytest.raises(ValueError, match="^path: expected a file name; got .*, which is a folder"):
        FileTier(tmp_path, 10)  # (it used to say the folder 'exists; FileTier.open resumes it')
    with pytest.raises(ValueError, match=r"^path: expected a file name \(a str or a Path\)"):
        FileTier("", 10)
    with pytest.raises(ValueError, match="^numel: expected a tier that fits in a file"):
        FileTier(tmp_path / "huge.bin", 2**62)
    # 2 × 32 TiB: too big for the file system
    with pytest.raises(OSError, match="path: cannot reserve") as info:
        FileTier(tmp_path / "big.bin", 2**43)
    assert info.value.errno in (errno.EFBIG, errno.ENOSPC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.bin"], (
        "no 0-byte or scratch file may be left"
    )
    with FileTier(tmp_path / "x.bin", 10) as retry:  # and the name is free for a retry
        assert retry.step == 0


def test_adam_over_files_equals_adam_in_memory_and_resumes(tmp_path, io_path):
    n = 10_000
    tiers, memory = _state(tmp_path, n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2):
        grad = torch.randn(n).to(torch.bfloat16)
        seconds = adam_from_file(*tiers, grad, out, lr=1e-2, chunk=2048)
        _memory_step(memory, grad, step)
        assert set(seconds) == {"read", "update", "write", "other"} and all(
            s >= 0 for s in seconds.values()
        )
    assert torch.equal(out, memory[0].to(torch.bfloat16))
    for tier in tiers:
        tier.close()
    tiers = open_state(*(tmp_path / f"{name}.bin" for name in NAMES))  # a later session resumes
    assert [t.step for t in tiers] == [2, 2, 2]
    grad = torch.randn(n)
    with pytest.raises(ValueError, match="^step: expected 3"):
        adam_from_file(*tiers, grad, step=1, lr=1e-2)
    adam_from_file(*tiers, grad, lr=1e-2)
    _memory_step(memory, grad, 3)
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected)
        tier.close()


def _child(script: str, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_when_paused(child: subprocess.Popen) -> None:
    """Wait for the child to say it is paused where the test wants it, then SIGKILL it there."""
    line = child.stdout.readline()
    if line != "paused\n":
        child.kill()
        raise AssertionError(f"the child did not pause: {line!r} {child.stderr.read()}")
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL


# The child runs one step of adam_from_file over the files and pauses (on a pipe, no sleeps) at a
# chosen point, where the parent kills it: after chunk 0 of the new step reached the file (its
# writes are waited for before chunk 2's reads), or between the first file's commit and the
# second's.
_CRASHING_STEP = """
    import sys
    import torch
    from offloadlab import cpu_adam, nvme

    folder, where = sys.argv[1], sys.argv[2]
    names = ("master", "exp_avg", "exp_avg_sq")
    tiers = nvme.open_state(*(f"{folder}/{name}.bin" for name in names), queue_depth=2)

    def pause():
        print("paused", flush=True)
        sys.stdin.readline()

    if where == "mid-step":
        update, calls = cpu_adam.adamw_step, []
        def paused_update(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                pause()
            return update(*args, **kwargs)
        cpu_adam.adamw_step = paused_update
    else:
        commit, calls = nvme.FileTier.commit, []
        def paused_commit(self):
            step = commit(self)
            calls.append(1)
            if len(calls) == 1:
                pause()
            return step
        nvme.FileTier.commit = paused_commit
    torch.manual_seed(1)
    nvme.adam_from_file(*tiers, torch.randn(tiers[0].numel), lr=1e-2, chunk=1024)
    print("finished", flush=True)
"""


@pytest.mark.parametrize("where", ["mid-step", "between commits"])
def test_sigkill_during_a_step_leaves_the_previous_step(tmp_path, where):
    n = 8192  # 8 chunks of 1024 elements
    tiers, memory = _state(tmp_path, n)
    grad = torch.randn(n)
    adam_from_file(*tiers, grad, lr=1e-2, chunk=1024)
    _memory_step(memory, grad, 1)
    for tier in tiers:
        tier.close()
    before = {name: (tmp_path / f"{name}.bin").read_bytes() for name in NAMES}
    _kill_when_paused(_child(_CRASHING_STEP, tmp_path, where))
    assert all((tmp_path / f"{name}.bin").read_bytes() != before[name] for name in NAMES), (
        "the child must have written part of the new step before it was killed"
    )
    if where == "between commits":  # master committed step 2 alone; alone it opens there
        with FileTier.open(tmp_path / "master.bin") as master:
            assert master.step == 2 and master.steps == [1, 2]
    tiers = open_state(*(tmp_path / f"{name}.bin" for name in NAMES))
    assert [t.step for t in tiers] == [1, 1, 1]
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected), "the files must hold step 1 exactly"
    grad = torch.randn(n)
    adam_from_file(*tiers, grad, lr=1e-2, chunk=1024)  # the retry updates every chunk once
    _memory_step(memory, grad, 2)
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected)
        tier.close()


def _fail_on_call(monkeypatch, module, name, call, error):
    """Make ``module.name`` raise ``error`` on its ``call``-th call (counted across threads)."""
    real, calls, lock = getattr(module, name), [0], threading.Lock()

    def failing(*args, **kwargs):
        with lock:
            calls[0] += 1
            mine = calls[0]
        if mine == call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("fault", ["write", "read", "second commit", "interrupt"])
def test_a_failed_step_leaves_all_three_files_at_the_previous_step(tmp_path, monkeypatch, fault):
    n = 8192
    tiers, memory = _state(tmp_path, n)
    grad = torch.randn(n)
    adam_from_file(*tiers, grad, lr=1e-2, chunk=1024)
    _memory_step(memory, grad, 1)
    if fault == "write":
        _fail_on_call(monkeypatch, os, "pwritev", 10, OSError(errno.EIO, "Input/output error"))
    elif fault == "read":
        _fail_on_call(monkeypatch, os, "preadv", 20, OSError(errno.EIO, "Input/output error"))
    elif fault == "second commit":  # exp_avg's data sync, after master committed
        _fail_on_call(
            monkeypatch, nvme.direct_io, "sync", 6, OSError(errno.ENOSPC, "No space left on device")
        )
    else:
        _fail_on_call(monkeypatch, cpu_adam, "adamw_step", 4, KeyboardInterrupt())
    grad = torch.randn(n)
    with pytest.raises((OSError, KeyboardInterrupt)):
        adam_from_file(*tiers, grad, lr=1e-2, chunk=1024)
    monkeypatch.undo()
    assert [t.step for t in tiers] == [1, 1, 1]
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected)
        tier.close()
    # on disk too: each file alone opens at step 1 (master's step 2 was withdrawn)
    for name in NAMES:
        with FileTier.open(tmp_path / f"{name}.bin") as tier:
            assert tier.step == 1
    tiers = open_state(*(tmp_path / f"{name}.bin" for name in NAMES))
    adam_from_file(*tiers, grad, lr=1e-2, chunk=1024)  # a retry updates every element exactly once
    _memory_step(memory, grad, 2)
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected)
        tier.close()
    tiers = open_state(*(tmp_path / f"{name}.bin" for name in NAMES))
    assert [t.step for t in tiers] == [2, 2, 2]
    for tier in tiers:
        tier.close()


def test_a_full_disk_fails_at_creation_and_never_mid_step(small_disk):
    disk = small_disk("2m")
    with pytest.raises(OSError, match="path: cannot reserve 8.4 MB for a tier of 1048576") as info:
        FileTier(disk / "big.bin", 2**20)
    assert info.value.errno == errno.ENOSPC
    assert not list(disk.iterdir()), "a refused tier leaves no file"
    tiers, memory = _state(disk, 2**16)  # 3 × 2 × 256 KiB, reserved up front
    with pytest.raises(OSError):
        (disk / "filler").write_bytes(b"x" * 2**21)  # the rest of the disk fills up
    for step in (1, 2):
        grad = torch.randn(2**16)
        adam_from_file(*tiers, grad, lr=1e-2)
        _memory_step(memory, grad, step)
    for tier, expected in zip(tiers, memory):
        assert torch.equal(_values(tier), expected)
        tier.close()


def test_without_posix_fallocate_the_space_is_reserved_by_writing(small_disk, monkeypatch):
    """macOS has no posix_fallocate: the tier writes zeros instead, with the same guarantee."""
    monkeypatch.delattr(os, "posix_fallocate")
    disk = small_disk("2m")
    with pytest.raises(OSError, match="path: cannot reserve 8.4 MB"):
        FileTier(disk / "big.bin", 2**20)
    assert not list(disk.iterdir())
    with FileTier(disk / "small.bin", 2**16, init=torch.ones(2**16), block_bytes=BLOCK) as tier:
        assert tier.step == 0 and torch.equal(_values(tier), torch.ones(2**16))


def test_damage_is_detected_and_a_damaged_header_falls_back(tmp_path):
    n = 4096
    path = tmp_path / "t.bin"
    with FileTier(path, n, block_bytes=BLOCK) as tier:
        first = torch.randn(n)
        tier.write(0, first)
        tier.commit()
        second = torch.randn(n)
        tier.write(0, second)
        tier.commit()
        layout = tier._layout
        newest_slot = tier._slot
    raw = bytearray(path.read_bytes())
    data = layout.block_offset(newest_slot, 2)
    raw[data + 100] ^= 0xFF
    path.write_bytes(raw)
    with FileTier.open(path) as tier:
        assert tier.step == 2
        with pytest.raises(ChecksumError, match="block 2 of step 2 does not match its checksum"):
            _values(tier)
    header = layout.header_offset(newest_slot)
    raw[header + 40] ^= 0xFF  # a torn header
    path.write_bytes(raw)
    with FileTier.open(path) as tier:
        assert tier.step == 1 and tier.steps == [1] and torch.equal(_values(tier), first)


def test_a_truncated_file_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "t.bin"
    tier = FileTier(path, 4096, block_bytes=BLOCK)
    os.truncate(path, 3 * BLOCK)  # cut while open: the data slots are gone
    with pytest.raises(OSError, match="shorter than its header says"):
        _values(tier)
    tier.close()
    with pytest.raises(OSError, match="shorter than its header says"):
        FileTier.open(path)
    path.write_bytes(b"not a tier")
    with pytest.raises(ValueError, match="not an offloadlab tier file"):
        FileTier.open(path)


def test_ownership_is_by_handle_not_by_name(tmp_path):
    path = tmp_path / "t.bin"
    first = FileTier(path, 100)
    with pytest.raises(OSError, match="open in another FileTier"):
        FileTier.open(path)
    os.unlink(path)  # the name is reused by a second tier while the first is open
    second = FileTier(path, 100, init=torch.ones(100))
    first.close()
    first.remove()
    assert path.exists(), "closing or removing the first tier must not delete the second's file"
    second.remove()
    assert not path.exists()


_EXIT_WITHOUT_CLOSE = """
    import os, sys, torch
    from offloadlab import nvme
    folder = sys.argv[1]
    named = nvme.FileTier(f"{folder}/state.bin", 1000, init=torch.arange(1000.0))
    scratch = nvme.FileTier.temporary(folder, 1000)
    print("paused", flush=True)
    sys.stdin.readline()
"""


def test_a_process_killed_without_close_leaves_its_state_and_no_scratch(tmp_path):
    _kill_when_paused(_child(_EXIT_WITHOUT_CLOSE, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"], (
        "a temporary tier has no file to leave"
    )
    with FileTier.open(tmp_path / "state.bin") as tier:  # the lock died with the process
        assert tier.step == 0 and torch.equal(_values(tier), torch.arange(1000.0))


_KILLED_WHILE_CREATING = """
    import sys, torch
    from offloadlab import nvme
    format_ = nvme.FileTier._format
    def paused_format(self, init):
        format_(self, init)
        print("paused", flush=True)  # reserved and written, not yet given its name
        sys.stdin.readline()
    nvme.FileTier._format = paused_format
    nvme.FileTier(f"{sys.argv[1]}/state.bin", 2**20, init=torch.ones(2**20))
"""


def test_a_process_killed_while_creating_a_tier_leaves_nothing(tmp_path):
    """The file is built without a name (O_TMPFILE) and named once complete: a crash during creation
    leaves neither a half-made tier nor a hidden scratch file of its full size."""
    _kill_when_paused(_child(_KILLED_WHILE_CREATING, tmp_path))
    assert list(tmp_path.iterdir()) == []
    with FileTier(tmp_path / "state.bin", 10) as tier:  # and the name is free
        assert tier.step == 0


def test_reads_run_at_the_queue_depth(tmp_path, monkeypatch):
    """Count the preadv calls in flight: at depth 4 four run at once, never more."""
    tier = FileTier(tmp_path / "t.bin", 16 * 1024, block_bytes=BLOCK, queue_depth=4)
    real, gate = os.preadv, threading.Barrier(4, timeout=60)
    in_flight, most, lock = [0], [0], threading.Lock()

    def counted(*args):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            gate.wait()  # returns only once four calls are in flight together
            return real(*args)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(os, "preadv", counted)
    _values(tier)  # 16 blocks
    monkeypatch.undo()
    assert most[0] == 4
    tier.close()


def test_checksums_can_be_turned_off_and_the_choice_is_kept(tmp_path):
    path = tmp_path / "t.bin"
    with FileTier(path, 4096, block_bytes=BLOCK, checksums=False, init=torch.ones(4096)) as tier:
        assert not tier.checksums
    with FileTier.open(path) as tier:
        assert (
            not tier.checksums and tier.step == 0 and torch.equal(_values(tier), torch.ones(4096))
        )
    with pytest.raises(ValueError, match="^checksums: "):
        FileTier(tmp_path / "x.bin", 10, checksums="no")


def test_one_tier_given_three_times_and_no_paths_are_clear_errors(tmp_path):
    with FileTier(tmp_path / "state.bin", 16) as tier:
        with pytest.raises(ValueError, match="^exp_avg: expected three different tiers"):
            adam_from_file(tier, tier, tier, torch.zeros(16), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="^paths: expected the files of one optimizer state"):
        open_state()
