"""CPUOffloadAdam offloading a share of the optimizer (``offload_fraction``) or parking it
(``update_on="device"``): torch.optim.AdamW is still the specification, and the link's ledger and
the device memory are held to chapter 4's arithmetic.
"""

import copy

import pytest
import torch
from torch import nn

from offloadlab.bench import traffic_per_step
from offloadlab.offload import CPUOffloadAdam
from offloadlab.offload.device_update import SLOTS, kept_on_device
from tests.test_offload import assert_matches, data, groups, mlp, run

MODES = {
    "F=0": dict(offload_fraction=0.0),
    "F=0.3": dict(offload_fraction=0.3),
    "F=0.7": dict(offload_fraction=0.7),
    "F=1": dict(offload_fraction=1.0),
    "parked": dict(update_on="device"),
    "parked, F=0.5": dict(update_on="device", offload_fraction=0.5),
}


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("micro, declared", [(1, None), (3, None), (3, 3)])
def test_every_mode_follows_adamw(link, mode, micro, declared):
    ref, mine = mlp(unused=True), mlp(unused=True)
    run(ref, torch.optim.AdamW(groups(ref), lr=1e-3), data(8, micro))
    opt = CPUOffloadAdam(
        groups(mine),
        lr=1e-3,
        link=link,
        bucket_bytes=2048,
        accumulation_steps=declared,
        **MODES[mode],
    )
    run(mine, opt, data(8, micro))
    opt.close()
    assert_matches(ref, mine)
    assert torch.equal(mine[2].bias, mlp()[2].bias)  # frozen
    assert torch.equal(mine.spare.weight, mlp(unused=True).spare.weight)  # never had a gradient


def test_nothing_offloaded_is_adamw_bit_for_bit_and_moves_nothing(link):
    """F = 0 is torch's AdamW on the device: the same kernel, so the same bits, and no byte on the
    link."""
    ref, mine = mlp(), mlp()
    run(ref, torch.optim.AdamW(groups(ref), lr=1e-3), data(6, 2))
    opt = CPUOffloadAdam(groups(mine), lr=1e-3, link=link, offload_fraction=0)
    before = link.traffic.snapshot()
    run(mine, opt, data(6, 2))
    after = link.traffic.snapshot()
    assert opt.offload_fraction == 0 and opt.host_bytes() == {}
    opt.close()
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
    assert after["h2d_bytes"] == before["h2d_bytes"] and after["d2h_bytes"] == before["d2h_bytes"]


def test_everything_offloaded_is_the_cpu_optimizer_with_nothing_on_the_device(link):
    opt = CPUOffloadAdam(mlp().parameters(), link=link, offload_fraction=1)
    assert opt.offload_fraction == 1 and opt.device_bytes() == {}
    assert opt.update_on == "cpu"
    opt.close()


def test_the_kept_share_is_the_first_parameters_and_never_more_than_asked():
    """Whole tensors, in the order given (forward's, for model.parameters()), each kept while it
    fits: the kept bytes never exceed (1 − F) of the whole, so device memory stays within it."""
    sizes = [100, 400, 50, 300, 150]
    params = [torch.zeros(n) for n in sizes]
    kept = kept_on_device(params, 0.5)  # room for 500 of 1000
    assert [id(p) in kept for p in params] == [True, True, False, False, False]
    kept = kept_on_device(params, 0.4)  # room for 600: 100 + 400 + 50, then 300 and 150 do not fit
    assert [id(p) in kept for p in params] == [True, True, True, False, False]
    assert kept_on_device(params, 0.0) == {id(p) for p in params}
    assert kept_on_device(params, 1.0) == set()


@pytest.mark.parametrize("mode", ["F=0.3", "parked"])
@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_clipping_uses_the_norm_of_both_shares(link, mode, how):
    ref, mine = mlp(), mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data(8, 1), clip="model")
    opt = CPUOffloadAdam(
        mine.parameters(),
        lr=1e-3,
        link=link,
        **({"max_grad_norm": 0.05} if how == "max_grad_norm" else {}),
        **MODES[mode],
    )
    run(mine, opt, data(8, 1), clip=None if how == "max_grad_norm" else "optimizer")
    opt.close()
    assert_matches(ref, mine)


def test_parked_gradients_stay_in_grad_where_torchs_clipping_finds_them(link):
    """Nothing takes a parked optimizer's gradients off the model: torch's own clip_grad_norm_ works
    on them, as with AdamW."""
    ref, mine = mlp(), mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data(6, 2), clip="model")
    opt = CPUOffloadAdam(mine.parameters(), lr=1e-3, link=link, update_on="device")
    run(mine, opt, data(6, 2), clip="model")
    opt.close()
    assert_matches(ref, mine)


