"""The library's low findings of issue 37's thirteenth probe pass (640 probes, /tmp/probes45):
each wrong result, traceback or unclear line a user met, reproduced as they met it. Each test
failed before its fix. (The medium ones are in test_activations.py, test_student.py and
test_grading.py.)"""

from __future__ import annotations

import os
import pickle
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import offloadlab as ol
from offloadlab import experiment, fsdp_offload, sharding, trace, units
from offloadlab.link import open_link
from offloadlab.nvme import FileTier
from offloadlab.streaming import StreamedModel


@pytest.mark.parametrize(
    "options, said",
    [
        (dict(steps=0), "steps: expected a whole number ≥ 1; got 0"),  # F13: ran 4 steps
        (dict(micro_batches=0), "micro_batches: expected"),  # F16: ran 1
        (dict(clip=0.0), "clip: expected a positive number"),  # F15: ran unclipped
        (dict(processes=0), "processes: expected a whole number of processes"),  # F11
        (dict(out="/nonexistent/x.json"), "out: expected a file in an existing folder"),  # F12
        (dict(lr=1e-3), "lr: launch takes no such option"),
    ],
)
def test_launch_refuses_before_any_process_starts(options, said, tmp_path):
    options.setdefault("out", tmp_path / "run.json")
    with pytest.raises(ValueError, match=f"^{said}"):
        fsdp_offload.launch("offload", **options)


def test_launch_refuses_a_folder_without_a_checkpoint(tmp_path):  # F14: each rank's traceback
    with pytest.raises(ValueError, match="^load: expected a folder holding a checkpoint"):
        fsdp_offload.launch("offload", out=tmp_path / "run.json", load=tmp_path)


def test_a_value_that_rounds_up_is_shown_in_the_next_unit():  # U25, U26: '1e+03 MB'
    assert units.format_size(999_999_999) == "1 GB"
    assert units.format_count(999_999) == "1 M"
    assert units.format_size(1_048_000, binary=True) == "0.999 MiB"
    assert units.format_size(160e9) == "160 GB" and units.format_duration(0.25) == "250 ms"


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda: sharding.layout("zero3", "none", -7e9, 8), "params: "),  # U61: negative bytes
        (lambda: sharding.layout("zero3", "none", float("nan"), 8), "params: "),  # U62: nan
        (lambda: sharding.ring_bytes("broadcast", 100, 4), "collective: expected one of"),  # U63
        (lambda: sharding.ring_bytes("all-gather", 100, 0), "gpus: expected"),  # U64
        (lambda: sharding.fsdp2_pinned_bytes([(10, 10)], 0), "gpus: expected"),  # U66
    ],
)
def test_sharding_refuses_what_it_cannot_count_by_name(call, said):
    with pytest.raises(ValueError, match=f"^{said}"):
        call()


def test_a_zero_dim_parameter_is_one_value_to_fsdp2():  # U65: IndexError
    assert sharding.fsdp2_pinned_bytes([()], 2) == 2 * 4


@pytest.mark.parametrize(
    "lanes, said",
    [
        ({"a": [(None, 1, "x")]}, "lane 'a' interval 0: expected times in seconds"),  # U35
        ({"a": [(0, 1, "x")], "b": 5}, "lane 'b': expected a list"),  # U36
        ({"a": [(0, 1)]}, "lane 'a' interval 0: expected \\(start, end, label\\)"),  # U33
        ({"a": [(0, float("inf"), "x")]}, "lane 'a' interval 0: expected finite times"),  # U37
    ],
)
def test_a_malformed_timeline_is_named_by_lane_and_interval(lanes, said):
    with pytest.raises(ValueError, match=f"^lanes: {said}"):
        trace.chrome_trace(lanes)


def test_numpy_and_tensor_times_are_written(tmp_path):  # U38, U39: json refused them
    lanes = {"a": [(np.float32(0.5), np.float32(1.5), "x"), (torch.tensor(2.0), 3, "y")]}
    written = trace.write_chrome_trace(lanes, tmp_path / "t.json")
    events = [e for e in trace.chrome_trace(lanes)["traceEvents"] if e["ph"] == "X"]
    assert written.is_file() and [(e["ts"], e["dur"]) for e in events] == [(5e5, 1e6), (2e6, 1e6)]


@pytest.mark.parametrize("batches", [["a"], [1.7, 2.2], "124", [2, 0]])
def test_crossover_batches_must_be_whole_sizes(batches):  # U50, U51: int() truncated 1.7
    with open_link(emulated=True) as link:
        with pytest.raises(ValueError, match="^batches: expected"):
            experiment.measure_crossover(link, batches=batches)


def test_a_step_that_took_no_gradient_leaves_nothing_to_zero():  # O57: a false warning
    model = nn.Linear(4, 2)
    optimizer = ol.CPUOffloadAdam(model.parameters(), lr=1e-3)
    try:
        optimizer.zero_grad()
        optimizer.step()  # no backward yet: nothing taken
        model(torch.ones(3, 4)).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optimizer.step()
    finally:
        optimizer.close()


def test_a_file_tier_refuses_pickling_by_name(tmp_path):  # N45
    with FileTier(tmp_path / "t.bin", 1024) as tier:
        with pytest.raises(TypeError, match="^FileTier cannot be pickled"):
            pickle.dumps(tier)


def test_threads_writing_the_first_blocks_at_once_begin_one_step(tmp_path):  # N57
    block = 2**20 // 4
    values = torch.arange(16 * block, dtype=torch.float32)
    with FileTier(tmp_path / "t.bin", values.numel(), block_bytes=2**20) as tier:
        start = threading.Barrier(16)

        def write(i):
            start.wait()
            tier.write(i * block, values[i * block : (i + 1) * block])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        tier.commit()
        back = torch.empty_like(values)
        tier.read(0, back)
    assert torch.equal(back, values)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).tanh()
        return x


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_jit_trace_of_a_streamed_model_is_refused_by_name():  # S44
    model = _Blocks()
    with open_link(emulated=True) as link:
        streamed = StreamedModel(model, link, buffers=2)
        try:
            with pytest.raises(RuntimeError, match="torch.jit cannot trace the weight fetches"):
                torch.jit.trace(model, torch.ones(2, 8))
        finally:
            streamed.remove()


def test_functional_call_on_a_streamed_model_is_named():  # S34
    model = _Blocks()
    weights = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    with open_link(emulated=True) as link:
        streamed = StreamedModel(model, link, buffers=2)
        try:
            with pytest.raises(RuntimeError, match="functional_call"):
                torch.func.functional_call(model, weights, (torch.ones(2, 8),))
        finally:
            streamed.remove()


def test_a_lab_name_that_is_no_regular_file_is_named(tmp_path):  # C10: skipped in silence
    from offloadlab_course import student

    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "lab01_a.md").write_text("---\njupytext:\n  formats: md\n---\n# Lab\n")
    os.mkfifo(labs / "lab05_fifo.md")
    with pytest.warns(UserWarning, match="lab05_fifo.md is not a regular file; skipped"):
        assert [p.name for p in student.find_labs(labs)] == ["lab01_a.md"]
