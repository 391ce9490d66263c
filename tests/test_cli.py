import json
import os
import subprocess
import sys

import pytest

from offloadlab.cli import main
from tests.conftest import offloadlab


run = offloadlab  # (in this process: see tests/conftest.py)


def run_process(*args):
    """The command as a user starts it: ``python -m offloadlab`` in a Python of its own."""
    return subprocess.run(
        [sys.executable, "-m", "offloadlab", *args], capture_output=True, text=True
    )


def test_state_json_reports_160_gb_for_10b_params():
    result = run_process("state", "--params", "10e9", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["total_bytes"] == 160e9
    assert payload["by_kind_bytes"]["master_weights"] == 40e9
    assert payload["recipe"] == "mixed-adam"
    assert '"params": 10000000000,' in result.stdout  # a count, not 10000000000.0


def test_state_table(capsys):
    assert main(["state", "--params", "7e9", "--recipe", "bf16-adam"]) == 0
    out = capsys.readouterr().out
    assert "56 GB" in out and "fits on: 80 GB, 141 GB cards" in out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["state", "--params", "-1"], "must not be negative"),
        # argparse reads -5e9 as an option: the line says how to pass it
        (["state", "--params", "-5e9"], "--params: got '-5e9', which reads as an option; write"),
        (["state", "--params=-5e9"], "must not be negative"),
        (["state", "--params", "ten"], "params: expected"),
        (["state", "--params", "1e9", "--recipe", "lion"], "recipe: expected one of"),
        (["state"], "--params"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(args, fragment):
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloadlab: error:")
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


# The error contract: 2 for a bad argument, 1 for a fault of the machine, one line, never a
# traceback.


def _one_line_error(result, status):
    assert result.returncode == status, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("offloadlab: error:"), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            [
                "budget",
                "--link",
                "1e-300",
                "--window",
                "1e-300",
                "--params",
                "10e9",
                "--offload",
                "optimizer",
            ],
            "--link",
        ),
        (["budget", "--link", "32 GB/s", "--window", "1e-300 s"], "--window"),
        (
            ["plan", "--params", "30e9", "--gpu-memory", "80 GB", "--link", "1e-300", "--json"],
            "--link",
        ),
        (["plan", "--params", "1e300", "--gpu-memory", "80 GB", "--link", "32 GB/s"], "--params"),
        (
            [
                "plan",
                "--params",
                "30e9",
                "--gpu-memory",
                "80 GB",
                "--link",
                "32 GB/s",
                "--compute",
                "nan",
            ],
            "--compute",
        ),
        (
            [
                "plan",
                "--params",
                "30e9",
                "--gpu-memory",
                "80 GB",
                "--link",
                "32 GB/s",
                "--compute",
                "5 GB",
            ],
            "--compute",
        ),
        (
            [
                "plan",
                "--params",
                "30e9",
                "--gpu-memory",
                "80 GB",
                "--link",
                "32 GB/s",
                "--batch",
                "1" + "0" * 400,
            ],
            "--batch",
        ),
        (["state", "--params", "1e-3"], "--params"),
        (["state", "--params", "1e400"], "--params"),
        (
            [
                "budget",
                "--link",
                "32 GB/s",
                "--window",
                "1 s",
                "--params",
                "1e9",
                "--offload",
                "optimizer,optimizer",
            ],
            "optimizer repeated",
        ),
        (
            [
                "budget",
                "--link",
                "32 GB/s",
                "--window",
                "1 s",
                "--params",
                "1e9",
                "--offload",
                "optimizer,",
            ],
            "comma-separated",
        ),
        (
            [
                "budget",
                "--link",
                "32 GB/s",
                "--window",
                "1 s",
                "--params",
                "1e9",
                "--offload",
                "optimizer, warp",
            ],
            "warp",
        ),
    ],
)
def test_out_of_range_and_overflowing_arguments_are_usage_errors(args, fragment):
    assert fragment in _one_line_error(run(*args), 2)


def test_offload_names_may_have_spaces_after_commas():
    spaced = run(
        "budget",
        "--link",
        "32 GB/s",
        "--window",
        "1 s",
        "--params",
        "1e9",
        "--offload",
        "optimizer, gradients",
        "--json",
    )
    tight = run(
        "budget",
        "--link",
        "32 GB/s",
        "--window",
        "1 s",
        "--params",
        "1e9",
        "--offload",
        "optimizer,gradients",
        "--json",
    )
    assert spaced.returncode == 0, spaced.stderr
    assert json.loads(spaced.stdout) == json.loads(tight.stdout)


