"""The transfer engine: the emulated link on every machine, the CUDA link where there is a GPU.

Ordering tests hold the emulated compute stream at a gate (a launched function waiting on an
event) so that what must wait and what must not is decided by the engine, not by scheduling.
"""

import gc
import json
import threading
import time

import pytest
import torch

from offloadlab import trace
from offloadlab.link import CudaLink, EmulatedLink, Link, Marker, open_link, pinned_allocation_bytes

WATCHDOG = 60  # seconds before a test that should never wait that long calls it a deadlock


def gate(link):
    """Hold the link's compute stream until the returned event is set."""
    opened = threading.Event()
    link.launch(opened.wait)
    return opened


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
    # (how much slower a busy machine makes it is no test's business)
    assert transfer.elapsed >= floor * 0.999


def test_transfer_overlaps_compute_on_the_main_thread(link):
    # 32 MiB: ~34 ms at 1 GB/s
    src, dst = link.host_buffer(8 * 2**20), link.device_buffer(8 * 2**20)
    a = torch.randn(256, 256)
    before = link.mark()
    transfer = link.to_device(dst, src)
    issued = link.mark()
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


def test_a_copy_waits_for_the_compute_it_is_ordered_after(link):
    src, dst = link.host_buffer(1024).fill_(1.0), link.device_buffer(1024).zero_()
    opened = gate(link)
    marker = link.mark()
    for after in (marker, "compute"):
        transfer = link.to_device(dst, src, after=after)
        # the gate is shut: it cannot have started
        assert not marker.reached() and not transfer.done()
    opened.set()
    assert transfer._landed.wait(WATCHDOG)
    assert transfer.start >= marker.time and torch.equal(dst, src)


def test_a_copy_after_nothing_runs_while_compute_is_held(link):
    src, dst = link.host_buffer(1024).fill_(2.0), link.device_buffer(1024)
    opened = gate(link)
    transfer = link.to_device(dst, src, after=None)
    assert transfer._landed.wait(WATCHDOG)  # landed with the compute stream still shut
    assert torch.equal(dst, src)
    opened.set()
    link.synchronize()


def test_the_emulation_catches_a_copy_not_ordered_after_its_reader(link):
    """A consumer on the compute stream reads a buffer twice; a copy into it issued while the
    consumer runs overwrites what it reads unless the copy is ordered after the consumer — as on
    a GPU."""
    for after_consumer in (True, False):
        buffer, new = link.device_buffer(1024).fill_(1.0), link.host_buffer(1024).fill_(9.0)
        opened, read_once, seen = threading.Event(), threading.Event(), []

        def consumer():
            first = buffer.clone()
            read_once.set()
            opened.wait()
            seen.append(torch.equal(buffer, first))

        link.launch(consumer)
        released = link.mark()
        if not after_consumer:
            # its first read done (on a busy machine the copy could land before it)
            assert read_once.wait(WATCHDOG)
        transfer = link.to_device(buffer, new, after=released if after_consumer else None)
        if not after_consumer:
            # overwrites the buffer while the consumer still reads it
            assert transfer._landed.wait(WATCHDOG)
        opened.set()
        link.synchronize()
        assert seen == [after_consumer]


def test_one_engine_per_direction_a_held_copy_up_does_not_hold_a_copy_down(link):
    up_src, up_dst = link.host_buffer(1024), link.device_buffer(1024)
    down_src, down_dst = link.device_buffer(1024).fill_(3.0), link.host_buffer(1024)
    opened = gate(link)
    up = link.to_device(up_dst, up_src, after="compute")
    down = link.to_host(down_dst, down_src, after=None)
    # full duplex: the d2h engine did not queue behind
    assert down._landed.wait(WATCHDOG) and not up.done()
    opened.set()
    link.synchronize()
    assert up.done() and torch.equal(down_dst, down_src)


