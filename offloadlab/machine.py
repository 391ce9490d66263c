"""What this machine has: accelerator, host memory, disk, and the GPU's PCIe link.

Facts come from torch, psutil and (for the PCIe link) NVML through nvidia-ml-py when it is
installed. Whatever cannot be read is reported as unknown (``None``), never guessed.
Sizes are in bytes, bandwidths in bytes per second.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from . import cores
from .units import is_integer

__all__ = [
    "Accelerator",
    "PCIeLink",
    "Disk",
    "Machine",
    "accelerator",
    "pcie_link",
    "pcie_bandwidth",
    "disk",
    "last_level_cache_bytes",
    "host_memory",
    "cgroup_memory_limit",
    "describe",
    "provenance",
]

# Per-lane signalling rate (GT/s) and line-code efficiency of each PCIe generation.
_PCIE_LANE = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 242 / 256),
}


def pcie_bandwidth(generation: int, width: int) -> float:
    """Nominal bandwidth of a PCIe link in one direction, bytes/s (gen 4 ×16 ≈ 31.5 GB/s)."""
    if generation not in _PCIE_LANE:
        raise ValueError(f"generation: expected a PCIe generation 1–6; got {generation!r}")
    if not is_integer(width) or width not in (1, 2, 4, 8, 16, 32):
        raise ValueError(
            f"width: expected a link width of 1, 2, 4, 8, 16 or 32 lanes; got {width!r}"
        )
    rate, efficiency = _PCIE_LANE[generation]
    return rate * 1e9 * efficiency / 8 * width


@dataclass(frozen=True)
class Accelerator:
    """The compute device: kind is 'cuda', 'rocm', 'mps' or 'none'."""

    kind: str
    name: str | None = None
    memory_bytes: int | None = None
    count: int = 0

    @property
    def device(self) -> str:
        """The torch device string for this accelerator ('cpu' when there is none)."""
        return {"cuda": "cuda", "rocm": "cuda", "mps": "mps"}.get(self.kind, "cpu")


@dataclass(frozen=True)
class PCIeLink:
    """The GPU's PCIe link as NVML reports it; None where unknown."""

    generation: int | None = None
    width: int | None = None
    max_generation: int | None = None
    max_width: int | None = None
    nominal_bytes_per_s: float | None = None
    source: str = "unknown"


@dataclass(frozen=True)
class Disk:
    """The file system holding ``path``: capacity and free space in bytes."""

    path: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Machine:
    hostname: str
    cpu: str
    logical_cores: int
    physical_cores: int | None
    usable_cores: int  # what this process may run on: affinity and cgroup quota (offloadlab.cores)
    host_memory_bytes: int
    accelerator: Accelerator
    pcie: PCIeLink
    disk: Disk

    def to_dict(self) -> dict:
        return asdict(self)


def accelerator() -> Accelerator:
    """The first accelerator torch can use, or kind 'none'."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return Accelerator(kind, props.name, props.total_memory, torch.cuda.device_count())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return Accelerator("mps", "Apple GPU (unified memory)", None, 1)
    return Accelerator("none")


def pcie_link(index: int = 0) -> PCIeLink:
    """The PCIe generation and width of GPU ``index`` from NVML, or an all-unknown record."""
    try:
        import pynvml
    except ImportError:
        return PCIeLink(source="unknown (nvidia-ml-py not installed)")
    try:
        pynvml.nvmlInit()
    except Exception:  # NVML raises its own error types when no driver is present
        return PCIeLink(source="unknown (no NVIDIA driver)")
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
        max_gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        max_width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
    except Exception:
        return PCIeLink(source="unknown (NVML could not read the link)")
    finally:
        pynvml.nvmlShutdown()
    # Idle GPUs train their link down to save power; the maximum is what a transfer gets.
    try:
        nominal = pcie_bandwidth(max_gen, max_width)
    except ValueError:
        nominal = None
    return PCIeLink(gen, width, max_gen, max_width, nominal, "nvml")


def disk(path: str | os.PathLike = ".") -> Disk:
    """Capacity and free space of the file system that holds ``path``."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"path: expected an existing folder; got {str(path)!r}")
    usage = shutil.disk_usage(folder)
    return Disk(str(folder.resolve()), usage.total, usage.free)


def last_level_cache_bytes(root: str | os.PathLike = "/") -> int | None:
    """Bytes of the CPUs' last-level cache, every instance of it counted once (one per socket, or
    per core complex on AMD): the data a loop over all cores keeps close. From Linux's sysfs;
    None where it cannot be read."""
    caches: dict[tuple[int, str], int] = {}  # (level, the CPUs that share it) → bytes
    for index in Path(root, "sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        number, unit = size.rstrip("KMG"), size[len(size.rstrip("KMG")) :]
        if kind == "Instruction" or not number.isdigit() or len(unit) > 1:
            continue
        caches[level, shared] = int(number) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    if not caches:
        return None
    last = max(level for level, _ in caches)
    return sum(nbytes for (level, _), nbytes in caches.items() if level == last)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cgroup_memory_limit(root: str | os.PathLike = "/") -> int | None:
    """The memory limit of this process's cgroup in bytes, the tightest of it and its parents
    (cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``), or None when there is none or it
    cannot be read; ``root`` is where /proc and /sys are."""
    limits = []
    for version, folder in cores.cgroup_folders("memory", root):
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        try:
            text = (folder / name).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or v1's huge number: no limit (min() drops it)
            limits.append(int(text))
    return min(limits) if limits else None


def host_memory(root: str | os.PathLike = "/") -> tuple[int, str]:
    """(bytes, where from): the host memory this process may use, the smaller of the machine's
    and its cgroup's limit (:func:`cgroup_memory_limit`)."""
    physical = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit(root)
    if limit is not None and limit < physical:
        return limit, "this process's cgroup memory limit"
    return physical, "this machine's memory"


def describe(disk_path: str | os.PathLike = ".") -> Machine:
    """Everything this module knows about the machine, with the disk that holds ``disk_path``."""
    acc = accelerator()
    return Machine(
        hostname=socket.gethostname(),
        cpu=_cpu_name(),
        logical_cores=os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        usable_cores=cores.usable_cores(),
        host_memory_bytes=host_memory()[0],
        accelerator=acc,
        pcie=pcie_link() if acc.kind == "cuda" else PCIeLink(source="unknown (no NVIDIA GPU)"),
        disk=disk(disk_path),
    )


def provenance() -> dict:
    """Where and when a measurement was taken: machine, GPU, driver, torch, CPU, date (UTC)."""
    acc = accelerator()
    record = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu": _cpu_name(),
        "logical_cores": os.cpu_count(),
        "usable_cores": cores.usable_cores(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "accelerator": acc.kind,
        "gpu": acc.name,
    }
    if acc.kind in ("cuda", "rocm"):
        record["cuda"] = torch.version.cuda or torch.version.hip
        record["driver"] = _driver_version()
    return record


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:
        return None
