"""Under torch.compile (CPU inductor): CPUOffloadAdam trains a compiled model as AdamW does
(issue 35, item 6)."""

import pytest
import torch
from torch import nn

from offloadlab.offload import CPUOffloadAdam
from tests.test_offload import assert_matches, data, mlp


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graph or guard is carried over from another test."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def train(model, optimizer, steps):
    for micro in steps:
        optimizer.zero_grad()
        for x, y in micro:
            (nn.functional.mse_loss(model(x), y) / len(micro)).backward()
        optimizer.step()


def adamw_one_step_late(model, steps, lr):
    """AdamW whose updates reach the model one step late (a delayed update): each step's
    gradients are taken at weights one update behind AdamW's own."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().clone().requires_grad_() for p in trainable]
    adamw, pending = torch.optim.AdamW(master, lr=lr), None
    for micro in steps:
        model.zero_grad()
        for x, y in micro:
            (nn.functional.mse_loss(model(x), y) / len(micro)).backward()
        for m, p in zip(master, trainable):
            m.grad = p.grad.clone()
        adamw.step()
        with torch.no_grad():
            for p, value in zip(trainable, pending or trainable):
                p.copy_(value)
        pending = [m.detach().clone() for m in master]
    with torch.no_grad():  # what synchronize() applies: the last update
        for p, value in zip(trainable, pending):
            p.copy_(value)


SCHEDULES = {
    "at step": {},
    "accumulation_steps=2": dict(accumulation_steps=2),
    "delayed_update": dict(delayed_update=True),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_cpu_offload_adam_trains_a_compiled_model_as_adamw_does(link, schedule):
    """The compiled backward hands the gradients over all at once, and each parameter's hook still
    fires after it: four steps of two micro-batches reach AdamW's weights (for a delayed update,
    AdamW's applied one step late)."""
    ref, mine = mlp(), mlp()
    steps = data(4, 2)
    if schedule == "delayed_update":
        adamw_one_step_late(torch.compile(ref), steps, lr=1e-2)
    else:
        train(torch.compile(ref), torch.optim.AdamW(ref.parameters(), lr=1e-2), steps)
    opt = CPUOffloadAdam(
        mine.parameters(), lr=1e-2, link=link, bucket_bytes=4096, **SCHEDULES[schedule]
    )
    assert len(opt.buckets) > 1
    train(torch.compile(mine), opt, steps)
    opt.synchronize()
    opt.close()
    assert_matches(ref, mine)
