"""Overlap experiments: real compute against real transfers, predicted beside measured.

Compute is a chain of matrix products on the compute stream (on the CPU's main thread with
the emulated link); the transfer runs on the link's copy stream (its copy thread). Times
come from the link's clock: CUDA events on a GPU, the copy thread's timestamps otherwise.
Every result says whether it is ``measured`` or ``emulated``. Units: seconds and bytes.

Sizes follow the device (:func:`overlap_work`): on a GPU the products are sized for a compute
window of :data:`WINDOW` seconds from the GPU's measured product time (planned beforehand from
its :class:`~offloadlab.devices.DeviceProfile`), so a transfer of a few windows' worth stays a
few GB. Sized from a fixed count of products instead, 16 fp32 8192³ products with TF32 off take
about a third of a second on an H100: transfers of a quarter of, one and four times that came to
94 GB, all kept. :func:`measure_overlap` also keeps one pinned buffer per link, the largest asked
for, so a series of experiments holds its largest transfer, not their sum.
"""

from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass, field

import torch

from . import devices, overlap
from .link import Link
from .units import check_integer, parse_size

__all__ = [
    "MatmulWork",
    "OverlapResult",
    "measure_overlap",
    "CrossoverResult",
    "measure_crossover",
    "WINDOW",
    "GPU_SHAPE",
    "overlap_work",
    "planned_count",
    "transfer_bytes",
    "matmul_device_bytes",
]

WINDOW = 0.04  # seconds of compute the overlap experiments hide transfers behind, on a GPU
GPU_SHAPE = (2048, 4096)  # rows × hidden of each product on a GPU (fp32: 69 GFLOP, 1–4 ms)
EMULATED_SHAPE = (256, 512)  # on the emulated link (a CPU's products)


class MatmulWork:
    """``count`` products of a (rows × hidden) activation with a (hidden × hidden) weight (fp32)."""

    def __init__(self, rows: int, hidden: int, count: int, device):
        for name, value in (("rows", rows), ("hidden", hidden), ("count", count)):
            check_integer(value, name)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, hidden, generator=generator).to(device)
        self.w = (torch.randn(hidden, hidden, generator=generator) / hidden**0.5).to(device)
        self.rows, self.hidden, self.count = rows, hidden, count
        self.flops = 2.0 * rows * hidden * hidden * count

    @property
    def device_bytes(self) -> int:
        """Device memory while it runs (see :func:`matmul_device_bytes`)."""
        return matmul_device_bytes(self.rows, self.hidden)

    def with_count(self, count: int) -> "MatmulWork":
        """The same products (same tensors), ``count`` of them."""
        work = MatmulWork.__new__(MatmulWork)
        work.x, work.w, work.rows, work.hidden, work.count = (
            self.x,
            self.w,
            self.rows,
            self.hidden,
            count,
        )
        work.flops = 2.0 * self.rows * self.hidden * self.hidden * count
        return work

    def __call__(self) -> torch.Tensor:
        y = self.x
        for _ in range(self.count):
            y = y @ self.w
        return y


@dataclass(frozen=True)
class OverlapResult:
    """Compute alone, transfer alone and both together (median seconds), with the prediction.
    A record: read-only, as are the crossover's below."""

    nbytes: int
    t_compute: float
    t_transfer: float
    t_both: float
    source: str
    timeline: dict = field(default_factory=dict)  # lane -> [(start, end, label)], from the last run

    @property
    def predicted(self) -> overlap.Stage:
        return overlap.Stage(self.t_transfer, self.t_compute)

    @property
    def measured_stall(self) -> float:
        return max(0.0, self.t_both - self.t_compute)

    @property
    def ratio(self) -> float:
        """Measured step over predicted step, max(t_compute, t_transfer): 1.0 is a perfect
        prediction."""
        return self.t_both / self.predicted.step

    def to_dict(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "t_compute_s": self.t_compute,
            "t_transfer_s": self.t_transfer,
            "t_both_s": self.t_both,
            "predicted_step_s": self.predicted.step,
            "predicted_stall_s": self.predicted.stall,
            "measured_stall_s": self.measured_stall,
            "ratio": self.ratio,
            "regime": self.predicted.regime,
            "source": self.source,
        }


def matmul_device_bytes(rows: int, hidden: int) -> int:
    """Device memory of a :class:`MatmulWork` while it runs: fp32 activation and weight, and two
    products alive at once (the one being read and the one being written)."""
    return 4 * (3 * rows * hidden + hidden * hidden)


def planned_count(profile: devices.DeviceProfile, shape=GPU_SHAPE, window: float = WINDOW) -> int:
    """Products of ``shape`` that fill ``window`` seconds on ``profile`` at its datasheet fp32
    rate (TF32 as torch is set now), at least one."""
    rows, hidden = shape
    return max(
        1, round(window * profile.matmul_flops(torch.float32) / (2.0 * rows * hidden * hidden))
    )


def transfer_bytes(profile: devices.DeviceProfile, factor: float, window: float = WINDOW) -> int:
    """Bytes of a transfer ``factor`` compute windows long over ``profile``'s nominal link: an upper
    bound for the real link, which is slower."""
    return int(factor * window * profile.link_bytes_per_s) // 4 * 4


