"""A parameter without a gradient is not touched, as torch.optim.AdamW does not touch it.

A bucket's weights travel up to the device whole, so a parameter that got no gradient this step
goes up too, from the optimizer's outgoing copy: that copy must hold its current weights, never
uninitialised memory (on a GPU, garbage; on the emulated link, poison). Every case in which a
trainable parameter has no gradient is run in fp32, bf16 and fp16 for three steps against AdamW
(on fp32 master weights for the 16-bit models, as mixed-precision training keeps them):

- never used (an unused head, an unrouted expert);
- used on some steps only (LayerDrop, a branch taken now and then);
- added by ``add_param_group`` after training began;
- inside a streamed block (StreamedModel), whether the block is skipped or only a part of it is
  unused;
- ``zero_grad(set_to_none=False)``: a parameter that had a gradient keeps a zero one, and AdamW
  steps it (decay and momentum move it), while one that never had a gradient still has none.

On every step, each parameter that AdamW left alone is bit-identical before and after our step.
"""

import pytest
import torch
from torch import nn

from offloadlab.offload import CPUOffloadAdam
from offloadlab.streaming import StreamedModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = 1024.0  # fp16: a fixed power of two, so scaling and unscaling are exact on both sides
# decay moves every parameter that is stepped, even with a zero gradient
HYPER = dict(lr=1e-2, weight_decay=0.1)


class MixedAdamW:
    """torch.optim.AdamW, on fp32 master copies of 16-bit parameters (on the parameters themselves
    for fp32): a parameter whose ``.grad`` is None is skipped, as AdamW skips it."""

    def __init__(self, params, dtype, **hyper):
        self.dtype = dtype
        self.pairs = []
        self.adamw = torch.optim.AdamW(self._masters(params), **hyper)

    def _masters(self, params):
        params = [p for p in params if p.requires_grad]
        if self.dtype == torch.float32:
            self.pairs += [(p, p) for p in params]
            return params
        masters = [p.detach().float().requires_grad_() for p in params]
        self.pairs += list(zip(params, masters))
        return masters

    def add_param_group(self, group):
        self.adamw.add_param_group({**group, "params": self._masters(group["params"])})

    def zero_grad(self, set_to_none=True):
        for p, master in self.pairs:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        if self.dtype != torch.float32:
            self.adamw.zero_grad(set_to_none)

    def scale_loss(self, loss):
        return loss * LOSS_SCALE if self.dtype == torch.float16 else loss

    @torch.no_grad()
    def step(self):
        if self.dtype != torch.float32:
            for p, master in self.pairs:
                if p.grad is None:
                    master.grad = None
                else:
                    grad = p.grad.float()
                    master.grad = grad / LOSS_SCALE if self.dtype == torch.float16 else grad
        self.adamw.step()
        if self.dtype != torch.float32:
            for p, master in self.pairs:
                p.copy_(master)


def offloaded(params, dtype, link, **kwargs):
    scale = {"loss_scale": LOSS_SCALE} if dtype == torch.float16 else {}
    return CPUOffloadAdam(params, link=link, bucket_bytes=1 << 20, **HYPER, **scale, **kwargs)


class Net(nn.Module):
    """Two layers always used, one on some steps only, one never."""

    SOMETIMES = (0, 2)  # the steps on which `sometimes` is used

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.sometimes, self.second = (
            nn.Linear(8, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
        )
        self.never = nn.Linear(16, 16)
        self.to(dtype)

    def forward(self, x, step):
        h = torch.tanh(self.first(x))
        if step in self.SOMETIMES:
            h = h + self.sometimes(h)
        return self.second(h)


def inputs(step, dtype, features=8):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, features, generator=generator).to(dtype)


def train(model, optimizer, forward, steps=3, set_to_none=True, after_step=None, untouched=None):
    """Train ``steps`` steps. Without ``untouched`` (the reference, AdamW): returns, per step, the
    indices of the parameters AdamW leaves alone (``.grad`` None after backward). With it (ours):
    asserts that each of those parameters came out of its step bit-identical."""
    params = list(model.parameters())
    skipped = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = forward(model, step).float().pow(2).mean()
        optimizer.scale_loss(loss).backward()
        if untouched is None:
            skipped.append([i for i, p in enumerate(params) if p.requires_grad and p.grad is None])
            optimizer.step()
        else:
            before = {i: params[i].detach().clone() for i in untouched[step]}
            optimizer.step()
            for i, value in before.items():
                assert torch.equal(params[i].detach(), value), (
                    f"step {step}: parameter {i} was touched"
                )
        if after_step is not None:
            after_step(step, optimizer)
    return skipped


def reference_and_ours(make_model, dtype, link, **run):
    """The same training under AdamW (the reference) and under CPUOffloadAdam, each parameter
    that AdamW left alone on a step checked bit-identical through our step: (ref model, ours,
    checked)."""
    ref, mine = make_model(dtype), make_model(dtype)
    reference = MixedAdamW(ref.parameters(), dtype, **HYPER)
    ours = offloaded(mine.parameters(), dtype, link)
    skipped = train(ref, reference, **run)
    train(mine, ours, untouched=skipped, **run)
    ours.close()
    return ref, mine, sum(map(len, skipped))


