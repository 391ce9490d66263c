"""Planning a real model on a real node: shares of the node, sharding against offloading, the
command."""

import json

import pytest

from offloadlab import architectures, engines, planner
from tests.conftest import offloadlab

P = 10e9
WORK = planner.Workload(P, layers=40, hidden=4096, heads=32, batch=1, seq=512)  # 512 tokens a GPU


def node(gpus=8, **kw):
    return planner.Hardware(
        "80 GB",
        "25 GB/s",
        host_memory=kw.pop("host", "2 TB"),
        compute=200e12,
        cpu_adam=kw.pop("cpu_adam", 8e9),
        gpus_per_node=gpus,
        interconnect=kw.pop("interconnect", "450 GB/s"),
        **kw,
    )


def by_name(report, name):
    return next(p for p in report.plans if p.name == name)


def test_each_gpu_gets_an_nth_of_the_node():
    share = node(8, host="2 TB", gpus_per_link=2).share()
    assert share.host_memory == 250e9 and share.cpu_adam == 1e9 and share.link == 12.5e9
    assert node(1).share() == node(1)


def test_hand_worked_zero2_and_zero3_steps_on_eight_gpus():
    """6 · 10e9 · 512 FLOP for the weights and 3 · 40 · 2 · (513 / 2) · 8192 · 512 for causal
    attention's two products, at 200e12: 154.9 ms of compute. ZeRO-2 reduce-scatters 7/8 · 20 GB
    during backward (38.9 ms at 450 GB/s, hidden) and all-gathers the new weights after the update
    (38.9 ms, exposed): 193.8 ms. ZeRO-3 moves 1.5 × as much, all of it during the passes
    (116.7 ms < 154.9 ms): 154.9 ms."""
    compute = (6 * 10e9 * 512 + 3 * 40 * 2 * (513 / 2) * 8192 * 512) / 200e12
    assert compute == pytest.approx(0.1549, abs=1e-4)
    report = planner.plan(WORK, node())
    zero2, zero3 = (
        by_name(report, "ZeRO-2, activations kept"),
        by_name(report, "ZeRO-3, activations kept"),
    )
    assert zero2.t_compute == pytest.approx(compute)
    assert zero2.t_interconnect == pytest.approx(17.5e9 / 450e9) == zero2.t_interconnect_after
    assert zero2.step == pytest.approx(compute + 17.5e9 / 450e9)
    assert zero3.t_interconnect == pytest.approx(52.5e9 / 450e9) and zero3.t_interconnect_after == 0
    assert zero3.step == pytest.approx(compute)
    assert by_name(report, "data parallel, activations kept").fits_gpu is False  # 160 GB of state
    assert report.chosen.step == pytest.approx(compute) and report.chosen.strategy in (
        "zero3",
        "fsdp2",
    )
    assert report.chosen.binding.startswith("compute")


def test_a_slow_interconnect_binds():
    """Over 10 GB/s, ZeRO-3's 52.5 GB take 5.25 s against 154.9 ms of compute."""
    report = planner.plan(WORK, node(interconnect="10 GB/s"))
    zero3 = by_name(report, "ZeRO-3, activations kept")
    assert zero3.step == pytest.approx(5.25) and zero3.binding.startswith("the interconnect")


def test_offloading_alone_updates_a_whole_copy_on_an_eighth_of_the_cores():
    """Sharded offload updates P/8 parameters at 1/8 of the node's rate: P / 8e9 = 1.25 s, as if one
    GPU had the whole node. Offloading alone updates all P at 1/8 of the rate: 10 s."""
    report = planner.plan(WORK, node())
    shared = by_name(report, "ZeRO-2 + offload optimizer, activations kept")
    alone = by_name(report, "data parallel + offload optimizer, activations kept")
    assert shared.t_cpu == pytest.approx(1.25) and alone.t_cpu == pytest.approx(10.0)
    assert alone.host_bytes == 16 * P and shared.host_bytes == 16 * P / 8


