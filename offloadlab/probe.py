"""Measurements of this machine's memory tiers and the links between them.

Every function returns plain :class:`Measurement` records that carry their provenance
(machine, torch version, date), how they were taken, how many repeats, and the spread.
A record's ``source`` says what it is: ``"measured"`` on real hardware, ``"emulated"``
through :class:`~offloadlab.link.EmulatedLink`, ``"nominal"`` from a datasheet or the
material, or ``"not measured"`` with the reason in ``note``.

Units: bandwidths in bytes/s, times in seconds, sizes in bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm  # plain bars: hidden where stderr is not a terminal (notebooks, CI)

from . import cores, machine
from .files import write_all
from .link import Link
from .units import check_integer, format_bandwidth, format_size, parse_count, parse_size

__all__ = [
    "Measurement",
    "AlphaBeta",
    "host_memory_bandwidth",
    "device_memory_bandwidth",
    "link_sweep",
    "bidirectional",
    "fit_alpha_beta",
    "fit_sweep",
    "busy_filler_bytes",
    "default_sizes_for",
    "check_disk_folder",
    "disk_bandwidth",
    "default_sizes",
    "cpu_adam_throughput",
    "matmul_rate",
]


@dataclass(frozen=True)
class Measurement:
    """One measured (or nominal, or missing) quantity with how, where and when it was taken (a
    read-only record)."""

    quantity: str
    value: float | None
    unit: str
    source: str
    method: str
    repeats: int = 0
    spread: tuple[float, float] | None = None  # (min, max) of the samples, in ``unit``
    params: dict = field(default_factory=dict)
    note: str = ""
    provenance: dict = field(default_factory=machine.provenance)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        """The value formatted with its unit and source, e.g. '24.1 GB/s (measured)'."""
        if self.value is None:
            return f"not measured ({self.note})" if self.note else "not measured"
        text = (
            format_bandwidth(self.value) if self.unit == "B/s" else f"{self.value:.3g} {self.unit}"
        )
        return f"{text} ({self.source})"


def _summary(samples: list[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(samples), (min(samples), max(samples))


def _bandwidth_record(quantity, nbytes, seconds, source, method, params, note="") -> Measurement:
    if not all(s > 0 for s in seconds):
        raise ValueError(
            f"seconds: a {quantity} sample of {nbytes} bytes took no measurable time "
            f"({min(seconds):.3g} s); measure larger sizes"
        )
    rates = [nbytes / s for s in seconds]
    value, spread = _summary(rates)
    return Measurement(
        quantity,
        value,
        "B/s",
        source,
        method,
        len(seconds),
        spread,
        {**params, "bytes_per_repeat": nbytes, "median_seconds": statistics.median(seconds)},
        note,
    )


def _host_seconds(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def host_memory_bandwidth(nbytes="256 MiB", threads=None, repeats: int = 5) -> list[Measurement]:
    """Host DRAM bandwidth for a copy (read + write: 2 × nbytes) and an in-place update
    ``a += b`` (read a, read b, write a: 3 × nbytes), for each torch thread count in ``threads``
    (default: 1 and every core this process may use, :func:`offloadlab.cores.usable_cores`)."""
    size = int(parse_size(nbytes, "nbytes"))
    counts = sorted({1, cores.usable_cores()}) if threads is None else list(threads)
    for n in counts:
        check_integer(n, "threads", expected="positive integers")
    numel = size // 4
    a, b = torch.ones(numel), torch.ones(numel)
    records = []
    previous = torch.get_num_threads()
    try:
        for n in tqdm(counts, desc="host memory", disable=None, leave=False):
            torch.set_num_threads(n)
            copy = _host_seconds(lambda: a.copy_(b), repeats)
            update = _host_seconds(lambda: a.add_(b), repeats)
            records.append(
                _bandwidth_record(
                    "host copy bandwidth",
                    2 * numel * 4,
                    copy,
                    "measured",
                    "torch copy_ of fp32 tensors, wall clock",
                    {"threads": n},
                )
            )
            records.append(
                _bandwidth_record(
                    "host update bandwidth",
                    3 * numel * 4,
                    update,
                    "measured",
                    "torch add_ in place (read a, read b, write a), wall clock",
                    {"threads": n},
                )
            )
    finally:
        torch.set_num_threads(previous)
    return records


def device_memory_bandwidth(nbytes="1 GiB", repeats: int = 10) -> Measurement:
    """GPU memory bandwidth of a device-to-device copy (2 × nbytes moved), timed with CUDA
    events."""
    size = int(parse_size(nbytes, "nbytes"))
    if not torch.cuda.is_available():
        return Measurement(
            "device memory bandwidth",
            None,
            "B/s",
            "not measured",
            "device copy",
            note="no GPU on this machine",
        )
    src = torch.empty(size // 4, device="cuda")
    dst = torch.empty_like(src)
    seconds = []
    for i in range(repeats + 2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:  # two warm-up copies
            seconds.append(begin.elapsed_time(end) / 1e3)
    return _bandwidth_record(
        "device memory bandwidth",
        2 * src.numel() * 4,
        seconds,
        "measured",
        "device-to-device copy_, CUDA event timing",
        {},
    )


def default_sizes(link: Link, quick: bool = False) -> list[int]:
    """Transfer sizes for a sweep, 4 KiB upwards by factors of 4, scaled to the machine:
    up to 1 GiB on a GPU (256 MiB with ``quick``), 64 MiB on the emulated link (16 MiB quick)."""
    return default_sizes_for(link.emulated, quick)


def default_sizes_for(emulated: bool, quick: bool = False) -> list[int]:
    """:func:`default_sizes` of a link that is, or is not, emulated (for plans made without one)."""
    top = (16 if quick else 64) * 2**20 if emulated else (256 if quick else 1024) * 2**20
    sizes, size = [], 4 * 2**10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def _link_source(link: Link) -> str:
    return "emulated" if link.emulated else "measured"


def busy_filler_bytes(emulated: bool) -> int:
    """Bytes of the copy issued ahead of each timed one (see :func:`link_sweep`): long enough on
    the engine (about 0.3 ms on a GPU's PCIe 5 link, 0.5 ms on the emulated one at its default
    rate) for the host to issue the timed copy behind it, which takes tens of microseconds."""
    return (1 if emulated else 16) * 2**20


def _timed_transfers(link: Link, direction: str, host, device, repeats: int, filler) -> list[float]:
    """Seconds of each of ``repeats`` copies, each issued while its engine is still busy with a
    ``filler`` copy (host, device) in the same direction: the copy's begin event then fires when
    the engine turns to it, not when the host asked, so its time holds no dispatch by the host."""
    start = link.to_device if direction == "h2d" else link.to_host
    pair = (device, host) if direction == "h2d" else (host, device)
    ahead = (filler[1], filler[0]) if direction == "h2d" else filler
    start(*pair).synchronize()  # warm-up
    seconds = []
    for _ in range(repeats):
        start(*ahead)
        transfer = start(*pair)
        transfer.synchronize()
        seconds.append(transfer.elapsed)
    return seconds


def link_sweep(
    link: Link,
    sizes=None,
    directions=("h2d", "d2h"),
    pinned=(True, False),
    repeats: int = 5,
    quick: bool = False,
) -> list[Measurement]:
    """Bandwidth of single transfers over ``link`` for every size, direction and memory kind.

    Each transfer is timed on the link's own clock (CUDA events, or the emulated copy
    thread's timestamps), after one warm-up; the record's value is the median bandwidth. Each is
    issued while its copy engine is still busy with a pinned copy of :func:`busy_filler_bytes`
    ahead of it (as bandwidth tests such as nvbandwidth queue work first), so a small copy's time
    — the α of :func:`fit_alpha_beta` — is the engine's own latency, without the microseconds the
    host takes to issue the copy. Each record says how its host memory was pinned.
    """
    if sizes is None:
        chosen = default_sizes(link, quick)
    else:  # whole fp32 elements: round each size down to a multiple of 4 bytes
        chosen = [int(parse_size(s, "sizes")) // 4 * 4 for s in sizes]
        if not chosen or min(chosen) < 4:
            raise ValueError(f"sizes: expected sizes of at least 4 bytes; got {sizes!r}")
    for d in directions:
        if d not in ("h2d", "d2h"):
            raise ValueError(f"directions: expected 'h2d' and/or 'd2h'; got {d!r}")
    check_integer(repeats, "repeats")
    source = _link_source(link)
    clock = "emulated copy-thread timestamps" if link.emulated else "CUDA events on the copy stream"
    largest = max(chosen) // 4
    device = link.device_buffer(largest)
    hosts = {
        True: link.host_buffer(largest) if True in pinned else None,
        False: torch.zeros(largest) if False in pinned else None,
    }  # ordinary, pageable memory
    filler_bytes = busy_filler_bytes(link.emulated)
    filler = (link.host_buffer(filler_bytes // 4), link.device_buffer(filler_bytes // 4))
    pinning = {True: link.pinning_of(hosts[True]) if True in pinned else None, False: "pageable"}
    cases = [(d, p, s) for d in directions for p in pinned for s in chosen]
    records = []
    for direction, is_pinned, size in tqdm(cases, desc="link sweep", disable=None, leave=False):
        numel = size // 4
        seconds = _timed_transfers(
            link, direction, hosts[is_pinned][:numel], device[:numel], repeats, filler
        )
        memory = "pinned" if is_pinned else "pageable"
        records.append(
            _bandwidth_record(
                f"{direction} bandwidth",
                size,
                seconds,
                source,
                f"single {memory} transfer issued behind a {filler_bytes >> 20} MiB copy (no host "
                f"dispatch in its time), {clock}",
                {
                    "direction": direction,
                    "pinned": is_pinned,
                    "size": size,
                    "pinning": pinning[is_pinned],
                },
            )
        )
    return records


def bidirectional(link: Link, nbytes="64 MiB", repeats: int = 5) -> list[Measurement]:
    """Bandwidth of each direction while both run at once (pinned buffers)."""
    size = int(parse_size(nbytes, "nbytes"))
    numel = size // 4
    up_host, down_host = link.host_buffer(numel), link.host_buffer(numel)
    up_dev, down_dev = link.device_buffer(numel), link.device_buffer(numel)
    samples = {"h2d": [], "d2h": []}
    for i in range(repeats + 1):
        h2d = link.to_device(up_dev, up_host)
        d2h = link.to_host(down_host, down_dev, after=None)
        h2d.synchronize()
        d2h.synchronize()
        if i:  # the first round is a warm-up
            samples["h2d"].append(h2d.elapsed)
            samples["d2h"].append(d2h.elapsed)
    return [
        _bandwidth_record(
            f"{d} bandwidth, both directions at once",
            size,
            s,
            _link_source(link),
            "pinned transfers in both directions issued together",
            {
                "direction": d,
                "pinned": True,
                "size": size,
                "duplex": True,
                "pinning": link.pinning_of(up_host),
            },
        )
        for d, s in samples.items()
    ]


@dataclass(frozen=True)
class AlphaBeta:
    """t = alpha + n / beta: latency ``alpha`` (s) and asymptotic bandwidth ``beta`` (B/s)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta

    def half_bandwidth_size(self) -> float:
        """The transfer size that reaches half the asymptotic bandwidth: alpha × beta bytes."""
        return self.alpha * self.beta


