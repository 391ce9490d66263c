import json
import subprocess
import sys

import pytest

from offloadlab.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "offloadlab", *args], capture_output=True, text=True)


def test_state_json_reports_160_gb_for_10b_params():
    result = run("state", "--params", "10e9", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["total_bytes"] == 160e9
    assert payload["by_kind_bytes"]["master_weights"] == 40e9
    assert payload["recipe"] == "mixed-adam"


def test_state_table(capsys):
    assert main(["state", "--params", "7e9", "--recipe", "bf16-adam"]) == 0
    out = capsys.readouterr().out
    assert "56 GB" in out and "fits on: 80 GB, 141 GB cards" in out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["state", "--params", "-1"], "must not be negative"),
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