def assert_like_adamw(ref, mine):
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.isfinite(b).all(), f"{name} holds non-finite values"
        torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_never_used_and_sometimes_used_parameters(link, dtype):
    ref, mine, checked = reference_and_ours(
        Net, dtype, link, forward=lambda m, step: m(inputs(step, dtype), step)
    )
    assert checked == 3 * 2 + 2  # `never` on every step, `sometimes` on step 1
    assert_like_adamw(ref, mine)
    fresh = Net(dtype)
    assert all(torch.equal(a, b) for a, b in zip(mine.never.parameters(), fresh.never.parameters()))
    # stepped on steps 0 and 2
    assert not torch.equal(mine.sometimes.weight, fresh.sometimes.weight)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_bf16_sequential_with_an_unused_linear_keeps_it_bit_exact(link, dtype):
    """The finding as reported: a Sequential plus a Linear it never calls."""

    def make(dtype):
        torch.manual_seed(0)
        return nn.ModuleDict(
            {
                "body": nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
                "unused": nn.Linear(8, 8),
            }
        ).to(dtype)

    ref, mine, checked = reference_and_ours(
        make, dtype, link, forward=lambda m, step: m["body"](inputs(step, dtype))
    )
    assert checked == 3 * 2
    assert_like_adamw(ref, mine)
    assert all(
        torch.equal(a, b)
        for a, b in zip(mine["unused"].parameters(), make(dtype)["unused"].parameters())
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_parameters_added_by_add_param_group(link, dtype):
    """The layer used on some steps and the unused one join after the first step."""

    def make(dtype):
        return Net(dtype)

    def split(model):
        later = [*model.sometimes.parameters(), *model.never.parameters()]
        return [p for p in model.parameters() if all(p is not q for q in later)], later

    ref, mine = make(dtype), make(dtype)
    (ref_first, ref_later), (my_first, my_later) = split(ref), split(mine)
    reference = MixedAdamW(ref_first, dtype, **HYPER)
    ours = offloaded(my_first, dtype, link)

    def add_later(later):
        def hook(step, optimizer):
            if step == 0:
                optimizer.add_param_group({"params": later, "lr": 2e-2})

        return hook

    forward = lambda m, step: m(inputs(step, dtype), step)  # noqa: E731
    skipped = train(ref, reference, forward, after_step=add_later(ref_later))
    train(mine, ours, forward, after_step=add_later(my_later), untouched=skipped)
    ours.close()
    assert sum(map(len, skipped)) == 3 * 2 + 2  # `never` on every step, `sometimes` on step 1
    assert_like_adamw(ref, mine)
    assert all(
        torch.equal(a, b) for a, b in zip(mine.never.parameters(), Net(dtype).never.parameters())
    )


class StreamedNet(nn.Module):
    """Blocks to stream, each with a part it never uses; block 1 is skipped on step 1
    (LayerDrop)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.used(x))

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(self.Block() for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.to(dtype)

    def forward(self, x, step):
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if not (step == 1 and i == 1):
                h = block(h)
        return self.head(h)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_streamed_blocks_skipped_or_partly_unused(link, dtype):
    ref, mine = StreamedNet(dtype), StreamedNet(dtype)
    StreamedModel(mine, link)
    reference = MixedAdamW(ref.parameters(), dtype, **HYPER)
    ours = offloaded(mine.parameters(), dtype, link)
    forward = lambda m, step: m(inputs(step, dtype), step)  # noqa: E731
    skipped = train(ref, reference, forward)
    train(mine, ours, forward, untouched=skipped)
    ours.close()
    # every spare on every step, and the skipped block's `used` once
    assert sum(map(len, skipped)) == 3 * 6 + 2
    assert_like_adamw(ref, mine)
    fresh = StreamedNet(dtype)
    for block, new in zip(mine.blocks, fresh.blocks):
        assert all(
            torch.equal(a, b) for a, b in zip(block.spare.parameters(), new.spare.parameters())
        )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_zero_grad_keeping_zeros_steps_what_had_a_gradient_and_only_that(link, dtype):
    """set_to_none=False: `sometimes` keeps a zero gradient on step 1 and AdamW steps it; `never`
    never had one and stays untouched."""
    ref, mine, checked = reference_and_ours(
        Net, dtype, link, set_to_none=False, forward=lambda m, step: m(inputs(step, dtype), step)
    )
    # only `never`: `sometimes` had a gradient on step 0, so AdamW steps it on step 1
    assert checked == 3 * 2
    assert_like_adamw(ref, mine)
    assert all(
        torch.equal(a, b) for a, b in zip(mine.never.parameters(), Net(dtype).never.parameters())
    )


@pytest.mark.parametrize(
    "how", ["optimizer.zero_grad(False), then (True)", "model.zero_grad(set_to_none=True)"]
)
def test_which_zero_grad_was_called_last_decides_like_adamw(link, how):
    """AdamW steps a parameter whose .grad was zeroed in place and skips one whose .grad is None,
    whichever call made it so last. (model.zero_grad(set_to_none=False) cannot reach gradients that
    have left the model, and offloadlab does not patch torch to make it: the optimizer's docstring
    says to call optimizer.zero_grad, and tests/test_offload.py checks what each call reaches.)"""
    dtype = torch.bfloat16

    def clear(model, optimizer):
        if how.startswith("optimizer"):
            optimizer.zero_grad(set_to_none=False)
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=how.endswith("True)"))

    ref, mine = Net(dtype), Net(dtype)
    reference, ours = (
        MixedAdamW(ref.parameters(), dtype, **HYPER),
        offloaded(mine.parameters(), dtype, link),
    )
    for model, optimizer in ((ref, reference), (mine, ours)):
        for step in range(3):
            clear(model, optimizer)
            model(inputs(step, dtype), step).float().pow(2).mean().backward()
            optimizer.step()
    ours.close()
    assert_like_adamw(ref, mine)
