"""The findings of issue 37's fifth probe pass (606 probes): each wrong result or unclear message
a user met, reproduced as they met it. Each test failed before its fix."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import warnings
from contextlib import redirect_stderr

import numpy as np
import pytest
import torch

import offloadlab as ol
from offloadlab import cli
from offloadlab_course import check, grading

X = torch.ones(3, 4)


def twins():
    torch.manual_seed(0)
    ours = torch.nn.Linear(4, 2)
    return ours, copy.deepcopy(ours)


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_delayed_update_takes_true_or_false_only(value):
    """ "no" is true to Python: it switched the delayed update on."""
    with pytest.raises(ValueError, match=r"^delayed_update: expected True or False; got"):
        ol.CPUOffloadAdam(torch.nn.Linear(4, 2).parameters(), delayed_update=value)


def test_numpy_hyperparameters_are_taken_as_adamw_takes_them():
    """lr=np.float32(1e-3) was refused with "expected a number ≥ 0"; AdamW takes it."""
    ours, theirs = twins()
    lr = np.float32(1e-3)
    optimizer = ol.CPUOffloadAdam(ours.parameters(), lr=lr)
    reference = torch.optim.AdamW(theirs.parameters(), lr=float(lr))
    try:
        for model, step in ((ours, optimizer), (theirs, reference)):
            model(X).sum().backward()
            step.step()
        assert optimizer.param_groups[0]["lr"] == lr
        assert torch.equal(ours.weight, theirs.weight)
    finally:
        optimizer.close()
    with pytest.raises(ValueError, match=r"^lr: expected a number ≥ 0; got np.float32\(nan\)"):
        ol.CPUOffloadAdam(torch.nn.Linear(4, 2).parameters(), lr=np.float32("nan"))


def test_a_state_entry_cannot_be_replaced_only_written_into():
    """optimizer.state[p]["exp_avg"] = t went into a throwaway dict: AdamW would use t."""
    ours, _ = twins()
    optimizer = ol.CPUOffloadAdam(ours.parameters(), lr=0.1)
    try:
        ours(X).sum().backward()
        optimizer.step()
        entry = optimizer.state[ours.weight]
        with pytest.raises(TypeError, match=r"live views of the host state; write into one"):
            entry["exp_avg"] = torch.zeros_like(ours.weight)
        with pytest.raises(TypeError):
            optimizer.state[torch.nn.Parameter(torch.ones(1))]["step"] = 1  # (no state yet)
        entry["exp_avg"].copy_(torch.zeros_like(ours.weight))
        assert optimizer.state[ours.weight]["exp_avg"].abs().sum() == 0
        # a copy or a pickle is a plain dict, free to change
        for plain in (copy.deepcopy(entry), pickle.loads(pickle.dumps(entry))):
            assert type(plain) is dict and torch.equal(plain["exp_avg"], entry["exp_avg"])
    finally:
        optimizer.close()


def test_hyperparameters_changed_after_an_eager_update_began_are_said_to_wait():
    """With accumulation_steps, lr set to 0 between the last backward and step() was silently
    ignored (the update had run during backward); AdamW would have used 0."""
    ours, _ = twins()
    optimizer = ol.CPUOffloadAdam(ours.parameters(), lr=0.1, accumulation_steps=1)
    try:
        ours(X).sum().backward()
        optimizer.param_groups[0]["lr"] = 0.0
        with pytest.warns(UserWarning, match=r"changed after this step's update began"):
            optimizer.step()
        optimizer.zero_grad()
        ours(X).sum().backward()  # set before backward: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            optimizer.step()
    finally:
        optimizer.close()


def test_a_second_step_with_the_delayed_update_says_what_it_does():
    """It said "this step changes nothing", but it applies the pending update a step early."""
    ours, _ = twins()
    optimizer = ol.CPUOffloadAdam(ours.parameters(), lr=0.1, delayed_update=True)
    try:
        ours(X).sum().backward()
        optimizer.step()
        with pytest.warns(UserWarning, match=r"applies now the update the last step left pending"):
            optimizer.step()
    finally:
        optimizer.close()


def test_prefetcher_refuses_one_tensor_and_a_link_that_is_not_one():
    """One tensor was split into 0-dim items; link="emulated" gave an AttributeError."""
    link = ol.open_link(emulated=True)
    try:
        with pytest.raises(ValueError, match=r"^items: expected a sequence of host tensors"):
            ol.Prefetcher(torch.arange(3.0), link)
    finally:
        link.close()
    with pytest.raises(ValueError, match=r"^link: expected an offloadlab.link.Link"):
        ol.Prefetcher([torch.ones(3)], "emulated")


@pytest.mark.parametrize("micro_batches", [0, -3, "4", 2.0])
def test_plan_takes_a_positive_whole_number_of_micro_batches(micro_batches):
    """-3 gave negative times and shares; "4" a TypeError from inside."""
    work, hardware = ol.Workload(params=7e9), ol.Hardware(gpu_memory=80e9, link=25e9)
    with pytest.raises(ValueError, match=r"^micro_batches: expected a positive integer"):
        ol.plan(work, hardware, micro_batches=micro_batches)


def test_plan_names_a_workload_that_is_not_one():
    with pytest.raises(TypeError, match=r"^work: expected an offloadlab.Workload; got '30e9'"):
        ol.plan("30e9", ol.Hardware(gpu_memory=80e9, link=25e9))


def test_the_student_release_does_not_name_the_unit_slip(monkeypatch, capsys):
    """ "That is a factor of 8" gave the expected value away: 800 / 8 passed."""
    monkeypatch.setenv(check.STUDENT_VARIABLE, "1")
    verdict = check.answer("bandwidth", 800, 100)
    assert not verdict and "Check your units." in verdict.message
    assert "8" not in verdict.message.replace("bandwidth", "")
    monkeypatch.setenv(check.STUDENT_VARIABLE, "0")
    assert "That is a factor of 8: bits against bytes?" in check.answer("b", 800, 100).message


def test_a_mismatch_never_shows_two_equal_numbers(capsys):
    """0.1 + 0.2 against 0.3 printed "0.3, but 0.3 was expected"."""
    verdict = check.exact("x", 0.1 + 0.2, 0.3)
    assert not verdict
    yours, expected = verdict.message.split(": ", 1)[1].split(" was expected")[0].split(", but ")
    assert yours != expected and yours.startswith("0.30000000000000004"), verdict.message


@pytest.mark.parametrize("copies, computes", [([(1.0, 0.0)], [(0.0, 2.0)]), ([(0, 1)], [(3, 2)])])
def test_hidden_share_refuses_an_interval_that_ends_before_it_starts(copies, computes):
    """A reversed interval cancelled real copy time: the share came out 1.0."""
    with pytest.raises(ValueError, match=r"ends before it starts"):
        grading.hidden_share(copies, computes)


def test_a_model_config_error_names_the_flag_typed(tmp_path, capsys):
    """--model-config /tmp was refused as "--model: ..."."""
    status = cli.main(["plan", "--model-config", str(tmp_path), "--gpu-memory", "24 GB"])
    error = capsys.readouterr().err
    assert status == 2 and "error: --model-config: expected a folder holding a config.json" in error


def test_version():
    out = io.StringIO()
    with pytest.raises(SystemExit) as stopped, redirect_stderr(io.StringIO()):
        sys.stdout, saved = out, sys.stdout
        try:
            cli.main(["--version"])
        finally:
            sys.stdout = saved
    assert stopped.value.code == 0 and out.getvalue() == f"offloadlab {ol.__version__}\n"


def test_a_file_size_limit_is_not_reported_as_a_full_disk(tmp_path):
    """Under `ulimit -f 1` the disk probe said "No space left on device" on a disk with 74 GB
    free: a short write is resumed, and the error that stops it is the one named."""
    script = (
        "import resource, offloadlab.probe as p;"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY));"
        f"p.disk_bandwidth({str(tmp_path)!r}, '4 MiB')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    assert "file size limit (ulimit -f)" in done.stderr and "No space left" not in done.stderr
