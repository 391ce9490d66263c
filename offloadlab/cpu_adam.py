"""CPU AdamW over flat fp32 buffers, fused with the cast of the weights for the trip back.

The step is bandwidth-bound (28 bytes per parameter with bf16 gradients and output):
:func:`adamw_step` makes one pass with a C kernel (``csrc/cpu_adam.c``), called through ctypes
with the GIL released, so it overlaps the training loop's other threads. :func:`load` finds the
kernel built at install time (:mod:`offloadlab.kernel_build`; no torch needed to build it), or
compiles it into ``$OFFLOADLAB_CACHE`` (default ``~/.cache/offloadlab``), or falls back to a
pure-torch step with one warning saying why; call it where a pause is harmless, never first on
a worker thread mid-backward. The library holds one copy of the kernel per instruction set
(AVX-512, AVX2 + FMA + F16C, x86-64; NEON) and runs the best the CPU has;
``OFFLOADLAB_CPU_ADAM_VARIANT`` picks another and ``CC`` the compiler.

Numerics: each variant performs ``torch.optim.AdamW``'s operations in its order and rounding
(the FMA variants fuse lerp_'s and addcmul_'s multiply-add as torch's AVX2, AVX-512 and Arm
kernels do; the x86-64 baseline rounds twice, as torch's DEFAULT kernels do), so the moments are
bit-identical to AdamW's; the weights differ at most by a rounding of the update where torch's
square root (MKL's ``vsSqrt``, about one case in six) is not correctly rounded.
tests/test_cpu_adam.py holds each variant to it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

from . import cores, kernel_build
from .units import check_adamw_settings, check_integer, is_number, plain_scalar

__all__ = [
    "adamw_step",
    "grad_sum_of_squares",
    "floor_pass",
    "backend",
    "load",
    "Kernel",
    "Library",
    "bytes_per_param",
    "default_threads",
    "TORCH",
    "VARIANT_ENV",
]

TORCH = "torch"  # the name of the pure-torch step among the variants
VARIANT_ENV = "OFFLOADLAB_CPU_ADAM_VARIANT"
_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # enum in csrc/kernel.h
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of gradients and of the weights' copy
_STATUS = {
    1: "a gradient or copy dtype it has no loop for",
    2: "a variant it does not hold",
    3: "a variant whose instructions this CPU lacks",
    4: "not enough memory",
}


class _Coefficients(ctypes.Structure):
    """``struct adamw_coefficients`` of csrc/kernel.h: the step's scalars, rounded once to float."""

    _fields_ = [
        (name, ctypes.c_float)
        for name in (
            "decay",
            "lerp_weight",
            "beta2",
            "one_minus_b2",
            "eps",
            "bc2_sqrt",
            "neg_step_size",
            "grad_scale",
        )
    ]