def test_pinned_memory_belongs_to_its_owner_and_is_freed_with_it(link):
    assert link.pinned_bytes == 0
    buffer = link.host_buffer(1000)
    view = buffer[10:20]
    assert link.pinned_bytes == 4000 and link.is_pinned(view)
    del buffer
    gc.collect()
    assert link.pinned_bytes == 4000  # a view keeps the memory alive (and pinned)
    del view
    gc.collect()
    assert link.pinned_bytes == 0


def test_scattered_upload_lands_every_target(link):
    targets = [link.device_buffer(3), link.device_buffer((2, 2)), link.device_buffer(5)]
    src = link.host_buffer(12).copy_(torch.arange(12.0))
    staging = link.device_buffer(12)
    views = [staging[0:3], staging[3:7].view(2, 2), staging[7:12]]
    link.to_device_scattered(list(zip(targets, views)), src, staging).synchronize()
    assert torch.equal(torch.cat([t.reshape(-1) for t in targets]), src)
    with pytest.raises(ValueError, match="^targets: "):
        link.to_device_scattered([(targets[0], torch.zeros(3))], src, staging)


def test_launched_errors_come_back_at_synchronize(link):
    link.launch(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        link.synchronize()
    link.synchronize()  # reported once


def test_emulated_compute_uses_the_launchers_thread_count():
    """OpenMP keeps one team size per thread, fixed when the thread first runs a parallel op; a
    compute thread that kept its first count could take every core and leave none to the emulated
    copy engines, so the launcher's count goes with each piece of work."""

    def openmp_team_size():
        info = torch.__config__.parallel_info()
        return int(info.split("omp_get_max_threads() :")[1].split()[0])

    seen = []
    before = torch.get_num_threads()
    with EmulatedLink(bandwidth="1 GB/s", latency="50 us") as link:
        try:
            torch.set_num_threads(2)
            link.launch(lambda: (torch.ones(64).sum(), seen.append(openmp_team_size())))
            torch.set_num_threads(1)
            link.launch(lambda: seen.append(openmp_team_size()))
            link.synchronize()
        finally:
            torch.set_num_threads(before)
    assert seen == [2, 1]


def test_a_recording_becomes_a_chrome_trace(link, tmp_path):
    with link.record() as recording:
        link.to_device(link.device_buffer(256), link.host_buffer(256), label="weights")
        link.to_host(link.host_buffer(256), link.device_buffer(256), label="grads")
    lanes = recording.lanes()
    assert [label for *_, label in lanes["H2D"]] == ["weights"] and len(lanes["D2H"]) == 1
    path = trace.write_chrome_trace(lanes, tmp_path / "link.json")
    events = json.loads(path.read_text())["traceEvents"]
    copies = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in copies} == {"weights", "grads"} and all(
        e["dur"] >= 0 for e in copies
    )
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"H2D", "D2H"}


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
        open_link(
            emulated=False, bandwidth="1 GB/s"
        ) if torch.cuda.is_available() else EmulatedLink(bandwidth="1 GB")


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
    with pytest.raises(RuntimeError, match="closed"):
        link.launch(print)


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
def test_cuda_has_a_copy_stream_per_direction_and_they_run_at_once():
    with CudaLink() as cuda:
        assert cuda.h2d_stream != cuda.d2h_stream
        n = 64 * 2**20  # 256 MiB each way
        up_src, up_dst = cuda.host_buffer(n), cuda.device_buffer(n)
        down_src, down_dst = cuda.device_buffer(n), cuda.host_buffer(n)
        torch.cuda._sleep(2_000_000_000)  # hold the compute stream for a while
        up = cuda.to_device(up_dst, up_src, after="compute")
        down = cuda.to_host(down_dst, down_src, after=None)
        down.synchronize()
        assert not up.done()  # the copy down did not queue behind the held copy up: an engine each
        cuda.synchronize()