def test_host_memory_is_fitted_by_deepspeeds_own_estimate():
    """70 B, ZeRO-3 with the optimizer offloaded on 8 GPUs: 16 · 70.55e9 / 8 = 141 GB of state
    per GPU, 1.13 TB for the node; DeepSpeed's estimator asks 1.5 times that, 1.69 TB. So 1.2 TB
    of host memory, which the bare state would fit, does not hold it; FSDP2 with
    CPUOffloadPolicy, built on the meta device, holds its 149 GB a GPU (16 B a parameter, its
    pinned copies rounded up to powers of two) without DeepSpeed's allowance: 1.19 TB, more than
    1.2 TB less its 10 % reserve (1.08 TB), so it fits on 1.4 TB (1.26 TB usable); 2 TB holds
    ZeRO-3 too."""
    model = planner.Workload.of_model(architectures.load("llama-3.1-70b"), batch=1, seq=1024)
    name = "ZeRO-3 + offload optimizer, activations kept"
    deepspeed = pytest.importorskip("deepspeed.runtime.zero.stage3")
    cpu, gpu, _ = deepspeed.estimate_zero3_model_states_mem_needs(
        model.params,
        model.largest_module_params(),
        8,
        1,
        cpu_offload=True,
        cpu_offload_params=False,
    )
    for host, usable, each in (("1 TB", "900 GB", "112 GB"), ("1.2 TB", "1.08 TB", "135 GB")):
        report = planner.plan(model, node(host=host))
        short = by_name(report, name)
        assert short.host_bytes == pytest.approx(16 * model.params / 8) and short.fits_gpu
        assert short.host_need == pytest.approx(cpu, abs=1) and short.estimate[
            "gpu_bytes"
        ] == pytest.approx(gpu, abs=1)
        assert not short.fits_host and short.binding.startswith(
            "host memory: needs 1.69 TB by DeepSpeed's estimate (141 GB per GPU of state) of the "
            f"{usable} usable of the node's {host}, {each} a GPU"  # (the usable share: 125 before)
        )
    nothing = planner.plan(model, node(host="1 TB"))
    fsdp = by_name(nothing, "FSDP2 + offload optimizer+parameters, activations kept")
    assert round(fsdp.host_bytes / 1e9) == 149 and fsdp.host_need == 8 * fsdp.host_bytes
    # CPUOffloadAdam on FSDP2's shards keeps the 16-bit shard on the GPU: 16 B a parameter on the
    # host (fp32 master, two moments, a 16-bit landing and outgoing copy), 8 fewer than the policy
    ours = by_name(nothing, "FSDP2 + offload optimizer, activations kept")
    assert ours.host_bytes == pytest.approx(16 * model.params / 8)
    assert ours.host_need == 8 * ours.host_bytes
    # The refusal names what the closest plan needs (the least host memory), and what would help.
    assert (
        nothing.chosen is None
        and ours.binding in nothing.warnings[0]
        and "add nodes" in nothing.warnings[0]
    )
    assert planner.plan(model, node(host="1.2 TB")).chosen is None  # 1.19 TB leaves no reserve
    assert planner.plan(model, node(host="1.4 TB")).chosen.strategy == "fsdp2"
    fits = planner.plan(model, node(host="2 TB"))
    zero3 = by_name(fits, name)
    assert zero3.fits and zero3.to_dict()["deepspeed_estimate"][
        "host_bytes_per_node"
    ] == pytest.approx(cpu, abs=1)


def test_nvme_is_planned_only_when_the_drive_is_given():
    eight_b = planner.Workload.of_model(architectures.load("llama-3.1-8b"))
    small_host = dict(host_memory="64 GB")
    without = planner.plan(eight_b, planner.Hardware("24 GB", "25 GB/s", **small_host))
    assert without.chosen is None and "--nvme" in without.warnings[0]
    # the next tier's what-if
    assert "assumption" in without.warnings[1] and "would fit" in without.warnings[1]
    drive = planner.plan(eight_b, planner.Hardware("24 GB", "25 GB/s", nvme="3 GB/s", **small_host))
    # ZeRO-3's 18 B on the drive
    assert drive.chosen.layout.nvme_bytes == pytest.approx(18 * eight_b.params)
    assert drive.chosen.binding.startswith("the NVMe drive") and "NVMe" in drive.warnings[0]


