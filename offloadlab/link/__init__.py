"""The transfer engine: asynchronous copies between host memory and the device, with events.

One small interface, two implementations:

- :class:`CudaLink` drives a real GPU: one copy stream per direction (a GPU has a copy engine
  for each, and PCIe is full duplex), exact-size pinned host buffers, CUDA events for ordering
  and timing.
- :class:`EmulatedLink` stands in on a machine without a GPU. It emulates the whole contract,
  not only the timing: a paced copy engine per direction that really moves the bytes, and an
  asynchronous compute stream (:meth:`Link.launch`), so a copy ordered after a point of the
  compute stream really waits for it, and a copy that is *not* ordered after the compute that
  still reads its buffer really overwrites it — as on a GPU.

Both hand out :class:`Transfer` objects (wait for one, ask whether it is done, read when it
ran) and :class:`Marker` objects (a point in the compute stream, for ordering and timelines).

The ordering contract, identical on both links:

- ``to_device``/``to_host(dst, src, after=...)`` starts a copy on its direction's engine once the
  compute stream has reached ``after``: ``"compute"`` (everything issued to it so far), a
  :class:`Marker`, or ``None`` (nothing). Copies in one direction run in the order issued; the two
  directions run at the same time.
- :meth:`Transfer.wait` orders the compute that follows after the copy.
- Pinned host memory from :meth:`Link.host_buffer` belongs to whoever asked for it: it is
  unpinned and freed when the last tensor using it is dropped. :attr:`Link.pinned_bytes` says
  how much is alive. The link keeps the tensors of a copy alive until the copy has finished.
- Fresh buffers from :meth:`Link.host_buffer` and :meth:`Link.device_buffer` hold poison
  (:data:`POISON_BYTE` in every byte: NaN in every floating-point format, -1 or the maximum in
  integers), on both links: on a GPU an uninitialised buffer holds whatever was there before, so
  a read before the first write must show on a CPU too, not pass because memory came zeroed.

Times are seconds on the link's own clock, which starts when the link is made. Sizes are
bytes, bandwidths bytes per second. Use :func:`open_link` to get the right link for this machine.

The package's modules: :mod:`~offloadlab.link.base` (the contract: :class:`Link`,
:class:`Transfer`, :class:`Marker`), :mod:`~offloadlab.link.emulated` and
:mod:`~offloadlab.link.cuda`; every name is importable from ``offloadlab.link`` itself.
"""

from __future__ import annotations

import torch

from .base import POISON_BYTE, Link, Marker, Recording, Transfer, pinned_allocation_bytes, poison

# (two internals, still reachable here)
from .cuda import CudaLink, _EventClock, _fallback_warning  # noqa: F401
from .emulated import DEFAULT_EMULATED_BANDWIDTH, DEFAULT_EMULATED_LATENCY, EmulatedLink

__all__ = [
    "Link",
    "CudaLink",
    "EmulatedLink",
    "Transfer",
    "Marker",
    "Recording",
    "open_link",
    "check_link",
    "pinned_allocation_bytes",
    "DEFAULT_EMULATED_BANDWIDTH",
    "DEFAULT_EMULATED_LATENCY",
    "POISON_BYTE",
    "poison",
]


_LINK_CALLS = ("host_buffer", "device_buffer", "to_device", "to_host", "mark")


def check_link(link, optional: bool = False) -> None:
    """ValueError unless ``link`` is a :class:`Link`, or an object that answers its calls and
    says whether it is emulated (a wrapper that counts them, say), or with ``optional`` None: a
    string such as "emulated" would fail later with an AttributeError from inside, and a mock,
    which answers everything, with a wrong result."""
    says_what_it_is = type(getattr(link, "emulated", None)) is bool  # (a mock's is a mock)
    answers = not isinstance(link, type) and all(hasattr(link, call) for call in _LINK_CALLS)
    is_a_link = (isinstance(link, Link) or answers) and says_what_it_is
    if not (is_a_link or (optional and link is None)):
        none = " or None" if optional else ""
        raise ValueError(
            f"link: expected an offloadlab.link.Link (open_link(), EmulatedLink(...), "
            f"CudaLink()){none}; got {link!r}"
        )


def open_link(emulated: bool | None = None, **emulation) -> Link:
    """A :class:`CudaLink` when a CUDA GPU is present, else an :class:`EmulatedLink`.

    ``emulated=True`` forces the emulation (keyword arguments go to :class:`EmulatedLink`).
    """
    if emulated is None:
        emulated = not torch.cuda.is_available()
    elif not isinstance(emulated, bool):  # ("no" is true to Python)
        raise ValueError(f"emulated: expected True, False or None; got {emulated!r}")
    if emulated:
        return EmulatedLink(**emulation)
    if emulation:
        raise ValueError(
            f"{next(iter(emulation))}: only the emulated link takes emulation settings"
        )
    return CudaLink()
