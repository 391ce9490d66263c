"""The CPU AdamW kernel: every variant, built by every compiler, against torch.optim.AdamW bit for
bit; its conversions over every 16-bit value and the floats where rounding is decided; how the
library is found, built and chosen; and the pure-torch fallback."""

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from offloadlab import cpu_adam, kernel_build
from tests import adamw_reference
from tests.conftest import ROOT

X86 = kernel_build.variants_for()[0].name == "avx512"
# Variants whose lerp_ and addcmul_ round the multiply-add twice, as torch's DEFAULT kernels for
# x86-64 without FMA do; every other variant fuses it, as torch's AVX2, AVX512 and Arm kernels do.
UNFUSED = {"baseline"}
# "package": the library the package itself loaded
COMPILERS = ("package", "gcc-11", "gcc", "clang")
VARIANTS = ("avx512", "avx2", "baseline", "neon", "portable")
LOW = (torch.bfloat16, torch.float16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    differ = (bits(actual) != bits(expected)).nonzero().flatten()
    assert len(differ) == 0, (
        f"{what}: {len(differ)} of {actual.numel()} differ, first at {differ[0].item()}: "
        f"{actual[differ[0]].item()!r} instead of {expected[differ[0]].item()!r}"
    )


@pytest.fixture(scope="session")
def torch_references(tmp_path_factory):
    """The inputs by gradient dtype, and AdamW's results and its op-for-op references on them
    by rounding ("fused", "unfused"), computed by torch with the kernels that round that way."""
    capabilities = {"fused": "avx2" if X86 else "default", "unfused": "default" if X86 else None}
    folder = tmp_path_factory.mktemp("references")
    inputs = {dtype: adamw_reference.inputs(dtype) for dtype in (torch.float32, *LOW)}
    torch.save(inputs, folder / "inputs.pt")
    results = {}
    for rounding, capability in capabilities.items():
        if capability is None:
            continue
        out = folder / f"{capability}.pt"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.adamw_reference",
                capability,
                str(folder / "inputs.pt"),
                str(out),
            ],
            cwd=ROOT,
            check=True,
            env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
        )
        computed = torch.load(out)
        if computed["capability"] == capability:  # else this CPU cannot run torch's kernels for it
            results[rounding] = computed
    return inputs, results


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Kernel libraries by compiler, built on first request (a missing compiler fails under CI)."""
    built = {"package": cpu_adam._library()}

    def get(compiler: str) -> cpu_adam.Library:
        if compiler not in built:
            if not shutil.which(compiler):
                message = f"{compiler} is not installed (apt-get install gcc-11 clang libomp-dev)"
                if os.environ.get("CI"):
                    pytest.fail(message + ": CI must test every compiler")
                pytest.skip(message)
            target = tmp_path_factory.mktemp(compiler) / kernel_build.LIBRARY_NAME
            kernel_build.build(target, [compiler])
            problems = []
            built[compiler] = cpu_adam._try_open(
                target, f"built by {compiler} for the tests", problems
            )
            assert built[compiler], problems
        library = built[compiler]
        if library.handle is None:
            pytest.skip(f"no compiled kernel here: {library.problem}")
        return library

    return get


@pytest.fixture(params=COMPILERS)
def library(request, libraries, monkeypatch):
    """Each compiler's library in turn, as the one cpu_adam uses."""
    chosen = libraries(request.param)
    monkeypatch.setattr(cpu_adam, "_opened", chosen)
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    return chosen


def run_kernel(
    variant, start, grads, out_dtype=None, *, lr, weight_decay, betas, eps, grad_scale, threads=2
):
    p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for step, grad in enumerate(grads, 1):
        cpu_adam.adamw_step(
            p,
            m,
            v,
            grad,
            out,
            step=step,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            grad_scale=grad_scale,
            threads=threads,
            variant=variant,
        )
    return p, m, v, out


