"""Exact parameter counts of real decoder-only transformers, from their Hugging Face config.json.

A model's ``config.json`` holds its shape: layers, hidden size, attention heads and key/value heads,
MLP width, vocabulary, experts, and whether the output head shares the token embedding. From that
shape :func:`from_config` lists every weight tensor the model's own code creates (its module, its
shape, and whether it is tied to another), family by family, and :class:`Architecture` counts from
that list: the total (a tied tensor once), the parameters one token uses (mixture-of-experts models
route each token through a few experts), the largest module and the largest tensor. It also
describes each layer's computation, for the activations it keeps (:meth:`LayerShape.kept_bytes`).

===========  =================================================================================
family       what differs
===========  =================================================================================
llama        grouped-query attention (``num_key_value_heads``), gated SiLU MLP (gate, up, down),
             RMSNorm, untied head; ``attention_bias``, ``mlp_bias`` and ``head_dim`` where set
mistral      as llama (sliding-window attention changes no parameter)
qwen2        as llama, plus biases on the query, key and value projections (not the output)
qwen3        as llama, plus an RMSNorm over ``head_dim`` on queries and on keys
phi3         as llama with the query/key/value and gate/up projections fused (the same count)
gemma        as llama, ``head_dim`` 256 unless set, tied head
gemma2       as gemma with four norms per layer (before and after attention and MLP)
gemma3_text  as gemma2 plus query and key norms (a multimodal gemma3 config: its ``text_config``)
gpt2         learned positions, fused QKV (Conv1D) with biases, GELU MLP of 4 h (``n_inner``),
             LayerNorm with bias, tied head
phi          one LayerNorm per layer (attention and MLP side by side), biases everywhere
             (q, k, v, dense, fc1, fc2 and the head's bias, which tying leaves in place)
opt          learned positions (2 extra rows), biases and LayerNorms, projections in and out when
             ``word_embed_proj_dim`` differs from the hidden size, final norm only for pre-norm
falcon       fused QKV with one key/value head (``multi_query``) or ``num_kv_heads`` (the new
             decoder architecture, with two norms per parallel layer), MLP of 4 h, tied head
bloom        fused QKV, biases everywhere, a LayerNorm after the embedding, tied head
gpt_neox     fused QKV and output with biases (``attention_bias``), LayerNorms, a plain MLP of
             ``intermediate_size`` with biases, untied head (Pythia, GPT-NeoX-20B)
mixtral      llama attention; each layer's MLP is a router and ``num_local_experts`` gated experts
qwen2_moe    qwen2 attention; router, ``num_experts`` experts, a shared expert and its gate
deepseek_v2  multi-head latent attention (low-rank key/value and, with ``q_lora_rank``, query
deepseek_v3  projections); the first ``first_k_dense_replace`` layers dense, then routed and
             shared experts (V3 also routes by groups, which changes no parameter)
===========  =================================================================================

Fields a config leaves out take the defaults of transformers' config classes (``_DEFAULTS``;
tests/test_architectures.py checks them against transformers). Experts are fused into one tensor
per projection, as transformers 5 builds them. Several configurations are shipped with the package
(:func:`shipped`); :func:`load` takes one of their names, the path of a local ``config.json`` or
the folder of a downloaded snapshot (nothing is fetched from the network). Counts are integers of
parameters; activations are bytes per token.

This module needs only the standard library: :mod:`offloadlab.model_count` builds the same
configs with transformers, when it is installed, to count them from the models' own code.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import files
from .units import check_integer, is_integer

__all__ = [
    "Weight",
    "LayerShape",
    "Architecture",
    "FAMILIES",
    "CONFIG_FOLDER",
    "shipped",
    "read_config",
    "from_config",
    "load",
    "defaults",
]

CONFIG_FOLDER = Path(__file__).resolve().parent / "model_configs"

_LLAMA = dict(
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    head_dim=None,
    num_key_value_heads=None,
)
# transformers 5's defaults for the fields the counts read, where a config may leave them out.
_DEFAULTS: dict[str, dict] = {
    "llama": _LLAMA,
    "mistral": dict(tie_word_embeddings=False, head_dim=None, num_key_value_heads=8),
    "qwen2": dict(tie_word_embeddings=False, num_key_value_heads=32),
    "qwen3": dict(
        tie_word_embeddings=False, attention_bias=False, head_dim=128, num_key_value_heads=32
    ),
    "phi3": dict(tie_word_embeddings=False, num_key_value_heads=None),
    "gemma": dict(
        tie_word_embeddings=True, attention_bias=False, head_dim=256, num_key_value_heads=16
    ),
    "gemma2": dict(
        tie_word_embeddings=True, attention_bias=False, head_dim=256, num_key_value_heads=4
    ),
    "gemma3_text": dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "gpt2": dict(
        tie_word_embeddings=True,
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=None,
    ),
    "phi": dict(tie_word_embeddings=False, num_key_value_heads=None, qk_layernorm=False),
    "opt": dict(
        tie_word_embeddings=True,
        word_embed_proj_dim=None,
        do_layer_norm_before=True,
        _remove_final_layer_norm=False,
        enable_bias=True,
        layer_norm_elementwise_affine=True,
    ),
    "falcon": dict(
        tie_word_embeddings=True,
        num_kv_heads=None,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        ffn_hidden_size=None,
        num_ln_in_parallel_attn=None,
    ),
    "bloom": dict(tie_word_embeddings=True),
    "gpt_neox": dict(
        tie_word_embeddings=False,
        vocab_size=50432,
        hidden_size=6144,
        num_hidden_layers=44,
        num_attention_heads=64,
        intermediate_size=24576,
        attention_bias=True,
    ),
    "mixtral": dict(
        tie_word_embeddings=False,
        head_dim=None,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        tie_word_embeddings=False,
        num_key_value_heads=16,
        qkv_bias=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
    "deepseek_v2": dict(
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        first_k_dense_replace=0,
        kv_lora_rank=512,
        q_lora_rank=1536,
        n_routed_experts=64,
        n_shared_experts=2,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts_per_tok=None,
        moe_intermediate_size=1407,
    ),
    "deepseek_v3": dict(
        tie_word_embeddings=False,
        attention_bias=False,
        first_k_dense_replace=3,
        kv_lora_rank=512,
        q_lora_rank=1536,
        n_routed_experts=256,
        n_shared_experts=1,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
    ),
}
FAMILIES = tuple(sorted(_DEFAULTS))
# The most decoder layers a config may have (real ones have a few hundred at most): the weights of
# every layer are listed, so an absurd count is refused before it is built.
MAX_LAYERS = 100_000
# a model's config.json is kilobytes; a larger input is not one (and /dev/zero never ends)
MAX_CONFIG_BYTES = 16 * 2**20
_LAYER_FIELDS = ("num_hidden_layers", "n_layer")
# Elements a plain MLP keeps per element of its width, by activation function (the default: 2).
_PLAIN_MLP_KEPT = {"relu": 1, "gelu_new": 5}
# The field that names a multimodal model's language model, and the model types that carry one.
_TEXT_CONFIG = "text_config"
# The embedding tables' module names across families (token first, then positions)
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "wpe", "embed_positions")


def defaults(family: str) -> dict:
    """The defaults this module assumes for ``family`` (transformers' own, for the fields it
    reads)."""
    return dict(_DEFAULTS[family])


@dataclass(frozen=True)
class Weight:
    """One parameter tensor: its module (a dotted path), its name, its shape, where it sits.

    ``layer`` is the decoder layer it belongs to (None for embeddings, final norm and head).
    ``tied``: it shares its storage with an earlier weight, so counts take it once; it still
    belongs to its module (torch lists it there). ``experts`` > 0: the leading dimension holds
    that many experts, one slice each.
    """

    module: str
    name: str
    shape: tuple[int, ...]
    layer: int | None = None
    tied: bool = False
    experts: int = 0

    @property
    def numel(self) -> int:
        total = 1
        for size in self.shape:
            total *= size
        return total


@dataclass(frozen=True)
class LayerShape:
    """What one decoder layer computes for each token, in elements: what its activations follow
    from.

    ``norm`` is 'rms' (transformers' RMSNorm, which computes in fp32 and keeps that copy),
    'gemma' (Gemma's RMSNorm, which also scales in fp32) or 'layer' (torch's LayerNorm);
    ``norms`` feed a projection, ``residual_norms`` (Gemma 2 and 3) feed the residual stream.
    Attention widths are per token: queries, keys, values, and the output (heads × value dim).
    The MLP is ``mlp_width`` wide (per expert when ``experts`` > 0, with ``top_k`` of them per
    token and ``shared_width`` of always-on experts), ``gated`` (activation × up) or not.
    """

    hidden: int
    norms: int
    norm: str
    q_width: int
    k_width: int
    v_width: int
    o_width: int
    heads: int
    mlp_width: int
    gated: bool
    experts: int = 0
    top_k: int = 0
    shared_width: int = 0
    residual_norms: int = 0
    qk_norm: bool = False
    mlp_kept: int = 0  # elements kept per element of the MLP's width; 0: 4 when gated, 2 when not
    # other elements kept per token in the compute dtype (a fused QKV output, latents)
    extra: int = 0
    # Measured from the model's own code (:mod:`offloadlab.model_count`), in place of the count
    # below: per attention, (bytes a token in the compute dtype, in other dtypes, and each per
    # position of the sequence), measured in bf16
    measured: tuple[tuple[str, float, float, float, float], ...] = ()

    def kept_bytes(self, element: int, seq: int, attention: str = "sdpa") -> float:
        """Bytes of activations this layer keeps for backward, per token, in the compute dtype's
        ``element`` bytes; ``attention`` 'sdpa' (flash or memory-efficient: no seq × seq tensor) or
        'eager' (the softmax in fp32 and the probabilities in the compute dtype, ``seq`` per head,
        with keys and values repeated to every query head).

        Counted as transformers' modules and torch's autograd keep them: each norm its input (an
        RMSNorm in fp32) and the output a projection reads, the query, key, value and attention
        output (and for SDPA one fp32 log-sum-exp per head), the MLP's projections and activation,
        and for experts each token's routed copies and the router's fp32 scores. Dropout is taken
        as off, as in today's LLM training. A ``measured`` layer returns its measurement instead,
        the compute dtype's share scaled to ``element`` bytes.
        """
        if self.measured:
            _, compute, other, compute_s, other_s = next(
                row for row in self.measured if row[0] == attention
            )
            return (compute + compute_s * seq) * element / 2 + other + other_s * seq
        h, e = self.hidden, element
        kept_in = {"rms": 4 * h + e * h + 4, "gemma": 8 * h + 4, "layer": e * h + 8}[self.norm]
        norms = (self.norms + self.residual_norms) * kept_in + self.norms * e * h
        if attention == "eager":
            attend = e * (2 * self.q_width + 2 * self.o_width) + (4 + e) * self.heads * seq
        else:
            attend = (
                e * (self.q_width + self.k_width + self.v_width + self.o_width) + 4 * self.heads
            )
        if self.qk_norm:  # an RMSNorm over each head of the queries and the keys
            attend += (4 + e) * (self.q_width + self.k_width)
        # Gated: gate, activation, up and their product; plain: the projection and the activation
        # (ReLU keeps only its output; GPT-2's tanh GELU, written as five tensor operations, keeps
        # five).
        per_width = (self.mlp_kept or (4 if self.gated else 2)) * e
        if self.experts:
            mlp = (
                self.top_k * (per_width * self.mlp_width + 2 * e * h)
                + 8 * self.experts
                + per_width * self.shared_width
            )
        else:
            mlp = per_width * self.mlp_width
        return norms + attend + mlp + e * self.extra

    def attention_flops(self, seq: int, attention: str = "sdpa") -> float:
        """Forward FLOPs per token of attention's two products over the sequence (scores, then
        the weighted sum of values), causal: 'sdpa' (flash) skips the masked half, a token
        attending to (seq + 1) / 2 positions on average; 'eager' multiplies every pair and masks
        after. A sliding window would compute less; it is not modelled."""
        pairs = (seq + 1) / 2 if attention == "sdpa" else seq
        return 2 * pairs * (self.q_width + self.o_width)


@dataclass(frozen=True)
class Architecture:
    """One decoder-only transformer: its shape, every weight tensor, and the counts that follow.

    ``kv_heads`` < ``heads`` is grouped-query attention; ``head_dim`` × ``heads`` need not equal
    ``hidden`` (Gemma, Qwen3). ``experts`` > 0 is a mixture of experts with ``experts_per_token``
    routed per token. ``counted_by`` says where the weights came from: 'formula' (this module)
    or transformers' own code (:mod:`offloadlab.model_count`). ``notes`` say what was read and how.
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
    experts: int = 0
    experts_per_token: int = 0
    weights: tuple[Weight, ...] = field(default=(), repr=False)
    layer_shapes: tuple[LayerShape, ...] = field(default=(), repr=False)
    counted_by: str = "formula"
    notes: tuple[str, ...] = ()

    @property
    def params(self) -> int:
        """Every parameter, a tied tensor once."""
        return sum(w.numel for w in self.weights if not w.tied)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to."""
        if not self.experts:
            return self.params
        idle = sum(
            w.numel * (w.experts - self.experts_per_token) // w.experts
            for w in self.weights
            if w.experts and not w.tied
        )
        return self.params - idle

    @property
    def lookup_params(self) -> int:
        """Parameters of embedding tables a token only looks up (no multiply): the token and
        position embeddings outside the layers, less the token table a tied head multiplies by."""
        tables = [
            w
            for w in self.weights
            if w.layer is None and not w.tied and w.module.rsplit(".", 1)[-1] in _EMBEDDINGS
        ]
        looked_up = sum(w.numel for w in tables)
        if self.tied_embeddings and tables:
            looked_up -= tables[0].numel  # (the token table comes first)
        return looked_up

    def _per_layer(self) -> list[int]:
        sizes = [0] * self.layers
        for w in self.weights:
            if w.layer is not None and not w.tied:
                sizes[w.layer] += w.numel
        return sizes

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (every layer, unless some are dense and some
        experts)."""
        return max(self._per_layer())

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, head."""
        return self.params - sum(self._per_layer())

    def module_params(self) -> dict[str, int]:
        """Each module's own parameters (a tied weight in each module that holds it, as torch
        lists them)."""
        sizes: dict[str, int] = {}
        for w in self.weights:
            sizes[w.module] = sizes.get(w.module, 0) + w.numel
        return sizes

    @property
    def largest_module_params(self) -> int:
        """The largest single module's own parameters (DeepSpeed's ``largest_layer_params``).

        ZeRO-3 gathers one module at a time, so its largest module bounds the gathered buffer:
        with a large vocabulary that is the token embedding or the head; with fused experts, a
        layer's expert projections.
        """
        return max(self.module_params().values())

    @property
    def largest_weight_params(self) -> int:
        """Elements of the largest single tensor: what each NVMe swap buffer must hold (a shard
        of it)."""
        return max(w.numel for w in self.weights)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "tied_embeddings": self.tied_embeddings,
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "params": self.params,
            "active_params": self.active_params,
            "layer_params": self.layer_params,
            "root_params": self.root_params,
            "largest_module_params": self.largest_module_params,
            "largest_weight_params": self.largest_weight_params,
            "counted_by": self.counted_by,
            "notes": list(self.notes),
        }


def shipped() -> list[str]:
    """Names of the configurations shipped with the package (``--model NAME``)."""
    return sorted(p.stem for p in CONFIG_FOLDER.glob("*.json"))


_JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _parse_json(text: str, source: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{source}: expected a readable JSON config; got JSONDecodeError: {error}"
        ) from None
    except RecursionError:  # thousands of nested brackets: the parser gives up before we could look
        raise ValueError(
            f"{source}: expected a JSON config; got nesting too deep to read"
        ) from None
    except ValueError as error:  # Python's limit on an integer's digits (4,300 by default)
        raise ValueError(
            f"{source}: expected a JSON config of numbers Python can read; got {error}"
        ) from None


def read_config(model: str | Path) -> tuple[dict, str, tuple[str, ...]]:
    """The config dict of ``model``, its display name and notes on how it was read.

    ``model`` is a shipped name (``"llama-3.1-8b"``), a config.json file, or a folder holding one
    (a downloaded snapshot). A multimodal config's language model (``text_config``) is what is
    returned, and a note says so.
    """
    text = str(model)
    names = shipped()
    path = Path(model)
    if text in names:
        path, name = CONFIG_FOLDER / f"{text}.json", text
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model: expected a folder holding a config.json (a model snapshot); got {text!r}, "
                f"which has none"
            )
        path, name = path / "config.json", text
    elif path.is_file() or path.is_fifo():  # a pipe too: --model-config <(cat config.json)
        name = text
    else:
        close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"model: expected one of {', '.join(names)}, or a config.json file or the folder "
            f"holding one; got {text!r}{hint}"
        )
    try:
        raw = files.read_input(path, MAX_CONFIG_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path.name}: expected a readable JSON config; got {type(error).__name__}: {error}"
        ) from None
    if not raw or len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{path.name}: expected a JSON config of at most {MAX_CONFIG_BYTES // 2**20} MiB; got "
            + ("nothing (an empty file, or a pipe nobody writes to)" if not raw else "more")
        )
    config = _parse_json(raw, name)
    if not isinstance(config, dict):
        raise ValueError(
            f"{name}: expected a JSON object (a model's config.json); got a JSON "
            f"{_JSON_KINDS.get(type(config), type(config).__name__)}"
        )
    if config.get(_TEXT_CONFIG) is not None and not isinstance(config[_TEXT_CONFIG], dict):
        raise ValueError(
            f"{name}: expected {_TEXT_CONFIG!r} to be an object (the language model's config); "
            f"got {config[_TEXT_CONFIG]!r:.60}"
        )
    notes: tuple[str, ...] = ()
    if isinstance(config.get(_TEXT_CONFIG), dict):
        outer = config.get("model_type", "multimodal")
        inner = dict(config[_TEXT_CONFIG])
        inner.setdefault("model_type", f"{outer}_text" if f"{outer}_text" in _DEFAULTS else outer)
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in inner:
            inner["tie_word_embeddings"] = config["tie_word_embeddings"]
        notes = (
            f"a multimodal {outer} config: counting its language model (text_config, "
            f"{inner['model_type']}), not its vision tower",
        )
        config = inner
    return config, name, notes


def load(model: str | Path) -> Architecture:
    """The :class:`Architecture` of a shipped configuration, a local config.json or a snapshot
    folder."""
    config, name, notes = read_config(model)
    arch = from_config(config, name=name)
    return arch if not notes else _with_notes(arch, notes)


def _with_notes(arch: Architecture, notes: tuple[str, ...]) -> Architecture:
    from dataclasses import replace

    return replace(arch, notes=arch.notes + notes)


class _Config:
    """Fields of one config, read with the family's defaults and checked as they are read."""

    def __init__(self, config: dict, source: str, family: str):
        self.config, self.source, self.family = config, source, family
        self.defaults = _DEFAULTS[family]

    def _value(self, key):
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        return self.defaults.get(key)

    def int(self, key: str, default=None) -> int:
        value = self._value(key)
        if value is None:
            value = default
        if value is None:
            raise ValueError(
                f"{self.source}: expected the field {key!r} for a {self.family} model; it is "
                "missing"
            )
        check_integer(value, self.source, expected=f"{key!r} to be a positive integer")
        # each layer is listed: refuse before building them
        if key in _LAYER_FIELDS and value > MAX_LAYERS:
            raise ValueError(
                f"{self.source}: expected {key!r} to be at most {MAX_LAYERS:,} layers; got "
                f"{value:,}"
            )
        return value

    def count(self, key: str) -> int:
        """A field that may be 0 (a number of dense layers, say)."""
        value = self._value(key)
        if value is None:
            value = 0
        return check_integer(value, self.source, 0, expected=f"{key!r} to be a whole number")

    def bool(self, key: str) -> bool:
        value = self._value(key)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise ValueError(f"{self.source}: expected {key!r} to be true or false; got {value!r}")
        return value

    def optional(self, key: str) -> int | None:
        """A positive integer or None (``q_lora_rank``: no low-rank query projection)."""
        if key in self.config:
            value = self.config[key]
            return None if value is None else self.int(key)
        return self.defaults.get(key)

    def int_list(self, key: str) -> list[int]:
        value = self._value(key) or []
        if not isinstance(value, list) or not all(is_integer(v) for v in value):
            raise ValueError(
                f"{self.source}: expected {key!r} to be a list of layer numbers; got {value!r}"
            )
        return value

    def divide(self, total: int, parts: int, total_key: str, parts_key: str) -> int:
        if total % parts:
            raise ValueError(
                f"{self.source}: expected {parts_key!r} to divide {total_key}={total}; got {parts}"
            )
        return total // parts


