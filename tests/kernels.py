"""The kernels the tests start reach them over Unix sockets, not TCP ports.

jupyter_client picks five free ports, closes them and hands their numbers to the kernel. Until the
kernel binds them (seconds on a loaded machine) any other process may take one: the kernel then
dies at start-up ("Kernel died before replying to kernel_info") or never answers. A socket file
named for one kernel alone cannot be taken.
"""

from __future__ import annotations

import os
import tempfile
import uuid

from jupyter_client.manager import KernelManager
from traitlets import default


class UnixSocketKernelManager(KernelManager):
    """A KernelManager whose kernel listens on socket files in the temporary folder."""

    @default("transport")
    def _unix_sockets(self) -> str:
        return "ipc"

    @default("ip")
    def _socket_files(self) -> str:
        # absolute: the kernel starts in the notebook's folder, the client stays where it is
        return os.path.join(tempfile.gettempdir(), f"kernel-{uuid.uuid4().hex}")


def start_kernel(kernel_name: str = "python3", startup_timeout: float = 60, **kwargs):
    """jupyter_client's ``start_new_kernel`` over Unix sockets: (manager, client), ready."""
    manager = UnixSocketKernelManager(kernel_name=kernel_name)
    manager.start_kernel(**kwargs)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=startup_timeout)
    except RuntimeError:
        client.stop_channels()
        manager.shutdown_kernel()
        raise
    return manager, client
