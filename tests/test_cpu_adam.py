"""The fused CPU AdamW step against torch.optim.AdamW, on the compiled kernel and the torch fallback."""

import pytest
import torch

from offloadlab import cpu_adam


@pytest.fixture(params=["compiled", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(cpu_adam, "_library", lambda: (None, "torch fallback (forced by the test)"))
    elif cpu_adam._library()[0] is None:
        pytest.skip(f"no compiled kernel here: {cpu_adam.backend()}")
    return request.param


def reference_run(n, steps, lr=1e-2, wd=0.1, seed=0):
    torch.manual_seed(seed)
    start = torch.randn(n)
    ref = start.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=lr, weight_decay=wd)
    generator = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(n, generator=generator) for _ in range(steps)]
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    return start, grads, ref.detach(), opt.state[ref]


def test_matches_torch_adamw_within_float32_rounding(path):
    start, grads, expected, state = reference_run(10_000, 50)
    master, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, g in enumerate(grads, 1):
        cpu_adam.adamw_step(master, m, v, g, step=step, lr=1e-2, weight_decay=0.1)
    if path == "compiled":  # the kernel rounds the moments exactly as torch does
        assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
    torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_in_and_weights_out(path, low):
    torch.manual_seed(0)
    n = 4099  # not a multiple of any vector width
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad = torch.randn(n).to(low)
    expected = master.clone()
    em, ev = m.clone(), v.clone()
    cpu_adam.adamw_step(expected, em, ev, grad.float(), step=1, lr=1e-3)  # fp32 gradient, same values
    out = torch.empty(n, dtype=low)
    cpu_adam.adamw_step(master, m, v, grad, out, step=1, lr=1e-3)
    assert torch.equal(master, expected) and torch.equal(m, em)
    assert torch.equal(out, master.to(low))  # round-to-nearest-even, as torch casts


def test_grad_scale_and_sum_of_squares(path):
    g = torch.tensor([3.0, 4.0]).bfloat16()
    assert cpu_adam.grad_sum_of_squares(g) == 25.0
    assert cpu_adam.grad_sum_of_squares(torch.tensor([1.0, float("inf")])) == float("inf")
    a, b = torch.ones(2), torch.ones(2)
    ma, va, mb, vb = torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2)
    cpu_adam.adamw_step(a, ma, va, torch.tensor([2.0, 4.0]), step=1, lr=0.1, grad_scale=0.5)
    cpu_adam.adamw_step(b, mb, vb, torch.tensor([1.0, 2.0]), step=1, lr=0.1)
    assert torch.equal(a, b) and torch.equal(ma, mb)


def test_bad_arguments():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="^exp_avg: expected 4 elements"):
        cpu_adam.adamw_step(x, torch.zeros(3), torch.zeros(4), torch.zeros(4), step=1, lr=0.1)
    with pytest.raises(ValueError, match="^master: expected dtype torch.float32"):
        cpu_adam.adamw_step(x.half(), x, x, x, step=1, lr=0.1)
    with pytest.raises(ValueError, match="^grad: expected dtype"):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), torch.zeros(4, dtype=torch.int32), step=1, lr=0.1)
    with pytest.raises(ValueError, match="^step: "):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), step=0, lr=0.1)
    with pytest.raises(ValueError, match="^betas: "):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), x.clone(), step=1, lr=0.1, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="^grad: expected a contiguous host"):
        cpu_adam.adamw_step(x, x.clone(), x.clone(), torch.zeros(8)[::2], step=1, lr=0.1)


def test_bytes_per_param():
    assert cpu_adam.bytes_per_param() == 28
    assert cpu_adam.bytes_per_param(torch.float32, None) == 28
    assert cpu_adam.bytes_per_param(torch.float32, torch.bfloat16) == 30
    assert "kernel" in cpu_adam.backend() or "fallback" in cpu_adam.backend()
