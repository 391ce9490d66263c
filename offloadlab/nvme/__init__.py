"""One tier further: optimizer state in files on NVMe (or any disk), crash-safe and resumable.

A :class:`FileTier` keeps a flat array of one dtype in a file, and :func:`adam_from_file` runs the
CPU AdamW step over master weights and moments kept in three such files — read a chunk, update it,
write it back — the way ZeRO-Infinity keeps optimizer state on NVMe. Sizes are bytes unless a name
says elements.

**Versions, not overwrites.** The file holds two copies ("slots") of the array, each with a header
that records the step it holds and a crc32 of every block. A step writes its new values into the
slot that does *not* hold the current version, then commits: it syncs the data and writes that
slot's header. The committed version is never touched while the next one is written, so a crash at
any moment — SIGKILL, power loss on a drive that honours its flushes, a full or failing disk —
leaves the previous step or the new one on disk, never a mixture, and :meth:`FileTier.open` resumes
from it. This costs twice the space and no extra I/O: every byte of a step is written once, which is
what a per-step journal could not do (it writes every byte twice — a redo log first, then in place),
and unlike writing a new file and renaming it, the space is reserved once at creation
(``posix_fallocate``; zeros written where the platform lacks it), so a full disk fails there with a
clear error and never in the middle of a step. (On ext4 and XFS the first write into reserved space
also converts it to written extents, so a tier's first two steps are slower than the rest.) Per step
and file the protocol adds one 4 KiB write and sync before the data — the target slot's header is
invalidated, so a half-written slot can never pass for an older complete one — and one header write
and sync after it. Checksums cost 4 bytes per block on disk and a crc32 pass over every byte written
and read: zlib's runs at about 4 GB/s on an idle core, in the I/O threads, overlapped with the
transfers — on a machine with few free cores and a fast disk the largest cost. ``checksums=False``
keeps the commit protocol (still the previous step or the new one after a crash, never a mixture)
but can no longer detect a disk that returns wrong data. ``offloadlab bench nvme`` measures both
against the same I/O without them.

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

The package's modules, bottom up: :mod:`~offloadlab.nvme.direct_io` (page-aligned memory,
durable syncs, reserved space, files named once complete), :mod:`~offloadlab.nvme.aio` (block
requests at a queue depth), :mod:`~offloadlab.nvme.format` (the superblock and slot headers),
:mod:`~offloadlab.nvme.tier` (:class:`FileTier` and its two-slot commit) and
:mod:`~offloadlab.nvme.adam` (:func:`adam_from_file`, :func:`open_state`); every name is
importable from ``offloadlab.nvme`` itself.
"""

from __future__ import annotations

from . import direct_io
from .adam import adam_from_file, open_state
from .aio import BlockQueue
from .direct_io import PAGE, aligned_empty
from .format import FORMAT_VERSION, ChecksumError
from .tier import FileTier

__all__ = [
    "FileTier",
    "ChecksumError",
    "BlockQueue",
    "adam_from_file",
    "open_state",
    "aligned_empty",
    "PAGE",
    "FORMAT_VERSION",
    "direct_io",
]