def _strict(text):
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "link, window", [("1 B/s", "1 ns"), ("1 PB/s", "1e9 s"), ("1 B/s", "1e9 s")]
)
def test_json_stays_strict_at_the_bounds(link, window):
    budget = run(
        "budget",
        "--link",
        link,
        "--window",
        window,
        "--params",
        "1e15",
        "--offload",
        "park-and-copy",
        "--json",
    )
    assert budget.returncode == 0, budget.stderr
    assert _strict(budget.stdout)["traffic_bytes"] > 0
    plan = run(
        "plan",
        "--params",
        "1e15",
        "--gpu-memory",
        "1000 PB",
        "--link",
        link,
        "--compute",
        "1 FLOP/s",
        "--json",
    )
    assert plan.returncode == 0, plan.stderr
    _strict(plan.stdout)
    text = run(
        "plan", "--params", "1e15", "--gpu-memory", "80 GB", "--link", link, "--compute", "1 FLOP/s"
    )
    assert text.returncode == 0 and " inf " not in text.stdout and "nan" not in text.stdout


def test_an_internal_value_error_is_a_bug_not_a_usage_error(monkeypatch):
    from offloadlab import planner

    def broken(*args, **kwargs):
        raise ValueError("an internal slip")

    monkeypatch.setattr(planner, "plan", broken)
    with pytest.raises(ValueError, match="an internal slip"):
        main(["plan", "--params", "30e9", "--gpu-memory", "80 GB", "--link", "32 GB/s"])


@pytest.mark.parametrize(
    "command",
    [
        [
            "budget",
            "--link",
            "25 GB/s",
            "--window",
            "250 ms",
            "--params",
            "1e9",
            "--offload",
            "optimizer",
        ],
        ["plan", "--params", "7e9", "--gpu-memory", "24 GB", "--link", "25 GB/s"],
    ],
)
def test_a_terminal_that_cannot_show_arrows_gets_question_marks_not_a_traceback(command):
    child = subprocess.run(
        [sys.executable, "-m", "offloadlab", *command],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
    )
    assert child.returncode == 0, child.stderr.decode(errors="replace")
    assert child.stderr == b"" and b"?" in child.stdout and child.stdout.isascii()