@pytest.mark.parametrize("mode", ["F=0.3", "parked", "parked, F=0.5"])
def test_bf16_weights_follow_fp32_masters_as_mixed_precision_adamw(link, mode):
    model, ref_model = mlp(torch.bfloat16), mlp(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in trainable(ref_model)]
    reference = torch.optim.AdamW(masters, lr=1e-3)
    for micro in data(10, 1, torch.bfloat16):
        x, y = micro[0]
        nn.functional.mse_loss(ref_model(x).float(), y.float()).backward()
        for master, p in zip(masters, trainable(ref_model)):
            master.grad, p.grad = p.grad.float(), None
        reference.step()
        for master, p in zip(masters, trainable(ref_model)):
            p.data.copy_(master.detach())
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link, **MODES[mode])
    run(model, opt, data(10, 1, torch.bfloat16))
    state = opt.state_dict()["state"]
    opt.close()
    ours = [state[i]["master"] for i in sorted(state)]
    for a, b in zip(masters, ours):
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-6)
    for p, master in zip(trainable(model), ours):
        assert torch.equal(p, master.to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["F=0.3", "parked"])
def test_fp16_overflow_skips_the_step_for_both_shares(link, mode):
    model = mlp(torch.float16)
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link, loss_scale=1024.0, **MODES[mode])
    x, y = data(1, 1, torch.float16)[0][0]
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.scale_loss(nn.functional.mse_loss(model(x).float(), y.float()) * 1e30).backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    opt.scale_loss(nn.functional.mse_loss(model(x).float(), y.float())).backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, trainable(model)))
    opt.close()


@pytest.mark.parametrize("save, load", [("F=0.3", "F=1"), ("parked", "F=0.7"), ("F=1", "parked")])
def test_a_state_dict_moves_between_modes_and_through_adamw(link, save, load):
    model = mlp()
    opt = CPUOffloadAdam(groups(model), lr=1e-3, link=link, **MODES[save])
    run(model, opt, data(3, 1))
    saved = opt.state_dict()
    opt.close()
    twin = copy.deepcopy(model)
    plain = torch.optim.AdamW(groups(twin), lr=1e-3)
    plain.load_state_dict(saved)
    opt2 = CPUOffloadAdam(groups(model), lr=1e-3, link=link, **MODES[load])
    opt2.load_state_dict(saved)
    assert opt2.state_dict()["state"].keys() == saved["state"].keys()
    run(model, opt2, data(3, 1, seed=5))
    run(twin, plain, data(3, 1, seed=5))
    opt2.close()
    assert_matches(twin, model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("micro", [1, 4])
def test_parking_moves_the_state_once_a_step_whatever_the_micro_batches(link, dtype, micro):
    """Chapter 6's rule box, on the link's own ledger: a parked step brings master and moments up
    and takes them back down once (12 bytes a parameter each way for bf16, whose fp32 master
    moves; 8 for fp32), no gradient crosses, nothing syncs inside backward; device memory is three
    buckets' state; pinned memory is the parked state alone."""
    model = mlp(dtype)
    params = sum(p.numel() for p in trainable(model))
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-3, link=link, bucket_bytes=512, update_on="device"
    )
    assert len(opt.buckets) == 0  # nothing is updated on the CPU
    run(model, opt, data(1, micro, dtype))
    before, steps = link.traffic.snapshot(), 3
    run(model, opt, data(steps, micro, dtype, seed=2))
    traffic = traffic_per_step(before, link.traffic.snapshot(), steps, params, link)
    state = 12 if dtype == torch.bfloat16 else 8
    assert traffic["h2d_bytes_per_param"] == state
    assert traffic["d2h_bytes_per_param"] == state
    assert traffic["host_syncs_in_backward"] == 0
    assert opt.host_bytes() == {"parked_state": state * params}
    largest = max(b.numel for b in opt._engine.on_device[0].buckets)
    assert len(opt._engine.on_device[0].buckets) > SLOTS
    assert opt.device_bytes() == {"device_slots": SLOTS * state * largest}
    opt.close()


@pytest.mark.parametrize("micro", [1, 3])
def test_only_the_offloaded_share_crosses_the_link(link, micro):
    """With F < 1 the kept share's gradients stay on the device: per step the link carries the
    offloaded share's gradients down (one per micro-batch) and its weights up, and the device holds
    the kept share's master and moments (12 bytes a bf16 parameter)."""
    model = mlp(torch.bfloat16)
    every = trainable(model)
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-3, link=link, bucket_bytes=4096, offload_fraction=0.3
    )
    kept = [p for p in every if id(p) in {id(q) for q in opt._engine.on_device[0].params}]
    offloaded = sum(p.numel() for p in every) - sum(p.numel() for p in kept)
    assert kept and offloaded
    assert opt.device_bytes() == {"device_state": 12 * sum(p.numel() for p in kept)}
    assert opt.offload_fraction == offloaded / sum(p.numel() for p in every) >= 0.3
    run(model, opt, data(1, micro, torch.bfloat16))
    before, steps = link.traffic.snapshot(), 3
    run(model, opt, data(steps, micro, torch.bfloat16, seed=2))
    after = link.traffic.snapshot()
    buckets = len(opt.buckets)
    assert (after["h2d_bytes"] - before["h2d_bytes"]) / steps == 2 * offloaded
    assert (after["d2h_bytes"] - before["d2h_bytes"]) / steps == micro * 2 * offloaded + buckets
    assert after["syncs_in_backward"] == before["syncs_in_backward"]
    opt.close()