class _Builder:
    """Collects a model's weights in the order its code creates them."""

    def __init__(self):
        self.weights: list[Weight] = []
        self.layer: int | None = None

    def tensor(self, module: str, name: str, *shape: int, experts: int = 0) -> None:
        self.weights.append(Weight(module, name, tuple(shape), self.layer, experts=experts))

    def linear(self, module: str, inputs: int, outputs: int, bias: bool) -> None:
        self.tensor(module, "weight", outputs, inputs)
        if bias:
            self.tensor(module, "bias", outputs)

    def conv1d(self, module: str, inputs: int, outputs: int) -> None:
        """GPT-2's Conv1D: a linear layer whose weight is stored transposed, always with a bias."""
        self.tensor(module, "weight", inputs, outputs)
        self.tensor(module, "bias", outputs)

    def norm(self, module: str, size: int, bias: bool = False) -> None:
        self.tensor(module, "weight", size)
        if bias:
            self.tensor(module, "bias", size)

    def head(self, inputs: int, vocab: int, tied: bool, embedding: str, bias: bool = False) -> None:
        """The output head: its weight tied to ``embedding``'s (counted there) or its own."""
        self.weights.append(Weight("lm_head", "weight", (vocab, inputs), None, tied=tied))
        if bias:
            self.tensor("lm_head", "bias", vocab)


