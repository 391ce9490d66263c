"""Files for a tier, and direct I/O into them: page-aligned memory, durable syncs, reserved space.

O_DIRECT moves whole pages between page-aligned memory and page-aligned file offsets, bypassing the
page cache (:func:`reopen_direct` opens a file that way where its file system allows it);
:func:`sync` makes writes durable on the device, not only in its cache; :func:`reserve` allocates a
file's space up front, so a full disk fails there and not in the middle of a step. A new tier's file
is built without a name and named once complete (:func:`file_to_name_later`,
:func:`link_when_complete`), so a crash during creation leaves nothing.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

import torch

from ..files import write_all

__all__ = [
    "PAGE",
    "round_up",
    "aligned_empty",
    "bytes_of",
    "is_aligned",
    "sync",
    "reserve",
    "reopen_direct",
    "unique_file",
    "nameless_file",
    "file_to_name_later",
    "link_when_complete",
]

PAGE = 4096  # alignment of offsets, lengths and memory for O_DIRECT on common devices


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def aligned_empty(numel: int, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised host tensor on page-aligned memory, which O_DIRECT transfers use in
    place."""
    size = torch.tensor([], dtype=dtype).element_size() * numel
    memory = mmap.mmap(-1, max(PAGE, round_up(size, PAGE)))
    return torch.frombuffer(memory, dtype=torch.uint8, count=size).view(dtype)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def is_aligned(address: int, length: int) -> bool:
    """Whether O_DIRECT can move ``length`` bytes at ``address`` in place (else: a bounce
    buffer)."""
    return address % PAGE == 0 and length % PAGE == 0


def sync(fd: int) -> None:
    """Make what was written to ``fd`` durable: on the device, not only in its volatile cache."""
    if hasattr(fcntl, "F_FULLFSYNC"):  # macOS: fsync alone leaves data in the drive's cache
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` for the file now, so that writing into them later cannot run out of
    space. posix_fallocate where the platform has it (Linux); elsewhere (macOS) zeros are
    written."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)
        return
    zeros = bytes(1 << 20)
    for offset in range(0, nbytes, len(zeros)):
        write_all(fd, zeros[: min(len(zeros), nbytes - offset)], offset)


def reopen_direct(fd: int) -> tuple[int, bool]:
    """A second descriptor of the same file with O_DIRECT, if the file system takes it (and a direct
    read of the first page succeeds); otherwise ``fd`` itself."""
    if not hasattr(os, "O_DIRECT") or not os.path.exists(f"/proc/self/fd/{fd}"):
        return fd, False
    try:
        direct = os.open(
            f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        )
    except OSError:
        return fd, False
    try:
        os.preadv(direct, [mmap.mmap(-1, PAGE)], 0)
    except OSError:
        os.close(direct)
        return fd, False
    return direct, True


def unique_file(folder: Path) -> tuple[int, Path]:
    """A new file in ``folder`` under a fresh random name (O_EXCL|O_NOFOLLOW: no one can have
    planted it)."""
    while True:
        scratch = folder / f".offloadlab-tier-{os.urandom(6).hex()}.tmp"
        try:
            flags = (
                os.O_RDWR
                | os.O_CREAT
                | os.O_EXCL
                | getattr(os, "O_NOFOLLOW", 0)
                | getattr(os, "O_CLOEXEC", 0)
            )
            return os.open(scratch, flags, 0o600), scratch
        except FileExistsError:
            continue


def nameless_file(folder: Path) -> int:
    """A new file in ``folder`` with no name: O_TMPFILE where the file system has it, else a
    fresh name removed at once. Its space is freed when the last descriptor closes, however the
    process ends."""
    fd, scratch = file_to_name_later(folder)
    if scratch is not None:
        os.unlink(scratch)
    return fd


def file_to_name_later(folder: Path) -> tuple[int, Path | None]:
    """A new file in ``folder`` that :func:`link_when_complete` names when it is complete:
    (descriptor, None) for a nameless O_TMPFILE file that /proc can link, else (descriptor,
    hidden scratch name)."""
    if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:  # (no O_EXCL: the file may be linked later)
            return os.open(
                folder, os.O_RDWR | os.O_TMPFILE | getattr(os, "O_CLOEXEC", 0), 0o600
            ), None
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    return unique_file(folder)


def link_when_complete(fd: int, scratch: Path | None, path: Path) -> None:
    """Give the finished file (``fd``, or its ``scratch`` name) the name ``path``, refusing if
    ``path`` appeared meanwhile."""
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        try:
            # linkat(…, AT_SYMLINK_FOLLOW): Python calls linkat only when given a folder fd
            if scratch is None:
                os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=folder, follow_symlinks=True)
            else:
                os.link(scratch, path)
        except FileExistsError:
            raise ValueError(
                f"path: {str(path)!r} appeared while the tier was being created; it was left as "
                f"it is"
            ) from None
        if scratch is not None:
            os.unlink(scratch)
        os.fsync(folder)
    finally:
        os.close(folder)
