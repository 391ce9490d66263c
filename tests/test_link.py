"""The transfer engine: the emulated link on every machine, the CUDA link where there is a GPU."""

import time

import pytest
import torch

from offloadlab.link import CudaLink, EmulatedLink, Marker, open_link, pinned_allocation_bytes


@pytest.fixture
def link():
    with EmulatedLink(bandwidth="1 GB/s", latency="50 us") as emulated:
        yield emulated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_moves_the_right_bytes_both_ways(link, dtype):
    src = link.host_buffer((3, 1000), dtype)
    src.copy_(torch.arange(3000).reshape(3, 1000).to(dtype))
    device = link.device_buffer((3, 1000), dtype)
    link.to_device(device, src).wait()
    assert torch.equal(device, src)
    back = link.host_buffer((3, 1000), dtype)
    transfer = link.to_host(back, device)
    transfer.synchronize()
    assert transfer.done() and torch.equal(back, src)
    assert transfer.direction == "d2h" and transfer.nbytes == 3000 * src.element_size()
    assert transfer.emulated and transfer.pinned


def test_never_faster_than_the_configured_bandwidth(link):
    nbytes = 16 * 2**20
    src, dst = link.host_buffer(nbytes // 4), link.device_buffer(nbytes // 4)
    transfer = link.to_device(dst, src)
    transfer.synchronize()
    floor = link.latency + nbytes / link.bandwidth
    assert transfer.elapsed >= floor * 0.999
    # Generous upper tolerance: the pacing adds sleep granularity, not a multiple of the time.
    assert transfer.bandwidth >= 0.25 * link.bandwidth


def test_transfer_overlaps_compute_on_the_main_thread(link):
    src, dst = link.host_buffer(8 * 2**20), link.device_buffer(8 * 2**20)  # 32 MiB: ~34 ms at 1 GB/s
    a = torch.randn(256, 256)
    transfer = link.to_device(dst, src)
    issued = link.mark()
    before = link.mark()
    while not transfer.done():  # compute for as long as the copy is in flight
        a = torch.tanh(a @ a)
    after = link.mark()
    assert not transfer.done() or transfer.end >= issued.time  # returned before the copy ended
    assert transfer.start < after.time and before.time < transfer.end  # the two intervals intersect
    assert transfer.end - transfer.start > 0


def test_pageable_copies_are_synchronous_and_slower(link):
    pageable = torch.ones(4 * 2**20 // 4)  # not from host_buffer: ordinary memory
    assert not link.is_pinned(pageable)
    dst = link.device_buffer(pageable.shape)
    transfer = link.to_device(dst, pageable)
    assert transfer.done() and not transfer.pinned  # the caller waited for it
    assert transfer.elapsed >= 4 * 2**20 / (link.bandwidth * link.pageable_fraction) * 0.999
    assert torch.equal(dst, pageable)


def test_timestamps_order_queued_transfers(link):
    src, dst = link.host_buffer(2**18), link.device_buffer(2**18)
    first, second = link.to_device(dst, src), link.to_device(dst, src)
    assert first.end <= second.start  # one copy engine per direction: transfers queue


def test_bad_arguments(link):
    src = link.host_buffer(10)
    with pytest.raises(ValueError, match="^dst: expected 10 elements"):
        link.to_device(link.device_buffer(11), src)
    with pytest.raises(ValueError, match="^dst: expected dtype torch.float32"):
        link.to_device(link.device_buffer(10, torch.float16), src)
    with pytest.raises(ValueError, match="^src: expected a contiguous tensor"):
        link.to_device(link.device_buffer(5), link.host_buffer((5, 2)).t()[0])
    with pytest.raises(ValueError, match="^after: "):
        link.to_device(link.device_buffer(10), src, after="later")
    with pytest.raises(ValueError, match="^src: expected a torch.Tensor"):
        link.to_host(src, [1, 2, 3])
    for bad in (0, -1, "0 GB/s", "fast"):
        with pytest.raises(ValueError, match="^bandwidth: "):
            EmulatedLink(bandwidth=bad)
    with pytest.raises(ValueError, match="^latency: "):
        EmulatedLink(latency="-1 ms")
    with pytest.raises(ValueError, match="^pageable_fraction: "):
        EmulatedLink(pageable_fraction=0)
    with pytest.raises(ValueError, match="^bandwidth: "):
        open_link(emulated=False, bandwidth="1 GB/s") if torch.cuda.is_available() else EmulatedLink(bandwidth="1 GB")


def test_reserves_a_core_and_gives_it_back():
    before = torch.get_num_threads()
    link = EmulatedLink()
    import os
    if (os.cpu_count() or 1) > 1:
        assert torch.get_num_threads() <= (os.cpu_count() or 1) - 1
    link.close()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        link.to_device(torch.zeros(1), torch.zeros(1))


def test_open_link_picks_the_machine():
    with open_link() as chosen:
        assert chosen.emulated == (not torch.cuda.is_available())
    with open_link(emulated=True, bandwidth="3 GB/s") as forced:
        assert forced.bandwidth == 3e9


def test_marker_times_increase(link):
    first = link.mark()
    time.sleep(0.001)
    assert isinstance(first, Marker) and link.mark().time > first.time


def test_pinned_allocation_rounds_to_powers_of_two():
    assert pinned_allocation_bytes(0) == 0
    assert pinned_allocation_bytes(1) == 1
    assert pinned_allocation_bytes(1000) == 1024
    assert pinned_allocation_bytes(2**30 + 1) == 2**31
    with pytest.raises(ValueError, match="^nbytes: "):
        pinned_allocation_bytes(-1)


def test_cuda_link_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaLink()


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_cuda_round_trip_with_exact_size_pinned_buffers():
    with CudaLink() as cuda:
        host = cuda.host_buffer(1000 * 1000 + 3)
        assert host.is_pinned() and host.numel() == 1000 * 1000 + 3
        host.copy_(torch.arange(host.numel(), dtype=torch.float32))
        device = cuda.device_buffer(host.shape)
        cuda.to_device(device, host).wait()
        back = cuda.host_buffer(host.shape)
        cuda.to_host(back, device * 2).synchronize()
        assert torch.equal(back, host * 2)


@pytest.mark.gpu
def test_cuda_copy_overlaps_a_running_kernel():
    with CudaLink() as cuda:
        host = cuda.host_buffer(64 * 2**20)  # 256 MiB
        device = cuda.device_buffer(host.shape)
        a = torch.randn(8192, 8192, device="cuda")
        start = cuda.mark()
        for _ in range(20):
            a = a @ a / 8192
        end = cuda.mark()
        transfer = cuda.to_device(device, host, after=None)
        cuda.synchronize()
        assert transfer.start < end.time and start.time < transfer.end
