"""The labs' measured challenges (offloadlab_course.grading), graded on links whose speed the test
sets.

The labs' own run (tests/test_lab_checks.py) grades the worked answer and two wrong ones on the
one link the lab measured; here each bar is checked against a link's known rate, on either
side of it, and each way out of it (too many bytes, not a number) gives its own line.
"""

import enum
import random
import re
import time

import numpy as np
import pytest
import torch

from offloadlab.models import GPTConfig
from offloadlab.models import TinyGPT
from offloadlab.offload import CPUOffloadAdam
from offloadlab.streaming import StreamedModel
from offloadlab.link import open_link
from offloadlab_course import grading


def two_size_probe(link, repeats=3, small=2 * 2**20, large=8 * 2**20):
    """Lab 2's worked answer: α cancels in the difference of two sizes' fastest times."""
    host, device = link.host_buffer(large // 4), link.device_buffer(large // 4)

    def fastest_seconds(size):
        seconds = []
        for _ in range(repeats):
            transfer = link.to_device(device[: size // 4], host[: size // 4])
            transfer.synchronize()
            seconds.append(transfer.elapsed)
        return min(seconds)

    link.to_device(device[: small // 4], host[: small // 4]).synchronize()
    return (large - small) / (fastest_seconds(large) - fastest_seconds(small))


@pytest.mark.parametrize("bandwidth", [0.25e9, 1.2e9])
def test_lab02_a_probe_that_measures_passes_on_any_link(bandwidth, capsys):
    with open_link(emulated=True, bandwidth=bandwidth, latency=60e-6) as link:
        outcome = grading.lab02_challenge(two_size_probe, link, reference=link.bandwidth)
    assert outcome, capsys.readouterr().out
    assert "from 32.0 MiB of copies" in outcome.line


def test_lab02_a_number_known_in_advance_fails_on_another_link(capsys):
    with open_link(emulated=True, bandwidth=0.25e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(
            lambda link: (two_size_probe(link), 0.8e9)[1], link, reference=link.bandwidth
        )
    assert not outcome and "above the reference" in outcome.line


@pytest.mark.parametrize(
    "probe", [lambda link: link.bandwidth, lambda link: 2e9], ids=["link's own rate", "a constant"]
)
def test_lab02_a_probe_that_copies_nothing_fails(probe, capsys):
    """Eleventh probe pass C58, C59: a probe that returned the link's own rate, or the emulated
    link's default, passed 'from 0.0 MiB of copies'."""
    with open_link(emulated=True, bandwidth=2e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(probe, link, reference=2e9)
    assert not outcome and "the probe copied 0.0 MiB host→device" in outcome.line


def test_lab02_the_hidden_link_keeps_its_rate_from_the_probe(capsys):
    """C58: on the hidden link a probe read the answer off link.bandwidth; there it is refused,
    and the rate is drawn afresh each run, so no constant passes either, while a probe that
    measures does."""
    assert grading.lab02_hidden_challenge(two_size_probe), capsys.readouterr().out
    peeking = grading.lab02_hidden_challenge(lambda link: (two_size_probe(link), link.bandwidth)[1])
    assert not peeking and "keeps its rate from the probe: measure it" in peeking.line
    rates = {grading.lab02_hidden_rate() for _ in range(20)}
    assert len(rates) > 1 and all(0.1e9 <= r <= 1e9 for r in rates)


def test_lab02_the_link_counts_the_bytes_a_probe_moves(capsys):
    with open_link(emulated=True, bandwidth=1.2e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(
            lambda link: two_size_probe(link, repeats=5), link, reference=link.bandwidth
        )
    assert (
        not outcome
        and "the probe moved 52.0 MiB (measured by the link); at most 32 MiB" in outcome.line
    )


@pytest.mark.parametrize("returned", [None, "1e9", float("nan"), -1.0, True])
def test_lab02_a_probe_that_returns_no_bandwidth_gets_one_line(returned, capsys):
    with open_link(emulated=True, bandwidth=1.2e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(lambda link: returned, link, reference=link.bandwidth)
    assert (
        not outcome
        and f"the probe returned {returned!r}; expected a bandwidth in bytes/s" in outcome.line
    )


def overlapped_step(link, work, host, device):
    """Lab 3's worked answer: the copy after the buffer's last use, beside the work."""
    free = link.mark()
    transfer = link.to_device(device, host, after=free)
    link.launch(work)
    transfer.wait()


def serial_step(link, work, host, device):
    link.to_device(device, host).wait()
    link.launch(work)


def unordered_step(link, work, host, device):
    transfer = link.to_device(device, host, after=None)  # may land while the last step still reads
    link.launch(work)
    transfer.wait()


def unwaited_step(link, work, host, device):
    link.to_device(device, host, after=link.mark())
    link.launch(work)


@pytest.mark.parametrize("copy_share", [1.25, 0.6])
def test_lab03_a_copy_beside_the_work_passes_whichever_is_longer(copy_share, capsys):
    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(overlapped_step, link, copy_share=copy_share)
    assert outcome, outcome.line


def test_lab03_one_pass_starved_by_a_busy_machine_does_not_fail_a_right_step(capsys):
    """The under-load run failed the solved lab 3 once: on a machine busy with other work one
    pass's copies can be starved. A step that overlaps in a later pass passes; one that never
    overlaps still fails (below)."""
    calls = {"n": 0}

    def starved_then_overlapped(link, work, host, device):
        calls["n"] += 1
        if calls["n"] <= 16:  # the warm-up and the first measured pass: as if starved
            serial_step(link, work, host, device)
        else:
            overlapped_step(link, work, host, device)

    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(starved_then_overlapped, link)
    assert outcome, outcome.line


def test_lab03_a_copy_before_the_work_is_too_slow(capsys):
    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(serial_step, link)
    overlapped = int(outcome.line.split("challenge: ", 1)[1].split("%", 1)[0])
    assert not outcome and overlapped < 20, outcome.line


# Each mistake where it cannot go unseen: a copy issued early lands inside the last step's work
# when the work is the longer; an unwaited copy is still moving when the check runs when it is.
@pytest.mark.parametrize(
    "step, copy_share",
    [(unordered_step, 0.6), (unwaited_step, 1.25)],
    ids=["not after the last use", "not waited for"],
)
def test_lab03_a_copy_out_of_order_reads_another_steps_bytes(step, copy_share, capsys):
    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(step, link, copy_share=copy_share)
    assert not outcome and "read the bytes of another step" in outcome.line, outcome.line


# Lab 1: the state is counted at its peak. Counted after the step only, a plain AdamW that frees
# its gradients with zero_grad() read 6.00 B/param and passed, though it held every gradient at
# the end of backward: 8 B/param, what the challenge is about.
LAB01_MODEL = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32)


def adamw_freeing_gradients_after_the_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, [optimizer]


def adamw_inside_backward(model):
    optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    def update(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(update)
    return (lambda: None), list(optimizers.values())


def test_lab01_gradients_freed_only_after_the_step_count_at_their_peak(capsys):
    outcome = grading.lab01_challenge(adamw_freeing_gradients_after_the_step, LAB01_MODEL, "cpu")
    assert not outcome, outcome.line
    assert "8.00 bytes of state a parameter at the peak" in outcome.line, outcome.line


def test_lab01_an_update_inside_backward_passes_at_six_bytes(capsys):
    outcome = grading.lab01_challenge(adamw_inside_backward, LAB01_MODEL, "cpu")
    assert outcome, outcome.line
    assert re.search(r"✓ challenge: 6\.0\d bytes", outcome.line), outcome.line


def adamw_silencing_the_counter(how):
    """A plain AdamW (8 B/param inside backward) whose trainer keeps the grader's counter from
    seeing backward: by rebinding torch's hook registration, or by removing every hook."""

    def trainer(model):
        step, optimizers = adamw_freeing_gradients_after_the_step(model)
        if how == "rebinds":
            torch.Tensor.register_post_accumulate_grad_hook = lambda self, hook: None
            torch.Tensor.untyped_storage = lambda self: torch.UntypedStorage(0)
        else:  # before each forward, so before the backward the grader counts in

            def clear(module, inputs):
                for p in model.parameters():
                    if p._post_accumulate_grad_hooks is not None:
                        p._post_accumulate_grad_hooks.clear()

            model.register_forward_pre_hook(clear)
        return step, optimizers

    return trainer


def adamw_hiding_gradients(how):
    """A plain AdamW whose hooks take each gradient off its parameter as backward makes it and
    keep it (or a copy) in a list of the trainer's own, handed back for the step: every gradient
    is alive at the end of backward, 8 B/param, though no ``.grad`` holds one."""

    def trainer(model):
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        hidden = {}

        def hide(p):
            hidden[p] = p.grad.clone() if how == "copies" else p.grad
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(hide)

        def step():
            for p in params:
                p.grad = hidden.pop(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, [optimizer]

    return trainer


@pytest.mark.parametrize("how", ["keeps", "copies"])
def test_lab01_gradients_kept_off_the_parameters_still_count(how, capsys):
    outcome = grading.lab01_challenge(adamw_hiding_gradients(how), LAB01_MODEL, "cpu")
    assert not outcome, outcome.line
    assert "8.00 bytes of state a parameter at the peak" in outcome.line, outcome.line


@pytest.mark.parametrize("how", ["rebinds", "clears"])
def test_lab01_a_trainer_cannot_hide_backward_from_the_counter(how, monkeypatch):
    """The counter registers its hooks and reads storages with torch's own functions, kept when
    the course was imported; and a gradient it did not see fails the challenge."""
    for name in ("register_post_accumulate_grad_hook", "untyped_storage"):
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))  # (restored after)
    outcome = grading.lab01_challenge(adamw_silencing_the_counter(how), LAB01_MODEL, "cpu")
    assert not outcome, outcome.line
    expected = "8.00 bytes" if how == "rebinds" else "the counter saw"
    assert expected in outcome.line, outcome.line


# Lab 7: the bar is a reference tier read in the same call, taking turns with the student's, so
# a disk slower now than when the lab measured it (another process reading, a cache gone cold)
# moves both rates together. The rate the lab passes in is only shown.
def test_lab07_large_requests_pass_though_the_disk_was_faster_when_the_lab_measured_it(
    tmp_path, capsys
):
    idle_rate = 1e12  # far above any disk: the old bar, share × this, failed every tier
    outcome = grading.lab07_challenge(tmp_path, 2**20, 8, idle_rate, params=2 * 2**20)
    assert outcome, outcome.line
    assert "step 1 measured 1e+03 GB/s" in outcome.line


# Another process's busy spell can cover every one of the student's first reads (CI: the solved
# lab's 1 MiB, depth-8 tier, the reference's own settings, read at under half the reference).
def test_lab07_a_busy_spell_over_the_first_reads_is_not_the_verdict(tmp_path, monkeypatch, capsys):
    from offloadlab.nvme import FileTier

    read, slowed = FileTier.read, []

    def read_in_a_busy_spell(tier, start, out):
        if tier.path.name == "yours.bin" and len(slowed) < 5:
            slowed.append(tier)
            time.sleep(0.5)  # an 8 MiB read takes milliseconds
        read(tier, start, out)

    monkeypatch.setattr(FileTier, "read", read_in_a_busy_spell)
    outcome = grading.lab07_challenge(tmp_path, 2**20, 8, 1e9, params=2 * 2**20)
    assert len(slowed) == 5
    assert outcome, outcome.line


# On CI the solved lab, whose tier has the reference's own settings, read at 45 % of the
# reference in every one of 129 rounds: the tier made first read slower. Here the file made
# first reads slowly on purpose; the reference made before the student's takes that cost.
def test_lab07_a_disk_slower_for_the_file_made_first_is_not_the_students_fault(
    tmp_path, monkeypatch, capsys
):
    from offloadlab.nvme import FileTier

    made, read = [], FileTier.read
    original_init = FileTier.__init__

    def init_in_order(tier, *args, **kwargs):
        original_init(tier, *args, **kwargs)
        made.append(tier)

    def read_slower_if_first(tier, start, out):
        if tier is made[0]:
            time.sleep(0.05)  # an 8 MiB read takes milliseconds
        read(tier, start, out)

    monkeypatch.setattr(FileTier, "__init__", init_in_order)
    monkeypatch.setattr(FileTier, "read", read_slower_if_first)
    outcome = grading.lab07_challenge(tmp_path, 2**20, 8, 1e9, params=2 * 2**20, patience_s=0)
    assert outcome, outcome.line


def test_lab07_small_requests_one_at_a_time_fail_beside_the_reference(tmp_path, capsys):
    outcome = grading.lab07_challenge(tmp_path, 4096, 1, 1.0, params=2 * 2**20)
    assert not outcome and "at least 50% needed" in outcome.line, outcome.line
    assert list(tmp_path.iterdir()) == []  # both tiers' files are gone


# Lab 4: the optimizer's device buffers and its copies, counted by the link it was built on.
LAB04_MODELS = [
    GPTConfig(layers=2, hidden=128, heads=4, vocab=512, seq=64),
    GPTConfig(layers=3, hidden=192, heads=4, vocab=768, seq=64),
]


def offload_with(bucket_bytes, lr=1e-3):
    def offload(model, link):
        size = bucket_bytes(sum(p.numel() * p.element_size() for p in model.parameters()))
        return CPUOffloadAdam(
            model.parameters(), lr=lr, link=link, bucket_bytes=size, accumulation_steps=1
        )

    return offload


@pytest.mark.parametrize("config", LAB04_MODELS, ids=["lab", "hidden"])
def test_lab04_a_bucket_a_third_of_the_budget_passes_on_either_model(config, capsys):
    outcome = grading.lab04_challenge(
        offload_with(lambda gradient_bytes: int(0.4 * gradient_bytes / 3)), config, "cpu"
    )
    assert outcome, outcome.line


def test_lab04_a_bucket_tuned_to_one_model_sends_too_many_copies_on_the_other(capsys):
    tuned = offload_with(lambda gradient_bytes: 248 * 2**10)  # passes on the lab's model
    assert grading.lab04_challenge(tuned, LAB04_MODELS[0], "cpu")
    outcome = grading.lab04_challenge(tuned, LAB04_MODELS[1], "cpu")
    assert (
        not outcome
        and "20 device→host copies a step (counted by the link; at most 16)" in outcome.line
    )


def test_lab04_the_default_bucket_holds_the_whole_model_three_times(capsys):
    outcome = grading.lab04_challenge(
        lambda model, link: CPUOffloadAdam(model.parameters(), link=link), LAB04_MODELS[0], "cpu"
    )
    assert not outcome and "device buffers of 300% of the gradients' bytes" in outcome.line, (
        outcome.line
    )


def test_lab04_an_optimizer_not_on_the_given_link_gets_one_line(capsys):
    outcome = grading.lab04_challenge(
        lambda model, link: CPUOffloadAdam(model.parameters()), LAB04_MODELS[0], "cpu"
    )
    assert not outcome and "no gradient went down the link" in outcome.line


def test_lab04_another_learning_rate_leaves_adamw(capsys):
    outcome = grading.lab04_challenge(
        offload_with(lambda gradient_bytes: 2**20, lr=1e-2), LAB04_MODELS[0], "cpu"
    )
    assert not outcome and "the loss left fp32 AdamW's" in outcome.line, outcome.line


# Lab 8: the choice is graded on counted bytes, at nodes on both sides of the crossover.
def lab08_right(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):
    sent = (ranks - 1) / ranks * tensor_bytes
    carried = max(down, up) if duplex == "full" else down + up
    return "shard" if sent / interconnect <= carried / host_link else "offload"


@pytest.mark.parametrize("ranks, down, up", [(2, 4e6, 4e6), (8, 2e6, 2e6), (4, 2e6, 6e6)])
def test_lab08_the_shorter_traffic_time_is_right_on_every_node(ranks, down, up, capsys):
    outcome = grading.lab08_challenge(lab08_right, 6e6, ranks, down, up)
    assert outcome and "all 12 nodes chosen right" in outcome.line, outcome.line


def test_lab08_a_ring_size_typed_in_fails_on_another_ring(capsys):
    def two_ranks(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):
        return lab08_right(tensor_bytes, 2, down, up, interconnect, host_link, duplex)

    assert grading.lab08_challenge(two_ranks, 6e6, 2, 4e6, 4e6)
    outcome = grading.lab08_challenge(two_ranks, 6e6, 8, 2e6, 2e6)
    assert not outcome and "nodes chosen wrong" in outcome.line


def test_lab08_the_duplex_decides_between_its_two_crossovers(capsys):
    # Half duplex doubles the host link's time: the nodes at 1.5 times the full-duplex crossover
    # flip.
    def full_always(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):
        return lab08_right(tensor_bytes, ranks, down, up, interconnect, host_link, "full")

    outcome = grading.lab08_challenge(full_always, 6e6, 2, 4e6, 4e6)
    assert not outcome and outcome.line.startswith("✗ challenge: 2 of 12 nodes chosen wrong"), (
        outcome.line
    )


def test_lab08_an_answer_that_is_not_a_choice_gets_one_line(capsys):
    outcome = grading.lab08_challenge(lambda *args: True, 6e6, 2, 4e6, 4e6)
    assert not outcome and "expected 'shard' or 'offload'" in outcome.line


# Lab 6: a streamed run's device buffers and its bytes up, both counted by the link.
LAB06_MODEL = GPTConfig(layers=4, hidden=256, heads=4, vocab=4096, seq=64)
LAB06_BLOCK = sum(p.numel() * p.element_size() for p in TinyGPT(LAB06_MODEL).blocks[0].parameters())


def streamed_with(buffers):
    return lambda model, link, budget: StreamedModel(model, link, buffers=buffers)


@pytest.mark.parametrize("blocks, buffers", [(5, 3), (6.5, 4)])
def test_lab06_the_most_buffers_that_fit_pass(blocks, buffers, capsys):
    outcome = grading.lab06_challenge(
        streamed_with(buffers), LAB06_MODEL, "cpu", torch.float32, int(blocks * LAB06_BLOCK)
    )
    assert outcome, outcome.line


@pytest.mark.parametrize(
    "blocks, buffers, why",
    [(5, 4, "at most 15.06 MiB"), (6.5, 3, "16.12 MiB with the most")],
    ids=["over the budget", "a buffer short"],
)
def test_lab06_one_buffer_off_fails(blocks, buffers, why, capsys):
    outcome = grading.lab06_challenge(
        streamed_with(buffers), LAB06_MODEL, "cpu", torch.float32, int(blocks * LAB06_BLOCK)
    )
    assert not outcome and why in outcome.line, outcome.line


def test_lab06_something_else_than_a_streamed_model_gets_one_line(capsys):
    outcome = grading.lab06_challenge(
        lambda model, link, budget: None, LAB06_MODEL, "cpu", torch.float32, 5 * LAB06_BLOCK
    )
    assert not outcome and "returned NoneType; expected a StreamedModel" in outcome.line


# Issue 37, items 7 and 10: the helpers gave -6.0, ZeroDivisionError or "unsupported operand".
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: grading.one_buffer_pass_seconds(-3, 1.0, 1.0), "items: expected a whole number"),
        (lambda: grading.one_buffer_pass_seconds(3, -1.0, 1.0), "copy_seconds: expected"),
        (lambda: grading.one_buffer_pass_seconds(2.5, 1.0, 1.0), "items: expected"),
        (
            lambda: grading.exchange_seconds(1e9, 0, 1e9),
            "h2d_rate: expected a positive number; got 0 ",
        ),
        (lambda: grading.exchange_seconds("1e9", 1e9, 1e9), "nbytes: expected a number ≥ 0"),
        (lambda: grading.exchange_seconds(1e9, 1e9, float("nan")), "d2h_rate: expected"),
        (
            lambda: grading.disk_step_seconds(None, 1e9, 1e9),
            "params: expected a number ≥ 0; got None",
        ),
        (lambda: grading.disk_step_seconds(1e6, 1e9, -1), "write_rate: expected"),
        (lambda: grading.lab08_challenge(lambda *a: "shard", 6e6, 0, 4e6, 4e6), "ranks: expected"),
        (lambda: grading.lab08_challenge(lambda *a: "shard", 6e6, 2, 0, 0), "down, up: expected"),
        (lambda: grading.lab08_challenge(lambda *a: "shard", "6e6", 2, 4e6, 4e6), "tensor_bytes:"),
        (lambda: grading.lab07_challenge(".", None, 8, 1e9), "block_bytes: expected a whole"),
        (
            lambda: grading.lab06_challenge(
                streamed_with(2), LAB06_MODEL, "cpu", torch.float32, -1
            ),
            "budget: expected a whole number of bytes",
        ),
    ],
)
def test_a_helper_given_a_wrong_argument_names_it_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as refused:
        call()
    assert "\n" not in str(refused.value)


def test_the_helpers_take_numpys_numbers():
    import numpy as np

    assert grading.one_buffer_pass_seconds(np.int64(3), np.float32(1.0), 1.0) == 6.0
    assert grading.exchange_seconds(np.float64(2e9), 1e9, np.int64(10**9)) == 2.0


@pytest.mark.parametrize(
    "challenge, name",
    [
        (lambda: grading.lab01_challenge(None, LAB06_MODEL, "cpu"), "trainer"),
        (lambda: grading.lab04_challenge(None, LAB06_MODEL, "cpu"), "offload"),
        (lambda: grading.lab06_challenge(None, LAB06_MODEL, "cpu", torch.float32, 10**8), "stream"),
        (lambda: grading.lab08_challenge(None, 6e6, 2, 4e6, 4e6), "choose"),
        (lambda: grading.lab02_challenge(None, None, 1e9), "probe"),
        (lambda: grading.lab03_challenge(None, None), "step"),
        (lambda: grading.lab05_challenge(None, None), "prefetch"),
    ],
)
def test_an_unanswered_challenge_says_what_is_missing(challenge, name, capsys):
    """lab05_challenge(None, link) said "'NoneType' object is not callable"."""
    outcome = challenge()
    assert not outcome and outcome.line.startswith(f"✗ challenge: {name}: expected your function")
    assert outcome.line.endswith("got None") and capsys.readouterr().out == outcome.line + "\n"


def adamw_with_a_master_out_of_sight(how):
    """Lab 1's worked answer (AdamW inside backward, bf16 moments: 6 B/param) plus an fp32
    master copy of each weight kept where the counter did not look: in numpy arrays, or in
    tensors made at set-up and swapped through .data (10 B/param)."""
    import numpy as np

    def trainer(model):
        step, optimizers = adamw_inside_backward(model)
        masters = {}
        for p in model.parameters():
            masters[p] = np.zeros(p.numel(), np.float32) if how == "numpy" else torch.zeros(1)

            def keep(p):
                if how == "numpy":
                    masters[p][:] = p.detach().float().reshape(-1).numpy()
                else:
                    masters[p].data = p.detach().float().reshape(-1).clone()

            p.register_post_accumulate_grad_hook(keep)
        return step, optimizers

    return trainer


@pytest.mark.parametrize("how", ["numpy", "swapped"])
def test_lab01_a_master_copy_out_of_sight_still_counts(how, capsys):
    outcome = grading.lab01_challenge(adamw_with_a_master_out_of_sight(how), LAB01_MODEL, "cpu")
    assert not outcome and "10.0" in outcome.line, outcome.line


def adamw_kept_out_of_sight(how):
    """Tenth probe pass C3, C4: fp32 AdamW state (14 B/param with the bf16 weights) kept where
    the counter did not look: numpy arrays, or tensors made at set-up and swapped through .data,
    with one-element placeholders standing in for the moments in optimizer.state."""
    import numpy as np

    def trainer(model):
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)  # (only its state dict is shown)
        kept = {}
        for p in params:
            n = p.numel()
            if how == "numpy":
                kept[p] = [np.zeros(n, np.float32) for _ in range(3)]
                optimizer.state[p] = {"exp_avg": kept[p][0], "exp_avg_sq": kept[p][1]}
            else:
                kept[p] = [torch.zeros(n) for _ in range(3)]
                optimizer.state[p] = {"exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)}

        def update(p):  # not AdamW's arithmetic: the counter's verdict is what is tested
            if how == "numpy":
                kept[p][2][:] = p.detach().float().reshape(-1).numpy()
            else:
                kept[p][2].data = p.detach().float().reshape(-1).clone()
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(update)
        return (lambda: None), [optimizer]

    return trainer


@pytest.mark.parametrize("how", ["numpy", "swapped"])
def test_lab01_state_kept_out_of_sight_still_counts(how, capsys):
    outcome = grading.lab01_challenge(adamw_kept_out_of_sight(how), LAB01_MODEL, "cpu")
    assert not outcome, outcome.line
    assert "have no AdamW moments" in outcome.line or "14.00 bytes" in outcome.line, outcome.line


@pytest.mark.parametrize(
    "made", [None, ((lambda: None), None), 3], ids=["none", "no optimizers", "a number"]
)
def test_lab01_a_trainer_that_returns_the_wrong_thing_fails_by_name(made, capsys):
    """Tenth pass C11, C12: a TypeError from the unpacking."""
    outcome = grading.lab01_challenge(lambda model: made, LAB01_MODEL, "cpu")
    assert not outcome and "must return (step, optimizers)" in outcome.line, outcome.line


def test_lab07_asks_at_its_start_for_the_disk_space_its_challenge_reserves():
    """The challenge's three tiers (two versions of ``params`` fp32 values each) are the lab's
    largest files at one time; the first cell's free-space check must cover them, or a student
    short of space learns it at the last step."""
    import inspect

    from offloadlab.units import parse_size
    from tests.test_chapter_cores import code_cells

    first = code_cells("labs/lab07_one_tier_further.md")[0]
    asked = re.search(r'check_disk_folder\(folder, "([^"]+)"\)', first)
    params = inspect.signature(grading.lab07_challenge).parameters["params"].default
    assert asked and parse_size(asked[1]) >= 3 * 2 * 4 * params + 3 * 2 * 4096


# Thirteenth probe pass, C26, C76, C93: a choice equal to everything, a StreamedModel on a link of
# its own (the grader's link saw no buffer), or one streaming a single block, passed.
def test_lab08_an_answer_equal_to_everything_is_not_a_choice(capsys):
    class Anything:
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        __hash__ = object.__hash__

    outcome = grading.lab08_challenge(lambda *args: Anything(), 6e6, 2, 4e6, 4e6)
    assert not outcome and "expected 'shard' or 'offload'" in outcome.line


# Fourteenth probe pass, W19, W20: a right choice returned as numpy's string (np.where over
# names) or a str subclass was refused as "not a choice", while a lying object must stay refused.
class _Choice(str, enum.Enum):
    SHARD = "shard"
    OFFLOAD = "offload"


@pytest.mark.parametrize(
    "kind",
    [
        np.str_,
        type("Choice", (str,), {}),
        np.array,  # np.where over scalars: a 0-d array (fifteenth pass, W101)
        _Choice,  # an Enum of str (W103)
    ],
    ids=["numpy", "subclass", "0-d-array", "str-enum"],
)
def test_lab08_a_right_choice_as_a_string_of_another_type_passes(kind, capsys):
    outcome = grading.lab08_challenge(lambda *a: kind(lab08_right(*a)), 6e6, 8, 2e6, 2e6)
    assert outcome and "all 12 nodes chosen right" in outcome.line, outcome.line


def test_lab08_a_string_equal_to_everything_is_still_judged_by_its_text(capsys):
    class Lying(str):
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        def __str__(self):  # (the fifteenth pass, W106: a text that lies about itself)
            return "offload" if random.random() < 0.5 else "shard"

        __hash__ = str.__hash__

    outcome = grading.lab08_challenge(lambda *args: Lying("shard"), 6e6, 8, 2e6, 2e6)
    assert not outcome and "nodes chosen wrong" in outcome.line, outcome.line


@pytest.mark.parametrize(
    "stream, said",
    [
        (
            lambda model, link, budget: StreamedModel(model, open_link(emulated=True), buffers=2),
            "runs on a link of its own",
        ),
        (
            lambda model, link, budget: StreamedModel(model, link, blocks=[model.blocks[0]]),
            "3 of the model's 4 blocks are not streamed",
        ),
    ],
    ids=["own link", "one block"],
)
def test_lab06_a_streaming_the_grader_cannot_count_fails(stream, said, capsys):
    outcome = grading.lab06_challenge(stream, LAB06_MODEL, "cpu", torch.float32, 5 * LAB06_BLOCK)
    assert not outcome and said in outcome.line, outcome.line
