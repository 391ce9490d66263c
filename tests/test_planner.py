"""The planner's choices on a table of scenarios, its emitted configurations and its command."""

import json
from types import MappingProxyType
import subprocess
import sys

import pytest

from offloadlab import architectures, engines, memory, planner


def report(params, gpu="80 GB", link="60 GB/s", host="2 TB", **kw):
    hw_keys = {"cpu_adam", "compute", "comm_fraction"}
    hw = planner.Hardware(
        gpu, link, host_memory=host, **{k: v for k, v in kw.items() if k in hw_keys}
    )
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
    gpu_too_small = report(400e9, batch=1, seq=2048, gpu="24 GB")
    assert (
        gpu_too_small.chosen is None
        and "even with everything offloaded" in gpu_too_small.warnings[0]
    )
    host_too_small = report(30e9, host="64 GB", batch=1, seq=1024)
    assert host_too_small.chosen is None and "NVMe" in host_too_small.warnings[0]
    with pytest.raises(ValueError, match="^report: nothing fits"):
        engines.deepspeed_config(engines.setup(host_too_small))


def test_400b_fails_on_host_memory_not_on_the_gpu():
    r = report(400e9, batch=1, seq=2048)
    everything = next(p for p in r.plans if p.level == 3 and p.recompute)
    assert everything.fits_gpu and round(everything.gpu_bytes / 1e9) == 29
    assert everything.host_bytes == 6.4e12 and not everything.fits_host
    assert everything.binding == "host memory: needs 6.4 TB of the 1.8 TB usable of 2 TB"
    assert (
        r.chosen is None
        and "6.4 TB of host memory against the 1.8 TB usable of 2 TB" in r.warnings[0]
    )


def test_binding_of_a_plan_that_does_not_fit_is_the_memory():
    r = report(10e9, gpu="80 GB", link="25 GB/s", batch=1, seq=2048)
    nothing = next(p for p in r.plans if p.level == 0 and not p.recompute)
    assert not nothing.fits and nothing.binding.startswith("GPU memory: needs")


def test_wrong_tool():
    r = report(10e9, batch=1, seq=1024, comm_fraction=0.5)
    assert any("wrong tool" in w for w in r.warnings)
    bound = report(13e9, link="4 GB/s", batch=1, seq=512, compute=400e12)
    assert bound.chosen.binding.startswith("the link")
    assert any("bandwidth-bound" in w for w in bound.warnings)


def test_one_layer_step_is_compute_then_gradient_update_upload_in_turn():
    # One layer: nothing overlaps. 6 × 1e9 × 1024 FLOP for the weights, and causal attention's
    # two products, each 2 × (1024 + 1) / 2 × 1024 FLOP a token forward, three times over with
    # backward, at 1 PFLOP/s: 6.1505 ms of compute; then 2 GB down at 10 GB/s (0.2 s), 1e9
    # parameters updated at 1e9/s (1 s), 2 GB up (0.2 s).
    r = report(
        1e9,
        gpu="8 GB",
        link="10 GB/s",
        layers=1,
        hidden=1024,
        heads=8,
        batch=1,
        seq=1024,
        compute=1e15,
        cpu_adam=1e9,
    )
    optimizer = next(p for p in r.plans if p.offload == "optimizer" and not p.recompute)
    attention = 3 * 2 * (2 * (1024 + 1) / 2 * 1024) * 1024
    compute = (6 * 1e9 * 1024 + attention) / 1e15
    assert compute == pytest.approx(6.1505e-3, rel=1e-4)
    assert optimizer.t_compute == pytest.approx(compute)
    assert optimizer.step == pytest.approx(compute + 0.2 + 1 + 0.2)
    assert (optimizer.h2d_bytes, optimizer.d2h_bytes) == (
        2e9,
        2e9,
    ) and optimizer.t_transfer == pytest.approx(0.2)
    # The old model, max(compute, transfer) + CPU, said 1.2 s: it hid the upload the update
    # produces.
    assert optimizer.step > max(optimizer.t_compute, optimizer.t_transfer) + optimizer.t_cpu


