"""Install the package as users do — a wheel of this checkout, an editable install, a wheel built
without a C compiler — in throwaway environments that reuse the torch already installed, and
check that the CPU Adam kernel there is compiled and computes the same bits as this checkout's."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import torch

from offloadlab import cpu_adam, kernel_build
from tests.conftest import ROOT

# What a build of the package reads (pyproject's readme included).
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md", "offloadlab")
# Runs in the installed environment: steps with every variant there, saved for comparison.
STEP_SCRIPT = """
import sys, warnings, torch
warnings.simplefilter("error")  # a fallback warning would fail the run
import offloadlab
from offloadlab import cpu_adam
generator = torch.Generator().manual_seed(0)
master = torch.randn(50_001, generator=generator)
grads = [torch.randn(50_001, generator=generator).bfloat16() for _ in range(3)]
runnable = cpu_adam.load().library.runnable
results = {"file": offloadlab.__file__, "backend": cpu_adam.backend(), "variants": runnable}
for variant in cpu_adam.load().library.runnable:
    p, m, v = master.clone(), torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(master.numel(), dtype=torch.bfloat16)
    for step, grad in enumerate(grads, 1):
        cpu_adam.adamw_step(p, m, v, grad, out, step=step, lr=1e-3, variant=variant)
    results[variant] = (p, m, v, out, cpu_adam.grad_sum_of_squares(grads[0], variant=variant))
torch.save(results, sys.argv[1])
"""


def copy_package(folder):
    folder.mkdir()
    for name in PACKAGE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source,
                folder / name,
                ignore=shutil.ignore_patterns("__pycache__", kernel_build.LIBRARY_NAME, ".build-*"),
            )
        else:
            shutil.copy2(source, folder / name)
    return folder


def make_environment(folder):
    """A fresh venv that sees this interpreter's packages (torch, pip, setuptools) after its own."""
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(own) / "parent-packages.pth").write_text("\n".join(sorted(shared)) + "\n")
    return python


