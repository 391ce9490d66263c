"""How many CPU cores this process may really use: its affinity mask and its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores. A process given a slice of a large server — a
cpuset (``taskset``, Slurm, Kubernetes' static CPU manager) or a container's CPU quota — may run
on far fewer: 191 OpenMP threads on a 16-core slice of a 192-core host spend their time waiting
for each other. :func:`usable_cores` is the smaller of

- the cores in the process's affinity mask (``os.sched_getaffinity``), and
- the cgroup's CPU quota in whole cores, rounded down (at least 1): cgroup v2's ``cpu.max``
  (``"quota period"``, or ``"max"`` for none) or cgroup v1's ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us`` (``-1`` for none), the tightest of the process's cgroup and its parents.

Where neither can be read (another OS), it is ``os.cpu_count()``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["usable_cores", "worker_threads", "cgroup_cpu_limit", "cgroup_folders"]


def usable_cores(root: str | os.PathLike = "/") -> int:
    """Cores this process may use (see the module docstring); ``root`` is where /proc and /sys
    are."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return max(1, min(cores, limit) if limit is not None else cores)


def worker_threads(root: str | os.PathLike = "/") -> int:
    """Threads for a CPU-bound pool: every usable core but one, which stays free for the launcher
    (the training loop and the copies it issues); at least 1."""
    return max(1, usable_cores(root) - 1)


def cgroup_cpu_limit(root: str | os.PathLike = "/") -> int | None:
    """The cgroup CPU quota of this process in whole cores (rounded down, at least 1), or None
    when there is none or it cannot be read."""
    limits = []
    for version, folder in cgroup_folders("cpu", root):
        limits += (_v2_limits if version == 2 else _v1_limits)(folder)
    return min(limits) if limits else None


def cgroup_folders(controller: str, root: str | os.PathLike = "/") -> list[tuple[int, Path]]:
    """(cgroup version, folder) of this process's cgroup and its parents that hold
    ``controller``'s files ("cpu", "memory"); [] when /proc cannot be read. ``root`` is where /proc
    and /sys are."""
    base = Path(root)
    try:
        lines = (base / "proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one unified hierarchy
            found += [(2, f) for f in _ancestors(base / "sys/fs/cgroup", path)]
        elif controller in controllers.split(","):
            mount = base / "sys/fs/cgroup" / controllers
            if not mount.is_dir():
                mount = base / "sys/fs/cgroup" / controller
            found += [(1, f) for f in _ancestors(mount, path)]
    return found


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its parents' under ``mount``. Inside a container the path may name
    the host's hierarchy, which the container sees as its own root: then the root is what counts."""
    relative = [p for p in path.strip("/").split("/") if p]
    folders = [mount.joinpath(*relative[:depth]) for depth in range(len(relative), -1, -1)]
    return [f for f in folders if f.is_dir()] or [mount]


def _v2_limits(folder: Path) -> list[int]:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        return []
    return [] if quota == "max" else [_whole_cores(int(quota), int(period))]


def _v1_limits(folder: Path) -> list[int]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [_whole_cores(quota, period)] if quota > 0 else []


def _whole_cores(quota: int, period: int) -> int:
    return max(1, quota // period) if period > 0 else 1