def fit_alpha_beta(sizes, seconds) -> AlphaBeta:
    """Least-squares fit of t = α + n/β to transfer sizes (bytes) and times (s).

    Residuals are relative (each point weighted by 1/t), so the small transfers that fix
    α count as much as the large ones that fix β.
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError(f"seconds: expected one time per size; got {t.shape} for sizes {n.shape}")
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError("sizes: expected at least two different transfer sizes")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(n > 0)):
        raise ValueError("seconds: expected positive, finite sizes and times")
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inverse_beta <= 0:
        raise ValueError("seconds: the times do not grow with size, so no bandwidth can be fitted")
    return AlphaBeta(max(float(alpha), 0.0), float(1 / inverse_beta))


def fit_sweep(records: list[Measurement], direction: str = "h2d", pinned: bool = True) -> AlphaBeta:
    """The α–β fit of one direction and memory kind of a :func:`link_sweep`."""
    chosen = [
        r
        for r in records
        if r.params.get("direction") == direction
        and r.params.get("pinned") == pinned
        and not r.params.get("duplex")
    ]
    if not chosen:
        raise ValueError(
            f"records: no {direction} {'pinned' if pinned else 'pageable'} transfers in the sweep"
        )
    return fit_alpha_beta(
        [r.params["size"] for r in chosen], [r.params["median_seconds"] for r in chosen]
    )


def _drop_cached_pages(fd: int) -> bool:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    return False


_SCRATCH_PREFIX = ".offloadlab-disk-probe-"


def check_disk_folder(folder=".", nbytes="256 MiB") -> None:
    """Refuse now what would make :func:`disk_bandwidth` fail later, before a long run starts.

    ValueError for a ``folder`` that does not exist; OSError for one that refuses new files (a
    read-only file system) or has less than ``nbytes`` free.
    """
    disk = machine.disk(folder)
    if not os.path.isdir(disk.path):
        raise ValueError(f"folder: expected a folder; got {str(folder)!r}")
    size = int(parse_size(nbytes, "nbytes"))
    os.rmdir(_scratch_folder(disk.path))
    if disk.free_bytes < size:
        raise OSError(
            errno.ENOSPC,
            f"the disk holding {disk.path} has {format_size(disk.free_bytes)} free; "
            f"the disk probe writes {format_size(size)}",
        )


def _scratch_folder(where: str) -> str:
    """A new folder only this process can enter, so no name inside it can have been planted."""
    try:
        return tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=where)
    except OSError as error:
        raise OSError(
            error.errno, f"cannot create a scratch file in {where}: {error.strerror}"
        ) from None


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    """``path`` opened with O_DIRECT where the file system allows it (tmpfs and others refuse)."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _at_depth(count: int, depth: int, one) -> float:
    """Seconds to run ``one(i)`` for blocks i = 0 … count-1 with ``depth`` of them in flight
    (threads issuing positional reads or writes; depth 1 runs them in order in this thread)."""
    start = time.perf_counter()
    if depth == 1:
        for i in range(count):
            one(i)
    else:
        with ThreadPoolExecutor(depth) as pool:
            # raises the first error; the pool waits for the rest
            for _ in pool.map(one, range(count)):
                pass
    return time.perf_counter() - start