@pytest.mark.gpu
def test_cuda_pinned_buffers_are_unregistered_when_dropped():
    with CudaLink() as cuda:
        buffer = cuda.host_buffer(2**20)
        assert buffer.is_pinned() and cuda.pinned_bytes == 4 * 2**20
        del buffer
        gc.collect()
        assert cuda.pinned_bytes == 0


@pytest.mark.gpu
def test_cuda_copy_runs_while_the_compute_stream_is_busy():
    """Ordering from events: a copy ordered after nothing finishes while the compute stream is still
    held by a long kernel (about a second), which its end marker has not reached."""
    with CudaLink() as cuda:
        host = cuda.host_buffer(64 * 2**20)  # 256 MiB
        device = cuda.device_buffer(host.shape)
        torch.cuda._sleep(2_000_000_000)  # hold the compute stream
        end = cuda.mark()
        transfer = cuda.to_device(device, host, after=None)
        transfer.synchronize()
        assert not end.reached()
        cuda.synchronize()
        assert transfer.end <= end.time


def test_torch_threads_come_back_whatever_order_links_close_in():
    before = torch.get_num_threads()
    first, second = EmulatedLink(), EmulatedLink()  # a notebook cell run twice
    first.close()
    if before > 1:  # (torch on one thread has no core to give)
        assert torch.get_num_threads() < before  # the second link still keeps its core
    second.close()
    assert torch.get_num_threads() == before


def test_a_link_dropped_without_close_gives_back_its_threads_and_its_core():
    """A notebook cell `link = open_link()` run again drops the previous link without close()."""
    gc.collect()
    threads, torch_threads = threading.active_count(), torch.get_num_threads()
    for _ in range(5):
        link = EmulatedLink(latency=0)
        out = link.device_buffer(4)
        link.to_device(out, link.host_buffer(4)).synchronize()
        link.launch(torch.add, out, 1, out=out)
        marker = link.mark()
        marker.time  # (a marker keeps its link alive while it is held)
        del link, marker
    gc.collect()
    assert threading.active_count() == threads and torch.get_num_threads() == torch_threads


