"""The overlap condition, the pipeline model and the per-step budget, against hand-computed
cases."""

from types import MappingProxyType
import pytest

from offloadlab import budget, memory, overlap


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


def test_the_sources_budget_figures_are_the_half_duplex_reading():
    assert budget.ceiling("32 GB/s", "250 ms") == pytest.approx(8e9)
    half = budget.verdict("32 GB/s", "250 ms", 10e9, "optimizer", duplex="half")
    assert half.traffic_bytes == 40e9 and half.transfer_seconds == pytest.approx(1.25)
    assert half.ratio == pytest.approx(5) and not half.fits and len(half.fixes()) == 3
    assert "5× over budget" in half.summary()
    # Park-and-copy of a 30 B model: 12 B × 30 B = 360 GB each way; both ways one after the other at
    # 60 GB/s: 12 s.
    assert budget.TRAFFIC["park-and-copy"].h2d * 30e9 == 360e9
    park = budget.verdict("60 GB/s", "1 s", 30e9, "park-and-copy", duplex="half")
    assert park.transfer_seconds == pytest.approx(12)
    live = budget.verdict("60 GB/s", "1 s", 30e9, "optimizer", duplex="half")
    assert park.traffic_bytes / live.traffic_bytes == pytest.approx(6)


def test_full_duplex_moves_both_directions_at_once():
    # 20 GB down and 20 GB up, each on its own copy engine: 0.625 s, 2.5 times the window.
    full = budget.verdict("32 GB/s", "250 ms", 10e9, "optimizer")
    assert full.duplex == "full" and (full.h2d_bytes, full.d2h_bytes) == (20e9, 20e9)
    assert full.transfer_seconds == pytest.approx(0.625) and full.ratio == pytest.approx(2.5)
    assert full.stall_seconds == pytest.approx(0.375) and "2.5× over budget" in full.summary()
    # The JSON names the rate for what it is: each direction's, while both run (not their sum).
    rates = {key: value for key, value in full.to_dict().items() if key.endswith("bytes_per_s")}
    assert rates == {
        "bandwidth_bytes_per_s": 32e9,
        "each_direction_while_both_run_bytes_per_s": 32e9,
    }
    assert budget.verdict(
        "60 GB/s", "1 s", 30e9, "park-and-copy"
    ).transfer_seconds == pytest.approx(6)
    # One direction only: duplex changes nothing.
    assert (
        budget.link_seconds(20e9, 0, 32e9, 16e9)
        == budget.link_seconds(20e9, 0, 32e9, 32e9)
        == 0.625
    )


def test_a_measured_rate_for_both_directions_lies_between():
    # Each direction keeps 20 of its 32 GB/s while the other runs: 20 GB at 20 GB/s = 1 s.
    measured = budget.verdict("32 GB/s", "250 ms", 10e9, "optimizer", duplex="20 GB/s")
    assert measured.duplex == "measured" and measured.transfer_seconds == pytest.approx(1.0)
    assert measured.ratio == pytest.approx(4)
    # Asymmetric traffic: the overlapping part at the shared rate, the rest alone.
    assert budget.link_seconds(30e9, 10e9, 32e9, 20e9) == pytest.approx(10 / 20 + 20 / 32)
    # half duplex: the sum
    assert budget.link_seconds(30e9, 10e9, 32e9, 16e9) == pytest.approx(40 / 32)
    # Two measurements of one link differ a little: a both-ways rate just above the one-way rate is
    # full duplex.
    assert budget.both_directions_rate("2 GB/s", "2.1 GB/s") == (2e9, "measured")


def test_traffic_comes_from_the_recipe():
    assert {n: (t.h2d, t.d2h) for n, t in budget.TRAFFIC.items()} == {
        "optimizer": (2, 2),
        "gradients": (2, 2),
        "parameters": (4, 2),
        "park-and-copy": (12, 12),
    }
    # Gradients ride with the optimizer; offloaded parameters replace the upload after the update.
    assert budget.traffic(["optimizer", "gradients"]).per_param == 4
    both = budget.traffic(["optimizer", "parameters"])
    assert (both.h2d, both.d2h) == (4, 2)
    assert budget.traffic_bytes(1e9, ["optimizer", "parameters"]) == 6e9
    fp32 = budget.traffic("optimizer", "fp32-adam")
    assert (fp32.h2d, fp32.d2h) == (4, 4) and budget.traffic("park-and-copy", "fp32-adam").h2d == 8
    fits = budget.verdict("32 GB/s", "1 s", 1e9, "optimizer")
    assert fits.fits and fits.fixes() == [] and "fits" in fits.summary()
    payload = budget.verdict("32 GB/s", "250 ms").to_dict()
    assert payload["ceiling_bytes"] == pytest.approx(8e9) and payload["ratio"] is None


