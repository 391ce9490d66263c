"""Overlap experiments on the emulated link: regime and ordering, never a wall-clock bound."""

import pytest

from offloadlab import experiment
from offloadlab.link import EmulatedLink
from offloadlab_course import plots


@pytest.fixture(scope="module")
def link():
    with EmulatedLink(bandwidth="1 GB/s") as emulated:
        yield emulated


def test_small_transfer_hides_and_large_one_stalls(link):
    # Compute of tens of milliseconds against a 64 KiB transfer (65 µs at 1 GB/s): on a busy
    # machine a thread waits a few milliseconds for a core, which a millisecond of compute (the
    # old size) did not outlast, and the small transfer "stalled".
    work = experiment.MatmulWork(512, 512, 8, "cpu")
    small = experiment.measure_overlap(link, "64 KiB", work, repeats=2)
    large_bytes = int(small.t_compute * 1e9 * 6)  # six times the compute at 1 GB/s
    large = experiment.measure_overlap(link, large_bytes, work, repeats=2)
    assert small.predicted.hidden and not large.predicted.hidden
    assert large.t_transfer > small.t_transfer
    assert large.measured_stall > small.measured_stall
    assert small.source == "emulated" and set(small.timeline) == {"compute", "H2D"}
    ((t_start, t_end, _),) = large.timeline["H2D"]
    ((c_start, c_end, _),) = large.timeline["compute"]
    assert t_start < c_end and c_start < t_end  # the transfer ran during the compute


def test_crossover_orders_batches(link):
    result = experiment.measure_crossover(
        link, batches=(1, 2, 4, 8, 16), rows_per_sample=16, hidden=256, count=4, repeats=2
    )
    computes = [r.t_compute for r in result.results]
    assert computes[-1] > computes[0]
    assert result.predicted_batch >= 1 and result.seconds_per_sample > 0
    assert result.results[0].measured_stall > 0  # batch 1 cannot hide the transfer
    assert result.measured_batch is None or result.measured_batch >= result.batches[1]


def test_bad_arguments(link):
    with pytest.raises(ValueError, match="^rows: "):
        experiment.MatmulWork(0, 8, 1, "cpu")
    with pytest.raises(ValueError, match="^repeats: "):
        experiment.measure_overlap(link, "1 MiB", experiment.MatmulWork(8, 8, 1, "cpu"), repeats=0)
    with pytest.raises(ValueError, match="^batches: "):
        experiment.measure_crossover(link, batches=(0, 1))
    with pytest.raises(ValueError, match="^lanes: "):
        plots.timeline({})


def test_overlap_timeline_is_a_chrome_trace(link, tmp_path):
    from offloadlab import trace

    result = experiment.measure_overlap(
        link, "1 MiB", experiment.MatmulWork(64, 128, 2, "cpu"), repeats=1
    )
    events = trace.chrome_trace(result.timeline)["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} == {"compute", "H2D"}
    assert trace.write_chrome_trace(result.timeline, tmp_path / "overlap.json").stat().st_size > 0