def test_ctrl_c_during_a_pageable_copy_stops_the_caller(link, monkeypatch):
    """A pageable copy runs on the caller's thread: Ctrl-C there is the user stopping the program
    (the command line exits 130), not a failed copy to wrap in a RuntimeError."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(link, "_paced_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        link.to_device(link.device_buffer(2), torch.zeros(2))  # ordinary (pageable) memory
    monkeypatch.undo()
    link.synchronize()  # nothing is left hanging
    out = link.device_buffer(2)
    link.to_device(out, torch.ones(2)).synchronize()
    assert torch.equal(out, torch.ones(2))


def test_a_copy_that_fails_on_its_engine_raises_to_whoever_waits(link, monkeypatch):
    def failing(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(link, "_paced_copy", failing)
    transfer = link.to_device(link.device_buffer(2), link.host_buffer(2))
    assert transfer._landed.wait(WATCHDOG)  # it does not hang
    with pytest.raises(RuntimeError, match="failed: MemoryError"):
        transfer.synchronize()
    monkeypatch.undo()
    # as on a GPU: refused at once, on the caller's thread
    target = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="^targets: expected tensors autograd does not track"):
        staging = torch.zeros(8)
        link.to_device_scattered([(target, staging[:3])], link.host_buffer(8), staging)


# ----------------------------------------------------------------------------- timing that holds


class FakeEvent:
    """A CUDA event on a fake GPU clock: elapsed_time answers in float32 milliseconds, as CUDA
    does."""

    def __init__(self, clock):
        self.t = clock["now"]

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return float(torch.tensor((other.t - self.t) * 1e3, dtype=torch.float32))


def test_event_times_keep_their_precision_as_the_link_ages():
    """From one epoch event, float32 milliseconds step by 0.5 ms two hours on: an 8 µs copy read
    as 0 (or 0.5 ms). Anchors recorded as the link is used keep every interval to well under 1
    µs."""
    from offloadlab.link import _EventClock

    fake = {"now": 0.0}
    clock = _EventClock(lambda: FakeEvent(fake), every=1.0, now=lambda: fake["now"])
    epoch = clock.anchor().event
    while fake["now"] < 7200:  # two hours of use, a call every half second
        fake["now"] += 0.5
        clock.anchor()
    anchor = clock.anchor()
    begin = FakeEvent(fake)
    fake["now"] += 8e-6
    finish = FakeEvent(fake)
    # what the epoch alone gives
    assert epoch.elapsed_time(finish) - epoch.elapsed_time(begin) in (0.0, 0.5)
    interval = anchor.seconds_to(finish) - anchor.seconds_to(begin)
    assert abs(interval - 8e-6) < 1e-7
    # and the absolute time stays on the link's clock
    assert abs(anchor.seconds_to(begin) - 7200.0) < 1e-3


def test_event_times_after_a_long_idle_spell_stay_precise_within_it():
    from offloadlab.link import _EventClock

    fake = {"now": 0.0}
    clock = _EventClock(lambda: FakeEvent(fake), every=1.0, now=lambda: fake["now"])
    fake["now"] = 5000.0  # nothing for over an hour, then a burst of copies
    anchor = clock.anchor()
    times = []
    for _ in range(4):
        times.append(anchor.seconds_to(FakeEvent(fake)))
        fake["now"] += 3e-6
    assert all(abs((b - a) - 3e-6) < 1e-7 for a, b in zip(times, times[1:]))


def test_a_copy_too_short_for_the_clock_has_no_bandwidth_rather_than_a_division_by_zero(link):
    transfer = link.to_device(link.device_buffer(0), link.host_buffer(0))
    transfer.synchronize()
    transfer._start = transfer._end = 1.0  # as two events in one tick of the clock would read
    with pytest.raises(RuntimeError, match="below the resolution of the link's clock"):
        transfer.bandwidth


def test_the_link_says_how_each_buffer_was_pinned(link):
    buffer = link.host_buffer(16)
    assert link.pinning_of(buffer) == "emulated" and link.pinning_of(torch.zeros(4)) is None


def test_a_refused_registration_warns_with_cudas_reason_not_ulimit():
    from offloadlab.link import _fallback_warning

    text = _fallback_warning(3 << 29, 1 << 31, 2, "out of memory")
    assert (
        "CUDA error 2 (out of memory)" in text and "memory limit" in text and "ulimit" not in text
    )
    assert f"{3 << 29} → {1 << 31} bytes" in text


def test_cuda_links_fallback_is_a_user_warning_with_cudas_reason(monkeypatch):
    """Without a GPU, the CUDA runtime faked: a refused cudaHostRegister must be seen (Python's
    default filters hid the ResourceWarning), say CUDA's reason, and count the rounded bytes."""
    # (the CUDA link lives there since link became a package)
    from offloadlab.link import cuda as link_module

    class Refusing:
        def cudaHostRegister(self, address, nbytes, flags):
            return 2

        def cudaGetErrorString(self, status):
            return "out of memory"

    real_empty = torch.empty
    monkeypatch.setattr(link_module.torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(link_module, "_clear_cuda_error", lambda: None)
    monkeypatch.setattr(
        link_module.torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k)
    )
    cuda = CudaLink.__new__(CudaLink)  # (its constructor needs a GPU; the allocation path does not)
    Link.__init__(cuda)
    cuda._warned_fallback = False
    with pytest.warns(UserWarning, match=r"CUDA error 2 \(out of memory\)"):
        buffer = cuda.host_buffer(3 * 2**18)  # 3 MiB of fp32
    assert cuda.pinning_of(buffer) == "caching allocator" and cuda.pinned_bytes == 4 * 2**20
    assert torch.isnan(buffer).all()  # poisoned, like every fresh buffer


