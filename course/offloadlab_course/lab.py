"""JupyterLab as `make lab` runs it: the contents manager that serves the book's notebooks.

Jupytext text notebooks carry no ``language_info``: it holds the Python version, which differs
from one machine to the next, and Jupytext's metadata filter leaves it out of the file. As soon as
a notebook's kernel starts, JupyterLab writes the kernel's ``language_info`` into the notebook and
so marks it edited: every chapter showed as unsaved the moment it opened, and closing it unread
asked "Save your work?". ``BookContentsManager`` is Jupytext's contents manager that hands Lab a
text notebook with the ``language_info`` this environment's Python kernel reports, so the kernel's
write changes nothing. On saving, the filter drops it again: the file stays byte for byte as it was.

etc/jupyter_server_config.json names it as the server's contents manager.
"""

from __future__ import annotations

from jupytext.async_contentsmanager import AsyncTextFileContentsManager

__all__ = ["BookContentsManager", "python_language_info"]


def python_language_info() -> dict:
    """The ``language_info`` ipykernel reports for this interpreter, which runs the book's kernel
    (jupyter_client starts a Python kernelspec with the server's own interpreter)."""
    from ipykernel.ipkernel import IPythonKernel

    return dict(IPythonKernel.language_info)


class BookContentsManager(AsyncTextFileContentsManager):
    """Jupytext's contents manager; a Python notebook without ``language_info`` gets this
    kernel's."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and model.get("content") is not None:
            metadata = model["content"]["metadata"]
            if (
                "language_info" not in metadata
                and metadata.get("kernelspec", {}).get("language") == "python"
            ):
                metadata["language_info"] = python_language_info()
        return model
