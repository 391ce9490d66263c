"""Memory truths that only a GPU can show (skipped cleanly without one).

Sizes come from the same places as lab 4's and the GPU kit's plan: the model and cap of
:mod:`offloadlab_course.capacity`, checked against the GPU's profile before anything is allocated.
"""

import gc
import weakref

import pytest
import torch

from offloadlab import devices
from offloadlab.link import CudaLink
from offloadlab.models import (
    GPTConfig,
    TinyGPT,
    batches,
    markov_corpus,
    saved_activation_bytes,
    train,
)
from offloadlab.offload import CPUOffloadAdam
from offloadlab.streaming import StreamedModel
from offloadlab_course import capacity

CONFIG = capacity.LAB_CONFIG


def release_device_memory() -> None:
    """Tensors held only by reference cycles (an exception's traceback and the frames it keeps,
    an autograd graph) are freed first: ``empty_cache`` returns only blocks nothing holds."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def test_release_frees_what_only_a_cycle_holds():
    """The capped test's OOM leaves the plain model to the traceback's frames: without a
    collection first, ``empty_cache`` kept its memory reserved under the cap."""

    class Holder:
        pass

    holder = Holder()
    holder.tensor, holder.me = torch.empty(1024), holder  # a cycle
    alive = weakref.ref(holder)
    gc.disable()  # (no collection may run before the one under test)
    try:
        del holder
        assert alive() is not None
        release_device_memory()
        assert alive() is None
    finally:
        gc.enable()


@pytest.fixture
def capped():
    """Cap this process's GPU memory at lab 4's cap: the offloaded run's need (weights, saved
    activations, buffers) plus 20 %, below plain AdamW's 16 bytes per parameter of state."""
    cap = capacity.lab_cap(CONFIG, capacity.LAB_BATCH)
    profile = devices.present()
    if cap > 0.8 * profile.memory_bytes:
        pytest.skip(f"lab 4's cap of {cap} bytes does not fit this GPU's {profile.memory_bytes}")
    release_device_memory()
    torch.cuda.set_per_process_memory_fraction(
        cap / torch.cuda.get_device_properties(0).total_memory
    )
    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0)
    release_device_memory()


@pytest.mark.gpu
def test_plain_adamw_runs_out_of_memory_under_the_cap_and_offload_trains(capped):
    data = batches(markov_corpus(CONFIG.vocab, 100_000), capacity.LAB_BATCH, CONFIG.seq)
    plain = []
    with pytest.raises(torch.cuda.OutOfMemoryError):
        plain.append(TinyGPT(CONFIG).cuda())
        train(plain[0], torch.optim.AdamW(plain[0].parameters()), data, 2, "cuda")
    plain.clear()
    release_device_memory()  # the model and AdamW's state, held by the OOM's frames till now
    torch.cuda.reset_peak_memory_stats()
    model = TinyGPT(CONFIG).to("cuda", torch.bfloat16)
    optimizer = CPUOffloadAdam(model.parameters(), lr=1e-3, bucket_bytes=16 * 2**20)
    losses = train(model, optimizer, data, 5, "cuda")
    optimizer.close()
    assert torch.cuda.max_memory_reserved() <= capped and losses[-1] < losses[0]


@pytest.mark.gpu
def test_parameter_streaming_keeps_device_memory_within_its_budget():
    config = GPTConfig(layers=16, hidden=1024, heads=16, vocab=1024, seq=128)
    batch = 2
    torch.manual_seed(0)
    model = TinyGPT(config).cuda()
    with CudaLink() as cuda:
        handle = StreamedModel(model, cuda, buffers=2)
        release_device_memory()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()  # embeddings and head stay on the device
        x = torch.randint(0, 1024, (batch, 128), device="cuda")
        model(x, x).backward()
        torch.cuda.synchronize()
        streamed_total = sum(
            p.numel() * p.element_size() for block in handle.blocks for p in block.parameters()
        )
        peak_over_resident = torch.cuda.max_memory_allocated() - resident
        # All of the streaming's device memory, allocated up front (it is in `resident`): two weight
        # buffers and two gradient buffers of one block each, 4 of the 16 blocks' worth.
        assert (
            handle.device_budget == 2 * handle.block_bytes + 2 * handle.gradient_layouts[0].nbytes
        )
        assert handle.device_budget <= streamed_total * 4 / config.layers
        # Above that the peak holds the saved activations (counted on the meta device, which keeps
        # more than a GPU's fused attention) and a few blocks' worth of transient gradients —
        # never every block's weights.
        bound = saved_activation_bytes(config, batch, torch.float32) + 4 * handle.block_bytes
        assert peak_over_resident <= bound < streamed_total
