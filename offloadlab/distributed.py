"""Sharded training on several processes, with the bytes of every collective counted.

:func:`launch` starts ``torchrun`` with N processes that each run :func:`main`: run the FSDP2 script
that :func:`offloadlab.engines.fsdp_snippet` emits, with TinyGPT built in it (on the meta device,
then sharded and filled with the weights of the single-process reference), and train a few
steps on each rank's share of one global batch. Every all-gather, reduce-scatter and
all-reduce the training makes passes through :class:`CollectiveCounter`, which records the size
and dtype of the tensor each call gathers or reduces. The processes talk over gloo on the CPU
and NCCL on GPUs. :func:`reference_losses` trains the same model on one process with AdamW.

A collective's *tensor* bytes are counted from the calls; the bytes each rank *sends* follow from
the ring algorithm, (N−1)/N of them (:func:`offloadlab.sharding.ring_bytes`). Units: bytes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from . import engines
from .models import GPTConfig, TinyGPT, batches, markov_corpus

__all__ = ["CollectiveCounter", "LAB_CONFIG", "launch", "reference_losses", "main"]

LAB_CONFIG = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32)
GLOBAL_BATCH = 8
_OPTIMIZER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class CollectiveCounter:
    """Counts what each collective carries: ``calls[kind]`` and ``tensor_bytes[kind]``.

    ``kind`` is 'all-gather', 'reduce-scatter' or 'all-reduce'. For an all-gather the tensor is
    the gathered output, for a reduce-scatter the unreduced input, for an all-reduce the tensor
    itself. Use as a context manager around the training; it wraps every ``torch.distributed``
    entry point of each kind that exists in this torch (FSDP2 calls ``all_gather_single`` and
    ``reduce_scatter_single`` in recent versions, ``*_into_tensor``/``*_tensor`` in older ones).
    """

    # entry point: (kind, the argument holding the full tensor)
    _WRAPPED = {
        "all_gather_single": ("all-gather", "output_tensor"),
        "all_gather_into_tensor": ("all-gather", "output_tensor"),
        "reduce_scatter_single": ("reduce-scatter", "input"),
        "reduce_scatter_tensor": ("reduce-scatter", "input"),
        "all_reduce": ("all-reduce", "tensor"),
    }

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.tensor_bytes: dict[str, int] = {}
        self._originals: dict = {}

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.tensor_bytes[kind] = (
            self.tensor_bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
        )

    def __enter__(self):
        for name, (kind, argument) in self._WRAPPED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)
            self._originals[name] = original

            def counted(
                *args,
                _original=original,
                _kind=kind,
                _argument=argument,
                _signature=signature,
                **kwargs,
            ):
                self._record(_kind, _signature.bind(*args, **kwargs).arguments[_argument])
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()


def _train(model, optimizer, data, steps: int, rank: int, world: int, device="cpu") -> list[float]:
    """Train ``steps`` steps; each rank takes rows rank, rank + world, … of one global batch."""
    losses = []
    for _ in range(steps):
        inputs, targets = next(data)
        loss = model(inputs[rank::world].to(device), targets[rank::world].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return losses


def reference_losses(steps: int, seed: int = 0) -> list[float]:
    """The same model, data and AdamW on one process in fp32: the losses the sharded runs should
    follow."""
    torch.manual_seed(seed)
    model = TinyGPT(LAB_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), **_OPTIMIZER)
    data = batches(markov_corpus(LAB_CONFIG.vocab, 20_000), GLOBAL_BATCH, LAB_CONFIG.seq, seed=1)
    return [float(loss) for loss in _train(model, optimizer, data, steps, 0, 1)]


def counted(model: TinyGPT) -> TinyGPT:
    """``model`` with its first block's forward calls counted (in ``model.block_forward_calls``).

    Recomputation calls a block's forward itself, not through the module's hooks, so the count
    shows whether backward rebuilt the activations."""
    model.block_forward_calls = 0
    forward = model.blocks[0].forward

    def counted_forward(*inputs, **kwargs):
        model.block_forward_calls += 1
        return forward(*inputs, **kwargs)

    model.blocks[0].forward = counted_forward
    return model


def load_reference(model) -> None:
    """Fill a sharded TinyGPT with the weights :func:`reference_losses` starts from (seed 0),
    from the full state dict every rank builds for itself."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    full = TinyGPT(LAB_CONFIG).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def main(argv: list[str] | None = None) -> None:
    """One rank of a sharded run (started by torchrun): train, count, and write JSON from rank 0."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--offload", choices=["none", "optimizer", "optimizer+parameters"], default="none"
    )
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The emitted script as a user runs it, with TinyGPT built in place of a transformers model: it
    # sets the device, starts the process group, builds on the meta device, shards and fills.
    setup = engines.Setup(
        "fsdp2",
        args.offload,
        args.recompute,
        world,
        micro_batch=GLOBAL_BATCH // world,
        blocks="model.blocks",
        seq=LAB_CONFIG.seq,
        clipping=0.0,
        imports="from offloadlab.distributed import LAB_CONFIG, counted, load_reference\n"
        "from offloadlab.models import TinyGPT",
        build="counted(TinyGPT(LAB_CONFIG))",
        initialise="load_reference(model)",
        **_OPTIMIZER,
    )
    snippet = engines.fsdp_snippet(setup)
    scope = {"__name__": "emitted_fsdp2_script"}  # its own training loop runs only as __main__
    exec(compile(snippet, "<emitted FSDP2 script>", "exec"), scope)
    rank, device, model = dist.get_rank(), scope["device"], scope["model"]
    try:
        data = batches(
            markov_corpus(LAB_CONFIG.vocab, 20_000), GLOBAL_BATCH, LAB_CONFIG.seq, seed=1
        )
        with CollectiveCounter() as counter:
            losses = _train(model, scope["optimizer"], data, args.steps, rank, world, device)
        mean = torch.stack(losses).to(device)
        dist.all_reduce(mean)  # outside the counter: the global loss is ours, not training's
        if rank == 0:
            result = {
                "world": world,
                "backend": dist.get_backend(),
                "offload": args.offload,
                "recompute": args.recompute,
                "steps": args.steps,
                "snippet": snippet,
                "losses": (mean / world).tolist(),
                "params": sum(p.numel() for p in TinyGPT(LAB_CONFIG).parameters()),
                "calls": counter.calls,
                "tensor_bytes": counter.tensor_bytes,
                "block_forward_calls": model.block_forward_calls,
            }
            Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def launch(
    offload: str = "none",
    recompute: bool = False,
    steps: int = 4,
    processes: int = 2,
    out: str | os.PathLike = "sharded.json",
    timeout: float = 300,
) -> dict:
    """Run :func:`main` on ``processes`` processes with torchrun and return rank 0's record."""
    if offload not in ("none", "optimizer", "optimizer+parameters"):
        raise ValueError(
            f"offload: expected 'none', 'optimizer' (offloadlab's CPUOffloadAdam on each shard) or "
            f"'optimizer+parameters' (FSDP2's CPUOffloadPolicy); got {offload!r}"
        )
    arguments = ["--offload", offload, "--steps", str(steps), "--out", str(out)]
    if recompute:
        arguments.append("--recompute")
    torchrun("offloadlab.distributed", arguments, processes, timeout)
    return json.loads(Path(out).read_text(encoding="utf-8"))


def torchrun(module: str, arguments: list[str], processes: int, timeout: float) -> None:
    """``torchrun`` ``module`` with ``arguments`` on ``processes`` processes of one thread each (two
    processes on two cores must not oversubscribe them), a GPU each or none (then on CPUs with
    gloo). RuntimeError with the ranks' own error lines if it fails."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        module,
        *arguments,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= processes):
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        ranks = [line for line in done.stderr.splitlines() if line.startswith("[rank")]
        detail = "\n".join(ranks[-40:]) or done.stderr[-3000:]
        raise RuntimeError(f"torchrun failed (exit {done.returncode}):\n{detail}")


if __name__ == "__main__":
    main()
