"""One tier further: optimizer state in files on NVMe (or any disk), crash-safe and resumable.

A :class:`FileTier` keeps a flat array of one dtype in a file; :func:`adam_from_file` runs the CPU
AdamW step over master weights and moments kept in three of them, chunk by chunk, as
ZeRO-Infinity keeps optimizer state on NVMe. Sizes are bytes unless a name says elements.

- **Versions, not overwrites**: each file holds two slots; a step writes the slot that does not
  hold the current version, syncs, then writes and syncs its header (crc32 of every block
  included). A crash leaves the old step or the new, never a mixture; every byte is written once;
  the space is reserved at creation, so a full disk fails there and not mid-step.
- **Several files, one step**: :func:`open_state` reopens them at the newest step they all hold;
  after an error inside a step all three are back at the previous one.
- **A queue depth**: ``block_bytes`` requests (1 MiB) on ``queue_depth`` threads, ``O_DIRECT``
  where the file system allows it, through page-aligned memory (:func:`aligned_empty`).
- **Ownership by handle**: a tier locks its file while open; ``close()`` deletes nothing,
  ``remove()`` only this handle's file, and :meth:`FileTier.temporary` makes one with no name.

Chapter 8 explains each choice and what it costs; ``offloadlab bench nvme`` measures them.
Modules, bottom up: ``direct_io``, ``aio``, ``format``, ``tier``, ``adam``; every name is
importable from ``offloadlab.nvme``.
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
