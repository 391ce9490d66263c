"""The live calculators' arithmetic: the crossover tokens T* and the `offloadlab overlap` command."""

import json
import subprocess
import sys

import pytest

from offloadlab import overlap


def offloadlab(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offloadlab", *argv], capture_output=True, text=True, cwd=cwd)


# --- T* and the overlap command ----------------------------------------------------------------------

def test_crossover_tokens_is_r_over_3b_and_the_model_size_cancels():
    assert overlap.crossover_tokens(200e12, "25 GB/s") == pytest.approx(200e12 / (3 * 25e9), rel=1e-15)
    assert overlap.crossover_tokens(200e12, 25e9, flops_per_param_token=4) == 4000
    # Against the condition itself, for models of any size: 2 B per parameter each way, a window of
    # T tokens × 6P/R. From ⌈T*⌉ tokens the copy hides; one token fewer, it stalls.
    for params in (1e9, 10e9, 70e9, 405e9):
        for rate, link in ((200e12, 25e9), (400e12, 50e9), (82e12, 12e9)):
            whole = -(-overlap.crossover_tokens(rate, link) // 1)
            assert overlap.stage(2 * params, link, whole * 6 * params / rate).hidden
            assert not overlap.stage(2 * params, link, (whole - 1) * 6 * params / rate).hidden
    with pytest.raises(ValueError, match=r"^bandwidth: .*'25 GB'"):
        overlap.crossover_tokens(200e12, "25 GB")
    with pytest.raises(ValueError, match=r"^flops: expected a positive number"):
        overlap.crossover_tokens(0, "25 GB/s")


def test_the_overlap_command_states_the_condition_and_the_crossover():
    done = offloadlab("overlap", "--link", "25 GB/s", "--compute", "200e12", "--bytes", "20 GB", "--window", "250 ms",
                      "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert round(result["crossover_tokens"]) == 2667 and result["crossover_tokens_backward_only"] == 4000
    assert (result["transfer_s"], result["hidden"], result["stall_s"]) == (0.8, False, pytest.approx(0.55))
    text = offloadlab("overlap", "--link", "32 GB/s", "--compute", "200e12", "--bytes", "8 GB", "--window", "250 ms")
    assert "compute-bound (transfer hidden)" in text.stdout and "from 2,084 tokens" in text.stdout  # ⌈2083.3⌉
    alone = json.loads(offloadlab("overlap", "--link", "25 GB/s", "--compute", "200e12", "--json").stdout)
    assert alone["hidden"] is None and alone["bytes"] is None
    refused = offloadlab("overlap", "--link", "25 GB/s", "--compute", "200e12", "--bytes", "8 GB")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "--bytes and --window together" in refused.stderr
