"""Prefetcher on the emulated link (every machine) and on a GPU (where there is one).

The consumer's work is launched on the link's compute stream, so on the emulated link it runs
asynchronously, behind the host, as kernels do on a GPU: a buffer refilled before that work is
done would show up in the poison checks. Ordering checks read what each copy was ordered after
(recorded by a wrapping link), not timings.
"""

import gc

import pytest
import torch

from offloadlab import trace
from offloadlab.link import CudaLink, EmulatedLink, Link
from offloadlab.prefetch import Layout, Prefetcher
from tests.cuda_semantics import CudaOrderLink

VARIANTS = [dict(), dict(buffers=3), dict(buffers=1), dict(synchronous=True), dict(pinned=False)]


@pytest.fixture(params=["emulated", "CUDA order checker"])
def link(request):
    """The emulated link, and the same under CUDA's ordering rules with training on a stream of
    its own (tests/cuda_semantics.py): any violation fails the test when it ends."""
    if request.param == "emulated":
        with EmulatedLink(bandwidth="1 GB/s", latency=0) as emulated:
            yield emulated
        return
    with (
        CudaOrderLink(bandwidth="1 GB/s", latency=0) as checker,
        checker.compute_stream("training"),
    ):
        yield checker
        checker.check()


class Recorder:
    """The link, with each to_device call's ``after`` and each mark() recorded, in order."""

    def __init__(self, link):
        self.link, self.copies, self.marks = link, [], []

    def __getattr__(self, name):
        return getattr(self.link, name)

    def to_device(self, dst, src, after="compute", label=""):
        self.copies.append((label, after))
        return self.link.to_device(dst, src, after=after, label=label)

    def mark(self):
        marker = self.link.mark()
        self.marks.append(marker)
        return marker


Link.register(Recorder)  # (a link, to the Prefetcher that refuses anything else)


def items(count=6, numel=4096):
    return [torch.full((numel,), float(i)) for i in range(count)]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_every_variant_yields_the_right_tensors_in_order(link, variant):
    groups = [
        (torch.full((3, 5), float(i)), torch.arange(7, dtype=torch.int64) + i) for i in range(5)
    ]
    seen = []
    for a, b in Prefetcher(groups, link, **variant):
        seen.append((a.clone(), b.clone()))
        assert a.device.type == link.device.type
    assert len(seen) == 5
    for (a, b), (x, y) in zip(seen, groups):
        assert torch.equal(a, x) and torch.equal(b, y)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_no_buffer_is_overwritten_while_in_use_poison_and_check(link, variant):
    """The consumer's launched work checks each item, works on it, checks it again and poisons
    it: an item delivered before its copy landed, or refilled while still in use, shows up."""
    source = [link.host_buffer(2**18).fill_(float(i)) for i in range(8)]  # 1 MiB each, pinned
    failures = []

    def consume(i, tensor):
        if not torch.equal(tensor, source[i]):
            failures.append(f"item {i} was delivered before its copy landed")
        a = torch.randn(128, 128)
        for _ in range(20):
            a = torch.tanh(a @ a)
        if not torch.equal(tensor, source[i]):
            failures.append(f"item {i} was overwritten while in use")
        tensor.fill_(float("nan"))

    for _ in range(2):  # a second pass over the same buffers, too
        for i, tensor in enumerate(Prefetcher(source, link, **variant)):
            link.launch(consume, i, tensor)
        link.synchronize()
    assert failures == []


def test_each_refill_waits_for_the_release_of_its_buffer_across_passes(link):
    recorder = Recorder(link)
    prefetcher = Prefetcher(items(6), recorder, buffers=2)
    for _ in range(2):
        for _ in prefetcher:
            pass
    copies = recorder.copies
    assert [label for label, _ in copies] == [str(i) for i in range(6)] * 2
    # pass 1: the first two fills wait for the point where the buffers were allocated (on a GPU,
    # kernels still queued may be using that memory); fill i waits for the release of item i - 2
    allocated, *marks = recorder.marks
    assert copies[0][1] is allocated and copies[1][1] is allocated
    releases = [m for k, m in enumerate(marks) if k % 2 == 1]  # marks alternate: begin, release
    for i in range(2, 6):
        assert copies[i][1] is releases[i - 2]
    # pass 2 starts over the same buffers: its first fills wait for pass 1's last releases
    assert copies[6][1] is releases[4] and copies[7][1] is releases[5]


