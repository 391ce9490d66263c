"""The emitted configurations run: DeepSpeed's own config class accepts them in a real gloo world
of 1, 4 and 8 processes, and the FSDP2 script trains on two CPU processes (gloo) — TinyGPT to the
losses of single-process AdamW, and a transformers model as written."""

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offloadlab import architectures, distributed, engines, planner, sharding
from offloadlab.models import TinyGPT

ROOT = Path(__file__).resolve().parent.parent
SETUPS = [
    dict(strategy=strategy, offload=offload, recompute=recompute, precision=precision)
    for strategy in sharding.STRATEGIES
    for offload in sharding.OFFLOADS
    if engines.offered(strategy, offload)
    for recompute in (False, True)
    for precision in ("bf16", "fp16")
]
WORLDS = (1, 4, 8)


def _configs(world):
    """Every emitted config for ``world`` GPUs, then NVMe, ZenFlow, and a batch made for another
    world."""
    configs = [
        engines.deepspeed_config(engines.Setup(**s, gpus=world, micro_batch=2, accumulation=4))
        for s in SETUPS
    ]
    nvme = engines.Setup(
        "zero3",
        "optimizer+parameters",
        gpus=world,
        offload_device="nvme",
        nvme_path="/local_nvme",
        nvme_buffer=131_334_144,
    )
    zenflow = engines.deepspeed_config(engines.Setup("zero2", "optimizer", gpus=world))
    zenflow["zero_optimization"]["zenflow"] = engines.zenflow_block()
    wrong = engines.deepspeed_config(
        engines.Setup("zero2", "optimizer", gpus=2 * world, micro_batch=2)
    )
    share = engines.deepspeed_config(
        engines.Setup("zero3", "optimizer", gpus=world, offload_ratio=0.3)
    )
    configs += [engines.deepspeed_config(nvme), zenflow, wrong, share]
    if world == 8:  # the planner's own, for four nodes of two GPUs
        configs.append(engines.deepspeed_config(engines.setup(_four_nodes(), "deepspeed")))
    return configs


def _four_nodes():
    """Llama 3.1 70B planned on four nodes of two 80 GB GPUs (8 in all), 4,096 tokens each."""
    work = planner.Workload.of_model(architectures.load("llama-3.1-70b"), seq=4096)
    hardware = planner.Hardware(
        "80 GB", "25 GB/s", host_memory="1 TB", gpus_per_node=2, nodes=4, network="50 GB/s"
    )
    return planner.plan(work, hardware)


