"""Exact parameter counts from config.json, checked against real torch modules of the same shape.

Each family gets a small reference module written here from the family's published model code
(module names follow transformers'), built on the meta device so a 70 B model costs no memory.
The reference reads the config dict itself, not :class:`Architecture`, so a wrong formula and a
right module disagree.
"""

import json

import pytest
import torch
from torch import nn

from offloadlab import architectures

META = torch.device("meta")


def _linear(inputs, outputs, bias):
    return nn.Linear(inputs, outputs, bias=bias, device=META)


class RotaryDecoder(nn.Module):
    """Llama, Mistral, Qwen2 and Gemma: GQA attention, gated MLP, RMSNorm (weights only)."""

    def __init__(self, c, family):
        super().__init__()
        h, heads = c["hidden_size"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        head_dim = c["head_dim"] if family == "gemma" else c.get("head_dim") or h // heads
        qkv_bias = True if family == "qwen2" else c.get("attention_bias", False)
        out_bias = False if family == "qwen2" else c.get("attention_bias", False)
        mlp_bias = c.get("mlp_bias", False)
        width = c["intermediate_size"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], h, device=META)
        self.layers = nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = nn.Module()
            layer.q_proj = _linear(h, heads * head_dim, qkv_bias)
            layer.k_proj = _linear(h, kv * head_dim, qkv_bias)
            layer.v_proj = _linear(h, kv * head_dim, qkv_bias)
            layer.o_proj = _linear(heads * head_dim, h, out_bias)
            layer.gate_proj = _linear(h, width, mlp_bias)
            layer.up_proj = _linear(h, width, mlp_bias)
            layer.down_proj = _linear(width, h, mlp_bias)
            layer.input_layernorm = nn.RMSNorm(h, device=META)
            layer.post_attention_layernorm = nn.RMSNorm(h, device=META)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(h, device=META)
        tied = c.get("tie_word_embeddings", family == "gemma")
        self.lm_head = _linear(h, c["vocab_size"], False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


class GPT2(nn.Module):
    """GPT-2: learned positions, Conv1D-shaped fused QKV, LayerNorms with bias, tied head."""

    def __init__(self, c):
        super().__init__()
        h = c["n_embd"]
        width = c.get("n_inner") or 4 * h
        self.wte = nn.Embedding(c["vocab_size"], h, device=META)
        self.wpe = nn.Embedding(c["n_positions"], h, device=META)
        self.h = nn.ModuleList()
        for _ in range(c["n_layer"]):
            block = nn.Module()
            block.ln_1, block.ln_2 = nn.LayerNorm(h, device=META), nn.LayerNorm(h, device=META)
            block.c_attn = _linear(h, 3 * h, True)
            block.attn_c_proj = _linear(h, h, True)
            block.c_fc = _linear(h, width, True)
            block.mlp_c_proj = _linear(width, h, True)
            self.h.append(block)
        self.ln_f = nn.LayerNorm(h, device=META)
        self.lm_head = _linear(h, c["vocab_size"], False)
        self.lm_head.weight = self.wte.weight


class Phi(nn.Module):
    """Phi-1.5/2: one LayerNorm per layer, biases on every projection and on the head."""

    def __init__(self, c):
        super().__init__()
        h, heads = c["hidden_size"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        head_dim = h // heads
        self.embed_tokens = nn.Embedding(c["vocab_size"], h, device=META)
        self.layers = nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = nn.Module()
            layer.input_layernorm = nn.LayerNorm(h, device=META)
            layer.q_proj = _linear(h, heads * head_dim, True)
            layer.k_proj = _linear(h, kv * head_dim, True)
            layer.v_proj = _linear(h, kv * head_dim, True)
            layer.dense = _linear(heads * head_dim, h, True)
            if c.get("qk_layernorm"):
                layer.q_layernorm = nn.LayerNorm(head_dim, device=META)
                layer.k_layernorm = nn.LayerNorm(head_dim, device=META)
            layer.fc1 = _linear(h, c["intermediate_size"], True)
            layer.fc2 = _linear(c["intermediate_size"], h, True)
            self.layers.append(layer)
        self.final_layernorm = nn.LayerNorm(h, device=META)
        self.lm_head = _linear(h, c["vocab_size"], True)
        if c.get("tie_word_embeddings"):
            self.lm_head.weight = self.embed_tokens.weight


def reference_module(config):
    family = config["model_type"]
    return GPT2(config) if family == "gpt2" else Phi(config) if family == "phi" else RotaryDecoder(config, family)


def counts(module):
    """Distinct parameters (a tied head counts once) and the largest module's own parameters."""
    total = sum(p.numel() for p in module.parameters())  # parameters() yields a shared tensor once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    return total, largest


def shipped_config(name):
    return json.loads((architectures.CONFIG_FOLDER / f"{name}.json").read_text())


# Published totals (the models' cards and transformers' own count): a second, independent anchor.
PUBLISHED = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
             "llama-3-8b": 8_030_261_248, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
             "mistral-7b-v0.1": 7_241_732_096, "qwen2-7b": 7_615_616_512, "qwen2-0.5b": 494_032_768,
             "gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "gemma-2b": 2_506_172_416,
             "gemma-7b": 8_537_680_896, "phi-2": 2_779_683_840}


def test_every_shipped_config_has_a_published_total():
    assert set(architectures.shipped()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_counts_match_a_module_of_the_same_shape(name):
    arch = architectures.load(name)
    total, largest = counts(reference_module(shipped_config(name)))
    assert arch.params == total == PUBLISHED[name]
    assert arch.largest_module_params == largest


@pytest.mark.parametrize("name, change", [
    ("llama-3.1-8b", {"attention_bias": True, "mlp_bias": True}),
    ("llama-2-7b", {"num_key_value_heads": None, "tie_word_embeddings": True}),
    ("llama-3-8b", {"head_dim": 64, "num_attention_heads": 64}),
    ("phi-2", {"qk_layernorm": True, "num_key_value_heads": 8}),
    ("gpt2", {"n_inner": 1000, "n_positions": 2048}),
    ("qwen2-0.5b", {"tie_word_embeddings": False}),
    ("gemma-2b", {"tie_word_embeddings": False, "num_key_value_heads": 8}),
])
def test_variants_match_a_module_of_the_same_shape(name, change):
    config = {**shipped_config(name), **change}
    config = {k: v for k, v in config.items() if v is not None}
    total, largest = counts(reference_module(config))
    arch = architectures.from_config(config)
    assert (arch.params, arch.largest_module_params) == (total, largest)


def test_counts_agree_with_transformers_when_installed():
    transformers = pytest.importorskip("transformers")
    for name in architectures.shipped():
        config = transformers.AutoConfig.for_model(**shipped_config(name))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert counts(model) == (architectures.load(name).params, architectures.load(name).largest_module_params)


def test_load_reads_a_local_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shipped_config("mistral-7b-v0.1")))
    arch = architectures.load(path)
    assert arch.params == 7_241_732_096 and arch.name == str(path) and arch.kv_heads == 8


