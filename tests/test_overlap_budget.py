"""The overlap condition, the pipeline model and the per-step budget, against hand-computed cases."""

import pytest

from offloadlab import budget, overlap


def test_stage_hidden_and_stalled():
    hidden = overlap.stage("8 GB", "32 GB/s", "300 ms")
    assert hidden.t_transfer == pytest.approx(0.25) and hidden.hidden and hidden.stall == 0
    assert hidden.step == pytest.approx(0.3) and hidden.regime.startswith("compute-bound")
    stalled = overlap.stage(40e9, 32e9, 0.25)
    assert stalled.t_transfer == pytest.approx(1.25) and not stalled.hidden
    assert stalled.stall == pytest.approx(1.0) and stalled.step == pytest.approx(1.25)
    assert overlap.stage("1 MB", "1 GB/s", 0, latency="1 ms").t_transfer == pytest.approx(0.002)
    assert overlap.stage(0, "1 GB/s", 0.1).t_transfer == 0


def test_stage_bad_input():
    with pytest.raises(ValueError, match="^bandwidth: "):
        overlap.stage("1 GB", 0, 1)
    with pytest.raises(ValueError, match="^nbytes: "):
        overlap.stage("-1 GB", "1 GB/s", 1)
    with pytest.raises(ValueError, match="^t_compute: "):
        overlap.stage("1 GB", "1 GB/s", "-2 s")


def test_pipeline_depths():
    transfers, computes = [1.0] * 4, [2.0] * 4
    synchronous = overlap.pipeline(transfers, computes, depth=0)
    assert synchronous.step == pytest.approx(4 * (1 + 2)) and synchronous.stall == pytest.approx(4)
    double = overlap.pipeline(transfers, computes, depth=1)
    assert double.step == pytest.approx(1 + 4 * 2) and double.stall == pytest.approx(1)
    # Transfer-bound: the link is the bottleneck whatever the depth.
    bound = overlap.pipeline([3.0] * 4, [1.0] * 4, depth=2)
    assert bound.step == pytest.approx(4 * 3 + 1)
    # A buffer is refilled only after its compute: with depth 1 transfer 2 waits for compute 0.
    assert double.transfers[2][0] >= double.computes[0][1]
    with pytest.raises(ValueError, match="^compute_seconds: "):
        overlap.pipeline([1, 2], [1])
    with pytest.raises(ValueError, match="^depth: "):
        overlap.pipeline([1], [1], depth=-1)


def test_crossover_batch():
    # 40 GB at 32 GB/s = 1.25 s; at 50 ms of compute per sample the transfer hides from batch 25.
    assert overlap.crossover_batch(40e9, 32e9, 0.05) == 25
    assert overlap.crossover_batch(1e6, 1e9, 1.0) == 1
    with pytest.raises(ValueError, match="^compute_seconds_per_sample: "):
        overlap.crossover_batch(1e9, 1e9, 0)


def test_the_materials_budget_figures():
    assert budget.ceiling("32 GB/s", "250 ms") == pytest.approx(8e9)
    v = budget.verdict("32 GB/s", "250 ms", 10e9, "optimizer")
    assert v.traffic_bytes == 40e9 and v.transfer_seconds == pytest.approx(1.25)
    assert v.ratio == pytest.approx(5) and not v.fits and len(v.fixes()) == 3
    assert "5× over budget" in v.summary()
    # Park-and-copy of a 30 B model: 12 B × 30 B = 360 GB each way; both ways at 60 GB/s ≈ 12 s.
    assert budget.TRAFFIC["park-and-copy"].down * 30e9 == 360e9
    park = budget.verdict("60 GB/s", "1 s", 30e9, "park-and-copy")
    assert park.transfer_seconds == pytest.approx(12)
    live = budget.verdict("60 GB/s", "1 s", 30e9, "optimizer")
    assert park.traffic_bytes / live.traffic_bytes == pytest.approx(6)


def test_traffic_of_each_choice():
    assert {n: t.per_param for n, t in budget.TRAFFIC.items()} == {
        "optimizer": 4, "gradients": 2, "parameters": 4, "park-and-copy": 24}
    assert budget.traffic_bytes(1e9, ["optimizer", "gradients"]) == 4e9  # gradients ride with the optimizer
    assert budget.traffic_bytes(1e9, ["optimizer", "parameters"]) == 8e9
    fits = budget.verdict("32 GB/s", "1 s", 1e9, "optimizer")
    assert fits.fits and fits.fixes() == [] and "fits" in fits.summary()
    assert budget.verdict("32 GB/s", "250 ms").to_dict()["ceiling_bytes"] == pytest.approx(8e9)


@pytest.mark.parametrize("call, fragment", [
    (lambda: budget.traffic_bytes(1e9, "teleport"), "^offload: "),
    (lambda: budget.traffic_bytes(1e9, []), "^offload: "),
    (lambda: budget.traffic_bytes(-1, "optimizer"), "^params: "),
    (lambda: budget.ceiling("32 GB", "1 s"), "^bandwidth: "),
    (lambda: budget.ceiling("32 GB/s", "0 s"), "^window: "),
])
def test_budget_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
