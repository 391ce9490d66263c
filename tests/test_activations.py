"""offload_activations: saved tensors down as forward makes them, up one ahead in backward, on the
emulated link and under CUDA's ordering rules; gradients equal the plain model's bit for bit.

References run inside the link's context: an emulated link keeps a core for its copies, and a
CPU reduction split over another number of threads sums in another order.
"""

import gc
import json

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from offloadlab.activations import ActivationOffload, offload_activations
from offloadlab.models import GPTConfig, TinyGPT, batches, markov_corpus

CONFIG = GPTConfig(layers=3, hidden=128, heads=4, vocab=512, seq=64)
SMALL = 4096  # bytes: offload all but the smallest saved tensors of these small models


def batch(config=CONFIG, seed=0):
    return next(batches(markov_corpus(config.vocab, 20_000), 8, config.seq, seed=seed))


def gradients(make, inputs, link=None, **offload):
    torch.manual_seed(0)
    model = make()
    x, y = inputs
    if link is None:
        loss = model(x, y)
    else:
        with offload_activations(link, **offload) as used:
            loss = model(x, y)
        assert used.offloaded_bytes > 0
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class Tied(nn.Module):
    """Embedding and output head share one matrix."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 128)
        self.body = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))

    def forward(self, x, y):
        h = self.body(self.embed(x))
        logits = h @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, 512), y.reshape(-1))


class HalfCheckpointed(nn.Module):
    """TinyGPT with its first block recomputed (torch.utils.checkpoint) and the rest saved."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(CONFIG)

    def forward(self, x, y):
        gpt = self.gpt
        h = gpt.tokens(x) + gpt.positions(torch.arange(x.shape[1]))
        for i, block in enumerate(gpt.blocks):
            h = (
                torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                if i == 0
                else block(h)
            )
        return nn.functional.cross_entropy(gpt.head(gpt.norm(h)).flatten(0, 1), y.flatten())


@pytest.mark.parametrize(
    "make",
    [lambda: TinyGPT(CONFIG), Tied, HalfCheckpointed],
    ids=["TinyGPT", "tied weights", "some blocks checkpointed"],
)
def test_gradients_equal_the_plain_models_bit_for_bit(link, make):
    inputs = batch()
    plain = gradients(make, inputs)
    offloaded = gradients(make, inputs, link, min_bytes=SMALL)
    assert_same(plain, offloaded)
    traffic = link.traffic.snapshot()
    # every byte that went down came up once, and nothing waited inside backward
    assert traffic["h2d_bytes"] == traffic["d2h_bytes"] > 0
    assert traffic["syncs_in_backward"] == 0


def test_parameters_small_tensors_and_inference_stay_on_the_device(link):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    x, y = batch()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sent = []
    with offload_activations(link, min_bytes=SMALL) as used:
        original = used._offloaded
        used._offloaded = lambda t: sent.append(t.untyped_storage().data_ptr()) or original(t)
        model(x, y).backward()
        assert not any(used._offloaded(p) for p in model.parameters())
        with torch.no_grad():
            before = used.offloaded_bytes
            model(x, y)
            assert used.offloaded_bytes == before  # nothing is saved without grad
    assert used.kept_tensors > 0
    assert link.traffic.snapshot()["d2h_bytes"] == used.offloaded_bytes
    assert parameters  # (the parameters' memory is the model's)


def test_backward_twice_is_refused_as_torch_refuses_it(link):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    x, y = batch()
    with offload_activations(link, min_bytes=SMALL):
        loss = model(x, y)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_retain_graph_brings_the_tensors_up_again(link):
    inputs = batch()
    torch.manual_seed(0)
    plain = TinyGPT(CONFIG)
    loss = plain(*inputs)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    with offload_activations(link, min_bytes=SMALL):
        loss = model(*inputs)
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


def test_a_forward_that_raises_leaves_no_copy_and_no_device_tensor_held(link):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    x, y = batch()
    offload = ActivationOffload(link, min_bytes=SMALL)
    with pytest.raises(ValueError, match="stop"):
        with offload:
            h = model.tokens(x)
            h = model.blocks[0](h)
            raise ValueError("stop")
    assert offload._down == []
    del h
    gc.collect()
    # the graph is gone: every pinned buffer is back in the pool, none held by a saved tensor
    assert all(ref() is None for ref in offload._saved.values())
    pooled = sum(host.numel() for free in offload._pool.values() for host, _ in free)
    assert pooled == offload.offloaded_bytes
    offload.close()


def test_pinned_buffers_are_reused_by_the_next_step(link):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    offload = ActivationOffload(link, min_bytes=SMALL)
    pinned = []
    for seed in range(3):
        with offload:
            loss = model(*batch(seed=seed))
        loss.backward()
        del loss
        gc.collect()
        pinned.append(link.pinned_bytes)
    assert pinned[0] == pinned[1] == pinned[2] > 0
    offload.close()