@functools.lru_cache(maxsize=None)
def deepspeed_reads(world):
    """What DeepSpeedConfig reads from each of :func:`_configs`, in a gloo world of ``world``
    processes."""
    pytest.importorskip("deepspeed")
    folder = (
        Path(os.environ.get("PYTEST_TMP", "/tmp"))
        / f"offloadlab-deepspeed-world-{os.getpid()}-{world}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configs.json").write_text(json.dumps(_configs(world)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(ROOT / "tests" / "deepspeed_world.py"),
        str(folder / "configs.json"),
        str(folder / "out.json"),
    ]
    # A world of eight on a busy machine has once failed in gloo's own handshake, before
    # DeepSpeed read anything ("connectFullMesh failed ... Connection closed by peer"): that, and
    # only that, is tried once more. Every output is kept beside the configs, and the first line
    # of a failure (what a summary of the run shows) says how long the world ran and its first
    # error.
    for attempt in (1, 2):
        started = time.monotonic()
        done = subprocess.run(launch, capture_output=True, text=True, timeout=600, env=env)
        log = folder / f"launcher-{attempt}.log"
        log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        if done.returncode == 0 or "connectFullMesh failed" not in done.stderr:
            break
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
    assert done.returncode == 0, (
        f"torch.distributed.run exited {done.returncode} after "
        f"{time.monotonic() - started:.0f} s (attempt {attempt}); first error: "
        f"{errors[0] if errors else 'none'}; output in {log}\n"
        + "\n".join(errors[:20])
        + "\n"
        + done.stderr[-2000:]
    )
    out = json.loads((folder / "out.json").read_text())
    assert out["world"] == world
    return out["results"]


@pytest.mark.slow  # (DeepSpeed in a real world of processes)
@pytest.mark.parametrize("world", WORLDS)
def test_every_deepspeed_config_passes_deepspeeds_validation_in_a_real_world(world):
    reads = deepspeed_reads(world)
    for setup, read in zip(SETUPS, reads):
        s = engines.Setup(**setup, gpus=world)
        assert "error" not in read, (setup, read)
        assert read["world_size"] == world and read["train_batch_size"] == 2 * 4 * world
        assert (
            read["stage"] == s.stage
            and read["optimizer"] == "adamw"
            and read["gradient_clipping"] == 1.0
        )
        assert (read["offload_optimizer"] is not None) == (s.offload != "none")
        assert (read["offload_param"] is not None) == (s.offload == "optimizer+parameters")
        assert read["bf16"] == (s.precision == "bf16") and read["fp16"] == (s.precision == "fp16")
    nvme, zenflow, wrong, share = reads[len(SETUPS) : len(SETUPS) + 4]
    if world == 8:  # four nodes of two: one config for all eight ranks
        (multi_node,) = reads[len(SETUPS) + 4 :]
        chosen = engines.setup(_four_nodes(), "deepspeed")
        assert chosen.gpus == 8 and chosen.nodes == 4, chosen
        assert "error" not in multi_node, multi_node
        assert multi_node["world_size"] == 8 and multi_node["train_batch_size"] == 8
        assert multi_node["stage"] == chosen.stage
    assert share["offload_ratio"] == 0.3 and nvme["offload_ratio"] == 1.0
    assert nvme["offload_param"] == "nvme" and nvme["nvme_path"] == "/local_nvme"
    assert nvme["buffer_size"] == 131_334_144 and nvme["aio_queue_depth"] == 8
    assert zenflow["zenflow_update_interval"] == 4
    # The validation has teeth: a train batch that is not micro × accumulation × world is refused.
    assert "train_batch_size is not equal" in wrong["error"]


def test_every_aio_key_emitted_is_one_deepspeed_reads():
    """DeepSpeed drops aio keys it does not know without a word: every one emitted must be read."""
    constants = pytest.importorskip("deepspeed.runtime.swap_tensor.constants")
    known = {
        value
        for name, value in vars(constants).items()
        if name.startswith("AIO_") and isinstance(value, str)
    }
    setup = engines.Setup(
        "zero3", "optimizer+parameters", gpus=8, offload_device="nvme", nvme_path="/local_nvme"
    )
    assert set(engines.deepspeed_config(setup)["aio"]) <= known


def test_the_nvme_buffer_holds_the_largest_shard():
    """DeepSpeed's partitioned_param_swapper asserts numel <= buffer_size for each parameter's
    partition: Llama 3.1 70B's embedding on 8 GPUs is 131,334,144 elements, past the default 1e8."""
    llama70 = architectures.load("llama-3.1-70b")
    assert llama70.largest_weight_params == 128256 * 8192
    shard = -(-llama70.largest_weight_params // 8)
    assert shard == 131_334_144 > sharding.NVME_DEFAULT_BUFFER
    work = planner.Workload.of_model(llama70, seq=1024)
    report = planner.plan(
        work,
        planner.Hardware("80 GB", "25 GB/s", host_memory="512 GB", gpus_per_node=8, nvme="6 GB/s"),
    )
    assert report.chosen.layout.nvme_bytes  # the plan goes to NVMe
    config = engines.deepspeed_config(engines.setup(report, "deepspeed"))
    assert config["zero_optimization"]["offload_param"]["buffer_size"] >= shard
    staging = (
        sharding.NVME_BUFFER_COUNT * config["zero_optimization"]["offload_param"]["buffer_size"] * 2
    )
    assert report.chosen.layout.host_bytes >= staging  # the host keeps the buffers it was sized for


def test_optimizer_block_is_there_for_deepspeeds_cpu_adam():
    config = engines.deepspeed_config(engines.Setup("zero2", "optimizer"))
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    }
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            dict(strategy="zero2", offload="optimizer+parameters"),
            "^offload: expected a combination the engines offer",
        ),
        (dict(strategy="ddp", offload="optimizer"), "^offload: "),
        (dict(gpus=0), "^gpus: expected a positive integer; got 0$"),
        (dict(precision="fp8"), "^precision: "),
        (dict(strategy="zero3", offload="optimizer", offload_device="nvme"), "^nvme_path: "),
        (
            dict(strategy="zero2", offload="optimizer", offload_device="nvme", nvme_path="/x"),
            "only with ZeRO-3",
        ),
        (
            dict(checkpointed=3),
            "^checkpointed: expected a positive number of blocks, with recompute",
        ),
        (dict(recompute=True, checkpointed=0), "^checkpointed: "),
        (dict(clipping=-1.0), "^clipping: "),
        (dict(strategy="zero3", offload="optimizer", offload_ratio=1.5), "^offload_ratio: "),
        (dict(strategy="zero2", offload="optimizer", offload_ratio=0.5), "only with ZeRO-3"),
    ],
)
def test_setup_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        engines.Setup(**kwargs)


