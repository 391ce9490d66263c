"""Builds the CPU Adam kernel when offloadlab is installed (everything else is in pyproject.toml).

A plain setuptools Extension, not torch.utils.cpp_extension: the kernel is C called through
ctypes and needs no torch headers, so the build needs no torch in pip's isolated build
environment. The build is optional: without a C compiler the installation succeeds, and
offloadlab.cpu_adam compiles the kernel at first use or falls back to torch, with a warning.
"""

import importlib.util
import sys
from functools import cache
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

HERE = Path(__file__).resolve().parent


@cache
def _kernel_build():
    """offloadlab/kernel_build.py, loaded by path: importing the package would need torch."""
    spec = importlib.util.spec_from_file_location("offloadlab_kernel_build", HERE / "offloadlab" / "kernel_build.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


class BuildKernel(build_ext):
    """Builds the kernel library with offloadlab.kernel_build's recipe (several objects, each
    with its own instruction-set flags, which one Extension's flags cannot express)."""

    def get_ext_filename(self, fullname):
        # A library for ctypes, not a Python module: no Python ABI tag in its name.
        return str(Path(*fullname.split(".")[:-1], _kernel_build().LIBRARY_NAME))

    def build_extension(self, ext):
        kernel_build = _kernel_build()
        try:
            for command in kernel_build.build(Path(self.get_ext_fullpath(ext.name))):
                print(command)
        except kernel_build.BuildError as error:
            raise CompileError(str(error)) from error  # optional=True: a warning, and the install goes on


setup(
    ext_modules=[Extension("offloadlab._cpu_adam", sources=[f"offloadlab/csrc/{name}" for name in
                                                            ("cpu_adam.c", "dispatch.c")], optional=True)],
    cmdclass={"build_ext": BuildKernel},
)
