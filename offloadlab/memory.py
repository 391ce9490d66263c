"""The memory wall: how many bytes of training state a model holds.

Pure arithmetic (no torch needed) for recipes, transformer parameter counts and
activation estimates, plus :func:`measure_state`, which counts the bytes a real
torch model and optimizer hold so the arithmetic can be checked against reality.
All sizes are in bytes; "GB" means 10**9 bytes and "GiB" 2**30, as in :mod:`offloadlab.units`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from dataclasses import dataclass, field

from .units import check_integer, check_non_negative, parse_count

__all__ = [
    "Recipe",
    "RECIPES",
    "DEFAULT_RECIPE",
    "GPU_SIZES",
    "KINDS",
    "OPTIMIZER_KINDS",
    "StateBreakdown",
    "get_recipe",
    "state_bytes",
    "fitting_gpus",
    "transformer_params",
    "activation_bytes_per_layer",
    "measure_state",
]

# Kinds of persistent training state, in the order tables list them.
KINDS = (
    "weights",
    "gradients",
    "master_weights",
    "first_moment",
    "second_moment",
    "quantization_scales",
)
# The kinds only the optimizer's update reads and writes: what optimizer offload moves off the GPU.
OPTIMIZER_KINDS = ("master_weights", "first_moment", "second_moment", "quantization_scales")


@dataclass(frozen=True)
class Recipe:
    """A training recipe and the bytes per parameter each kind of state costs."""

    name: str
    description: str
    bytes_per_param: Mapping[str, float]  # read-only, as the recipe is

    def __post_init__(self):
        object.__setattr__(self, "bytes_per_param", MappingProxyType(dict(self.bytes_per_param)))

    @property
    def total(self) -> float:
        """Bytes of persistent state per parameter."""
        return sum(self.bytes_per_param.values())

    @property
    def weight_bytes(self) -> float:
        """Bytes per parameter of the weights the forward and backward passes read."""
        return self.bytes_per_param["weights"]

    @property
    def gradient_bytes(self) -> float:
        """Bytes per parameter of the gradient the backward pass produces."""
        return self.bytes_per_param["gradients"]

    @property
    def optimizer_bytes(self) -> float:
        """Bytes per parameter only the update touches: master weights, moments, scales."""
        return sum(b for k, b in self.bytes_per_param.items() if k in OPTIMIZER_KINDS)


# Block-wise 8-bit Adam keeps one fp32 absmax per block of each moment: 2048 values in the
# paper (Dettmers et al., 2022), the basis used here; bitsandbytes' kernels now use 256 (0.03 B
# a parameter of scales instead of 0.004).
_BLOCK = 2048
RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        r.name: r
        for r in (
            Recipe(
                "mixed-adam",
                "mixed-precision Adam: fp16/bf16 weights and gradients, fp32 master weights and "
                "moments",
                {
                    "weights": 2,
                    "gradients": 2,
                    "master_weights": 4,
                    "first_moment": 4,
                    "second_moment": 4,
                },
            ),
            Recipe(
                "mixed-adam-fp32-grads",
                "mixed precision with fp32 gradients (DeepSpeed's gradient partition, fp32 "
                "accumulation): 16-bit weights, fp32 gradients, master weights and moments",
                {
                    "weights": 2,
                    "gradients": 4,
                    "master_weights": 4,
                    "first_moment": 4,
                    "second_moment": 4,
                },
            ),
            Recipe(
                "fp32-adam",
                "full fp32 Adam: weights, gradients and both moments in fp32",
                {"weights": 4, "gradients": 4, "first_moment": 4, "second_moment": 4},
            ),
            Recipe(
                "bf16-adam",
                "pure bf16 Adam: weights, gradients and moments all in bf16, no master copy",
                {"weights": 2, "gradients": 2, "first_moment": 2, "second_moment": 2},
            ),
            Recipe(
                "sgd-momentum",
                "fp32 SGD with momentum: weights, gradients and one momentum buffer",
                {"weights": 4, "gradients": 4, "first_moment": 4},
            ),
            Recipe(
                "adam-8bit",
                "mixed precision with block-wise 8-bit Adam moments "
                "(one fp32 scale per 2048 values)",
                {
                    "weights": 2,
                    "gradients": 2,
                    "master_weights": 4,
                    "first_moment": 1,
                    "second_moment": 1,
                    "quantization_scales": 2 * 4 / _BLOCK,
                },
            ),
        )
    }
)
DEFAULT_RECIPE = "mixed-adam"

_MiB = 2**20
# Memory of common training cards as the card reports it (torch.cuda.get_device_properties(i)
# .total_memory), in bytes, keyed by the size the vendor names. An "80 GB" card carries 80 GiB of
# HBM, of which the driver keeps some back: it reports about 79.2 GiB, 85.0e9 bytes. Figures are
# from the cards named, with ECC on; drivers move them by a few hundred MiB.
GPU_SIZES = MappingProxyType(
    {
        "24 GB": 25_393_692_672,  # GeForce RTX 4090: 23.65 GiB (nvidia-smi shows 24,564 MiB)
        "40 GB": 42_298_834_944,  # A100-SXM4-40GB: 39.39 GiB
        "80 GB": 81_049 * _MiB,  # A100 80GB PCIe: 79.15 GiB (H100 80GB HBM3: 81,090 MiB)
        "141 GB": 143_156 * _MiB,  # H200: 139.8 GiB
    }
)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ValueError listing the known names otherwise."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}; got {name!r}") from None


@dataclass(frozen=True)
class StateBreakdown:
    """Bytes of persistent state for ``params`` parameters under one recipe."""

    params: float
    recipe: str
    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return sum(self.by_kind.values())

    def to_dict(self) -> dict:
        return {
            # a count, not 7e9.0
            "params": int(self.params) if float(self.params).is_integer() else self.params,
            "recipe": self.recipe,
            "bytes_per_param": get_recipe(self.recipe).bytes_per_param,
            "by_kind_bytes": self.by_kind,
            "total_bytes": self.total_bytes,
            "fits": {name: self.total_bytes <= size for name, size in GPU_SIZES.items()},
            "gpu_reported_bytes": dict(GPU_SIZES),
        }


def state_bytes(params, recipe: str = DEFAULT_RECIPE) -> StateBreakdown:
    """The persistent training state of a ``params``-parameter model, by kind, in bytes."""
    count = parse_count(params, "params")
    chosen = get_recipe(recipe)
    return StateBreakdown(
        count, chosen.name, {k: b * count for k, b in chosen.bytes_per_param.items()}
    )


def fitting_gpus(total_bytes: float) -> list[str]:
    """Names of the common GPU sizes whose reported memory holds ``total_bytes``."""
    return [name for name, size in GPU_SIZES.items() if total_bytes <= size]


def transformer_params(
    layers: int,
    hidden: int,
    vocab: int,
    *,
    mlp_ratio: float = 4,
    positions: int = 0,
    tied_embeddings: bool = True,
    bias: bool = True,
) -> int:
    """Parameters of a GPT-style decoder (pre-norm, LayerNorm with bias, GELU MLP).

    Per layer: attention Q, K, V and output projections (4 h² weights, 4 h biases),
    an MLP of width ``mlp_ratio`` × h (2 r h² weights, r h + h biases) and two
    LayerNorms (4 h). Plus the token embedding (V h), learned position embedding
    (``positions`` × h), the final LayerNorm (2 h) and, unless tied, the output head (V h).
    The count does not depend on the number of heads.
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab)):
        check_integer(value, name)
    check_non_negative(positions, "positions")
    ratio = float(mlp_ratio)
    if not ratio > 0 or ratio * hidden != int(ratio * hidden):
        raise ValueError(
            "mlp_ratio: expected a positive number with mlp_ratio × hidden whole; got "
            f"{mlp_ratio!r}"
        )
    width = int(ratio * hidden)
    attention = 4 * hidden * hidden + (4 * hidden if bias else 0)
    mlp = 2 * width * hidden + ((width + hidden) if bias else 0)
    norms = 2 * (2 * hidden if bias else hidden)
    per_layer = attention + mlp + norms
    embeddings = vocab * hidden + int(positions) * hidden
    head = 0 if tied_embeddings else vocab * hidden
    final_norm = 2 * hidden if bias else hidden
    return layers * per_layer + embeddings + final_norm + head