@pytest.mark.parametrize("args", [["--help"], ["state", "--params", "1e9"]])
def test_output_to_a_full_device_is_a_fault_not_a_silent_success(args):
    with open("/dev/full", "w") as full:
        child = subprocess.run(
            [sys.executable, "-m", "offloadlab", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert child.returncode == 1 and child.stderr == "offloadlab: error: No space left on device\n"


def test_a_closed_pipe_ends_quietly_with_sigpipe_status():
    """The reader has gone before the first write (deterministic: its end is closed first)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab",
            "plan",
            "--params",
            "30e9",
            "--gpu-memory",
            "80 GB",
            "--link",
            "32 GB/s",
        ],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert child.returncode == 141 and child.stderr == ""


def test_head_reads_one_line_without_a_traceback():
    shell = subprocess.run(
        [
            "bash",
            "-c",
            f"'{sys.executable}' -m offloadlab plan --params 30e9 --gpu-memory '80 GB' "
            "--link '32 GB/s' --json | head -1; echo \"status ${PIPESTATUS[0]}\"",
        ],
        capture_output=True,
        text=True,
    )
    assert shell.stdout.splitlines()[0] == "{"
    # 0 if it all fitted in the pipe first
    assert shell.stdout.splitlines()[-1] in ("status 0", "status 141")
    assert shell.stderr == ""


def test_interrupt_and_machine_faults_are_one_line(monkeypatch, capsys):
    from offloadlab import memory

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(memory, "fitting_gpus", interrupted)
    assert main(["state", "--params", "1e9"]) == 130
    assert capsys.readouterr().err == "offloadlab: error: interrupted\n"

    def io_error(*args, **kwargs):
        raise OSError(5, "Input/output error", "/dev/nvme0n1")

    monkeypatch.setattr(memory, "fitting_gpus", io_error)
    assert main(["state", "--params", "1e9"]) == 1
    assert capsys.readouterr().err == "offloadlab: error: /dev/nvme0n1: Input/output error\n"


# Output files: checked before a long run, written whole, and a measurement that ran is never lost.


@pytest.fixture
def quick_bench(monkeypatch):
    """bench link as a stand-in that returns at once, counting its runs (the plumbing is under
    test)."""
    from offloadlab import bench

    runs = []

    def fake_link(quick=False):
        runs.append(quick)
        return {
            "benchmark": "link",
            "source": "emulated",
            "rows": [],
            "ratios": {"x / y": 1.5},
            "provenance": {},
        }

    monkeypatch.setattr(bench, "link", fake_link)
    return runs


def test_bad_json_targets_are_refused_before_the_run(tmp_path, quick_bench, capsys):
    (tmp_path / "old.json").write_text("mine")
    for target, force, fragment in (
        ("", False, "--json: expected a file name; got ''"),
        (str(tmp_path), True, "which is a folder"),
        (str(tmp_path / "old.json"), False, "exists; choose another name or pass --force"),
        (str(tmp_path / "no" / "x.json"), False, "does not exist"),
    ):
        assert main(["bench", "link", "--json", target] + (["--force"] if force else [])) == 2
        assert fragment in capsys.readouterr().err
    assert quick_bench == [] and (tmp_path / "old.json").read_text() == "mine"


def test_a_read_only_json_folder_is_a_fault_found_before_the_run(small_disk, quick_bench, capsys):
    read_only = small_disk("1m", read_only=True)
    assert main(["bench", "link", "--json", str(read_only / "out.json")]) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "--json: cannot create a file in" in err
        and "Read-only file system" in err
    )
    assert quick_bench == []


def test_results_go_to_stdout_when_the_disk_fills_before_they_are_written(
    small_disk, quick_bench, capsys
):
    disk = small_disk("1m")
    # fill it: the check before the run still passes (an empty file fits)
    with pytest.raises(OSError):
        (disk / "filler").write_bytes(b"x" * 2**21)
    assert main(["bench", "link", "--json", str(disk / "out.json")]) == 1
    captured = capsys.readouterr()
    assert quick_bench == [False]
    assert json.loads(captured.out[: captured.out.index("\nbenchmark link")])["ratios"] == {
        "x / y": 1.5
    }
    assert captured.err.count("\n") == 1 and "--json: could not write" in captured.err
    assert "No space left on device" in captured.err and "the results are on stdout" in captured.err
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_json_is_written_whole_and_replaced_only_with_force(tmp_path, quick_bench, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "link", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ratios"] == {"x / y": 1.5}
    out.write_text("edited by hand")
    assert main(["bench", "link", "--json", str(out)]) == 2 and out.read_text() == "edited by hand"
    assert main(["bench", "link", "--json", str(out), "--force"]) == 0 and json.loads(
        out.read_text()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "link"],
        ["probe", "--quick"],
        ["probe", "--quick", "--reference", "mine", "--reference-dir", "{dir}"],
    ],
    ids=["bench --json", "probe --json", "probe --reference-dir"],
)
def test_a_dangling_link_planted_at_an_output_is_refused_before_the_run(
    tmp_path, quick_bench, monkeypatch, command, capsys
):
    """Each used to create the file where the link pointed, without --force."""
    from offloadlab import probe

    monkeypatch.setattr(probe, "link_sweep", lambda *a, **k: pytest.fail("the probe ran"))
    victim = tmp_path / "elsewhere.json"
    planted = tmp_path / ("mine.json" if "--reference" in command else "out.json")
    planted.symlink_to(victim)
    args = [a.replace("{dir}", str(tmp_path)) for a in command]
    if "--reference" not in command:
        args += ["--json", str(planted)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a symbolic link (to " in err and "--force" in err
    assert not victim.exists() and quick_bench == []


@pytest.fixture
def user_references(tmp_path, monkeypatch):
    from offloadlab import reference

    folder = tmp_path / "references"
    monkeypatch.setenv(reference.USER_FOLDER_VARIABLE, str(folder))
    return folder


def test_probe_checks_the_disk_and_the_reference_name_before_the_sweep(
    small_disk, user_references, monkeypatch, capsys
):
    from offloadlab import probe, reference

    def must_not_run(*args, **kwargs):
        raise AssertionError("the sweep ran before a check that should have stopped it")

    monkeypatch.setattr(probe, "link_sweep", must_not_run)
    packaged = (reference.FOLDER / "nominal-ladder.json").read_bytes()
    assert main(["probe", "--quick", "--reference", "nominal-ladder", "--force"]) == 2
    assert "'nominal-ladder' is a reference shipped with offloadlab" in capsys.readouterr().err
    assert not user_references.exists()  # a refused name leaves no empty folder behind
    assert main(["probe", "--quick", "--reference", "../x"]) == 2
    assert "--reference: expected letters" in capsys.readouterr().err
    assert main(["probe", "--quick", "--reference", ""]) == 2  # not silently "no reference"
    assert "--reference: expected letters" in capsys.readouterr().err
    assert main(["probe", "--quick", "--disk", ""]) == 2  # not silently "here"
    assert "--disk: expected an existing folder; got ''" in capsys.readouterr().err
    user_references.write_text("a file where the folder should be")  # a setting, so exit 2
    assert main(["probe", "--quick", "--reference", "x"]) == 2
    assert (
        f"'{user_references}' (from $OFFLOADLAB_REFERENCE_DIR) is not a folder"
        in capsys.readouterr().err
    )
    user_references.unlink()
    user_references.mkdir()
    (user_references / "x.json").write_text("{}")
    assert main(["probe", "--quick", "--reference", "x"]) == 2
    assert "choose another name or pass --force to replace it" in capsys.readouterr().err
    assert main(["probe", "--quick", "--reference", "x", "--reference-dir", "/no/such/folder"]) == 2
    assert "--reference-dir: expected an existing folder" in capsys.readouterr().err
    assert (
        "--reference-dir: give it with --reference"
        in (main(["probe", "--reference-dir", "."]), capsys.readouterr().err)[1]
    )
    read_only = small_disk("1m", read_only=True)
    assert main(["probe", "--quick", "--disk", str(read_only)]) == 1
    assert (
        f"cannot create a scratch file in {read_only}: Read-only file system"
        in capsys.readouterr().err
    )
    full = small_disk("1m")
    assert main(["probe", "--quick", "--disk", str(full)]) == 1
    assert "the disk probe writes 67.1 MB" in capsys.readouterr().err
    assert (reference.FOLDER / "nominal-ladder.json").read_bytes() == packaged


def test_probe_keeps_the_sweep_when_the_disk_fails_midway(
    tmp_path, user_references, monkeypatch, capsys
):
    from offloadlab import probe, reference

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(probe, "disk_bandwidth", disk_full)
    out = tmp_path / "probe.json"
    assert (
        main(
            ["probe", "--quick", "--disk", str(tmp_path), "--json", str(out), "--reference", "mine"]
        )
        == 1
    )
    captured = capsys.readouterr()
    assert (
        captured.err.count("\n") == 1
        and "disk probe in" in captured.err
        and "No space left" in captured.err
    )
    records = json.loads(out.read_text())["records"]
    assert {r["quantity"] for r in records if r["source"] == "not measured"} >= {
        "disk read bandwidth"
    }
    assert any(r["quantity"].startswith("h2d") and r["value"] for r in records)
    assert reference.load("mine")["records"] == records and reference.origin("mine") == "user"
    assert f"wrote reference {user_references / 'mine.json'}" in captured.out


def test_a_closed_pipe_does_not_cost_the_json_file(tmp_path):
    """probe writes its file before it prints, so `probe --json f | head` keeps every record."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    out = tmp_path / "probe.json"
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab",
            "probe",
            "--quick",
            "--disk",
            str(tmp_path),
            "--json",
            str(out),
        ],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert child.returncode == 141 and child.stderr == ""
    assert any(
        r["quantity"] == "disk read bandwidth" for r in json.loads(out.read_text())["records"]
    )


def test_a_parameter_count_is_a_whole_number_and_a_closed_stdout_is_said_plainly():
    result = run("state", "--params", "1.5")
    assert (
        result.returncode == 2
        and "--params: expected a whole number of parameters" in result.stderr
    )
    closed = subprocess.run(
        [sys.executable, "-m", "offloadlab", "state", "--params", "1e9"],
        stdout=subprocess.DEVNULL,
        # `>&-`
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),
    )
    assert (
        closed.returncode == 1
        and closed.stderr.count("\n") == 1
        and "standard output is closed" in closed.stderr
    )