def _timed_write(fd: int, buffer, count: int, depth: int) -> float:
    """Seconds to write ``buffer`` at every block of the file, through fsync. A regular file takes a
    write short only when the disk is full (or the file at its size limit)."""
    chunk = len(buffer)

    def one(i):
        write_all(fd, buffer, i * chunk)

    start = time.perf_counter()
    _at_depth(count, depth, one)
    os.fsync(fd)
    return time.perf_counter() - start


def _timed_read(fd: int, chunk: int, count: int, depth: int) -> float:
    """Seconds to read every block of the file, each thread into its own page-aligned buffer."""
    buffers = threading.local()

    def one(i):
        if not hasattr(buffers, "one"):
            buffers.one = mmap.mmap(-1, chunk)
        # never loop on a file that came up short
        if os.preadv(fd, [buffers.one], i * chunk) < chunk:
            raise OSError(errno.EIO, "the scratch file came back shorter than it was written")

    return _at_depth(count, depth, one)


def _read_all(path: str, chunk: int, count: int, depth: int) -> tuple[float, bool]:
    """Seconds to read ``path``, and whether O_DIRECT was used."""
    fd, direct = _open_direct(path, os.O_RDONLY)
    try:
        return _timed_read(fd, chunk, count, depth), direct
    except OSError as error:
        if not (direct and error.errno == errno.EINVAL):
            raise
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)  # O_DIRECT accepted at open but refused for the read
    try:
        return _timed_read(fd, chunk, count, depth), False
    finally:
        os.close(fd)


