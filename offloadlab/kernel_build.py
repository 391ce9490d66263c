"""How the CPU Adam kernel library is built: one recipe for install time and for first use.

The library holds one copy of ``csrc/cpu_adam.c`` per instruction-set variant of this
architecture (on x86-64: AVX-512, AVX2 + FMA + F16C, and plain x86-64), each compiled with its
own flags, and ``csrc/dispatch.c``, compiled with none, which checks at load time which copies
the running CPU can execute. The library therefore runs on any CPU of the architecture it was
built for, wherever it was built: nothing is compiled for "this machine" (``-march=native``),
so a library built on one node of a cluster cannot crash another with an illegal instruction.

Separate objects rather than the ``target_clones`` attribute: the kernel's loops live in the
functions OpenMP outlines, and Clang (14, checked) does not clone those, so every copy would run
the baseline loop; separate objects build the same way with GCC 11, later GCCs and Clang, and
need no ifunc support from the C library.

``setup.py`` builds the library into the package when it is installed; :mod:`offloadlab.cpu_adam`
builds it into a cache at first use when no installed library matches the sources. This module
imports only the standard library: ``setup.py`` loads it by path, before torch exists.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Variant",
    "BuildError",
    "variants_for",
    "source_digest",
    "compiler_command",
    "compiler_identity",
    "build",
    "LIBRARY_NAME",
]

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("kernel.h", "cpu_adam.c", "dispatch.c")
LIBRARY_NAME = "_cpu_adam.so"  # loaded with ctypes, not imported: no Python ABI in the name
# -O3 vectorises the loops; -fno-trapping-math lets it compute both sides of a select (the
# branch-free conversions), as torch's own build does; it changes no result, only whether
# floating-point exception flags may be raised. No -ffast-math and no implicit contraction of
# a*b+c: every operation rounds as torch's kernels round it (the source asks for the fused
# multiply-adds it needs).
COMPILE_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-fvisibility=hidden",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
)
LINK_FLAGS = ("-shared", "-fopenmp")
LIBRARIES = ("-lm",)
# A compiler that has not finished in this long is stuck (a full build takes seconds).
TIMEOUT_S = 300


@dataclass(frozen=True)
class Variant:
    """One copy of the kernel: its name and the instruction-set flags it is compiled with."""

    name: str
    flags: tuple[str, ...] = ()


# Best first. For each name, csrc/dispatch.c checks that the CPU has every instruction set the
# flags enable, and csrc/cpu_adam.c that the flags enable what the code uses.
_VARIANTS = {
    "x86_64": (
        Variant(
            "avx512",
            ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
        ),
        Variant("avx2", ("-mavx2", "-mfma", "-mf16c")),
        Variant("baseline"),
    ),
    # NEON and FMA are part of every AArch64 CPU. No SVE copy: the step is bandwidth-bound (on
    # x86-64 the AVX2 copy runs within about 10 % of the AVX-512 one), and without an Arm machine
    # to measure on, a second Arm copy would be code no one has seen win.
    "aarch64": (Variant("neon"),),
}
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


class BuildError(RuntimeError):
    """A step of the build failed; the message holds the command and the compiler's whole output."""


def variants_for(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built on ``machine`` (default: this one), best first."""
    machine = (machine or platform.machine()).lower()
    return _VARIANTS.get(_MACHINE_ALIASES.get(machine, machine), (Variant("portable"),))


def source_digest(variants: tuple[Variant, ...] | None = None) -> str:
    """A digest of what the library is built from: the sources and the recipe (flags, variants).

    Compiled into the library, so that an installed library built from other sources (an
    editable install whose C file has since changed) is recognised and not used.
    """
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    digest.update(repr((COMPILE_FLAGS, LINK_FLAGS, LIBRARIES, variants or variants_for())).encode())
    return digest.hexdigest()[:16]


def compiler_command(environ=None) -> list[str]:
    """The C compiler as a command line: ``$CC`` (split as a shell would, so ``CC="gcc -O0"``
    works), else the compiler Python was built with when it is installed, else ``cc``."""
    environ = os.environ if environ is None else environ
    if environ.get("CC", "").strip():
        return shlex.split(environ["CC"])
    python_cc = shlex.split(sysconfig.get_config_var("CC") or "")
    if python_cc and shutil.which(python_cc[0]):
        return python_cc
    return ["cc"]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except FileNotFoundError:
        raise BuildError(f"no C compiler: {command[0]!r} was not found (set CC to one)") from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"{shlex.join(command)}\ndid not finish in {TIMEOUT_S} s") from None
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise BuildError(
            f"{shlex.join(command)}\nfailed with exit status {result.returncode}:\n{output}"
        )
    return result


def compiler_identity(compiler: list[str]) -> str:
    """What ``compiler --version`` says: part of the key of a library compiled at first use."""
    return _run([*compiler, "--version"], Path.cwd()).stdout.strip()


def build(target: Path, compiler: list[str] | None = None, machine: str | None = None) -> list[str]:
    """Compile every variant and the dispatcher, and link them into the library ``target``.

    ``target`` is replaced atomically (built beside it, then renamed), so processes that
    build the same library at once never load a half-written file. The compiler runs in a
    scratch folder holding copies of the sources, so its messages name files, not the
    folders of this machine. Returns the commands it ran; raises :class:`BuildError`.
    """
    compiler = compiler or compiler_command()
    variants = variants_for(machine)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    commands = []
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
        scratch = Path(scratch)
        for name in SOURCES:
            shutil.copyfile(SOURCE_DIR / name, scratch / name)
        objects = []
        for variant in variants:
            objects.append(f"cpu_adam_{variant.name}.o")
            commands.append(
                [
                    *compiler,
                    *COMPILE_FLAGS,
                    *variant.flags,
                    f"-DOFFLOADLAB_VARIANT={variant.name}",
                    f"-DOFFLOADLAB_VARIANT_{variant.name.upper()}",
                    "-c",
                    "cpu_adam.c",
                    "-o",
                    objects[-1],
                ]
            )
        table = "".join(f"X({variant.name})" for variant in variants)
        objects.append("dispatch.o")
        commands.append(
            [
                *compiler,
                *COMPILE_FLAGS,
                f"-DOFFLOADLAB_VARIANTS={table}",
                f'-DOFFLOADLAB_SOURCE_DIGEST="{source_digest(variants)}"',
                "-c",
                "dispatch.c",
                "-o",
                objects[-1],
            ]
        )
        commands.append([*compiler, *LINK_FLAGS, *objects, "-o", LIBRARY_NAME, *LIBRARIES])
        for command in commands:
            _run(command, scratch)
        os.replace(scratch / LIBRARY_NAME, target)
    return [shlex.join(command) for command in commands]
