"""What is trained and on what: the :class:`Workload` (model and step) and the :class:`Hardware`.

A workload is a parameter count, or a real model's :class:`~offloadlab.architectures.Architecture`,
with a micro-batch and a sequence length. It knows the activations a step keeps on the GPU
(:meth:`Workload.activations`) and the compute a step does. The hardware is a GPU's memory, its
host link, host memory, the CPU-Adam rate and the compute rate, and for a node its GPU count and
interconnect. Units: bytes, bytes/s, seconds, FLOP/s, parameters/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..architectures import Architecture, LayerShape
from ..units import (
    check_integer,
    check_positive,
    format_bandwidth,
    format_size,
    is_integer,
    is_number,
    parse_bandwidth,
    parse_count,
    parse_flops,
    parse_size,
)

__all__ = [
    "Workload",
    "Hardware",
    "Activations",
    "typical_shape",
    "ATTENTIONS",
    "ASSUMED_COMPUTE",
    "ASSUMED_CPU_ADAM",
    "ASSUMED_INTERCONNECT",
    "ASSUMED_NETWORK",
    "ASSUMED_NVME",
    "ASSUMED_VOCAB",
    "WORKSPACE_FRACTION",
    "HOST_RESERVE_FRACTION",
    "BYTES_MOVED_PER_ADAM_PARAM",
]

# Used only when the reader gives no measurement; every report names them as assumptions.
ASSUMED_COMPUTE = 200e12  # FLOP/s a modern training GPU sustains on bf16 matrix products
ASSUMED_CPU_ADAM = 100e9 / 28  # params/s: 100 GB/s of host memory at 28 B moved per parameter
# bytes/s each way per GPU: NVLink inside a node, from the book's link table
ASSUMED_INTERCONNECT = 450e9
# B/s each way per GPU between nodes: one 400 Gb/s NIC (InfiniBand NDR) per GPU, rail-optimized
ASSUMED_NETWORK = 50e9
# Sustained bytes/s of a data-centre NVMe drive, the lower of read and write (writes sustain less
# than the 7 GB/s read figure drives are sold on; chapter 8): used only to say what the next tier
# would give when nothing fits in host memory and no drive was given.
ASSUMED_NVME = 2e9
ASSUMED_VOCAB = 50257  # GPT-2's vocabulary, for the logits of a model known only by its size
WORKSPACE_FRACTION = 0.10  # of GPU memory kept back for the framework, kernels and fragmentation
# Of host memory kept back (an assumption, as the GPU's workspace is): the OS and page cache, each
# rank's Python and CUDA context, data-loader workers. A plan whose state fills host memory exactly
# does not fit.
HOST_RESERVE_FRACTION = 0.10
BYTES_MOVED_PER_ADAM_PARAM = 28  # host bytes one fused AdamW update reads and writes per parameter
ATTENTIONS = ("sdpa", "eager")
# The smallest GPU memory and host link taken as meant when given as a bare Python number of bytes
# (or B/s): below them the number was surely meant in GB or GB/s.
_SMALLEST_BARE_BYTES = 2**20
MAX_NODES = 100_000


@dataclass(frozen=True)
class Activations:
    """A step's activation memory on one GPU at its peak (bytes), by term.

    ``layers``: what the decoder layers keep for backward (a checkpointed layer keeps its input
    only). ``logits``: the loss's fp32 log-probabilities, their gradient and the logits' gradient
    in fp32, and the logits in the compute dtype, all alive as backward starts. ``rebuilt``: one
    checkpointed layer's activations while backward recomputes it (after the logits are gone).
    ``other``: the final norm, the rotary tables, the token ids.
    """

    layers: float
    logits: float
    rebuilt: float
    other: float

    @property
    def total(self) -> float:
        return self.layers + max(self.logits, self.rebuilt) + self.other

    def terms(self) -> dict[str, float]:
        return {
            "activations of the layers": self.layers + self.rebuilt,
            "logits and loss": self.logits,
        }


@dataclass(frozen=True)
class Workload:
    """The model and the step: parameters, optional transformer shape, batch and sequence.

    ``attention`` is how attention runs: 'sdpa' (PyTorch's scaled-dot-product attention, flash or
    memory-efficient, transformers' default: no seq × seq tensor is kept) or 'eager' (the scores and
    probabilities are kept, seq² per head). ``vocab`` sizes the logits of a model given by its shape
    (a real model's architecture has its own; without either, GPT-2's 50,257 is assumed).
    """

    params: float
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    batch: int = 1
    seq: int = 2048
    architecture: Architecture | None = None
    attention: str = "sdpa"
    vocab: int | None = None
    # GPUs that split each sequence (context parallelism, ring attention): each keeps and
    # computes seq / context of its tokens, attending over the whole sequence
    context: int = 1
    shape_assumed: bool = field(default=False, init=False)

    @classmethod
    def of_model(
        cls, architecture: Architecture, batch: int = 1, seq: int = 2048, attention: str = "sdpa"
    ) -> "Workload":
        """A workload of a real model's exact parameter count and shape (see
        :mod:`offloadlab.architectures`)."""
        return cls(
            architecture.params,
            architecture.layers,
            architecture.hidden,
            architecture.heads,
            batch,
            seq,
            architecture,
            attention,
        )

    def __post_init__(self):
        object.__setattr__(self, "params", parse_count(self.params, "params"))
        for name in ("batch", "seq", "context"):
            check_integer(getattr(self, name), name)
        if self.seq % self.context:
            raise ValueError(
                f"context: expected a divisor of seq={self.seq} (each GPU an equal share of the "
                f"sequence); got {self.context}"
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention: expected one of {', '.join(ATTENTIONS)}; got {self.attention!r}"
            )
        if self.architecture is not None:
            object.__setattr__(self, "vocab", self.architecture.vocab)
        elif self.vocab is None:
            object.__setattr__(self, "vocab", ASSUMED_VOCAB)
        else:
            check_integer(self.vocab, "vocab")
        shape = (self.layers, self.hidden, self.heads)
        if all(v is None for v in shape):
            object.__setattr__(self, "shape_assumed", True)
            for name, value in zip(("layers", "hidden", "heads"), typical_shape(self.params)):
                object.__setattr__(self, name, value)
        elif not all(is_integer(v) and v > 0 for v in shape):
            raise ValueError(
                f"layers: expected layers, hidden and heads given together as positive integers; "
                f"got {shape}"
            )
        elif self.hidden % self.heads:
            raise ValueError(
                f"heads: expected a divisor of hidden={self.hidden} (each head gets an equal "
                f"slice); got {self.heads}"
            )
        elif self.layers > MAX_LAYERS:  # (each layer is laid out, one by one)
            raise ValueError(
                f"layers: expected at most {MAX_LAYERS:,} layers (the deepest models have a few "
                f"hundred); got {self.layers:,}"
            )
        elif 12 * self.layers * self.hidden**2 > 10 * self.params:
            raise ValueError(
                f"layers, hidden: {self.layers:,} layers of width {self.hidden:,} hold about "
                f"{12 * self.layers * self.hidden**2:.3g} parameters (12·L·h²), more than ten "
                f"times the {self.params:.3g} given; check the shape or the count"
            )

    @property
    def tokens(self) -> int:
        """Tokens one GPU computes a micro-batch: its share of each sequence."""
        return self.batch * self.seq // self.context

    def context_bytes(self, recompute=False, element: int = 2) -> float:
        """Bytes one GPU receives a step from the others of its context group (ring attention):
        in forward, and again for each recomputed layer, the keys and values of the (c−1)/c of
        the sequence it does not hold; in backward those again and their gradients."""
        if self.context == 1:
            return 0.0
        k = self.checkpointed(recompute)
        kv = [2 * shape.k_width * element for shape in self.layer_shapes()]
        passes = 3 * sum(kv) + sum(kv[:k])
        return passes * self.batch * self.seq * (self.context - 1) / self.context

    @property
    def active_params(self) -> float:
        """Parameters each token passes through: for a mixture of experts, only its routed
        experts'."""
        return self.architecture.active_params if self.architecture else self.params

    def layer_shapes(self) -> tuple[LayerShape, ...]:
        """Each layer's computation: the real model's, or a GPT-like layer (LayerNorm, 4 h GELU
        MLP)."""
        if self.architecture is not None and self.architecture.layer_shapes:
            return self.architecture.layer_shapes
        h = self.hidden
        return (LayerShape(h, 2, "layer", h, h, h, h, self.heads, 4 * h, False),) * self.layers

    def checkpointed(self, recompute) -> int:
        """How many layers ``recompute`` checkpoints: True is every layer, False none, an int
        that many."""
        if recompute is True:
            return self.layers
        if recompute is False or recompute is None:
            return 0
        if isinstance(recompute, int) and 0 <= recompute <= self.layers:
            return recompute
        raise ValueError(
            f"recompute: expected True, False or a number of layers from 0 to {self.layers}; "
            f"got {recompute!r}"
        )

    def activations(self, recompute=False, element: int = 2) -> Activations:
        """Activation memory of one step on one GPU, at its peak, with ``element``-byte activations.

        ``recompute`` checkpoints the first that many layers (True: all): each keeps only its input
        and is rebuilt, one at a time, in backward. See :meth:`LayerShape.kept_bytes` for what a
        layer keeps and :class:`Activations` for the rest.
        """
        k, tokens = self.checkpointed(recompute), self.tokens
        shapes = self.layer_shapes()
        per_token = [shape.kept_bytes(element, self.seq, self.attention) for shape in shapes]
        layers = sum(element * self.hidden if i < k else kept for i, kept in enumerate(per_token))
        rebuilt = max(per_token[:k], default=0.0)
        logits = (4 + 8 + element) * self.vocab
        head_dim = self.architecture.head_dim if self.architecture else self.hidden // self.heads
        other = 4 * self.hidden + 2 * element * self.hidden + 2 * element * head_dim + 16
        return Activations(layers * tokens, logits * tokens, rebuilt * tokens, other * tokens)

    def activation_bytes(self, recompute=False, element: int = 2) -> float:
        """Activation memory of the whole model at its peak (see :meth:`activations`)."""
        return self.activations(recompute, element).total

    def pass_flops(self, recompute=False) -> tuple[float, float]:
        """FLOPs of one step's (forward, backward with its recomputation).

        Forward: 2 per parameter a token is multiplied by (its routed experts', the head's; not an
        embedding it looks up) and causal attention's products over the sequence
        (:meth:`LayerShape.attention_flops`); backward twice that, and once more the forward of
        each recomputed layer.
        """
        k = self.checkpointed(recompute)
        attention = [
            shape.attention_flops(self.seq, self.attention) for shape in self.layer_shapes()
        ]
        multiplied = self.active_params - (
            self.architecture.lookup_params if self.architecture else 0
        )
        forward = 2 * multiplied + sum(attention)
        again = 2 * multiplied * k / self.layers + sum(attention[:k])
        return forward * self.tokens, (2 * forward + again) * self.tokens

    def compute_flops(self, recompute=False) -> float:
        """FLOPs of one step (:meth:`pass_flops`, both passes)."""
        return sum(self.pass_flops(recompute))

    def layer_params(self) -> float:
        """Parameters of one transformer layer: exact (the largest) for a real model, else an
        equal share."""
        return self.architecture.layer_params if self.architecture else self.params / self.layers

    def root_params(self) -> float:
        """Parameters outside the layers (embeddings, final norm, head): 0 when only a count is
        known."""
        return self.architecture.root_params if self.architecture else 0.0

    def largest_module_params(self) -> float:
        """The largest single module (ZeRO-3 gathers one at a time): exact for a real model, else a
        layer's MLP input projection, 4 h² of the GPT-like shape."""
        return self.architecture.largest_module_params if self.architecture else 4 * self.hidden**2

    def largest_weight_params(self) -> float:
        """The largest single tensor: exact for a real model, else the larger of the assumed
        vocabulary's embedding and a 4 h² projection."""
        if self.architecture:
            return self.architecture.largest_weight_params
        return max(self.vocab * self.hidden, 4 * self.hidden**2)

    def weight_shapes(self) -> list[tuple[int, ...]] | None:
        """Every distinct weight tensor's shape (a real model), else None."""
        if self.architecture is None:
            return None
        return [w.shape for w in self.architecture.weights if not w.tied]


