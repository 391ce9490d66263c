"""Parameter counts from transformers' own model code: each config built on the meta device.

:func:`architecture` hands a config dict to transformers (``AutoConfig.for_model``), builds
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` — shapes and no storage, so a
70 B model costs no memory and nothing is downloaded — and lists every parameter it made, a
tied one once, in the :class:`offloadlab.architectures.Architecture` the planner reads. The
count is then the model's own, for any model type transformers knows; the formulas of
:mod:`offloadlab.architectures` stay the fallback when transformers is not installed (and in
the browser), and the note says whether they agree.

It imports torch and transformers only when called: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import warnings
from dataclasses import replace

from . import architectures
from .architectures import Architecture, LayerShape, Weight
from .units import is_integer

__all__ = ["available", "architecture", "version"]

# Config fields that name the number of routed experts and how many each token uses, across
# families.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


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
    config: dict, name: str = "config.json", notes: tuple[str, ...] = ()
) -> Architecture:
    """The :class:`Architecture` of ``config`` as transformers builds it (ValueError if it
    cannot)."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object; got {type(config).__name__}")
    counted = _counted(json.dumps(config, sort_keys=True), name)
    return replace(counted, notes=notes + counted.notes)


@functools.lru_cache(maxsize=64)
def _counted(config_text: str, name: str) -> Architecture:
    import torch
    import transformers

    config = json.loads(config_text)
    family = config.get("model_type")
    if not isinstance(family, str) or not family:
        raise ValueError(
            f"{name}: expected a 'model_type' naming the model's family; got {family!r}"
        )
    fields = {k: v for k, v in config.items() if k != "model_type"}
    # the model would be built layer by layer
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = fields.get(key)
        if isinstance(value, int) and value > architectures.MAX_LAYERS:
            raise ValueError(
                f"{name}: expected {key!r} to be at most {architectures.MAX_LAYERS:,} layers; "
                f"got {value:,}"
            )
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            built = transformers.AutoConfig.for_model(family, **fields)
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"{name}: expected a model_type transformers {transformers.__version__} knows; got "
                f"{family!r} ({str(error).splitlines()[0][:120]})"
            ) from None
        except (TypeError, AttributeError) as error:
            raise ValueError(
                f"{name}: transformers {transformers.__version__} cannot read this {family} config "
                f"({type(error).__name__}: {str(error).splitlines()[0][:120]})"
            ) from None
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
    hidden = _attr(built, "hidden_size", "n_embd", "d_model")
    heads = _attr(built, "num_attention_heads", "n_head")
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
        shapes = (_llama_like(counted),) * layers
        note = (
            f"no formula for {family}: activations estimated as for a Llama-like layer of the "
            "same widths"
        )
    return replace(counted, layer_shapes=shapes, notes=(note,))


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