def test_steps_respect_the_order_of_gradient_update_upload():
    r = report(10e9, batch=1, seq=1024)
    for p in r.plans:
        if p.level == 0:
            assert p.step == pytest.approx(p.t_compute)
            continue
        # No faster than the busiest resource, no slower than everything one after the other.
        assert (
            max(p.t_compute, p.t_cpu, p.t_transfer / 2)
            <= p.step
            <= p.t_compute + p.t_transfer + p.t_cpu
        )
        if p.t_step_delayed is not None:
            assert p.t_step_delayed >= max(p.t_compute, p.t_cpu)


def test_30b_plan_is_cpu_bound():
    r = report(30e9, gpu=memory.GPU_SIZES["80 GB"], batch=1, seq=2048)
    c = r.chosen
    assert c.offload == "optimizer+gradients" and c.recompute
    assert c.binding.startswith("the CPU") and c.t_cpu / c.step > 0.9
    # 12 B of state, a 2 B gradient landing buffer, 2 B of outgoing weights
    assert c.host_bytes == 16 * 30e9


def test_half_duplex_slows_the_step_only_where_the_link_binds():
    work = planner.Workload(13e9, batch=1, seq=512)
    hw = planner.Hardware("80 GB", "4 GB/s", host_memory="2 TB", compute=400e12)
    full, half = planner.plan(work, hw), planner.plan(work, hw, duplex="half")
    assert half.chosen.t_transfer == pytest.approx(2 * full.chosen.t_transfer)
    assert half.chosen.step > full.chosen.step and half.duplex == "half"
    with pytest.raises(ValueError, match="^duplex: "):
        planner.plan(work, hw, duplex="simplex")


def test_a_correction_to_a_recipe_reaches_the_planner(monkeypatch):
    fp32_grads = memory.Recipe(
        "fp32-grads",
        "16-bit weights, fp32 gradients and state",
        {"weights": 2, "gradients": 4, "master_weights": 4, "first_moment": 4, "second_moment": 4},
    )
    monkeypatch.setattr(
        memory, "RECIPES", MappingProxyType({**memory.RECIPES, "fp32-grads": fp32_grads})
    )
    work, hw = planner.Workload(1e9, batch=1, seq=1024), planner.Hardware("80 GB", "10 GB/s")
    r = planner.plan(work, hw, recipe="fp32-grads")
    optimizer = next(p for p in r.plans if p.offload == "optimizer" and not p.recompute)
    assert optimizer.d2h_bytes == 4e9 and optimizer.host_bytes == (12 + 4 + 2) * 1e9
    assert r.ranking[0].frees_bytes == 12e9 and r.recipe == "fp32-grads"


def test_candidates_are_priced_given_the_ones_before():
    ranked = {c.name: c for c in planner.candidates(planner.Workload(30e9, batch=1, seq=2048))}
    assert ranked["optimizer states"].payoff_per_traffic == 3  # 12 B freed for 4 B moved
    assert ranked["gradients"].traffic_bytes == 0  # already going down
    assert ranked["parameters"].payoff_per_traffic == 1  # 2 B freed, 2 B more up
    assert ranked["activations (offload)"].payoff_per_traffic == 0.5


def test_least_offload_is_chosen():
    r = report(10e9, batch=1, seq=1024)
    levels = [p.level for p in r.plans if p.fits]
    assert r.chosen.level == min(levels)
    assert (
        "plan:" in r.explain()
        and "assumed:" in r.explain()
        and "delayed parameter update" in r.explain()
    )


def test_typical_shape_matches_gpt3():
    assert planner.typical_shape(175e9) == (96, 12288, 96)


def test_deepspeed_and_fsdp_emission():
    optimizer_only = engines.deepspeed_config(
        engines.setup(report(7e9, batch=1, seq=1024, compute=400e12, cpu_adam=10e9))
    )
    zero = optimizer_only["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero
    everything = report(40e9, layers=48, hidden=8192, heads=64, batch=1, seq=1024)
    zero3 = engines.deepspeed_config(engines.setup(everything))["zero_optimization"]
    assert zero3["stage"] == 3 and zero3["offload_param"]["pin_memory"] is True
    snippet = engines.fsdp_snippet(engines.setup(everything))
    assert 'CPUOffloadPolicy(pin_memory=device.type == "cuda")' in snippet
    compile(snippet, "<fsdp>", "exec")  # tests/test_engines.py validates and runs what engines emit


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(params=-1), "^params: "),
        (dict(params=1e9, batch=0), "^batch: "),
        (dict(params=1e9, layers=2), "^layers: "),
    ],
)
def test_workload_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        planner.Workload(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(gpu_memory="0 GB", link="1 GB/s"), "^gpu_memory: "),
        (dict(gpu_memory="80 GB", link="fast"), "^link: "),
        (dict(gpu_memory="80 GB", link="1 GB/s", compute=0), "^compute: "),
        (dict(gpu_memory="80 GB", link="1 GB/s", comm_fraction=1.5), "^comm_fraction: "),
    ],
)
def test_hardware_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        planner.Hardware(**kwargs)