def disk_bandwidth(
    folder=".", nbytes="256 MiB", block="4 MiB", queue_depth: int = 1
) -> list[Measurement]:
    """Write and read of a scratch file in ``folder``, page cache kept out: the disk's raw rate.

    Blocks of ``block`` bytes go in file order, ``queue_depth`` of them in flight (threads issuing
    ``pwrite``/``preadv``; 1: one after the other). Both directions use ``O_DIRECT`` where the file
    system allows it. The file is written once untimed, so the timed write overwrites allocated
    space as a device does: a first write into a fresh or ``posix_fallocate``-reserved file also
    pays the file system's allocation (ext4's conversion of reserved extents makes it several times
    slower at depth 1), which is the file system's cost, not the disk's. The timed write runs up to
    and including ``fsync``; before the read the file's cached pages are dropped
    (``posix_fadvise(DONTNEED)``). The scratch file is created with ``O_EXCL|O_NOFOLLOW`` inside a
    new private folder and removed afterwards, also when the disk fills up or fails: that OSError
    is raised, and nothing is left behind.
    """
    where = machine.disk(folder).path
    size = int(parse_size(nbytes, "nbytes"))
    chunk = int(parse_size(block, "block"))
    if chunk % 4096:
        raise ValueError(f"block: expected a multiple of 4 KiB; got {block!r}")
    check_integer(queue_depth, "queue_depth", 1, 1024)
    count = size // chunk
    if count == 0:
        raise ValueError(
            f"nbytes: expected at least one block ({format_size(chunk, binary=True)}); got "
            f"{nbytes!r}"
        )
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(chunk))
    scratch = _scratch_folder(where)
    path = os.path.join(scratch, "probe.bin")
    try:
        fd, direct = _open_direct(
            path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
        )
        try:
            _timed_write(fd, buffer, count, queue_depth)  # allocates the file: untimed
            write_seconds = _timed_write(fd, buffer, count, queue_depth)
            dropped = _drop_cached_pages(fd)
        finally:
            os.close(fd)
        read_seconds, read_direct = _read_all(path, chunk, count, queue_depth)
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(scratch)
        buffer.close()
    order = "sequential" if queue_depth == 1 else f"in file order, {queue_depth} blocks in flight"
    write_method = f"{order} write" + (", O_DIRECT" if direct else "") + ", timed through fsync"
    read_method = (
        f"{order} read"
        + (", O_DIRECT" if read_direct else "")
        + (", cached pages dropped first" if dropped else ", page cache may serve the read")
    )
    params = {"folder": where, "block": chunk, "queue_depth": queue_depth}
    return [
        _bandwidth_record(
            "disk write bandwidth", count * chunk, [write_seconds], "measured", write_method, params
        ),
        _bandwidth_record(
            "disk read bandwidth", count * chunk, [read_seconds], "measured", read_method, params
        ),
    ]


