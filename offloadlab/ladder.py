"""The memory-tier ladder: capacity and bandwidth of each tier, and the links between them.

:func:`measure` runs the probes for this machine; :func:`of_machine` turns their records
into ladder rows; :func:`nominal` gives the material's reference ladder. A row is a plain
dict with ``name``, ``capacity_bytes``, ``bandwidth_bytes_per_s`` and ``source``
('measured', 'emulated', 'nominal' or 'not measured').
"""

from __future__ import annotations

from . import machine as _machine
from . import probe, reference
from .link import open_link
from .units import format_bandwidth, format_size

__all__ = ["measure", "of_machine", "nominal", "table", "cliff", "reference_figures"]


def measure(quick: bool = False, disk_folder=".", link=None) -> dict:
    """Run every probe this machine allows; returns {'machine': ..., 'records': [Measurement, ...],
    'faults': [str, ...]}.

    ``quick`` shrinks sizes so the whole run takes seconds on a CPU-only machine. The disk folder
    is checked first (ValueError or OSError before any sweep runs); if the disk still fails during
    its probe (filled up meanwhile, an I/O error), the other records are kept, the disk's are
    marked not measured, and ``faults`` says why in one line.
    """
    disk_size = "64 MiB" if quick else "1 GiB"
    probe.check_disk_folder(disk_folder, disk_size)
    info = _machine.describe(disk_folder)
    records = probe.host_memory_bandwidth(
        "64 MiB" if quick else "512 MiB", repeats=3 if quick else 5
    )
    records.append(probe.device_memory_bandwidth("256 MiB" if quick else "2 GiB"))
    owned = link is None
    link = open_link() if owned else link
    try:
        records += probe.link_sweep(link, quick=quick, repeats=3 if quick else 5)
        records += probe.bidirectional(link, "16 MiB" if link.emulated else "256 MiB", repeats=3)
    finally:
        if owned:
            link.close()
    faults = []
    try:
        records += probe.disk_bandwidth(disk_folder, disk_size)
    except OSError as error:
        fault = f"disk probe in {info.disk.path}: {error.strerror or error}"
        faults.append(fault)
        records += [
            probe.Measurement(
                f"disk {direction} bandwidth",
                None,
                "B/s",
                "not measured",
                f"sequential {direction}",
                note=fault,
            )
            for direction in ("write", "read")
        ]
    return {"machine": info, "records": records, "faults": faults}


def _best(records, quantity):
    found = [r for r in records if r.quantity == quantity and r.value is not None]
    return max(found, key=lambda r: r.value) if found else None


def _row(name, capacity, record, note=""):
    if record is None or record.value is None:
        return {
            "name": name,
            "capacity_bytes": capacity,
            "bandwidth_bytes_per_s": None,
            "source": "not measured",
            "note": note or (record.note if record else ""),
        }
    return {
        "name": name,
        "capacity_bytes": capacity,
        "bandwidth_bytes_per_s": record.value,
        "source": record.source,
        "note": note or record.method,
    }


