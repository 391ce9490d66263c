"""Per-user memory and CPU caps for the course hub's servers (offloadlab_course.limits): the
group layouts on folders shaped like cgroup v1 and v2, and, where this machine lets the tests
make a group, a process past its cap killed and one within it left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offloadlab_course.limits import UserLimits, group_name, join, own_groups

MiB = 2**20
OWN = own_groups(Path("/proc/self/cgroup").read_text(encoding="utf-8"))


def test_own_groups_reads_v1_and_v2_lines():
    text = "12:memory:/a/b\n4:cpu,cpuacct:/c\n1:name=systemd:/d\n0::/user.slice/e\n"
    assert own_groups(text) == {
        "memory": "/a/b",
        "cpu": "/c",
        "cpuacct": "/c",
        "name=systemd": "/d",
        "": "/user.slice/e",
    }


def test_a_user_name_cannot_leave_its_folder():
    assert group_name("ada") == "offloadlab-ada"
    assert group_name("../../etc").startswith("offloadlab-.._.._etc-")  # (and a digest)
    assert "/" not in group_name("a/b")


def test_v2_the_hub_moves_to_a_leaf_and_hands_memory_and_cpu_to_the_users(tmp_path):
    parent = tmp_path / OWN.get("", "/").lstrip("/")
    parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (parent / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (parent / "cgroup.procs").write_text("11\n")
    limits = UserLimits(1536 * MiB, cpus=1.5, root=tmp_path)
    groups, why_none = limits.prepare("ada")
    assert why_none == "" and groups == [parent / "offloadlab-ada"] == limits.groups_of("ada")
    assert (parent / "hub" / "cgroup.procs").read_text() == "11"
    assert set((parent / "cgroup.subtree_control").read_text().split()) == {"+memory", "+cpu"}
    assert (groups[0] / "memory.max").read_text() == str(1536 * MiB)
    assert (groups[0] / "cpu.max").read_text() == "150000 100000"


def test_v2_without_the_memory_controller_says_to_delegate(tmp_path):
    parent = tmp_path / OWN.get("", "/").lstrip("/")
    parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text("cpu pids\n")
    (parent / "cgroup.controllers").write_text("cpu pids\n")
    groups, why_none = UserLimits(MiB, 1, root=tmp_path).prepare("ada")
    assert groups == [] and "Delegate=yes" in why_none and "ada" in why_none


@pytest.mark.skipif("memory" not in OWN or "cpu" not in OWN, reason="no cgroup v1 hierarchies")
def test_v1_a_group_below_the_hubs_own_in_memory_and_cpu(tmp_path):
    for kind in ("memory", "cpu"):
        (tmp_path / kind / OWN[kind].lstrip("/")).mkdir(parents=True, exist_ok=True)
    groups, why_none = UserLimits(512 * MiB, cpus=2, root=tmp_path).prepare("grace")
    memory, cpu = groups
    assert why_none == "" and memory.name == cpu.name == "offloadlab-grace"
    assert (memory / "memory.limit_in_bytes").read_text() == str(512 * MiB)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "200000"


def test_no_hierarchy_to_write_in_says_so(tmp_path):
    groups, why_none = UserLimits(MiB, 1, root=tmp_path).prepare("ada")
    assert groups == [] and why_none.startswith("no control group could be made for ada")


def test_past_its_cap_a_process_is_killed_and_within_it_runs():
    """On this machine's own control groups (root only): a process that fills 400 MiB in a
    group capped at 200 MiB is ended by the OOM killer; one that takes 50 MiB finishes."""
    if os.geteuid() != 0:
        pytest.skip("making a control group needs root")
    limits = UserLimits(200 * MiB, cpus=1)
    user = f"test-{os.getpid()}"
    groups, why_none = limits.prepare(user)
    if why_none:
        pytest.skip(why_none)
    try:
        ran = {
            size: subprocess.run(
                [sys.executable, "-c", f"b = bytearray({size * MiB})"],
                preexec_fn=lambda: join(groups),
                capture_output=True,
            ).returncode
            for size in (400, 50)
        }
        assert ran == {400: -9, 50: 0}
    finally:
        for group in limits.groups_of(user):
            group.rmdir()
