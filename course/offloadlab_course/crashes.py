"""What a crash can leave of a file: the writes a program made to it, replayed up to every point
at which it could have stopped.

A kill (SIGKILL) stops a process between two system calls, and every write it had made is in the
page cache, so the disk gets all of them. A power cut loses what no flush had reached: the drive
may hold any of the writes since the last ``fsync``, and one cut in the middle holds only its
first part. :func:`record` notes each ``os.pwrite``, ``os.write`` and ``os.fsync`` (or
``fdatasync``) to one file while a block runs, and :func:`crashes` lists, for every point between
two of those calls, the file a kill leaves and the files a power cut leaves with none, one, or
half of one of the unflushed writes on the drive. An emulation, labelled as such where it grades:
it tries each unflushed write alone, not every subset of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field

from offloadlab_course import watch


@dataclass
class Recording:
    """The file's bytes before the block, and what the block did to it, in order: ``("write",
    offset, bytes)``, ``("flush",)``, or ``("mark", label)`` where the caller called
    :meth:`mark`."""

    start: bytes
    calls: list = field(default_factory=list)

    def mark(self, label) -> None:
        """Note that the program reached ``label`` (a commit returned, say)."""
        self.calls.append(("mark", label))


@dataclass
class Crash:
    """One file a crash can leave: ``kind`` is "kill" or "power cut"; ``after`` counts the writes
    made since the last mark, ``pending`` those no flush has reached, ``held`` says which of
    them the drive holds, and ``marks`` lists the labels marked before it."""

    kind: str
    after: int
    pending: int
    held: str
    marks: list
    image: bytes


@contextlib.contextmanager
def record(path):
    """Note every write and flush to the file at ``path`` while the block runs (through any
    descriptor open on it; os.sync and a descriptor opened O_SYNC or O_DSYNC flush too); the
    writes still reach the file."""
    with open(path, "rb") as file:
        recording = Recording(file.read())
    target = os.stat(path)

    def ours(fd) -> bool:
        try:
            now = os.fstat(fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (target.st_dev, target.st_ino)

    real = {name: getattr(os, name) for name in ("pwrite", "write", "fsync", "fdatasync", "sync")}

    def appends(fd) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)

    def durable(fd) -> bool:
        """Opened with O_SYNC or O_DSYNC: each write is flushed before it returns."""
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_SYNC | os.O_DSYNC))

    def pwrite(fd, data, offset):
        mine = ours(fd)
        # (Linux appends a pwrite on an O_APPEND descriptor at the end, whatever its offset)
        landed = os.fstat(fd).st_size if mine and appends(fd) else offset
        written = real["pwrite"](fd, data, offset)
        if mine:
            recording.calls.append(("write", landed, bytes(memoryview(data).cast("B")[:written])))
            if durable(fd):
                recording.calls.append(("flush",))
        return written

    def write(fd, data):
        written = real["write"](fd, data)
        if ours(fd):  # (where it landed: an O_APPEND descriptor writes at the end, not its offset)
            offset = os.lseek(fd, 0, os.SEEK_CUR) - written
            recording.calls.append(("write", offset, bytes(memoryview(data).cast("B")[:written])))
            if durable(fd):
                recording.calls.append(("flush",))
        return written

    def sync():
        real["sync"]()
        recording.calls.append(("flush",))  # every file, this one included

    def flusher(name):
        def flush(fd):
            real[name](fd)
            if ours(fd):
                recording.calls.append(("flush",))

        return flush

    replaced = {"pwrite": pwrite, "write": write, "sync": sync}
    replaced |= {name: flusher(name) for name in ("fsync", "fdatasync")}
    with watch.standing_in(replaced.values()):
        try:
            for name, function in replaced.items():
                setattr(os, name, function)
            yield recording
        finally:
            for name, function in real.items():
                setattr(os, name, function)


def _applied(image: bytes, writes) -> bytes:
    out = bytearray(image)
    for offset, data in writes:
        end = offset + len(data)
        out[len(out) : end] = bytes(max(0, end - len(out)))  # a write past the end grows it
        out[offset:end] = data
    return bytes(out)


def final_image(recording: Recording) -> bytes:
    """The file as the recorded writes leave it: what it holds unless something unrecorded (a
    file object, mmap, a truncation, another process) changed it."""
    return _applied(recording.start, [call[1:] for call in recording.calls if call[0] == "write"])


def crashes(recording: Recording):
    """Every :class:`Crash` the recorded calls allow, in order of where it falls."""
    durable, pending, marks, writes = recording.start, [], [], 0
    for call in [*recording.calls, None]:
        if call is None or call[0] != "mark":
            now = (writes, len(pending))
            yield Crash("kill", *now, "all", list(marks), _applied(durable, pending))
            if pending:
                yield Crash("power cut", *now, "none", list(marks), durable)
            for number, (offset, data) in enumerate(pending, 1):
                alone = _applied(durable, [(offset, data)])
                yield Crash("power cut", *now, f"only the {_ordinal(number)}", list(marks), alone)
                if len(data) > 1:
                    torn = _applied(durable, [(offset, data[: len(data) // 2])])
                    held = f"half of the {_ordinal(number)}"
                    yield Crash("power cut", *now, held, list(marks), torn)
        if call is None:
            return
        if call[0] == "write":
            pending.append(call[1:])
            writes += 1
        elif call[0] == "flush":
            durable, pending = _applied(durable, pending), []
        else:
            marks.append(call[1])
            writes = 0


def _ordinal(number: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(number, f"{number}th")