def test_bad_arguments_are_refused_in_one_line(link):
    for kwargs, message in [
        (dict(link="cuda"), "^link: expected an offloadlab.link.Link"),
        (dict(link=link, min_bytes=-1), "^min_bytes: expected a whole number of bytes ≥ 0"),
        (dict(link=link, prefetch=0), "^prefetch: expected a positive integer"),
        (dict(link=link, in_flight=0), "^in_flight: expected a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            ActivationOffload(**kwargs)


@pytest.mark.gpu
def test_gradients_equal_the_plain_models_on_the_gpu():
    from offloadlab.link import open_link

    torch.manual_seed(0)
    x, y = (t.cuda() for t in batch())
    plain = gradients(lambda: TinyGPT(CONFIG).cuda(), (x, y))
    with open_link() as link:
        offloaded = gradients(lambda: TinyGPT(CONFIG).cuda(), (x, y), link, min_bytes=SMALL)
    for a, b in zip(plain[1], offloaded[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_bench_records_a_timeline_where_each_copy_up_follows_its_own_down(
    monkeypatch, tmp_path, capsys
):
    from offloadlab import bench
    from offloadlab.cli import main

    monkeypatch.setattr(bench, "_offload_rounds", lambda gpu, quick: (1, 1))
    result = bench.activations(quick=True)
    assert [row["contender"] for row in result["rows"]] == list(bench.ACTIVATION_CONTENDERS)
    link_row = next(row["link"] for row in result["rows"] if "link" in row)
    assert link_row["d2h_bytes"] == link_row["h2d_bytes"] == link_row["predicted_each_way"] > 0
    lanes = result["timeline"]
    (start, forward_done, _), (_, backward_done, _) = lanes["compute"]
    downs = {label: (s, e) for s, e, label in lanes["D2H"]}
    ups = {label: (s, e) for s, e, label in lanes["H2D"]}
    assert len(downs) == len(lanes["D2H"]) > 0 and downs.keys() == ups.keys()
    for label, (down_start, down_end) in downs.items():
        assert start <= down_start and down_end <= ups[label][0]  # up reads what has landed
        assert forward_done <= ups[label][0] and ups[label][1] <= backward_done

    monkeypatch.setattr(bench, "activations", lambda quick=False: result)
    trace_file = tmp_path / "step.trace.json"
    assert main(["bench", "activations", "--trace", str(trace_file)]) == 0
    assert "copies down" in capsys.readouterr().out
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 + 2 * len(downs)
    assert main(["bench", "activations", "--trace", str(trace_file)]) == 2  # kept without --force
    assert "--force" in capsys.readouterr().err
    assert main(["bench", "link", "--trace", str(tmp_path / "other.json")]) == 2
    assert "only bench activations records a timeline" in capsys.readouterr().err
    both = str(tmp_path / "both.json")
    assert main(["bench", "activations", "--json", both, "--trace", both]) == 2
    assert "names the --json file" in capsys.readouterr().err


# Thirteenth probe pass, V31: each `with offload_activations():` given no link opened an emulated
# link (copy threads, a pinned pool) that nothing closed: 300 steps left 901 threads.
def test_offload_without_a_link_shares_one_rather_than_leave_one_open_per_pass():
    import threading

    model = nn.Sequential(nn.Linear(64, 256), nn.Sigmoid(), nn.Linear(256, 1))
    x = torch.randn(32, 64)
    links = []
    for step in range(20):
        with offload_activations(min_bytes=0) as used:
            loss = model(x).sigmoid().sum()
        loss.backward()
        links.append(used.link)
        if step == 0:
            threads = threading.active_count()
    assert used.offloaded_bytes > 0 and all(link is links[0] for link in links)
    assert threading.active_count() == threads
    used.close()
    assert not links[0].closed  # the process's link, not the pass's


# V7, V46: torch refuses a backward through a saved tensor edited in place; the hooks replaced its
# check, and the copy down raced the edit (the weight's gradient came out 0 instead of 66.27).
@pytest.mark.parametrize("where", ["after forward", "inside forward"])
@pytest.mark.parametrize("min_bytes", [0, 2**30], ids=["offloaded", "kept"])
def test_a_saved_tensor_edited_in_place_is_refused_as_torch_refuses_it(link, where, min_bytes):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with offload_activations(link, min_bytes=min_bytes):
        h = (x @ w).sigmoid()
        if where == "inside forward":
            h.mul_(2)
        out = (h * 2).sum()
    if where == "after forward":
        h.mul_(0)
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        out.backward()