def test_probe_record_feeds_the_hardware(tmp_path):
    record = {
        "machine": {
            "host_memory_bytes": 64e9,
            "logical_cores": 16,
            "accelerator": {"kind": "cuda", "memory_bytes": 85e9},
        },
        "ladder": {
            "tiers": [{"name": "host memory", "bandwidth_bytes_per_s": 56e9, "source": "measured"}],
            "links": [{"name": "host → GPU", "bandwidth_bytes_per_s": 24e9, "source": "measured"}],
        },
    }
    hw = planner.Hardware.from_probe(record)
    assert (hw.gpu_memory, hw.link, hw.host_memory, hw.cpu_adam) == (85e9, 24e9, 64e9, 2e9)
    assert any("derived" in s for s in hw.sources) and hw.assumptions == [
        f"compute {planner.ASSUMED_COMPUTE / 1e12:.0f} TFLOP/s (assumed; measure yours or pass "
        "--compute)"
    ]
    given = planner.Hardware.from_probe(record, gpu_memory="80 GB", gpus_per_node=2)
    assert given.gpu_memory == 80e9 and given.gpus_per_node == 2
    assert not any(s.startswith("GPU memory") for s in given.sources)
    with pytest.raises(ValueError, match="^measured: expected an `offloadlab probe --json` record"):
        planner.Hardware.from_probe({"records": []})


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(gpus_per_node=0), "^gpus_per_node: expected a positive integer; got 0$"),
        (
            dict(gpus_per_node=2, gpus_per_link=4),
            r"^gpus_per_link: expected a divisor of gpus_per_node=2 .*; got 4$",
        ),
        (
            dict(gpus_per_node=4, gpus_per_link=3),
            r"^gpus_per_link: expected a divisor of gpus_per_node=4 .*; got 3$",
        ),
        (dict(gpus_per_node=2, interconnect="fast"), "^interconnect: "),
        (dict(nvme="0 GB/s"), "^nvme: "),
    ],
)
def test_node_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        planner.Hardware("80 GB", "25 GB/s", **kwargs)


EIGHT_B = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--gpu-memory",
    "24 GB",
    "--link",
    "25 GB/s",
    "--host-memory",
    "64 GB",
]


def test_plan_a_real_model_exactly():
    payload = json.loads(offloadlab(*EIGHT_B, "--json").stdout)
    assert payload["params"] == 8_030_261_248 and payload["model"]["kv_heads"] == 8
    # 96 GB of fp32 optimizer state cannot live in 64 GB of host memory
    assert payload["chosen"] is None
    refused = offloadlab(*EIGHT_B, "--emit", "deepspeed")
    assert (
        refused.returncode == 2
        and refused.stderr.count("\n") == 1
        and "nothing fits" in refused.stderr
    )
    text = offloadlab(*EIGHT_B, "--nvme", "3 GB/s", "--emit", "deepspeed")
    assert text.returncode == 0, text.stderr
    assert "8,030,261,248 parameters" in text.stdout and "to NVMe" in text.stdout
    waits = next(line for line in text.stdout.splitlines() if "then the GPU waits" in line)
    # what the GPU waits for names the drive, which takes most of the step
    assert ", NVMe " in waits
    assert '"device": "nvme"' in text.stdout and "--nvme-path" in text.stdout
    # FSDP2 has no NVMe tier: refused
    fsdp = offloadlab(*EIGHT_B, "--nvme", "3 GB/s", "--emit", "fsdp")
    assert (
        fsdp.returncode == 2 and fsdp.stdout == "" and "no FSDP2 configuration fits" in fsdp.stderr
    )