def usable_host(host_memory: float) -> float:
    """Of ``host_memory`` bytes, what a plan's state may fill."""
    return host_memory * (1 - HOST_RESERVE_FRACTION)


MAX_LAYERS = 100_000


def typical_shape(params: float) -> tuple[int, int, int]:
    """A GPT-like (layers, hidden, heads) for ``params``: P ≈ 12·L·h² with h ≈ 128·L, heads of 128.

    The aspect ratio of GPT-3 175B (96 layers, h = 12,288); used only when no shape is given.
    """
    layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    hidden = max(128, round((params / (12 * layers)) ** 0.5 / 128) * 128)
    return layers, hidden, hidden // 128


def _memory(value, name: str) -> float:
    size = parse_size(value, name)
    if not isinstance(value, str) and size < _SMALLEST_BARE_BYTES:
        raise ValueError(
            f"{name}: expected bytes; got {value!r}, which is {format_size(size)}: did you mean "
            f"'{value:g} GB'?"
        )
    return size


def _rate(value, name: str) -> float:
    rate = parse_bandwidth(value, name)
    if not isinstance(value, str) and rate < _SMALLEST_BARE_BYTES:
        raise ValueError(
            f"{name}: expected bytes per second; got {value!r}, which is {format_bandwidth(rate)}: "
            f"did you mean '{value:g} GB/s'?"
        )
    return rate