def offloadlab(*args):
    return subprocess.run(
        [sys.executable, "-m", "offloadlab", *args], capture_output=True, text=True
    )


def test_budget_command_reports_the_8_gb_ceiling():
    result = offloadlab("budget", "--link", "32 GB/s", "--window", "250 ms", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["ceiling_bytes"] == 8e9


@pytest.mark.parametrize(
    "duplex, seconds, ratio",
    [(None, 0.625, 2.5), ("full", 0.625, 2.5), ("half", 1.25, 5), ("20 GB/s", 1.0, 4)],
)
def test_budget_command_reports_bytes_per_direction(duplex, seconds, ratio):
    args = [
        "budget",
        "--link",
        "32 GB/s",
        "--window",
        "250 ms",
        "--params",
        "10e9",
        "--offload",
        "optimizer",
        "--json",
    ] + (["--duplex", duplex] if duplex else [])
    result = offloadlab(*args)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (
        payload["bytes_per_direction"] == {"h2d": 20e9, "d2h": 20e9}
        and payload["traffic_bytes"] == 40e9
    )
    assert payload["transfer_s"] == pytest.approx(seconds) and payload["ratio"] == pytest.approx(
        ratio
    )
    assert payload["fits"] is False and payload["duplex"] == (
        duplex if duplex in ("full", "half") else "measured" if duplex else "full"
    )


def test_budget_command_takes_a_recipe():
    result = offloadlab(
        "budget",
        "--link",
        "32 GB/s",
        "--window",
        "1 s",
        "--params",
        "1e9",
        "--offload",
        "park-and-copy",
        "--recipe",
        "fp32-adam",
    )
    assert result.returncode == 0, result.stderr
    assert "8 GB up, 8 GB down" in result.stdout and "fp32-adam" in result.stdout


def test_plan_command_json_and_emit():
    result = offloadlab(
        "plan",
        "--params",
        "30e9",
        "--gpu-memory",
        "80 GB",
        "--link",
        "60 GB/s",
        "--emit",
        "deepspeed",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (
        payload["chosen"]["fits"] and payload["deepspeed"]["zero_optimization"]["offload_optimizer"]
    )
    text = offloadlab(
        "plan", "--params", "30e9", "--gpu-memory", "80 GB", "--link", "60 GB/s", "--emit", "fsdp"
    )
    assert "fully_shard" in text.stdout and "binding constraint" in text.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["budget", "--link", "0 GB/s", "--window", "1 s"], "--link"),
        (["budget", "--link", "32 GB/s", "--window", "1 s", "--params", "1e9"], "together"),
        (["budget", "--link", "32 GB/s", "--window", "soon"], "window"),
        (
            ["budget", "--link", "32 GB/s", "--window", "1 s", "--duplex", "both"],
            "duplex: expected 'full', 'half'",
        ),
        (
            ["budget", "--link", "32 GB/s", "--window", "1 s", "--duplex", "64 GB/s"],
            "duplex: expected at most",
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
                "optimizer",
                "--recipe",
                "lion",
            ],
            "recipe: expected one of",
        ),
        (
            [
                "plan",
                "--params",
                "1e9",
                "--gpu-memory",
                "80 GB",
                "--link",
                "60 GB/s",
                "--batch",
                "0",
            ],
            "--batch",
        ),
        (["plan", "--params", "1e9", "--gpu-memory", "lots", "--link", "60 GB/s"], "--gpu-memory"),
        (["plan", "--params", "1e9", "--gpu-memory", "80 GB"], "--link"),
        (
            [
                "plan",
                "--params",
                "1e9",
                "--gpu-memory",
                "80 GB",
                "--link",
                "6 GB/s",
                "--emit",
                "xml",
            ],
            "--emit",
        ),
    ],
)
def test_bad_arguments(args, fragment):
    result = offloadlab(*args)
    assert result.returncode == 2 and fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_clipping_holds_the_updates_until_backward_ends():
    # Four layers, 1.2 s of compute (forward 0.4 s, backward 0.8 s), a 1 s CPU update, 0.05 s per
    # layer each way on the link. Eager: the updates follow the gradients through backward and
    # end 1.65 s in, the last upload 1.7 s. Clipped: they start when the last gradient lands
    # (1.25 s) and the last upload ends at 2.3 s. Delayed: the update runs behind the next step's
    # compute, and the 0.2 s of uploads at the boundary are what remains: 1.4 s.
    work = planner.Workload(1e9, layers=4, hidden=1024, heads=8, batch=1, seq=1024)
    # (the rate at which its weights' and attention's FLOPs take 1.2 s)
    hw = planner.Hardware("8 GB", "10 GB/s", compute=work.compute_flops() / 1.2, cpu_adam=1e9)
    pick = lambda r: next(p for p in r.plans if p.offload == "optimizer" and not p.recompute)  # noqa: E731
    eager, clipped = pick(planner.plan(work, hw)), pick(planner.plan(work, hw, clipping=True))
    assert eager.step == pytest.approx(1.7) and clipped.step == pytest.approx(2.3)
    assert clipped.t_step_delayed == eager.t_step_delayed == pytest.approx(1.4)
    laid_out = planner.schedule(work, hw, "optimizer", clipping=True)
    assert laid_out.step == pytest.approx(clipped.step)
    with pytest.raises(ValueError, match="^offload: "):
        planner.schedule(work, hw, "everything")


