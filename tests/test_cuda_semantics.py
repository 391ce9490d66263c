"""The CUDA-order checker (tests/cuda_semantics.py) catches what a GPU would do to careless code.

Each hazard is written twice: the careless way, which the checker must catch (a test that cannot
fail proves nothing), and the right way, which it must accept.
"""

import threading

import pytest
import torch

from tests.cuda_semantics import CudaOrderLink


@pytest.fixture
def link():
    with CudaOrderLink(bandwidth="4 GB/s", latency=0) as checker:
        yield checker


def test_a_result_read_after_wait_alone_is_poison_and_after_synchronize_is_right(link):
    """wait() orders the compute stream, not the host: the host reads NaN until it synchronises."""
    device, host = torch.arange(1024, dtype=torch.float32), link.host_buffer(1024)
    transfer = link.to_host(host, device)
    transfer.wait()
    assert torch.isnan(host).all()
    transfer.synchronize()
    assert torch.equal(host, device)


def test_done_and_a_later_copy_on_the_same_engine_tell_the_host(link):
    device = torch.arange(512, dtype=torch.float32)
    first, second = link.host_buffer(512), link.host_buffer(512)
    a = link.to_host(first, device)
    b = link.to_host(second, device)
    while not b.done():
        pass
    assert torch.equal(first, device) and torch.equal(second, device)  # engines run in order
    assert a.done()


def test_a_marker_after_a_wait_tells_the_host_once_it_is_reached(link):
    device, host = torch.ones(256), link.host_buffer(256)
    transfer = link.to_host(host, device)
    transfer.wait()
    marker = link.mark()
    assert torch.isnan(host).all()
    marker.time  # the host synchronises with a point the compute reached after waiting for the copy
    assert torch.equal(host, device)


def test_writing_a_source_before_the_host_knows_is_caught_when_the_copy_is_used(link):
    source, device = link.host_buffer(256).fill_(1.0), torch.empty(256)
    link.to_device(device, source).wait()
    source.fill_(2.0)  # careless: the compute waits for the copy, the host does not
    with pytest.raises(AssertionError, match="wrote the source of copy"):
        link.check()


def test_writing_a_source_after_synchronize_is_fine(link):
    source, device = link.host_buffer(256).fill_(1.0), torch.empty(256)
    transfer = link.to_device(device, source)
    transfer.wait()
    transfer.synchronize()
    source.fill_(2.0)
    link.check()


@pytest.mark.parametrize("ordered", [True, False], ids=["after the compute", "unordered"])
def test_state_copied_down_where_it_came_up_from_is_caught_unless_ordered_after_the_copy_up(
    link, ordered
):
    """A parked optimizer's round trip: state comes up from a pinned buffer, the compute updates it,
    and it goes back down into the same buffer. Ordered after the compute that waited for the copy
    up, the copy down cannot start before the copy up has read everything; unordered, it may land
    while the copy up still reads."""
    state, slot = link.host_buffer(256).fill_(1.0), torch.empty(256)
    up = link.to_device(slot, state, after=link.mark(timed=False))
    if ordered:
        up.wait()
        slot.add_(1.0)
        down = link.to_host(state, slot, after=link.mark(timed=False))
    else:  # (other bytes than the copy up's, so that landing over its source always shows)
        down = link.to_host(state, torch.full((256,), 5.0), after=None)
        up.wait()
    down.synchronize()
    if ordered:
        link.check()
        assert torch.equal(state, torch.full((256,), 2.0))
    else:
        with pytest.raises(AssertionError, match="wrote the source of copy"):
            link.check()


@pytest.mark.parametrize("ordered", [True, False], ids=["after the copy down", "unordered"])
def test_a_copy_up_ordered_after_a_copy_down_reads_its_bytes_the_host_may_not_know_yet(
    link, ordered
):
    """An offloaded activation: down into a pinned buffer, later up from it. Ordered on the device
    (the compute waits for the copy down, the copy up follows that point), the copy up reads the
    bytes even though the host never learned the copy down was done; the host still reads
    poison there. Unordered, it may read the buffer before the bytes land."""
    device, host, back = torch.arange(256.0), link.host_buffer(256), torch.empty(256)
    down = link.to_host(host, device)
    if ordered:
        down.wait()
    up = link.to_device(back, host, after=link.mark(timed=False) if ordered else None)
    up.wait()
    assert torch.isnan(host).all()  # the host knows nothing yet
    if ordered:
        assert torch.equal(back, device)
        link.check()
    else:
        assert torch.isnan(back).all()


def test_a_torn_copy_whose_bytes_are_never_used_is_not_a_violation(link):
    source, device = link.host_buffer(256).fill_(1.0), torch.empty(256)
    link.to_device(device, source)  # a prefetch that will be thrown away
    source.fill_(2.0)
    link.check()


def test_writing_a_destination_before_the_host_knows_is_caught(link):
    device, host = torch.ones(256), link.host_buffer(256)
    link.to_host(host, device).wait()
    host.zero_()
    with pytest.raises(AssertionError, match="wrote into the destination of copy"):
        link.check()


def test_two_copies_down_into_the_same_memory_is_caught(link):
    device, host = torch.ones(256), link.host_buffer(256)
    link.to_host(host, device)
    link.to_host(host, device)
    with pytest.raises(AssertionError, match="may still be writing"):
        link.check()


def test_a_wait_on_one_stream_tells_nothing_about_a_copy_ordered_after_another(link):
    """Knowledge travels along one stream: waiting on the training stream and then ordering a copy
    after the worker's stream proves nothing about the first copy."""
    device, host = torch.ones(256), link.host_buffer(256)
    with link.compute_stream("training"):
        down = link.to_host(host, device)
        down.wait()
        training_point = link.mark()
    source, target = link.host_buffer(16).fill_(3.0), torch.empty(16)
    worker = {}

    def on_a_worker():
        # the worker's own stream
        worker["other stream"] = link.to_device(target, source, after="compute")
        worker["training stream"] = link.to_device(
            target, source, after=link.mark_on(training_point)
        )

    thread = threading.Thread(target=on_a_worker)
    thread.start()
    thread.join()
    worker["other stream"].synchronize()
    assert torch.isnan(host).all()  # the worker's stream never waited for the copy down
    worker["training stream"].synchronize()
    # ordered after the training stream's wait: the copy down is done
    assert torch.equal(host, device)


def test_pageable_copies_are_known_at_once(link):
    device, host = torch.ones(64), torch.zeros(64)  # ordinary memory: CUDA copies it synchronously
    link.to_host(host, device)
    assert torch.equal(host, device)
    link.check()