def test_the_reference_is_torch_adamw(torch_references):
    """The op-for-op reference with torch's own square root reproduces AdamW exactly, so the
    one difference between "exact sqrt" and AdamW is how the square root is rounded."""
    _, references = torch_references
    assert references, "torch ran no reference (ATEN_CPU_CAPABILITY not honoured?)"
    for computed in references.values():
        for key, result in computed.items():
            if isinstance(key, tuple):
                for name, a, b in zip("pmv", result["torch sqrt"], result["adamw"]):
                    assert_same_bits(a, b, f"{computed['capability']} {key} {name}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", adamw_reference.CASES)
def test_every_variant_matches_torch_adamw_bit_for_bit(library, variant, case, torch_references):
    if variant not in library.variants:
        pytest.skip(f"no {variant} variant on this architecture")
    if variant not in library.runnable:
        pytest.skip(f"this CPU lacks the {variant} variant's instructions")
    inputs, references = torch_references
    rounding = "unfused" if variant in UNFUSED else "fused"
    if rounding not in references:
        pytest.skip(f"torch cannot run its {rounding} kernels on this CPU")
    references = references[rounding]
    hyper = adamw_reference.CASES[case]
    for dtype, (start, grads) in inputs.items():
        for out_dtype in (None, torch.float32, *LOW):
            p, m, v, out = run_kernel(variant, start, grads, out_dtype, **hyper)
            what = f"{variant}, {dtype} gradients, {out_dtype} copy"
            exact = references[case, dtype]["exact sqrt"]
            for name, actual, expected in zip(
                ("weights", "exp_avg", "exp_avg_sq"), (p, m, v), exact
            ):
                assert_same_bits(actual, expected, f"{what}: {name}")
            if out is not None:
                assert_same_bits(
                    out, p.to(out_dtype), f"{what}: the copy (torch's cast of the weights)"
                )
            adamw = references[case, dtype]["adamw"]
            assert_same_bits(m, adamw[1], f"{what}: exp_avg against AdamW")
            assert_same_bits(v, adamw[2], f"{what}: exp_avg_sq against AdamW")
            # torch's square root (MKL's, on x86) is off by an ulp at times: the weights then differ
            # by a rounding of the update (at most a few lr / 2^23 per step) or of the weight
            torch.testing.assert_close(p, adamw[0], rtol=1e-6, atol=hyper["lr"] * 1e-5)


