"""Result files: checked before a run, written whole, never replacing a file by surprise."""

import errno
import os

import pytest

from offloadlab import files


def test_check_target_refuses_what_cannot_be_written(tmp_path):
    assert files.check_target(tmp_path / "new.json") == tmp_path / "new.json"
    with pytest.raises(ValueError, match="^out: expected a file name; got ''$"):
        files.check_target("", name="out")
    with pytest.raises(ValueError, match="which is a folder"):
        files.check_target(tmp_path, name="out")
    with pytest.raises(ValueError, match="does not exist"):
        files.check_target(tmp_path / "missing" / "x.json", name="out")
    (tmp_path / "old.json").write_text("mine")
    with pytest.raises(ValueError, match="exists; choose another name or pass --force"):
        files.check_target(tmp_path / "old.json", name="out", how_to_replace="--force")
    assert files.check_target(tmp_path / "old.json", replace=True) == tmp_path / "old.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]


def test_write_atomically_never_replaces_by_surprise(tmp_path):
    target = tmp_path / "out.json"
    files.write_atomically(target, "first\n")
    with pytest.raises(FileExistsError):
        files.write_atomically(target, "second\n")
    assert target.read_text() == "first\n"
    files.write_atomically(target, "second\n", replace=True)
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # like open(), not mkstemp's 0o600


def test_replacing_keeps_the_files_permissions_and_long_names_work(tmp_path):
    private = tmp_path / "private.json"
    private.write_text("old")
    private.chmod(0o600)
    files.write_atomically(private, "new", replace=True)
    assert private.read_text() == "new" and private.stat().st_mode & 0o777 == 0o600
    long_name = tmp_path / ("r" * 250 + ".json")  # 255 bytes: the limit, so no room for a suffix
    files.check_target(long_name)
    files.write_atomically(long_name, "ok")
    assert long_name.read_text() == "ok" and len(list(tmp_path.iterdir())) == 2


def test_a_failed_write_leaves_the_old_file_and_no_scratch(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("precious")

    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(target, "new", replace=True)
    monkeypatch.undo()
    assert target.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_pipes_are_written_through_and_links_followed(tmp_path):
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    files.check_target(fifo)  # a stream: nothing there to replace
    files.write_atomically(fifo, '{"ok": 1}')
    reader.join(30)
    # the reader got the data; the pipe is still a pipe
    assert got == ['{"ok": 1}'] and fifo.is_fifo()
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    files.write_atomically(link, "new", replace=True)
    assert link.is_symlink() and real.read_text() == "new"


@pytest.mark.parametrize("dangling", [True, False], ids=["dangling", "to a file"])
def test_a_link_planted_at_the_name_is_refused_unless_replacing(tmp_path, dangling):
    """A dangling link used to pass check_target (its target did not exist) and be written
    through: the file appeared wherever the link pointed."""
    victim, planted = tmp_path / "victim.json", tmp_path / "out.json"
    if not dangling:
        victim.write_text("precious")
    planted.symlink_to(victim)
    with pytest.raises(ValueError, match=r"^out: .*out\.json' is a symbolic link \(to .*--force"):
        files.check_target(planted, name="out", how_to_replace="--force")
    with pytest.raises(FileExistsError, match="is a symbolic link now"):  # planted after the check
        files.write_atomically(planted, "new")
    assert victim.exists() != dangling and planted.is_symlink()
    files.check_target(planted, replace=True)  # asked for: written where it points
    files.write_atomically(planted, "new", replace=True)
    assert victim.read_text() == "new" and planted.is_symlink()


def test_check_target_refuses_a_folders_name_a_nul_and_a_deleted_current_folder(
    tmp_path, monkeypatch
):
    """As FileTier's names (tenth probe pass T4, T8, T34): 'out/' was taken as the file 'out'."""
    with pytest.raises(ValueError, match="^out: expected a file name; got '.*new/', which ends"):
        files.check_target(f"{tmp_path}/new/", name="out")
    with pytest.raises(ValueError, match="^out: expected a file name without a NUL character"):
        files.check_target(f"{tmp_path}/a\0b", name="out")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ValueError, match="^out: 'x.json' is relative to the current folder"):
        files.check_target("x.json", name="out")
    assert list(tmp_path.iterdir()) == []
