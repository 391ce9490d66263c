"""The AArch64 build of the kernel (its NEON variant), cross-compiled with the package's recipe and
run under qemu-aarch64, against this machine's fused-rounding variant bit for bit: AArch64 has
FMA, so its copy rounds as torch's Arm kernels and as the AVX2 and AVX-512 copies do. It is
the check of the Arm code path (``__fp16`` conversions, the dispatcher) on an x86-64 machine."""

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from offloadlab import cpu_adam, kernel_build
from tests import adamw_reference
from tests.conftest import ROOT
from tests.test_cpu_adam import UNFUSED, X86, assert_same_bits

CROSS_COMPILER, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}

pytestmark = pytest.mark.skipif(not X86, reason="on an Arm machine, test_cpu_adam runs the NEON variant itself")


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    """(the library, the driver) built for AArch64, and this machine's variant to compare with."""
    missing = [tool for tool in (CROSS_COMPILER, QEMU) if not shutil.which(tool)]
    if missing:
        message = f"{', '.join(missing)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must test the Arm build")
        pytest.skip(message)
    kernel = cpu_adam.load()
    fused = [variant for variant in kernel.library.runnable if variant not in UNFUSED]
    if not fused:
        pytest.skip("this CPU runs no fused-rounding variant to compare with")
    folder = tmp_path_factory.mktemp("arm")
    kernel_build.build(folder / "lib.so", [CROSS_COMPILER], machine="aarch64")
    subprocess.run([CROSS_COMPILER, "-O2", str(ROOT / "tests" / "arm_driver.c"), "-o", str(folder / "driver"), "-ldl"],
                   check=True)
    return folder, fused[0]


def coefficients(step, *, lr, weight_decay, betas, eps, grad_scale) -> bytes:
    """struct adamw_coefficients, computed as cpu_adam.adamw_step computes it."""
    beta1, beta2 = betas
    return np.array([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, (1 - beta2**step) ** 0.5,
                     -(lr / (1 - beta1**step)), grad_scale], dtype=np.float32).tobytes()


def raw(t: torch.Tensor) -> bytes:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


def run_arm(arm, start, grads, out_dtype, hyper):
    folder, _ = arm
    n = start.numel()
    with open(folder / "in.bin", "wb") as f:
        f.write(np.array([n, len(grads), KIND[grads[0].dtype], KIND[out_dtype]], dtype=np.int64).tobytes())
        f.write(raw(start) + raw(torch.zeros(n)) + raw(torch.zeros(n)))
        for step, grad in enumerate(grads, 1):
            f.write(coefficients(step, **hyper) + raw(grad))
    subprocess.run([QEMU, "-L", SYSROOT, str(folder / "driver"), str(folder / "lib.so"), str(folder / "in.bin"),
                    str(folder / "out.bin")], check=True)
    data = bytearray((folder / "out.bin").read_bytes())
    p, m, v = (torch.frombuffer(data[i * 4 * n:(i + 1) * 4 * n], dtype=torch.float32) for i in range(3))
    return p, m, v, None if out_dtype is None else torch.frombuffer(data[12 * n:], dtype=out_dtype)


def run_here(variant, start, grads, out_dtype, hyper):
    p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for step, grad in enumerate(grads, 1):
        cpu_adam.adamw_step(p, m, v, grad, out, step=step, threads=2, variant=variant, **hyper)
    return p, m, v, out


def assert_same_apart_from_nan_payloads(actual, expected, what):
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"{what}: NaNs in other places"
    assert_same_bits(actual[~nan], expected[~nan], what)


@pytest.mark.parametrize("case", adamw_reference.CASES)
def test_arm_steps_match_bit_for_bit(arm, case):
    hyper = adamw_reference.CASES[case]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        start, grads = adamw_reference.inputs(dtype)
        for out_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
            theirs = run_arm(arm, start, grads, out_dtype, hyper)
            ours = run_here(arm[1], start, grads, out_dtype, hyper)
            for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq", "copy"), theirs, ours):
                if b is not None:
                    assert_same_bits(a, b, f"neon against {arm[1]}, {dtype} gradients, {out_dtype} copy: {name}")


def test_arm_conversions_match_bit_for_bit(arm):
    """Every 16-bit gradient value (NaN payloads aside: Arm and x86 propagate them by other
    rules) and the copy of every float where rounding is decided, NaNs included."""
    for dtype in (torch.bfloat16, torch.float16):
        grad = adamw_reference.every_16_bit_value(dtype)
        hyper = dict(lr=0.0, weight_decay=0.0, betas=(0.0, 0.0), eps=1e-8, grad_scale=1.0)
        zeros = torch.zeros(grad.numel())
        theirs, ours = run_arm(arm, zeros, [grad], None, hyper), run_here(arm[1], zeros, [grad], None, hyper)
        for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq"), theirs, ours):
            assert_same_apart_from_nan_payloads(a, b, f"{dtype} gradients: {name}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        master = adamw_reference.floats_where_rounding_is_decided(torch.bfloat16 if dtype == torch.float32 else dtype)
        hyper = dict(lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, grad_scale=1.0)
        zeros = torch.zeros(master.numel())
        theirs = run_arm(arm, master, [zeros], dtype, hyper)[3]
        assert_same_bits(theirs, run_here(arm[1], master, [zeros], dtype, hyper)[3], f"float32 → {dtype} copy")
