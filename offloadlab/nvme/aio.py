"""Asynchronous block I/O at a queue depth: ``depth`` block requests in flight on one file.

Transfers are cut into blocks and run on ``depth`` threads that each issue one
``preadv``/``pwritev`` at a time (the GIL is released during each): the queue depth an NVMe drive
needs to reach its rated bandwidth, with nothing to build (io_uring is not in Python's standard
library; libaio, what DeepSpeed's ``aio`` uses, needs a compiled extension).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ..files import write_all
from ..units import check_integer, plain_scalar
from .direct_io import PAGE, round_up

__all__ = ["BlockQueue", "checked_depth", "all_of"]


def checked_depth(depth) -> int:
    return check_integer(plain_scalar(depth), "queue_depth", 1, 1024)  # (numpy's as Python's)


class BlockQueue:
    """Block reads and writes on one file, ``depth`` of them in flight at a time.

    Each request is one ``preadv``/``pwritev`` of a whole number of pages at a page-aligned offset,
    run on one of ``depth`` threads; :meth:`submit` returns a Future. A short read means the file is
    shorter than expected (truncated), a short write that the disk is full: both raise instead of
    retrying, so nothing spins on a damaged file.
    """

    def __init__(self, fd: int, depth: int, bounce_bytes: int, name: str = "file"):
        self.fd, self.depth, self.name = fd, checked_depth(depth), name
        self._bounce_bytes = round_up(bounce_bytes, PAGE)
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
            raise OSError(
                errno.EIO,
                f"{self.name}: {got} of {len(view)} bytes at offset {offset}: "
                "the file is shorter than its header says (truncated?)",
            )

    def write(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset`` (blocking, in the calling thread)."""
        try:
            write_all(self.fd, view, offset)
        except OSError as error:
            raise OSError(
                error.errno, f"{self.name}: {error.strerror} (at offset {offset})"
            ) from None

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def all_of(futures: list[Future]) -> Future:
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