def overlap_work(link: Link, window: float | None = None) -> MatmulWork:
    """The chain of products for an overlap experiment on ``link``'s device.

    On a GPU: products of :data:`GPU_SHAPE`, as many as fill ``window`` seconds (default
    :data:`WINDOW`, half of it in the kit's quick mode, :func:`offloadlab.devices.quick_mode`),
    counted from the product's time measured here (the datasheet's rate is a peak; the real one
    is lower, and TF32 may be on or off). On the emulated link: a CPU's small products, eight.
    """
    if window is None:
        window = WINDOW / 2 if devices.quick_mode() else WINDOW
    if link.emulated:
        return MatmulWork(*EMULATED_SHAPE, 8, link.device)
    one = MatmulWork(*GPU_SHAPE, 1, link.device)
    one()  # warm-up: cuBLAS picks its kernel
    seconds = []
    for _ in range(3):
        begin = link.mark()
        one()
        seconds.append(link.mark().time - begin.time)
    return one.with_count(max(1, round(window / statistics.median(seconds))))


_BUFFERS: "weakref.WeakKeyDictionary[Link, tuple]" = weakref.WeakKeyDictionary()


def _buffers(link: Link, nbytes):
    """Pinned host and device buffers of ``nbytes``: views of one pair per link, the largest asked
    for so far (pinned memory lives until the link is dropped), so that a series of experiments
    holds the largest transfer, not the sum of them."""
    size = int(parse_size(nbytes, "nbytes"))
    numel = max(1, size // 4)
    host, device = _BUFFERS.get(link, (None, None))
    if host is None or host.numel() < numel:
        # the smaller pair goes before the larger one is made
        host = device = _BUFFERS.pop(link, None)
        _BUFFERS[link] = host, device = link.host_buffer(numel), link.device_buffer(numel)
    return host[:numel], device[:numel], numel * 4


def _run_once(link: Link, work: MatmulWork, host, device, mode: str):
    begin = link.mark()
    transfer = link.to_device(device, host, after=None) if mode != "compute" else None
    compute_end = None
    if mode != "transfer":
        work()
        compute_end = link.mark()
    if transfer is not None:
        transfer.wait()
    end = link.mark()
    return begin, compute_end, transfer, end


def measure_overlap(link: Link, nbytes, work: MatmulWork, repeats: int = 3) -> OverlapResult:
    """Time ``work`` alone, a host→device transfer of ``nbytes`` alone, and both at once."""
    check_integer(repeats, "repeats")
    host, device, size = _buffers(link, nbytes)
    _run_once(link, work, host, device, "both")  # warm-up
    samples = {"compute": [], "transfer": [], "both": []}
    for _ in range(repeats):
        for mode in samples:
            begin, _, transfer, end = _run_once(link, work, host, device, mode)
            samples[mode].append(transfer.elapsed if mode == "transfer" else end.time - begin.time)
    begin, compute_end, transfer, end = _run_once(link, work, host, device, "both")
    origin = begin.time
    timeline = {
        "compute": [(0.0, compute_end.time - origin, "matmuls")],
        "H2D": [(transfer.start - origin, transfer.end - origin, "transfer")],
    }
    link.synchronize()
    return OverlapResult(
        size,
        *(statistics.median(samples[m]) for m in ("compute", "transfer", "both")),
        source="emulated" if link.emulated else "measured",
        timeline=timeline,
    )


@dataclass(frozen=True)
class CrossoverResult:
    """The batch below which a fixed transfer stops hiding behind compute, predicted and
    measured."""

    nbytes: int
    batches: tuple[int, ...]
    results: tuple[OverlapResult, ...]
    seconds_per_sample: float
    source: str

    def __post_init__(self):
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "results", tuple(self.results))

    @property
    def predicted_batch(self) -> int:
        return overlap.crossover_batch(
            self.nbytes, self.nbytes / self.t_transfer, self.seconds_per_sample
        )

    @property
    def t_transfer(self) -> float:
        return statistics.median(r.t_transfer for r in self.results)

    @property
    def measured_batch(self) -> int | None:
        """The smallest batch whose step took at most 10 % longer than its compute alone."""
        hidden = [b for b, r in zip(self.batches, self.results) if r.t_both <= 1.10 * r.t_compute]
        return min(hidden) if hidden else None


def measure_crossover(
    link: Link,
    batches=(1, 2, 4, 8, 16, 32),
    rows_per_sample: int = 64,
    hidden: int = 512,
    count: int = 4,
    nbytes=None,
    repeats: int = 3,
) -> CrossoverResult:
    """Overlap a fixed transfer with compute that grows with the batch, for each batch size.

    Compute per sample is ``count`` products of a (``rows_per_sample`` × ``hidden``) block. When
    ``nbytes`` is not given, it is chosen so the transfer takes as long as the compute of a batch
    in the middle of ``batches`` (so the crossover falls inside the range).
    """
    if isinstance(batches, (str, bytes)) or not hasattr(batches, "__iter__"):
        raise ValueError(f"batches: expected a list of whole batch sizes ≥ 1; got {batches!r}")
    chosen = sorted(
        {check_integer(b, "batches", expected="whole batch sizes ≥ 1") for b in batches}
    )
    if not chosen:
        raise ValueError(f"batches: expected a list of whole batch sizes ≥ 1; got {batches!r}")
    device = link.device
    largest = MatmulWork(rows_per_sample * chosen[-1], hidden, count, device)
    timing = measure_overlap(link, "4 MiB", largest, repeats=1)
    per_sample = timing.t_compute / chosen[-1]
    if nbytes is None:
        middle = chosen[len(chosen) // 2]
        bandwidth = timing.nbytes / timing.t_transfer
        nbytes = int(middle * 0.75 * per_sample * bandwidth)
    results = [
        measure_overlap(
            link, nbytes, MatmulWork(rows_per_sample * b, hidden, count, device), repeats
        )
        for b in chosen
    ]
    slope = statistics.median(r.t_compute / b for b, r in zip(chosen, results))
    return CrossoverResult(results[0].nbytes, chosen, results, slope, results[0].source)