@pytest.mark.parametrize("source", ["/dev/zero", "/no/such/record.json"])
def test_a_measured_record_that_is_endless_or_missing_is_one_line(source):
    result = subprocess.run(
        [sys.executable, "-m", "offloadlab", "plan", "--params", "7e9", "--measured", source],
        # /dev/zero used to be read forever
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        result.returncode == 2 and result.stderr.count("\n") == 1 and "--measured:" in result.stderr
    )


def test_duplex_refusals_name_the_flag_and_what_was_typed(capsys):
    assert main(["budget", "--link", "25 GB/s", "--window", "250 ms", "--duplex", "1 PB/s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offloadlab: error: --duplex: expected at most") and "got '1 PB/s'" in err
    # within 10 %
    assert main(["budget", "--link", "25 GB/s", "--window", "250 ms", "--duplex", "26 GB/s"]) == 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["ladder"]["links"][0].update(bandwidth_bytes_per_s="fast"),
        lambda r: r["ladder"]["links"][0].update(bandwidth_bytes_per_s=1e-300),
        lambda r: r["machine"].update(host_memory_bytes=True),
        lambda r: r.update(machine="a string"),
        # issue 37, item 8: AttributeError and KeyError tracebacks, exit 1
        lambda r: r["machine"].update(accelerator="none"),
        lambda r: r["ladder"]["links"][0].pop("source"),
        lambda r: r["ladder"]["links"][0].update(source=None),
        lambda r: r["ladder"].update(links="host → GPU"),
    ],
    ids=[
        "text",
        "tiny",
        "bool",
        "not a dict",
        "accelerator a string",
        "no source",
        "source null",
        "links a string",
    ],
)
def test_a_damaged_measured_record_is_one_line(tmp_path, damage):
    record = {
        "machine": {"host_memory_bytes": 64e9, "accelerator": {"memory_bytes": 85e9}},
        "ladder": {
            "tiers": [],
            "links": [{"name": "host → GPU", "bandwidth_bytes_per_s": 24e9, "source": "measured"}],
        },
    }
    damage(record)
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record))
    result = run("plan", "--params", "7e9", "--measured", str(path))
    assert (
        result.returncode == 2 and result.stderr.count("\n") == 1 and "measured:" in result.stderr
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--gpu-memory", "80", "--link", "25 GB/s"],
            "--gpu-memory: expected a size with its unit; got '80': did you mean '80 GB'?",
        ),
        (["--gpu-memory", "80 GB", "--link", "25"], "did you mean '25 GB/s'?"),
        (["--gpu-memory", "80 GB", "--link", "25 Gb/s"], "'Gb' means gigabits"),
        (
            ["--gpu-memory", "80 GB", "--link", "25 GB/s", "--host-memory", "1024"],
            "did you mean '1024 GB'?",
        ),
        (
            ["--gpu-memory", "80 GB", "--link", "25 GB/s", "--compute", "400"],
            "did you mean '400 TFLOP/s'?",
        ),
    ],
)
def test_sizes_and_rates_without_units_are_refused(args, fragment):
    assert fragment in _one_line_error(run("plan", "--params", "8e9", *args), 2)