def test_a_local_config_beyond_the_params_bound_is_refused(tmp_path):
    config = json.loads((architectures.CONFIG_FOLDER / "qwen2-7b.json").read_text())
    config["num_hidden_layers"] = 10**30
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = offloadlab(
        "plan",
        "--model-config",
        str(tmp_path / "config.json"),
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--json",
    )
    assert (
        result.returncode == 2
        and "expected 'num_hidden_layers' to be at most 100,000 layers" in result.stderr
    )
    # (a width its 28 heads divide: the formula, which counts a known family, checks that first)
    config["num_hidden_layers"], config["hidden_size"] = 80, 28 * 2**25
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = offloadlab(
        "plan",
        "--model-config",
        str(tmp_path / "config.json"),
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--json",
    )
    assert (
        result.returncode == 2 and "expected a model of at most 1e+15 parameters" in result.stderr
    )


def test_plan_a_local_config_on_a_node(tmp_path):
    config = tmp_path / "config.json"
    config.write_text((architectures.CONFIG_FOLDER / "qwen2-7b.json").read_text())
    result = offloadlab(
        "plan",
        "--model-config",
        str(config),
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "1 TB",
        "--gpus-per-node",
        "8",
        "--interconnect",
        "450 GB/s",
        "--json",
        "--emit",
        "deepspeed",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["params"] == 7_615_616_512 and payload["gpus_per_node"] == 8
    assert payload["chosen"]["gpus"] == 8 and payload["deepspeed"]["train_batch_size"] == 8
    shared = offloadlab(
        "plan",
        "--model-config",
        str(config),
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--gpus-per-node",
        "4",
        "--gpus-per-link",
        "2",
    )
    assert (
        "each gets 1/4 of host memory and CPU cores, and shares its link with 1 other(s)"
        in shared.stdout
    )


def test_plan_from_a_probe_record(tmp_path):
    measured = tmp_path / "probe.json"
    probe = offloadlab("probe", "--quick", "--disk", str(tmp_path), "--json", str(measured))
    assert probe.returncode == 0, probe.stderr
    result = offloadlab(
        "plan", "--params", "1e9", "--measured", str(measured), "--gpu-memory", "24 GB"
    )
    assert result.returncode == 0, result.stderr
    # no GPU here: the link was emulated
    assert "measured: link" in result.stdout and "emulated" in result.stdout
    no_gpu = offloadlab("plan", "--params", "1e9", "--measured", str(measured))
    assert (
        no_gpu.returncode == 2
        and "measured: the record has no gpu memory; pass --gpu-memory" in no_gpu.stderr
    )


def test_the_issue_16_command_no_longer_calls_an_oversized_plan_a_fit():
    payload = json.loads(
        offloadlab(
            "plan", "--params", "10e9", "--gpu-memory", "80 GB", "--link", "25 GB/s", "--json"
        ).stdout
    )
    kept = next(p for p in payload["plans"] if p["name"] == "offload nothing, activations kept")
    assert (
        kept["fits"] is False
        and kept["gpu_bytes"] > 160e9
        and kept["binding"].startswith("GPU memory: needs ")
    )


def test_emit_when_nothing_fits_names_the_flag_and_what_to_run():
    """The 8 B model on 24 GB and 64 GB of host memory: no plan, so nothing to emit — one line,
    exit 2."""
    result = offloadlab(*EIGHT_B, "--emit", "fsdp")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "offloadlab: error: offloadlab plan: --emit fsdp: nothing fits on this hardware, so there "
        "is no configuration to emit (run without --emit to see what binds)"
    ]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--params", "1e9", "--model", "gpt2"],
            "expected exactly one of --params, --model or --model-config; got --params and --model",
        ),
        (["--model", "llama-3.1-8", "--json"], "model: expected one of bloom-560m"),
        (["--model", "llama-3.1-8"], "got 'llama-3.1-8' (did you mean 'llama-3.1-8b'?)"),
        (
            ["--model-config", "/nonexistent/config.json"],
            "--model-config: expected a config.json file",
        ),
        (["--model", "gpt2", "--layers", "2"], "--layers/--hidden/--heads go with --params"),
        (["--params", "1e9", "--interconnect", "450 GB/s"], "need --gpus-per-node above 1"),
        (["--params", "1e9", "--gpus-per-node", "0"], "--gpus-per-node"),
        (
            ["--params", "1e9", "--measured", "/nonexistent.json"],
            "--measured: expected an `offloadlab probe --json` file",
        ),
        (
            ["--params", "1e12", "--layers", "2", "--hidden", "10", "--heads", "3"],
            "heads: expected a divisor of hidden=10",
        ),
    ],
)
def test_plan_bad_arguments(args, fragment):
    result = offloadlab("plan", "--gpu-memory", "80 GB", "--link", "25 GB/s", *args)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_long_context_finds_a_plan():
    """The issue's command: Llama 3.1 8B, 32,768 tokens a GPU, 8 × 80 GB, 1 TB of host memory.
    With SDPA there is no s² term; the logits and loss, counted now, are most of what remains."""
    result = offloadlab(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpus-per-node",
        "8",
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "1 TB",
        "--seq",
        "32768",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["chosen"]["fits"] and payload["activations"]["attention"] == "sdpa"
    assert payload["activations"]["logits_bytes"] == 14 * 128256 * 32768
    assert payload["model"]["counted_by"].startswith(("transformers", "formula"))
    chosen = payload["chosen"]
    if chosen["engine"] == "deepspeed":  # fitted, and printed, by DeepSpeed's own estimate too
        stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
            payload["params"],
            payload["model"]["largest_module_params"],
            8,
            1,
            cpu_offload=True,
            cpu_offload_params=chosen["offload"] == "optimizer+parameters",
            zero_init=1,
        )
        assert chosen["deepspeed_estimate"]["host_bytes_per_node"] == pytest.approx(cpu, abs=1)
        assert chosen["deepspeed_estimate"]["gpu_bytes"] == pytest.approx(gpu, abs=1)
        text = offloadlab(
            "plan",
            "--model",
            "llama-3.1-8b",
            "--gpus-per-node",
            "8",
            "--gpu-memory",
            "80 GB",
            "--link",
            "25 GB/s",
            "--host-memory",
            "1 TB",
            "--seq",
            "32768",
        ).stdout
        assert "DeepSpeed's own estimate: GPU" in text


