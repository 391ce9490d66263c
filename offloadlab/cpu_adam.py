"""CPU AdamW over flat fp32 buffers, fused with the cast of the weights for the trip back.

The step is bandwidth-bound: each parameter reads its fp32 master weight, both fp32 moments
and its gradient, and writes the three fp32 values and a low-precision copy of the weight —
28 bytes per parameter with bf16 gradients and bf16 output. :func:`adamw_step` does that in
one pass with a small C kernel (``_cpu_adam.c``) compiled on first use with the system C
compiler and loaded through ctypes (the call releases the GIL, so it overlaps other
threads). Without a compiler it falls back to a correct pure-torch step; :func:`backend`
says which one runs and why.

Set ``OFFLOADLAB_NO_COMPILE=1`` to force the fallback; ``OFFLOADLAB_CACHE`` to choose where
the compiled kernel is kept (default ``~/.cache/offloadlab``).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["adamw_step", "grad_sum_of_squares", "backend", "bytes_per_param", "default_threads"]

_SOURCE = Path(__file__).with_name("_cpu_adam.c")
_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# (gradient dtype, output dtype) pairs the C kernel has a loop for; others use the torch path.
_COMPILED_PAIRS = {(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
                   (torch.float32, None), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                   (torch.bfloat16, None), (torch.float16, None)}
# No contraction of a*b+c into fused multiply-adds the source does not ask for: torch rounds each op.
_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]


def default_threads() -> int:
    """All cores but one: the remaining core drives the copies and the training loop."""
    return max(1, (os.cpu_count() or 2) - 1)


def bytes_per_param(grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16) -> int:
    """Bytes the step moves per parameter: 3 × (read + write) fp32 + the gradient + the output copy."""
    grad_bytes = torch.tensor([], dtype=grad_dtype).element_size()
    out_bytes = 0 if out_dtype is None else torch.tensor([], dtype=out_dtype).element_size()
    return 24 + grad_bytes + out_bytes


def _cache_dir() -> Path:
    return Path(os.environ.get("OFFLOADLAB_CACHE", Path.home() / ".cache" / "offloadlab"))


def _compile(target: Path, compiler: str, march_native: bool) -> None:
    flags = _FLAGS + (["-march=native"] if march_native else [])
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)  # atomic: concurrent first uses never see a half-written file


@lru_cache(maxsize=None)
def _library():
    """(ctypes library or None, a sentence saying which backend runs and why)."""
    if os.environ.get("OFFLOADLAB_NO_COMPILE"):
        return None, "torch fallback (OFFLOADLAB_NO_COMPILE is set)"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "torch fallback (no C compiler found)"
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + platform.machine().encode())
    errors = []
    for native in (True, False):
        name = f"cpu_adam-{digest.hexdigest()[:16]}-{'native' if native else 'generic'}.so"
        target = _cache_dir() / name
        try:
            if not target.exists():
                _compile(target, compiler, native)
            lib = ctypes.CDLL(str(target))
            break
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            errors.append(detail.strip().splitlines()[-1] if detail.strip() else type(error).__name__)
    else:
        return None, f"torch fallback (compiling the kernel failed: {errors[-1]})"
    lib.offloadlab_adamw.restype = None
    lib.offloadlab_adamw.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                             ctypes.c_int64] + [ctypes.c_float] * 8 + [ctypes.c_int]
    lib.offloadlab_sumsq.restype = ctypes.c_double
    lib.offloadlab_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    return lib, f"compiled C kernel ({'-march=native' if 'native' in name else 'generic'}, OpenMP) from {target}"


def backend() -> str:
    """Which implementation :func:`adamw_step` uses here, in one sentence."""
    return _library()[1]


def _check(name: str, t: torch.Tensor, dtypes, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous host (cpu) tensor")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}; got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements to match master; got {t.numel()}")


def adamw_step(master, exp_avg, exp_avg_sq, grad, out=None, *, step: int, lr: float, betas=(0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 1e-2, grad_scale: float = 1.0,
               threads: int | None = None) -> None:
    """One AdamW step in place on flat fp32 ``master``, ``exp_avg``, ``exp_avg_sq``.

    ``grad`` is fp32, bf16 or fp16 (as it arrived from the GPU) and is multiplied by
    ``grad_scale`` first (1 / loss scale, or a clipping factor); ``out``, if given, receives
    the updated weights in its own dtype (bf16, fp16 or fp32). ``step`` is the 1-based step
    count used for bias correction; ``threads`` the OpenMP threads (default: all cores but one).
    """
    n = master.numel()
    _check("master", master, (torch.float32,), None)
    _check("exp_avg", exp_avg, (torch.float32,), n)
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    _check("grad", grad, (torch.float32, torch.bfloat16, torch.float16), n)
    if out is not None:
        _check("out", out, (torch.float32, torch.bfloat16, torch.float16), n)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step: expected the 1-based step count; got {step!r}")
    beta1, beta2 = betas
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas: expected two numbers in [0, 1); got {betas!r}")
    if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and math.isfinite(grad_scale)):
        raise ValueError("lr: expected lr, eps and weight_decay ≥ 0 and a finite grad_scale")
    bc2_sqrt = math.sqrt(1 - beta2**step)
    neg_step_size = -(lr / (1 - beta1**step))
    lib = _library()[0]
    if lib is not None and (grad.dtype, None if out is None else out.dtype) in _COMPILED_PAIRS:
        lib.offloadlab_adamw(master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                             _KIND[grad.dtype], None if out is None else out.data_ptr(),
                             0 if out is None else _KIND[out.dtype], n, 1 - lr * weight_decay, 1 - beta1, beta2,
                             1 - beta2, eps, bc2_sqrt, neg_step_size, grad_scale, threads or default_threads())
        return
    g = grad.float()
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=neg_step_size)
    if out is not None:
        out.copy_(master)


def grad_sum_of_squares(grad: torch.Tensor, threads: int | None = None) -> float:
    """Σ g² of a host gradient buffer, in double precision (inf or nan if any element is)."""
    _check("grad", grad, (torch.float32, torch.bfloat16, torch.float16), None)
    lib = _library()[0]
    if lib is not None:
        return lib.offloadlab_sumsq(grad.data_ptr(), _KIND[grad.dtype], grad.numel(), threads or default_threads())
    return float(grad.double().square().sum())
