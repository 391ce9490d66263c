"""Under torch.compile (CPU inductor): CPUOffloadAdam trains a compiled model as AdamW does, and a
StreamedModel compiles each block's own forward, with its weight fetch and release left outside
the graph (issue 35, item 6)."""

import copy

import pytest
import torch
from torch import nn

from offloadlab import _torch_compat
from offloadlab.models import GPTConfig, TinyGPT
from offloadlab.offload import CPUOffloadAdam
from offloadlab.streaming import StreamedModel
from tests.test_offload import assert_matches, data, mlp


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graph or guard is carried over from another test."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Counter:
    """A torch.compile backend that runs each graph as traced and counts its runs."""

    def __init__(self):
        self.runs: list[int] = []  # per graph compiled

    def __call__(self, graph, example_inputs):
        index = len(self.runs)
        self.runs.append(0)

        def run(*args):
            self.runs[index] += 1
            return graph.forward(*args)

        return run


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


# ---------------------------------------------------------------------- keeping code out of graphs


@pytest.mark.parametrize("recursive", [True, False])
def test_a_function_kept_out_of_the_graph_runs_eagerly_and_says_why(recursive):
    """_torch_compat.eager_under_compile: the function runs as written, outside the graph; what it
    calls is compiled only when not recursive; fullgraph=True is refused with the reason."""

    def inner(x):
        return x * 3

    @_torch_compat.eager_under_compile("kept out for a test", recursive=recursive)
    def outside(x):
        return inner(x + 1)

    counter = Counter()
    x = torch.arange(4.0)
    assert torch.equal(torch.compile(lambda x: outside(x * 2), backend=counter)(x), (x * 2 + 1) * 3)
    assert len(counter.runs) == (1 if recursive else 2)  # x * 2, and inner's x * 3 if compiled
    with pytest.raises(Exception, match="kept out for a test"):
        torch.compile(lambda x: outside(x * 2), fullgraph=True, backend=Counter())(x)


def test_a_torch_whose_disable_takes_no_reason_still_keeps_the_function_out(monkeypatch):
    """Older torches' torch.compiler.disable has no ``reason``: the decorator is made without it."""
    real, calls = torch.compiler.disable, []

    def disable(fn=None, recursive=True):
        calls.append(recursive)
        return real(fn, recursive=recursive)

    monkeypatch.setattr(torch.compiler, "disable", disable)
    decorator = _torch_compat.eager_under_compile("unused", recursive=False)
    assert calls == [False] and decorator(abs)(-2) == 2


# ---------------------------------------------------------------------- StreamedModel


@pytest.fixture(params=["emulated", "CUDA order checker"])
def landing_link(request):
    """The links of tests/test_streaming.py: a StreamedModel with no optimizer lands gradients in
    .grad, waiting for them on the host only once backward has issued all its work."""
    from offloadlab.link import EmulatedLink
    from tests.cuda_semantics import CudaOrderLink

    if request.param == "emulated":
        with EmulatedLink(bandwidth="8 GB/s", latency=0) as emulated:
            yield emulated
        return
    with (
        CudaOrderLink(bandwidth="8 GB/s", latency=0) as checker,
        checker.compute_stream("training"),
    ):
        yield checker
        checker.check()


def gpt_twins(layers=4):
    torch.manual_seed(0)
    plain = TinyGPT(GPTConfig(layers=layers, hidden=32, heads=2, vocab=64, seq=16))
    return plain, copy.deepcopy(plain)


def tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def test_a_compiled_streamed_model_runs_one_graph_per_block(landing_link):
    """The blocks share one graph, compiled once; each forward runs it once per block, between
    the fetch and the release of the block's weights, which stay out of the graph."""
    _, streamed = gpt_twins(layers=4)
    StreamedModel(streamed, landing_link)
    counter = Counter()
    compiled = torch.compile(streamed, backend=counter)
    x, y = tokens()
    for _ in range(2):
        before = sum(counter.runs)
        compiled(x, y).backward()
        assert len(counter.runs) == 1 and sum(counter.runs) - before == 4


def test_fullgraph_names_the_streaming_as_the_break(landing_link):
    """fullgraph=True, which allows no break, is refused with the streaming's reason."""
    _, streamed = gpt_twins(layers=1)
    StreamedModel(streamed, landing_link)
    with pytest.raises(Exception, match="StreamedModel fetches and releases a block's weights"):
        torch.compile(streamed, fullgraph=True, backend=Counter())(*tokens())


def test_a_streamed_block_compiled_by_itself_with_fullgraph_trains_as_the_plain_one(
    landing_link,
):
    """Eleventh probe pass S57: block.compile(fullgraph=True) on a streamed block failed inside
    torch ('reconstructing @contextmanager object'): the swap of its weights was traced. The
    swap now stays eager and the block's own forward is one graph."""
    plain, streamed = gpt_twins(layers=2)
    StreamedModel(streamed, landing_link)
    counter = Counter()
    for block in streamed.blocks:
        block.compile(backend=counter, fullgraph=True)
    x, y = tokens()
    plain(x, y).backward(), streamed(x, y).backward()
    assert sum(counter.runs) == 2  # one run of the block's graph per block
    for p, q in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(p.grad, q.grad)


def fetches(recording) -> int:
    return sum(t.direction == "h2d" for t in recording.transfers)


def test_a_compiled_streamed_model_has_the_gradients_of_its_blocks_compiled(landing_link):
    """With inductor, the streamed model's loss and gradients are those of the plain model whose
    blocks are compiled one by one (bit for bit), and within rounding of the uncompiled model;
    backward fetches the weights again as it does uncompiled (the graph keeps none of them)."""
    plain, streamed = gpt_twins()
    blockwise = copy.deepcopy(plain)
    for block in blockwise.blocks:
        block.compile()
    StreamedModel(streamed, landing_link)
    compiled = torch.compile(streamed)
    x, y = tokens()
    loss = streamed(x, y)
    with landing_link.record() as uncompiled:
        loss.backward()
    for _ in range(2):  # the second pass reuses the buffers and the graph
        for model in (plain, streamed, blockwise):
            model.zero_grad()
        loss = compiled(x, y)
        with landing_link.record() as recording:
            loss.backward()
        # the blocks no longer in a buffer, fetched again
        assert fetches(recording) == fetches(uncompiled) == len(streamed.blocks) - 2
        expected = blockwise(x, y)
        expected.backward()
        plain(x, y).backward()
        assert torch.equal(loss, expected)
        for a, b, c in zip(blockwise.parameters(), streamed.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)
            torch.testing.assert_close(b.grad, c.grad, rtol=1e-5, atol=1e-6)


def test_a_compiled_streamed_model_trains_with_cpu_offload_adam(link):
    """Three steps of CPUOffloadAdam on the compiled streamed model give the weights of the plain
    model with its blocks compiled, trained the same way."""
    plain, streamed = gpt_twins(layers=2)
    for block in plain.blocks:
        block.compile()
    StreamedModel(streamed, link)
    x, y = tokens()
    for model in (plain, torch.compile(streamed)):
        optimizer = CPUOffloadAdam(model.parameters(), lr=1e-2, link=link)
        for _ in range(3):
            optimizer.zero_grad()
            model(x, y).backward()
            optimizer.step()
        optimizer.close()
    for a, b in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(a, b)