def test_zero2_offload_on_eight_gpus_fits_by_deepspeeds_loading_peak():
    """ZeRO-2 with the optimizer offloaded: every one of 8 processes loads the fp32 model, so
    DeepSpeed asks max(4 · 8, 16) · 1.5 = 48 B a parameter of host memory: 385 GB for 8 B, three
    times the 128 GB of state."""
    eight_b = planner.Workload.of_model(architectures.load("llama-3.1-8b"))
    report = planner.plan(eight_b, node(8, host="2 TB"))
    zero2 = by_name(report, "ZeRO-2 + offload optimizer, activations kept")
    assert zero2.host_bytes * 8 == pytest.approx(16 * eight_b.params)
    assert (
        zero2.host_need == pytest.approx(48 * eight_b.params)
        and round(zero2.host_need / 1e9) == 385
    )
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    cpu, _ = stage2.estimate_zero2_model_states_mem_needs(eight_b.params, 8, 1, cpu_offload=True)
    assert zero2.host_need == pytest.approx(cpu, abs=1)
    assert not by_name(planner.plan(eight_b, node(8, host="300 GB")), zero2.name).fits


def test_deepspeed_sends_fp32_gradients_down_and_uploads_after_the_update():
    report = planner.plan(WORK, node())
    zero2 = by_name(report, "ZeRO-2 + offload optimizer, activations kept")
    assert zero2.d2h_bytes == pytest.approx(4 * P / 8) and zero2.h2d_bytes == pytest.approx(
        2 * P / 8
    )
    assert zero2.serial_upload and zero2.step == pytest.approx(
        max(zero2.t_compute, zero2.t_interconnect, zero2.t_transfer)
        + zero2.t_cpu
        + zero2.t_upload_after
        + zero2.t_interconnect_after
    )
    alone = by_name(report, "data parallel + offload optimizer, activations kept")
    assert not alone.serial_upload  # offloadlab's own pipeline uploads each layer as it is updated


