"""Per-user memory and CPU limits for a course hub's servers, through Linux control groups.

JupyterHub's local spawner reads ``mem_limit`` and ``cpu_limit`` but enforces neither. Here each
user's server starts inside a control group of its own, made below the hub's own group, that
caps the memory (bytes) and the CPU time (cores) of the server, its kernels and everything they
start: a student who allocates past the cap has that process killed by the kernel's OOM killer,
and the rest of the class keeps its memory.

Two layouts are handled. cgroup v2 (a systemd host; the hub's unit needs ``Delegate=yes``): the
hub moves itself into a leaf, ``hub``, so that its group may hand the memory and cpu controllers
to the users' groups beside it. cgroup v1 (older hosts and some containers): the users' groups go
below the hub's own in the ``memory`` and ``cpu`` hierarchies. Where neither can be written,
:meth:`UserLimits.prepare` says why and the servers run without a cap.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from offloadlab.units import check_positive, plain_scalar

CGROUPS = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000  # cgroup v1's default scheduling period, in microseconds
MIN_CPUS = 1_000 / CFS_PERIOD_US  # the kernel's smallest quota, 1 ms, over that period


def own_groups(proc_cgroup: str) -> dict[str, str]:
    """The calling process's group per hierarchy, from /proc/self/cgroup's text: ``""`` names
    the v2 (unified) hierarchy, ``"memory"`` and ``"cpu"`` the v1 controllers."""
    groups = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


_DIGEST_END = re.compile(r"-[0-9a-f]{12}$")


def group_name(user: str) -> str:
    """The folder name of ``user``'s group: the name, with anything but letters, digits, ``-``,
    ``_`` and ``.`` replaced by ``_`` and, when anything was, a digest of the name appended, so
    that two users (``jo@x.com`` and ``jo_x.com``) never share a group and its caps."""
    if not isinstance(user, str) or not user:
        raise ValueError(f"user: expected a user name; got {user!r}")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
    # (a name that already ends like a digest gets one too, so none can pose as another's)
    if safe != user or _DIGEST_END.search(user):
        safe += "-" + hashlib.sha256(user.encode()).hexdigest()[:12]
    return "offloadlab-" + safe


class UserLimits:
    """Memory (bytes) and CPU (cores) for each user's control group; ``root`` is the cgroup
    file system (a test gives a folder of its own)."""

    def __init__(self, memory_bytes: int, cpus: float, root: Path = CGROUPS):
        self.memory_bytes = int(check_positive(plain_scalar(memory_bytes), "memory_bytes"))
        if self.memory_bytes < 1:
            raise ValueError(f"memory_bytes: expected at least one byte; got {memory_bytes!r}")
        if not isinstance(root, (str, os.PathLike)):
            raise ValueError(f"root: expected the cgroup folder (a str or a Path); got {root!r}")
        self.cpus, self.root = check_positive(plain_scalar(cpus), "cpus"), Path(root)
        if self.cpus < MIN_CPUS:  # (a quota below the kernel's 1 ms a period is refused there)
            raise ValueError(f"cpus: expected at least {MIN_CPUS} of a core; got {cpus!r}")
        groups = own_groups(Path("/proc/self/cgroup").read_text(encoding="utf-8"))
        self.unified = (self.root / "cgroup.controllers").exists()  # v2 only, no v1 hierarchy
        if self.unified:
            self.parents = {"": self.root / groups.get("", "/").lstrip("/")}
        else:
            self.parents = {
                kind: self.root / kind / groups[kind].lstrip("/")
                for kind in ("memory", "cpu")
                if kind in groups and (self.root / kind).is_dir()
            }

    def prepare(self, user: str) -> tuple[list[Path], str]:
        """Make ``user``'s groups with this object's caps: (the groups' folders, "" or why there
        are none). Run in the hub, before the server starts; run again, it resets the caps."""
        try:
            return (self._prepare_v2(user) if self.unified else self._prepare_v1(user)), ""
        except OSError as error:
            return [], f"no control group could be made for {user} ({error})"

    def _prepare_v2(self, user: str) -> list[Path]:
        parent = self.parents[""]
        if "memory" not in (parent / "cgroup.controllers").read_text().split():
            raise OSError(f"{parent} has no memory controller: give the hub's unit Delegate=yes")
        if not (parent / "hub").is_dir():  # (a group with processes may not hand controllers down)
            (parent / "hub").mkdir()
            for pid in (parent / "cgroup.procs").read_text().split():
                (parent / "hub" / "cgroup.procs").write_text(pid)
            offered = (parent / "cgroup.controllers").read_text().split()
            handed = " ".join(f"+{kind}" for kind in ("memory", "cpu") if kind in offered)
            (parent / "cgroup.subtree_control").write_text(handed)
        group = parent / group_name(user)
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(self.memory_bytes))
        if (group / "memory.swap.max").exists():  # (no swap to spill into past the cap)
            (group / "memory.swap.max").write_text("0")
        if "cpu" in (parent / "cgroup.subtree_control").read_text().replace("+", "").split():
            (group / "cpu.max").write_text(f"{round(self.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")
        return [group]

    def groups_of(self, user: str) -> list[Path]:
        """``user``'s groups, made or not (to remove them once their processes have ended)."""
        return [parent / group_name(user) for parent in self.parents.values()]

    def _prepare_v1(self, user: str) -> list[Path]:
        if "memory" not in self.parents:
            raise OSError(f"no cgroup memory hierarchy under {self.root}")
        made = []
        for kind, parent in self.parents.items():
            group = parent / group_name(user)
            group.mkdir(exist_ok=True)
            made.append(group)
            if kind == "memory":
                (group / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
            else:
                (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(round(self.cpus * CFS_PERIOD_US)))
        return made


def remove(groups: list[Path]) -> None:
    """Remove ``groups`` once their processes have ended (one still in use, or gone, is left)."""
    for group in groups:
        try:
            group.rmdir()
        except OSError:
            pass


def join(groups: list[Path]) -> None:
    """Move the calling process into ``groups`` (run in the server's process before it drops
    root: what it starts afterwards stays in them)."""
    for group in groups:
        (group / "cgroup.procs").write_text(str(os.getpid()))
