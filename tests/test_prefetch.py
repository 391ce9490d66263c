"""Prefetcher and parameter streaming on the emulated link; the CUDA path where there is a GPU."""

import copy

import pytest
import torch

from offloadlab.link import CudaLink, EmulatedLink
from offloadlab.models import GPTConfig, TinyGPT
from offloadlab.prefetch import Prefetcher, stream_parameters

VARIANTS = [dict(), dict(buffers=3), dict(buffers=1), dict(synchronous=True), dict(pinned=False)]


@pytest.fixture
def link():
    with EmulatedLink(bandwidth="1 GB/s", latency=0) as emulated:
        yield emulated


def items(count=6, numel=4096):
    return [torch.full((numel,), float(i)) for i in range(count)]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_every_variant_yields_the_right_tensors_in_order(link, variant):
    groups = [(torch.full((3, 5), float(i)), torch.arange(7, dtype=torch.int64) + i) for i in range(5)]
    seen = []
    for a, b in Prefetcher(groups, link, **variant):
        seen.append((a.clone(), b.clone()))
        assert a.device.type == link.device.type
    assert len(seen) == 5
    for (a, b), (x, y) in zip(seen, groups):
        assert torch.equal(a, x) and torch.equal(b, y)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_no_buffer_is_overwritten_while_in_use_poison_and_check(link, variant):
    """The consumer poisons each buffer after use; an item delivered before its copy landed,
    or a buffer refilled while still in use, shows up as poison or a changed value."""
    source = items(8, 2**18)  # 1 MiB each: ~1 ms per copy at 1 GB/s, long enough to be caught
    prefetcher = Prefetcher(source, link, **variant)
    a = torch.randn(128, 128)
    for i, tensor in enumerate(prefetcher):
        assert torch.equal(tensor, source[i]), f"item {i} was delivered before its copy landed"
        for _ in range(20):  # the consumer works on the item for a while
            a = torch.tanh(a @ a)
        assert torch.equal(tensor, source[i]), f"item {i} was overwritten while in use"
        tensor.fill_(float("nan"))  # poison: a reused buffer must be refilled before delivery


def test_double_buffer_fetches_the_next_item_during_the_current_one(link):
    prefetcher = Prefetcher(items(6, 2**18), link, buffers=2)
    a = torch.randn(128, 128)
    for _ in prefetcher:
        for _ in range(20):
            a = torch.tanh(a @ a)
    lanes = prefetcher.timeline()
    copies, computes = lanes["H2D"], lanes["compute"]
    for i in range(len(copies) - 1):
        assert copies[i + 1][0] < computes[i][1], f"copy {i + 1} did not start before item {i} was done"


def test_one_buffer_and_synchronous_fetch_only_after_the_consumer(link):
    for variant in (dict(buffers=1), dict(synchronous=True)):
        prefetcher = Prefetcher(items(4, 2**16), link, **variant)
        for _ in prefetcher:
            pass
        lanes = prefetcher.timeline()
        for i in range(1, 4):
            assert lanes["H2D"][i][0] >= lanes["compute"][i - 1][1]


def test_device_memory_stays_within_the_buffers(link):
    source = [torch.zeros(1000), torch.zeros(3000), torch.zeros(2000)]
    prefetcher = Prefetcher(source, link, buffers=2)
    assert prefetcher.device_bytes == 2 * 12032  # the largest item, 64-byte aligned, per buffer
    slots = {t.untyped_storage().data_ptr() for t in prefetcher._slots}
    for tensor in prefetcher:
        assert tensor.untyped_storage().data_ptr() in slots


def test_bad_arguments(link):
    with pytest.raises(ValueError, match="^buffers: "):
        Prefetcher(items(), link, buffers=0)
    with pytest.raises(ValueError, match="^depth: "):
        Prefetcher(items(), link, buffers=2, depth=2)
    with pytest.raises(ValueError, match="^items: expected at least one"):
        Prefetcher([], link)
    with pytest.raises(ValueError, match="^items: expected host"):
        Prefetcher([torch.zeros(2), "not a tensor"], link)
    with pytest.raises(ValueError, match="^layers: "):
        stream_parameters(torch.nn.Linear(2, 2), link)
    with pytest.raises(ValueError, match="^buffers: "):
        stream_parameters(TinyGPT(GPTConfig(layers=1, hidden=8, heads=2, vocab=8, seq=4)), link, buffers=1)


def test_streamed_model_gives_the_same_outputs_and_gradients(link):
    config = GPTConfig(layers=4, hidden=64, heads=4, vocab=128, seq=32)
    torch.manual_seed(0)
    plain = TinyGPT(config)
    streamed = copy.deepcopy(plain)
    handle = stream_parameters(streamed, link, buffers=2)
    x, y = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    for _ in range(2):  # twice: the second pass reuses the host weights and buffers
        plain.zero_grad(), streamed.zero_grad()
        expected, got = plain(x, y), streamed(x, y)
        expected.backward(), got.backward()
        assert torch.equal(expected, got)
        for a, b in zip(plain.parameters(), streamed.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert handle.device_budget == 2 * handle.layer_bytes
    assert all(link.is_pinned(p) for layer in handle.layers for p in layer.parameters())


def three_steps(model, optimizer, x, y) -> None:
    for _ in range(3):
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    if hasattr(optimizer, "close"):
        optimizer.close()


@pytest.mark.parametrize("optimizer", ["AdamW", "CPUOffloadAdam"])
def test_streamed_model_trains_exactly_like_the_plain_one(link, optimizer):
    """Any optimizer (CPUOffloadAdam writing the host copy) gives the unstreamed model's weights."""
    from offloadlab.offload import CPUOffloadAdam

    make = {"AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
            "CPUOffloadAdam": lambda m: CPUOffloadAdam(m.parameters(), lr=1e-2, link=link)}[optimizer]
    config = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16)
    torch.manual_seed(0)
    plain = TinyGPT(config)
    streamed = copy.deepcopy(plain)
    stream_parameters(streamed, link)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    for model in (plain, streamed):
        three_steps(model, make(model), x, y)
    for a, b in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_prefetch_poison_and_memory():
    with CudaLink() as cuda:
        source = [torch.full((2**22,), float(i)) for i in range(6)]
        before = torch.cuda.memory_allocated()
        prefetcher = Prefetcher(source, cuda, buffers=2)
        a = torch.randn(4096, 4096, device="cuda")
        for i, tensor in enumerate(prefetcher):
            for _ in range(5):
                a = a @ a / 4096
            assert torch.equal(tensor, source[i].cuda())
            tensor.fill_(float("nan"))
        assert torch.cuda.memory_allocated() - before <= prefetcher.device_bytes + 4096 * 4096 * 4 * 2


@pytest.mark.gpu
def test_cuda_streaming_with_cpu_offload_adam():
    from offloadlab.offload import CPUOffloadAdam

    config = GPTConfig(layers=4, hidden=256, heads=4, vocab=512, seq=64)
    torch.manual_seed(0)
    plain = TinyGPT(config).cuda()
    streamed = copy.deepcopy(plain)
    x = torch.randint(0, 512, (4, 64), device="cuda")
    y = torch.randint(0, 512, (4, 64), device="cuda")
    with CudaLink() as cuda:
        stream_parameters(streamed, cuda)
        for model in (plain, streamed):
            three_steps(model, CPUOffloadAdam(model.parameters(), lr=1e-3, link=cuda), x, y)
        for a, b in zip(plain.parameters(), streamed.parameters()):
            torch.testing.assert_close(b.to("cuda"), a, rtol=1e-5, atol=1e-6)
