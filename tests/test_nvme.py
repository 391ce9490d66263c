"""The file-backed tier: exact round trips, Adam over state in files equals Adam in memory."""

import pytest
import torch

from offloadlab import cpu_adam
from offloadlab.nvme import FileTier, adam_from_file


def test_round_trip_and_bounds(tmp_path):
    with FileTier(tmp_path / "t.bin", 1000, torch.bfloat16) as tier:
        data = torch.randn(300).to(torch.bfloat16)
        tier.write(500, data, sync=True)
        tier.flush()
        back = torch.empty(300, dtype=torch.bfloat16)
        tier.read(500, back)
        assert torch.equal(back, data)
        zeros = torch.ones(10, dtype=torch.bfloat16)
        tier.read(0, zeros)
        assert torch.equal(zeros, torch.zeros(10, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="^start: "):
            tier.write(900, data)
        with pytest.raises(ValueError, match="^tensor: "):
            tier.write(0, torch.zeros(3))
    assert not (tmp_path / "t.bin").exists()


def test_refuses_to_overwrite_and_bad_sizes(tmp_path):
    (tmp_path / "mine.bin").write_bytes(b"precious")
    with pytest.raises(ValueError, match="exists"):
        FileTier(tmp_path / "mine.bin", 10)
    assert (tmp_path / "mine.bin").read_bytes() == b"precious"
    with pytest.raises(ValueError, match="^numel: "):
        FileTier(tmp_path / "x.bin", 0)
    with pytest.raises(ValueError, match="^path: folder"):
        FileTier(tmp_path / "missing" / "x.bin", 10)


def test_adam_over_files_equals_adam_in_memory(tmp_path):
    n = 10_000
    torch.manual_seed(0)
    start = torch.randn(n)
    tiers = [FileTier(tmp_path / f"{name}.bin", n) for name in ("master", "m", "v")]
    tiers[0].write(0, start)
    master, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    for step in (1, 2, 3):
        grad = torch.randn(n)
        seconds = adam_from_file(*tiers, grad, None, step=step, lr=1e-2, chunk=3000)
        cpu_adam.adamw_step(master, m, v, grad, step=step, lr=1e-2)
        assert set(seconds) == {"read", "update", "write"} and all(s >= 0 for s in seconds.values())
    back = torch.empty(n)
    tiers[0].read(0, back)
    assert torch.equal(back, master)
    for tier in tiers:
        tier.close()
