"""Parameter counts from transformers' own model code: each config built on the meta device;
for a family without a formula, its layers' activations too, from a forward on fake tensors.

:func:`architecture` hands a config dict to transformers (``AutoConfig.for_model``), builds
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` — shapes and no storage, so a
70 B model costs no memory and nothing is downloaded — and lists every parameter it made, a
tied one once, in the :class:`offloadlab.architectures.Architecture` the planner reads. The
count is then the model's own, for any model type transformers knows; the formulas of
:mod:`offloadlab.architectures` stay the fallback when transformers is not installed (and in
the browser), and the note says whether they agree. Where no formula describes the family, each
decoder layer's saved bytes are measured as its own code runs forward on fake tensors (shapes and
dtypes, no memory) under saved-tensor hooks (:func:`offloadlab.models.saved_bytes_by_layer`,
given as ``measure``: it runs the model, so it lives with the models, not with the estimates).

It imports torch and transformers only when called: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import warnings
from dataclasses import replace

from . import architectures
from .architectures import Architecture, LayerShape, Weight
from .units import check_integer, is_integer

__all__ = ["available", "architecture", "version"]

# Config fields that name the number of routed experts and how many each token uses, across
# families.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# Fields that mean the same in every family that has them: checked before transformers reads them
_WIDTH_FIELDS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "moe_intermediate_size",
    "vocab_size",
    "num_experts_per_tok",
)
_FLAG_FIELDS = ("tie_word_embeddings",)
# The widths a plan cannot do without: taken from transformers' defaults, they would describe
# another model
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads")
_NOTED = ("intermediate_size", "vocab_size")  # said in a note when taken from the defaults
# Blocks that hold state in place of attention, by class name (Mamba's and Bamba's mixers,
# Qwen3-Next's gated DeltaNet, LFM2's short convolution, RecurrentGemma's, RWKV's)
_ATTENTION_FREE = re.compile(r"Mamba|SSM|DeltaNet|ShortConv|Recurrent|Rwkv|RWKV|Mixer$")


def available() -> bool:
    """Whether transformers (and torch) can be imported here."""
    return (
        importlib.util.find_spec("transformers") is not None
        and importlib.util.find_spec("torch") is not None
    )


def version() -> str:
    import transformers

    return transformers.__version__


def architecture(
    config: dict, name: str = "config.json", notes: tuple[str, ...] = (), measure=None
) -> Architecture:
    """The :class:`Architecture` of ``config`` as transformers builds it (ValueError if it
    cannot). For a family without a formula, ``measure``
    (:func:`offloadlab.models.saved_bytes_by_layer`, which runs the model's code) gives its
    layers' activations; without it they are estimated."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object; got {type(config).__name__}")
    counted = _counted(json.dumps(config, sort_keys=True), name, measure)
    return replace(counted, notes=notes + counted.notes)


@functools.lru_cache(maxsize=64)
def _counted(config_text: str, name: str, measure=None) -> Architecture:
    import torch
    import transformers

    config = json.loads(config_text)
    family = config.get("model_type")
    if not isinstance(family, str) or not family:
        raise ValueError(
            f"{name}: expected a 'model_type' naming the model's family; got {family!r}"
        )
    fields = {k: v for k, v in config.items() if k != "model_type"}
    _check_fields(fields, name)
    family = _language_model_type(family, name)
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            built = transformers.AutoConfig.for_model(family, **fields)
        except (ValueError, KeyError) as error:
            if family in transformers.CONFIG_MAPPING:
                raise ValueError(f"{name}: {_refusal(error, family)}") from None
            raise ValueError(
                f"{name}: expected a model_type transformers {transformers.__version__} knows; got "
                f"{family!r} ({str(error).splitlines()[0][:120]})"
            ) from None
        except (TypeError, AttributeError, _validation_error()) as error:
            raise ValueError(f"{name}: {_refusal(error, family)}") from None
        defaulted = _check_given(built, fields, name, family)
        try:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(built)
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RuntimeError,
            AssertionError,
        ) as error:
            raise ValueError(
                f"{name}: transformers {transformers.__version__} cannot build this {family} "
                f"config as a causal language model ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:120] if str(error) else ''})"
            ) from None
    layers_path, layers = _decoder_layers(model)
    weights = _weights(model, layers_path, built)
    formula = _formula(config, name)
    experts, per_token = _expert_counts(built)
    architectures.check_routing(experts, per_token, name)
    hidden = _attr(built, "hidden_size", "n_embd", "d_model")
    heads = _attr(built, "num_attention_heads", "n_head")
    stateful = _attention_free_layers(model, layers_path)
    if not heads or stateful == layers:
        raise ValueError(
            f"{name}: a {family} model has no attention layers (a state-space or other "
            "attention-free model); the planner models attention layers only"
        )
    kv_heads = _attr(built, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _attr(built, "head_dim") or (hidden // heads if hidden and heads else 0)
    intermediate = _attr(
        built, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"
    ) or 4 * (hidden or 0)
    tied = bool(getattr(built, "tie_word_embeddings", False))
    counted = Architecture(
        name,
        family,
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        _attr(built, "vocab_size"),
        tied,
        experts,
        per_token,
        weights,
        (),
        f"transformers {transformers.__version__}, built on the meta device",
    )
    if formula is not None:
        shapes = formula.layer_shapes
        agree = formula.params == counted.params and formula.active_params == counted.active_params
        note = (
            "the formula gives the same count"
            if agree
            else f"the formula gives {formula.params:,} (transformers' count is the one used)"
        )
    else:
        shapes, note = _measured_shapes(counted, built, layers_path, measure)
    notes = (note, *defaulted)
    if stateful:
        how = "measured" if shapes and shapes[0].measured else "estimated as an attention layer's"
        notes += (
            f"a hybrid: {stateful} of its {layers} layers hold state-space or recurrent blocks, "
            f"their activations {how}",
        )
    return replace(counted, layer_shapes=shapes, notes=notes)


def _measured_shapes(counted: Architecture, built, layers_path: str, measure):
    """(layer shapes, note) of a family without a formula: each layer's saved bytes as
    ``measure`` finds them running transformers' own code
    (:func:`offloadlab.models.saved_bytes_by_layer`), else a Llama-like estimate, and the note
    says which."""
    like = _llama_like(counted)
    if measure is None:
        return (like,) * counted.layers, (
            f"no formula for {counted.family}: activations estimated as for a Llama-like layer of "
            "the same widths (not measured: no measure given)"
        )
    try:
        measured, attention = measure(built, layers_path, counted.layers)
    except Exception as error:  # (a forward fake tensors cannot run: data-dependent shapes, say)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
        return (like,) * counted.layers, (
            f"no formula for {counted.family}, and its forward would not run on fake tensors "
            f"({reason}): activations estimated as for a Llama-like layer of the same widths"
        )
    note = (
        f"no formula for {counted.family}: activations measured from transformers' own code "
        "(each layer's saved tensors, on fake tensors, in bf16)"
    )
    if attention == "eager":
        note += f"; {counted.family} has no SDPA in transformers: eager attention, s² scores kept"
    return tuple(replace(like, measured=rows) for rows in measured), note


def _check_fields(fields: dict, name: str) -> None:
    """ValueError naming the first field of ``fields`` whose type or range no family accepts, or
    whose heads or experts disagree, before transformers reads it."""
    for key in _WIDTH_FIELDS:
        if fields.get(key) is not None:
            value = fields[key]
            check_integer(value, name, expected=f"{key!r} to be a positive integer")
            if key in ("num_hidden_layers", "n_layer", "num_layers"):
                # the model would be built layer by layer
                check_integer(
                    value,
                    name,
                    high=architectures.MAX_LAYERS,
                    expected=f"{key!r} to be at most {architectures.MAX_LAYERS:,} layers",
                )
    for key in _EXPERT_FIELDS:
        if fields.get(key) is not None:
            check_integer(fields[key], name, 0, expected=f"{key!r} to be a whole number")
    for key in _FLAG_FIELDS:
        if key in fields and not isinstance(fields[key], bool):
            raise ValueError(f"{name}: expected {key!r} to be true or false; got {fields[key]!r}")
    heads = fields.get("num_attention_heads") or fields.get("n_head")
    kv_heads = fields.get("num_key_value_heads") or fields.get("num_kv_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(
            f"{name}: expected the key-value heads ({kv_heads}) to divide the {heads} attention "
            "heads"
        )
    experts = next((fields[key] for key in _EXPERT_FIELDS if fields.get(key)), 0)
    if experts and fields.get("num_experts_per_tok") is not None:
        architectures.check_routing(experts, fields["num_experts_per_tok"], name)


def _language_model_type(family: str, name: str) -> str:
    """The model_type of a multimodal ``family``'s language model (``llama4`` → ``llama4_text``):
    the fields given are its text config's."""
    import transformers

    if family not in transformers.CONFIG_MAPPING:
        return family  # refused, with the families transformers knows, when it is read
    text = (getattr(transformers.CONFIG_MAPPING[family], "sub_configs", None) or {}).get(
        "text_config"
    )
    if text is None:
        return family
    if not getattr(text, "model_type", ""):
        raise ValueError(
            f"{name}: expected a 'model_type' inside text_config: a {family} model's language "
            "model may be of several families"
        )
    return text.model_type


def _check_given(built, fields: dict, name: str, family: str) -> tuple[str, ...]:
    """ValueError if a width the plan needs came from transformers' defaults, not ``fields``
    (``{"model_type": "qwen3"}`` alone is not a 12B model); else a note naming the other widths
    that did."""
    aliases = getattr(type(built), "attribute_map", {}) or {}

    def given(key):
        return key in fields or aliases.get(key) in fields

    for key in _REQUIRED:
        if not given(key) and _attr(built, key):
            raise ValueError(
                f"{name}: expected the field {aliases.get(key, key)!r} for a {family} model; it is "
                f"missing (transformers would fill in {getattr(built, key)}, another model's width)"
            )
    defaulted = [
        f"{key} {getattr(built, key)}" for key in _NOTED if not given(key) and _attr(built, key)
    ]
    if not defaulted:
        return ()
    return (f"not in the config, from transformers' {family} defaults: {', '.join(defaulted)}",)


def _validation_error() -> type:
    """The error transformers' config classes raise for a field of the wrong type
    (huggingface_hub's strict dataclasses; not a ValueError)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its configs raise ValueError or TypeError
        return TypeError
    return StrictDataclassError


def _refusal(error: Exception, family: str) -> str:
    """One line: transformers' reason for refusing a ``family`` config (its last line names the
    field)."""
    import transformers

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = lines[-1] if lines else type(error).__name__
    return f"transformers {transformers.__version__} refuses this {family} config: {reason[:160]}"


def _attention_free_layers(model, layers_path: str) -> int:
    """How many decoder layers hold a state-space or recurrent block (by its class name)."""
    if not layers_path:
        return 0
    layers = model.get_submodule(layers_path)
    return sum(
        any(_ATTENTION_FREE.search(type(module).__name__) for module in layer.modules())
        for layer in layers
    )


def _attr(config, *names):
    for key in names:
        value = getattr(config, key, None)
        if is_integer(value) and value > 0:
            return value
    return 0


def _decoder_layers(model) -> tuple[str, int]:
    """The path and length of the model's list of decoder layers: its longest ModuleList."""
    import torch

    lists = [
        (name, len(module))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module)
    ]
    if not lists:
        return "", 0
    return max(lists, key=lambda item: item[1])


