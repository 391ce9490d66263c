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