def environment(**extra):
    """This process's environment without what would let the checkout or its caches leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "CC", "OFFLOADLAB_CPU_ADAM_VARIANT")
    }
    return {**env, **extra}


def pip(python, *arguments, **extra):
    result = subprocess.run(
        [python, "-m", "pip", *arguments],
        capture_output=True,
        text=True,
        env=environment(PIP_NO_INDEX="1", **extra),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def run_steps(python, tmp_path, **extra):
    out = tmp_path / "steps.pt"
    result = subprocess.run(
        [python, "-c", STEP_SCRIPT, str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment(**extra),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return torch.load(out)


def assert_same_as_this_checkout(results):
    """The installed kernel's steps against this checkout's kernel, bit for bit, variant by
    variant."""
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(50_001, generator=generator)
    grads = [torch.randn(50_001, generator=generator).bfloat16() for _ in range(3)]
    assert results["variants"] == cpu_adam.load().library.runnable
    for variant in results["variants"]:
        p, m, v = master.clone(), torch.zeros_like(master), torch.zeros_like(master)
        out = torch.empty(master.numel(), dtype=torch.bfloat16)
        for step, grad in enumerate(grads, 1):
            cpu_adam.adamw_step(p, m, v, grad, out, step=step, lr=1e-3, variant=variant)
        *theirs, their_sum = results[variant]
        for name, ours, installed in zip(
            ("weights", "exp_avg", "exp_avg_sq", "copy"), (p, m, v, out), theirs
        ):
            assert torch.equal(
                ours.view(torch.int16 if ours.element_size() == 2 else torch.int32),
                installed.view(torch.int16 if ours.element_size() == 2 else torch.int32),
            ), f"{variant}: {name} differs between the installed kernel and this checkout's"
        assert their_sum == cpu_adam.grad_sum_of_squares(grads[0], variant=variant)


@pytest.fixture(scope="module")
def checkout_kernel():
    kernel = cpu_adam.load()
    if not kernel.compiled:
        pytest.fail(f"this checkout has no compiled kernel to compare with: {kernel.describe()}")
    return kernel


def test_a_wheel_carries_the_compiled_kernel_and_runs_it_without_a_compiler(
    tmp_path, checkout_kernel
):
    source = copy_package(tmp_path / "source")
    pip(
        sys.executable,
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(tmp_path / "dist"),
        str(source),
    )
    (wheel,) = (tmp_path / "dist").glob("offloadlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"offloadlab/{kernel_build.LIBRARY_NAME}" in names
    assert {f"offloadlab/csrc/{name}" for name in kernel_build.SOURCES} <= set(names)
    modules = {
        path.relative_to(source).as_posix() for path in (source / "offloadlab").rglob("*.py")
    }
    assert modules <= set(names), f"pyproject's packages leave out {sorted(modules - set(names))}"
    # the library alone: the course's tooling is a package of its own (course/)
    course = ("plots", "check", "grading", "student", "lab", "offload/capacity")
    assert not [n for n in names if n.startswith("offloadlab_course")]
    assert not {f"offloadlab/{m}.py" for m in course} & set(names)
    python = make_environment(tmp_path / "venv")
    pip(python, "install", "--no-deps", str(wheel))
    # No compiler and an empty cache at run time: the kernel must be the one in the wheel.
    results = run_steps(
        python, tmp_path, CC="/no/such/compiler", OFFLOADLAB_CACHE=str(tmp_path / "cache")
    )
    assert results["file"].startswith(str(tmp_path / "venv")), results["file"]
    assert results["backend"].startswith(
        f"compiled C kernel, {checkout_kernel.library.runnable[0]} variant"
    ), results["backend"]
    assert "built at install time" in results["backend"]
    assert not (tmp_path / "cache").exists()
    assert_same_as_this_checkout(results)


def test_an_editable_install_builds_the_kernel_in_place(tmp_path, checkout_kernel):
    source = copy_package(tmp_path / "source")
    python = make_environment(tmp_path / "venv")
    pip(python, "install", "--no-deps", "--no-build-isolation", "--editable", str(source))
    assert (source / "offloadlab" / kernel_build.LIBRARY_NAME).exists()
    results = run_steps(
        python, tmp_path, CC="/no/such/compiler", OFFLOADLAB_CACHE=str(tmp_path / "cache")
    )
    assert results["file"] == str(source / "offloadlab" / "__init__.py")
    assert "built at install time" in results["backend"], results["backend"]
    assert_same_as_this_checkout(results)


def test_without_a_compiler_the_install_succeeds_and_the_first_use_compiles(
    tmp_path, checkout_kernel
):
    source = copy_package(tmp_path / "source")
    pip(
        sys.executable,
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(tmp_path / "dist"),
        str(source),
        CC="/no/such/compiler",
    )
    (wheel,) = (tmp_path / "dist").glob("offloadlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"offloadlab/{kernel_build.LIBRARY_NAME}" not in names
    assert {f"offloadlab/csrc/{name}" for name in kernel_build.SOURCES} <= set(names)
    modules = {
        path.relative_to(source).as_posix() for path in (source / "offloadlab").rglob("*.py")
    }
    assert modules <= set(names), f"pyproject's packages leave out {sorted(modules - set(names))}"
    python = make_environment(tmp_path / "venv")
    pip(python, "install", "--no-deps", str(wheel))
    # Still no compiler at run time: the torch step, with one warning naming the reason.
    result = subprocess.run(
        [python, "-c", "from offloadlab import cpu_adam; print(cpu_adam.backend())"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment(CC="/no/such/compiler", OFFLOADLAB_CACHE=str(tmp_path / "cache")),
    )
    assert result.returncode == 0, result.stderr
    reason = (
        "no library was built at install time; compiling it at first use failed: no C compiler: "
        "'/no/such/compiler' was not found (set CC to one)"
    )
    assert result.stdout.strip() == f"torch fallback ({reason})"
    assert result.stderr.count("RuntimeWarning") == 1 and reason in result.stderr, result.stderr
    # With a compiler, the first use builds the same multi-variant library into the cache.
    results = run_steps(python, tmp_path, OFFLOADLAB_CACHE=str(tmp_path / "cache"))
    assert (
        "compiled at first use into $OFFLOADLAB_CACHE, because no library was built at install time"
        in results["backend"]
    ), results["backend"]
    assert len(list((tmp_path / "cache").glob("cpu_adam-*.so"))) == 1
    assert_same_as_this_checkout(results)
