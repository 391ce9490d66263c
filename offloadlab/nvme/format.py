"""A tier file's format: a 4 KiB superblock, two slot headers, two data slots.

The superblock says what the file holds (dtype, elements, block size, whether blocks carry crc32s)
and is checked when the file is opened; each slot header records the step its slot holds and a
crc32 of every block, itself checksummed, so a torn or invalidated header never passes for a valid
one. See :mod:`offloadlab.nvme` for how a step moves between the two slots.
"""

from __future__ import annotations

from types import MappingProxyType
import struct
import zlib
from array import array

import torch

from ..units import check_integer, is_integer, plain_scalar
from .direct_io import PAGE, round_up

__all__ = ["FORMAT_VERSION", "ChecksumError", "FileLayout", "new_layout", "DTYPES"]

FORMAT_VERSION = 1
MAGIC = b"OFFLOADLAB-TIER\n"
SLOT_MAGIC = b"OFFLOADLAB-SLOT\n"
# magic, version, dtype, itemsize, numel, block bytes, blocks, header bytes, slot bytes, checksums
# (0 or 1)
SUPERBLOCK = struct.Struct("<16sI16sIQQQQQI")
# magic, slot, step, blocks; then one crc32 per block, then the header's crc32
SLOT_HEAD = struct.Struct("<16sIQQ")
DTYPES = MappingProxyType(
    {
        str(d).removeprefix("torch."): d
        for d in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
        )
    }
)
LARGEST_FILE = 2**63 - 1  # off_t


class ChecksumError(OSError):
    """Data read from a tier does not match the checksum its header recorded (EIO)."""


class FileLayout:
    """Where everything is in a tier file: a 4 KiB superblock, two slot headers, two data slots."""

    def __init__(self, dtype: torch.dtype, numel: int, block_bytes: int, checksums: bool = True):
        self.dtype, self.numel, self.block_bytes, self.checksums = (
            dtype,
            numel,
            block_bytes,
            checksums,
        )
        self.itemsize = torch.tensor([], dtype=dtype).element_size()
        self.block = block_bytes // self.itemsize  # elements per block
        self.blocks = -(-numel // self.block)
        self.header_bytes = round_up(SLOT_HEAD.size + 4 * self.blocks + 4, PAGE)
        self.slot_bytes = self.blocks * block_bytes
        self.total_bytes = PAGE + 2 * self.header_bytes + 2 * self.slot_bytes

    def header_offset(self, slot: int) -> int:
        return PAGE + slot * self.header_bytes

    def block_offset(self, slot: int, block: int) -> int:
        return PAGE + 2 * self.header_bytes + slot * self.slot_bytes + block * self.block_bytes

    def block_elements(self, block: int) -> tuple[int, int]:
        return block * self.block, min((block + 1) * self.block, self.numel)

    def superblock(self) -> bytes:
        body = SUPERBLOCK.pack(
            MAGIC,
            FORMAT_VERSION,
            str(self.dtype).removeprefix("torch.").encode(),
            self.itemsize,
            self.numel,
            self.block_bytes,
            self.blocks,
            self.header_bytes,
            self.slot_bytes,
            int(self.checksums),
        )
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def parse(cls, data: bytes, name: str) -> FileLayout:
        body, (crc,) = data[: SUPERBLOCK.size], struct.unpack_from("<I", data, SUPERBLOCK.size)
        (
            magic,
            version,
            dtype,
            itemsize,
            numel,
            block_bytes,
            blocks,
            header_bytes,
            slot_bytes,
            checksums,
        ) = SUPERBLOCK.unpack(body)
        if magic != MAGIC or zlib.crc32(body) != crc:
            raise ValueError(
                f"path: {name} is not an offloadlab tier file (or its first page is damaged)"
            )
        if version != FORMAT_VERSION:
            raise ValueError(
                f"path: {name} is tier format {version}; this offloadlab reads format "
                f"{FORMAT_VERSION}"
            )
        dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
        if dtype not in DTYPES:
            raise ValueError(
                f"path: {name} holds {dtype!r} elements, which this offloadlab cannot read"
            )
        layout = cls(DTYPES[dtype], numel, block_bytes, bool(checksums))
        if (layout.itemsize, layout.blocks, layout.header_bytes, layout.slot_bytes) != (
            itemsize,
            blocks,
            header_bytes,
            slot_bytes,
        ):
            raise ValueError(f"path: {name} has an inconsistent header")
        return layout

    def slot_header(self, slot: int, step: int, crcs: array) -> bytes:
        body = SLOT_HEAD.pack(SLOT_MAGIC, slot, step, self.blocks) + crcs.tobytes()
        return body + struct.pack("<I", zlib.crc32(body))

    def parse_slot_header(self, data: bytes, slot: int) -> tuple[int, array] | None:
        """(step, crcs) of a valid header for ``slot``, or None (never written, invalidated or
        torn)."""
        size = SLOT_HEAD.size + 4 * self.blocks
        magic, which, step, blocks = SLOT_HEAD.unpack_from(data)
        if magic != SLOT_MAGIC or which != slot or blocks != self.blocks:
            return None
        if zlib.crc32(data[:size]) != struct.unpack_from("<I", data, size)[0]:
            return None
        crcs = array("I")
        crcs.frombytes(data[SLOT_HEAD.size : size])
        if crcs.itemsize != 4:  # array('I') is 4 bytes on every platform torch supports
            raise RuntimeError("array('I') is not 32-bit here")
        return step, crcs


def new_layout(numel, dtype, block_bytes, init, checksums) -> FileLayout:
    """The layout of a new tier, every argument checked before any file is made."""
    numel, block_bytes = plain_scalar(numel), plain_scalar(block_bytes)  # (numpy's as Python's)
    check_integer(numel, "numel")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}; got {dtype!r}")
    if (
        not is_integer(block_bytes)
        or block_bytes <= 0
        or block_bytes % PAGE
        or block_bytes > 1 << 30
    ):
        raise ValueError(
            f"block_bytes: expected a multiple of 4096 up to 1 GiB; got {block_bytes!r}"
        )
    if not isinstance(checksums, bool):
        raise ValueError(f"checksums: expected True or False; got {checksums!r}")
    layout = FileLayout(dtype, numel, block_bytes, checksums)
    if layout.total_bytes > LARGEST_FILE:
        raise ValueError(
            f"numel: expected a tier that fits in a file; got {numel} elements "
            f"({layout.total_bytes} bytes with both slots)"
        )
    if init is not None and (
        not isinstance(init, torch.Tensor)
        or init.dtype != dtype
        or init.numel() != numel
        or init.device.type != "cpu"
    ):
        raise ValueError(
            f"init: expected a host tensor of {numel} elements of {dtype}; got {init!r}"
        )
    return layout
