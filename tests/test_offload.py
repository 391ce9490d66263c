"""CPUOffloadAdam on the emulated link (every machine) and on a GPU (where there is one)."""

import copy

import pytest
import torch
from torch import nn

from offloadlab.link import EmulatedLink
from offloadlab.models import GPTConfig, TinyGPT, batches, markov_corpus, train
from offloadlab.offload import CPUOffloadAdam


@pytest.fixture
def link():
    with EmulatedLink(bandwidth="8 GB/s", latency=0) as emulated:
        yield emulated


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    model[2].bias.requires_grad_(False)  # a frozen parameter
    return model.to(dtype)


def groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 3e-3, "weight_decay": 0.0}, {"params": []}]


def data(steps, micro, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(8, 16, generator=generator).to(dtype), torch.randn(8, 4, generator=generator).to(dtype))
             for _ in range(micro)] for _ in range(steps)]


def run(model, optimizer, batches_, clip=None, scale=lambda loss: loss):
    for micro in batches_:
        optimizer.zero_grad()
        for x, y in micro:
            loss = nn.functional.mse_loss(model(x).float(), y.float()) / len(micro)
            scale(loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        optimizer.step()


def test_fp32_matches_adamw_with_groups_frozen_param_and_accumulation(link):
    ref, mine = mlp(), mlp()
    run(ref, torch.optim.AdamW(groups(ref), lr=1e-3), data(50, 2))
    opt = CPUOffloadAdam(groups(mine), lr=1e-3, link=link, accumulation_steps=2)
    run(mine, opt, data(50, 2))
    opt.close()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert torch.equal(mine[2].bias, mlp()[2].bias)  # the frozen bias never moved


def test_bf16_master_weights_match_reference_mixed_precision(link):
    model, ref_model = mlp(torch.bfloat16), mlp(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in ref_model.parameters() if p.requires_grad]
    reference = torch.optim.AdamW(masters, lr=1e-3)
    trainable = [p for p in ref_model.parameters() if p.requires_grad]
    for micro in data(20, 1, torch.bfloat16):
        x, y = micro[0]
        nn.functional.mse_loss(ref_model(x).float(), y.float()).backward()
        for master, p in zip(masters, trainable):
            master.grad = p.grad.float()
            p.grad = None
        reference.step()
        for master, p in zip(masters, trainable):
            p.data.copy_(master.detach())
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link)
    run(model, opt, data(20, 1, torch.bfloat16))
    state = opt.state_dict()["state"]
    opt.close()
    ours = [state[i]["master"] for i in sorted(state)]
    for a, b in zip(masters, ours):
        torch.testing.assert_close(b, a.detach(), rtol=1e-5, atol=1e-6)
    for p, master in zip((p for p in model.parameters() if p.requires_grad), ours):
        assert p.dtype == torch.bfloat16 and torch.equal(p, master.to(torch.bfloat16))


def test_clipping_matches_clip_grad_norm(link):
    ref, mine = mlp(), mlp()
    run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data(10, 1), clip=0.05)
    opt = CPUOffloadAdam(mine.parameters(), lr=1e-3, link=link, max_grad_norm=0.05)
    run(mine, opt, data(10, 1))
    opt.close()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trip_is_bit_exact(link, tmp_path):
    model = mlp()
    opt = CPUOffloadAdam(groups(model), lr=1e-3, link=link)
    run(model, opt, data(5, 1))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    run(model, opt, data(5, 1, seed=7))
    opt.close()

    restored = mlp()
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    restored.load_state_dict(checkpoint["model"])
    opt2 = CPUOffloadAdam(groups(restored), lr=1e-3, link=link)
    opt2.load_state_dict(checkpoint["optimizer"])
    run(restored, opt2, data(5, 1, seed=7))
    opt2.close()
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_state_dict_loads_into_plain_adamw_and_back(link):
    model = mlp()
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link)
    run(model, opt, data(3, 1))
    saved = opt.state_dict()
    opt.close()
    twin = copy.deepcopy(model)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    plain.load_state_dict(saved)
    run(twin, plain, data(3, 1, seed=5))
    back = mlp()
    back.load_state_dict(model.state_dict())
    opt2 = CPUOffloadAdam(back.parameters(), lr=1e-3, link=link)
    opt2.load_state_dict(plain.state_dict())  # an AdamW state dict: masters from the weights
    run(back, opt2, data(3, 1, seed=9))
    opt2.close()
    assert all(torch.isfinite(p).all() for p in back.parameters())