@pytest.mark.parametrize("dtype", LOW)
def test_gradient_conversion_of_every_16_bit_value(library, dtype):
    """With beta1 = 0 and beta2 = 0 the step's moments are g and g² exactly: every finite
    gradient value arrives as torch converts it, and infinities and NaNs as AdamW treats them."""
    grad = adamw_reference.every_16_bit_value(dtype)
    expected = grad.float()
    finite = expected.isfinite()
    seen = {}
    for variant in library.runnable:
        p, m, v = torch.zeros(grad.numel()), torch.zeros(grad.numel()), torch.zeros(grad.numel())
        cpu_adam.adamw_step(
            p, m, v, grad, step=1, lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, variant=variant
        )
        assert_same_bits(m[finite], expected[finite], f"{variant}: {dtype} → float32")
        em, ev = torch.zeros_like(expected), torch.zeros_like(expected)
        em.lerp_(expected, 1.0)
        ev.mul_(0.0).addcmul_(expected, expected, value=1.0)
        assert torch.equal(m.isnan(), em.isnan()) and torch.equal(v.isnan(), ev.isnan()), variant
        assert torch.equal(v[~finite & ~expected.isnan()], ev[~finite & ~expected.isnan()]), variant
        seen[variant] = (m, v)
    for variant, (m, v) in seen.items():  # the same bits in every variant, NaN payloads included
        assert_same_bits(
            m, seen[library.runnable[0]][0], f"{variant} against {library.runnable[0]}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_weight_conversion_at_every_rounding_decision(library, dtype):
    """With lr = 0 and a zero gradient the weights do not move, so the copy is the conversion
    alone: round to nearest even, subnormals, overflow to infinity, as torch casts; a NaN stays
    a quiet NaN with its sign and leading payload bits, the same in every variant."""
    master = adamw_reference.floats_where_rounding_is_decided(
        torch.bfloat16 if dtype == torch.float32 else dtype
    )
    nan = master.isnan()
    expected = master.to(dtype)
    quiet = (bits(master[nan]).to(torch.int64) & 0xFFFFFFFF) | 0x00400000  # arithmetic quiets a NaN
    nan_bits = {
        torch.float32: quiet,
        torch.bfloat16: quiet >> 16,
        torch.float16: (quiet >> 16 & 0x8000) | 0x7C00 | (quiet >> 13 & 0x3FF),
    }[dtype]
    seen = {}
    for variant in library.runnable:
        p, zeros = master.clone(), torch.zeros(master.numel())
        out = torch.empty(master.numel(), dtype=dtype)
        cpu_adam.adamw_step(
            p,
            zeros.clone(),
            zeros.clone(),
            zeros,
            out,
            step=1,
            lr=0.0,
            weight_decay=0.0,
            variant=variant,
        )
        assert_same_bits(out[~nan], expected[~nan], f"{variant}: float32 → {dtype}")
        mask = 0xFFFFFFFF if dtype == torch.float32 else 0xFFFF
        assert torch.equal(bits(out[nan]).to(torch.int64) & mask, nan_bits), (
            f"{variant}: a NaN becomes a quiet NaN with its sign and leading payload bits"
        )
        seen[variant] = out
    for variant, out in seen.items():
        assert_same_bits(out, seen[library.runnable[0]], f"{variant} against {library.runnable[0]}")


def test_sum_of_squares_is_exact_here_and_the_same_for_any_threads_and_variant(library):
    torch.manual_seed(0)
    # Small integers: every square and partial sum is exact in double, so there is one right answer.
    ints = torch.randint(-100, 101, (3_000_017,)).float()
    exact = int((ints.long() ** 2).sum())
    grad = torch.randn(1_000_003) * 10.0 ** torch.randint(-8, 8, (1_000_003,))
    sums = {}
    for variant in library.runnable:
        for dtype in (torch.float32, *LOW):
            assert cpu_adam.grad_sum_of_squares(ints.to(dtype), variant=variant) == exact
        results = {
            cpu_adam.grad_sum_of_squares(grad, threads, variant=variant) for threads in (1, 2, 3, 8)
        }
        assert len(results) == 1, f"{variant}: the sum depends on the thread count: {results}"
        sums[variant] = results.pop()
        assert sums[variant] == sums[library.runnable[0]], f"{variant} adds in another order"
        assert sums[variant] == pytest.approx(float(grad.double().square().sum()), rel=1e-12)
        assert cpu_adam.grad_sum_of_squares(
            torch.tensor([1.0, float("inf")]), variant=variant
        ) == float("inf")
        for dtype in (torch.float32, *LOW):
            assert math.isnan(
                cpu_adam.grad_sum_of_squares(
                    torch.tensor([1.0, float("nan")]).to(dtype), variant=variant
                )
            )
        assert cpu_adam.grad_sum_of_squares(torch.zeros(0), variant=variant) == 0.0


def test_the_floor_touches_every_element_the_step_does_in_every_variant_and_pair(library):
    """bench adam's floor: for each gradient and copy dtype, every element of the three fp32 arrays
    read and written (here: the gradient added), the copy written from the weights, a ragged length,
    any threads."""
    n = 3 * 1024 * 33 + 5  # several threads' grains and a partial tile
    for variant in library.runnable:
        for grad_dtype in (torch.float32, *LOW):
            for out_dtype in (None, torch.float32, *LOW):
                arrays = [torch.full((n,), float(k)) for k in (1, 2, 3)]
                grad = torch.arange(n, dtype=torch.float32).remainder(7).to(grad_dtype)
                out = None if out_dtype is None else torch.full((n,), float("nan")).to(out_dtype)
                cpu_adam.floor_pass(*arrays, grad, out, threads=3, variant=variant)
                for k, array in enumerate(arrays, 1):
                    assert torch.equal(array, k + grad.float()), (variant, grad_dtype, out_dtype)
                if out is not None:
                    assert torch.equal(out, arrays[0].to(out_dtype)), (
                        variant,
                        grad_dtype,
                        out_dtype,
                    )


def test_the_floor_needs_the_compiled_kernel_and_checks_its_arguments(library):
    arrays = [torch.zeros(8) for _ in range(3)]
    with pytest.raises(ValueError, match="^variant: the floor is the compiled kernel's loop"):
        cpu_adam.floor_pass(*arrays, torch.zeros(8), variant=cpu_adam.TORCH)
    with pytest.raises(ValueError, match="^grad: expected 8 elements"):
        cpu_adam.floor_pass(*arrays, torch.zeros(9))
    with pytest.raises(ValueError, match="^exp_avg: expected memory of its own"):
        cpu_adam.floor_pass(arrays[0], arrays[0], arrays[2], torch.zeros(8))


def test_the_torch_step_is_torch_adamw_exactly():
    hyper = adamw_reference.CASES["low beta1, scaled"]
    for dtype in (torch.float32, *LOW):
        start, grads = adamw_reference.inputs(dtype)
        p, m, v, out = run_kernel(cpu_adam.TORCH, start, grads, torch.bfloat16, **hyper)
        for name, actual, expected in zip(
            "pmv", (p, m, v), adamw_reference.adamw(start, grads, **hyper)
        ):
            assert_same_bits(actual, expected, f"torch step, {dtype}: {name}")
        assert_same_bits(out, p.bfloat16(), "torch step: the copy")


@pytest.mark.parametrize("variant", [None, cpu_adam.TORCH])
def test_a_scaled_step_leaves_the_callers_gradient_alone(variant):
    grad = torch.tensor([2.0, -4.0, 8.0])
    p, m, v = torch.ones(3), torch.zeros(3), torch.zeros(3)
    cpu_adam.adamw_step(p, m, v, grad, step=1, lr=0.1, grad_scale=0.5, variant=variant)
    assert grad.tolist() == [2.0, -4.0, 8.0]
    assert m.tolist() == pytest.approx([0.1, -0.2, 0.4])


def test_backend_names_the_variant_and_where_it_came_from_without_paths(monkeypatch):
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    kernel = cpu_adam.load()
    text = cpu_adam.backend()
    if not kernel.compiled:
        pytest.skip(f"no compiled kernel here: {text}")
    assert text.startswith(
        f"compiled C kernel, {kernel.library.runnable[0]} variant (the best of "
    ), text
    assert "built at install time" in text or "compiled at first use into " in text, text
    assert not re.search(r"(^|[\s(=:])/", text) and str(ROOT) not in text, (
        f"a path of this machine: {text}"
    )
    for grad_dtype in (torch.float32, *LOW):  # the C code has a loop for every pair
        for out_dtype in (None, torch.float32, *LOW):
            assert cpu_adam.backend(grad_dtype, out_dtype) == text
    with pytest.raises(
        ValueError, match=r"^grad_dtype: expected dtype torch.float32 or .*; got torch.int32$"
    ):
        cpu_adam.backend(torch.int32)


def test_the_variant_can_be_chosen_and_a_wrong_choice_is_an_error(monkeypatch):
    kernel = cpu_adam.load()
    if not kernel.compiled:
        pytest.skip(f"no compiled kernel here: {cpu_adam.backend()}")
    last = kernel.library.runnable[-1]
    monkeypatch.setenv(cpu_adam.VARIANT_ENV, last)
    assert cpu_adam.backend().startswith(
        f"compiled C kernel, {last} variant (chosen by {cpu_adam.VARIANT_ENV}; "
    )
    monkeypatch.setenv(cpu_adam.VARIANT_ENV, cpu_adam.TORCH)
    assert cpu_adam.backend() == f"torch fallback (chosen by {cpu_adam.VARIANT_ENV})"
    monkeypatch.setenv(cpu_adam.VARIANT_ENV, "sse9")
    with pytest.raises(
        ValueError, match=rf"^{cpu_adam.VARIANT_ENV}: expected one of .*, torch; got 'sse9'$"
    ):
        cpu_adam.backend()
    monkeypatch.delenv(cpu_adam.VARIANT_ENV)
    with pytest.raises(ValueError, match=r"^variant: expected one of"):
        cpu_adam.adamw_step(
            torch.zeros(2),
            torch.zeros(2),
            torch.zeros(2),
            torch.zeros(2),
            step=1,
            lr=0.1,
            variant="sse9",
        )
    # As on a CPU without the best variant's instructions:
    best, *others = kernel.library.runnable
    monkeypatch.setattr(
        cpu_adam, "_opened", dataclasses.replace(kernel.library, runnable=tuple(others))
    )
    with pytest.raises(
        ValueError, match=rf"^variant: expected a variant this CPU runs .*; got '{best}', whose"
    ):
        cpu_adam.load(best)
    monkeypatch.setenv(cpu_adam.VARIANT_ENV, best)
    with pytest.raises(
        ValueError, match=rf"^{cpu_adam.VARIANT_ENV}: expected a variant this CPU runs"
    ):
        cpu_adam.backend()


def test_the_library_refuses_a_variant_it_does_not_hold():
    kernel = cpu_adam.load()
    if not kernel.compiled:
        pytest.skip(f"no compiled kernel here: {cpu_adam.backend()}")
    total = cpu_adam.ctypes.c_double()
    status = kernel.library.handle.offloadlab_sumsq(
        len(kernel.library.variants),
        torch.zeros(1).data_ptr(),
        1,
        1,
        1,
        cpu_adam.ctypes.byref(total),
    )
    assert status == 2  # STATUS_BAD_VARIANT in csrc/kernel.h


@pytest.mark.skipif(not X86, reason="the guard is on x86-64's baseline variant")
def test_a_compiler_error_falls_back_with_one_warning_holding_the_whole_error(
    monkeypatch, tmp_path
):
    """CC with -mavx2 would let AVX2 into the baseline copy, which any x86-64 CPU may run: the
    source refuses to compile, and the whole error reaches the user, once."""
    monkeypatch.setattr(cpu_adam, "_opened", None)
    monkeypatch.setattr(cpu_adam, "_INSTALLED", tmp_path / "not-installed.so")
    monkeypatch.setenv("OFFLOADLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "gcc -mavx2")
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = cpu_adam.backend()
        start, grads = adamw_reference.inputs()
        hyper = adamw_reference.CASES["usual"]
        p, m, v, _ = run_kernel(None, start, grads, **hyper)
        cpu_adam.load()
    assert [w.category for w in caught] == [RuntimeWarning]
    message = str(caught[0].message)
    assert "no library was built at install time" in message
    assert "gcc -mavx2 -O3" in message and "failed with exit status 1" in message
    assert re.search(
        r"cpu_adam\.c:\d+:\d+: error: #error \"the baseline variant is for any x86-64 CPU", message
    )
    assert text.startswith(
        "torch fallback (no library was built at install time; compiling it at first use failed"
    )
    for name, actual, expected in zip(
        "pmv", (p, m, v), adamw_reference.adamw(start, grads, **hyper)
    ):
        assert_same_bits(actual, expected, f"fallback: {name}")
    assert list((tmp_path / "cache").iterdir()) == [], "a failed build leaves nothing behind"


def test_first_use_builds_into_the_cache_once_and_reuses_it(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_adam, "_INSTALLED", tmp_path / "not-installed.so")
    monkeypatch.setenv("OFFLOADLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "gcc -O0")  # a command with flags; the recipe's -O3 comes after it
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    monkeypatch.setattr(cpu_adam, "_opened", None)
    kernel = cpu_adam.load()
    assert kernel.compiled, kernel
    assert (
        kernel.library.origin
        == "compiled at first use into $OFFLOADLAB_CACHE, because no library was built at "
        "install time"
    )
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_adam-"), built
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_adam, "_opened", None)  # as a new process
    assert cpu_adam.load().compiled and built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "cache").iterdir()) == built


