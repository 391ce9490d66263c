"""Probes, the α–β fit, the ladder, machine discovery and reference data."""

import copy
import errno
import json
import os

import numpy as np
import pytest
import torch

from offloadlab import ladder, machine, probe, reference
from offloadlab.link import EmulatedLink
from tests.conftest import offloadlab


@pytest.mark.parametrize("alpha, beta", [(10e-6, 25e9), (2e-3, 1e9), (0.0, 50e9)])
def test_alpha_beta_fit_recovers_known_values(alpha, beta):
    sizes = np.array([4 * 4**k * 1024 for k in range(9)], dtype=float)
    rng = np.random.default_rng(0)
    times = (alpha + sizes / beta) * rng.normal(1, 0.01, sizes.size)
    fit = probe.fit_alpha_beta(sizes, times)
    assert fit.beta == pytest.approx(beta, rel=0.03)
    assert fit.alpha == pytest.approx(alpha, rel=0.1, abs=2e-7)
    assert fit.time(1e9) == pytest.approx(fit.alpha + 1e9 / fit.beta)
    assert fit.half_bandwidth_size() == pytest.approx(fit.alpha * fit.beta)


def test_alpha_beta_fit_bad_input():
    with pytest.raises(ValueError, match="^sizes: "):
        probe.fit_alpha_beta([4096, 4096], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="^seconds: expected one time per size"):
        probe.fit_alpha_beta([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="^seconds: "):
        probe.fit_alpha_beta([1, 2, 3], [1, -2, 3])
    with pytest.raises(ValueError, match="do not grow"):
        probe.fit_alpha_beta([1e3, 1e6], [2.0, 1.0])


def test_host_memory_records_have_spread_and_provenance():
    records = probe.host_memory_bandwidth("8 MiB", threads=[1], repeats=3)
    assert {r.quantity for r in records} == {"host copy bandwidth", "host update bandwidth"}
    for r in records:
        assert r.source == "measured" and r.unit == "B/s" and r.repeats == 3
        assert r.spread[0] <= r.value <= r.spread[1]
        assert r.provenance["torch"] == torch.__version__ and "date" in r.provenance
    with pytest.raises(ValueError, match="^threads: "):
        probe.host_memory_bandwidth("1 MiB", threads=[0])
    with pytest.raises(ValueError, match="^nbytes: "):
        probe.host_memory_bandwidth("-1 MiB")


def test_sweep_on_the_emulated_link_is_labelled_and_never_beats_its_pacing():
    """Only what the pacing guarantees is asserted: a busy machine makes copies slower, never faster
    (how close the fit comes to 2 GB/s is `offloadlab bench link`'s business, not a test's)."""
    with EmulatedLink(bandwidth="2 GB/s", pageable_fraction=0.5) as link:
        records = probe.link_sweep(link, sizes=["1 MiB", "4 MiB", "16 MiB"], repeats=2)
        both = probe.bidirectional(link, "4 MiB", repeats=2)
    assert len(records) == 3 * 2 * 2
    assert all(r.source == "emulated" for r in records + both)
    for r in records:  # pinned copies at most the link's rate, pageable ones at most half of it
        assert r.spread[1] <= 2e9 * (1 if r.params["pinned"] else 0.5) * 1.001
    assert {(r.params["direction"], r.params["pinned"]) for r in records} == {
        (d, p) for d in ("h2d", "d2h") for p in (True, False)
    }
    with EmulatedLink() as spare:
        with pytest.raises(ValueError, match="^directions: "):
            probe.link_sweep(spare, directions=["up"])
        with pytest.raises(ValueError, match="^sizes: "):
            probe.link_sweep(spare, sizes=["2 B"])


def test_device_memory_not_measured_without_gpu():
    record = probe.device_memory_bandwidth("1 MiB")
    if torch.cuda.is_available():
        assert record.source == "measured" and record.value > 0
    else:
        assert record.value is None and record.source == "not measured" and "no GPU" in record.note


def test_disk_probe(tmp_path):
    write, read = probe.disk_bandwidth(tmp_path, "8 MiB", block="1 MiB")
    assert write.quantity == "disk write bandwidth" and read.quantity == "disk read bandwidth"
    assert write.value > 0 and read.value > 0 and "fsync" in write.method
    assert not list(tmp_path.iterdir()), "the probe must remove its file"
    with pytest.raises(ValueError, match="^block: "):
        probe.disk_bandwidth(tmp_path, "8 MiB", block="1000 B")
    with pytest.raises(ValueError, match="^path: "):
        probe.disk_bandwidth(tmp_path / "missing")


def test_disk_probe_at_a_queue_depth(tmp_path):
    write, read = probe.disk_bandwidth(tmp_path, "8 MiB", block="1 MiB", queue_depth=4)
    assert write.params["queue_depth"] == 4 and "4 blocks in flight" in read.method
    assert write.value > 0 and read.value > 0
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="^queue_depth: "):
        probe.disk_bandwidth(tmp_path, "8 MiB", queue_depth=0)


