"""The emitted configurations run: DeepSpeed's own config class accepts them, and the FSDP2 snippet
trains TinyGPT on two CPU processes (gloo) to the losses of single-process AdamW."""

from unittest import mock

import pytest

from offloadlab import distributed, engines, sharding
from offloadlab.models import TinyGPT

ALL_SETUPS = [engines.Setup(strategy, offload, recompute, gpus, micro_batch=2, accumulation=4, precision=precision)
              for strategy in sharding.STRATEGIES for offload in sharding.OFFLOADS
              if engines.offered(strategy, offload)
              for recompute in (False, True) for gpus in (1, 8) for precision in ("bf16", "fp16")]


class DataParallel:
    """The one thing DeepSpeedConfig asks a model-parallel unit: how many data-parallel ranks there are."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


def deepspeed_parse(config, world):
    """DeepSpeed's own DeepSpeedConfig with a world size of ``world``, no process group needed.

    DeepSpeedConfig asks torch.distributed for this rank before it asks the unit for the world
    size; answering rank 0 is all that is faked.
    """
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    with mock.patch.object(ds_config.dist, "get_rank", return_value=0):
        return ds_config.DeepSpeedConfig(config, mpu=DataParallel(world))


@pytest.mark.parametrize("setup", ALL_SETUPS, ids=lambda s: f"{s.strategy}-{s.offload}-{s.recompute}-{s.gpus}-"
                                                         f"{s.precision}")
def test_every_deepspeed_config_passes_deepspeeds_validation(setup):
    parsed = deepspeed_parse(engines.deepspeed_config(setup), setup.gpus)
    assert parsed.world_size == setup.gpus and parsed.train_batch_size == 2 * 4 * setup.gpus
    assert parsed.zero_optimization_stage == setup.stage and parsed.optimizer_name == "adamw"
    zero = parsed.zero_config
    assert (zero.offload_optimizer is not None) == (setup.offload != "none")
    assert (zero.offload_param is not None) == (setup.offload == "optimizer+parameters")
    assert parsed.bfloat16_config.enabled == (setup.precision == "bf16")
    assert parsed.float16_config.enabled == (setup.precision == "fp16")


def test_deepspeed_refuses_a_batch_that_does_not_add_up():
    """The validation has teeth: a train batch that is not micro × accumulation × world is refused."""
    config = engines.deepspeed_config(engines.Setup("zero2", "optimizer", gpus=8, micro_batch=2))
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_parse(config, 4)


def test_nvme_offload_config_passes_validation_with_its_path():
    setup = engines.Setup("zero3", "optimizer+parameters", gpus=8, offload_device="nvme", nvme_path="/local_nvme")
    parsed = deepspeed_parse(engines.deepspeed_config(setup), 8)
    assert str(parsed.zero_config.offload_param.nvme_path) == "/local_nvme"
    assert parsed.zero_config.offload_optimizer.device == "nvme"
    # DeepSpeed drops aio keys it does not know without a word: every one emitted must be read.
    constants = pytest.importorskip("deepspeed.runtime.swap_tensor.constants")
    known = {value for name, value in vars(constants).items() if name.startswith("AIO_") and isinstance(value, str)}
    emitted = engines.deepspeed_config(setup)["aio"]
    assert set(emitted) <= known and parsed.aio_config["queue_depth"] == emitted["queue_depth"]


def test_optimizer_block_is_there_for_deepspeeds_cpu_adam():
    config = engines.deepspeed_config(engines.Setup("zero2", "optimizer"))
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                               "weight_decay": 0.1}}
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(strategy="zero2", offload="optimizer+parameters"), "^offload: expected a combination the engines offer"),
    (dict(strategy="fsdp2", offload="optimizer"), "^offload: "),
    (dict(strategy="ddp", offload="optimizer"), "^offload: "),
    (dict(gpus=0), "^gpus: expected a positive integer; got 0$"),
    (dict(precision="fp8"), "^precision: "),
    (dict(strategy="zero3", offload="optimizer", offload_device="nvme"), "^nvme_path: "),
    (dict(strategy="zero2", offload="optimizer", offload_device="nvme", nvme_path="/x"), "only with ZeRO-3"),
])
def test_setup_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        engines.Setup(**kwargs)


def test_snippets_compile_and_turn_recomputation_on():
    for setup in ALL_SETUPS:
        for snippet in (engines.fsdp_snippet(setup), engines.deepspeed_snippet(setup)):
            compile(snippet, "<snippet>", "exec")
            assert ("checkpoint, block.forward" in snippet) == setup.recompute
    fsdp = engines.fsdp_snippet(engines.Setup("fsdp2", "none"))
    assert "reduce_dtype=torch.bfloat16" in fsdp and "import torch\n" in fsdp and "CPUOffloadPolicy" not in fsdp


def test_emitted_fsdp2_snippet_trains_on_two_cpu_processes(tmp_path):
    """The snippet as emitted (CPUOffloadPolicy, recomputation, bf16) on torchrun with gloo.

    Tolerance: each step's mean loss within 0.1 % of single-process fp32 AdamW on the same global
    batch (measured here: at most 1.2e-4 relative; bf16 compute and reductions are the difference).
    """
    steps = 4
    run = distributed.launch("optimizer+parameters", recompute=True, steps=steps, out=tmp_path / "run.json")
    reference = distributed.reference_losses(steps)
    assert run["world"] == 2 and run["backend"] in ("gloo", "nccl")
    assert run["losses"] == pytest.approx(reference, rel=1e-3)
    assert run["losses"][-1] < run["losses"][0]
    assert run["block_forward_calls"] == 2 * steps  # forward, and again in backward: recomputation happened
    # Bytes gathered and reduced, counted from the calls, against the hand-worked FSDP2 layout:
    # blocks are gathered for forward and again for backward; the root (embeddings, final norm)
    # stays gathered from forward into backward, so once; gradients are reduce-scattered once, 2 B each.
    model = TinyGPT(distributed.LAB_CONFIG)
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    blocks = run["params"] - root
    assert run["tensor_bytes"]["all-gather"] == steps * 2 * (2 * blocks + root)
    assert run["tensor_bytes"]["reduce-scatter"] == steps * 2 * run["params"]
    assert run["calls"] == {"all-gather": steps * (2 * distributed.LAB_CONFIG.layers + 1),
                            "reduce-scatter": steps * (distributed.LAB_CONFIG.layers + 1)}


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
