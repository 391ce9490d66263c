"""A compact GPT-style decoder whose size is set by a few numbers.

The chapters and labs use it as "a real small transformer": its parameter count is
exactly :func:`offloadlab.memory.transformer_params` of the same shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from . import _torch_compat  # (also loads what torch.optim would load lazily: see there)
from .memory import transformer_params
from .units import check_integer

__all__ = [
    "GPTConfig",
    "Block",
    "TinyGPT",
    "saved_activation_bytes",
    "saved_bytes_by_layer",
    "markov_corpus",
    "batches",
    "train",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`: layers, hidden size, heads, vocabulary, context."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 512
    seq: int = 128
    mlp_ratio: int = 4
    tied_embeddings: bool = True

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq", "mlp_ratio"):
            check_integer(getattr(self, name), name)
        if self.hidden % self.heads:
            raise ValueError(f"heads: expected a divisor of hidden={self.hidden}; got {self.heads}")

    @property
    def params(self) -> int:
        """Parameter count from the formula in :mod:`offloadlab.memory`."""
        return transformer_params(
            self.layers,
            self.hidden,
            self.vocab,
            mlp_ratio=self.mlp_ratio,
            positions=self.seq,
            tied_embeddings=self.tied_embeddings,
        )


class Block(nn.Module):
    """One pre-norm decoder layer: causal self-attention, then a GELU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, config.mlp_ratio * h)
        self.out = nn.Linear(config.mlp_ratio * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, ``layers`` blocks, a tied head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.hidden)
        self.positions = nn.Embedding(config.seq, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tied_embeddings:
            self.head.weight = self.tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for token ids ``idx`` (batch × seq); with ``targets``, the mean cross-entropy
        loss."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@functools.lru_cache(maxsize=32)  # (a few seconds for a large config: counted once per shape)
def saved_activation_bytes(
    config: GPTConfig, batch: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """Bytes autograd saves for backward in one forward of a TinyGPT (weights in ``dtype``) on
    ``batch`` sequences: every distinct storage it keeps, the model's own parameters excluded."""
    with torch.device("meta"):
        model = TinyGPT(config).to(dtype)
    tokens = torch.zeros(batch, config.seq, dtype=torch.long, device="meta")
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # one entry per storage, however many views of it
        saved[_torch_compat.storage_key(storage)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, tokens)
    weights = {_torch_compat.storage_key(p.untyped_storage()) for p in model.parameters()}
    return sum(n for key, n in saved.items() if key not in weights)


def markov_corpus(vocab: int, tokens: int, successors: int = 4, seed: int = 0) -> torch.Tensor:
    """A token stream from a random sparse bigram chain: each token has ``successors`` likely
    next tokens. Generated, never downloaded; a model that learns the chain drives its loss
    from ln(vocab) towards the chain's entropy (about ln(successors))."""
    for name, value in (("vocab", vocab), ("tokens", tokens), ("successors", successors)):
        check_integer(value, name)
    if successors > vocab:
        raise ValueError(f"successors: expected at most vocab={vocab}; got {successors}")
    generator = torch.Generator().manual_seed(seed)
    table = torch.stack(
        [torch.randperm(vocab, generator=generator)[:successors] for _ in range(vocab)]
    )
    choices = torch.randint(0, successors, (tokens,), generator=generator)
    stream = torch.empty(tokens, dtype=torch.long)
    token = 0
    for i in range(tokens):
        token = int(table[token, choices[i]])
        stream[i] = token
    return stream


def batches(corpus: torch.Tensor, batch: int, seq: int, seed: int = 0):
    """Endless (inputs, targets) pairs of shape batch × seq drawn from ``corpus``."""
    if corpus.numel() <= seq + 1:
        raise ValueError(
            f"seq: expected fewer than {corpus.numel() - 1} tokens for this corpus; got {seq}"
        )
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=generator)
        window = torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(
    model: nn.Module, optimizer, data, steps: int, device, accumulation: int = 1, scale_loss=None
) -> list[float]:
    """Train for ``steps`` optimizer steps of ``accumulation`` micro-batches; returns the losses.

    ``scale_loss`` (for fp16, e.g. ``CPUOffloadAdam.scale_loss``) multiplies each loss before
    backward.
    """
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(accumulation):
            inputs, targets = next(data)
            loss = model(inputs.to(device), targets.to(device)) / accumulation
            (scale_loss(loss) if scale_loss else loss).backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


# ------------------------------------------------- activations of a transformers model, measured


def saved_bytes_by_layer(built, layers_path: str, layers: int) -> tuple[list, str]:
    """Per decoder layer of transformers' config ``built`` (its list of layers at
    ``layers_path``), :attr:`~offloadlab.architectures.LayerShape.measured` for SDPA and eager
    attention, and the attention the model runs with SDPA asked for ('eager' where transformers
    has no SDPA for it).

    The model runs forward in bf16 on fake tensors (shapes and dtypes, no memory and no
    arithmetic: a 70 B model in about a second) under saved-tensor hooks; each storage saved for
    backward, parameters aside, counts once, in the layer that first saved it. Two sequence
    lengths tell the bytes a token keeps from those that grow with the sequence.
    """
    rows: list[list] = [[] for _ in range(layers)]
    sdpa = "sdpa"
    for attention in ("sdpa", "eager"):
        try:
            model = _fake_model(built, attention)
        except ValueError as error:
            if attention == "eager" or "scaled_dot_product_attention" not in str(error):
                raise
            sdpa = "eager"  # SDPA asked for, eager run (transformers refuses SDPA for it)
            continue
        short, long = (_saved_per_token(model, layers_path, layers, seq) for seq in _SEQS)
        for layer in range(layers):
            growth = [(b - a) / (_SEQS[1] - _SEQS[0]) for a, b in zip(short[layer], long[layer])]
            flat = [a - g * _SEQS[0] for a, g in zip(short[layer], growth)]
            rows[layer].append((attention, *flat, *growth))
    if sdpa == "eager":
        rows = [[("sdpa", *row[0][1:]), *row] for row in rows]
    return [tuple(row) for row in rows], sdpa


# The sequence lengths saved bytes are measured at (fake tensors: the cost is the same at any)
_SEQS = (32, 64)


def _fake_model(built, attention: str):
    """``built``'s model in bf16 with ``attention``, its parameters fake tensors on the CPU
    (ValueError where transformers has no such attention for it)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            built, attn_implementation=attention, dtype=torch.bfloat16
        )
    mode = _torch_compat.FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = model.to_empty(device="cpu")
    model.fake_mode = mode
    return model


def _saved_per_token(model, layers_path: str, layers: int, seq: int) -> list[tuple[float, float]]:
    """Per decoder layer, the bytes a forward over ``seq`` tokens saves for backward, per token:
    (in bf16, in other dtypes)."""
    current: list = [None]
    blocks = model.get_submodule(layers_path)
    hooks = []
    for index, block in enumerate(blocks):
        hooks.append(
            block.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i))
        )
        hooks.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    parameters = {_torch_compat.storage_key(p.untyped_storage()) for p in model.parameters()}
    saved: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = _torch_compat.storage_key(storage)
        if current[0] is not None and key not in parameters and key not in saved:
            saved[key] = (current[0], storage.nbytes(), tensor.dtype == torch.bfloat16)
        return tensor

    try:
        with model.fake_mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.zeros(1, seq, dtype=torch.long))
    finally:
        for hook in hooks:
            hook.remove()
    by_layer = [[0.0, 0.0] for _ in range(layers)]
    for layer, nbytes, compute in saved.values():
        by_layer[layer][0 if compute else 1] += nbytes / seq
    return [tuple(pair) for pair in by_layer]
