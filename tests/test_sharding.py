"""Per-GPU bytes of ZeRO-1/2/3 and FSDP2, worked by hand, and DeepSpeed's own estimators beside
them."""

import pytest

from offloadlab import architectures, sharding

# a 10 B model on an 8-GPU node, mixed-precision Adam (2 + 2 + 12 bytes per parameter)
P, N = 10e9, 8
SHARD = P / N


def test_hand_worked_ten_billion_on_eight_gpus():
    ddp = sharding.layout("ddp", "none", P, N)
    # all-reduce
    assert ddp.gpu_bytes == 160e9 and ddp.interconnect_bytes == pytest.approx(2 * 7 / 8 * 20e9)
    zero1 = sharding.layout("zero1", "none", P, N)
    # 16-bit weights and gradients + fp32 shard
    assert zero1.gpu_bytes == pytest.approx(40e9 + 16 * SHARD)
    # reduce-scatter during backward
    assert zero1.interconnect_overlapped == pytest.approx(7 / 8 * 20e9)
    assert zero1.interconnect_after == pytest.approx(7 / 8 * 20e9)  # all-gather of the new weights
    zero2 = sharding.layout("zero2", "none", P, N)
    assert zero2.gpu_bytes == pytest.approx(20e9 + 18 * SHARD) == 42.5e9
    # ZeRO-2 moves what data parallelism moves
    assert zero2.interconnect_bytes == ddp.interconnect_bytes
    zero3 = sharding.layout("zero3", "none", P, N, largest_module=1e9)
    assert zero3.gpu_bytes == pytest.approx(18 * SHARD + 4e9) == 26.5e9
    assert zero3.interconnect_bytes == pytest.approx(1.5 * ddp.interconnect_bytes) == 52.5e9
    fsdp = sharding.layout("fsdp2", "none", P, N, block_params=0.25e9, root_params=1e9)
    assert fsdp.gathered_bytes == pytest.approx(2 * 1e9 + 2 * 4 * 0.25e9)
    assert fsdp.gpu_bytes == pytest.approx(16 * SHARD + 4e9) == 24e9


def test_hand_worked_offload_on_eight_gpus():
    zero2 = sharding.layout("zero2", "optimizer", P, N)
    # only the 16-bit weights stay; reduced gradients go straight down
    assert zero2.gpu_bytes == 20e9
    assert zero2.host_bytes == pytest.approx(16 * SHARD) == 20e9  # an eighth of the node's 160 GB
    # DeepSpeed casts each gradient to fp32 on the GPU before it goes down; the 16-bit weights come
    # up.
    assert (zero2.d2h_bytes, zero2.h2d_bytes, zero2.cpu_params) == pytest.approx(
        (4 * SHARD, 2 * SHARD, SHARD)
    )
    infinity = sharding.layout("zero3", "optimizer+parameters", P, N, largest_module=1e9)
    assert infinity.gpu_bytes == 4e9 and infinity.host_bytes == pytest.approx(18 * SHARD)
    # DeepSpeed 0.19's stage3.py: the 16-bit gradient partition goes into a pinned host buffer and
    # straight back (2 B each way), then at the boundary down in fp32 (4 B); the 16-bit shard comes
    # up for forward and for backward.
    assert infinity.h2d_bytes == pytest.approx((2 + 2 * 2) * SHARD) and infinity.upload_after == 0
    assert infinity.d2h_bytes == pytest.approx((2 + 4) * SHARD)
    offload = sharding.layout("zero3", "optimizer", P, N, largest_module=1e9)
    assert (offload.d2h_bytes, offload.h2d_bytes) == pytest.approx((6 * SHARD, 4 * SHARD))
    # the new 16-bit weights, after the update
    assert offload.upload_after == pytest.approx(2 * SHARD)
    assert zero2.upload_after == zero2.h2d_bytes  # ZeRO-2 sends gradients down once, in fp32
    fsdp = sharding.layout(
        "fsdp2", "optimizer+parameters", P, N, block_params=0.25e9, root_params=1e9
    )
    assert fsdp.host_bytes == pytest.approx(16 * SHARD)
    # fp32 shards move
    assert (fsdp.h2d_bytes, fsdp.d2h_bytes) == pytest.approx((8 * SHARD, 4 * SHARD))