def test_fsdp2_offload_counts_its_pinned_copies_as_torch_rounds_them():
    """CPUOffloadPolicy pins each sharded parameter and gradient on its own; torch's pinned
    allocator rounds each to a power of two. Llama 3.1 8B's MLP projection, 14336 × 4096 fp32 on
    8 GPUs, is 29.4 MB a shard and takes 32 MiB."""
    from offloadlab import sharding

    shard = 14336 // 8 * 4096 * 4
    assert sharding.fsdp2_pinned_bytes([(14336, 4096)], 8) == 2 * 2**25 > 2 * shard
    eight_b = planner.Workload.of_model(architectures.load("llama-3.1-8b"))
    fsdp = by_name(
        planner.plan(eight_b, node(8)), "FSDP2 + offload optimizer+parameters, activations kept"
    )
    exact = 16 * eight_b.params / 8
    assert exact < fsdp.host_bytes < 1.3 * exact and fsdp.host_need == 8 * fsdp.host_bytes


def test_emit_for_another_engine_says_so_and_is_refused_when_that_engine_does_not_fit():
    args = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpus-per-node",
        "8",
        "--gpu-memory",
        "24 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "2 TB",
        "--seq",
        "4096",
    ]
    deepspeed = offloadlab(*args, "--emit", "deepspeed")
    # the plan is DeepSpeed's
    assert deepspeed.returncode == 0 and "note: --emit" not in deepspeed.stdout
    fsdp = offloadlab(*args, "--emit", "fsdp")
    notes = [line for line in fsdp.stdout.splitlines() if line.startswith("note: --emit fsdp:")]
    assert fsdp.returncode == 0 and len(notes) == 1 and "FSDP2 runs FSDP2 + offload" in notes[0]
    single = offloadlab(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu-memory",
        "80 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "512 GB",
        "--emit",
        "deepspeed",
        "--json",
    )
    emitted = json.loads(single.stdout)["emitted_plan"]
    assert (
        "its update waits for the end of backward" in emitted["note"]
        and emitted["engine"] == "deepspeed"
    )
    assert emitted["step_s"] >= json.loads(single.stdout)["chosen"]["step_s"]
    short = offloadlab(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu-memory",
        "24 GB",
        "--link",
        "25 GB/s",
        "--host-memory",
        "64 GB",
        "--nvme",
        "3 GB/s",
        "--emit",
        "fsdp",
    )
    assert (
        short.returncode == 2
        and short.stderr.count("\n") == 1
        and "no FSDP2 configuration fits" in short.stderr
    )


def _shipped(name, **changes):
    config = json.loads((architectures.CONFIG_FOLDER / f"{name}.json").read_text())
    return {**config, **changes}


# (config, what the one line names): every one is refused whichever way the model is counted
BAD_CONFIGS = {
    "JSON array": ([1, 2], "expected a JSON object (a model's config.json); got a JSON array"),
    "JSON string": ("llama", "got a JSON string"),
    "float width": (_shipped("llama-3.2-1b", hidden_size=2048.0), "'hidden_size' to be a positive"),
    "string layers": (_shipped("llama-3.2-1b", num_hidden_layers="16"), "'num_hidden_layers'"),
    "flag as text": (_shipped("llama-3.2-1b", tie_word_embeddings="yes"), "true or false"),
    "no heads": (_shipped("llama-3.2-1b", num_attention_heads=0), "'num_attention_heads'"),
    "kv heads": (_shipped("llama-3.2-1b", num_key_value_heads=5), "divide"),
    "width missing": ({"model_type": "qwen3"}, "'hidden_size' for a qwen3 model; it is missing"),
    "width null": (_shipped("llama-3.2-1b", hidden_size=None), "'hidden_size'"),
    "top-k above the experts": (
        _shipped("mixtral-8x7b", num_experts_per_tok=20),
        "'num_experts_per_tok' from 1 to the 8 experts; got 20",
    ),
    "top-k zero": (_shipped("mixtral-8x7b", num_experts_per_tok=0), "'num_experts_per_tok'"),
    "text_config not an object": (
        _shipped("gemma-3-4b", text_config=[1]),
        "expected 'text_config' to be an object",
    ),
}
# refused by transformers' own checks, or only where transformers builds the model
TRANSFORMERS_ONLY = {
    "Llama 4 Scout as published": (
        {
            "model_type": "llama4",
            "text_config": {
                "attn_temperature_tuning": 4,
                "hidden_size": 5120,
                "intermediate_size": 8192,
                "intermediate_size_mlp": 16384,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "num_hidden_layers": 48,
                "num_local_experts": 16,
                "num_experts_per_tok": 1,
                "vocab_size": 202048,
            },
        },
        "refuses this llama4_text config: TypeError: Field 'attn_temperature_tuning' expected "
        "bool, got int",
    ),
    "attention-free": (
        {
            "model_type": "mamba",
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "vocab_size": 1000,
            "state_size": 16,
        },
        "a mamba model has no attention layers",
    ),
}


