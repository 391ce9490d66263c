"""Device profiles: what a GPU and the server around it have, for sizing work before it runs.

Everything in offloadlab that sizes itself for a GPU — the benchmarks, chapter 3's experiment,
lab 4's memory cap, the GPU tests, ``offloadlab gpu-check`` — works from a
:class:`DeviceProfile`, so a CPU-only machine can plan (and a test can check) what each part
would ask of an H100 before one is lent. The profiles here are datasheet figures:

- memory in GB (10⁹ bytes) as the datasheet gives it; a card reports a little more to torch
  (an H100's "80 GB" is 85.0·10⁹ bytes), so plans made from these figures are conservative;
- the host link: PCIe generation and width, whose nominal one-direction rate
  :func:`offloadlab.machine.pcie_bandwidth` computes (gen 5 ×16: 63.0 GB/s);
- dense matrix-product rates: fp32 with TF32 off (CUDA cores; torch's default for fp32
  matmuls), fp32 with TF32 on (tensor cores), and bf16 (tensor cores). NVIDIA's data-center
  datasheets print tensor-core rates *with* 2:4 sparsity; the dense rates here are half of them;
- host memory: an assumption, stated with each profile — the share of one GPU in the server such
  a GPU usually sits in (a DGX gives 8 GPUs 1–2 TB), since the kit runs on one GPU of it.

:func:`present` builds the profile of the GPU this machine has: the datasheet figures of the
matching profile, with the real memory, host memory (the smaller of the machine's and its cgroup's
limit: :func:`offloadlab.machine.host_memory`) and PCIe link put in.

Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM column); NVIDIA H200 Tensor Core GPU datasheet
(SXM column); NVIDIA A100 Tensor Core GPU datasheet (40 GB); NVIDIA L4 Tensor Core GPU datasheet;
NVIDIA Ada Lovelace GPU architecture whitepaper v2.01, appendix table for the GeForce RTX 4090;
NVIDIA DGX H100 / DGX H200 / DGX A100 datasheets for the servers' system memory.
"""

from __future__ import annotations

from types import MappingProxyType
import dataclasses
import os
import re

import torch

from . import machine

__all__ = [
    "DeviceProfile",
    "PROFILES",
    "Footprint",
    "ASSUMED",
    "get",
    "present",
    "names",
    "quick_mode",
]

GB = 10**9