# -- sizes with units, activations as they are computed today, experts -----------------------------


def test_a_number_too_small_for_a_gpu_is_refused_as_a_slip_for_gigabytes():
    with pytest.raises(
        ValueError,
        match=r"^gpu_memory: expected bytes; got 80, which is 80 B: did you mean '80 GB'\?$",
    ):
        planner.Hardware(80, "25 GB/s")
    with pytest.raises(ValueError, match=r"^link: .*did you mean '25 GB/s'\?$"):
        planner.Hardware("80 GB", 25)
    with pytest.raises(ValueError, match=r"did you mean '80 GB'\?$"):
        planner.Hardware("80", "25 GB/s")
    # bytes as a Python number still mean bytes
    assert planner.Hardware(85e9, 25e9).gpu_memory == 85e9


def test_sdpa_keeps_no_seq_squared_scores_and_eager_keeps_them():
    """Llama 3.1 8B at 32,768 tokens: SDPA (transformers' default) keeps per layer what it keeps at
    1,024 tokens, per token; eager attention adds its fp32 softmax and 16-bit probabilities,
    6 bytes per head per pair of tokens: 6 · 32 · 32768² · 32 layers = 6.6 TB."""
    arch = architectures.load("llama-3.1-8b")
    sdpa, eager = (
        planner.Workload.of_model(arch, seq=32768, attention=a) for a in ("sdpa", "eager")
    )
    assert eager.activations().layers - sdpa.activations().layers == pytest.approx(
        32 * 6 * 32 * 32768**2 + 32 * 32768 * (2 * 2 * (4096 - 1024) - 4 * 32)
    )
    assert sdpa.activations().layers == 32 * 32768 * arch.layer_shapes[0].kept_bytes(2, 32768)
    with pytest.raises(ValueError, match="^attention: expected one of sdpa, eager; got 'flash'$"):
        planner.Workload(1e9, attention="flash")


def test_logits_and_loss_are_counted_in_their_dtypes():
    """Per token, the loss's fp32 log-probabilities (4 B a logit), their gradient and the logits'
    gradient in fp32 (8 B), and the logits in the compute dtype (2 B): 14 B × 128,256 at 32k
    tokens."""
    work = planner.Workload.of_model(architectures.load("llama-3.1-8b"), seq=32768)
    assert work.activations().logits == 14 * 128256 * 32768 == pytest.approx(58.8e9, rel=1e-3)