@pytest.mark.parametrize("count", ["transformers", "formula", "auto"])
@pytest.mark.parametrize("case", [*BAD_CONFIGS, *TRANSFORMERS_ONLY])
def test_every_bad_config_is_one_line_and_exit_2_however_it_is_counted(
    tmp_path, capsys, case, count
):
    from offloadlab.cli import main

    config, fragment = {**BAD_CONFIGS, **TRANSFORMERS_ONLY}[case]
    if case in TRANSFORMERS_ONLY and count != "transformers":
        fragment = ""  # the formulas know no such family: refused for that, in one line
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    status = main(
        ["plan", "--model-config", str(path), "--gpu-memory", "80 GB", "--link", "25 GB/s"]
        + ["--count", count]
    )
    err = capsys.readouterr().err
    assert status == 2 and fragment in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_widths_from_transformers_defaults_are_named(tmp_path, capsys):
    from offloadlab.cli import main

    path = tmp_path / "config.json"
    sizes = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16}
    path.write_text(json.dumps({"model_type": "qwen3", **sizes, "head_dim": 64}))
    args = ["plan", "--model-config", str(path), "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    assert main([*args, "--count", "transformers"]) == 0
    out = capsys.readouterr().out
    assert "from transformers' qwen3 defaults: intermediate_size 22016, vocab_size 151936" in out


def test_a_hybrid_names_its_state_space_layers(tmp_path, capsys):
    from offloadlab.cli import main

    path = tmp_path / "jamba.json"
    jamba = {
        "model_type": "jamba",
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 4,  # attention in layers 2 and 6, Mamba in the other six
        "attn_layer_offset": 2,
        "use_mamba_kernels": False,
    }
    path.write_text(json.dumps(jamba))
    args = ["plan", "--model-config", str(path), "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    assert main([*args, "--count", "transformers"]) == 0
    out = capsys.readouterr().out
    assert (
        "a hybrid: 6 of its 8 layers hold state-space or recurrent blocks, their activations "
        "measured" in out
    )


def test_across_nodes_the_network_carries_the_collectives_and_each_node_holds_its_share():
    """Four nodes of eight, 10 B parameters: ZeRO-3's collectives move 3 · 31/32 · 20 GB = 58.1 GB a
    GPU, over the ring's slowest hop, the 50 GB/s network: 1.16 s, hidden behind 1.24 s of compute
    (the overlap condition, now for the network); over 25 GB/s they take 2.33 s and bind. Each
    node holds its eight GPUs' shares, and DeepSpeed's estimate is for one node."""
    work = planner.Workload(10e9, layers=40, hidden=4096, heads=32, batch=8, seq=512)
    fast, slow = (
        planner.plan(work, node(nodes=4, network=network)) for network in ("50 GB/s", "25 GB/s")
    )
    zero3 = by_name(fast, "ZeRO-3, activations kept")
    assert zero3.layout.gpus == 32 and zero3.nodes == 4
    assert zero3.layout.interconnect_bytes == pytest.approx(3 * 31 / 32 * 20e9)
    assert zero3.t_interconnect == pytest.approx(3 * 31 / 32 * 20e9 / 50e9)
    assert zero3.t_interconnect < zero3.t_compute and zero3.step == pytest.approx(zero3.t_compute)
    slow3 = by_name(slow, "ZeRO-3, activations kept")
    assert slow3.t_interconnect == pytest.approx(2 * zero3.t_interconnect)
    assert slow3.step == pytest.approx(slow3.t_interconnect)
    assert slow3.binding.startswith("the network: collectives take")
    offloaded = by_name(fast, "ZeRO-3 + offload optimizer, activations kept")
    assert offloaded.to_dict()["host_bytes_per_node"] == pytest.approx(8 * offloaded.host_bytes)


def test_plan_on_four_nodes_from_the_command_line(capsys):
    from offloadlab.cli import main

    args = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    assert main([*args, "--gpus-per-node", "8", "--nodes", "4", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["nodes"] == 4 and payload["chosen"]["gpus"] == 32
    assert main([*args, "--gpus-per-node", "8", "--nodes", "4", "--emit", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "assumed: network 50 GB/s each way per GPU between nodes" in out
    assert "torchrun --nnodes 4 --nproc-per-node 8" in out
    assert main([*args, "--network", "50 GB/s"]) == 2
    assert "network: the link between nodes; give it with nodes above 1" in capsys.readouterr().err
    assert main([*args, "--nodes", "0"]) == 2


QWEN3_32B = {
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 64,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_a_sequence_split_over_c_gpus_keeps_and_computes_a_cth_and_rings_the_keys_and_values():
    """Context parallelism over 4 GPUs at 32,768 tokens: a quarter of the tokens each, so a
    quarter of the activations and of the compute (attention still over the whole sequence);
    the ring brings each GPU the other 3/4 of the keys and values, 2 · 1,024 · 2 bytes a token
    and layer, three times a step (forward, backward, gradients), once more where recomputed."""
    arch = architectures.from_config(QWEN3_32B)
    whole = planner.Workload.of_model(arch, seq=32768)
    split = planner.Workload(
        arch.params, arch.layers, arch.hidden, arch.heads, 1, 32768, arch, context=4
    )
    assert split.tokens == 8192
    assert split.activations(0).layers == pytest.approx(whole.activations(0).layers / 4)
    assert split.compute_flops(0) == pytest.approx(whole.compute_flops(0) / 4)
    kv = 2 * 8 * 128 * 2
    assert split.context_bytes(0) == pytest.approx(3 * 64 * kv * 32768 * 3 / 4)
    assert split.context_bytes(16) == pytest.approx((3 * 64 + 16) * kv * 32768 * 3 / 4)
    assert whole.context_bytes(0) == 0
    with pytest.raises(ValueError, match="^context: expected a divisor of seq=32768"):
        planner.Workload(1e9, seq=32768, context=3)


def test_long_context_that_fits_nowhere_whole_is_split_over_the_fewest_gpus_that_fit(capsys):
    """Qwen3-32B at 131,072 tokens on a node of eight 80 GB GPUs: no plan fits with whole
    sequences (the issue's 'nothing fits'); split over the node's GPUs, one does, and the fewest
    GPUs that fit are used."""
    arch = architectures.from_config(QWEN3_32B)
    work = planner.Workload.of_model(arch, seq=131072)
    report = planner.plan(work, node(host="2 TB"))
    assert not any(p.fits for p in report.plans if p.context == 1)
    chosen = report.chosen
    assert chosen is not None and chosen.context > 1 and "context parallel over" in chosen.name
    assert not any(p.fits for p in report.plans if p.context < chosen.context)
    assert chosen.to_dict()["context_parallel"] == chosen.context
    report_text = report.explain()
    assert f"each of {chosen.context} GPUs of a node computes" in report_text
    _, note = engines.plan_for(report, "fsdp")
    assert "context parallelism), which this FSDP2 setup does not do" in note