def test_a_correction_to_a_recipe_reaches_the_budget(monkeypatch):
    corrected = memory.Recipe(
        "corrected",
        "16-bit weights, fp32 gradients",
        {"weights": 2, "gradients": 4, "master_weights": 4, "first_moment": 4, "second_moment": 4},
    )
    monkeypatch.setattr(
        memory, "RECIPES", MappingProxyType({**memory.RECIPES, "corrected": corrected})
    )
    moved = budget.traffic("optimizer", "corrected")
    assert (moved.h2d, moved.d2h) == (2, 4)
    assert (
        budget.verdict("10 GB/s", "1 s", 1e9, "optimizer", recipe="corrected").transfer_seconds
        == 0.4
    )


def test_deepspeeds_fp32_gradients_cross_the_link_at_four_bytes():
    # DeepSpeed casts each gradient to fp32 on the GPU before its device-to-host copy
    # (stage_1_and_2.py, stage3.py in 0.19) and brings 16-bit weights back: 4 B down, 2 B up, 18 B
    # of state per parameter.
    moved = budget.traffic("optimizer", "mixed-adam-fp32-grads")
    assert (moved.h2d, moved.d2h) == (2, 4) and memory.get_recipe(
        "mixed-adam-fp32-grads"
    ).total == 18
    slower = budget.verdict("25 GB/s", "1 s", 10e9, "optimizer", recipe="mixed-adam-fp32-grads")
    assert (
        slower.transfer_seconds
        == 1.6
        == 2 * budget.verdict("25 GB/s", "1 s", 10e9).transfer_seconds
    )


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: budget.traffic_bytes(1e9, "teleport"), "^offload: "),
        (lambda: budget.traffic_bytes(1e9, []), "^offload: "),
        (lambda: budget.traffic_bytes(-1, "optimizer"), "^params: "),
        (lambda: budget.ceiling("32 GB", "1 s"), "^bandwidth: "),
        (lambda: budget.ceiling("32 GB/s", "0 s"), "^window: "),
        (lambda: budget.traffic(["optimizer", "park-and-copy"]), "^offload: .*not both"),
        (lambda: budget.traffic("optimizer", "adamw"), "^recipe: "),
        (
            lambda: budget.verdict("32 GB/s", "1 s", duplex="sometimes"),
            "^duplex: expected 'full', 'half'",
        ),
        (lambda: budget.verdict("32 GB/s", "1 s", duplex=None), "^duplex: "),
        (lambda: budget.verdict("32 GB/s", "1 s", duplex="40 GB/s"), "^duplex: expected at most"),
    ],
)
def test_budget_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def _lane(step, name):
    return {label: (start, end) for start, end, label in step.lanes[name]}


def test_offload_step_waits_update_for_gradient_and_upload_for_update():
    # Four layers: forward 1 s, backward 2 s, gradient down 0.5 s, CPU update 1 s, weights up 0.5 s
    # each.
    s = overlap.offload_step(4, 1, 2, gradient=0.5, update=1, upload=0.5)
    grads, updates, uploads = _lane(s, "D2H"), _lane(s, "CPU"), _lane(s, "H2D")
    for j in range(4):
        assert (
            updates[f"u{j}"][0] >= grads[f"g{j}"][1] and uploads[f"w{j}"][0] >= updates[f"u{j}"][1]
        )
    # Backward ends at 12 s with layer 0, whose gradient, update and upload then run in turn: 2 s
    # exposed.
    assert s.busy("compute") == 12 and s.step == pytest.approx(14) and s.waiting == pytest.approx(2)
    # The old model, max(compute, transfer) + CPU, would have said 12 + 4 = 16 s.


def test_offload_step_half_duplex_serialises_the_two_directions():
    # Two layers, 1 s of compute each way; a gradient and an upload both ready at 4 s must take
    # turns.
    full = overlap.offload_step(2, 1, 1, gradient=1, update=0, upload=1)
    half = overlap.offload_step(2, 1, 1, gradient=1, update=0, upload=1, duplex="half")
    assert full.step == pytest.approx(6) and half.step == pytest.approx(7)
    # On one engine the earlier-ready copy goes first; at a tie, the one issued first (the
    # gradient).
    assert _lane(half, "D2H")["g0"] == (4, 5) and _lane(half, "H2D")["w1"] == (5, 6)


def test_delayed_update_hides_the_cpu_behind_the_next_step():
    # CPU update 4 s per layer (16 s) against 12 s of compute: without delay the CPU starts with the
    # first gradient, at 6.5 s, and the last upload ends at 23 s; with the delayed update the step
    # is max(compute, CPU) + the uploads at the step boundary = 16 + 2 = 18 s.
    eager = overlap.offload_step(4, 1, 2, gradient=0.5, update=4, upload=0.5)
    delayed = overlap.offload_step(4, 1, 2, gradient=0.5, update=4, upload=0.5, delayed=True)
    assert eager.step == pytest.approx(23) and delayed.step == pytest.approx(18)
    # The update that overlaps this step's compute is the previous step's: it starts with the step.
    assert min(start for start, _, _ in delayed.lanes["CPU"]) == pytest.approx(0)
    # When the CPU is quick, delaying buys nothing here: the uploads it moves to the boundary are
    # exposed.
    quick = [
        overlap.offload_step(4, 1, 2, gradient=0.5, update=0.1, upload=0.5, delayed=d).step
        for d in (False, True)
    ]
    assert quick[1] >= quick[0]