@pytest.mark.parametrize("mode", ["F=0.3", "parked"])
def test_weights_set_by_hand_on_the_device_share_are_taken_as_adamw_takes_them(link, mode):
    model = mlp(torch.bfloat16)
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link, **MODES[mode])
    run(model, opt, data(2, 1, torch.bfloat16))
    with torch.no_grad():
        model[0].weight.data.fill_(0.5)  # the first parameter: kept on the device with F = 0.3
    run(model, opt, data(1, 1, torch.bfloat16, seed=3))
    state = opt.state_dict()["state"]
    opt.close()
    # AdamW with masters would step from 0.5: the master took the weights set by hand
    assert (state[0]["master"] - 0.5).abs().max() < 0.01


def test_bad_arguments_are_refused_in_one_line(link):
    params = list(mlp().parameters())
    cases = [
        (dict(offload_fraction=1.5), "^offload_fraction: expected a number from 0 to 1; got 1.5"),
        (dict(offload_fraction="half"), "^offload_fraction: expected a number"),
        (dict(update_on="gpu"), "^update_on: expected 'cpu' or 'device'; got 'gpu'"),
        (dict(update_on="device", delayed_update=True), "^delayed_update: expected False"),
        (dict(offload_fraction=0.5, delayed_update=True), "^delayed_update: expected False"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            CPUOffloadAdam(params, link=link, **kwargs)


def test_a_parked_optimizer_takes_a_new_group_into_its_parked_state(link):
    ref, mine = mlp(unused=True), mlp(unused=True)
    for model in (ref, mine):
        model.spare.requires_grad_(False)
    plain = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt = CPUOffloadAdam(
        [p for p in mine.parameters() if p.requires_grad], lr=1e-3, link=link, update_on="device"
    )
    for model, optimizer in ((ref, plain), (mine, opt)):
        run(model, optimizer, data(2, 1))
        model.spare.requires_grad_(True)
        optimizer.add_param_group({"params": list(model.spare.parameters())})
        run(model, optimizer, data(2, 1, seed=4))
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
        optimizer.zero_grad()
        model.spare(model[:5](x)).sum().backward()
        optimizer.step()
    assert opt.host_bytes()["parked_state"] == 8 * sum(p.numel() for p in trainable(mine))
    opt.close()
    assert_matches(ref, mine)


@pytest.mark.parametrize("bucket_bytes, slots", [(1 << 20, 1), (20000, 2), (512, SLOTS)])
def test_parked_state_takes_no_more_slots_than_it_has_buckets(link, bucket_bytes, slots):
    """One bucket needs one slot: three would hold three copies of the whole state on the device,
    more than keeping it there."""
    ref, model = mlp(), mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data(3, 1))
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-3, link=link, bucket_bytes=bucket_bytes, update_on="device"
    )
    part = opt._engine.on_device[0]
    assert len(part.slots) == slots <= len(part.buckets)
    assert opt.device_bytes()["device_slots"] == slots * 8 * max(b.numel for b in part.buckets)
    run(model, opt, data(3, 1))
    opt.close()
    assert_matches(ref, model)


@pytest.mark.parametrize(
    "mode, micro", [("F=0.3", 1), ("F=0.7", 3), ("parked", 1), ("parked, F=0.5", 3)]
)
def test_the_benchs_prediction_is_the_ledger(link, mode, micro):
    """bench offload prints predicted beside measured: the arithmetic it predicts with is what the
    link's ledger and the optimizer's device memory show (to the byte a bucket that says whether
    weights were changed by hand)."""
    from offloadlab.bench import _predicted_share

    model = mlp(torch.bfloat16)
    opt = CPUOffloadAdam(model.parameters(), link=link, bucket_bytes=1024, **MODES[mode])
    run(model, opt, data(1, micro, torch.bfloat16))
    before, steps = link.traffic.snapshot(), 2
    run(model, opt, data(steps, micro, torch.bfloat16, seed=2))
    after = link.traffic.snapshot()
    predicted = _predicted_share(opt, micro)
    buckets = len(opt.buckets)
    assert (after["h2d_bytes"] - before["h2d_bytes"]) / steps == predicted["h2d_bytes"]
    assert (after["d2h_bytes"] - before["d2h_bytes"]) / steps == predicted["d2h_bytes"] + buckets
    assert sum(opt.device_bytes().values()) == predicted["device_bytes"]
    opt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["F=0.3", "parked", "parked, F=0.5"])
def test_every_mode_follows_adamw_on_the_gpu(mode):
    """On a GPU the device's share runs torch's fused AdamW on the real streams."""
    ref, mine = mlp().cuda(), mlp().cuda()
    to_gpu = [[(x.cuda(), y.cuda()) for x, y in micro] for micro in data(12, 2)]
    run(ref, torch.optim.AdamW(groups(ref), lr=1e-3), to_gpu)
    opt = CPUOffloadAdam(groups(mine), lr=1e-3, bucket_bytes=1024, **MODES[mode])
    run(mine, opt, to_gpu)
    opt.close()
    assert_matches(ref, mine)