def test_first_use_builds_for_other_machines_or_compilers_have_other_names(monkeypatch):
    name = cpu_adam._first_use_name(["gcc"])
    assert name == cpu_adam._first_use_name(["gcc"]) != cpu_adam._first_use_name(["gcc", "-O0"])
    if shutil.which("clang"):
        assert cpu_adam._first_use_name(["clang"]) != name
    # same compiler text, other machine
    monkeypatch.setattr(cpu_adam.platform, "machine", lambda: "aarch64")
    assert cpu_adam._first_use_name(["gcc"]) != name


def test_an_installed_library_from_other_sources_is_not_used(monkeypatch, tmp_path):
    target = tmp_path / kernel_build.LIBRARY_NAME
    kernel_build.build(target)
    problems = []
    assert cpu_adam._try_open(target, "built at install time", problems)
    # the C files changed
    monkeypatch.setattr(kernel_build, "source_digest", lambda variants=None: "0" * 16)
    assert cpu_adam._try_open(target, "built at install time", problems) is None
    assert problems == [
        "the library built at install time is out of date (built from other sources)"
    ]


def test_compiler_command_is_split_like_a_shell_would():
    assert kernel_build.compiler_command({"CC": "gcc -O0"}) == ["gcc", "-O0"]
    assert kernel_build.compiler_command({"CC": "'/opt/my cc/bin/gcc' -m64"}) == [
        "/opt/my cc/bin/gcc",
        "-m64",
    ]
    assert kernel_build.compiler_command({"CC": "  "}) == kernel_build.compiler_command({})