def test_offloading_alone_keeps_a_whole_copy_per_gpu():
    alone = sharding.layout("ddp", "optimizer", P, N)
    # state, gradient buffer, weights
    assert alone.gpu_bytes == 40e9 and alone.host_bytes == (12 + 2 + 2) * P
    assert alone.cpu_params == P and alone.interconnect_bytes == pytest.approx(2 * 7 / 8 * 20e9)


def test_one_gpu_sends_nothing_and_holds_everything():
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
        one = sharding.layout(strategy, "none", P, 1)
        assert one.interconnect_bytes == 0
    assert sharding.layout("zero2", "none", P, 1).gpu_bytes == 20e9 + 18 * P


@pytest.mark.parametrize(
    "strategy, offload",
    [
        ("ddp", "optimizer+parameters"),
        ("zero2", "optimizer+parameters"),
        ("zero4", "none"),
        ("zero2", "disk"),
    ],
)
def test_combinations_engines_do_not_offer_are_refused(strategy, offload):
    with pytest.raises(ValueError, match="^(strategy|offload): expected "):
        sharding.layout(strategy, offload, P, N)


def test_gpus_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="^gpus: expected a positive integer; got 0$"):
        sharding.layout("zero2", "none", P, 0)


LLAMA_8B, LLAMA_70B = architectures.load("llama-3.1-8b"), architectures.load("llama-3.1-70b")
CASES = [
    (10e9, 1e9, 1, 1),
    (LLAMA_8B.params, LLAMA_8B.largest_module_params, 4, 1),
    (LLAMA_70B.params, LLAMA_70B.largest_module_params, 8, 1),
    (LLAMA_70B.params, LLAMA_70B.largest_module_params, 8, 4),  # four nodes
    (LLAMA_8B.params, LLAMA_8B.largest_module_params, 2, 16),
]


@pytest.mark.parametrize("params, largest, gpus, nodes", CASES)
def test_layout_agrees_with_deepspeeds_estimators(params, largest, gpus, nodes):
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for offload in (True, False):
        cpu, gpu = stage2.estimate_zero2_model_states_mem_needs(
            params, gpus, nodes, cpu_offload=offload
        )
        ours = sharding.deepspeed_estimate(
            2, "optimizer" if offload else "none", params, largest, gpus, nodes=nodes
        )
        assert gpu == pytest.approx(ours["gpu_bytes"], abs=1) and cpu == pytest.approx(
            ours["host_bytes_per_node"], abs=1
        )
        # GPU bytes are the layout's own, term for term; only host memory carries the named extra
        # terms.
        assert (
            ours["gpu_bytes"]
            == sharding.layout(
                "zero2", "optimizer" if offload else "none", params, gpus * nodes
            ).gpu_bytes
        )
    for offload, zero_init in [
        (o, z) for o in ("none", "optimizer", "optimizer+parameters") for z in (True, False)
    ]:
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
            params,
            largest,
            gpus,
            nodes,
            cpu_offload=offload != "none",
            cpu_offload_params=offload == "optimizer+parameters",
            zero_init=zero_init,
        )
        ours = sharding.deepspeed_estimate(
            3, offload, params, largest, gpus, zero_init=zero_init, nodes=nodes
        )
        assert gpu == pytest.approx(ours["gpu_bytes"], abs=1), (offload, zero_init)
        assert cpu == pytest.approx(ours["host_bytes_per_node"], abs=1), (offload, zero_init)


def test_deepspeeds_ten_billion_figure_and_its_buffer_factor():
    """The figures DeepSpeed prints for 10 B on one GPU with optimizer offload: 18.63 GiB and
    223.52 GiB."""
    ours = sharding.deepspeed_estimate(2, "optimizer", 10e9, 1e9, 1)
    assert round(ours["gpu_bytes"] / 2**30, 2) == 18.63
    assert round(ours["host_bytes_per_node"] / 2**30, 2) == 223.52
    # the state itself: 16 B per parameter
    state = sharding.layout("zero2", "optimizer", 10e9, 1).host_bytes
    assert state == 160e9 and ours["host_bytes_per_node"] == 1.5 * state
    assert ours["terms"] == ["host × 1.5 buffer factor"]