def test_units_in_any_case_and_a_params_slip_for_billions():
    assert (
        run(
            "plan",
            "--params",
            "8e9",
            "--gpu-memory",
            "80 gb",
            "--link",
            "25 gb/s",
            "--compute",
            "400 TFLOP/s",
        ).returncode
        == 0
    )
    # (twelfth probe pass L8: '400 TFLOPS' was refused as 'it takes no unit')
    plan = ("plan", "--params", "8e9", "--gpu-memory", "80 GB", "--link", "25 GB/s")
    assert run(*plan, "--compute", "400 TFLOPS").returncode == 0
    for command in ("plan", "state"):
        extra = ["--gpu-memory", "80 GB", "--link", "25 GB/s"] if command == "plan" else []
        assert (
            "--params: expected a model's parameter count, at least 1e+06; got '8': did you mean "
            "8e9?" in _one_line_error(run(command, "--params", "8", *extra), 2)
        )


@pytest.mark.parametrize("depth", [2000, 5000])
def test_deeply_nested_json_is_one_line_not_a_recursion_error(tmp_path, depth):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * depth + "]" * depth)
    config = run("plan", "--model-config", str(deep), "--gpu-memory", "80 GB", "--link", "25 GB/s")
    assert "nesting too deep to read" in _one_line_error(config, 2)
    measured = run("plan", "--params", "8e9", "--measured", str(deep))
    assert "--measured: expected an `offloadlab probe --json` file" in _one_line_error(measured, 2)
    assert "nesting too deep" in measured.stderr


