"""The kernel library on CPUs this machine is not, emulated by qemu (user mode) and driven by
tests/kernel_driver.c, against this machine's variants bit for bit:

- the AArch64 build (its NEON variant), cross-compiled with the package's recipe: AArch64 has
  FMA, so its copy must round as the AVX2 and AVX-512 copies do. The one check of the Arm path
  (``__fp16`` conversions, the dispatcher's Arm branch) on an x86-64 machine;
- the x86-64 build on a Haswell (AVX2, FMA, F16C, no AVX-512) and a Nehalem (no AVX): the
  dispatcher offers only what each CPU has, the copies it offers compute what they compute
  here, and the library refuses to enter a copy the CPU lacks instead of dying on an illegal
  instruction.
"""

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

CROSS_COMPILER, SYSROOT = "aarch64-linux-gnu-gcc", "/usr/aarch64-linux-gnu"
QEMU_ARM, QEMU_X86 = "qemu-aarch64", "qemu-x86_64"
DRIVER = ROOT / "tests" / "kernel_driver.c"
KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
REFUSED = 3  # kernel_driver's exit status when the library refuses the call

pytestmark = pytest.mark.skipif(not X86, reason="emulates other CPUs from an x86-64 machine")


def require(*tools: str) -> None:
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        message = (
            f"{', '.join(missing)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        )
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must test the library on emulated CPUs")
        pytest.skip(message)


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    """A runner of the AArch64 library, and this machine's fused-rounding variant to compare
    with."""
    require(CROSS_COMPILER, QEMU_ARM)
    fused = [variant for variant in cpu_adam.load().library.runnable if variant not in UNFUSED]
    if not fused:
        pytest.skip("this CPU runs no fused-rounding variant to compare with")
    folder = tmp_path_factory.mktemp("arm")
    kernel_build.build(folder / "lib.so", [CROSS_COMPILER], machine="aarch64")
    subprocess.run(
        [CROSS_COMPILER, "-O2", str(DRIVER), "-o", str(folder / "driver"), "-ldl"], check=True
    )
    return Emulated([QEMU_ARM, "-L", SYSROOT], folder), fused[0]


@pytest.fixture(scope="module")
def x86(tmp_path_factory):
    """A runner of this machine's library on an emulated CPU model, by name."""
    require(QEMU_X86)
    folder = tmp_path_factory.mktemp("x86")
    kernel_build.build(folder / "lib.so")
    subprocess.run(
        [
            *kernel_build.compiler_command(),
            "-O2",
            str(DRIVER),
            "-o",
            str(folder / "driver"),
            "-ldl",
        ],
        check=True,
    )
    return lambda model: Emulated([QEMU_X86, "-cpu", model], folder)


class Emulated:
    """kernel_driver and a library built for it, run under qemu."""

    def __init__(self, qemu: list[str], folder):
        self.command, self.folder = [*qemu, str(folder / "driver"), str(folder / "lib.so")], folder

    def variants(self) -> dict[str, bool]:
        result = subprocess.run(self.command, capture_output=True, text=True, check=True)
        return {
            name: runs == "1"
            for name, runs in (line.split() for line in result.stdout.splitlines())
        }

    def run(self, variant, start, grads, out_dtype, hyper):
        """(weights, exp_avg, exp_avg_sq, copy) after the steps, or the driver's exit status."""
        n = start.numel()
        with open(self.folder / "in.bin", "wb") as f:
            f.write(
                np.array(
                    [n, len(grads), KIND[grads[0].dtype], KIND[out_dtype]], dtype=np.int64
                ).tobytes()
            )
            f.write(raw(start) + raw(torch.zeros(n)) + raw(torch.zeros(n)))
            for step, grad in enumerate(grads, 1):
                f.write(coefficients(step, **hyper) + raw(grad))
        number = list(self.variants()).index(variant)
        result = subprocess.run(
            [*self.command, str(number), str(self.folder / "in.bin"), str(self.folder / "out.bin")],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            return result.returncode
        data = bytearray((self.folder / "out.bin").read_bytes())
        p, m, v = (
            torch.frombuffer(data[i * 4 * n : (i + 1) * 4 * n], dtype=torch.float32)
            for i in range(3)
        )
        return (
            p,
            m,
            v,
            None if out_dtype is None else torch.frombuffer(data[12 * n :], dtype=out_dtype),
        )


def coefficients(step, *, lr, weight_decay, betas, eps, grad_scale) -> bytes:
    """struct adamw_coefficients, computed as cpu_adam.adamw_step computes it."""
    beta1, beta2 = betas
    return np.array(
        [
            1 - lr * weight_decay,
            1 - beta1,
            beta2,
            1 - beta2,
            eps,
            (1 - beta2**step) ** 0.5,
            -(lr / (1 - beta1**step)),
            grad_scale,
        ],
        dtype=np.float32,
    ).tobytes()


def raw(t: torch.Tensor) -> bytes:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


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
            theirs = arm[0].run("neon", start, grads, out_dtype, hyper)
            ours = run_here(arm[1], start, grads, out_dtype, hyper)
            for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq", "copy"), theirs, ours):
                if b is not None:
                    assert_same_bits(
                        a, b, f"neon against {arm[1]}, {dtype} gradients, {out_dtype} copy: {name}"
                    )


def test_arm_conversions_match_bit_for_bit(arm):
    """Every 16-bit gradient value (NaN payloads aside: Arm and x86 propagate them by other
    rules) and the copy of every float where rounding is decided, NaNs included."""
    for dtype in (torch.bfloat16, torch.float16):
        grad = adamw_reference.every_16_bit_value(dtype)
        hyper = dict(lr=0.0, weight_decay=0.0, betas=(0.0, 0.0), eps=1e-8, grad_scale=1.0)
        zeros = torch.zeros(grad.numel())
        theirs, ours = (
            arm[0].run("neon", zeros, [grad], None, hyper),
            run_here(arm[1], zeros, [grad], None, hyper),
        )
        for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq"), theirs, ours):
            assert_same_apart_from_nan_payloads(a, b, f"{dtype} gradients: {name}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        master = adamw_reference.floats_where_rounding_is_decided(
            torch.bfloat16 if dtype == torch.float32 else dtype
        )
        hyper = dict(lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, grad_scale=1.0)
        zeros = torch.zeros(master.numel())
        theirs = arm[0].run("neon", master, [zeros], dtype, hyper)[3]
        assert_same_bits(
            theirs, run_here(arm[1], master, [zeros], dtype, hyper)[3], f"float32 → {dtype} copy"
        )


@pytest.mark.parametrize(
    "model, offered", [("Haswell", ["avx2", "baseline"]), ("Nehalem", ["baseline"])]
)
def test_x86_cpus_without_some_instruction_sets(x86, model, offered):
    emulated = x86(model)
    variants = emulated.variants()
    assert [name for name, runs in variants.items() if runs] == offered, variants
    here = cpu_adam.load().library.runnable
    start, grads = adamw_reference.inputs(torch.bfloat16)
    hyper = adamw_reference.CASES["usual"]
    for variant in variants:
        result = emulated.run(variant, start, grads[:2], torch.bfloat16, hyper)
        if variant not in offered:
            assert result == REFUSED, f"{model}: the {variant} copy was entered: {result}"
        elif variant in here:
            for name, a, b in zip(
                ("weights", "exp_avg", "exp_avg_sq", "copy"),
                result,
                run_here(variant, start, grads[:2], torch.bfloat16, hyper),
            ):
                assert_same_bits(a, b, f"{variant} on an emulated {model} against this CPU: {name}")
