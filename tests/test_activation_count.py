"""Activations of families without a formula, measured from transformers' own code on fake
tensors, against a real forward on the CPU: the bytes one decoder layer saves for backward, by
saved-tensor hooks on real tensors (two layers' model less one layer's), at a sequence length
the planner did not measure at."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from offloadlab import model_count, models, planner  # noqa: E402

SEQ = 96  # (the planner measures at 32 and 64 tokens and extrapolates)
SMALL = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
FAMILIES = {
    "qwen3_moe": {
        **SMALL,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "head_dim": 32,
    },
    "starcoder2": {**SMALL, "intermediate_size": 512, "use_bias": True},
    "granite": {**SMALL, "intermediate_size": 256},
    "olmo2": {**SMALL, "intermediate_size": 256},
    "smollm3": {**SMALL, "intermediate_size": 256, "pad_token_id": 0},
    "cohere": {**SMALL, "intermediate_size": 256, "pad_token_id": 0},
    "gpt_oss": {
        **SMALL,
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 32,
        "sliding_window": 256,  # wider than SEQ: every layer attends to the whole sequence
    },
}


def real_layer_bytes(family: str, fields: dict, attention: str) -> float:
    """Bytes one decoder layer saves for backward in a real bf16 forward over SEQ tokens."""

    def saved(layers):
        config = transformers.AutoConfig.for_model(family, **fields, num_hidden_layers=layers)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attention, dtype=torch.bfloat16
        )
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in parameters:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, 512, (1, SEQ)))
        return sum(storages.values())

    return saved(2) - saved(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_measured_layer_keeps_what_a_real_forward_saves(family):
    fields = FAMILIES[family]
    arch = model_count.architecture(
        {"model_type": family, **fields, "num_hidden_layers": 2},
        measure=models.saved_bytes_by_layer,
    )
    assert arch.layer_shapes and all(shape.measured for shape in arch.layer_shapes)
    assert any("measured from transformers' own code" in note for note in arch.notes)
    sdpa_supported = family != "gpt_oss"  # (transformers 5 runs gpt-oss eager only)
    for attention in ("sdpa", "eager"):
        work = planner.Workload.of_model(arch, seq=SEQ, attention=attention)
        planned = work.activations(0, 2).layers / 2
        ran = "sdpa" if attention == "sdpa" and sdpa_supported else "eager"
        real = real_layer_bytes(family, fields, ran)
        assert planned == pytest.approx(real, rel=0.05), (family, attention, planned, real)


def test_eager_attention_keeps_scores_growing_with_the_sequence_and_sdpa_does_not():
    arch = model_count.architecture(
        {"model_type": "granite", **FAMILIES["granite"], "num_hidden_layers": 2},
        measure=models.saved_bytes_by_layer,
    )
    shape = arch.layer_shapes[0]
    # per token: SDPA's bytes do not grow with the sequence; eager's grow by the fp32 softmax and
    # its bf16 copy, 6 bytes a head for each position (and their dropout-free masks' share)
    assert shape.kept_bytes(2, 4096, "sdpa") == pytest.approx(shape.kept_bytes(2, 64, "sdpa"))
    growth = (shape.kept_bytes(2, 4096, "eager") - shape.kept_bytes(2, 64, "eager")) / 4032
    assert growth >= 6 * 4


def test_gpt_oss_is_planned_with_the_eager_attention_it_runs(tmp_path, capsys):
    from offloadlab.cli import main

    path = tmp_path / "gpt-oss.json"
    config = {"model_type": "gpt_oss", **FAMILIES["gpt_oss"], "num_hidden_layers": 2}
    path.write_text(json.dumps(config))
    args = ["plan", "--model-config", str(path), "--gpu-memory", "80 GB", "--link", "25 GB/s"]
    assert main([*args, "--count", "transformers"]) == 0
    assert "gpt_oss has no SDPA in transformers: eager attention, s² scores kept" in (
        capsys.readouterr().out
    )


def test_a_forward_fake_tensors_cannot_run_falls_back_to_the_estimate_and_says_so(monkeypatch):
    def refuse(built, attention):
        raise RuntimeError("data-dependent output shape")

    monkeypatch.setattr(models, "_fake_model", refuse)
    model_count._counted.cache_clear()
    config = {"model_type": "olmo2", **FAMILIES["olmo2"], "num_hidden_layers": 2}
    arch = model_count.architecture(config, measure=models.saved_bytes_by_layer)
    model_count._counted.cache_clear()
    assert not any(shape.measured for shape in arch.layer_shapes)
    assert any(
        "would not run on fake tensors (RuntimeError: data-dependent output shape)" in note
        and "estimated as for a Llama-like layer" in note
        for note in arch.notes
    )
