"""CPUOffloadAdam on FSDP2-sharded parameters inside this process (a one-rank gloo group): the
stand-ins, the state dict's DTensors and the refusals. tests/test_fsdp_offload.py trains on two
and four processes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from offloadlab.offload import CPUOffloadAdam
from offloadlab.offload.sharded import LocalShards

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor  # noqa: E402


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def sharded_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def plain_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))


def test_one_rank_of_fsdp2_trains_as_adamw_and_saves_dtensors(one_rank):
    model, reference = sharded_mlp(), plain_mlp()
    opt = CPUOffloadAdam(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    opt.synchronize()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.full_tensor(), theirs.detach(), rtol=1e-5, atol=1e-6)
    # state by the sharded parameter, DTensors placed like it; steps are plain numbers
    first = next(model.parameters())
    assert set(opt.state[first]) >= {"step", "exp_avg", "exp_avg_sq"}
    saved = opt.state_dict()
    entry = saved["state"][0]
    assert isinstance(entry["exp_avg"], DTensor) and entry["exp_avg"].placements == first.placements
    assert not isinstance(entry["step"], DTensor)
    assert "threads of 1 ranks on this host" in repr(opt)
    # a state dict placed otherwise is refused by name, and changes nothing
    wrong = {**saved, "state": {**saved["state"], 0: dict(entry)}}
    wrong["state"][0]["exp_avg"] = distribute_tensor(
        entry["exp_avg"].full_tensor(), one_rank, [Replicate()]
    )
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\]: expected a tensor sharded"):
        opt.load_state_dict(wrong)
    opt.load_state_dict(saved)  # its own comes back
    opt.close()


def test_sharded_parameters_other_than_fsdp2s_are_refused_in_words(one_rank):
    """A DTensor replicated (not FSDP2's Shard(0) on one mesh dimension) is named and refused."""
    weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), one_rank, [Replicate()]))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*Shard\(0\)"):
        LocalShards([{"params": [weight]}])


def test_a_group_added_later_is_refused_in_words_for_sharded_parameters(one_rank):
    model = sharded_mlp()
    opt = CPUOffloadAdam(list(model[0].parameters()), lr=1e-2)
    with pytest.raises(ValueError, match="^add_param_group: .*sharded"):
        opt.add_param_group({"params": list(model[2].parameters())})
    assert len(opt.param_groups) == 1
    opt.close()


def train(model, opt, steps=3, micro=1, before_step=None, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        for _ in range(micro):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)
            (nn.functional.mse_loss(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad()
    if isinstance(opt, CPUOffloadAdam):
        opt.synchronize()


def full(model):
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def test_a_second_optimizer_takes_the_shards_over_and_a_dropped_one_lets_go(one_rank):
    """Hooks were left on the sharded parameters: a second CPUOffloadAdam failed inside backward
    (the first took .grad away), and after the first was garbage-collected torch's AdamW saw no
    gradient at all."""
    model, reference = sharded_mlp(), plain_mlp()
    first = CPUOffloadAdam(model.parameters(), lr=1e-2)
    train(model, first, steps=1)
    with pytest.warns(UserWarning, match="took their parameters over"):
        second = CPUOffloadAdam(model.parameters(), lr=1e-2)
    assert first.closed
    # the second's state starts afresh: AdamW's too, after one step of its own
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, ref_opt, steps=1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(model, second, steps=2, seed=2)
    train(reference, ref_opt, steps=2, seed=2)
    for mine, theirs in zip(full(model), full(reference)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    del second
    import gc

    gc.collect()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [w.clone() for w in full(model)]
    train(model, adamw, steps=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, full(model)))


def test_a_shard_unfrozen_later_gets_every_micro_batch(one_rank):
    """A parameter frozen when the optimizer was made waits in its stand-in's .grad until step()
    takes it over; the second micro-batch replaced the first there instead of adding to it."""
    model, reference = sharded_mlp(), plain_mlp()
    for m in (model, reference):
        m[2].weight.requires_grad_(False)
    opt = CPUOffloadAdam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def unfreeze(model):
        return lambda step: model[2].weight.requires_grad_(True) if step == 1 else None

    train(model, opt, steps=3, micro=2, before_step=unfreeze(model))
    train(reference, ref_opt, steps=3, micro=2, before_step=unfreeze(reference))
    for mine, theirs in zip(full(model), full(reference)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    opt.close()


@pytest.mark.parametrize("option", [dict(offload_fraction=0.5), dict(update_on="device")])
def test_keeping_or_parking_part_of_a_shard_is_refused_in_words(one_rank, option):
    """Both kept the stand-ins' gradients in .grad, where FSDP2's next micro-batch replaced them:
    0.058 from AdamW after two micro-batches, silently."""
    with pytest.raises(ValueError, match="^offload_fraction, update_on: over FSDP2's sharded"):
        CPUOffloadAdam(sharded_mlp().parameters(), lr=1e-2, **option)


def test_the_state_dicts_dtensors_stay_where_the_state_is(one_rank):
    """Placed like the parameter over the host tensor itself: DTensor.from_local would copy a host
    tensor to a GPU mesh's device (12 bytes per shard element on the GPU at every save)."""
    from offloadlab import _torch_compat

    model = sharded_mlp()
    like = next(model.parameters())
    host = torch.zeros(like.to_local().shape)
    placed = _torch_compat.dtensor_where_it_is(host, like)
    assert placed.placements == like.placements and placed.shape == like.shape
    assert placed.to_local().data_ptr() == host.data_ptr()