def test_snippets_compile_and_turn_recomputation_on():
    for setup in SETUPS:
        s = engines.Setup(**setup, gpus=8)
        for snippet in (engines.fsdp_snippet(s), engines.deepspeed_snippet(s)):
            compile(snippet, "<snippet>", "exec")
            assert ("checkpoint, block.forward" in snippet) == s.recompute
    partial = engines.fsdp_snippet(engines.Setup("fsdp2", "none", recompute=True, checkpointed=5))
    assert (
        "for block in model.model.layers[:5]:  # recompute the first 5 blocks' activations"
        in partial
    )


def test_the_fsdp2_script_does_what_a_gpu_node_needs():
    script = engines.fsdp_snippet(engines.Setup("fsdp2", "optimizer+parameters", gpus=8))
    assert (
        'local_rank = int(os.environ["LOCAL_RANK"])' in script
        and "torch.cuda.set_device(local_rank)" in script
    )
    meta = script.index('with torch.device("meta"):')
    # fp32 master shards
    assert "dtype=torch.float32" in script[meta : script.index("fully_shard(block")]
    assert (
        script.index("fully_shard(model")
        < script.index("model.to_empty(")
        < script.index("initialize_weights")
    )
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)" in script
    assert "fused=True" in script and "clip_grad_norm_(model.parameters(), 1.0)" in script
    plain = engines.fsdp_snippet(engines.Setup("fsdp2", "none"))
    assert "CPUOffloadPolicy" not in plain and "model.to_empty(device=device)" in plain


def test_the_fsdp2_script_with_cpuoffloadadam_scales_an_fp16_loss():
    """CPUOffloadAdam divides fp16 gradients by its loss scale: a script that did not scale the
    loss took steps 11 times too small (and never clipped)."""
    fp16 = engines.fsdp_snippet(
        engines.Setup("fsdp2", "optimizer", gpus=2, precision="fp16", accumulation=4)
    )
    assert "optimizer.scale_loss(loss / 4).backward()" in fp16
    assert "model.to(torch.float16)" in fp16 and "master weights are the optimizer's" in fp16
    assert "clip_grad_norm_" not in fp16 and "max_grad_norm=1.0" in fp16
    bf16 = engines.fsdp_snippet(engines.Setup("fsdp2", "optimizer", gpus=2))
    assert "        loss.backward()" in bf16 and "scale_loss" not in bf16


def test_the_deepspeed_snippet_builds_the_model_partitioned_under_zero3():
    zero3 = engines.deepspeed_snippet(engines.Setup("zero3", "optimizer"))
    assert zero3.index("HfDeepSpeedConfig(ds_config)") < zero3.index("from_pretrained(MODEL)")
    assert "deepspeed.zero.Init(config_dict_or_path=ds_config)" in zero3 and "zenflow" in zero3
    zero2 = engines.deepspeed_snippet(engines.Setup("zero2", "none"))
    assert "HfDeepSpeedConfig" not in zero2 and "zenflow" not in zero2


@pytest.mark.slow  # (torchrun, two processes)
def test_emitted_fsdp2_snippet_trains_on_two_cpu_processes(tmp_path):
    """The script as emitted (CPUOffloadPolicy, recomputation, bf16, meta-device build) on torchrun
    with gloo, TinyGPT built in it and filled with the reference weights.

    Tolerance: each step's mean loss within 0.1 % of single-process fp32 AdamW on the same global
    batch (measured here: at most 1.2e-4 relative; bf16 compute and reductions are the difference).
    """
    steps = 4
    run = distributed.launch(
        "optimizer+parameters", recompute=True, steps=steps, out=tmp_path / "run.json"
    )
    reference = distributed.reference_losses(steps)
    assert run["world"] == 2 and run["backend"] in ("gloo", "nccl")
    assert run["losses"] == pytest.approx(reference, rel=1e-3)
    assert run["losses"][-1] < run["losses"][0]
    # forward, and again in backward: recomputation happened
    assert run["block_forward_calls"] == 2 * steps
    # Bytes gathered and reduced, counted from the calls, against the hand-worked FSDP2 layout:
    # blocks are gathered for forward and again for backward; the root (embeddings, final norm)
    # stays gathered from forward into backward, so once; gradients are reduce-scattered once, 2 B
    # each.
    model = TinyGPT(distributed.LAB_CONFIG)
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    blocks = run["params"] - root
    assert run["tensor_bytes"]["all-gather"] == steps * 2 * (2 * blocks + root)
    assert run["tensor_bytes"]["reduce-scatter"] == steps * 2 * run["params"]
    assert run["calls"] == {
        "all-gather": steps * (2 * distributed.LAB_CONFIG.layers + 1),
        "reduce-scatter": steps * (distributed.LAB_CONFIG.layers + 1),
    }


