"""The planner's choices on a table of scenarios, its emitted configurations and its command."""

import json
import subprocess
import sys

import pytest

from offloadlab import planner


def report(params, gpu="80 GB", link="60 GB/s", host="2 TB", **kw):
    hw_keys = {"cpu_adam", "compute", "comm_fraction"}
    hw = planner.Hardware(gpu, link, host_memory=host, **{k: v for k, v in kw.items() if k in hw_keys})
    work = planner.Workload(params, **{k: v for k, v in kw.items() if k not in hw_keys})
    return planner.plan(work, hw)


def test_fits_on_the_gpu():
    r = report(1e9, batch=1, seq=1024)
    assert r.chosen.offload == "nothing" and "not needed" in r.warnings[0]
    assert r.chosen.binding.startswith("nothing")


def test_needs_optimizer_offload():
    r = report(7e9, batch=1, seq=1024, compute=400e12, cpu_adam=10e9)
    assert r.chosen.offload == "optimizer" and r.chosen.fits
    assert r.runner_up is not None and r.runner_up.step >= r.chosen.step * 0.999
    assert r.ranking[0].name == "optimizer states"


def test_needs_parameter_offload():
    r = report(40e9, layers=48, hidden=8192, heads=64, batch=1, seq=1024)
    assert r.chosen.offload == "optimizer+gradients+parameters"
    assert r.chosen.gpu_bytes < 80e9 * 0.9 and r.chosen.host_bytes == 16 * 40e9


def test_nothing_fits():
    gpu_too_small = report(400e9, batch=1, seq=2048)
    assert gpu_too_small.chosen is None and "nothing fits" in gpu_too_small.warnings[0]
    host_too_small = report(30e9, host="64 GB", batch=1, seq=1024)
    assert host_too_small.chosen is None and "NVMe" in host_too_small.warnings[0]
    with pytest.raises(ValueError, match="^report: nothing fits"):
        planner.deepspeed_config(host_too_small)


def test_wrong_tool():
    r = report(10e9, batch=1, seq=1024, comm_fraction=0.5)
    assert any("wrong tool" in w for w in r.warnings)
    bound = report(13e9, link="4 GB/s", batch=1, seq=512, compute=400e12)
    assert bound.chosen.binding.startswith("the link")
    assert any("bandwidth-bound" in w for w in bound.warnings)


def test_least_offload_is_chosen_and_plans_are_consistent():
    r = report(10e9, batch=1, seq=1024)
    levels = [p.level for p in r.plans if p.fits]
    assert r.chosen.level == min(levels)
    for p in r.plans:
        assert p.step == pytest.approx(max(p.t_compute, p.t_transfer) + p.t_cpu)
    assert "plan:" in r.explain() and "assumed:" in r.explain()


def test_typical_shape_matches_gpt3():
    assert planner.typical_shape(175e9) == (96, 12288, 96)


def test_deepspeed_and_fsdp_emission():
    optimizer_only = planner.deepspeed_config(report(7e9, batch=1, seq=1024, compute=400e12, cpu_adam=10e9))
    zero = optimizer_only["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero
    everything = report(40e9, layers=48, hidden=8192, heads=64, batch=1, seq=1024)
    zero3 = planner.deepspeed_config(everything)["zero_optimization"]
    assert zero3["stage"] == 3 and zero3["offload_param"]["pin_memory"] is True
    snippet = planner.fsdp_snippet(everything)
    assert "CPUOffloadPolicy(pin_memory=True)" in snippet
    compile(snippet, "<fsdp>", "exec")


def test_emitted_deepspeed_section_validates_with_deepspeed():
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    emitted = planner.deepspeed_config(report(40e9, layers=48, hidden=8192, heads=64, batch=1, seq=1024))
    parsed = config.DeepSpeedZeroConfig(**emitted["zero_optimization"])
    assert parsed.stage == 3 and parsed.offload_param is not None and parsed.offload_optimizer is not None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(params=-1), "^params: "),
    (dict(params=1e9, batch=0), "^batch: "),
    (dict(params=1e9, layers=2), "^layers: "),
])
def test_workload_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        planner.Workload(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(gpu_memory="0 GB", link="1 GB/s"), "^gpu_memory: "),
    (dict(gpu_memory="80 GB", link="fast"), "^link: "),
    (dict(gpu_memory="80 GB", link="1 GB/s", compute=0), "^compute: "),
    (dict(gpu_memory="80 GB", link="1 GB/s", comm_fraction=1.5), "^comm_fraction: "),
])
def test_hardware_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        planner.Hardware(**kwargs)


def offloadlab(*args):
    return subprocess.run([sys.executable, "-m", "offloadlab", *args], capture_output=True, text=True)


def test_budget_command_reports_the_8_gb_ceiling():
    result = offloadlab("budget", "--link", "32 GB/s", "--window", "250 ms", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["ceiling_bytes"] == 8e9
    verdict = offloadlab("budget", "--link", "32 GB/s", "--window", "250 ms", "--params", "10e9",
                         "--offload", "optimizer", "--json")
    payload = json.loads(verdict.stdout)
    assert payload["traffic_bytes"] == 40e9 and payload["ratio"] == pytest.approx(5) and payload["fits"] is False


def test_plan_command_json_and_emit():
    result = offloadlab("plan", "--params", "30e9", "--gpu-memory", "80 GB", "--link", "60 GB/s",
                        "--emit", "deepspeed", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["chosen"]["fits"] and payload["deepspeed"]["zero_optimization"]["offload_optimizer"]
    text = offloadlab("plan", "--params", "30e9", "--gpu-memory", "80 GB", "--link", "60 GB/s", "--emit", "fsdp")
    assert "fully_shard" in text.stdout and "binding constraint" in text.stdout


@pytest.mark.parametrize("args, fragment", [
    (["budget", "--link", "0 GB/s", "--window", "1 s"], "--link"),
    (["budget", "--link", "32 GB/s", "--window", "1 s", "--params", "1e9"], "together"),
    (["budget", "--link", "32 GB/s", "--window", "soon"], "window"),
    (["plan", "--params", "1e9", "--gpu-memory", "80 GB", "--link", "60 GB/s", "--batch", "0"], "--batch"),
    (["plan", "--params", "1e9", "--gpu-memory", "lots", "--link", "60 GB/s"], "--gpu-memory"),
    (["plan", "--params", "1e9", "--gpu-memory", "80 GB"], "--link"),
    (["plan", "--params", "1e9", "--gpu-memory", "80 GB", "--link", "6 GB/s", "--emit", "xml"], "--emit"),
])
def test_bad_arguments(args, fragment):
    result = offloadlab(*args)
    assert result.returncode == 2 and fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
