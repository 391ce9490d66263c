"""The fourteenth and fifteenth probe passes' lows, each a test that failed before its fix."""

import os
import subprocess
import sys

import pytest

from offloadlab import sharding
from offloadlab.units import format_count, format_duration, format_size


# U101-U105: at the largest unit a number of a thousand or more printed as '1e+03 T'.
@pytest.mark.parametrize(
    "formatted, expected",
    [
        (lambda: format_count(1e15), "1,000 T"),
        (lambda: format_size(1e18), "1,000 PB"),
        (lambda: format_duration(3.6e6), "1,000 h"),
        (lambda: format_size(999.9996e15), "1,000 PB"),
        (lambda: format_count(999_999_999_999_999), "1,000 T"),
        (lambda: format_count(12_345e12), "12,345 T"),
    ],
)
def test_beyond_the_largest_unit_a_number_is_grouped_not_in_e_notation(formatted, expected):
    assert formatted() == expected


# U121, U122: a bad digits or a string gave errors that named no argument.
@pytest.mark.parametrize(
    "call, said",
    [
        (lambda: format_size(1e9, digits=-1), "digits: expected a positive integer"),
        (lambda: format_size("1e9"), "num_bytes: expected a number; got '1e9'"),
        (lambda: format_duration(None), "seconds: expected a number"),
        (lambda: format_count(True), "count: expected a number"),
    ],
)
def test_the_format_helpers_name_the_argument_they_refuse(call, said):
    with pytest.raises(ValueError, match="^" + said.replace("(", r"\(")):
        call()


# L158: '200 TFLOP' (a unit, not a rate) was refused as "it takes no unit".
def test_a_flop_count_where_a_rate_is_expected_is_refused_naming_the_form():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab",
            "overlap",
            "--link",
            "25 GB/s",
            "--compute",
            "200 TFLOP",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--compute: expected a rate such as '400 TFLOP/s'" in done.stderr, done.stderr
    assert "takes no unit" not in done.stderr


# U166: a negative or fractional dimension gave a pinned size from nonsense.
@pytest.mark.parametrize("shape", [(-5, 3), (2.5, 4), (4, True)])
def test_fsdp2_pinned_bytes_refuses_a_shape_that_is_no_shape(shape):
    with pytest.raises(ValueError, match=r"^shapes\[1\]: expected whole sizes ≥ 0"):
        sharding.fsdp2_pinned_bytes([(8, 8), shape], 2)


# K44: a write on an O_APPEND descriptor lands at the end; the recording put it at offset 0.
def test_the_commit_recording_places_an_append_where_it_landed(tmp_path):
    from offloadlab_course import crashes

    path = tmp_path / "state.bin"
    path.write_bytes(b"abcd")
    with crashes.record(path) as recording:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"XY")
        finally:
            os.close(fd)
    assert recording.calls == [("write", 4, b"XY")]
    assert path.read_bytes() == b"abcdXY"


# W2, W3: a lab 6 answer that streamed one block and then reassigned `blocks` (and `link`) to
# look whole reached the grader, which failed with an IndexError deep in streaming.py.
@pytest.mark.parametrize("attribute", ["blocks", "link"])
def test_a_streamed_models_blocks_and_link_cannot_be_swapped_after_streaming(attribute):
    from offloadlab.link import open_link
    from offloadlab.models import GPTConfig, TinyGPT
    from offloadlab.streaming import StreamedModel

    model = TinyGPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=8))
    with open_link(emulated=True) as link:
        streamed = StreamedModel(model, link, blocks=[model.blocks[0]])
        try:
            with pytest.raises(AttributeError, match=attribute):
                setattr(streamed, attribute, list(model.blocks) if attribute == "blocks" else link)
            assert streamed.blocks == (model.blocks[0],) and streamed.link is link
        finally:
            streamed.remove()


# F102-F110: options launch passed on unchecked, to fail (or not) in a rank.
@pytest.mark.parametrize(
    "options, said",
    [
        ({"bf16": "yes"}, "bf16: expected True or False"),
        ({"unused": 1}, "unused: expected True or False"),
        ({"save_at": 5, "steps": 2, "save": "ckpt"}, "save_at: expected a step up to steps (2)"),
        ({"save_at": 9, "save": "ckpt"}, "save_at: expected a step up to steps (4)"),
        ({"save": ""}, "save: expected a folder for the checkpoint"),
        ({"timeout": 0}, "timeout: expected a positive number"),
        ({"out": "."}, "out: expected a file in an existing folder"),
    ],
)
def test_fsdp_launch_refuses_an_option_by_name_before_starting_a_rank(options, said, tmp_path):
    from offloadlab import fsdp_offload

    options = {"out": tmp_path / "run.json", **options}
    with pytest.raises(ValueError, match="^" + said.replace("(", r"\(").replace(")", r"\)")):
        fsdp_offload.launch("adamw", **options)


# Fifteenth probe pass, L179, L202, L203: the plan at the command line's own largest model said
# '1e+06 B parameters'.
def test_the_plan_names_the_largest_model_it_takes_in_words():
    from offloadlab import planner

    report = planner.plan(planner.Workload(1e15), planner.Hardware("80 GB", "25 GB/s"))
    assert report.explain().startswith("model: 1,000 T parameters"), report.explain()[:80]


# U146: format_bandwidth refused a string naming format_size's argument.
def test_format_bandwidth_names_its_own_argument():
    from offloadlab.units import format_bandwidth

    with pytest.raises(ValueError, match="^bytes_per_s: expected a number"):
        format_bandwidth("25e9")


# K101: a pwrite on an O_APPEND descriptor lands at the end on Linux, whatever its offset.
def test_the_commit_recording_places_an_appending_pwrite_where_it_landed(tmp_path):
    from offloadlab_course import crashes

    path = tmp_path / "state.bin"
    path.write_bytes(b"abcd")
    with crashes.record(path) as recording:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.pwrite(fd, b"XY", 0)
        finally:
            os.close(fd)
    landed = path.read_bytes().index(b"XY")
    assert recording.calls == [("write", landed, b"XY")]
    assert crashes.final_image(recording) == path.read_bytes()


# W121: lab 6's grader read a StreamedModel's writable block_bytes; a student could raise it.
def test_a_streamed_models_buffer_size_cannot_be_changed_after_streaming():
    from offloadlab.link import open_link
    from offloadlab.models import GPTConfig, TinyGPT
    from offloadlab.streaming import StreamedModel

    model = TinyGPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=8))
    with open_link(emulated=True) as link:
        streamed = StreamedModel(model, link)
        try:
            size = streamed.block_bytes
            with pytest.raises(AttributeError, match="block_bytes"):
                streamed.block_bytes = 10 * size
            assert streamed.block_bytes == size
        finally:
            streamed.remove()


# L72 (carried since the thirteenth pass): a --disk where no file can be made gave a line that
# named the folder but not the flag.
def test_bench_nvme_names_the_disk_flag_when_its_folder_takes_no_file():
    done = subprocess.run(
        [sys.executable, "-m", "offloadlab", "bench", "nvme", "--disk", "/proc", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "--disk: cannot create a scratch file in /proc" in (
        done.stderr
    )