def _tiny_llama_script(tmp_path, *hardware) -> str:
    """`offloadlab plan --emit fsdp` for a tiny tied Llama on GPUs too small for its state, as a
    user saves it (``hardware``: the node's flags), with a rate at which ten steps show the loss
    fall."""
    (tmp_path / "tiny-llama.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "tie_word_embeddings": True,
            }
        )
    )
    planned = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadlab",
            "plan",
            "--model-config",
            str(tmp_path / "tiny-llama.json"),  # (any name: not only a snapshot's config.json)
            *hardware,
            "--gpu-memory",
            "1 MiB",
            "--link",
            "25 GB/s",
            "--host-memory",
            "1 GB",
            "--seq",
            "32",
            "--recompute",
            "all",
            "--emit",
            "fsdp",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert planned.returncode == 0, planned.stderr
    payload = json.loads(planned.stdout)
    # the optimizer alone offloaded: offloadlab's CPUOffloadAdam on each rank's shard (FSDP2's
    # own policy would move the shards and their gradients too)
    assert payload["emitted_plan"]["name"] == "FSDP2 + offload optimizer, activations recomputed"
    assert "optimizer = CPUOffloadAdam(model.parameters()" in payload["fsdp"]
    assert "CPUOffloadPolicy" not in payload["fsdp"]
    script = payload["fsdp"].replace("lr=0.0003", "lr=0.003")
    assert f"MODEL = {str(tmp_path / 'tiny-llama.json')!r}" in script
    (tmp_path / "train.py").write_text(script)
    return script


def _falls(stdout: str) -> None:
    """Ten steps whose loss starts at ln(256) (freshly initialised weights, not uninitialised
    memory) and falls."""
    losses = [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 10 and losses[-1] < 0.8 * losses[0]
    assert abs(losses[0] - 5.545) < 0.2


_CPU_RANKS = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # (torchrun, two processes)
def test_the_emitted_fsdp2_script_trains_a_transformers_model_as_written(tmp_path):
    """The script for one node of two GPUs, run as a user would: torchrun on two CPU processes,
    transformers' model built on the meta device, sharded, initialised, trained ten steps on its
    stand-in batch with CPUOffloadAdam on each rank's shard, clipping in its step()."""
    pytest.importorskip("transformers")
    _tiny_llama_script(tmp_path, "--gpus-per-node", "2")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(tmp_path / "train.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_CPU_RANKS,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _falls(done.stdout)


@pytest.mark.slow  # (torchrun, two agents of one process each)
def test_the_emitted_multi_node_launch_trains_as_written(tmp_path):
    """The script for two nodes of one GPU, launched by the line it carries, once per node (two
    torchrun agents on this machine, meeting at the rendezvous the line names)."""
    pytest.importorskip("transformers")
    script = _tiny_llama_script(tmp_path, "--nodes", "2", "--network", "50 GB/s")
    launch = next(line for line in script.splitlines() if "torchrun --nnodes" in line)
    assert "torchrun --nnodes 2 --nproc-per-node 1" in launch
    rendezvous = next(line for line in script.splitlines() if "--rdzv-endpoint" in line)
    flags = launch.split("torchrun", 1)[1].split() + rendezvous.lstrip("# ").split()[:-1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = [f.replace("FIRST_NODE:29500", f"127.0.0.1:{port}") for f in flags]
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *flags, str(tmp_path / "train.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_CPU_RANKS,
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    _falls("".join(out for out, _ in outputs))


@pytest.mark.gpu
def test_emitted_fsdp2_snippet_trains_on_two_gpus_with_nccl(tmp_path):
    """On a machine with two GPUs the same run uses NCCL and the GPUs (skipped with fewer)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for offload in ("none", "optimizer+parameters"):
        run = distributed.launch(offload, steps=4, out=tmp_path / f"{offload}.json")
        assert run["backend"] == "nccl"
        assert run["losses"] == pytest.approx(distributed.reference_losses(4), rel=1e-2)