def cpu_adam_throughput(params=16e6, repeats: int = 5, threads: int | None = None) -> Measurement:
    """Parameters per second of torch's fused AdamW step on the CPU over one flat fp32 tensor."""
    count = int(parse_count(params, "params"))
    weights = torch.zeros(count, requires_grad=True)
    weights.grad = torch.randn(count)
    optimizer = torch.optim.AdamW([weights], lr=1e-3, fused=True)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        seconds = _host_seconds(optimizer.step, repeats)
    finally:
        torch.set_num_threads(previous)
    rates = [count / s for s in seconds]
    value, spread = _summary(rates)
    return Measurement(
        "cpu adam throughput",
        value,
        "params/s",
        "measured",
        "torch AdamW(fused=True) step, wall clock",
        repeats,
        spread,
        {"params": count, "threads": threads or previous},
    )


def matmul_rate(device=None, size: int | None = None, repeats: int = 5) -> Measurement:
    """Sustained FLOP/s of square matrix products on ``device`` (bf16 on a GPU, fp32 on the CPU)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    n = size or (8192 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def product():
        a @ b
        if gpu:
            torch.cuda.synchronize(device)

    seconds = _host_seconds(product, repeats, warmup=2)
    rates = [2 * n**3 / s for s in seconds]
    value, spread = _summary(rates)
    return Measurement(
        "matmul rate",
        value,
        "FLOP/s",
        "measured",
        f"{n}×{n} {str(dtype).split('.')[-1]} matmul",
        repeats,
        spread,
        {"device": str(device), "size": n},
    )
