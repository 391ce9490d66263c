"""`make gpu-check` on a machine without a GPU: one line saying so, the CPU parts, exit 0."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, gpu-check is the real thing: run make gpu-check")
def test_gpu_check_runs_the_cpu_parts_and_exits_0(tmp_path):
    result = subprocess.run([sys.executable, "-m", "offloadlab.gpucheck", "--out", str(tmp_path), "--quick"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("no CUDA GPU on this machine")
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {s["step"].split(" (")[0]: s for s in summary["steps"]}
    assert steps["GPU-marked tests"]["ok"] and "skipped" in steps["GPU-marked tests"]["summary"]
    for name in ("link", "overlap", "adam", "offload", "prefetch"):
        assert steps[f"bench {name}"]["ok"]
        payload = json.loads((tmp_path / f"bench-{name}.json").read_text())
        assert payload["provenance"]["torch"] == torch.__version__ and payload["ratios"]
    assert summary["provenance"]["accelerator"] == "none"
    assert "gpu-check on no GPU" in result.stdout
