"""Host memory as a process may use it: the smaller of the machine's and its cgroup's limit.

A GPU job in a container or a Slurm allocation sees the whole server's memory through psutil; its
cgroup may allow a fraction of it, and the GPU kit's plan (a quarter of host memory pinned at most)
must hold to that fraction. Each case is a fake /proc and /sys under a temporary folder.
"""

import types

import psutil
import pytest
import torch

from offloadlab import devices, machine

GiB = 2**30


def fake_root(tmp_path, cgroup_lines: str, files: dict) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_lines)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize(
    "lines, files, expected",
    [
        # cgroup v2: the job's memory.max, tighter than its parent's
        (
            "0::/job/step\n",
            {
                "sys/fs/cgroup/job/memory.max": f"{16 * GiB}\n",
                "sys/fs/cgroup/job/step/memory.max": f"{8 * GiB}\n",
            },
            8 * GiB,
        ),
        # the parent's is tighter
        (
            "0::/job/step\n",
            {
                "sys/fs/cgroup/job/memory.max": f"{4 * GiB}\n",
                "sys/fs/cgroup/job/step/memory.max": "max\n",
            },
            4 * GiB,
        ),
        ("0::/job\n", {"sys/fs/cgroup/job/memory.max": "max\n"}, None),
        # cgroup v1: memory.limit_in_bytes in the memory controller's hierarchy
        (
            "4:memory:/job\n3:cpu,cpuacct:/job\n",
            {"sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{6 * GiB}\n"},
            6 * GiB,
        ),
        # a container seeing the host's path as its own root
        (
            "4:memory:/docker/abc\n",
            {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2 * GiB}\n"},
            2 * GiB,
        ),
        ("0::/\n", {}, None),
    ],
)
def test_the_cgroup_memory_limit(tmp_path, lines, files, expected):
    assert machine.cgroup_memory_limit(fake_root(tmp_path, lines, files)) == expected


def test_no_proc_is_no_limit(tmp_path):
    assert machine.cgroup_memory_limit(tmp_path) is None


def test_host_memory_is_the_smaller_of_the_machine_and_its_cgroup(tmp_path):
    physical = psutil.virtual_memory().total
    small = fake_root(tmp_path / "a", "0::/job\n", {"sys/fs/cgroup/job/memory.max": f"{GiB}\n"})
    assert machine.host_memory(small) == (GiB, "this process's cgroup memory limit")
    large = fake_root(
        tmp_path / "b", "0::/job\n", {"sys/fs/cgroup/job/memory.max": f"{1024 * physical}\n"}
    )
    assert machine.host_memory(large) == (physical, "this machine's memory")


def test_the_gpu_present_is_planned_with_the_cgroups_memory(monkeypatch):
    """devices.present() took psutil's total: a 2 TB server's, for a job allowed 64 GiB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: types.SimpleNamespace(name="NVIDIA H200", total_memory=150 * 10**9),
    )
    monkeypatch.setattr(machine, "pcie_link", lambda: machine.PCIeLink(source="faked"))
    monkeypatch.setattr(machine, "host_memory", lambda: (64 * GiB, "a cgroup, faked"))
    profile = devices.present()
    assert profile.host_memory_bytes == 64 * GiB
    assert profile.host_memory_basis.startswith("a cgroup, faked")
