"""The labs' measured challenges (offloadlab.grading), graded on links whose speed the test sets.

The labs' own run (tests/test_lab_checks.py) grades the worked answer and two wrong ones on the
one link the lab measured; here each bar is checked against a link's known rate, on either
side of it, and each way out of it (too many bytes, not a number) gives its own line.
"""

import pytest

from offloadlab import grading
from offloadlab.link import open_link


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
        outcome = grading.lab02_challenge(lambda link: 0.8e9, link, reference=link.bandwidth)
    assert not outcome and "above the reference" in outcome.line


def test_lab02_the_link_counts_the_bytes_a_probe_moves(capsys):
    with open_link(emulated=True, bandwidth=1.2e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(lambda link: two_size_probe(link, repeats=5), link,
                                          reference=link.bandwidth)
    assert not outcome and "the probe moved 52.0 MiB (measured by the link); at most 32 MiB" in outcome.line


@pytest.mark.parametrize("returned", [None, "1e9", float("nan"), -1.0, True])
def test_lab02_a_probe_that_returns_no_bandwidth_gets_one_line(returned, capsys):
    with open_link(emulated=True, bandwidth=1.2e9, latency=60e-6) as link:
        outcome = grading.lab02_challenge(lambda link: returned, link, reference=link.bandwidth)
    assert not outcome and f"the probe returned {returned!r}; expected a bandwidth in bytes/s" in outcome.line


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


def test_lab03_a_copy_before_the_work_is_too_slow(capsys):
    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(serial_step, link)
    overlapped = int(outcome.line.split("challenge: ", 1)[1].split("%", 1)[0])
    assert not outcome and overlapped < 20, outcome.line


# Each mistake where it cannot go unseen: a copy issued early lands inside the last step's work
# when the work is the longer; an unwaited copy is still moving when the check runs when it is.
@pytest.mark.parametrize("step, copy_share", [(unordered_step, 0.6), (unwaited_step, 1.25)],
                         ids=["not after the last use", "not waited for"])
def test_lab03_a_copy_out_of_order_reads_another_steps_bytes(step, copy_share, capsys):
    with open_link(emulated=True) as link:
        outcome = grading.lab03_challenge(step, link, copy_share=copy_share)
    assert not outcome and "read the bytes of another step" in outcome.line, outcome.line