def test_recompute_is_chosen_or_forced_layer_by_layer():
    base = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu-memory",
        "24 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "1 TB",
        "--seq",
        "4096",
        "--count",
        "formula",
        "--json",
    ]
    auto = json.loads(run(*base).stdout)["chosen"]
    assert 0 < auto["checkpointed_layers"] < 32 and "of 32 layers" in auto["name"]
    forced = json.loads(run(*base, "--recompute", "all").stdout)
    assert {p["checkpointed_layers"] for p in forced["plans"]} == {32}
    assert "--recompute: expected a number of layers from 0 to 32; got 40" in _one_line_error(
        run(*base, "--recompute", "40"), 2
    )
    assert "--recompute: expected 'auto', 'none', 'all' or a number of layers" in _one_line_error(
        run(*base, "--recompute", "some"), 2
    )


def test_a_known_family_is_counted_by_its_formula_and_any_other_by_transformers(
    monkeypatch, capsys
):
    """The finding (issue 36): `plan --model llama-3.1-8b` took 10.6 s, building the model with
    transformers where the formula gives the same count (test_architectures holds the two equal)
    in a fraction of a second. transformers counts what the formula does not know, or on request."""
    from offloadlab import architectures, model_count

    command = ["plan", "--model", "qwen3-8b", "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "counted by: formula" in out and "8,190,735,360" in out
    assert main([*command, "--count", "transformers"]) == 0
    out = capsys.readouterr().out
    assert "counted by: transformers " in out and "8,190,735,360" in out
    monkeypatch.setattr(
        architectures, "FAMILIES", tuple(f for f in architectures.FAMILIES if f != "qwen3")
    )
    assert main(command) == 0  # (a family without a formula: transformers counts it)
    assert "counted by: transformers " in capsys.readouterr().out

    def cannot(config, name, notes=(), measure=None):
        raise ValueError(f"{name}: transformers 9.9 cannot build this qwen3 config")

    monkeypatch.setattr(model_count, "architecture", cannot)
    assert main([*command, "--count", "transformers"]) == 2
    assert "cannot build this qwen3 config" in capsys.readouterr().err


def test_a_reference_folder_that_is_a_dangling_link_is_one_line(tmp_path, monkeypatch, capsys):
    """The kit makes the reference folder: a dangling link there said only 'File exists'."""
    from offloadlab import probe, reference

    monkeypatch.setattr(probe, "link_sweep", lambda *a, **k: pytest.fail("the probe ran"))
    folder = tmp_path / "references"
    folder.symlink_to(tmp_path / "missing")
    monkeypatch.setenv(reference.USER_FOLDER_VARIABLE, str(folder))
    assert main(["probe", "--quick", "--reference", "mine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a symbolic link to a missing folder" in err
    assert not (tmp_path / "missing").exists()


def test_bench_adam_reports_a_stale_deepspeed_build_lock_instead_of_waiting(
    tmp_path, monkeypatch, capsys
):
    """Issue 37, item 13: `offloadlab bench adam` itself (d425690 covered the GPU kit's) waited
    forever on torch's lock, left by a DeepSpeed CPU Adam build killed midway."""
    from offloadlab import bench

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "peer_installed", lambda name: True)
    monkeypatch.setattr(bench, "adam", lambda **k: pytest.fail("waited on the lock"))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert main(["bench", "adam", "--quick"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(lock) in err and "delete it" in err


def test_an_unknown_model_names_the_flag():
    """It said 'model: expected one of …', not the flag typed."""
    line = _one_line_error(
        run("plan", "--model", "nope", "--gpu-memory", "80 GB", "--link", "25 GB/s"), 2
    )
    assert line.startswith("offloadlab: error: --model: expected one of")