def of_machine(measured: dict) -> dict:
    """Tiers and links of the measured machine, from the output of :func:`measure`."""
    info, records = measured["machine"], measured["records"]
    gpu = info.accelerator
    tiers = [
        _row(
            f"GPU memory ({gpu.name})" if gpu.name else "GPU memory",
            gpu.memory_bytes,
            _best(records, "device memory bandwidth"),
            "" if gpu.name else "no GPU on this machine",
        ),
        _row("host memory", info.host_memory_bytes, _best(records, "host copy bandwidth")),
        # Named by its role, not its path: the row is shown in the book, built on other machines.
        _row("disk under test", info.disk.total_bytes, _best(records, "disk read bandwidth")),
    ]
    links = []
    for direction, name in (("h2d", "host → GPU"), ("d2h", "GPU → host")):
        sweep = [
            r
            for r in records
            if r.params.get("direction") == direction
            and r.params.get("pinned")
            and not r.params.get("duplex")
        ]
        if sweep:
            fit = probe.fit_sweep(sweep, direction)
            links.append(
                {
                    "name": name,
                    "bandwidth_bytes_per_s": fit.beta,
                    "latency_s": fit.alpha,
                    "source": sweep[0].source,
                    "note": "α–β fit of the pinned size sweep",
                }
            )
    if info.pcie.nominal_bytes_per_s:
        links.append(
            {
                "name": f"PCIe gen {info.pcie.max_generation} ×{info.pcie.max_width} (nominal)",
                "bandwidth_bytes_per_s": info.pcie.nominal_bytes_per_s,
                "source": "nominal",
                "note": "from NVML's link generation and width",
            }
        )
    links.append(_row("disk → host", None, _best(records, "disk read bandwidth")))
    return {"tiers": tiers, "links": links}


def nominal() -> dict:
    """The material's ladder (tiers and links), marked nominal."""
    data = reference.load("nominal-ladder")
    return {
        "tiers": [{**t, "source": "nominal"} for t in data["tiers"]],
        "links": [{**link, "source": "nominal"} for link in data["links"]],
    }


def cliff(ladder: dict) -> float | None:
    """How many times slower the host link is than GPU memory (None if either is unknown)."""
    hbm = ladder["tiers"][0]["bandwidth_bytes_per_s"]
    host_links = [
        link["bandwidth_bytes_per_s"]
        for link in ladder["links"]
        if link["name"] in ("host → GPU", "PCIe, CPU to GPU") and link["bandwidth_bytes_per_s"]
    ]
    return hbm / host_links[0] if hbm and host_links else None


def table(ladder: dict) -> str:
    """A plain-text table of a ladder's tiers and links."""

    def size(v):
        return format_size(v) if v else "–"

    def rate(row):
        v = row.get("bandwidth_bytes_per_s")
        return (
            format_bandwidth(v)
            if v
            else ("not given" if row["source"] == "nominal" else "not measured")
        )

    lines = [f"{'tier':<34} {'capacity':>10} {'bandwidth':>14}  source"]
    lines += [
        f"{t['name'][:34]:<34} {size(t.get('capacity_bytes')):>10} {rate(t):>14}  {t['source']}"
        for t in ladder["tiers"]
    ]
    lines.append(f"{'link':<34} {'':>10} {'bandwidth':>14}  source")
    lines += [
        f"{link['name'][:34]:<34} {'':>10} {rate(link):>14}  {link['source']}"
        for link in ladder["links"]
    ]
    return "\n".join(lines)


def reference_figures(name: str, folder=None) -> dict:
    """Headline figures of a measured reference file (from ``make gpu-check``), bytes/s.

    Keys: 'label', 'date', 'h2d', 'd2h' (pinned asymptotic bandwidth, α–β fit), 'device memory',
    'host memory'; a figure the file does not hold is None.
    """
    data = reference.load(name, folder)
    if data["kind"] == "nominal":
        raise ValueError(f"name: {name!r} is the nominal ladder, not a measurement")
    records = data["records"]

    def best(quantity):
        values = [r["value"] for r in records if r.get("quantity") == quantity and r.get("value")]
        return max(values) if values else None

    figures = {
        "label": data["label"],
        "date": data["provenance"].get("date"),
        "device memory": best("device memory bandwidth"),
        "host memory": best("host copy bandwidth"),
    }
    for direction in ("h2d", "d2h"):
        sweep = [
            r
            for r in records
            if r.get("params", {}).get("direction") == direction
            and r["params"].get("pinned")
            and not r["params"].get("duplex")
        ]
        figures[direction] = (
            probe.fit_alpha_beta(
                [r["params"]["size"] for r in sweep], [r["params"]["median_seconds"] for r in sweep]
            ).beta
            if sweep
            else None
        )
    return figures