# What a plan's time estimates assume, where a datasheet gives only a peak. Sizes never depend on
# these: a plan's bytes come from peaks (an upper bound), and the runs measure before they size.
ASSUMED = MappingProxyType(
    {
        "link_efficiency": 0.8,  # pinned copies reach about 80 % of the PCIe nominal rate
        # pageable copies are staged by the driver: about a third of it
        "pageable_efficiency": 0.35,
        "matmul_efficiency": 0.7,  # large products reach about 70 % of the datasheet peak
        "host_bandwidth": 20e9,  # bytes/s of one socket's memory for a streaming CPU loop
        "disk_bandwidth": 2e9,  # bytes/s of a data-center NVMe drive, sequential, one direction
        "process_start": 8.0,  # seconds: a Python process importing torch and starting CUDA
        "notebook_start": 6.0,  # seconds: a Jupyter kernel started, the notebook's imports run
    }
)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What a piece of work asks of a machine: pinned host bytes and device bytes at most at once,
    and its estimated seconds (see :data:`ASSUMED`); ``basis`` says how they were found."""

    pinned_bytes: int
    device_bytes: int
    seconds: float
    basis: str = ""


def quick_mode() -> bool:
    """True when ``OFFLOADLAB_QUICK`` is set (to anything but 0): the GPU kit's quick run, in which
    the work the package sizes for a GPU (chapter 3's experiment, the benchmarks) is smaller."""
    return os.environ.get("OFFLOADLAB_QUICK", "0") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One GPU and the server around it. Sizes in bytes, rates in FLOP/s (dense)."""

    name: str  # how to ask for it: --profile NAME
    gpu: str  # the product
    memory_bytes: int  # device memory (datasheet GB, or what the card reports)
    host_memory_bytes: int  # host memory this GPU's work may use (see host_memory_basis)
    host_memory_basis: str  # where that figure comes from
    pcie_generation: int
    pcie_width: int
    fp32_flops: float  # fp32 matrix products, TF32 off
    tf32_flops: float  # fp32 matrix products, TF32 on
    bf16_flops: float  # bf16 matrix products
    source: str  # where the figures come from

    @property
    def link_bytes_per_s(self) -> float:
        """The host link's nominal rate in one direction (bytes/s); achievable is lower (≈ 80 %)."""
        return machine.pcie_bandwidth(self.pcie_generation, self.pcie_width)

    def matmul_flops(self, dtype: torch.dtype = torch.float32, tf32: bool | None = None) -> float:
        """The dense matrix-product rate for ``dtype``; for fp32, with TF32 on or off (None: as
        torch is set now, ``torch.backends.cuda.matmul.allow_tf32``)."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.bf16_flops
        if dtype != torch.float32:
            raise ValueError(f"dtype: expected torch.float32, bfloat16 or float16; got {dtype}")
        if tf32 is None:
            tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return self.tf32_flops if tf32 else self.fp32_flops

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "link_bytes_per_s": self.link_bytes_per_s}


_HOPPER = (
    "NVIDIA {} Tensor Core GPU datasheet, SXM column (tensor rates halved: printed with sparsity)"
)

PROFILES = MappingProxyType(
    {
        p.name: p
        for p in (
            DeviceProfile(
                "h100-sxm",
                "NVIDIA H100 SXM5 80 GB",
                80 * GB,
                256 * GB,
                "a DGX H100's 2 TB of system memory shared by its 8 GPUs",
                5,
                16,
                67e12,
                494.5e12,
                989.5e12,
                _HOPPER.format("H100"),
            ),
            DeviceProfile(
                "h200",
                "NVIDIA H200 SXM 141 GB",
                141 * GB,
                256 * GB,
                "a DGX H200's 2 TB of system memory shared by its 8 GPUs",
                5,
                16,
                67e12,
                494.5e12,
                989.5e12,
                _HOPPER.format("H200"),
            ),
            DeviceProfile(
                "a100-40gb",
                "NVIDIA A100 40 GB",
                40 * GB,
                128 * GB,
                "a DGX A100's 1 TB of system memory shared by its 8 GPUs",
                4,
                16,
                19.5e12,
                156e12,
                312e12,
                "NVIDIA A100 Tensor Core GPU datasheet, 40 GB (tensor rates: the dense figures)",
            ),
            DeviceProfile(
                "l4",
                "NVIDIA L4 24 GB",
                24 * GB,
                32 * GB,
                "a cloud VM with one L4 and 32 GB (Google Cloud's g2-standard-8)",
                4,
                16,
                30.3e12,
                60e12,
                121e12,
                "NVIDIA L4 Tensor Core GPU datasheet (tensor rates halved: printed with sparsity)",
            ),
            DeviceProfile(
                "rtx-4090",
                "NVIDIA GeForce RTX 4090 24 GB",
                24 * GB,
                64 * GB,
                "a workstation with 64 GB",
                4,
                16,
                82.6e12,
                82.6e12,
                165.2e12,
                "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 (dense tensor "
                "rates, FP32 accumulate)",
            ),
        )
    }
)

# The names torch reports for each profile's GPU (torch.cuda.get_device_name), as patterns.
_REPORTED = (
    ("h200", r"\bH200\b"),
    ("h100-sxm", r"\bH100\b"),
    ("a100-40gb", r"\bA100\b"),
    ("l4", r"\bL4\b"),
    ("rtx-4090", r"RTX 4090"),
)


def names() -> list[str]:
    return list(PROFILES)


def get(name: str) -> DeviceProfile:
    """The profile called ``name``; ValueError naming those there are."""
    if name not in PROFILES:
        raise ValueError(f"profile: expected one of {', '.join(PROFILES)}; got {name!r}")
    return PROFILES[name]


def matching(gpu_name: str) -> DeviceProfile | None:
    """The profile whose GPU torch reports as ``gpu_name`` (e.g. 'NVIDIA H100 80GB HBM3'), or
    None."""
    return next((PROFILES[n] for n, pattern in _REPORTED if re.search(pattern, gpu_name)), None)


def present() -> DeviceProfile | None:
    """The profile of this machine's first CUDA GPU (None without one): the matching profile's
    rates with this machine's real device memory, host memory and PCIe link. A GPU no profile
    matches raises ValueError naming it (pass a profile by name instead)."""
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    known = matching(properties.name)
    if known is None:
        raise ValueError(
            f"profile: no profile for this GPU ({properties.name}); name the nearest of "
            f"{', '.join(PROFILES)}"
        )
    link = machine.pcie_link()
    generation = link.max_generation or known.pcie_generation
    width = link.max_width or known.pcie_width
    host_bytes, basis = machine.host_memory()
    basis += "" if link.max_generation else "; PCIe link: the profile's (NVML unreadable)"
    return dataclasses.replace(
        known,
        name=f"{known.name} (this machine)",
        gpu=properties.name,
        memory_bytes=int(properties.total_memory),
        host_memory_bytes=host_bytes,
        host_memory_basis=basis,
        pcie_generation=generation,
        pcie_width=width,
    )