class _RegisteringRuntime:
    """cudaHostRegister as the driver keeps it, without a GPU: pages are what get locked, so a
    range that shares a page with one already registered is refused
    (cudaErrorHostMemoryAlreadyRegistered)."""

    def __init__(self, page: int):
        self.page, self.registered = page, {}  # base address → (first page, last page)

    def cudaHostRegister(self, address, nbytes, flags):
        first, last = address // self.page, (address + nbytes - 1) // self.page
        if any(a <= last and first <= b for a, b in self.registered.values()):
            return 712
        self.registered[address] = (first, last)
        return 0

    def cudaHostUnregister(self, address):
        del self.registered[address]  # (CUDA wants the very address that was registered)
        return 0

    def cudaGetErrorString(self, status):
        return "part or all of the requested memory range is already mapped"


def test_small_host_buffers_each_register_on_pages_of_their_own(monkeypatch):
    """Many small pinned buffers (a model's biases and norms, staging slots) from one CudaLink:
    each is registered, none falls back to the caching allocator, and each is unregistered when
    dropped."""
    import mmap
    import warnings

    runtime = _RegisteringRuntime(mmap.PAGESIZE)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    cuda = CudaLink.__new__(CudaLink)  # (its constructor needs a GPU; the allocation path does not)
    Link.__init__(cuda)
    cuda._warned_fallback = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        buffers = [
            cuda.host_buffer(shape, dtype)
            for _ in range(4)
            for shape in [(1,), (3, 5), (100,), (1000,), (mmap.PAGESIZE // 4 + 1,)]
            for dtype in (torch.float32, torch.bfloat16, torch.uint8)
        ]
    assert all(cuda.pinning_of(b) == "registered" for b in buffers) and len(
        runtime.registered
    ) == len(buffers)
    for b in buffers:
        assert b.data_ptr() % mmap.PAGESIZE == 0 and b.is_contiguous()
        # poisoned, as ever
        assert torch.isnan(b).all() if b.is_floating_point() else (b == 255).all()
    buffers[0].fill_(1)
    # one's writes stay in it
    assert not torch.isnan(buffers[0]).any() and torch.isnan(buffers[3]).all()
    pages = sum(last - first + 1 for first, last in runtime.registered.values())
    assert cuda.pinned_bytes == pages * mmap.PAGESIZE  # whole pages, counted as pinned
    del buffers, b
    gc.collect()
    assert runtime.registered == {} and cuda.pinned_bytes == 0


def test_one_cuda_link_per_device_for_whoever_was_given_none(monkeypatch):
    """The finding (issue 35): every CPUOffloadAdam made without link= made a CudaLink of its own,
    four of torch's 32 pooled streams each, a notebook cell run again taking four more."""
    import torch

    from offloadlab.link import cuda

    made = []

    class Made:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(cuda, "CudaLink", Made)
    monkeypatch.setattr(cuda, "_SHARED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    first = cuda.shared_cuda_link("cuda")
    assert cuda.shared_cuda_link("cuda:0") is first
    assert cuda.shared_cuda_link(torch.device("cuda", 1)) is not first
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_the_ledger_counts_bytes_copies_and_host_waits_as_a_gpu_would():
    """Link.traffic: bytes and copies each way; synchronize() (a copy's, the link's) and a copy of
    pageable memory hold the host; wait() does not (on a GPU only a stream waits); a wait on the
    thread running backward is counted apart, and apart again in the callback closing it."""
    import torch

    from offloadlab._torch_compat import EndOfBackward
    from offloadlab.link import EmulatedLink

    with EmulatedLink(bandwidth="8 GB/s", latency=0) as link:
        pinned = link.host_buffer(1024, torch.float32)
        device = link.device_buffer(1024, torch.float32)
        start = link.traffic.snapshot()
        link.to_device(device, pinned).wait()
        link.to_host(pinned, device).synchronize()
        link.to_host(torch.empty(256), device[:256])  # pageable: the host waits
        y = torch.ones(2, requires_grad=True)
        # one wait while backward issues work, one in the callback that closes the pass
        end = EndOfBackward(link.synchronize)
        y.register_hook(lambda g: (link.to_host(pinned, device).synchronize(), end.arm())[-1])
        (y * 2).sum().backward()
        link.synchronize()
        spent = {k: v - start[k] for k, v in link.traffic.snapshot().items()}
    assert spent == {
        "h2d_bytes": 4096,
        "d2h_bytes": 4096 + 1024 + 4096,
        "h2d_copies": 1,
        "d2h_copies": 3,
        "syncs": 5,
        "syncs_in_backward": 1,
        "syncs_ending_backward": 1,
    }


def test_host_times_stay_on_the_event_clock_as_the_two_clocks_drift():
    """The finding (issue 35): the CUDA link joined the host's clock to the GPU's once, when it
    was made; the two drift apart, so an hour on the CPU's lanes slid against the copies'. Host
    times are now placed from the newest anchor: with a GPU clock 100 ppm fast, two hours on, a
    host instant and an event recorded at it agree to within the drift of one anchor's second."""
    from offloadlab.link import _EventClock

    fake = {"now": 0.0}

    class DriftingEvent(FakeEvent):
        def __init__(self, clock):
            self.t = clock["now"] * (1 + 1e-4)  # the GPU's clock

    clock = _EventClock(lambda: DriftingEvent(fake), every=1.0, now=lambda: fake["now"])
    while fake["now"] < 7200:
        fake["now"] += 0.5
        clock.anchor()
    host = clock.host_seconds()
    event = clock.anchor().seconds_to(DriftingEvent(fake))
    assert abs(host - event) < 2e-4  # (joined once: 0.72 s apart)
    assert abs(host - 7200 * (1 + 1e-4)) < 2e-3


@pytest.mark.gpu
def test_cuda_a_copy_queued_behind_a_scatter_is_not_held_by_its_kernel():
    """The finding (issue 35): the scatter ran on the copy stream, so a scatter kernel waiting for
    SMs (behind a saturating GEMM) held every copy queued after it. Kernels behind a copy now run
    on the link's kernel stream: here that stream is held, and a later copy lands anyway; a copy
    into the staging buffer the scatter still reads waits for it."""
    with CudaLink() as cuda:
        n = 2**20
        host, staging = cuda.host_buffer(2 * n), cuda.device_buffer(2 * n)
        targets = [cuda.device_buffer(n), cuda.device_buffer(n)]
        with torch.cuda.stream(cuda.kernel_stream):
            torch.cuda._sleep(2_000_000_000)  # the kernel stream busy, as behind a GEMM
        pairs = list(zip(targets, staging.split(n)))
        scattered = cuda.to_device_scattered(pairs, host, staging, after=None)
        other = cuda.to_device(cuda.device_buffer(n), cuda.host_buffer(n), after=None)
        other.synchronize()
        assert not scattered.done()
        again = cuda.to_device_scattered(pairs, host, staging, after=None)
        scattered.synchronize()
        again.synchronize()
        assert all(torch.equal(t.cpu(), v) for t, v in zip(targets, host.split(n)))


def test_an_interrupt_between_counting_a_job_and_queueing_it_leaves_no_hang():
    """A KeyboardInterrupt that lands after an emulated stream counted a job but before it
    queued it (a fresh clone under load hung a lab's re-run cell this way) left the count one
    high, and synchronize() waited for a count of zero forever; it now waits for a mark."""
    import threading

    from offloadlab.link import EmulatedLink

    with EmulatedLink() as link:
        stream = link._compute
        with stream._lock:
            stream._pending += 1  # counted; the interrupt came before the put
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (link.synchronize(), done.set()), daemon=True)
        waiter.start()
        assert done.wait(30), "synchronize() hung on a job that was never queued"
        assert link.mark().time >= 0  # (marks now go through the queue, and are reached)
