"""Writing result files safely: checked before a long run, never half-written, never replaced by
surprise; a write that does not stop short (:func:`write_all`); and reading an input that may be
a pipe without waiting forever for a writer (:func:`read_input`).

:func:`check_target` says, before a measurement starts, whether a file can be written at a path
later; :func:`write_atomically` writes it: into a new temporary file beside the target, flushed to
the disk, then renamed onto the target, so a reader (or a crash) sees the old file or the new one,
never a mixture. Without ``replace`` an existing file is never overwritten, even one that appeared
while the measurement ran, and a symbolic link at the name (dangling or not) is refused; with
``replace`` it is followed (the file it names is written; the link stays). A target that is not a
regular file — a pipe, ``/dev/stdout``, a terminal — is written to as the stream it is, never
renamed over (a disk's block device is refused). Where a link or a pipe at the path is not the
user's own doing (files written into a shared folder, such as a course's release),
``follow=False`` writes a new regular file in its place instead, and nothing it pointed to is
touched.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import sys
import time
from pathlib import Path

__all__ = ["check_target", "file_name", "write_atomically", "write_all"]

# File systems without hard links (FAT, some FUSE mounts) refuse os.link with one of these.
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK}


def file_name(path, name: str = "path") -> Path:
    """``path`` (a str or os.PathLike naming a file) as an absolute Path, so that a later chdir
    does not move it; ValueError naming ``name`` for anything else: not a name, empty, holding a
    NUL, ending in a separator (a folder's name), or relative to a current folder since deleted."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        raise ValueError(f"{name}: expected a file name (a str or a Path); got {path!r}")
    if "\0" in text:
        raise ValueError(f"{name}: expected a file name without a NUL character; got {text!r}")
    if text.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise ValueError(
            f"{name}: expected a file name; got {text!r}, which ends in {text[-1]!r} as a "
            "folder's name does"
        )
    try:
        return Path(text).absolute()
    except FileNotFoundError:  # (os.getcwd() of a deleted folder)
        raise ValueError(
            f"{name}: {text!r} is relative to the current folder, which was deleted; give a full "
            "path"
        ) from None


def check_target(
    path, replace: bool = False, name: str = "path", how_to_replace: str = "replace=True"
) -> Path:
    """``path`` as a Path if a file can be written there later.

    ValueError (naming ``name``) for what the caller asked wrongly: an empty name, a folder, a
    missing parent folder, an existing file or a symbolic link (dangling or not) without
    ``replace`` (the message suggests ``how_to_replace``). OSError when the folder exists but
    refuses a new file (read-only file system, no permission, no free inodes): found by creating
    and removing a temporary file in it, which also works for root, whom permission bits do not
    stop.
    """
    if not str(path):
        raise ValueError(f"{name}: expected a file name; got ''")
    file_name(path, name)
    if _descriptor(path) is not None:  # /dev/stdout, redirected to a file or not: the stream
        return Path(path)
    # (os.stat follows every link, /proc's for /dev/stdout on a pipe too, which realpath cannot)
    if _is_stream(Path(path)):
        if stat.S_ISBLK(os.stat(path).st_mode):
            raise ValueError(f"{name}: expected a file name; got {str(path)!r}, a disk's device")
        if not os.access(path, os.W_OK):
            raise OSError(errno.EACCES, f"cannot write to {str(path)!r}")
        return Path(path)
    target = _followed(Path(path))
    # a link, dangling or not, is something at the name: followed only when replacing is allowed
    if Path(path).is_symlink() and not replace:
        raise ValueError(
            f"{name}: {str(path)!r} is a symbolic link (to {os.readlink(path)!r}); choose another "
            f"name or pass {how_to_replace} to write where it points"
        )
    if target.is_dir():
        raise ValueError(f"{name}: expected a file name; got {str(path)!r}, which is a folder")
    if not target.parent.is_dir():
        raise ValueError(f"{name}: folder {str(target.parent)!r} does not exist")
    if (target.exists() or target.is_symlink()) and not replace:
        raise ValueError(
            f"{name}: {str(path)!r} exists; choose another name or pass {how_to_replace} to "
            "replace it"
        )
    fd, scratch = _create_scratch(target)
    os.close(fd)
    os.unlink(scratch)
    return target


def _followed(path: Path) -> Path:
    """The file a symbolic link names (the link itself is to stay), else ``path``."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


# Names of a descriptor the process holds open: /dev/stdout, /dev/fd/3, /proc/self/fd/1.
_DESCRIPTOR_NAME = re.compile(
    r"/dev/std(?P<std>out|err)|/dev/fd/(?P<fd>\d+)|/proc/self/fd/(?P<proc>\d+)"
)


def _descriptor(path) -> int | None:
    """The open descriptor ``path`` names (1 for /dev/stdout), written to as the stream it is even
    when the shell redirected it to a file: a new file renamed over it would lose what was
    printed. None for any other name, or a descriptor not open."""
    match = _DESCRIPTOR_NAME.fullmatch(os.path.abspath(path))
    if match is None:
        return None
    descriptor = {"out": 1, "err": 2}.get(match["std"]) or int(match["fd"] or match["proc"])
    try:
        os.fstat(descriptor)
    except OSError:
        return None
    return descriptor


def _is_stream(path: Path) -> bool:
    """True for an existing target that is not a regular file (a pipe, a device, a socket)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode) and not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