def from_config(config: dict, name: str = "config.json") -> Architecture:
    """The :class:`Architecture` a Hugging Face ``config.json`` (as a dict) describes."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object; got {type(config).__name__}")
    family = config.get("model_type")
    if family not in _DEFAULTS:
        raise ValueError(
            f"{name}: expected 'model_type' to be one of {', '.join(FAMILIES)} for this formula; "
            f"got {family!r} (with transformers installed, `offloadlab plan` counts any model type "
            f"from transformers' own code)"
        )
    c = _Config(config, name, family)
    builder = {
        "gpt2": _gpt2,
        "phi": _phi,
        "opt": _opt,
        "falcon": _falcon,
        "bloom": _bloom,
        "gpt_neox": _gpt_neox,
    }.get(family, _rotary)
    return builder(c, name)


def _attention_widths(c: _Config, hidden: int, heads: int) -> tuple[int, int]:
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"{c.source}: expected 'num_key_value_heads' to divide num_attention_heads={heads}; "
            f"got {kv_heads}"
        )
    head_dim = c.optional("head_dim") or c.divide(
        hidden, heads, "hidden_size", "num_attention_heads"
    )
    return kv_heads, head_dim


def _rotary(c: _Config, name: str) -> Architecture:
    """The rotary-embedding decoders: llama and the families written after it."""
    family = c.family
    hidden, heads, layers = (
        c.int("hidden_size"),
        c.int("num_attention_heads"),
        c.int("num_hidden_layers"),
    )
    vocab, width = c.int("vocab_size"), c.int("intermediate_size")
    tied = c.bool("tie_word_embeddings")
    mla = family in ("deepseek_v2", "deepseek_v3")
    kv_heads, head_dim = (
        (heads, c.int("qk_rope_head_dim")) if mla else _attention_widths(c, hidden, heads)
    )
    q_bias = {"qwen2": True, "qwen2_moe": c.bool("qkv_bias")}.get(family, c.bool("attention_bias"))
    o_bias = c.bool("attention_bias") if family not in ("qwen2", "qwen2_moe") else False
    experts, top_k, expert_width, shared, moe_layers = _experts(c, layers)
    check_routing(experts, top_k, c.source)
    norms = 4 if family in ("gemma2", "gemma3_text") else 2
    b = _Builder()
    b.tensor("model.embed_tokens", "weight", vocab, hidden)
    shapes = []
    for layer in range(layers):
        b.layer = layer
        at = f"model.layers.{layer}"
        if mla:
            q_width, k_width, v_width, extra = _latent_attention(b, c, at, hidden, heads)
            o_width = v_width
        else:
            q_width, k_width = heads * head_dim, kv_heads * head_dim
            v_width, o_width, extra = k_width, q_width, 0
            if family == "phi3":
                b.linear(f"{at}.self_attn.qkv_proj", hidden, q_width + 2 * k_width, False)
            else:
                b.linear(f"{at}.self_attn.q_proj", hidden, q_width, q_bias)
                b.linear(f"{at}.self_attn.k_proj", hidden, k_width, q_bias)
                b.linear(f"{at}.self_attn.v_proj", hidden, k_width, q_bias)
            b.linear(f"{at}.self_attn.o_proj", q_width, hidden, o_bias)
            if family in ("qwen3", "gemma3_text"):
                b.norm(f"{at}.self_attn.q_norm", head_dim)
                b.norm(f"{at}.self_attn.k_norm", head_dim)
        sparse = layer in moe_layers
        if sparse:
            _expert_mlp(b, c, at, hidden, experts, expert_width, shared)
        elif family == "phi3":
            b.linear(f"{at}.mlp.gate_up_proj", hidden, 2 * width, False)
            b.linear(f"{at}.mlp.down_proj", width, hidden, False)
        else:
            mlp_bias = c.bool("mlp_bias") if family in ("llama", "deepseek_v2") else False
            b.linear(f"{at}.mlp.gate_proj", hidden, width, mlp_bias)
            b.linear(f"{at}.mlp.up_proj", hidden, width, mlp_bias)
            b.linear(f"{at}.mlp.down_proj", width, hidden, mlp_bias)
        norm_names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )[:norms]
        for norm in norm_names:
            b.norm(f"{at}.{norm}", hidden)
        # Of Gemma 2's four norms, those after attention and after the MLP feed the residual, not a
        # projection.
        gemma = family.startswith("gemma")
        shapes.append(
            LayerShape(
                hidden,
                2,
                "gemma" if gemma else "rms",
                q_width,
                k_width,
                v_width,
                o_width,
                heads,
                expert_width if sparse else width,
                True,
                experts if sparse else 0,
                top_k if sparse else 0,
                shared if sparse else 0,
                residual_norms=norms - 2,
                qk_norm=family in ("qwen3", "gemma3_text"),
                extra=extra,
            )
        )
    b.layer = None
    b.norm("model.norm", hidden)
    b.head(hidden, vocab, tied, "model.embed_tokens")
    return Architecture(
        name,
        family,
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        width,
        vocab,
        tied,
        experts,
        top_k,
        tuple(b.weights),
        tuple(shapes),
    )


def check_routing(experts: int, top_k: int, source: str) -> None:
    """ValueError unless a token is routed to 1 to ``experts`` experts (a dense model: none)."""
    if experts and not 1 <= top_k <= experts:
        raise ValueError(
            f"{source}: expected 'num_experts_per_tok' from 1 to the {experts} experts; got {top_k}"
        )


def _experts(c: _Config, layers: int) -> tuple[int, int, int, int, set[int]]:
    """(experts, routed per token, one expert's width, shared experts' width, the layers with
    experts)."""
    family = c.family
    if family == "mixtral":
        experts, top_k = c.int("num_local_experts"), c.int("num_experts_per_tok")
        return experts, top_k, c.int("intermediate_size"), 0, set(range(layers))
    if family == "qwen2_moe":
        experts, top_k = c.count("num_experts"), c.int("num_experts_per_tok")
        step, dense = c.int("decoder_sparse_step"), set(c.int_list("mlp_only_layers"))
        sparse = {i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0}
        return (
            experts,
            top_k,
            c.int("moe_intermediate_size"),
            c.int("shared_expert_intermediate_size"),
            sparse,
        )
    if family in ("deepseek_v2", "deepseek_v3"):
        experts, top_k = c.int("n_routed_experts"), c.int("num_experts_per_tok")
        width = c.int("moe_intermediate_size")
        first = c.count("first_k_dense_replace")
        return experts, top_k, width, width * c.count("n_shared_experts"), set(range(first, layers))
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if c.config.get(key):
            raise ValueError(
                f"{c.source}: expected a dense {family} model; got the mixture-of-experts field "
                f"{key!r}, which {family} does not have"
            )
    return 0, 0, 0, 0, set()


def _expert_mlp(
    b: _Builder, c: _Config, at: str, hidden: int, experts: int, width: int, shared: int
) -> None:
    """A router and ``experts`` gated experts fused per projection; shared experts where the
    family has them."""
    if c.family == "mixtral":
        b.tensor(f"{at}.mlp.gate", "weight", experts, hidden)
        b.tensor(f"{at}.mlp.experts", "gate_up_proj", experts, 2 * width, hidden, experts=experts)
        b.tensor(f"{at}.mlp.experts", "down_proj", experts, hidden, width, experts=experts)
        return
    if c.family == "qwen2_moe":
        b.tensor(f"{at}.mlp.gate", "weight", experts, hidden)
        b.tensor(f"{at}.mlp.experts", "gate_up_proj", experts, 2 * width, hidden, experts=experts)
        b.tensor(f"{at}.mlp.experts", "down_proj", experts, hidden, width, experts=experts)
        b.linear(f"{at}.mlp.shared_expert.gate_proj", hidden, shared, False)
        b.linear(f"{at}.mlp.shared_expert.up_proj", hidden, shared, False)
        b.linear(f"{at}.mlp.shared_expert.down_proj", shared, hidden, False)
        b.linear(f"{at}.mlp.shared_expert_gate", hidden, 1, False)
        return
    b.tensor(f"{at}.mlp.experts", "gate_up_proj", experts, 2 * width, hidden, experts=experts)
    b.tensor(f"{at}.mlp.experts", "down_proj", experts, hidden, width, experts=experts)
    b.tensor(f"{at}.mlp.gate", "weight", experts, hidden)
    bias = c.bool("mlp_bias") if c.family == "deepseek_v2" else False
    b.linear(f"{at}.mlp.shared_experts.gate_proj", hidden, shared, bias)
    b.linear(f"{at}.mlp.shared_experts.up_proj", hidden, shared, bias)
    b.linear(f"{at}.mlp.shared_experts.down_proj", shared, hidden, bias)


def _latent_attention(
    b: _Builder, c: _Config, at: str, hidden: int, heads: int
) -> tuple[int, int, int, int]:
    """DeepSeek's multi-head latent attention; returns the (q, k, v) widths per token and the
    extra kept."""
    nope, rope, v_dim = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    latent, q_rank, bias = (
        c.int("kv_lora_rank"),
        c.optional("q_lora_rank"),
        c.bool("attention_bias"),
    )
    q_width = heads * (nope + rope)
    if q_rank is None:
        b.linear(f"{at}.self_attn.q_proj", hidden, q_width, False)
    else:
        b.linear(f"{at}.self_attn.q_a_proj", hidden, q_rank, bias)
        b.norm(f"{at}.self_attn.q_a_layernorm", q_rank)
        b.linear(f"{at}.self_attn.q_b_proj", q_rank, q_width, False)
    b.linear(f"{at}.self_attn.kv_a_proj_with_mqa", hidden, latent + rope, bias)
    b.norm(f"{at}.self_attn.kv_a_layernorm", latent)
    b.linear(f"{at}.self_attn.kv_b_proj", latent, heads * (nope + v_dim), False)
    b.linear(f"{at}.self_attn.o_proj", heads * v_dim, hidden, bias)
    extra = (
        latent + rope + 2 * latent + heads * (nope + v_dim) + (2 * q_rank + q_rank if q_rank else 0)
    )
    return q_width, q_width, heads * v_dim, extra


def _mlp_kept(c: _Config, key: str, default: str) -> int:
    act = c.config.get(key) or default
    return _PLAIN_MLP_KEPT.get(act, 2) if isinstance(act, str) else 2


def _gpt2(c: _Config, name: str) -> Architecture:
    hidden, heads, layers = c.int("n_embd"), c.int("n_head"), c.int("n_layer")
    vocab, positions, tied = (
        c.int("vocab_size"),
        c.int("n_positions"),
        c.bool("tie_word_embeddings"),
    )
    width = c.int("n_inner", 4 * hidden)
    head_dim = c.divide(hidden, heads, "n_embd", "n_head")
    b = _Builder()
    b.tensor("transformer.wte", "weight", vocab, hidden)
    b.tensor("transformer.wpe", "weight", positions, hidden)
    for layer in range(layers):
        b.layer = layer
        at = f"transformer.h.{layer}"
        b.norm(f"{at}.ln_1", hidden, bias=True)
        b.conv1d(f"{at}.attn.c_attn", hidden, 3 * hidden)
        b.conv1d(f"{at}.attn.c_proj", hidden, hidden)
        b.norm(f"{at}.ln_2", hidden, bias=True)
        b.conv1d(f"{at}.mlp.c_fc", hidden, width)
        b.conv1d(f"{at}.mlp.c_proj", width, hidden)
    b.layer = None
    b.norm("transformer.ln_f", hidden, bias=True)
    b.head(hidden, vocab, tied, "transformer.wte")
    # transformers' GPT-2 keeps the fused QKV output as well as the queries, keys and values it
    # splits off.
    shape = LayerShape(
        hidden,
        2,
        "layer",
        hidden,
        hidden,
        hidden,
        hidden,
        heads,
        width,
        False,
        mlp_kept=_mlp_kept(c, "activation_function", "gelu_new"),
        extra=3 * hidden,
    )
    return Architecture(
        name,
        "gpt2",
        layers,
        hidden,
        heads,
        heads,
        head_dim,
        width,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )


def _phi(c: _Config, name: str) -> Architecture:
    hidden, heads, layers = (
        c.int("hidden_size"),
        c.int("num_attention_heads"),
        c.int("num_hidden_layers"),
    )
    vocab, width, tied = (
        c.int("vocab_size"),
        c.int("intermediate_size"),
        c.bool("tie_word_embeddings"),
    )
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"{c.source}: expected 'num_key_value_heads' to divide num_attention_heads={heads}; "
            f"got {kv_heads}"
        )
    head_dim = c.divide(hidden, heads, "hidden_size", "num_attention_heads")
    qk_norm = c.bool("qk_layernorm")
    q_width, k_width = heads * head_dim, kv_heads * head_dim
    b = _Builder()
    b.tensor("model.embed_tokens", "weight", vocab, hidden)
    for layer in range(layers):
        b.layer = layer
        at = f"model.layers.{layer}"
        b.linear(f"{at}.self_attn.q_proj", hidden, q_width, True)
        b.linear(f"{at}.self_attn.k_proj", hidden, k_width, True)
        b.linear(f"{at}.self_attn.v_proj", hidden, k_width, True)
        b.linear(f"{at}.self_attn.dense", q_width, hidden, True)
        if qk_norm:
            b.norm(f"{at}.self_attn.q_layernorm", head_dim, bias=True)
            b.norm(f"{at}.self_attn.k_layernorm", head_dim, bias=True)
        b.linear(f"{at}.mlp.fc1", hidden, width, True)
        b.linear(f"{at}.mlp.fc2", width, hidden, True)
        b.norm(f"{at}.input_layernorm", hidden, bias=True)
    b.layer = None
    b.norm("model.final_layernorm", hidden, bias=True)
    # tying shares the weight; the bias stays
    b.head(hidden, vocab, tied, "model.embed_tokens", bias=True)
    shape = LayerShape(
        hidden,
        1,
        "layer",
        q_width,
        k_width,
        k_width,
        q_width,
        heads,
        width,
        False,
        qk_norm=qk_norm,
        mlp_kept=_mlp_kept(c, "hidden_act", "gelu_new"),
    )
    return Architecture(
        name,
        "phi",
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        width,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )


def _opt(c: _Config, name: str) -> Architecture:
    hidden, heads, layers = (
        c.int("hidden_size"),
        c.int("num_attention_heads"),
        c.int("num_hidden_layers"),
    )
    vocab, width, positions = (
        c.int("vocab_size"),
        c.int("ffn_dim"),
        c.int("max_position_embeddings"),
    )
    tied, bias = c.bool("tie_word_embeddings"), c.bool("enable_bias")
    affine = (
        c.bool("layer_norm_elementwise_affine")
        if "layer_norm_elementwise_affine" in c.config
        else True
    )
    projected = c.int("word_embed_proj_dim", hidden)
    head_dim = c.divide(hidden, heads, "hidden_size", "num_attention_heads")
    b = _Builder()
    norm = (lambda module: b.norm(module, hidden, bias=True)) if affine else (lambda module: None)
    b.tensor("model.decoder.embed_tokens", "weight", vocab, projected)
    # OPT offsets positions by 2
    b.tensor("model.decoder.embed_positions", "weight", positions + 2, hidden)
    if projected != hidden:
        b.linear("model.decoder.project_out", hidden, projected, False)
        b.linear("model.decoder.project_in", projected, hidden, False)
    if c.bool("do_layer_norm_before") and not c.bool("_remove_final_layer_norm"):
        norm("model.decoder.final_layer_norm")
    for layer in range(layers):
        b.layer = layer
        at = f"model.decoder.layers.{layer}"
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            b.linear(f"{at}.self_attn.{proj}", hidden, hidden, bias)
        norm(f"{at}.self_attn_layer_norm")
        b.linear(f"{at}.fc1", hidden, width, bias)
        b.linear(f"{at}.fc2", width, hidden, bias)
        norm(f"{at}.final_layer_norm")
    b.layer = None
    b.head(projected, vocab, tied, "model.decoder.embed_tokens")
    shape = LayerShape(
        hidden,
        2,
        "layer",
        hidden,
        hidden,
        hidden,
        hidden,
        heads,
        width,
        False,
        mlp_kept=_mlp_kept(c, "activation_function", "relu"),
    )
    return Architecture(
        name,
        "opt",
        layers,
        hidden,
        heads,
        heads,
        head_dim,
        width,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )


def _falcon(c: _Config, name: str) -> Architecture:
    hidden, heads, layers = (
        c.int("hidden_size"),
        c.int("num_attention_heads"),
        c.int("num_hidden_layers"),
    )
    vocab, tied, bias = c.int("vocab_size"), c.bool("tie_word_embeddings"), c.bool("bias")
    width = c.int("ffn_hidden_size", 4 * hidden)
    head_dim = c.divide(hidden, heads, "hidden_size", "num_attention_heads")
    new = c.bool("new_decoder_architecture")
    kv_heads = c.int("num_kv_heads", heads) if (new or not c.bool("multi_query")) else 1
    parallel = c.bool("parallel_attn")
    norms = c.int("num_ln_in_parallel_attn", 2 if new else 1) if parallel else 2
    names = (
        (("ln_attn", "ln_mlp") if norms == 2 else ("input_layernorm",))
        if parallel
        else ("input_layernorm", "post_attention_layernorm")
    )
    b = _Builder()
    b.tensor("transformer.word_embeddings", "weight", vocab, hidden)
    for layer in range(layers):
        b.layer = layer
        at = f"transformer.h.{layer}"
        b.linear(
            f"{at}.self_attention.query_key_value", hidden, (heads + 2 * kv_heads) * head_dim, bias
        )
        b.linear(f"{at}.self_attention.dense", hidden, hidden, bias)
        b.linear(f"{at}.mlp.dense_h_to_4h", hidden, width, bias)
        b.linear(f"{at}.mlp.dense_4h_to_h", width, hidden, bias)
        for norm in names:
            b.norm(f"{at}.{norm}", hidden, bias=True)
    b.layer = None
    b.norm("transformer.ln_f", hidden, bias=True)
    b.head(hidden, vocab, tied, "transformer.word_embeddings")
    shape = LayerShape(
        hidden,
        len(names),
        "layer",
        hidden,
        kv_heads * head_dim,
        kv_heads * head_dim,
        hidden,
        heads,
        width,
        False,
    )
    return Architecture(
        name,
        "falcon",
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        width,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )


def _bloom(c: _Config, name: str) -> Architecture:
    hidden = c.int("hidden_size", c.config.get("n_embed"))
    heads, layers = c.int("n_head"), c.int("n_layer")
    vocab, tied = c.int("vocab_size"), c.bool("tie_word_embeddings")
    head_dim = c.divide(hidden, heads, "hidden_size", "n_head")
    b = _Builder()
    b.tensor("transformer.word_embeddings", "weight", vocab, hidden)
    b.norm("transformer.word_embeddings_layernorm", hidden, bias=True)
    for layer in range(layers):
        b.layer = layer
        at = f"transformer.h.{layer}"
        b.norm(f"{at}.input_layernorm", hidden, bias=True)
        b.linear(f"{at}.self_attention.query_key_value", hidden, 3 * hidden, True)
        b.linear(f"{at}.self_attention.dense", hidden, hidden, True)
        b.norm(f"{at}.post_attention_layernorm", hidden, bias=True)
        b.linear(f"{at}.mlp.dense_h_to_4h", hidden, 4 * hidden, True)
        b.linear(f"{at}.mlp.dense_4h_to_h", 4 * hidden, hidden, True)
    b.layer = None
    b.norm("transformer.ln_f", hidden, bias=True)
    b.head(hidden, vocab, tied, "transformer.word_embeddings")
    shape = LayerShape(hidden, 2, "layer", hidden, hidden, hidden, hidden, heads, 4 * hidden, False)
    return Architecture(
        name,
        "bloom",
        layers,
        hidden,
        heads,
        heads,
        head_dim,
        4 * hidden,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )


def _gpt_neox(c: _Config, name: str) -> Architecture:
    hidden, heads, layers = (
        c.int("hidden_size"),
        c.int("num_attention_heads"),
        c.int("num_hidden_layers"),
    )
    vocab, width, tied = (
        c.int("vocab_size"),
        c.int("intermediate_size"),
        c.bool("tie_word_embeddings"),
    )
    bias = c.bool("attention_bias")
    head_dim = c.divide(hidden, heads, "hidden_size", "num_attention_heads")
    b = _Builder()
    b.tensor("gpt_neox.embed_in", "weight", vocab, hidden)
    for layer in range(layers):
        b.layer = layer
        at = f"gpt_neox.layers.{layer}"
        b.norm(f"{at}.input_layernorm", hidden, bias=True)
        b.norm(f"{at}.post_attention_layernorm", hidden, bias=True)
        b.linear(f"{at}.attention.query_key_value", hidden, 3 * hidden, bias)
        b.linear(f"{at}.attention.dense", hidden, hidden, bias)
        b.linear(f"{at}.mlp.dense_h_to_4h", hidden, width, True)
        b.linear(f"{at}.mlp.dense_4h_to_h", width, hidden, True)
    b.layer = None
    b.norm("gpt_neox.final_layer_norm", hidden, bias=True)
    b.head(hidden, vocab, tied, "gpt_neox.embed_in")
    shape = LayerShape(
        hidden,
        2,
        "layer",
        hidden,
        hidden,
        hidden,
        hidden,
        heads,
        width,
        False,
        mlp_kept=_mlp_kept(c, "hidden_act", "gelu"),
    )
    return Architecture(
        name,
        "gpt_neox",
        layers,
        hidden,
        heads,
        heads,
        head_dim,
        width,
        vocab,
        tied,
        weights=tuple(b.weights),
        layer_shapes=(shape,) * layers,
    )