def test_double_buffer_issues_the_next_copy_before_the_consumer_is_done(link):
    recorder = Recorder(link)
    consumed = []
    for i, _ in enumerate(Prefetcher(items(4), recorder, buffers=2)):
        consumed.append((i, len(recorder.copies)))
    # when item i is handed over, copies up to item i + 1 have been issued (one ahead)
    assert consumed == [(0, 2), (1, 3), (2, 4), (3, 4)]


def test_one_buffer_and_synchronous_issue_only_after_the_consumer(link):
    for variant in (dict(buffers=1), dict(synchronous=True)):
        recorder = Recorder(link)
        consumed = []
        for i, _ in enumerate(Prefetcher(items(4), recorder, **variant)):
            consumed.append((i, len(recorder.copies)))
        assert consumed == [(0, 1), (1, 2), (2, 3), (3, 4)]
        if variant.get("synchronous"):
            assert all(after == "compute" for _, after in recorder.copies)


def test_items_may_be_a_generator(link):
    got = [t.clone() for t in Prefetcher((torch.full((4,), float(i)) for i in range(3)), link)]
    assert [t[0].item() for t in got] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("pinned_source", [True, False])
def test_sources_changed_between_passes_are_served_fresh(link, pinned_source):
    source = [
        link.host_buffer(16).fill_(i) if pinned_source else torch.full((16,), float(i))
        for i in range(3)
    ]
    prefetcher = Prefetcher(source, link)
    assert [t[0].item() for t in prefetcher] == [0.0, 1.0, 2.0]
    # (the docstring's rule: on a GPU the last copies may still read pinned sources)
    link.synchronize()
    for t in source:
        t.add_(10)
    assert [t[0].item() for t in prefetcher] == [10.0, 11.0, 12.0]


def test_pinned_memory_stays_at_the_buffers_and_goes_with_the_prefetcher(link):
    source = items(20, 1000)  # ordinary (pageable) tensors
    for _ in range(5):
        prefetcher = Prefetcher(source, link, buffers=2)
        for _ in prefetcher:
            pass
        # two staging buffers, not 20 copies
        assert link.pinned_bytes == prefetcher.host_staging_bytes == 2 * 4032
        del prefetcher
        # the last copies keep their staging buffers until they are known to be done
        link.synchronize()
        gc.collect()
        assert link.pinned_bytes == 0
    pinned = [link.host_buffer(1000) for _ in range(3)]
    # pinned sources are copied from in place
    assert Prefetcher(pinned, link).host_staging_bytes == 0


def test_a_pass_left_early_hands_its_buffer_back(link):
    prefetcher = Prefetcher(items(6), link)
    for i, _ in enumerate(prefetcher):
        if i == 2:
            break
    assert [t[0].item() for t in prefetcher] == [float(i) for i in range(6)]


def test_device_memory_stays_within_the_buffers(link):
    source = [torch.zeros(1000), torch.zeros(3000), torch.zeros(2000)]
    prefetcher = Prefetcher(source, link, buffers=2)
    assert prefetcher.device_bytes == 2 * 12032  # the largest item, 64-byte aligned, per buffer
    slots = {t.untyped_storage().data_ptr() for t in prefetcher._slots}
    for tensor in prefetcher:
        assert tensor.untyped_storage().data_ptr() in slots


def test_layout_aligns_or_packs():
    tensors = [torch.zeros(3), torch.zeros(5, dtype=torch.float16), torch.zeros(2)]
    assert [offset for *_, offset in Layout(tensors).specs] == [0, 64, 128] and Layout(
        tensors
    ).nbytes == 192
    packed = Layout(tensors, packed=True)
    assert [offset for *_, offset in packed.specs] == [0, 12, 24] and packed.nbytes == 32


def test_timeline_is_a_chrome_trace(link, tmp_path):
    prefetcher = Prefetcher(items(3), link)
    for _ in prefetcher:
        pass
    lanes = prefetcher.timeline()
    assert len(lanes["H2D"]) == len(lanes["compute"]) == 3
    assert trace.chrome_trace(lanes)["traceEvents"]
    trace.write_chrome_trace(lanes, tmp_path / "prefetch.json")