def test_offload_step_fetches_parameters_into_two_buffers():
    s = overlap.offload_step(4, 1, 2, gradient=0.5, update=1, fetch=0.5)
    fetches = sorted(s.lanes["H2D"])
    # each layer up for forward and again for backward
    assert len(fetches) == 8
    computes = sorted(s.lanes["compute"])
    # fetch i starts once compute i-2 has freed its buffer
    for i in range(2, 8):
        assert fetches[i][0] >= computes[i - 2][1] - 1e-12
    # first fetch, compute, last gradient and update
    assert s.step == pytest.approx(0.5 + 12 + 0.5 + 1)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(layers=0, forward=1, backward=1), "^layers: "),
        (dict(layers=2, forward=-1, backward=1), "^forward: "),
        (dict(layers=2, forward=1, backward=1, duplex="simplex"), "^duplex: "),
        (dict(layers=2, forward=1, backward=1, fetch=1, delayed=True), "^delayed: "),
    ],
)
def test_offload_step_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        overlap.offload_step(**kwargs)


def test_clipping_makes_the_updates_wait_for_backward_and_the_delayed_update_pays():
    # Global-norm clipping needs every gradient before any update: the CPU's 4 s start at 12.5 s,
    # when the last gradient lands, and the uploads trail them — 12.5 + 4 + 0.5 = 17 s.
    clipped = overlap.offload_step(4, 1, 2, gradient=0.5, update=1, upload=0.5, after_backward=True)
    assert min(start for start, _, _ in clipped.lanes["CPU"]) == pytest.approx(12.5)
    assert clipped.step == pytest.approx(17)
    # The delayed update hides those 4 s behind the next step: 12 + 2 s of uploads.
    assert overlap.offload_step(
        4, 1, 2, gradient=0.5, update=1, upload=0.5, delayed=True
    ).step == pytest.approx(14)


def test_pcie_figures_nominal_beside_achievable():
    from offloadlab import machine

    for (name, (nominal, achievable)), generation in zip(budget.PCIE_X16.items(), (4, 5)):
        assert nominal == pytest.approx(machine.pcie_bandwidth(generation, 16), rel=1e-3), name
        assert 0.7 < achievable / nominal < 0.9


@pytest.mark.parametrize("micro", [1, 4, 16])
def test_micro_batches_multiply_the_gradient_trips_and_leave_parked_state_alone(micro):
    """Updating in place sends a gradient down per micro-batch and the weight up once a step;
    parked state goes up and down once a step whatever the micro-batches (mixed-adam: w = g = 2,
    state 12)."""
    in_place = budget.traffic("optimizer", "mixed-adam", micro)
    parked = budget.traffic("park-and-copy", "mixed-adam", micro)
    assert (in_place.h2d, in_place.d2h) == (2, 2 * micro)
    assert (parked.h2d, parked.d2h) == (12, 12)
    fetched = budget.traffic("parameters", "mixed-adam", micro)
    assert fetched.h2d == 4 * micro  # every forward and every backward fetches the weights


@pytest.mark.parametrize("micro, fewer", [(1, "in place"), (11, "in place"), (12, "parked")])
def test_parking_moves_fewer_bytes_from_twelve_micro_batches_of_mixed_precision(micro, fewer):
    """2 + 2k bytes a parameter in place against 24 parked: equal at k = 11, fewer from 12."""
    choice = budget.verdict("25 GB/s", "1 s", 1e9, "optimizer", micro_batches=micro)
    assert choice.park_or_update() == {
        "micro_batches": micro,
        "in_place_bytes_per_param": 2 + 2 * micro,
        "parked_bytes_per_param": 24,
        "fewer": fewer,
    }


@pytest.mark.parametrize("window", ["50 ms", "250 ms", "559 ms", "561 ms", "2 s"])
def test_the_fraction_offered_is_the_largest_whose_traffic_fits(window):
    """Offloading a share F of the optimizer moves F of its traffic: the fraction the verdict
    offers fits the window, and one hundredth more would not."""
    whole = budget.verdict("25 GB/s", window, 7e9, "optimizer")
    share = whole.offload_fraction
    assert 0 < share <= 1
    assert budget.verdict("25 GB/s", window, share * 7e9, "optimizer").fits
    if share < 1:
        assert not budget.verdict("25 GB/s", window, (share + 0.01) * 7e9, "optimizer").fits
        assert f"offload_fraction={share:g}" in whole.summary()
    else:
        assert whole.fits
    assert budget.verdict("25 GB/s", window, 7e9, "park-and-copy").offload_fraction is None