def test_disk_probe_never_follows_a_planted_link(tmp_path):
    """A symlink planted where the probe writes must not make it overwrite another file."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    probe_folder = tmp_path / "shared"
    probe_folder.mkdir()
    # the old fixed name, and the new one
    for name in (f".offloadlab-disk-probe-{os.getpid()}", "probe.bin"):
        (probe_folder / name).symlink_to(victim)
    probe.disk_bandwidth(probe_folder, "1 MiB", block="1 MiB")
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in probe_folder.iterdir()) == sorted(
        [f".offloadlab-disk-probe-{os.getpid()}", "probe.bin"]
    )


def test_disk_probe_on_a_full_or_read_only_disk(small_disk):
    full = small_disk("2m")
    with pytest.raises(OSError) as info:
        probe.disk_bandwidth(full, "8 MiB", block="1 MiB")
    assert info.value.errno == errno.ENOSPC
    assert not list(full.iterdir()), (
        "the probe must remove its scratch file and folder on a full disk"
    )
    with pytest.raises(OSError, match="has 2.1 MB free; the disk probe writes 8.39 MB"):
        probe.check_disk_folder(full, "8 MiB")
    read_only = small_disk("1m", read_only=True)
    for attempt in (
        lambda: probe.check_disk_folder(read_only, "64 KiB"),
        lambda: probe.disk_bandwidth(read_only, "1 MiB", block="1 MiB"),
    ):
        with pytest.raises(
            OSError, match=f"cannot create a scratch file in {read_only}: Read-only file system"
        ):
            attempt()


def test_ladder_keeps_the_sweep_when_the_disk_fails_during_its_probe(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(probe, "disk_bandwidth", disk_full)
    measured = ladder.measure(quick=True, disk_folder=tmp_path)
    assert measured["faults"] == [f"disk probe in {tmp_path}: No space left on device"]
    by_quantity = {r.quantity: r for r in measured["records"]}
    assert by_quantity["disk read bandwidth"].source == "not measured"
    assert "No space left" in by_quantity["disk read bandwidth"].note
    assert by_quantity["host copy bandwidth"].value > 0 and any(
        q.startswith("h2d") for q in by_quantity
    )


def test_pcie_nominal_rates():
    assert machine.pcie_bandwidth(4, 16) == pytest.approx(31.5e9, rel=0.001)
    assert machine.pcie_bandwidth(5, 16) == pytest.approx(63.0e9, rel=0.001)
    assert machine.pcie_bandwidth(3, 8) == pytest.approx(7.88e9, rel=0.001)
    with pytest.raises(ValueError, match="^generation: "):
        machine.pcie_bandwidth(9, 16)
    with pytest.raises(ValueError, match="^width: "):
        machine.pcie_bandwidth(4, 3)


def test_describe_this_machine(tmp_path):
    info = machine.describe(tmp_path)
    assert info.host_memory_bytes > 0 and info.logical_cores >= 1 and info.disk.free_bytes > 0
    if not torch.cuda.is_available():
        assert info.accelerator.kind in ("none", "mps") and info.pcie.generation is None
        assert info.pcie.source.startswith("unknown")
    json.dumps(info.to_dict())


def test_nominal_ladder_is_the_material():
    nominal = ladder.nominal()
    tiers = {t["name"]: t for t in nominal["tiers"]}
    assert tiers["GPU memory (HBM)"]["capacity_bytes"] == 80e9
    assert tiers["GPU memory (HBM)"]["bandwidth_bytes_per_s"] == 3350e9
    links = {link["name"].split(",")[0]: link["bandwidth_bytes_per_s"] for link in nominal["links"]}
    assert links["NVLink"] == 450e9 and links["PCIe"] == 60e9 and links["InfiniBand"] == 50e9
    assert all(row["source"] == "nominal" for row in nominal["tiers"] + nominal["links"])
    assert ladder.cliff(nominal) == pytest.approx(3350 / 60)
    # The reference node's host (two DDR5-4800 sockets, 8 channels each) outruns its own PCIe link.
    host = tiers["host memory"]
    assert (
        host["bandwidth_bytes_per_s"] == 8 * 4800e6 * 8
        and host["bandwidth_max_bytes_per_s"] == 2 * 307.2e9
    )
    assert host["bandwidth_bytes_per_s"] > links["PCIe"]


def _offloadlab(*args, cwd=None):
    return offloadlab(*args, cwd=cwd)


def test_probe_command_quick_json(tmp_path):
    out = tmp_path / "out.json"
    result = _offloadlab("probe", "--quick", "--disk", str(tmp_path), "--json", str(out))
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    quantities = {r["quantity"] for r in payload["records"]}
    assert {
        "host copy bandwidth",
        "host update bandwidth",
        "disk read bandwidth",
        "disk write bandwidth",
    } <= quantities
    for r in payload["records"]:
        if r["quantity"].startswith(("host", "disk")):
            assert r["spread"] is not None and r["source"] == "measured"
        if r["quantity"].startswith(("h2d", "d2h")):
            assert r["source"] == ("measured" if torch.cuda.is_available() else "emulated")
        if r["quantity"] == "device memory bandwidth" and not torch.cuda.is_available():
            assert r["source"] == "not measured"
    assert "emulated" in result.stdout or torch.cuda.is_available()
    again = _offloadlab("probe", "--quick", "--disk", str(tmp_path), "--json", str(out))
    assert (
        again.returncode == 2 and "exists" in again.stderr and len(again.stderr.splitlines()) == 1
    )


def test_probe_prints_no_path_of_this_machine(tmp_path):
    """The ladder's rows end up in the book's tables and figures, which must not show the build
    machine's folders."""
    folder = tmp_path / "disk-under-test"
    folder.mkdir()
    result = _offloadlab("probe", "--quick", "--disk", str(folder))
    assert result.returncode == 0, result.stderr
    assert str(tmp_path) not in result.stdout and "disk-under-test" not in result.stdout
    assert "disk under test" in result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["probe", "--disk", "/no/such/folder"], "--disk"),
        (["probe", "--json", "/no/such/folder/out.json"], "--json"),
        (["bench", "warp-drive"], "invalid choice"),
    ],
)
def test_probe_and_bench_bad_arguments(args, fragment):
    result = _offloadlab(*args)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr


def test_bench_link_reports_ratios(tmp_path):
    out = tmp_path / "bench.json"
    result = _offloadlab("bench", "link", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert "h2d pinned / pageable" in payload["ratios"]
    assert payload["source"] == ("measured" if torch.cuda.is_available() else "emulated")
    assert "ratios:" in result.stdout


def test_reference_figures_from_a_saved_probe(tmp_path):
    with EmulatedLink(bandwidth="2 GB/s") as link:
        records = probe.link_sweep(link, sizes=["1 MiB", "4 MiB", "16 MiB"], repeats=2)
    records += probe.host_memory_bandwidth("8 MiB", threads=[1], repeats=2)
    payload = [r.to_dict() for r in records]
    # The figures are the α–β fit of the pinned one-direction sweep, nothing else. Its timings are
    # replaced by exact ones (a busy machine bends a real fit), and the rows the fit must skip
    # (pageable, both directions at once) get absurd ones.
    rates = {"h2d": 2e9, "d2h": 1.5e9}
    both_ways = copy.deepcopy(next(r for r in payload if r.get("params", {}).get("pinned")))
    both_ways["params"]["duplex"] = True
    payload.append(both_ways)
    for row in payload:
        params = row.get("params", {})
        if "direction" in params:
            honest = params.get("pinned") and not params.get("duplex")
            params["median_seconds"] = 20e-6 + params["size"] / (
                rates[params["direction"]] if honest else 1e15
            )
    reference.save(
        "gpu-test-card", "emulated", "test card", payload[0]["provenance"], payload, folder=tmp_path
    )
    figures = ladder.reference_figures("gpu-test-card", folder=tmp_path)
    assert figures["label"] == "test card" and figures["device memory"] is None
    assert figures["h2d"] == pytest.approx(2e9) and figures["d2h"] == pytest.approx(1.5e9)
    assert figures["host memory"] == max(
        r["value"] for r in payload if r["quantity"] == "host copy bandwidth"
    )
    with pytest.raises(ValueError, match="nominal"):
        ladder.reference_figures("nominal-ladder")


def test_bench_nvme_sets_the_tier_beside_raw_io(tmp_path):
    from offloadlab import bench

    result = bench.nvme(quick=True, folder=tmp_path, nbytes="4 MiB")
    rates = {row["contender"]: row["bytes_per_s"] for row in result["rows"]}
    for depth in (1, 4, 16):
        for name in ("raw direct I/O", "FileTier, no checksums", "FileTier, crc32"):
            assert (
                rates[f"{name} write, depth {depth}"] > 0
                and rates[f"{name} read, depth {depth}"] > 0
            )
    assert rates["probe read, depth 1, 4 MiB blocks"] > 0
    assert any("crash-safety overhead" in name for name in result["ratios"])
    assert all(value > 0 for value in result["ratios"].values())
    json.dumps(result, allow_nan=False)
    assert not list(tmp_path.iterdir()), "bench nvme must leave no files"


@pytest.mark.parametrize(
    "args, status, fragment",
    [
        (["bench", "link", "--disk", "."], 2, "--disk: only bench nvme uses a disk"),
        (["bench", "nvme", "--disk", "/no/such/folder"], 2, "--disk: expected an existing folder"),
    ],
)
def test_bench_nvme_arguments(args, status, fragment):
    result = _offloadlab(*args)
    assert (
        result.returncode == status
        and fragment in result.stderr
        and "Traceback" not in result.stderr
    )


def test_bench_nvme_refuses_a_read_only_disk_before_it_runs(small_disk):
    result = _offloadlab("bench", "nvme", "--disk", str(small_disk("1m", read_only=True)))
    assert result.returncode == 1 and "Read-only file system" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_each_timed_copy_waits_behind_a_busy_engine_so_alpha_holds_no_host_dispatch():
    """On an idle copy stream a copy's begin event fires when it is recorded, before the host has
    issued the copy: α would time the host. Every timed copy is issued behind a longer one."""
    with EmulatedLink(bandwidth="2 GB/s", latency=0) as link:
        with link.record() as recording:
            records = probe.link_sweep(
                link, sizes=["64 KiB", "256 KiB"], directions=("h2d",), pinned=(True,), repeats=2
            )
    filler = probe.busy_filler_bytes(link.emulated)
    sizes = [t.nbytes for t in recording.transfers]
    assert sizes == [
        64 * 2**10,
        filler,
        64 * 2**10,
        filler,
        64 * 2**10,
        256 * 2**10,
        filler,
        256 * 2**10,
        filler,
        256 * 2**10,
    ]
    timed = [t for t in recording.transfers if t.nbytes != filler]
    fillers = [t for t in recording.transfers if t.nbytes == filler]
    for before, measured in zip(fillers, [t for i, t in enumerate(timed) if i % 3]):
        # (engines run in order: it began once the filler was done)
        assert measured.start >= before.end
    assert all(r.params["pinning"] == "emulated" and "behind a" in r.method for r in records)