@dataclass(frozen=True)
class Hardware:
    """The machine: GPU memory, link, host memory, CPU-Adam and compute rates (None = assumed).

    Sizes and rates are strings with their units ('80 GB', '25 GB/s') or Python numbers of bytes
    and bytes/s; a number too small to be a GPU's memory or a link (under 1 MiB, 1 MiB/s) is
    refused as a slip for gigabytes. ``host_memory`` is the node's.
    """

    gpu_memory: float
    link: float
    host_memory: float | None = None
    cpu_adam: float | None = None
    compute: float | None = None
    comm_fraction: float = 0.0
    gpus_per_node: int = 1
    interconnect: float | None = None
    gpus_per_link: int = 1
    # sustained NVMe bandwidth (the lower of read and write); None: no NVMe tier
    nvme: float | None = None
    sources: tuple[str, ...] = ()
    # nodes of gpus_per_node GPUs each, and the network between them (B/s each way per GPU)
    nodes: int = 1
    network: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "gpu_memory", _memory(self.gpu_memory, "gpu_memory"))
        object.__setattr__(self, "link", _rate(self.link, "link"))
        if self.host_memory is not None:
            object.__setattr__(self, "host_memory", _memory(self.host_memory, "host_memory"))
        if self.cpu_adam is not None:
            object.__setattr__(self, "cpu_adam", check_positive(self.cpu_adam, "cpu_adam"))
        if self.compute is not None:
            object.__setattr__(self, "compute", parse_flops(self.compute, "compute"))
        if not (isinstance(self.comm_fraction, (int, float)) and 0 <= self.comm_fraction < 1):
            raise ValueError(
                f"comm_fraction: expected a fraction in [0, 1); got {self.comm_fraction!r}"
            )
        for name in ("gpus_per_node", "gpus_per_link"):
            check_integer(getattr(self, name), name)
        if self.gpus_per_node % self.gpus_per_link:
            raise ValueError(
                f"gpus_per_link: expected a divisor of gpus_per_node={self.gpus_per_node} (GPUs "
                f"share links in equal groups); got {self.gpus_per_link}"
            )
        if self.interconnect is not None:
            object.__setattr__(self, "interconnect", _rate(self.interconnect, "interconnect"))
        if self.nvme is not None:
            object.__setattr__(self, "nvme", _rate(self.nvme, "nvme"))
        check_integer(self.nodes, "nodes", high=MAX_NODES)
        if self.network is not None:
            if self.nodes == 1:
                raise ValueError("network: the link between nodes; give it with nodes above 1")
            object.__setattr__(self, "network", _rate(self.network, "network"))

    @property
    def gpus(self) -> int:
        """GPUs in all: every node's."""
        return self.nodes * self.gpus_per_node

    @property
    def collective_rate(self) -> float:
        """B/s each way per GPU that a collective over every GPU runs at: the interconnect within
        a node, and across nodes the slower of it and the network (a ring runs at its slowest
        hop)."""
        within = self.interconnect or ASSUMED_INTERCONNECT
        if self.nodes == 1:
            return within
        return min(within, self.network or ASSUMED_NETWORK)

    def share(self) -> "Hardware":
        """What one GPU of the node gets when every GPU trains at once: an Nth of host memory and of
        the CPU-Adam throughput (the cores and their memory bandwidth), and its link divided among
        the GPUs that share it. On a one-GPU node, the machine itself."""
        n = self.gpus_per_node
        if n == 1 and self.gpus_per_link == 1:
            return self
        return self._derived(
            gpu_memory=self.gpu_memory,
            link=self.link / self.gpus_per_link,
            host_memory=None if self.host_memory is None else self.host_memory / n,
            cpu_adam=(self.cpu_adam or ASSUMED_CPU_ADAM) / n,
            compute=self.compute,
            comm_fraction=self.comm_fraction,
        )

    def replaced(self, **changes) -> "Hardware":
        """This hardware with ``changes`` (figures already in bytes, bytes/s), not read again."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return self._derived(**{**values, **changes})

    @classmethod
    def _derived(cls, **values) -> "Hardware":
        """A Hardware of figures already checked (a share of this one): no second reading of
        them."""
        hardware = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(hardware, f.name, values.get(f.name, f.default))
        return hardware

    @property
    def usable_gpu_memory(self) -> float:
        return self.gpu_memory * (1 - WORKSPACE_FRACTION)

    @property
    def usable_host_memory(self) -> float | None:
        """Host memory a plan may fill, bytes: the node's less ``HOST_RESERVE_FRACTION``."""
        return None if self.host_memory is None else usable_host(self.host_memory)

    @classmethod
    def from_probe(cls, record: dict, **given) -> "Hardware":
        """Hardware from an ``offloadlab probe --json`` record; values in ``given`` (not None) win.

        Taken from the record: GPU memory (the accelerator's reported capacity), host memory, the
        host → GPU link (the α–β fit of the pinned sweep) and a CPU-Adam rate derived from the
        measured host memory bandwidth at 28 bytes moved per parameter. ``sources`` says where each
        came from; an emulated link (a machine without a GPU) is labelled so.
        """
        try:
            machine, ladder = record["machine"], record["ladder"]
            links = {row["name"]: row for row in ladder["links"]}
            tiers = {row["name"]: row for row in ladder["tiers"]}
            if not isinstance(machine, dict) or not all(
                isinstance(r, dict) for r in (*links.values(), *tiers.values())
            ):
                raise TypeError
        except (KeyError, TypeError, AttributeError):
            raise ValueError(
                "measured: expected an `offloadlab probe --json` record with 'machine' and "
                "'ladder'; got something else"
            ) from None
        values, sources = {}, {}

        def number(value, what: str, low: float, high: float) -> float:
            """A figure of the record, refused unless a number in [low, high] (a damaged or
            hand-edited file)."""
            if not is_number(value) or not low <= value <= high:
                raise ValueError(
                    f"measured: expected {what} between {low:g} and {high:g} in the record; got "
                    f"{value!r}"
                )
            return float(value)

        up = links.get("host → GPU")
        if up and up.get("bandwidth_bytes_per_s") is not None:
            values["link"] = number(
                up["bandwidth_bytes_per_s"], "the host → GPU bandwidth (B/s)", 1, 1e15
            )
            source = up.get("source")
            if not isinstance(source, str):
                raise ValueError(
                    "measured: expected the host → GPU link's 'source' (measured, emulated …) in "
                    f"the record; got {source!r}"
                )
            sources["link"] = (
                f"link {format_bandwidth(values['link'])} ({source}: α–β fit of the probe's sweep)"
            )
        accelerator = machine.get("accelerator") or {}
        if not isinstance(accelerator, dict):
            raise ValueError(
                "measured: expected the record's 'accelerator' to be an object with "
                f"'memory_bytes'; got {accelerator!r}"
            )
        gpu = accelerator.get("memory_bytes")
        if gpu is not None:
            values["gpu_memory"] = gpu = number(gpu, "the GPU memory (bytes)", 1, 1e18)
            sources["gpu_memory"] = f"GPU memory {format_size(gpu)} (as the card reports it)"
        if machine.get("host_memory_bytes") is not None:
            values["host_memory"] = number(
                machine["host_memory_bytes"], "the host memory (bytes)", 1, 1e18
            )
            sources["host_memory"] = (
                f"host memory {format_size(values['host_memory'])} (the probed machine's)"
            )
        host = tiers.get("host memory") or {}
        if host.get("bandwidth_bytes_per_s") is not None:
            values["cpu_adam"] = (
                number(host["bandwidth_bytes_per_s"], "the host memory bandwidth (B/s)", 1, 1e15)
                / BYTES_MOVED_PER_ADAM_PARAM
            )
            sources["cpu_adam"] = (
                f"CPU Adam {values['cpu_adam'] / 1e9:.2f} G params/s (derived: measured host "
                f"memory bandwidth ÷ {BYTES_MOVED_PER_ADAM_PARAM} B per parameter)"
            )
        for name, value in given.items():
            if value is not None:
                values[name] = value
                sources.pop(name, None)  # given explicitly: not from the record
        for name in ("gpu_memory", "link"):
            if name not in values:
                raise ValueError(
                    f"measured: the record has no {name.replace('_', ' ')}; "
                    f"pass --{name.replace('_', '-')}"
                )
        # a record's figures are bytes, whatever their size
        for name in ("gpu_memory", "host_memory", "link"):
            if name in values and not isinstance(values[name], str):
                values[name] = f"{values[name]!r} {'B/s' if name == 'link' else 'B'}"
        return cls(**values, sources=tuple(sources.values()))

    @property
    def assumptions(self) -> list[str]:
        """What the plan assumed because it was not given."""
        said = []
        if self.compute is None:
            said.append(
                f"compute {ASSUMED_COMPUTE / 1e12:.0f} TFLOP/s (assumed; measure yours or pass "
                "--compute)"
            )
        if self.cpu_adam is None:
            said.append(
                f"CPU Adam {ASSUMED_CPU_ADAM / 1e9:.1f} G params/s (assumed; pass --cpu-adam)"
            )
        if self.host_memory is None:
            said.append("host memory unlimited (not given)")
        if self.gpus_per_node > 1 and self.interconnect is None:
            said.append(
                f"interconnect {format_bandwidth(ASSUMED_INTERCONNECT)} each way per GPU (assumed: "
                f"NVLink; pass --interconnect)"
            )
        if self.nodes > 1 and self.network is None:
            said.append(
                f"network {format_bandwidth(ASSUMED_NETWORK)} each way per GPU between nodes "
                "(assumed: a 400 Gb/s NIC per GPU; pass --network)"
            )
        return said