def test_bad_arguments(link):
    with pytest.raises(ValueError, match="^buffers: "):
        Prefetcher(items(), link, buffers=0)
    with pytest.raises(ValueError, match="^depth: "):
        Prefetcher(items(), link, buffers=2, depth=2)
    with pytest.raises(ValueError, match="^items: expected at least one"):
        Prefetcher([], link)
    with pytest.raises(ValueError, match="^items: expected contiguous host"):
        Prefetcher([torch.zeros(2), "not a tensor"], link)
    with pytest.raises(ValueError, match="^items: expected contiguous host"):
        Prefetcher([torch.zeros(4, 4).t()], link)


@pytest.mark.gpu
def test_cuda_prefetch_poison_and_memory():
    with CudaLink() as cuda:
        source = [cuda.host_buffer(2**22).fill_(float(i)) for i in range(6)]
        before = torch.cuda.memory_allocated()
        a = torch.randn(4096, 4096, device="cuda")
        # the second pass reuses the buffers: its first copies wait for the first pass
        for _ in range(2):
            prefetcher = Prefetcher(source, cuda, buffers=2)
            for i, tensor in enumerate(prefetcher):
                for _ in range(5):
                    a = a @ a / 4096
                assert torch.equal(tensor, source[i].cuda())
                tensor.fill_(float("nan"))
        assert (
            torch.cuda.memory_allocated() - before
            <= 2 * prefetcher.device_bytes + 4096 * 4096 * 4 * 2
        )


def test_two_passes_at_once_are_refused(link):
    prefetcher = Prefetcher(items(4), link)
    outer = iter(prefetcher)
    next(outer)
    with pytest.raises(RuntimeError, match="a pass over its buffers is still in progress"):
        iter(prefetcher)
    del outer  # left: the next pass may start
    assert sum(1 for _ in prefetcher) == 4


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_an_item_kept_past_its_buffers_reuse_is_refused_not_changed(link, buffers):
    """Each item is a view into a staging buffer, refilled when the item ``buffers - depth``
    places later is asked for. list(Prefetcher(...)) used to give [4, 3, 4, 3, 4] for items 0 to
    4."""
    source = [torch.full((4,), float(i)) for i in range(5)]
    with pytest.raises(
        RuntimeError, match=r"item 0 is still referenced, but its device buffer has held item"
    ):
        list(Prefetcher(source, link, buffers=buffers))
    kept = []
    with pytest.raises(RuntimeError, match=r"\.clone\(\) it to keep it"):
        for item in Prefetcher(source, link, buffers=buffers):
            kept.append(item)
    # refused as the first kept item is overwritten (one item later for one buffer)
    assert len(kept) <= buffers + 1
    # kept the right way
    cloned = [item.clone() for item in Prefetcher(source, link, buffers=buffers)]
    assert all(torch.equal(a, b) for a, b in zip(cloned, source))


@pytest.mark.parametrize(
    "buffers, depth", [(b, d) for b in (1, 2, 3) for d in range(b)], ids=lambda v: str(v)
)
def test_an_item_holds_its_own_data_until_the_one_buffers_minus_depth_after_it_is_asked_for(
    link, buffers, depth
):
    """The documented lifetime (issue 37, item 4: the docstring promised until the item
    ``buffers`` places later was delivered, and item 0 showed item 2's data one item later)."""
    source = [torch.full((4,), float(i)) for i in range(6)]
    passes = iter(Prefetcher(source, link, buffers=buffers, depth=depth))
    first = next(passes)
    for _ in range(1, buffers - depth):
        next(passes)
        link.synchronize()
        assert torch.equal(first, source[0])


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_a_backward_that_saved_an_item_whose_buffer_was_refilled_is_refused(link, buffers):
    """Issue 37, item 4: the gradient was computed from the item that refilled the buffer."""
    source = [torch.full((4, 4), float(i)) for i in range(buffers + 2)]
    x = torch.ones(4, requires_grad=True)
    passes = iter(Prefetcher(source, link, buffers=buffers))
    y = x @ next(passes)  # saves item 0 for x's gradient
    next(passes)  # item 0's buffer refills (the next item's, for one buffer)
    link.synchronize()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    del passes
    # used before the next item is asked for, it is right
    for i, weight in enumerate(Prefetcher(source, link, buffers=buffers)):
        x.grad = None
        (x @ weight).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 4.0 * i))


@pytest.mark.parametrize("items", [None, 5])
def test_items_that_are_not_a_sequence_are_named(link, items):
    """They were "'NoneType' object is not iterable"."""
    with pytest.raises(ValueError, match="^items: expected a sequence of host tensors"):
        Prefetcher(items, link)
