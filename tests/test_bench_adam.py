"""`offloadlab bench adam`: its rows and ratios, and DeepSpeed's peer reported absent with the
reason when its extension cannot be built (not only when it is not installed)."""

import sys
import types

import pytest

from offloadlab import bench, cpu_adam


@pytest.fixture
def deepspeed_that_fails_to_build(monkeypatch):
    class DeepSpeedCPUAdam:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Error building extension 'cpu_adam'\nninja: build stopped: subcommand failed.")

    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = DeepSpeedCPUAdam
    for name, module in {"deepspeed": types.ModuleType("deepspeed"), "deepspeed.ops": types.ModuleType("deepspeed.ops"),
                         "deepspeed.ops.adam": adam}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_rows_for_the_best_and_the_baseline_variant_and_deepspeed_absent_with_its_reason(
        deepspeed_that_fails_to_build, monkeypatch):
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    kernel = cpu_adam.load()
    result = bench.adam(quick=True, params=200_000, threads=1)
    names = [row["contender"] for row in result["rows"]]
    expected = [f"offloadlab fused step, {kernel.variant} variant" if kernel.compiled else
                "offloadlab step, torch fallback"]
    if kernel.compiled and len(kernel.library.runnable) > 1:
        expected.append(f"offloadlab fused step, {kernel.library.runnable[-1]} variant")
    same_job = f"offloadlab step, {kernel.variant}, fp32 gradients, no copy"
    assert names == expected + [same_job, "torch AdamW foreach", "torch AdamW fused", "torch AdamW fused + bf16 cast"]
    assert all(row["seconds"] > 0 for row in result["rows"])
    assert result["note"] == ("DeepSpeedCPUAdam: absent (RuntimeError: ninja: build stopped: subcommand failed.)")
    ratios = result["ratios"]
    assert ratios["DeepSpeedCPUAdam + cast / offloadlab step (target ≥ 1.0)"] is None
    assert ratios["DeepSpeedCPUAdam / offloadlab step, same job (target ≥ 1.0)"] is None
    assert ratios["offloadlab step / bandwidth floor (target ≤ 1.10)"] > 0
    assert (ratios["fused + cast / offloadlab baseline step (target ≥ 1.0)"] is None) == (len(expected) == 1)
    assert "DeepSpeedCPUAdam: absent" in bench.format_result(result)


def test_deepspeed_not_installed_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ModuleNotFoundError
    step, why = bench._deepspeed_step(None)
    assert step is None and why == "not installed: pip install deepspeed to compare"
