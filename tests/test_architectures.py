"""Exact parameter counts from config.json, checked against transformers' own models on the meta
device.

The ground truth is transformers (the test extra installs it): each config is built with
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` — no weights, no download —
and every parameter it creates is counted, a tied one once. The formulas of
:mod:`offloadlab.architectures` must give the same numbers for every shipped config (written from
the published ones) and for variants that exercise each family's switches. The activations each
layer keeps are checked against what torch's autograd really saves in a small model of each kind.
"""

import json

import pytest
import torch

from offloadlab import architectures, model_count

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def shipped_config(name):
    return architectures.read_config(name)[0]


def meta_counts(config):
    """What transformers builds, counted directly from the model: (total, largest module, largest
    tensor)."""
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config["model_type"], **fields)
        )
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    largest_module = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    largest_tensor = max(p.numel() for p in model.parameters())
    return total, largest_module, largest_tensor


def formula_counts(config):
    arch = architectures.from_config(config)
    return arch.params, arch.largest_module_params, arch.largest_weight_params


# Published totals (the models' cards): a second anchor, independent of both counts.
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b-v0.1": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen2-0.5b": 494_032_768,
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "phi-2": 2_779_683_840,
    "gemma-2-9b": 9_241_705_984,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-8b": 8_190_735_360,
    "phi-3-mini-4k": 3_821_079_552,
    "pythia-1.4b": 1_414_647_808,  # Pythia's table: 1,414,647,808 total
}


def test_at_least_twenty_configs_of_every_family_ship():
    families = {shipped_config(name)["model_type"] for name in architectures.shipped()}
    assert len(architectures.shipped()) >= 20 and families == set(architectures.FAMILIES)


@pytest.mark.parametrize("name", architectures.shipped())
def test_every_shipped_config_counts_as_transformers_builds_it(name):
    config = shipped_config(name)
    assert formula_counts(config) == meta_counts(config)
    if name in PUBLISHED:
        assert architectures.load(name).params == PUBLISHED[name]


def _variant(name, **change):
    config = {**shipped_config(name), **change}
    return {k: v for k, v in config.items() if v is not None}


VARIANTS = {
    "llama biases": _variant("llama-3.1-8b", attention_bias=True, mlp_bias=True),
    "llama tied, no kv heads given": _variant(
        "llama-2-7b", num_key_value_heads=None, tie_word_embeddings=True
    ),
    "llama head_dim not hidden/heads": _variant("llama-3-8b", head_dim=64, num_attention_heads=64),
    "mistral head_dim 128 of 5120/32": _variant("mistral-nemo-12b"),
    "phi tied: the head keeps its bias": _variant("phi-2", tie_word_embeddings=True),
    "phi q/k layernorm, GQA": _variant("phi-2", qk_layernorm=True, num_key_value_heads=8),
    "gpt2 n_inner, positions": _variant("gpt2", n_inner=1000, n_positions=2048),
    "gpt2 untied": _variant("gpt2-medium", tie_word_embeddings=False),
    "qwen2 untied": _variant("qwen2-0.5b", tie_word_embeddings=False),
    "qwen3 tied, attention bias": _variant("qwen3-0.6b", attention_bias=True),
    "gemma untied, GQA": _variant("gemma-2b", tie_word_embeddings=False, num_key_value_heads=8),
    "gemma without head_dim (256)": _variant("gemma-7b", head_dim=None),
    "gemma2 untied": _variant("gemma-2-2b", tie_word_embeddings=False),
    "gemma3 GQA 2": _variant("gemma-3-1b", num_key_value_heads=2),
    "phi3 GQA": _variant("phi-3-mini-4k", num_key_value_heads=8),
    "opt post-norm, projected embeddings": _variant("opt-350m"),
    "opt untied, no bias": _variant("opt-1.3b", tie_word_embeddings=False, enable_bias=False),
    "falcon not multi-query, bias": _variant(
        "falcon-7b", multi_query=False, bias=True, num_attention_heads=71
    ),
    "falcon sequential layers": _variant("falcon-7b", parallel_attn=False),
    "falcon new architecture, one norm": _variant("falcon-40b", num_ln_in_parallel_attn=1),
    "bloom untied": _variant("bloom-560m", tie_word_embeddings=False),
    "gpt_neox tied, no attention bias": _variant(
        "pythia-1.4b", tie_word_embeddings=True, attention_bias=False
    ),
    "mixtral top-1 of 4": _variant("mixtral-8x7b", num_local_experts=4, num_experts_per_tok=1),
    "qwen-moe sparse every 2nd layer, two dense": _variant(
        "qwen1.5-moe-a2.7b", decoder_sparse_step=2, mlp_only_layers=[0, 5]
    ),
    "deepseek-v2 low-rank queries, 3 dense layers": _variant(
        "deepseek-v2-lite", q_lora_rank=768, first_k_dense_replace=3
    ),
    "deepseek-v3 no dense layer, biases": _variant(
        "deepseek-v3", first_k_dense_replace=0, attention_bias=True
    ),
}


