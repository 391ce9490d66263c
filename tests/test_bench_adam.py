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
            raise RuntimeError(
                "Error building extension 'cpu_adam'\nninja: build stopped: subcommand failed."
            )

    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = DeepSpeedCPUAdam
    for name, module in {
        "deepspeed": types.ModuleType("deepspeed"),
        "deepspeed.ops": types.ModuleType("deepspeed.ops"),
        "deepspeed.ops.adam": adam,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_rows_for_the_best_and_the_baseline_variant_and_deepspeed_absent_with_its_reason(
    deepspeed_that_fails_to_build, monkeypatch
):
    monkeypatch.delenv(cpu_adam.VARIANT_ENV, raising=False)
    kernel = cpu_adam.load()
    result = bench.adam(quick=True, params=200_000, threads=1)
    names = [row["contender"] for row in result["rows"]]
    expected = [
        f"offloadlab fused step, {kernel.variant} variant"
        if kernel.compiled
        else "offloadlab step, torch fallback"
    ]
    if kernel.compiled and len(kernel.library.runnable) > 1:
        expected.append(f"offloadlab fused step, {kernel.library.runnable[-1]} variant")
    same_job = f"offloadlab step, {kernel.variant}, fp32 gradients, no copy"
    assert names == expected + [
        same_job,
        "torch AdamW foreach",
        "torch AdamW fused",
        "torch AdamW fused + bf16 cast",
    ]
    assert all(row["seconds"] > 0 for row in result["rows"])
    assert result["note"] == (
        "DeepSpeedCPUAdam: absent (RuntimeError: ninja: build stopped: subcommand failed.)"
    )
    ratios = result["ratios"]
    assert ratios["DeepSpeedCPUAdam + cast / offloadlab step (target ≥ 1.0)"] is None
    assert ratios["DeepSpeedCPUAdam / offloadlab step, same job (target ≥ 1.0)"] is None
    # 200,000 parameters fit in a cache: no floor there, and the bench says why
    floor = result["floor"]
    assert (ratios["offloadlab step / bandwidth floor (target ≤ 1.10)"] is None) == (
        not floor["valid"]
    )
    assert floor["valid"] or floor["why_not"] in bench.format_result(result)
    assert (ratios["fused + cast / offloadlab baseline step (target ≥ 1.0)"] is None) == (
        len(expected) == 1
    )
    assert "DeepSpeedCPUAdam: absent" in bench.format_result(result)


def test_deepspeed_not_installed_says_so(monkeypatch):
    # import deepspeed raises ModuleNotFoundError, and so does a submodule an earlier test imported
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    step, why = bench._deepspeed_step(None)
    assert step is None and why == "not installed: pip install deepspeed to compare"


STREAMS = {"ours": bench._BF16_IN_OUT, "torch": bench._FP32_IN}


def test_a_contender_beating_its_floor_by_more_than_five_percent_makes_the_floor_invalid():
    floors = {bench._BF16_IN_OUT: 1.0, bench._FP32_IN: 0.5}
    fine = bench.floor_verdict(
        {"ours": 1.2, "torch": 0.5 / 1.04}, floors, STREAMS, 10**9, 32 * 2**20
    )
    assert fine == ""
    why = bench.floor_verdict(
        {"ours": 1.2, "torch": 0.5 / 1.06}, floors, STREAMS, 10**9, 32 * 2**20
    )
    assert why.startswith("torch ran at 106 % of its floor (over 105 %)")


def test_arrays_that_a_few_caches_hold_have_no_floor():
    floors = {bench._BF16_IN_OUT: 1.0, bench._FP32_IN: 0.5}
    seconds = {"ours": 1.2, "torch": 0.6}
    assert "less than 4× the last-level cache (32 MiB)" in bench.floor_verdict(
        seconds, floors, STREAMS, 100 * 2**20, 32 * 2**20
    )
    assert bench.floor_verdict(seconds, floors, STREAMS, 128 * 2**20, 32 * 2**20) == ""
    # (cache unknown: the margin still holds)
    assert bench.floor_verdict(seconds, floors, STREAMS, 2**20, None) == ""


def test_an_invalid_floor_is_said_instead_of_printed():
    result = {
        "benchmark": "adam",
        "source": "measured",
        "ratios": {"offloadlab step / bandwidth floor": None},
        "rows": [
            {
                "contender": "torch AdamW fused",
                "seconds": 0.05,
                "params_per_s": 3e8,
                "bytes_per_s": 9e9,
            }
        ],
        "floor": {
            "valid": False,
            "why_not": "torch AdamW fused ran at 120 % of its floor (over 105 %)",
        },
    }
    text = bench.format_result(result)
    assert (
        "floor not valid, so not shown: torch AdamW fused ran at 120 %" in text
        and "% of floor" not in text
    )
    assert "unknown" in text