def _weights(model, layers_path: str, config) -> tuple[Weight, ...]:
    """Every parameter, in registration order; a repeat of an earlier tensor is marked tied."""
    experts, _ = _expert_counts(config)
    seen: set[int] = set()
    prefix = f"{layers_path}." if layers_path else None
    weights = []
    for full_name, parameter in model.named_parameters(remove_duplicate=False):
        module, _, name = full_name.rpartition(".")
        layer = None
        if prefix and full_name.startswith(prefix):
            index = full_name[len(prefix) :].split(".", 1)[0]
            layer = int(index) if index.isdigit() else None
        in_experts = experts and ".experts" in f".{module}" and "shared_expert" not in module
        weights.append(
            Weight(
                module,
                name,
                tuple(parameter.shape),
                layer,
                tied=id(parameter) in seen,
                experts=experts if in_experts else 0,
            )
        )
        seen.add(id(parameter))
    return tuple(weights)


def _expert_counts(config) -> tuple[int, int]:
    experts = next(
        (
            getattr(config, f)
            for f in _EXPERT_FIELDS
            if isinstance(getattr(config, f, None), int) and getattr(config, f) > 0
        ),
        0,
    )
    per_token = getattr(config, "num_experts_per_tok", 0) or 0
    return (experts, per_token) if experts and per_token else (0, 0)


def _formula(config: dict, name: str) -> Architecture | None:
    if config.get("model_type") not in architectures.FAMILIES:
        return None
    try:
        return architectures.from_config(config, name)
    except ValueError:
        return None


def _llama_like(arch: Architecture) -> LayerShape:
    """A Llama-shaped layer of ``arch``'s widths: what a model type without a formula is assumed
    to keep."""
    q_width, k_width = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    return LayerShape(
        arch.hidden,
        2,
        "rms",
        q_width,
        k_width,
        k_width,
        q_width,
        arch.heads,
        arch.intermediate,
        True,
        arch.experts,
        arch.experts_per_token,
        0,
    )