_NAME_MAX = 255  # bytes in one file name on Linux file systems


def _create_scratch(target: Path) -> tuple[int, Path]:
    """A new, empty, uniquely named file beside ``target`` (mode 0o666 less the umask, as open()
    makes)."""
    # A name near the limit still gets a scratch name: "." + stem + ".12345678.tmp" fits in 255
    # bytes.
    stem = os.fsdecode(os.fsencode(target.name)[: _NAME_MAX - len(".12345678.tmp") - 1])
    for _ in range(16):
        scratch = target.with_name(f".{stem}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(
                scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666
            )
        except FileExistsError:
            continue
        except OSError as error:
            raise OSError(
                error.errno, f"cannot create a file in {str(target.parent)!r}: {error.strerror}"
            ) from None
        return fd, scratch
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {str(target)!r}")


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform lets a folder be opened and
    synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a folder; the rename itself has happened
        pass
    finally:
        os.close(fd)


def write_atomically(path, data: bytes | str, replace: bool = False, follow: bool = True) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` all at once; returns the path.

    Without ``replace`` an existing ``path`` is left as it is and FileExistsError is raised. Any
    OSError (a full disk, an I/O error) leaves no temporary file and ``path`` untouched; only a
    process killed while writing leaves its hidden ``.NAME.XXXXXXXX.tmp`` file behind. With
    ``follow=False`` a symbolic link, pipe or device at ``path`` is replaced by the new file (with
    ``replace``), never written through.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if follow and (descriptor := _descriptor(path)) is not None:
        sys.stdout.flush(), sys.stderr.flush()  # what was printed comes first
        view = memoryview(payload)
        while view:
            view = view[os.write(descriptor, view) :]
        return Path(path)
    if follow and _is_stream(Path(path)):  # nothing to replace: write through it
        descriptor = _open_for_a_reader(path)
        os.set_blocking(descriptor, True)
        with open(descriptor, "wb") as stream:
            stream.write(payload)
        return Path(path)
    target = _followed(Path(path)) if follow else Path(path)
    if not replace and Path(path).is_symlink():  # a link planted since check_target
        raise FileExistsError(
            errno.EEXIST, f"{str(path)!r} is a symbolic link now; it was left as it is"
        )
    fd, scratch = _create_scratch(target)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            # keep the permissions the user gave it
            if replace and target.exists() and not target.is_symlink():
                os.fchmod(fd, stat.S_IMODE(target.stat().st_mode))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(scratch, target)
        else:
            _link_new(scratch, target)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    _sync_folder(target.parent)
    return target


# Seconds a named pipe is given to find a reader before the write is refused.
_READER_WAIT_S = 30


def _open_for_a_reader(path) -> int:
    """``path`` (a pipe, a terminal, a device) opened for writing without blocking: a named pipe
    nobody reads is given :data:`_READER_WAIT_S` to find a reader, then refused, not waited on."""
    deadline = time.monotonic() + _READER_WAIT_S
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ENXIO:  # ENXIO: a pipe with no reader yet
                raise
            if time.monotonic() > deadline:
                raise OSError(
                    errno.ENXIO, f"{str(path)!r} is a pipe nobody read from in {_READER_WAIT_S} s"
                ) from None
            time.sleep(0.05)


def _link_new(scratch: Path, target: Path) -> None:
    """Give ``scratch`` the name ``target`` only if no file has it (os.link refuses an existing
    name)."""
    try:
        os.link(scratch, target)
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST, f"{str(target)!r} appeared meanwhile; it was left as it is"
        ) from None
    except OSError as error:
        if error.errno not in _NO_HARD_LINKS:
            raise
        if target.exists() or target.is_symlink():  # no hard links here: check, then rename
            raise FileExistsError(
                errno.EEXIST, f"{str(target)!r} appeared meanwhile; it was left as it is"
            ) from None
        os.replace(scratch, target)
        return
    os.unlink(scratch)


def read_input(path, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of the file or pipe at ``path`` (``<(command)`` included), opened
    without waiting for a writer: a named pipe nobody writes to reads as empty, not forever."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(descriptor, True)
    with open(descriptor, "rb") as source:
        return source.read(limit + 1)


def write_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset``, resuming after a short write; the OSError that stops
    it names the cause: ENOSPC (the disk is full) or EFBIG (the process's file size limit)."""
    done = 0
    # (released on the way out: a view left exported keeps an mmap from closing)
    with memoryview(data) as whole, whole.cast("B") as view:
        while done < len(view):
            with view[done:] as rest:
                try:
                    written = os.pwritev(fd, [rest], offset + done)
                except OSError as error:
                    if error.errno != errno.EFBIG:
                        raise
                    raise OSError(
                        errno.EFBIG,
                        "File too large: the file size limit (ulimit -f) stopped the write",
                    ) from None
            if written == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            done += written