@pytest.mark.parametrize("what", sorted(VARIANTS))
def test_variants_count_as_transformers_builds_them(what):
    assert formula_counts(VARIANTS[what]) == meta_counts(VARIANTS[what])


def test_the_tied_phi_head_keeps_its_bias():
    tied = architectures.from_config(VARIANTS["phi tied: the head keeps its bias"])
    assert tied.params == architectures.load("phi-2").params - 51200 * 2560 == 2_648_611_840


@pytest.mark.parametrize("family", architectures.FAMILIES)
def test_the_defaults_for_missing_fields_are_transformers_own(family):
    built = transformers.AutoConfig.for_model(family)
    for key, value in architectures.defaults(family).items():
        if value is not None:  # None: derived from other fields, as transformers derives it
            assert getattr(built, key) == value, key


SIZES = {
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, n_positions=32, vocab_size=100),
    "bloom": dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=100),
    "opt": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        ffn_dim=128,
        vocab_size=100,
        max_position_embeddings=32,
    ),
    "falcon": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100),
}


@pytest.mark.parametrize("family", architectures.FAMILIES)
def test_a_config_with_only_its_sizes_counts_with_the_defaults(family):
    # 32 heads: every family's default number of key/value heads (4 to 32) divides it
    sizes = SIZES.get(
        family,
        dict(
            hidden_size=256,
            num_attention_heads=32,
            num_hidden_layers=3,
            intermediate_size=128,
            vocab_size=100,
        ),
    )
    if family.startswith("deepseek"):
        sizes.update(moe_intermediate_size=32, num_experts_per_tok=2)
    if family == "phi3":  # its default padding token (32000) must be in the vocabulary
        sizes.update(vocab_size=32064)
    config = {"model_type": family, **sizes}
    assert formula_counts(config) == meta_counts(config)


def test_experts_count_in_memory_and_only_the_routed_ones_in_compute():
    mixtral = architectures.load("mixtral-8x7b")
    one_expert = 3 * 4096 * 14336
    assert mixtral.params - mixtral.active_params == 32 * (8 - 2) * one_expert
    assert round(mixtral.active_params / 1e9, 1) == 12.9  # Mistral's "12.9 B active"
    dense = architectures.load("llama-3.1-8b")
    assert dense.active_params == dense.params


def test_model_count_builds_any_model_type_transformers_knows(tmp_path):
    """A family without a formula (OLMo 2) is counted from transformers' code, and says so."""
    config = {
        "model_type": "olmo2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    with pytest.raises(
        ValueError, match="with transformers installed, `offloadlab plan` counts any model type"
    ):
        architectures.from_config(config)
    arch = model_count.architecture(config, "olmo2.json")
    assert arch.params == meta_counts(config)[0] and arch.counted_by.startswith("transformers ")
    assert "no formula for olmo2" in arch.notes[0] and len(arch.layer_shapes) == 2
    known = model_count.architecture(shipped_config("qwen3-8b"), "qwen3-8b")
    assert known.notes == ("the formula gives the same count",) and known.layer_shapes
    with pytest.raises(
        ValueError,
        match="^x.json: expected a model_type transformers .* knows; got 'no-such-model'",
    ):
        model_count.architecture({"model_type": "no-such-model"}, "x.json")


def test_load_reads_a_file_a_snapshot_folder_and_a_multimodal_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shipped_config("mistral-7b-v0.1")))
    assert (
        architectures.load(path).params == 7_241_732_096
        and architectures.load(tmp_path).kv_heads == 8
    )
    gemma3 = architectures.load("gemma-3-4b")
    assert gemma3.family == "gemma3_text" and "not its vision tower" in gemma3.notes[0]
    assert gemma3.params == meta_counts(architectures.read_config("gemma-3-4b")[0])[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match="^model: expected a folder holding a config.json .*, which has none$"
    ):
        architectures.load(empty)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"model_type": "falcon-ish"}, "expected 'model_type' to be one of bloom, deepseek_v2"),
        ({"hidden_size": 8}, "got None (with transformers installed"),
        (
            {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},
            "expected the field 'num_hidden_layers' for a llama model; it is missing",
        ),
        (
            {
                "model_type": "mistral",
                "hidden_size": 64,
                "num_attention_heads": 8,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 10,
                "num_local_experts": 8,
            },
            "expected a dense mistral model; got the mixture-of-experts field 'num_local_experts'",
        ),
        (
            {"model_type": "llama", "hidden_size": "4096"},
            "'hidden_size' to be a positive integer; got '4096'",
        ),
        (
            {
                "model_type": "llama",
                "hidden_size": 60,
                "num_attention_heads": 6,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 10,
                "num_key_value_heads": 4,
            },
            "'num_key_value_heads' to divide num_attention_heads=6; got 4",
        ),
        (
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_head": 4,
                "n_layer": 2,
                "n_positions": 8,
                "vocab_size": 10,
                "tie_word_embeddings": "yes",
            },
            "'tie_word_embeddings' to be true or false; got 'yes'",
        ),
        (
            {
                "model_type": "qwen2_moe",
                "hidden_size": 64,
                "num_attention_heads": 16,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 10,
                "mlp_only_layers": "0",
            },
            "'mlp_only_layers' to be a list",
        ),
        ([1, 2], "expected a JSON object; got list"),
    ],
)
def test_bad_configs_name_what_is_wrong(config, fragment):
    with pytest.raises(ValueError) as error:
        architectures.from_config(config)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_load_refuses_unknown_names_with_a_guess_and_unreadable_files(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^model: expected one of bloom-560m, .*, or a config.json file or the "
        r"folder holding one; got 'mixtral-8x7' \(did you mean 'mixtral-8x7b'\?\)$",
    ):
        architectures.load("mixtral-8x7")
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="expected a readable JSON config; got JSONDecodeError"):
        architectures.load(broken)


