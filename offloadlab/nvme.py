"""One tier further: a file-backed store for flat tensors, on NVMe or any disk.

:class:`FileTier` keeps a flat array of one dtype in a file and moves chunks of it between
the file and host tensors with ``pread``/``pwrite``; :meth:`FileTier.flush` syncs the file and
drops its pages from the page cache, so the next reads come from the disk, not from memory. :func:`adam_from_file` runs the CPU AdamW
update over optimizer state that lives in such files — read a chunk of master weights and
moments, update it, write it back — the way ZeRO-Infinity uses NVMe. Sizes are bytes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from . import cpu_adam

__all__ = ["FileTier", "adam_from_file"]


class FileTier:
    """A file holding ``numel`` elements of ``dtype``; created zero-filled, removed by :meth:`close`."""

    def __init__(self, path, numel: int, dtype=torch.float32):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"numel: expected a positive integer; got {numel!r}")
        self.path = Path(path)
        if self.path.exists():
            raise ValueError(f"path: {self.path} exists; FileTier will not overwrite a file")
        if not self.path.parent.is_dir():
            raise ValueError(f"path: folder {self.path.parent} does not exist")
        self.numel, self.dtype = numel, dtype
        self.itemsize = torch.tensor([], dtype=dtype).element_size()
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, numel * self.itemsize)

    def _check(self, start: int, tensor: torch.Tensor) -> int:
        if tensor.dtype != self.dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"tensor: expected a contiguous host tensor of {self.dtype}")
        if start < 0 or start + tensor.numel() > self.numel:
            raise ValueError(f"start: expected the chunk inside [0, {self.numel}); got {start}+{tensor.numel()}")
        return start * self.itemsize

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements ``start`` … ``start + out.numel()`` from the file."""
        offset = self._check(start, out)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.preadv(self._fd, [view[done:]], offset + done)

    def write(self, start: int, src: torch.Tensor, sync: bool = False) -> None:
        """Write ``src`` to elements ``start`` … of the file (and ``fsync`` with ``sync``)."""
        offset = self._check(start, src)
        view = memoryview(src.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)
        if sync:
            os.fsync(self._fd)

    def flush(self) -> None:
        """``fsync`` the file and drop its cached pages (where the OS allows) so reads hit the disk."""
        os.fsync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close and remove the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def adam_from_file(master: FileTier, exp_avg: FileTier, exp_avg_sq: FileTier, grad: torch.Tensor,
                   out: torch.Tensor | None, *, step: int, lr: float, chunk: int = 1 << 20, **adam) -> dict:
    """One AdamW step over state kept in three files, ``chunk`` elements at a time.

    Returns the seconds spent reading, updating and writing (the last includes ``fsync``; the
    files' pages are then dropped, so the next step reads from the disk again), so the disk's
    share of the step is measured, not assumed.
    """
    if not (master.numel == exp_avg.numel == exp_avg_sq.numel == grad.numel()):
        raise ValueError("grad: expected as many elements as each state file holds")
    buffers = [torch.empty(min(chunk, master.numel)) for _ in range(3)]
    seconds = {"read": 0.0, "update": 0.0, "write": 0.0}
    for start in range(0, master.numel, chunk):
        n = min(chunk, master.numel - start)
        p, m, v = (b[:n] for b in buffers)
        t0 = time.perf_counter()
        for tier, buf in ((master, p), (exp_avg, m), (exp_avg_sq, v)):
            tier.read(start, buf)
        t1 = time.perf_counter()
        cpu_adam.adamw_step(p, m, v, grad[start:start + n], None if out is None else out[start:start + n],
                            step=step, lr=lr, **adam)
        t2 = time.perf_counter()
        for tier, buf in ((master, p), (exp_avg, m), (exp_avg_sq, v)):
            tier.write(start, buf)
        seconds["read"] += t1 - t0
        seconds["update"] += t2 - t1
        seconds["write"] += time.perf_counter() - t2
    t3 = time.perf_counter()
    for tier in (master, exp_avg, exp_avg_sq):
        tier.flush()
    seconds["write"] += time.perf_counter() - t3
    return seconds