def test_the_fewest_layers_that_fit_are_recomputed():
    arch = architectures.load("llama-3.1-8b")
    work = planner.Workload.of_model(arch, seq=4096)
    report = planner.plan(work, planner.Hardware("24 GB", "25 GB/s", host_memory="1 TB"))
    level = [p for p in report.plans if p.offload == report.chosen.offload]
    kept, everything, partial = (
        next(p for p in level if p.checkpointed == k) for k in (0, 32, report.chosen.checkpointed)
    )
    assert 0 < partial.checkpointed < 32 and report.chosen is partial
    assert not kept.fits_gpu and partial.fits_gpu and everything.fits_gpu
    # two more FLOPs per recomputed layer
    assert kept.t_compute < partial.t_compute < everything.t_compute
    one_fewer = work.activation_bytes(partial.checkpointed - 1)
    assert (
        partial.gpu_bytes - work.activation_bytes(partial.checkpointed) + one_fewer
        > partial.gpu_usable
    )
    assert partial.name.endswith(f"activations recomputed in {partial.checkpointed} of 32 layers")
    forced = planner.plan(
        work, planner.Hardware("24 GB", "25 GB/s", host_memory="1 TB"), recompute="all"
    )
    assert {p.checkpointed for p in forced.plans} == {32}


def test_nothing_fits_names_the_activations_and_what_acts_on_them():
    """A million tokens a GPU: even with every layer recomputed the checkpoints alone outgrow 80 GB.
    The refusal names that term and the levers that shrink it — never more GPUs or NVMe, which do
    nothing for activations."""
    work = planner.Workload.of_model(architectures.load("llama-3.1-8b"), seq=2**20)
    report = planner.plan(work, planner.Hardware("80 GB", "25 GB/s", host_memory="2 TB"))
    assert report.chosen is None
    warning = report.warnings[0]
    assert (
        "what binds is logits and loss" in warning
        or "what binds is activations of the layers" in warning
    )
    assert "micro-batch" in warning and "NVMe" not in warning and "add GPUs" not in warning
    node = planner.plan(
        work, planner.Hardware("80 GB", "25 GB/s", host_memory="2 TB", gpus_per_node=8)
    )
    assert (
        node.chosen is None
        and "NVMe" not in node.warnings[0]
        and "add nodes" not in node.warnings[0]
    )
    assert "sequence or context parallelism" in planner.single.gpu_binding(
        {"activations of the layers": 2.0, "logits and loss": 1.0}, 1.0
    )


def test_experts_count_in_memory_and_their_active_share_in_compute():
    mixtral = architectures.load("mixtral-8x7b")
    work = planner.Workload.of_model(mixtral, seq=1024)
    r = planner.plan(work, planner.Hardware("80 GB", "25 GB/s", host_memory="2 TB", compute=400e12))
    kept = next(p for p in r.plans if p.offload == "nothing" and not p.recompute)
    # Each token is multiplied by 2 of the 8 experts, the attention and the head, not by the
    # embedding table it looks up (32,000 × 4,096); causal attention: 32 layers of queries and
    # outputs 4,096 wide, over (1,024 + 1) / 2 positions on average, two products.
    multiplied = mixtral.active_params - 32000 * 4096
    attention = 32 * 2 * (1024 + 1) / 2 * (4096 + 4096)
    assert kept.t_compute == pytest.approx(3 * (2 * multiplied + attention) * 1024 / 400e12)
    assert kept.gpu_terms["model state"] == 16 * mixtral.params  # all 8 experts' state


def test_the_estimates_run_without_torch_or_transformers():
    """The planner's layer runs in the browser (Pyodide), where neither is installed: it must
    import and plan with the standard library alone."""
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "numpy", "deepspeed"):
            raise ImportError(f"{name} is not here")