@dataclasses.dataclass(frozen=True)
class Library:
    """The kernel library this process found or built, or (``handle`` None) why there is none."""

    handle: ctypes.CDLL | None = dataclasses.field(repr=False, compare=False)
    origin: str = ""  # where it came from, in words (no paths of this machine)
    variants: tuple[str, ...] = ()  # the copies of the kernel it holds, best first
    runnable: tuple[str, ...] = ()  # those this CPU can execute, best first
    problem: str = ""  # why there is none: every attempt, compiler output in full


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The step :func:`adamw_step` runs: a variant of the library's kernel, or ``"torch"``."""

    variant: str
    chosen_by: str  # _BEST, or what named the variant
    library: Library

    @property
    def compiled(self) -> bool:
        return self.variant != TORCH

    def supports(self, grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> bool:
        """Whether the compiled kernel has a loop for this pair (the C code answers)."""
        return self.compiled and bool(
            self.library.handle.offloadlab_adamw_supports(_KIND[grad_dtype], _KIND[out_dtype])
        )

    def describe(self) -> str:
        library = self.library
        if not self.compiled:
            return f"torch fallback ({library.problem or 'chosen by ' + self.chosen_by})"
        how = (
            f"the best of {', '.join(library.variants)} this CPU runs"
            if self.chosen_by == _BEST
            else f"chosen by {self.chosen_by}; this CPU runs {', '.join(library.runnable)}"
        )
        return f"compiled C kernel, {self.variant} variant ({how}), {library.origin}, OpenMP"


_BEST = "the best this CPU runs"
# where setup.py builds the library
_INSTALLED = Path(__file__).with_name(kernel_build.LIBRARY_NAME)
_lock = threading.Lock()
_opened: Library | None = None


def default_threads(gpu: bool = False, ranks: int = 1) -> int:
    """This process's share of the cores it may use (its affinity and cgroup CPU quota, see
    :mod:`offloadlab.cores`), shared with ``ranks - 1`` other processes, but one, which drives
    the copies and the training loop; with a ``gpu``, but two: backward's autograd thread
    launches kernels while the update runs, and a starved launcher leaves the GPU idle."""
    share = cores.usable_cores() // max(1, ranks)
    return max(1, share - 1 - (1 if gpu else 0))


def bytes_per_param(grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16) -> int:
    """Bytes the step moves per parameter: 3 × (read + write) fp32 + the gradient + the output
    copy."""
    grad_bytes = torch.tensor([], dtype=grad_dtype).element_size()
    out_bytes = 0 if out_dtype is None else torch.tensor([], dtype=out_dtype).element_size()
    return 24 + grad_bytes + out_bytes


def _cache_dir() -> tuple[Path, str]:
    """Where first-use builds are kept, and how to name that place without this machine's paths."""
    if os.environ.get("OFFLOADLAB_CACHE"):
        return Path(os.environ["OFFLOADLAB_CACHE"]), "$OFFLOADLAB_CACHE"
    return Path.home() / ".cache" / "offloadlab", "~/.cache/offloadlab"


def _try_open(path: Path, origin: str, problems: list[str]) -> Library | None:
    """The library at ``path`` if it loads and was built from this package's sources."""
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as error:
        problems.append(
            f"the library {origin} does not load: {str(error).replace(str(path), path.name)}"
        )
        return None
    handle.offloadlab_source_digest.restype = ctypes.c_char_p
    if handle.offloadlab_source_digest().decode() != kernel_build.source_digest():
        problems.append(f"the library {origin} is out of date (built from other sources)")
        return None
    handle.offloadlab_variant_name.restype = ctypes.c_char_p
    handle.offloadlab_variant_name.argtypes = [ctypes.c_int]
    handle.offloadlab_variant_runs_here.argtypes = [ctypes.c_int]
    handle.offloadlab_adamw_supports.argtypes = [ctypes.c_int, ctypes.c_int]
    handle.offloadlab_adamw.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.POINTER(_Coefficients),
        ctypes.c_int,
    ]
    handle.offloadlab_sumsq.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
    ]
    handle.offloadlab_floor.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    count = range(handle.offloadlab_variant_count())
    variants = tuple(handle.offloadlab_variant_name(v).decode() for v in count)
    runnable = tuple(variants[v] for v in count if handle.offloadlab_variant_runs_here(v))
    return Library(handle, origin, variants, runnable)


def _first_use_name(compiler: list[str]) -> str:
    """The cached library's file name: a digest of all it is built from. The machine is part of
    it, for home folders shared between x86-64 and Arm nodes whose compilers print the same."""
    key = "\0".join(
        [
            kernel_build.source_digest(),
            kernel_build.compiler_identity(compiler),
            " ".join(compiler),
            platform.machine(),
        ]
    )
    return f"cpu_adam-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _open() -> Library:
    problems: list[str] = []
    if _INSTALLED.exists():
        if library := _try_open(_INSTALLED, "built at install time", problems):
            return library
    else:
        problems.append("no library was built at install time")
    folder, shown = _cache_dir()
    try:
        compiler = kernel_build.compiler_command()
        path = folder / _first_use_name(compiler)
        if not path.exists():
            kernel_build.build(path, compiler)
    except (kernel_build.BuildError, OSError) as error:
        problems.append(f"compiling it at first use failed: {error}")
    else:
        because = f", because {'; '.join(problems)}" if problems else ""
        if library := _try_open(path, f"compiled at first use into {shown}", problems):
            return dataclasses.replace(library, origin=library.origin + because)
    return Library(None, problem="; ".join(problems))