def test_a_missing_compiler_is_one_clear_error(tmp_path):
    with pytest.raises(
        kernel_build.BuildError,
        match=r"^no C compiler: '/no/such/cc' was not found \(set CC to one\)",
    ):
        kernel_build.build(tmp_path / "lib.so", ["/no/such/cc"])
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="^master: expected a torch.Tensor; got list"):
        cpu_adam.adamw_step([0.0] * 4, x, x, x, step=1, lr=0.1)
    with pytest.raises(ValueError, match="^exp_avg: expected 4 elements"):
        cpu_adam.adamw_step(x, torch.zeros(3), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)
    with pytest.raises(ValueError, match="^master: expected dtype torch.float32"):
        cpu_adam.adamw_step(x.half(), x, x, x, step=1, lr=0.1)
    with pytest.raises(ValueError, match="^grad: expected dtype"):
        cpu_adam.adamw_step(
            x, x.clone(), x.clone(), torch.zeros(4, dtype=torch.int32), step=1, lr=0.1
        )
    with pytest.raises(ValueError, match="^step: "):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), step=0, lr=0.1)
    with pytest.raises(ValueError, match="^betas: "):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), step=1, lr=0.1, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="^grad: expected a contiguous host"):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), torch.zeros(8)[::2], step=1, lr=0.1)
    with pytest.raises(
        ValueError, match=r"^out: expected memory of its own; got memory shared with master$"
    ):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), x, step=1, lr=0.1)
    buffer = torch.zeros(8)
    with pytest.raises(
        ValueError, match=r"^grad: expected memory of its own; got memory shared with exp_avg$"
    ):
        cpu_adam.adamw_step(x, buffer[:4], x.clone(), buffer[2:6], step=1, lr=0.1)
    with pytest.raises(
        ValueError, match=r"^threads: expected a positive number of threads; got 0$"
    ):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), step=1, lr=0.1, threads=0)
    with pytest.raises(
        ValueError, match=r"^threads: expected a positive number of threads; got 2.0$"
    ):
        cpu_adam.grad_sum_of_squares(x, 2.0)


def test_bytes_per_param():
    assert cpu_adam.bytes_per_param() == 28
    assert cpu_adam.bytes_per_param(torch.float32, None) == 28
    assert cpu_adam.bytes_per_param(torch.float32, torch.bfloat16) == 30