sys.meta_path.insert(0, Refuse())
from offloadlab import architectures, engines, planner
work = planner.Workload.of_model(architectures.load("mixtral-8x7b"), seq=4096)
hardware = planner.Hardware("80 GB", "25 GB/s", host_memory="2 TB", gpus_per_node=8)
report = planner.plan(work, hardware)
print(engines.setup(report, "deepspeed").stage, "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "False"]


def test_host_memory_keeps_a_reserve_as_gpu_memory_does():
    """A plan whose state fills host memory to the byte does not fit: the OS, each rank's process
    and the page cache need some of it (review M8: 480 GB of state on a 480 GB Grace was
    accepted)."""
    work = planner.Workload(10e9, batch=1, seq=1024)
    state = next(
        p
        for p in planner.plan(work, planner.Hardware("80 GB", "25 GB/s")).plans
        if p.offload == "optimizer" and not p.recompute
    ).host_bytes
    exact = next(
        p
        for p in planner.plan(work, planner.Hardware("80 GB", "25 GB/s", host_memory=state)).plans
        if p.offload == "optimizer" and not p.recompute
    )
    assert not exact.fits_host and "usable" in exact.binding
    roomy = planner.Hardware(
        "80 GB", "25 GB/s", host_memory=state / (1 - planner.HOST_RESERVE_FRACTION)
    )
    assert next(
        p for p in planner.plan(work, roomy).plans if p.offload == "optimizer" and not p.recompute
    ).fits_host
    node = planner.Hardware("80 GB", "25 GB/s", host_memory="1 TB", gpus_per_node=8)
    assert node.usable_host_memory == 0.9e12


def share_of(micro=1, **kw):
    hw = planner.Hardware("80 GB", "25 GB/s", host_memory="512 GB", **kw)
    return planner.plan(planner.Workload(7e9), hw, micro_batches=micro)


@pytest.mark.parametrize("cpu_adam", [5e9, 20e9, 60e9])
def test_the_optimizer_share_is_the_largest_that_hides_and_its_kept_state_fits(cpu_adam):
    """offload_fraction F: the offloaded share's link time and CPU update each fit the compute,
    and (1 − F) of the state fits beside the plan on the GPU; where no F does both, the GPU's
    memory sets F and the step stalls."""
    report = share_of(cpu_adam=cpu_adam)
    chosen, share = report.chosen, report.share
    assert chosen.offload == "optimizer" and share is not None
    f = share.offload_fraction
    kept = (1 - f) * 7e9 * memory.get_recipe("mixed-adam").optimizer_bytes
    assert chosen.gpu_bytes + kept <= chosen.gpu_usable
    if share.stall_s == 0:
        assert share.link_s <= share.window_s and share.cpu_s <= share.window_s
        more = (f + 0.01) / f
        assert f == 1 or max(share.link_s, share.cpu_s) * more > share.window_s
    else:
        smaller = 7e9 * memory.get_recipe("mixed-adam").optimizer_bytes * 0.01
        assert chosen.gpu_bytes + kept + smaller > chosen.gpu_usable  # one hundredth less won't fit


def test_many_micro_batches_park_the_state_and_one_updates_it_in_place():
    one, many = share_of(1, cpu_adam=5e9).share, share_of(16, cpu_adam=5e9).share
    assert one.update_on == "cpu" and many.update_on == "device"
    assert (one.in_place_per_param, one.parked_per_param) == (4, 24)
    assert (many.in_place_per_param, many.parked_per_param) == (34, 24)
    assert many.cpu_s == 0 and many.window_s == 16 * one.window_s


def test_plan_json_carries_the_fraction_and_where_it_is_updated():
    result = offloadlab(
        "plan", "--params", "7e9", "--gpu-memory", "80 GB", "--link", "25 GB/s",
        "--host-memory", "512 GB", "--accumulation", "16", "--json",
    )  # fmt: skip
    payload = json.loads(result.stdout)
    assert payload["chosen"]["offload_fraction"] == payload["optimizer_share"]["offload_fraction"]
    assert payload["chosen"]["update_on"] == "device"
    assert "--optimizer-offload-fraction" in payload["optimizer_share"]["megatron_core"]
    text = offloadlab(
        "plan", "--params", "7e9", "--gpu-memory", "80 GB", "--link", "25 GB/s",
        "--host-memory", "512 GB",
    ).stdout  # fmt: skip
    assert "optimizer share: offload_fraction=" in text and "Megatron-Core:" in text
    small = json.loads(
        offloadlab(
            "plan", "--params", "1e9", "--gpu-memory", "80 GB", "--link", "25 GB/s", "--json"
        ).stdout
    )
    assert small["chosen"]["offload_fraction"] == 0 and small["optimizer_share"] is None


def test_deepspeed_gets_the_share_as_its_ratio_where_zero_3_allows_it():
    from offloadlab.planner.share import optimizer_share

    report = share_of(cpu_adam=20e9)
    share = report.share
    assert 0 < share.offload_fraction < 1
    zero3 = engines.Setup("zero3", "optimizer")
    config, note = engines.with_share(zero3, share)
    assert note is None
    ratio = engines.deepspeed_config(config)["zero_optimization"]["offload_optimizer"]["ratio"]
    assert ratio == share.offload_fraction
    config, note = engines.with_share(engines.Setup("zero2", "optimizer"), share)
    assert config.offload_ratio == 1 and "only with ZeRO-3" in note
    parked = optimizer_share(report.chosen, report.work, report.hardware, micro_batches=16)
    config, note = engines.with_share(zero3, parked)
    assert parked.update_on == "device" and config.offload_ratio == 1
    assert "offload_states()" in note


def wide(link):
    hw = planner.Hardware("80 GB", link, host_memory="1 TB")
    work = planner.Workload(13e9, layers=40, hidden=5120, heads=40, batch=8, seq=4096)
    return planner.plan(work, hw), work


def test_activations_go_to_host_memory_where_their_copies_hide_and_recompute_costs_more():
    """h = 5,120 against 34R/(24B) = 4,427 at 64 GB/s: the activations' copies hide behind forward
    and backward, and offloading them beats recomputing (a third more compute)."""
    report, work = wide("64 GB/s")
    chosen = report.chosen
    assert chosen.activations_offloaded and not chosen.recompute
    assert chosen.name.endswith("activations offloaded")
    each_way, on_gpu = planner.single.offloaded_activations(work, 2)
    kept = next(
        p
        for p in report.plans
        if p.offload == chosen.offload and not p.checkpointed and not p.activations_offloaded
    )
    assert not kept.fits_gpu and chosen.fits_gpu
    assert chosen.h2d_bytes - kept.h2d_bytes == chosen.d2h_bytes - kept.d2h_bytes == each_way
    assert chosen.gpu_bytes == kept.gpu_bytes - work.activations(0, 2).total + on_gpu
    assert chosen.step == kept.step  # hidden: the same step as keeping them
    recomputed = [p for p in report.plans if p.offload == chosen.offload and p.checkpointed]
    assert all(chosen.step < p.step for p in recomputed)
    payload = report.to_dict()
    assert (
        payload["chosen"]["activations_offloaded"] and payload["activations"]["offloaded_to_host"]
    )
    assert "every layer's offloaded" in report.explain()


def test_activations_are_recomputed_where_their_copies_would_not_hide():
    """At 25 GB/s the threshold is 11,333: h = 5,120 is too narrow, so no plan offloads them."""
    report, _ = wide("25 GB/s")
    assert report.chosen.recompute
    assert not any(p.activations_offloaded for p in report.plans)


def test_a_plan_bound_by_the_cpu_recomputes_rather_than_fill_the_link():
    report = planner.plan(
        planner.Workload(30e9, batch=1, seq=2048),
        planner.Hardware(memory.GPU_SIZES["80 GB"], "60 GB/s", host_memory="2 TB"),
    )
    assert report.chosen.recompute and not report.chosen.activations_offloaded


def test_step_compute_counts_causal_attention_which_outgrows_the_weights_at_long_context():
    """Qwen3-32B at 131,072 tokens with every layer recomputed (its public widths: 64 layers of
    64 query heads of 128): the weights' 8 · N · T is about 3.4e16 FLOPs, causal attention's two
    products another 7.2e16, four passes (forward, backward twice, the recomputation) of
    64 · (s + 1) · 16,384 FLOPs a token. Eager attention multiplies every pair: twice that."""
    qwen = architectures.from_config(
        {
            "model_type": "qwen2",
            "hidden_size": 5120,
            "intermediate_size": 25600,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": 64,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        }
    )
    s = 131072
    sdpa = planner.Workload.of_model(qwen, seq=s)
    attention = 4 * 64 * (s + 1) * 16384 * s
    assert attention == pytest.approx(7.2e16, rel=0.01)
    weights = 8 * (qwen.active_params - 151936 * 5120) * s
    assert weights == pytest.approx(3.4e16, rel=0.02)
    assert sdpa.compute_flops(True) == pytest.approx(weights + attention)
    forward, backward = sdpa.pass_flops(True)
    assert backward == pytest.approx(3 * forward)  # twice forward, and the forward once more
    eager = planner.Workload.of_model(qwen, seq=s, attention="eager")
    assert eager.compute_flops(True) - weights == pytest.approx(2 * attention, rel=1e-4)
