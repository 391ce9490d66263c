"""Exact parameter counts of real decoder-only transformers, from their Hugging Face config.json.

A model's ``config.json`` holds its shape: layers, hidden size, attention heads and key/value heads,
MLP width, vocabulary, and whether the output head shares the token embedding. From that shape
:class:`Architecture` counts every parameter the model's own code creates, family by family:

========  ====================================================================================
family    what differs
========  ====================================================================================
llama     grouped-query attention (``num_key_value_heads``), gated SiLU MLP (gate, up, down),
          RMSNorm (no bias), untied head; ``attention_bias`` and ``mlp_bias`` where set
mistral   as llama (sliding-window attention changes no parameter)
qwen2     as llama, plus biases on the query, key and value projections (not the output)
gemma     as llama with ``head_dim`` given (not hidden / heads) and a tied head
gpt2      learned position embeddings, fused QKV (Conv1D) with biases, GELU MLP of 4 h
          (``n_inner``), LayerNorm with bias, tied head
phi       one LayerNorm per layer (attention and MLP side by side), biases everywhere
          (q, k, v, dense, fc1, fc2 and the head), partial rotary (no parameters)
========  ====================================================================================

Several configurations are shipped with the package (:func:`shipped`); :func:`load` takes one of
their names or the path of a local ``config.json`` (nothing is fetched from the network).
Counts are plain integers of parameters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Architecture", "FAMILIES", "CONFIG_FOLDER", "shipped", "load", "from_config"]

CONFIG_FOLDER = Path(__file__).resolve().parent / "model_configs"

# Family defaults for fields a config.json may leave out (the values transformers' config classes use).
_TIED_BY_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "gemma": True, "gpt2": True, "phi": False}
FAMILIES = tuple(sorted(_TIED_BY_DEFAULT))

# Fields that would change the count but that these families' code does not have: refuse, do not guess.
_UNMODELLED = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
               "num_experts_per_tok")


@dataclass(frozen=True)
class Architecture:
    """The shape of one decoder-only transformer and the parameter count that follows from it.

    ``kv_heads`` < ``heads`` is grouped-query attention; ``head_dim`` × ``heads`` need not equal
    ``hidden`` (Gemma). ``positions`` > 0 means learned position embeddings (GPT-2); rotary
    embeddings have no parameters. Norms hold ``hidden`` weights (RMSNorm) or weights and biases
    (LayerNorm, ``norm_bias``).
    """

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    gated_mlp: bool
    positions: int = 0
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    norms_per_layer: int = 2
    head_bias: bool = False
    qk_norm: bool = False

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer (with their biases and any q/k norms)."""
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        weights = self.hidden * (q_width + 2 * kv_width) + q_width * self.hidden
        biases = (q_width + 2 * kv_width if self.qkv_bias else 0) + (self.hidden if self.out_bias else 0)
        qk_norms = 2 * 2 * self.head_dim if self.qk_norm else 0  # one LayerNorm (weight, bias) each for q and k
        return weights + biases + qk_norms

    @property
    def mlp_params(self) -> int:
        """The MLP of one layer: gate, up and down (gated) or fc and projection (plain), with biases."""
        matrices = 3 if self.gated_mlp else 2
        biases = ((matrices - 1) * self.intermediate + self.hidden) if self.mlp_bias else 0
        return matrices * self.hidden * self.intermediate + biases

    @property
    def norm_params(self) -> int:
        """One norm over the hidden size: weights, and biases for a LayerNorm with bias."""
        return 2 * self.hidden if self.norm_bias else self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (every layer has the same shape)."""
        return self.attention_params + self.mlp_params + self.norms_per_layer * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding plus learned position embeddings (if any)."""
        return (self.vocab + self.positions) * self.hidden

    @property
    def head_params(self) -> int:
        """The output head: nothing of its own when tied to the token embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden + (self.vocab if self.head_bias else 0)

    @property
    def params(self) -> int:
        """Every parameter: embeddings, the layers, the final norm and the (untied) head."""
        return self.embedding_params + self.layers * self.layer_params + self.norm_params + self.head_params

    def module_params(self) -> list[int]:
        """Own parameters of each distinct kind of module (embeddings, one layer's linears, the head)."""
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        sizes = [self.vocab * self.hidden] + ([self.positions * self.hidden] if self.positions else [])
        if self.family == "gpt2":  # fused QKV and plain MLP, all with biases (Conv1D)
            sizes += [self.hidden * 3 * q_width + 3 * q_width, q_width * self.hidden + self.hidden]
        else:
            sizes += [self.hidden * q_width + (q_width if self.qkv_bias else 0),
                      self.hidden * kv_width + (kv_width if self.qkv_bias else 0),
                      q_width * self.hidden + (self.hidden if self.out_bias else 0)]
        sizes += [self.hidden * self.intermediate + (self.intermediate if self.mlp_bias else 0),
                  self.intermediate * self.hidden + (self.hidden if self.mlp_bias else 0)]
        return sizes + ([self.head_params] if self.head_params else [])

    @property
    def largest_module_params(self) -> int:
        """The largest single module's own parameters (DeepSpeed's ``largest_layer_params``).

        ZeRO-3 gathers one module at a time, so its largest module bounds the gathered buffer:
        with a large vocabulary that is the token embedding or the head, not a transformer layer.
        """
        return max(self.module_params())

    def to_dict(self) -> dict:
        return {**asdict(self), "params": self.params, "layer_params": self.layer_params,
                "largest_module_params": self.largest_module_params}


def shipped() -> list[str]:
    """Names of the configurations shipped with the package (``--model NAME``)."""
    return sorted(p.stem for p in CONFIG_FOLDER.glob("*.json"))


def load(model: str | Path) -> Architecture:
    """A shipped configuration by name (e.g. ``"llama-3.1-8b"``), or a local config.json by path."""
    path = Path(model)
    if str(model) in shipped():
        path = CONFIG_FOLDER / f"{model}.json"
    elif not path.suffix == ".json" or not path.is_file():
        raise ValueError(f"model: expected one of {', '.join(shipped())} or the path of a config.json file; "
                         f"got {str(model)!r}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path.name}: expected a readable JSON config; got {type(error).__name__}: {error}") from None
    return from_config(config, name=path.stem if path.parent == CONFIG_FOLDER else str(path))


def _field(config: dict, key: str, source: str, family: str, default=None, kind=int):
    """One field of a config, checked: a positive int (or a bool); ``default`` when absent (None = required)."""
    if key not in config or config[key] is None:
        if default is None:
            raise ValueError(f"{source}: expected the field {key!r} for a {family} model; it is missing")
        return default
    value = config[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{source}: expected {key!r} to be true or false; got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: expected {key!r} to be a positive integer; got {value!r}")
    return value


def from_config(config: dict, name: str = "config.json") -> Architecture:
    """The :class:`Architecture` a Hugging Face ``config.json`` (as a dict) describes."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object; got {type(config).__name__}")
    family = config.get("model_type")
    if family not in _TIED_BY_DEFAULT:
        raise ValueError(f"{name}: expected 'model_type' to be one of {', '.join(FAMILIES)}; got {family!r}")
    unmodelled = [key for key in _UNMODELLED if config.get(key)]
    if unmodelled:
        raise ValueError(f"{name}: expected a dense {family} model; got mixture-of-experts fields "
                         f"{', '.join(unmodelled)}, which this count does not model")

    def get(key, default=None, kind=int):
        return _field(config, key, name, family, default, kind)

    tied = get("tie_word_embeddings", _TIED_BY_DEFAULT[family], bool)
    if family == "gpt2":
        hidden, heads = get("n_embd"), get("n_head")
        return Architecture(
            name, family, layers=get("n_layer"), hidden=hidden, heads=heads, kv_heads=heads,
            head_dim=_divide(hidden, heads, name, "n_embd", "n_head"), intermediate=get("n_inner", 4 * hidden),
            vocab=get("vocab_size"), tied_embeddings=tied, gated_mlp=False, positions=get("n_positions"),
            qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True)

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"{name}: expected 'num_key_value_heads' to divide num_attention_heads={heads}; "
                         f"got {kv_heads}")
    # Gemma sets head_dim explicitly (256 with hidden 3072 and 16 heads); the others derive it.
    head_dim = get("head_dim") if family == "gemma" else get("head_dim", _divide(hidden, heads, name,
                                                                                   "hidden_size",
                                                                                   "num_attention_heads"))
    common = dict(layers=get("num_hidden_layers"), hidden=hidden, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, intermediate=get("intermediate_size"), vocab=get("vocab_size"),
                  tied_embeddings=tied)
    if family == "phi":
        return Architecture(name, family, **common, gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True,
                            norm_bias=True, norms_per_layer=1, head_bias=True,
                            qk_norm=get("qk_layernorm", False, bool))
    if family == "qwen2":
        return Architecture(name, family, **common, gated_mlp=True, qkv_bias=True)
    attention_bias = get("attention_bias", False, bool)
    return Architecture(name, family, **common, gated_mlp=True, qkv_bias=attention_bias, out_bias=attention_bias,
                        mlp_bias=get("mlp_bias", False, bool))


def _divide(total: int, parts: int, name: str, total_key: str, parts_key: str) -> int:
    if total % parts:
        raise ValueError(f"{name}: expected {parts_key!r} to divide {total_key}={total}; got {parts}")
    return total // parts