def _library() -> Library:
    """The library, found or built on the first call (once per process, whichever thread asks)."""
    global _opened
    with _lock:
        if _opened is None:
            _opened = _open()
            if _opened.handle is None:
                warnings.warn(
                    f"offloadlab.cpu_adam: no compiled kernel, so the slower pure-torch AdamW step "
                    f"runs: {_opened.problem}",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return _opened


def load(variant: str | None = None) -> Kernel:
    """Find or build the kernel library now, and choose the step to run.

    ``variant`` names a variant this CPU runs, or ``"torch"`` for the pure-torch step; by
    default ``$OFFLOADLAB_CPU_ADAM_VARIANT``, else the best variant this CPU runs (the torch
    step when no library could be found or built). Raises ``ValueError`` for a variant that
    is not in the library or whose instructions this CPU lacks.
    """
    source = "variant"
    if variant is None and os.environ.get(VARIANT_ENV):
        variant, source = os.environ[VARIANT_ENV], VARIANT_ENV
    if variant == TORCH:
        return Kernel(TORCH, source, Library(None))
    library = _library()
    if variant is None:
        return Kernel(library.runnable[0] if library.handle else TORCH, _BEST, library)
    if library.handle is None:
        raise ValueError(
            f"{source}: expected {TORCH!r}, the only step without a compiled kernel; got "
            f"{variant!r} ({library.problem})"
        )
    if variant not in library.variants:
        raise ValueError(
            f"{source}: expected one of {', '.join(library.variants + (TORCH,))}; got {variant!r}"
        )
    if variant not in library.runnable:
        raise ValueError(
            f"{source}: expected a variant this CPU runs "
            f"({', '.join(library.runnable + (TORCH,))}); got {variant!r}, whose instructions it "
            "lacks"
        )
    return Kernel(variant, source, library)


def backend(grad_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> str:
    """Which step :func:`adamw_step` runs here, in one sentence, finding or building the kernel
    first.

    With ``grad_dtype`` (and ``out_dtype``, the copy's dtype; ``None``: no copy), for that pair.
    """
    if grad_dtype is not None:
        _check_dtype("grad_dtype", grad_dtype, _DTYPES)
    if out_dtype is not None:
        _check_dtype("out_dtype", out_dtype, _DTYPES)
    kernel = load()
    if grad_dtype is not None and kernel.compiled and not kernel.supports(grad_dtype, out_dtype):
        return (
            f"torch fallback (the compiled kernel has no loop for {grad_dtype} gradients and "
            f"{out_dtype} copies)"
        )
    return kernel.describe()


def _check_dtype(name: str, dtype, dtypes) -> None:
    if dtype not in dtypes:
        raise ValueError(
            f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}; got {dtype}"
        )


def _check(name: str, t: torch.Tensor, dtypes, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous host (cpu) tensor")
    _check_dtype(name, t.dtype, dtypes)
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements to match master; got {t.numel()}")


def _check_disjoint(**buffers: torch.Tensor | None) -> None:
    """The kernel reads and writes each buffer once per element: two of them sharing memory
    would make the result depend on the order of those reads and writes."""
    spans = [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in buffers.items()
        if t is not None and t.numel()
    ]
    for i, (name, start, end) in enumerate(spans):
        for other, other_start, other_end in spans[:i]:
            if start < other_end and other_start < end:
                raise ValueError(
                    f"{name}: expected memory of its own; got memory shared with {other}"
                )


def _check_threads(threads) -> int:
    if threads is None:
        return default_threads()
    return check_integer(threads, "threads", expected="a positive number of threads")


def _check_arrays(master, exp_avg, exp_avg_sq, grad, out) -> int:
    """The element count of a step's arrays, once each is checked (contiguous CPU tensors of one
    length: fp32 state, an fp32/bf16/fp16 gradient and ``out``) and none overlaps another."""
    _check("master", master, (torch.float32,), None)
    n = master.numel()
    _check("exp_avg", exp_avg, (torch.float32,), n)
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    _check("grad", grad, _DTYPES, n)
    if out is not None:
        _check("out", out, _DTYPES, n)
    _check_disjoint(master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, grad=grad, out=out)
    return n


def _raise_for(status: int, function: str) -> None:
    if status:
        raise RuntimeError(
            f"{function}: the compiled kernel refused the call: {_STATUS.get(status, status)}"
        )


def adamw_step(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out=None,
    *,
    step: int,
    lr: float,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: float = 1.0,
    threads: int | None = None,
    variant: str | None = None,
) -> None:
    """One AdamW step in place on flat fp32 ``master``, ``exp_avg``, ``exp_avg_sq``.

    ``grad`` is fp32, bf16 or fp16 (as it arrived from the GPU) and is multiplied by
    ``grad_scale`` first (1 / loss scale, or a clipping factor); ``out``, if given, receives
    the updated weights in its own dtype (bf16, fp16 or fp32). ``step`` is the 1-based step
    count used for bias correction; ``threads`` the OpenMP threads (default: all cores but
    one); ``variant`` the step to run (see :func:`load`; default: the best this CPU runs).
    """
    n = _check_arrays(master, exp_avg, exp_avg_sq, grad, out)
    check_integer(step, "step", expected="the 1-based step count")
    check_adamw_settings(lr, betas, eps, weight_decay)
    beta1, beta2 = map(float, betas)
    if not is_number(plain_scalar(grad_scale)):
        raise ValueError(f"grad_scale: expected a finite number; got {grad_scale!r}")
    threads = _check_threads(threads)
    # The scalars as torch.optim.AdamW computes them, in double precision (the kernel rounds each to
    # float once).
    bc2_sqrt = (1 - beta2**step) ** 0.5
    neg_step_size = -(lr / (1 - beta1**step))
    kernel = load(variant)
    out_dtype = None if out is None else out.dtype
    if kernel.supports(grad.dtype, out_dtype):
        coefficients = _Coefficients(
            1 - lr * weight_decay,
            1 - beta1,
            beta2,
            1 - beta2,
            eps,
            bc2_sqrt,
            neg_step_size,
            grad_scale,
        )
        index = kernel.library.variants.index(kernel.variant)
        _raise_for(
            kernel.library.handle.offloadlab_adamw(
                index,
                master.data_ptr(),
                exp_avg.data_ptr(),
                exp_avg_sq.data_ptr(),
                grad.data_ptr(),
                _KIND[grad.dtype],
                None if out is None else out.data_ptr(),
                _KIND[out_dtype],
                n,
                ctypes.byref(coefficients),
                threads,
            ),
            "adamw_step",
        )
        return
    # a new tensor: the caller's stays as it is
    g = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=neg_step_size)
    if out is not None:
        out.copy_(master)


def floor_pass(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out=None,
    *,
    threads: int | None = None,
    variant: str | None = None,
) -> None:
    """One pass of the step's memory traffic without its arithmetic: the floor of ``bench adam``.

    The compiled kernel's loop with AdamW's operations replaced by one add per array: it reads
    and writes every element of ``master``, ``exp_avg`` and ``exp_avg_sq`` in place, reads
    ``grad`` and writes ``out`` as :func:`adamw_step` does, in the same tiles, with the same
    ``threads`` and the same ``variant`` (the three arrays end up holding sums, not a state).
    ValueError without a compiled kernel: a floor needs the kernel's own build.
    """
    n = _check_arrays(master, exp_avg, exp_avg_sq, grad, out)
    threads = _check_threads(threads)
    kernel = load(variant)
    if not kernel.compiled:
        raise ValueError(
            f"variant: the floor is the compiled kernel's loop; got the {kernel.describe()}"
        )
    index = kernel.library.variants.index(kernel.variant)
    _raise_for(
        kernel.library.handle.offloadlab_floor(
            index,
            master.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            grad.data_ptr(),
            _KIND[grad.dtype],
            None if out is None else out.data_ptr(),
            _KIND[None if out is None else out.dtype],
            n,
            threads,
        ),
        "floor_pass",
    )


def grad_sum_of_squares(
    grad: torch.Tensor, threads: int | None = None, *, variant: str | None = None
) -> float:
    """Σ g² of a host gradient buffer, in double precision (inf or nan if any element is).

    The compiled kernel adds in an order fixed by the buffer's length alone: the same result
    for any ``threads`` and in every variant.
    """
    _check("grad", grad, _DTYPES, None)
    threads = _check_threads(threads)
    kernel = load(variant)
    if kernel.compiled:
        total = ctypes.c_double()
        index = kernel.library.variants.index(kernel.variant)
        _raise_for(
            kernel.library.handle.offloadlab_sumsq(
                index,
                grad.data_ptr(),
                _KIND[grad.dtype],
                grad.numel(),
                threads,
                ctypes.byref(total),
            ),
            "grad_sum_of_squares",
        )
        return total.value
    return float(grad.double().square().sum())
