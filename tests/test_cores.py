"""Threads from the cores this process may use: its affinity mask and its cgroup's CPU quota."""

import os

import pytest

from offloadlab import cores, cpu_adam


def tree(tmp_path, cgroup: str, files: dict):
    """A fake /proc/self/cgroup and /sys/fs/cgroup under tmp_path."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_cgroup_v2_quota_in_whole_cores(tmp_path):
    root = tree(tmp_path, "0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "1600000 100000\n"})
    assert cores.cgroup_cpu_limit(root) == 16


def test_cgroup_v2_the_tightest_ancestor_counts_and_max_is_no_limit(tmp_path):
    root = tree(
        tmp_path, "0::/a/b\n", {"a/cpu.max": "250000 100000\n", "a/b/cpu.max": "max 100000\n"}
    )
    assert cores.cgroup_cpu_limit(root) == 2  # 2.5 cores: two threads, never more than the quota


def test_cgroup_v2_inside_a_container_sees_its_own_root(tmp_path):
    root = tree(tmp_path, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert cores.cgroup_cpu_limit(root) == 4


def test_cgroup_v1_cfs_quota(tmp_path):
    root = tree(
        tmp_path,
        "4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cores.cgroup_cpu_limit(root) == 3


def test_cgroup_v1_no_quota_and_a_fraction_of_a_core(tmp_path):
    unlimited = tree(
        tmp_path / "a",
        "1:cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert cores.cgroup_cpu_limit(unlimited) is None
    half = tree(
        tmp_path / "b",
        "1:cpu:/\n",
        {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert cores.cgroup_cpu_limit(half) == 1


def test_no_cgroup_information(tmp_path):
    assert cores.cgroup_cpu_limit(tmp_path) is None
    assert cores.usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_a_16_core_slice_of_a_192_core_host(tmp_path, monkeypatch):
    """The finding: threads came from os.cpu_count(), 191 on a 16-core slice."""
    monkeypatch.setattr(os, "cpu_count", lambda: 192)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert cores.usable_cores(tmp_path) == 16 and cores.worker_threads(tmp_path) == 15
    root = tree(tmp_path, "0::/\n", {"cpu.max": "800000 100000\n"})  # and a quota of 8 inside it
    assert cores.usable_cores(root) == 8 and cores.worker_threads(root) == 7


@pytest.mark.parametrize("usable", [1, 2, 16])
def test_cpu_adam_and_the_link_leave_one_core(monkeypatch, usable):
    monkeypatch.setattr(cores, "usable_cores", lambda root="/": usable)
    assert cpu_adam.default_threads() == max(1, usable - 1)


@pytest.mark.parametrize("usable", [1, 2, 3, 16])
def test_cpu_adam_beside_a_gpu_leaves_the_launcher_and_autograd_a_core_each(monkeypatch, usable):
    """The finding (issue 35): the kernel took every core but one beside a GPU too, where the
    training loop and backward's autograd thread both launch kernels while the update runs."""
    monkeypatch.setattr(cores, "usable_cores", lambda root="/": usable)
    assert cpu_adam.default_threads(gpu=True) == max(1, usable - 2)


@pytest.mark.parametrize(
    "usable, ranks, gpu, threads",
    [(16, 8, True, 1), (64, 8, True, 6), (64, 4, False, 15), (2, 2, False, 1)],
)
def test_ranks_on_one_host_share_its_cores(monkeypatch, usable, ranks, gpu, threads):
    """Eight FSDP2 ranks on one 64-core host: each rank's kernel takes its eighth, less its own
    launcher (and autograd thread beside a GPU): 6 threads each, not 62 each."""
    monkeypatch.setattr(cores, "usable_cores", lambda root="/": usable)
    assert cpu_adam.default_threads(gpu=gpu, ranks=ranks) == threads


def test_the_ranks_sharing_a_host_are_torchruns_local_world_unless_pinned(monkeypatch):
    """A rank shares its cores with torchrun's other local ranks unless it was pinned to its own
    (its mask differs from its launcher's); inside a container's or a Slurm job's cpuset every
    rank sees fewer cores than the host has, and is still sharing them."""
    from offloadlab.offload.sharded import ranks_on_this_host

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    parent, cpuset = os.getppid(), {0, 1, 2, 3}  # fewer than the host's cores

    def masks(mine, launchers):
        monkeypatch.setattr(
            os, "sched_getaffinity", lambda pid: launchers if pid == parent else mine
        )

    masks(cpuset, cpuset)
    assert ranks_on_this_host() == 4
    masks({0}, cpuset)  # numactl/taskset gave this rank a core of its own
    assert ranks_on_this_host() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    masks(cpuset, cpuset)
    assert ranks_on_this_host() == 1