def test_repeated_steps_do_not_grow_memory(link):
    model = mlp()
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link)
    run(model, opt, data(2, 1))
    before = (opt.host_bytes(), len(link._pinned))
    run(model, opt, data(20, 1))
    assert (opt.host_bytes(), len(link._pinned)) == before
    assert all(p.grad is None for p in model.parameters())  # device gradients released
    opt.close()


def test_delayed_update_applies_one_step_late(link):
    eager_model, delayed_model = mlp(), mlp()
    eager = CPUOffloadAdam(eager_model.parameters(), lr=1e-3, link=link)
    delayed = CPUOffloadAdam(delayed_model.parameters(), lr=1e-3, link=link, delayed_update=True)
    start = [p.detach().clone() for p in delayed_model.parameters()]
    batch = data(2, 1)
    run(eager_model, eager, batch[:1])
    run(delayed_model, delayed, batch[:1])
    assert all(torch.equal(p, s) for p, s in zip(delayed_model.parameters(), start))  # not applied yet
    run(delayed_model, delayed, batch[1:])  # step 2 applies update 1 (from the same first gradient)
    assert all(torch.equal(a, b) for a, b in zip(delayed_model.parameters(), eager_model.parameters()))
    delayed.close()
    eager.close()


def test_fp16_skips_a_step_on_overflow(link):
    model = mlp(torch.float16)
    opt = CPUOffloadAdam(model.parameters(), lr=1e-3, link=link)
    assert opt.loss_scale == 2.0**16
    run(model, opt, data(2, 1, torch.float16), scale=opt.scale_loss)
    scale, before = opt.loss_scale, [p.detach().clone() for p in model.parameters()]
    x, y = data(1, 1, torch.float16)[0][0]
    (opt.scale_loss(nn.functional.mse_loss(model(x).float(), y.float())) * float("inf")).backward()
    opt.step()
    assert opt.skipped_steps >= 1 and opt.loss_scale == scale / 2
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    run(model, opt, data(2, 1, torch.float16), scale=opt.scale_loss)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.close()


def test_trains_a_tiny_gpt(link):
    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=64, seq=32)
    model = TinyGPT(config).to(torch.bfloat16)
    opt = CPUOffloadAdam(model.parameters(), lr=3e-3, link=link)
    losses = train(model, opt, batches(markov_corpus(64, 5000), 8, 32), 30, "cpu")
    opt.close()
    assert losses[-1] < losses[0] - 0.5


def test_bad_arguments(link):
    model = mlp()
    with pytest.raises(ValueError, match="^lr: "):
        CPUOffloadAdam(model.parameters(), lr=-1, link=link)
    with pytest.raises(ValueError, match="^betas: "):
        CPUOffloadAdam(model.parameters(), betas=(0.9, 1.2), link=link)
    with pytest.raises(ValueError, match="^weight_decay: "):
        CPUOffloadAdam([{"params": list(model.parameters()), "weight_decay": -1}], link=link)
    with pytest.raises(ValueError, match="^max_grad_norm: "):
        CPUOffloadAdam(model.parameters(), max_grad_norm=0, link=link)
    with pytest.raises(ValueError, match="^accumulation_steps: "):
        CPUOffloadAdam(model.parameters(), accumulation_steps=0, link=link)
    with pytest.raises(ValueError, match="^params: expected one dtype"):
        CPUOffloadAdam([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float16))], link=link)
    with pytest.raises(ValueError, match="^params: expected one dtype"):
        CPUOffloadAdam([nn.Parameter(torch.zeros(2, dtype=torch.float64))], link=link)
    with pytest.raises(ValueError, match="^loss_scale: "):
        CPUOffloadAdam([nn.Parameter(torch.zeros(2, dtype=torch.float16))], loss_scale=0, link=link)
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = CPUOffloadAdam(embedding.parameters(), link=link)
    with pytest.raises(ValueError, match="sparse gradients"):
        embedding(torch.tensor([1, 2])).sum().backward()
    opt.close()
    twice = mlp()
    opt = CPUOffloadAdam(twice.parameters(), link=link)
    x, y = data(1, 1)[0][0]
    nn.functional.mse_loss(twice(x), y).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps=1"):
        nn.functional.mse_loss(twice(x), y).backward()
    opt.step()
    opt.close()


@pytest.mark.gpu
def test_matches_adamw_on_the_gpu():
    ref, mine = mlp().cuda(), mlp().cuda()
    to_gpu = [[(x.cuda(), y.cuda()) for x, y in micro] for micro in data(20, 2)]
    run(ref, torch.optim.AdamW(groups(ref), lr=1e-3), to_gpu)
    opt = CPUOffloadAdam(groups(mine), lr=1e-3, accumulation_steps=2)
    run(mine, opt, to_gpu)
    opt.close()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
