"""The tier: a flat array of one dtype in a file, versioned by step (the two-slot commit).

A step writes its new values into the slot that does *not* hold the current version, then
commits: it syncs the data and writes that slot's header. The committed version is never touched
while the next is written, so a crash at any moment leaves the previous step or the new one on
disk, never a mixture. :mod:`offloadlab.nvme` tells the whole protocol and its costs.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
import warnings
import zlib
from array import array
from concurrent.futures import Future
from pathlib import Path

import torch

from ..files import file_name
from ..units import check_integer, format_size, is_integer, plain_scalar
from . import direct_io
from .aio import BlockQueue, all_of, checked_depth
from .direct_io import PAGE, round_up
from .format import ChecksumError, FileLayout, new_layout

__all__ = ["FileTier"]


def _identity(status: os.stat_result) -> tuple:
    """What tells one file from another that later takes its name and freed inode number."""
    return status.st_dev, status.st_ino, status.st_size, status.st_ctime_ns


class FileTier:
    """A file holding ``numel`` elements of ``dtype``, versioned by step (see the module's
    docstring).

    ``FileTier(path, numel)`` creates the file (refusing an existing one) at step 0, zero-filled or
    holding ``init``, with ``queue_depth`` block requests of ``block_bytes`` in flight and a crc32
    per block unless ``checksums=False``; :meth:`open` resumes an existing one. :meth:`read` sees
    the committed step; :meth:`write` stages the next one, which :meth:`commit` makes current (step
    + 1) and :meth:`abort` discards. A step must write every element; writes cover whole blocks
    (``start`` a multiple of :attr:`block`, the length too except at the end).
    """

    _replace_newer = False  # (open(replace_newer=True) sets it: see open())

    def __init__(
        self,
        path,
        numel: int,
        dtype=torch.float32,
        *,
        init: torch.Tensor | None = None,
        block_bytes: int = 1 << 20,
        queue_depth: int = 8,
        checksums: bool = True,
    ):
        layout = new_layout(numel, dtype, block_bytes, init, checksums)
        checked_depth(queue_depth)
        path = file_name(path)
        if not path.parent.is_dir():
            missing = "is not a folder" if path.parent.exists() else "does not exist"
            raise ValueError(f"path: folder {str(path.parent)!r} {missing}")
        if path.is_dir():
            raise ValueError(f"path: expected a file name; got {str(path)!r}, which is a folder")
        if path.exists() or path.is_symlink():
            raise ValueError(
                f"path: {str(path)!r} exists; FileTier.open resumes it, and FileTier never "
                "overwrites a file"
            )
        # Built as a file with no name (O_TMPFILE), linked to ``path`` only when complete: a crash
        # during creation leaves nothing. Where the file system lacks O_TMPFILE, a hidden
        # .offloadlab-tier-*.tmp name stands in, and a crash can leave that behind — never a
        # half-made tier under ``path``.
        fd, scratch = direct_io.file_to_name_later(path.parent)
        try:
            self._start(fd, path, layout, queue_depth)
            self._format(init)
            direct_io.link_when_complete(fd, scratch, path)
        except BaseException:
            self._shut()
            if scratch is not None:
                scratch.unlink(missing_ok=True)
            raise

    @classmethod
    def temporary(
        cls,
        folder,
        numel: int,
        dtype=torch.float32,
        *,
        init: torch.Tensor | None = None,
        block_bytes: int = 1 << 20,
        queue_depth: int = 8,
        checksums: bool = True,
    ) -> FileTier:
        """A tier whose file has no name: nothing to clean up, and nothing left however the
        process ends."""
        layout = new_layout(numel, dtype, block_bytes, init, checksums)
        checked_depth(queue_depth)
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"folder: expected an existing folder; got {str(folder)!r}")
        tier = cls.__new__(cls)
        fd = direct_io.nameless_file(folder)
        try:
            tier._start(fd, None, layout, queue_depth)
            tier._format(init)
        except BaseException:
            tier._shut()
            raise
        return tier

    @classmethod
    def open(
        cls, path, *, step: int | None = None, queue_depth: int = 8, replace_newer: bool = False
    ) -> FileTier:
        """Resume the tier in ``path`` at its newest committed step (or at ``step``, if it holds
        it). Opened at the older of its two steps, it reads that step; its first write replaces
        the newer one, whose number the commit then reuses: a warning says so, unless
        ``replace_newer`` (the newer step is known to be stale, as after a crash between files'
        commits)."""
        checked_depth(queue_depth)
        path = file_name(path)
        if step is not None:  # (numpy's integers as Python's; 1.0 and True are no step)
            step = check_integer(plain_scalar(step), "step", 0, expected="a step number ≥ 0")
        if not isinstance(replace_newer, bool):
            raise ValueError(f"replace_newer: expected True or False; got {replace_newer!r}")
        tier = cls.__new__(cls)
        tier._replace_newer = replace_newer
        fd = tier._fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"path: {str(path)!r} is not an offloadlab tier file (not a file)")
            head = os.pread(fd, PAGE, 0)
            if len(head) < PAGE:
                raise ValueError(f"path: {str(path)!r} is not an offloadlab tier file (too short)")
            layout = FileLayout.parse(head, str(path))
            tier._start(fd, path, layout, queue_depth)
            if os.fstat(fd).st_size < layout.total_bytes:
                raise OSError(
                    errno.EIO, f"path: {str(path)!r} is shorter than its header says (truncated?)"
                )
            tier._load_headers(step)
        except BaseException:
            tier._shut()
            raise
        return tier

    # --- setting up -------------------------------------------------------------------------

    def _start(self, fd: int, path: Path | None, layout: FileLayout, queue_depth: int) -> None:
        """Take the lock, reserve the space (a new file), open the I/O descriptor and the queue."""
        self._fd, self.path, self._layout = fd, path, layout
        self._identity = None  # (see remove())
        self.numel, self.dtype, self.itemsize, self.block = (
            layout.numel,
            layout.dtype,
            layout.itemsize,
            layout.block,
        )
        self.checksums = layout.checksums
        self._io_fd = None
        name = str(path) if path else "temporary tier"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(
                errno.EBUSY, f"path: {name} is open in another FileTier (it holds the file's lock)"
            ) from None
        # a new file: reserve every byte now, so a full disk fails here
        if os.fstat(fd).st_size == 0:
            try:
                direct_io.reserve(fd, layout.total_bytes)
            except OSError as error:
                raise OSError(
                    error.errno,
                    f"path: cannot reserve {format_size(layout.total_bytes)} for a tier of "
                    f"{layout.numel} × {layout.dtype} (two slots): {error.strerror}",
                ) from None
        self._io_fd, self.direct = direct_io.reopen_direct(fd)
        self._io = BlockQueue(self._io_fd, queue_depth, layout.block_bytes, name)
        self.queue_depth = queue_depth
        # the version being written: slot, crcs, written blocks, futures; begun once, under a
        # lock, however many threads write its first blocks at once
        self._pending: dict | None = None
        self._beginning = threading.Lock()

    def _format(self, init: torch.Tensor | None) -> None:
        """Write the superblock and step 0 (zeros, which the reserved space already reads as, or
        ``init``)."""
        layout = self._layout
        page = memoryview(mmap.mmap(-1, PAGE))
        page[: len(layout.superblock())] = layout.superblock()
        self._io.write(page, 0)
        # as if step -1 were in slot 1
        self._slot, self.step, self._crcs, self._held = 1, -1, None, {}
        if init is None:
            self._publish(0, 0, array("I", (self._zero_crc(b) for b in range(layout.blocks))))
        else:
            self.write(0, init.contiguous())
            self.commit()

    def _zero_crc(self, block: int) -> int:
        lo, hi = self._layout.block_elements(block)
        return zlib.crc32(bytes((hi - lo) * self.itemsize)) if self.checksums else 0

    def _load_headers(self, step: int | None) -> None:
        layout = self._layout
        self._held = {}
        for slot in (0, 1):
            view = memoryview(mmap.mmap(-1, layout.header_bytes))
            self._io.read(view, layout.header_offset(slot))
            parsed = layout.parse_slot_header(bytes(view), slot)
            if parsed is not None:
                self._held[parsed[0]] = (slot, parsed[1])
        if not self._held:
            raise ValueError(f"path: {self.path} holds no committed step (damaged header pages)")
        chosen = max(self._held) if step is None else step
        if chosen not in self._held:
            raise ValueError(
                f"step: expected one of the steps {self.path} holds, {self.steps}; got {step!r}"
            )
        self.step = chosen
        self._slot, self._crcs = self._held[chosen]

    # --- what it holds ----------------------------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """The committed steps the file holds, oldest first (one or two)."""
        return sorted(self._held)

    def _check_open(self) -> None:
        if getattr(self, "_io", None) is None:
            raise ValueError(f"FileTier: {self.path or 'temporary tier'} is closed")

    def _blocks(self, start: int, tensor: torch.Tensor, name: str) -> list[tuple[int, int, int]]:
        """Check a transfer and cut it into (block, first element, past-the-last element) pieces."""
        self._check_open()
        start = plain_scalar(start)  # (numpy's integers as Python's)
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype != self.dtype
            or not tensor.is_contiguous()
            or tensor.device.type != "cpu"
        ):
            got = (
                type(tensor).__name__
                if not isinstance(tensor, torch.Tensor)
                else tensor.dtype
                if tensor.dtype != self.dtype
                else f"a tensor on {tensor.device}"
                if tensor.device.type != "cpu"
                else "a non-contiguous tensor (.contiguous() makes one that is)"
            )
            raise ValueError(
                f"{name}: expected a contiguous host tensor of {self.dtype}; got {got}"
            )
        stop = start + tensor.numel() if is_integer(start) else None
        if not is_integer(start) or start < 0 or stop > self.numel or stop == start:
            raise ValueError(
                f"start: expected a non-empty range inside [0, {self.numel}); got {start!r}"
                f"+{tensor.numel()}"
            )
        return [
            (b, max(lo, start), min(hi, stop))
            for b in range(start // self.block, (stop - 1) // self.block + 1)
            for lo, hi in [self._layout.block_elements(b)]
        ]

    # --- reading the committed step ---------------------------------------------------------

    def read_async(self, start: int, out: torch.Tensor) -> Future:
        """Start filling ``out`` with elements ``start`` … of the committed step; returns a Future.

        Every block read is checked against its crc32 (ChecksumError on a mismatch). Leave ``out``
        alone until the Future is done.
        """
        pieces = self._blocks(start, out, "out")
        target, base = direct_io.bytes_of(out), out.data_ptr()
        slot, crcs = self._slot, self._crcs
        return all_of(
            [
                self._io.submit(
                    self._read_block,
                    slot,
                    crcs[b],
                    b,
                    lo,
                    hi,
                    target[(lo - start) * self.itemsize : (hi - start) * self.itemsize],
                    base + (lo - start) * self.itemsize,
                )
                for b, lo, hi in pieces
            ]
        )

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``start`` … ``start + out.numel()`` of the committed step."""
        self.read_async(start, out).result()

    def _read_block(
        self, slot: int, crc: int, block: int, lo: int, hi: int, view: memoryview, address: int
    ) -> None:
        """Read block ``block`` and put its elements ``lo`` … ``hi`` in ``view`` (which is at
        ``address``)."""
        first, last = self._layout.block_elements(block)
        offset = self._layout.block_offset(slot, block)
        if (lo, hi) == (first, last) and (
            not self.direct or direct_io.is_aligned(address, len(view))
        ):
            self._io.read(view, offset)  # straight into the caller's memory
            self._verify(view, crc, block)
            return
        size = (last - first) * self.itemsize
        bounce = self._io.bounce()  # part of a block, or memory O_DIRECT cannot use
        self._io.read(bounce[: round_up(size, PAGE) if self.direct else size], offset)
        self._verify(bounce[:size], crc, block)
        view[:] = bounce[(lo - first) * self.itemsize : (hi - first) * self.itemsize]

    def _verify(self, view: memoryview, crc: int, block: int) -> None:
        if self.checksums and zlib.crc32(view) != crc:
            raise ChecksumError(
                errno.EIO,
                f"{self.path or 'temporary tier'}: block {block} of step {self.step} "
                "does not match its checksum (the file is damaged)",
            )

    # --- writing the next step --------------------------------------------------------------

    def write_async(self, start: int, src: torch.Tensor) -> Future:
        """Start staging ``src`` as elements ``start`` … of the next step; returns a Future.

        Nothing is visible to :meth:`read` (or on disk after a crash) before :meth:`commit`. Leave
        ``src`` alone until the Future is done.
        """
        pieces = self._blocks(start, src, "src")
        if any((lo, hi) != self._layout.block_elements(b) for b, lo, hi in pieces):
            raise ValueError(
                f"start: expected whole blocks of {self.block} elements (the last may end at "
                f"{self.numel}); got {start}+{src.numel()}"
            )
        with self._beginning:
            if self._pending is None:
                self._begin()
        source, base, pending = direct_io.bytes_of(src), src.data_ptr(), self._pending
        futures = [
            self._io.submit(
                self._write_block,
                pending,
                b,
                source[(lo - start) * self.itemsize : (hi - start) * self.itemsize],
                base + (lo - start) * self.itemsize,
            )
            for b, lo, hi in pieces
        ]
        with pending["lock"]:
            pending["in_flight"].update(futures)
        for future in futures:
            future.add_done_callback(lambda done: self._settled(pending, done))
        return all_of(futures)

    @staticmethod
    def _settled(pending: dict, done: Future) -> None:
        """Forget a finished write, keeping its error for commit (so a step holds no list of
        every block)."""
        with pending["lock"]:
            pending["in_flight"].discard(done)
            if done.exception() is not None and pending["error"] is None:
                pending["error"] = done.exception()

    def write(self, start: int, src: torch.Tensor) -> None:
        """Stage ``src`` as elements ``start`` … of the next step (see :meth:`write_async`)."""
        self.write_async(start, src).result()

    def _begin(self) -> None:
        """Start a version in the other slot: invalidate its header first, durably, so that a crash
        while its data is half-written cannot leave a valid header over it."""
        slot = 1 - self._slot
        newer = [s for s, held in self._held.items() if held[0] == slot and s > self.step]
        if newer and not self._replace_newer:
            warnings.warn(
                f"FileTier: writing step {self.step + 1} of {self.path} from step {self.step} "
                f"replaces step {newer[0]}, the newer step this file held",
                stacklevel=4,
            )
        self._io.write(memoryview(mmap.mmap(-1, PAGE)), self._layout.header_offset(slot))
        direct_io.sync(self._io_fd)
        self._held = {s: held for s, held in self._held.items() if held[0] != slot}
        self._pending = {
            "slot": slot,
            "crcs": array("I", bytes(4 * self._layout.blocks)),
            "written": bytearray(self._layout.blocks),
            "in_flight": set(),
            "error": None,
            "lock": threading.Lock(),
        }

    def _write_block(self, pending: dict, block: int, data: memoryview, address: int) -> None:
        crc = zlib.crc32(data) if self.checksums else 0
        # the last, partial block, or unaligned memory
        if self.direct and not direct_io.is_aligned(address, len(data)):
            padded = round_up(len(data), PAGE)
            bounce = self._io.bounce()
            bounce[: len(data)] = data
            bounce[len(data) : padded] = bytes(padded - len(data))
            data = bounce[:padded]
        self._io.write(data, self._layout.block_offset(pending["slot"], block))
        pending["crcs"][block] = crc
        pending["written"][block] = 1

    def commit(self) -> int:
        """Make the staged step current and durable; returns the new step number.

        Waits for the staged writes (raising the first error, with the step still staged: call
        :meth:`abort`), refuses a step that did not write every block, then syncs the data, writes
        the slot's header and syncs again.
        """
        self._check_open()
        pending = self._pending
        if pending is None:
            raise ValueError(f"commit: nothing was written since step {self.step}")
        self._wait(pending)
        if pending["error"] is not None:
            raise pending["error"]
        missing = [b for b, done in enumerate(pending["written"]) if not done]
        if missing:
            raise ValueError(
                f"commit: a step must write every element; blocks {_spans(missing)} of "
                f"{self._layout.blocks} were not written"
            )
        direct_io.sync(self._io_fd)
        self._publish(pending["slot"], self.step + 1, pending["crcs"])
        self._pending = None
        # the next step's reads should come from the disk
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._io_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self.step

    def _publish(self, slot: int, step: int, crcs: array) -> None:
        header = self._layout.slot_header(slot, step, crcs)
        page = memoryview(mmap.mmap(-1, self._layout.header_bytes))
        page[: len(header)] = header
        self._io.write(page, self._layout.header_offset(slot))
        direct_io.sync(self._io_fd)
        self._slot, self.step, self._crcs = slot, step, crcs
        self._held[step] = (slot, crcs)

    @staticmethod
    def _wait(pending: dict) -> None:
        """Wait for every staged write still in flight (without raising their errors)."""
        with pending["lock"]:
            in_flight = list(pending["in_flight"])
        for future in in_flight:
            future.exception()

    def abort(self) -> None:
        """Discard the staged step (waiting for its writes to finish); the committed one stays
        current."""
        if self._pending is not None:
            self._wait(self._pending)
            self._pending = None

    def _rewind(self) -> None:
        """Make the previous committed step current again (after a commit whose siblings failed).

        In this process at once; on disk by invalidating the newer header. If that write fails too,
        :func:`open_state` still reopens the files at the step all of them hold.
        """
        newer = self.step
        older = [s for s in self._held if s < newer]
        if not older:
            raise RuntimeError("FileTier._rewind: no previous step is held")
        newer_slot = self._slot
        self.step = max(older)
        self._slot, self._crcs = self._held[self.step]
        del self._held[newer]
        try:
            self._io.write(memoryview(mmap.mmap(-1, PAGE)), self._layout.header_offset(newer_slot))
            direct_io.sync(self._io_fd)
        except OSError:
            pass

    # --- lifetime ---------------------------------------------------------------------------

    def _shut(self) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            self.abort()
            io.close()
            self._io = None
        if getattr(self, "_io_fd", None) not in (None, getattr(self, "_fd", None)):
            os.close(self._io_fd)
        self._io_fd = None
        if getattr(self, "_fd", None) is not None:
            self._identity = _identity(os.fstat(self._fd))  # as we leave it
            os.close(self._fd)  # releases the lock
            self._fd = None

    def close(self) -> None:
        """Discard a staged step, release the file and its lock; the file and its committed steps
        stay."""
        self._shut()

    def remove(self) -> None:
        """Close, and delete the file if its path still names this tier's file, not another's that
        took the name: while the tier is open its inode says so (the open file keeps it), once
        closed its inode, size and change time as the tier left them, and no other handle may
        hold it. Where it cannot delete, it says why and leaves the file."""
        if self.path is None:
            self._shut()
            return
        try:
            theirs = _identity(os.stat(self.path, follow_symlinks=False))
        except FileNotFoundError:
            self._shut()
            return
        if getattr(self, "_fd", None) is not None:
            mine = _identity(os.fstat(self._fd))
            if theirs == mine:
                os.unlink(self.path)
            self._shut()
        else:
            mine = self._identity
            if theirs == mine and not self._unlink_unless_held():
                return
        if theirs != mine:
            warnings.warn(
                f"FileTier.remove(): {str(self.path)!r} left in place: it is not this tier's file "
                "as the tier left it (a link, another file that took the name, or changed since)",
                stacklevel=2,
            )

    def _unlink_unless_held(self) -> bool:
        """Delete the closed tier's file unless another handle holds its lock (it says so)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            warnings.warn(
                f"FileTier.remove(): {str(self.path)!r} left in place: another FileTier holds it "
                "open",
                stacklevel=3,
            )
            return False
        else:
            if _identity(os.fstat(fd)) == self._identity:
                os.unlink(self.path)
            return True
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "FileTier cannot be pickled or copied (it holds an open file, its lock and I/O "
            "threads); pickle its path and open it again with FileTier.open(path)"
        )

    def __repr__(self):
        state = "closed" if getattr(self, "_io", None) is None else f"step {self.step}"
        return (
            f"FileTier({str(self.path) if self.path else 'temporary'!r}, {self.numel} × "
            f"{self.dtype}, {state})"
        )


def _spans(indices: list[int]) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    spans, begin = [], indices[0]
    for previous, index in zip(indices, indices[1:] + [None]):
        if index != previous + 1 if index is not None else True:
            spans.append(f"{begin}" if begin == previous else f"{begin}-{previous}")
            begin = index
    return ", ".join(spans)
