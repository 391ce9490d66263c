"""One tier further: optimizer state in files on NVMe (or any disk), crash-safe and resumable.

A :class:`FileTier` keeps a flat array of one dtype in a file, and :func:`adam_from_file` runs the
CPU AdamW step over master weights and moments kept in three such files — read a chunk, update it,
write it back — the way ZeRO-Infinity keeps optimizer state on NVMe. Sizes are bytes unless a name
says elements.

**Versions, not overwrites.** The file holds two copies ("slots") of the array, each with a header
that records the step it holds and a crc32 of every block. A step writes its new values into the
slot that does *not* hold the current version, then commits: it syncs the data and writes that
slot's header. The committed version is never touched while the next one is written, so a crash
at any moment — SIGKILL, power loss on a drive that honours its flushes, a full or failing disk —
leaves the previous step or the new one on disk, never a mixture, and :meth:`FileTier.open` resumes from it. This costs twice the
space and no extra I/O: every byte of a step is written once, which is what a per-step journal
could not do (it writes every byte twice — a redo log first, then in place), and unlike writing a
new file and renaming it, the space is reserved once at creation (``posix_fallocate``; zeros
written where the platform lacks it), so a full
disk fails there with a clear error and never in the middle of a step. (On ext4 and XFS the
first write into reserved space also converts it to written extents, so a tier's first two steps
are slower than the rest.) Per step and file the protocol adds one 4 KiB write and sync before the
data — the target slot's header is invalidated, so a half-written slot can never pass for an
older complete one — and one header write and sync after it. Checksums cost 4 bytes per block on
disk and a crc32 pass over every byte written and read: zlib's runs at about 4 GB/s on an idle
core, in the I/O threads, overlapped with the transfers — on a machine with few free cores and a
fast disk the largest cost. ``checksums=False`` keeps the commit protocol (still the previous step
or the new one after a crash, never a mixture) but can no longer detect a disk that returns wrong
data. ``offloadlab bench nvme`` measures both against the same I/O without them.

**Several files, one step.** :func:`adam_from_file` commits master, exp_avg and exp_avg_sq one
after another; each file keeps its previous version until the next step begins, so after a crash
between two commits every file still holds the older step, and :func:`open_state` reopens all
three at the newest step they all hold. After any error inside the step — a failed read, write or
checksum, an interrupt — the three are back at the previous step in this process as well.

**Asynchronous I/O at a queue depth.** Transfers are cut into blocks (``block_bytes``, 1 MiB by
default, DeepSpeed's ``aio`` block size) and run on ``queue_depth`` threads that each issue one
``preadv``/``pwritev`` at a time (the GIL is released during each), so up to ``queue_depth`` block
requests are in flight: the depth an NVMe drive needs to reach its rated bandwidth. Threads over a
stdlib system call are portable and need no build step; io_uring is not in Python's standard
library, and libaio (what DeepSpeed's ``aio`` uses) needs a compiled extension. Where the file
system allows it the file is opened with ``O_DIRECT`` (no page cache: the disk's rate, not
memory's) and every transfer goes through page-aligned memory: tensors from
:func:`aligned_empty` are read and written in place, any other tensor through a per-thread
bounce buffer.

**Ownership by handle.** A tier holds an exclusive lock (``flock``) on its file while open, so a
second :class:`FileTier` cannot open the same file; :meth:`~FileTier.close` never deletes
anything, and :meth:`~FileTier.remove` unlinks the path only if it still names this handle's file.
A tier's file is its state: it outlives :meth:`~FileTier.close` and the process (also a process
that exits without closing: the kernel drops the lock, the last committed step stays on disk).
For scratch state that must not outlive the process, :meth:`FileTier.temporary` makes a file
with no name at all, which the kernel frees when the process ends, however it ends.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import threading
import time
import zlib
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from . import cpu_adam
from .units import format_size

__all__ = ["FileTier", "ChecksumError", "BlockQueue", "adam_from_file", "open_state", "aligned_empty"]

PAGE = 4096  # alignment of offsets, lengths and memory for O_DIRECT on common devices
FORMAT_VERSION = 1
_MAGIC = b"OFFLOADLAB-TIER\n"
_SLOT_MAGIC = b"OFFLOADLAB-SLOT\n"
# magic, version, dtype, itemsize, numel, block bytes, blocks, header bytes, slot bytes, checksums (0 or 1)
_SUPERBLOCK = struct.Struct("<16sI16sIQQQQQI")
_SLOT_HEAD = struct.Struct("<16sIQQ")  # magic, slot, step, blocks; then one crc32 per block, then the header's crc32
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                      torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)}
_LARGEST_FILE = 2**63 - 1  # off_t


class ChecksumError(OSError):
    """Data read from a tier does not match the checksum its header recorded (EIO)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def aligned_empty(numel: int, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised host tensor on page-aligned memory, which O_DIRECT transfers use in place."""
    size = torch.tensor([], dtype=dtype).element_size() * numel
    memory = mmap.mmap(-1, max(PAGE, _round_up(size, PAGE)))
    return torch.frombuffer(memory, dtype=torch.uint8, count=size).view(dtype)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def _sync(fd: int) -> None:
    """Make what was written to ``fd`` durable: on the device, not only in its volatile cache."""
    if hasattr(fcntl, "F_FULLFSYNC"):  # macOS: fsync alone leaves data in the drive's cache
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` for the file now, so that writing into them later cannot run out of space.
    posix_fallocate where the platform has it (Linux); elsewhere (macOS) zeros are written."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)
        return
    zeros = bytes(1 << 20)
    for offset in range(0, nbytes, len(zeros)):
        chunk = zeros[:min(len(zeros), nbytes - offset)]
        if os.pwrite(fd, chunk, offset) != len(chunk):
            raise OSError(errno.ENOSPC, "No space left on device")


def _checked_depth(depth) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 1024:
        raise ValueError(f"queue_depth: expected an integer from 1 to 1024; got {depth!r}")
    return depth


class BlockQueue:
    """Block reads and writes on one file, ``depth`` of them in flight at a time.

    Each request is one ``preadv``/``pwritev`` of a whole number of pages at a page-aligned offset,
    run on one of ``depth`` threads; :meth:`submit` returns a Future. A short read means the file is
    shorter than expected (truncated), a short write that the disk is full: both raise instead of
    retrying, so nothing spins on a damaged file.
    """

    def __init__(self, fd: int, depth: int, bounce_bytes: int, name: str = "file"):
        self.fd, self.depth, self.name = fd, _checked_depth(depth), name
        self._bounce_bytes = _round_up(bounce_bytes, PAGE)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="offloadlab-io")

    def bounce(self) -> memoryview:
        """This thread's page-aligned scratch buffer (for unaligned tensors and partial blocks)."""
        if not hasattr(self._local, "buffer"):
            self._local.buffer = mmap.mmap(-1, self._bounce_bytes)
        return memoryview(self._local.buffer)

    def read(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset`` (blocking, in the calling thread)."""
        got = os.preadv(self.fd, [view], offset)
        if got != len(view):
            raise OSError(errno.EIO, f"{self.name}: {got} of {len(view)} bytes at offset {offset}: "
                                     "the file is shorter than its header says (truncated?)")

    def write(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset`` (blocking, in the calling thread)."""
        done = os.pwritev(self.fd, [view], offset)
        if done != len(view):
            raise OSError(errno.ENOSPC, f"{self.name}: {done} of {len(view)} bytes written at offset {offset}")

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _gather(futures: list[Future]) -> Future:
    """One Future for many: done when all are, with the first exception if any failed."""
    result: Future = Future()
    if not futures:
        result.set_result(None)
        return result
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result(None)

    for future in futures:
        future.add_done_callback(one_done)
    return result


class _Layout:
    """Where everything is in a tier file: a 4 KiB superblock, two slot headers, two data slots."""

    def __init__(self, dtype: torch.dtype, numel: int, block_bytes: int, checksums: bool = True):
        self.dtype, self.numel, self.block_bytes, self.checksums = dtype, numel, block_bytes, checksums
        self.itemsize = torch.tensor([], dtype=dtype).element_size()
        self.block = block_bytes // self.itemsize  # elements per block
        self.blocks = -(-numel // self.block)
        self.header_bytes = _round_up(_SLOT_HEAD.size + 4 * self.blocks + 4, PAGE)
        self.slot_bytes = self.blocks * block_bytes
        self.total_bytes = PAGE + 2 * self.header_bytes + 2 * self.slot_bytes

    def header_offset(self, slot: int) -> int:
        return PAGE + slot * self.header_bytes

    def block_offset(self, slot: int, block: int) -> int:
        return PAGE + 2 * self.header_bytes + slot * self.slot_bytes + block * self.block_bytes

    def block_elements(self, block: int) -> tuple[int, int]:
        return block * self.block, min((block + 1) * self.block, self.numel)

    def superblock(self) -> bytes:
        body = _SUPERBLOCK.pack(_MAGIC, FORMAT_VERSION, str(self.dtype).removeprefix("torch.").encode(),
                                self.itemsize, self.numel, self.block_bytes, self.blocks, self.header_bytes,
                                self.slot_bytes, int(self.checksums))
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def parse(cls, data: bytes, name: str) -> _Layout:
        body, (crc,) = data[:_SUPERBLOCK.size], struct.unpack_from("<I", data, _SUPERBLOCK.size)
        magic, version, dtype, itemsize, numel, block_bytes, blocks, header_bytes, slot_bytes, checksums = \
            _SUPERBLOCK.unpack(body)
        if magic != _MAGIC or zlib.crc32(body) != crc:
            raise ValueError(f"path: {name} is not an offloadlab tier file (or its first page is damaged)")
        if version != FORMAT_VERSION:
            raise ValueError(f"path: {name} is tier format {version}; this offloadlab reads format {FORMAT_VERSION}")
        dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
        if dtype not in _DTYPES:
            raise ValueError(f"path: {name} holds {dtype!r} elements, which this offloadlab cannot read")
        layout = cls(_DTYPES[dtype], numel, block_bytes, bool(checksums))
        if (layout.itemsize, layout.blocks, layout.header_bytes, layout.slot_bytes) != \
                (itemsize, blocks, header_bytes, slot_bytes):
            raise ValueError(f"path: {name} has an inconsistent header")
        return layout

    def slot_header(self, slot: int, step: int, crcs: array) -> bytes:
        body = _SLOT_HEAD.pack(_SLOT_MAGIC, slot, step, self.blocks) + crcs.tobytes()
        return body + struct.pack("<I", zlib.crc32(body))

    def parse_slot_header(self, data: bytes, slot: int) -> tuple[int, array] | None:
        """(step, crcs) of a valid header for ``slot``, or None (never written, invalidated or torn)."""
        size = _SLOT_HEAD.size + 4 * self.blocks
        magic, which, step, blocks = _SLOT_HEAD.unpack_from(data)
        if magic != _SLOT_MAGIC or which != slot or blocks != self.blocks:
            return None
        if zlib.crc32(data[:size]) != struct.unpack_from("<I", data, size)[0]:
            return None
        crcs = array("I")
        crcs.frombytes(data[_SLOT_HEAD.size:size])
        if crcs.itemsize != 4:  # array('I') is 4 bytes on every platform torch supports
            raise RuntimeError("array('I') is not 32-bit here")
        return step, crcs


def _aligned(address: int, length: int) -> bool:
    """Whether O_DIRECT can move ``length`` bytes at ``address`` in place (else: a bounce buffer)."""
    return address % PAGE == 0 and length % PAGE == 0


def _new_layout(numel, dtype, block_bytes, init, checksums) -> _Layout:
    """The layout of a new tier, every argument checked before any file is made."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
        raise ValueError(f"numel: expected a positive integer; got {numel!r}")
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}; got {dtype!r}")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0 \
            or block_bytes % PAGE or block_bytes > 1 << 30:
        raise ValueError(f"block_bytes: expected a multiple of 4096 up to 1 GiB; got {block_bytes!r}")
    if not isinstance(checksums, bool):
        raise ValueError(f"checksums: expected True or False; got {checksums!r}")
    layout = _Layout(dtype, numel, block_bytes, checksums)
    if layout.total_bytes > _LARGEST_FILE:
        raise ValueError(f"numel: expected a tier that fits in a file; got {numel} elements "
                         f"({layout.total_bytes} bytes with both slots)")
    if init is not None and (not isinstance(init, torch.Tensor) or init.dtype != dtype or init.numel() != numel
                             or init.device.type != "cpu"):
        raise ValueError(f"init: expected a host tensor of {numel} elements of {dtype}; got {init!r}")
    return layout


class FileTier:
    """A file holding ``numel`` elements of ``dtype``, versioned by step (see the module's docstring).

    ``FileTier(path, numel)`` creates the file (refusing an existing one) at step 0, zero-filled or
    holding ``init``, with ``queue_depth`` block requests of ``block_bytes`` in flight and a crc32 per
    block unless ``checksums=False``; :meth:`open` resumes an existing one. :meth:`read` sees the committed step;
    :meth:`write` stages the next one, which :meth:`commit` makes current (step + 1) and
    :meth:`abort` discards. A step must write every element; writes cover whole blocks
    (``start`` a multiple of :attr:`block`, the length too except at the end).
    """

    def __init__(self, path, numel: int, dtype=torch.float32, *, init: torch.Tensor | None = None,
                 block_bytes: int = 1 << 20, queue_depth: int = 8, checksums: bool = True):
        layout = _new_layout(numel, dtype, block_bytes, init, checksums)
        _checked_depth(queue_depth)
        if not str(path):
            raise ValueError("path: expected a file name; got ''")
        path = Path(path)
        if not path.parent.is_dir():
            raise ValueError(f"path: folder {str(path.parent)!r} does not exist")
        if path.is_dir():
            raise ValueError(f"path: expected a file name; got {str(path)!r}, which is a folder")
        if path.exists() or path.is_symlink():
            raise ValueError(f"path: {str(path)!r} exists; FileTier.open resumes it, and FileTier never "
                             "overwrites a file")
        # Built as a file with no name (O_TMPFILE), linked to ``path`` only when complete: a crash during
        # creation leaves nothing. Where the file system lacks O_TMPFILE, a hidden .offloadlab-tier-*.tmp
        # name stands in, and a crash can leave that behind — never a half-made tier under ``path``.
        fd, scratch = _file_to_name_later(path.parent)
        try:
            self._start(fd, path, layout, queue_depth)
            self._format(init)
            _link(fd, scratch, path)
        except BaseException:
            self._shut()
            if scratch is not None:
                scratch.unlink(missing_ok=True)
            raise

    @classmethod
    def temporary(cls, folder, numel: int, dtype=torch.float32, *, init: torch.Tensor | None = None,
                  block_bytes: int = 1 << 20, queue_depth: int = 8, checksums: bool = True) -> FileTier:
        """A tier whose file has no name: nothing to clean up, and nothing left however the process ends."""
        layout = _new_layout(numel, dtype, block_bytes, init, checksums)
        _checked_depth(queue_depth)
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"folder: expected an existing folder; got {str(folder)!r}")
        tier = cls.__new__(cls)
        fd = _nameless_file(folder)
        try:
            tier._start(fd, None, layout, queue_depth)
            tier._format(init)
        except BaseException:
            tier._shut()
            raise
        return tier

    @classmethod
    def open(cls, path, *, step: int | None = None, queue_depth: int = 8) -> FileTier:
        """Resume the tier in ``path`` at its newest committed step (or at ``step``, if it holds it)."""
        _checked_depth(queue_depth)
        path = Path(path)
        tier = cls.__new__(cls)
        fd = tier._fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            head = os.pread(fd, PAGE, 0)
            if len(head) < PAGE:
                raise ValueError(f"path: {str(path)!r} is not an offloadlab tier file (too short)")
            layout = _Layout.parse(head, str(path))
            tier._start(fd, path, layout, queue_depth)
            if os.fstat(fd).st_size < layout.total_bytes:
                raise OSError(errno.EIO, f"path: {str(path)!r} is shorter than its header says (truncated?)")
            tier._load_headers(step)
        except BaseException:
            tier._shut()
            raise
        return tier

    # --- setting up -------------------------------------------------------------------------

    def _start(self, fd: int, path: Path | None, layout: _Layout, queue_depth: int) -> None:
        """Take the lock, reserve the space (a new file), open the I/O descriptor and the queue."""
        self._fd, self.path, self._layout = fd, path, layout
        identity = os.fstat(fd)
        self._identity = (identity.st_dev, identity.st_ino)  # which file is ours, whatever its path names later
        self.numel, self.dtype, self.itemsize, self.block = layout.numel, layout.dtype, layout.itemsize, layout.block
        self.checksums = layout.checksums
        self._io_fd = None
        name = str(path) if path else "temporary tier"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, f"path: {name} is open in another FileTier (it holds the file's lock)") from None
        if os.fstat(fd).st_size == 0:  # a new file: reserve every byte now, so a full disk fails here
            try:
                _reserve(fd, layout.total_bytes)
            except OSError as error:
                raise OSError(error.errno, f"path: cannot reserve {format_size(layout.total_bytes)} for a tier of "
                                           f"{layout.numel} × {layout.dtype} (two slots): {error.strerror}") from None
        self._io_fd, self.direct = _reopen_direct(fd)
        self._io = BlockQueue(self._io_fd, queue_depth, layout.block_bytes, name)
        self.queue_depth = queue_depth
        self._pending: dict | None = None  # the version being written: slot, crcs, written blocks, futures

    def _format(self, init: torch.Tensor | None) -> None:
        """Write the superblock and step 0 (zeros, which the reserved space already reads as, or ``init``)."""
        layout = self._layout
        page = memoryview(mmap.mmap(-1, PAGE))
        page[:len(layout.superblock())] = layout.superblock()
        self._io.write(page, 0)
        self._slot, self.step, self._crcs, self._held = 1, -1, None, {}  # as if step -1 were in slot 1
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
            raise ValueError(f"step: expected one of the steps {self.path} holds, {self.steps}; got {step!r}")
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
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype or not tensor.is_contiguous() \
                or tensor.device.type != "cpu":
            raise ValueError(f"{name}: expected a contiguous host tensor of {self.dtype}; got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        stop = start + tensor.numel() if isinstance(start, int) else None
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or stop > self.numel or stop == start:
            raise ValueError(f"start: expected a non-empty range inside [0, {self.numel}); got {start!r}"
                             f"+{tensor.numel()}")
        return [(b, max(lo, start), min(hi, stop)) for b in range(start // self.block, (stop - 1) // self.block + 1)
                for lo, hi in [self._layout.block_elements(b)]]

    # --- reading the committed step ---------------------------------------------------------

    def read_async(self, start: int, out: torch.Tensor) -> Future:
        """Start filling ``out`` with elements ``start`` … of the committed step; returns a Future.

        Every block read is checked against its crc32 (ChecksumError on a mismatch). Leave ``out``
        alone until the Future is done.
        """
        pieces = self._blocks(start, out, "out")
        target, base = _bytes_of(out), out.data_ptr()
        slot, crcs = self._slot, self._crcs
        return _gather([self._io.submit(self._read_block, slot, crcs[b], b, lo, hi,
                                        target[(lo - start) * self.itemsize:(hi - start) * self.itemsize],
                                        base + (lo - start) * self.itemsize)
                        for b, lo, hi in pieces])

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``start`` … ``start + out.numel()`` of the committed step."""
        self.read_async(start, out).result()

    def _read_block(self, slot: int, crc: int, block: int, lo: int, hi: int, view: memoryview, address: int) -> None:
        """Read block ``block`` and put its elements ``lo`` … ``hi`` in ``view`` (which is at ``address``)."""
        first, last = self._layout.block_elements(block)
        offset = self._layout.block_offset(slot, block)
        if (lo, hi) == (first, last) and (not self.direct or _aligned(address, len(view))):
            self._io.read(view, offset)  # straight into the caller's memory
            self._verify(view, crc, block)
            return
        size = (last - first) * self.itemsize
        bounce = self._io.bounce()  # part of a block, or memory O_DIRECT cannot use
        self._io.read(bounce[:_round_up(size, PAGE) if self.direct else size], offset)
        self._verify(bounce[:size], crc, block)
        view[:] = bounce[(lo - first) * self.itemsize:(hi - first) * self.itemsize]

    def _verify(self, view: memoryview, crc: int, block: int) -> None:
        if self.checksums and zlib.crc32(view) != crc:
            raise ChecksumError(errno.EIO, f"{self.path or 'temporary tier'}: block {block} of step {self.step} "
                                           "does not match its checksum (the file is damaged)")

    # --- writing the next step --------------------------------------------------------------

    def write_async(self, start: int, src: torch.Tensor) -> Future:
        """Start staging ``src`` as elements ``start`` … of the next step; returns a Future.

        Nothing is visible to :meth:`read` (or on disk after a crash) before :meth:`commit`. Leave
        ``src`` alone until the Future is done.
        """
        pieces = self._blocks(start, src, "src")
        if any((lo, hi) != self._layout.block_elements(b) for b, lo, hi in pieces):
            raise ValueError(f"start: expected whole blocks of {self.block} elements (the last may end at "
                             f"{self.numel}); got {start}+{src.numel()}")
        if self._pending is None:
            self._begin()
        source, base, pending = _bytes_of(src), src.data_ptr(), self._pending
        futures = [self._io.submit(self._write_block, pending, b,
                                   source[(lo - start) * self.itemsize:(hi - start) * self.itemsize],
                                   base + (lo - start) * self.itemsize)
                   for b, lo, hi in pieces]
        with pending["lock"]:
            pending["in_flight"].update(futures)
        for future in futures:
            future.add_done_callback(lambda done: self._settled(pending, done))
        return _gather(futures)

    @staticmethod
    def _settled(pending: dict, done: Future) -> None:
        """Forget a finished write, keeping its error for commit (so a step holds no list of every block)."""
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
        self._io.write(memoryview(mmap.mmap(-1, PAGE)), self._layout.header_offset(slot))
        _sync(self._io_fd)
        self._held = {s: held for s, held in self._held.items() if held[0] != slot}
        self._pending = {"slot": slot, "crcs": array("I", bytes(4 * self._layout.blocks)),
                         "written": bytearray(self._layout.blocks), "in_flight": set(), "error": None,
                         "lock": threading.Lock()}

    def _write_block(self, pending: dict, block: int, data: memoryview, address: int) -> None:
        crc = zlib.crc32(data) if self.checksums else 0
        if self.direct and not _aligned(address, len(data)):  # the last, partial block, or unaligned memory
            padded = _round_up(len(data), PAGE)
            bounce = self._io.bounce()
            bounce[:len(data)] = data
            bounce[len(data):padded] = bytes(padded - len(data))
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
            raise ValueError(f"commit: a step must write every element; blocks {_spans(missing)} of "
                             f"{self._layout.blocks} were not written")
        _sync(self._io_fd)
        self._publish(pending["slot"], self.step + 1, pending["crcs"])
        self._pending = None
        if not self.direct and hasattr(os, "posix_fadvise"):  # the next step's reads should come from the disk
            os.posix_fadvise(self._io_fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self.step

    def _publish(self, slot: int, step: int, crcs: array) -> None:
        header = self._layout.slot_header(slot, step, crcs)
        page = memoryview(mmap.mmap(-1, self._layout.header_bytes))
        page[:len(header)] = header
        self._io.write(page, self._layout.header_offset(slot))
        _sync(self._io_fd)
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
        """Discard the staged step (waiting for its writes to finish); the committed one stays current."""
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
            _sync(self._io_fd)
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
            os.close(self._fd)  # releases the lock
            self._fd = None

    def close(self) -> None:
        """Discard a staged step, release the file and its lock; the file and its committed steps stay."""
        self._shut()

    def remove(self) -> None:
        """Close, and delete the file if its path still names this tier's file (not another's)."""
        self._shut()
        if self.path is None:
            return
        try:
            theirs = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (theirs.st_dev, theirs.st_ino) == self._identity:
            os.unlink(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if getattr(self, "_io", None) is None else f"step {self.step}"
        return f"FileTier({str(self.path) if self.path else 'temporary'!r}, {self.numel} × {self.dtype}, {state})"


def _spans(indices: list[int]) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]."""
    spans, begin = [], indices[0]
    for previous, index in zip(indices, indices[1:] + [None]):
        if index != previous + 1 if index is not None else True:
            spans.append(f"{begin}" if begin == previous else f"{begin}-{previous}")
            begin = index
    return ", ".join(spans)


def _unique_file(folder: Path) -> tuple[int, Path]:
    """A new file in ``folder`` under a fresh random name (O_EXCL|O_NOFOLLOW: no one can have planted it)."""
    while True:
        scratch = folder / f".offloadlab-tier-{os.urandom(6).hex()}.tmp"
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            return os.open(scratch, flags, 0o600), scratch
        except FileExistsError:
            continue


def _nameless_file(folder: Path) -> int:
    """A new file in ``folder`` with no name: O_TMPFILE where the file system has it, else a fresh
    name removed at once. Its space is freed when the last descriptor closes, however the process ends."""
    fd, scratch = _file_to_name_later(folder)
    if scratch is not None:
        os.unlink(scratch)
    return fd


def _file_to_name_later(folder: Path) -> tuple[int, Path | None]:
    """A new file in ``folder`` that :func:`_link` names when it is complete: (descriptor, None) for a
    nameless O_TMPFILE file that /proc can link, else (descriptor, hidden scratch name)."""
    if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:  # (no O_EXCL: the file may be linked later)
            return os.open(folder, os.O_RDWR | os.O_TMPFILE | getattr(os, "O_CLOEXEC", 0), 0o600), None
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    return _unique_file(folder)


def _link(fd: int, scratch: Path | None, path: Path) -> None:
    """Give the finished file (``fd``, or its ``scratch`` name) the name ``path``, refusing if
    ``path`` appeared meanwhile."""
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        try:
            if scratch is None:  # linkat(…, AT_SYMLINK_FOLLOW): Python calls linkat only when given a folder fd
                os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=folder, follow_symlinks=True)
            else:
                os.link(scratch, path)
        except FileExistsError:
            raise ValueError(f"path: {str(path)!r} appeared while the tier was being created; it was left as "
                             f"it is") from None
        if scratch is not None:
            os.unlink(scratch)
        os.fsync(folder)
    finally:
        os.close(folder)


def _reopen_direct(fd: int) -> tuple[int, bool]:
    """A second descriptor of the same file with O_DIRECT, if the file system takes it (and a direct
    read of the first page succeeds); otherwise ``fd`` itself."""
    if not hasattr(os, "O_DIRECT") or not os.path.exists(f"/proc/self/fd/{fd}"):
        return fd, False
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return fd, False
    try:
        os.preadv(direct, [mmap.mmap(-1, PAGE)], 0)
    except OSError:
        os.close(direct)
        return fd, False
    return direct, True


def open_state(*paths, queue_depth: int = 8) -> list[FileTier]:
    """Open the files of one optimizer state (e.g. master, exp_avg, exp_avg_sq) at the newest step
    they all hold: the step a crash between two of :func:`adam_from_file`'s commits left complete."""
    if not paths:
        raise ValueError("paths: expected the files of one optimizer state (e.g. master, exp_avg, exp_avg_sq); got none")
    tiers = []
    try:
        for path in paths:
            tiers.append(FileTier.open(path, queue_depth=queue_depth))
        common = set.intersection(*(set(t.steps) for t in tiers))
        if not common:
            raise ValueError("paths: the files hold no common step: " +
                             ", ".join(f"{t.path} {t.steps}" for t in tiers))
        step = max(common)
        for i, tier in enumerate(tiers):
            if tier.step != step:
                tier.close()
                tiers[i] = FileTier.open(paths[i], step=step, queue_depth=queue_depth)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def adam_from_file(master: FileTier, exp_avg: FileTier, exp_avg_sq: FileTier, grad: torch.Tensor,
                   out: torch.Tensor | None = None, *, step: int | None = None, lr: float, chunk: int | None = None,
                   **adam) -> dict:
    """One AdamW step over fp32 state kept in three tiers, ``chunk`` elements at a time, as one transaction.

    ``step`` (1-based, for bias correction) must be one more than the tiers' committed step, which
    it is by default. While chunk i is updated, the reads of chunk i+1 and the writes of chunk i-1
    are in flight (two buffer sets). All three files commit at the end; after any error, or an
    interrupt, all three are at the previous step again (``out`` may hold part of the new weights).

    Returns seconds: 'read' (waiting for reads), 'update' (the CPU step), 'write' (waiting for
    writes, including the commit's syncs) and 'other' (the rest: handing blocks to the I/O
    threads, invalidating each file's old header before its first write). They add up to the
    step's time; 'read' + 'write' is the disk time the update did not hide.
    """
    tiers = (master, exp_avg, exp_avg_sq)
    for name, tier in zip(("master", "exp_avg", "exp_avg_sq"), tiers):
        if not isinstance(tier, FileTier) or tier.dtype != torch.float32:
            raise ValueError(f"{name}: expected a FileTier of torch.float32; got {tier!r}")
        tier._check_open()
    if len({id(t) for t in tiers}) != 3:
        raise ValueError("exp_avg: expected three different tiers for master, exp_avg and exp_avg_sq; got one twice")
    if not (master.numel == exp_avg.numel == exp_avg_sq.numel == grad.numel()):
        raise ValueError("grad: expected as many elements as each state file holds")
    if len({t.step for t in tiers}) != 1:
        raise ValueError(f"exp_avg: expected the three files at one step; got steps {[t.step for t in tiers]} "
                         "(open_state reopens them at the step they all hold)")
    step = master.step + 1 if step is None else step
    if step != master.step + 1:
        raise ValueError(f"step: expected {master.step + 1}, one more than the files' committed step; got {step!r}")
    block = master.block
    if exp_avg.block != block or exp_avg_sq.block != block:
        raise ValueError(f"exp_avg: expected the three files to share one block size; got "
                         f"{[t.block for t in tiers]} elements")
    chunk = chunk or block * max(1, master.queue_depth // 2)  # reads of one chunk + writes of another fill the depth
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 or chunk % block:
        raise ValueError(f"chunk: expected a positive multiple of the tiers' block ({block} elements); got {chunk!r}")
    n = master.numel
    chunk = min(chunk, _round_up(n, block))
    starts = list(range(0, n, chunk))
    sets = [[aligned_empty(chunk) for _ in tiers] for _ in range(2)]
    seconds = {"read": 0.0, "update": 0.0, "write": 0.0, "other": 0.0}
    started = time.perf_counter()

    def transfer(i, method):
        begin, end = starts[i], min(starts[i] + chunk, n)
        return _gather([getattr(tier, method)(begin, buffer[:end - begin]) for tier, buffer in zip(tiers, sets[i % 2])])

    def waited(future, key):
        begin = time.perf_counter()
        future.result()
        seconds[key] += time.perf_counter() - begin

    committed, reads, writes = [], {}, {}
    try:
        reads[0] = transfer(0, "read_async")
        for i, begin in enumerate(starts):
            waited(reads.pop(i), "read")
            if i + 1 < len(starts):
                if i - 1 in writes:  # chunk i+1 reads into the buffers chunk i-1 is written from
                    waited(writes.pop(i - 1), "write")
                reads[i + 1] = transfer(i + 1, "read_async")
            end = min(begin + chunk, n)
            p, m, v = (buffer[:end - begin] for buffer in sets[i % 2])
            t0 = time.perf_counter()
            cpu_adam.adamw_step(p, m, v, grad[begin:end], None if out is None else out[begin:end],
                                step=step, lr=lr, **adam)
            seconds["update"] += time.perf_counter() - t0
            writes[i] = transfer(i, "write_async")
        t0 = time.perf_counter()
        for future in writes.values():
            future.result()
        for tier in tiers:
            tier.commit()
            committed.append(tier)
        seconds["write"] += time.perf_counter() - t0
        seconds["other"] = time.perf_counter() - started - seconds["read"] - seconds["update"] - seconds["write"]
    except BaseException:
        for future in list(reads.values()) + list(writes.values()):
            future.exception()  # let the transfers into and out of our buffers finish first
        for tier in tiers:
            if tier in committed:
                tier._rewind()
            else:
                tier.abort()
        raise
    return seconds