@pytest.mark.parametrize("config, fragment", [
    ({"model_type": "falcon"}, "expected 'model_type' to be one of gemma, gpt2, llama, mistral, phi, qwen2; got 'falcon'"),
    ({"hidden_size": 8}, "one of gemma"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}, "expected the field 'num_hidden_layers' "
                                                                          "for a llama model; it is missing"),
    ({**{"model_type": "gemma", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 10}}, "'head_dim' for a gemma model; it is missing"),
    ({"model_type": "mistral", "num_local_experts": 8}, "mixture-of-experts fields num_local_experts"),
    ({"model_type": "llama", "hidden_size": "4096"}, "'hidden_size' to be a positive integer; got '4096'"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 6, "num_key_value_heads": 4},
     "'num_key_value_heads' to divide num_attention_heads=6; got 4"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 8, "vocab_size": 10,
      "tie_word_embeddings": "yes"}, "'tie_word_embeddings' to be true or false; got 'yes'"),
    ([1, 2], "expected a JSON object; got list"),
])
def test_bad_configs_name_what_is_wrong(config, fragment):
    with pytest.raises(ValueError) as error:
        architectures.from_config(config)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_load_refuses_unknown_names_and_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="^model: expected one of gemma-2b, .* or the path of a config.json file; "
                                         "got 'llama-9'$"):
        architectures.load("llama-9")
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="^config.json: expected a readable JSON config; got JSONDecodeError"):
        architectures.load(broken)


def test_the_wheel_ships_every_config(tmp_path):
    """Users install wheels: --model NAME must work from one, not only from this checkout."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from tests.conftest import ROOT

    source = tmp_path / "source"  # a clean copy, so no earlier build/ folder supplies the files
    shutil.copytree(ROOT / "offloadlab", source / "offloadlab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("offloadlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"offloadlab/model_configs/{n}.json" for n in architectures.shipped()} <= names