def activation_bytes_per_layer(
    batch: int, seq: int, hidden: int, heads: int, recompute: str = "none"
) -> float:
    """Activation memory of one transformer layer in bytes, with 16-bit activations.

    From Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models" (2022), without tensor or sequence parallelism:

    - ``"none"``: s·b·h·(34 + 5·a·s/h) — every intermediate kept, including the
      a·s² attention scores, softmax and dropout mask;
    - ``"selective"``: 34·s·b·h — the attention-score tensors recomputed;
    - ``"full"``: 2·s·b·h — only the layer's input kept, everything else recomputed.
    """
    for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads)):
        check_integer(value, name)
    sbh = seq * batch * hidden
    if recompute == "none":
        return sbh * (34 + 5 * heads * seq / hidden)
    if recompute == "selective":
        return 34.0 * sbh
    if recompute == "full":
        return 2.0 * sbh
    raise ValueError(f"recompute: expected 'none', 'selective' or 'full'; got {recompute!r}")


# Optimizer state keys of torch and offloadlab optimizers, by kind of state.
_STATE_KEY_KIND = {
    "exp_avg": "first_moment",
    "momentum_buffer": "first_moment",
    "exp_avg_sq": "second_moment",
    "max_exp_avg_sq": "second_moment",
    "master": "master_weights",
    "master_weights": "master_weights",
}


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def measure_state(model, optimizer=None) -> dict[str, int]:
    """Bytes the model and optimizer really hold, by kind of state.

    ``weights`` and ``gradients`` are the model's parameters and their ``.grad``;
    tensors the optimizer updates that are not the model's own parameters (a
    hand-made fp32 master copy) count as ``master_weights``, with their gradients as
    ``master_gradients``; optimizer state is sorted by key (``exp_avg`` → first
    moment, …) and anything unrecognised, such as step counters, goes to ``other``.
    Tensors that share storage are counted once.
    """
    seen: set[tuple] = set()
    totals: dict[str, int] = {}

    def add(kind: str, tensor) -> None:
        if tensor is None:
            return
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.numel(),
        )
        if key in seen:
            return
        seen.add(key)
        totals[kind] = totals.get(kind, 0) + _tensor_bytes(tensor)

    model_params = list(model.parameters())
    for p in model_params:
        add("weights", p)
        add("gradients", p.grad)
    if optimizer is not None:
        own = {id(p) for p in model_params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    add("master_weights", p)
                    add("master_gradients", p.grad)
        import torch

        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(_STATE_KEY_KIND.get(key, "other"), value)
    return totals