@pytest.mark.parametrize("depth", [2000, 5000])
def test_deeply_nested_json_is_a_value_error_not_a_recursion_error(tmp_path, depth):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * depth + "]" * depth)
    with pytest.raises(ValueError, match="expected a JSON config; got nesting too deep to read"):
        architectures.load(deep)


def test_the_wheel_ships_every_config(tmp_path):
    """Users install wheels: --model NAME must work from one, not only from this checkout."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from tests.conftest import ROOT

    source = tmp_path / "source"  # a clean copy, so no earlier build/ folder supplies the files
    shutil.copytree(
        ROOT / "offloadlab", source / "offloadlab", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("offloadlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"offloadlab/model_configs/{n}.json" for n in architectures.shipped()} <= names
    assert {"offloadlab/planner/__init__.py", "offloadlab/model_count.py"} <= names


# -- activations: what each layer keeps for backward, against what autograd saves ----------------

SMALL = {
    "llama": dict(
        hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen3": dict(
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=96,
    ),
    "mixtral": dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        hidden_size=256,
        intermediate_size=688,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "opt": dict(
        hidden_size=256,
        ffn_dim=1024,
        num_attention_heads=4,
        dropout=0.0,
        max_position_embeddings=1024,
    ),
    "phi": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, resid_pdrop=0.0),
    "gpt2": dict(
        n_embd=256, n_head=4, n_positions=1024, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0
    ),
    "gpt_neox": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4),
}
SEQ = 256


def saved_bytes(family, layers, attention):
    """Bytes of every tensor autograd saves in a bf16 forward (parameters aside), each storage
    once."""
    sizes = dict(
        SMALL[family],
        vocab_size=1000,
        **{"n_layer" if family == "gpt2" else "num_hidden_layers": layers},
    )
    config = transformers.AutoConfig.for_model(family, **sizes)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    ids = torch.randint(0, 1000, (1, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return sum(saved.values()), architectures.from_config(
        {"model_type": family, **sizes, "vocab_size": 1000}
    )


@pytest.mark.parametrize(
    "family, attention, tolerance",
    [
        ("llama", "sdpa", 0.01),
        ("llama", "eager", 0.01),
        ("qwen3", "sdpa", 0.01),
        ("mixtral", "sdpa", 0.01),
        ("qwen2_moe", "sdpa", 0.05),
        ("opt", "sdpa", 0.01),
        ("opt", "eager", 0.01),
        ("phi", "sdpa", 0.05),
        ("gpt2", "sdpa", 0.05),
        ("gpt_neox", "sdpa", 0.05),
    ],
)
def test_what_a_layer_keeps_is_what_autograd_saves(family, attention, tolerance):
    """One layer's share (three layers' saved bytes less one's, halved) against
    LayerShape.kept_bytes, in bytes per token; and the root's largest part, the loss's fp32
    log-probabilities, 4 B per logit."""
    one, arch = saved_bytes(family, 1, attention)
    three, _ = saved_bytes(family, 3, attention)
    measured = (three - one) / 2 / SEQ
    predicted = arch.layer_shapes[0].kept_bytes(2, SEQ, attention)
    assert measured == pytest.approx(predicted, rel=tolerance)
    # the log-probabilities the loss keeps, and a little more
    assert one - measured * SEQ >= 4 * 1000 * SEQ


def test_sdpa_keeps_no_seq_squared_term_and_eager_does():
    shape = architectures.load("llama-3.1-8b").layer_shapes[0]
    # per token: flat in the sequence length
    assert shape.kept_bytes(2, 32768) == shape.kept_bytes(2, 1024)
    assert shape.kept_bytes(2, 32768, "eager") - shape.kept_bytes(2, 1024, "eager") == 6 * 32 * (
        32768 - 1024
    )
