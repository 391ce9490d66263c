"""FSDP2 with the optimizer off the device, three ways, on N processes under torchrun.

Each rank of :func:`main` shards TinyGPT with ``fully_shard`` (one group per block and the root)
and trains it with one of :data:`OPTIMIZERS` on its share of one global batch: the state on the
device (torch's AdamW), FSDP2's own ``CPUOffloadPolicy`` (shards, gradients and torch's AdamW on
the CPU) or :class:`~offloadlab.offload.CPUOffloadAdam` on each rank's shard (at ``step()`` or
delayed). Rank 0 writes the losses, each rank's step times and link ledger, and the trained
weights. :func:`launch` starts it; the processes talk over gloo on CPUs and NCCL on GPUs.
Checkpoints go through ``torch.distributed.checkpoint`` (each rank saves its shards), so a run
may stop, and another resume it with any of the optimizers. Units: seconds, bytes.
"""

from __future__ import annotations

from types import MappingProxyType
import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from . import distributed
from .distributed import _OPTIMIZER, GLOBAL_BATCH, LAB_CONFIG, load_reference
from .models import TinyGPT, batches, markov_corpus
from .offload import CPUOffloadAdam
from .units import check_integer, check_positive

__all__ = ["OPTIMIZERS", "compare", "launch", "launch_compare", "main", "resume", "train"]

OPTIMIZERS = MappingProxyType(
    {
        "adamw": "FSDP2 + torch.optim.AdamW: the state on the device",
        "cpu-offload-policy": "FSDP2's CPUOffloadPolicy: shards, gradients and AdamW on the CPU",
        "offload": "FSDP2 + CPUOffloadAdam: each rank's shard updated on its CPU, at step()",
        "offload-delayed": "FSDP2 + CPUOffloadAdam(delayed_update=True): behind the next step",
    }
)

DEFAULT_STEPS = 4  # training steps a run takes unless told


def build(optimizer: str, bf16: bool, unused: bool, clip: float | None, device):
    """The sharded model (filled with the single-process reference's weights) and its
    optimizer.

    ``bf16``: computing in bf16, gradients reduced in bf16; torch's AdamW keeps fp32 shards and
    FSDP2 casts them for each gather, CPUOffloadAdam keeps bf16 shards on the device and the fp32
    master weights on the host (the same numbers: bf16 of the same fp32 master)."""
    with torch.device("meta"):
        model = TinyGPT(LAB_CONFIG)
        if unused:  # a parameter no forward uses: AdamW skips it, so must the offload
            model.unused = torch.nn.Linear(4, 3)
    offloaded = optimizer.startswith("offload")
    if bf16 and offloaded:
        model.to(torch.bfloat16)
    policy = {}
    if bf16 and not offloaded:
        policy["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        )
    if optimizer == "cpu-offload-policy":
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu" if optimizer == "cpu-offload-policy" else device)
    load_reference(model)
    if unused:
        with torch.no_grad():
            model.unused.weight.fill_(0.5)
            model.unused.bias.fill_(0.5)
    if offloaded:
        opt = CPUOffloadAdam(
            model.parameters(),
            **_OPTIMIZER,
            max_grad_norm=clip,
            delayed_update=optimizer == "offload-delayed",
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), **_OPTIMIZER)
    return model, opt


def _step(model, opt, inputs, targets, micro_batches: int, clip: float | None, offloaded: bool):
    """One optimizer step over ``micro_batches`` micro-batches; returns the mean loss."""
    total = 0.0
    for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
        loss = model(x, y) / micro_batches
        loss.backward()
        total += loss.item()
    if clip is not None and not offloaded:  # (CPUOffloadAdam clips in step(): max_grad_norm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return total


def _checkpoint(model, opt) -> dict:
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def resume(model, opt, folder: str) -> None:
    """Load a checkpoint ``dcp.save`` wrote of ``{"model": …, "optim": …}`` (either optimizer's,
    any world size) into the sharded ``model`` and ``opt``.

    DCP loads into a state dict of the right layout, which ``get_state_dict`` makes by stepping a
    fresh optimizer once with zero gradients: that gives every parameter an entry, a CPUOffloadAdam
    a ``master`` too. What the checkpoint does not hold (AdamW's has no master; a parameter that
    never had a gradient has no entry) is dropped from it before loading, as the optimizer then
    expects."""
    state = _checkpoint(model, opt)
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = _only_saved(state, saved, "")
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )


def _only_saved(tree: dict, saved, prefix: str) -> dict:
    kept = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            inner = _only_saved(value, saved, f"{name}.")
            if inner or not value:
                kept[key] = inner
        elif not isinstance(value, (torch.Tensor, int, float)) or name in saved:
            kept[key] = value
    return kept


def main(argv: list[str] | None = None) -> None:
    """One rank (started by torchrun): train, and write the record and weights from rank 0."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="offload")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--unused", action="store_true")
    parser.add_argument("--save", help="a folder: a checkpoint after --save-at steps")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--load", help="a folder with a checkpoint to resume from")
    parser.add_argument("--die-at", type=int, help="(tests) the last rank is killed at this step")
    parser.add_argument(
        "--compare", type=int, default=0, metavar="ROUNDS", help="time every optimizer instead"
    )
    parser.add_argument("--per-round", type=int, default=3, help="steps of each in a round")
    parser.add_argument("--out", required=True, help="the JSON record (and OUT.pt, the weights)")
    args = parser.parse_args(argv)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        (compare if args.compare else train)(args, device)
    finally:
        dist.destroy_process_group()


def _train_step(args, model, opt, data, step, rank, world, device, losses, seconds) -> None:
    """One timed step of :func:`train` (and, at ``--save-at``, a checkpoint)."""
    offloaded = isinstance(opt, CPUOffloadAdam)
    inputs, targets = next(data)
    inputs, targets = inputs[rank::world].to(device), targets[rank::world].to(device)
    if step == args.die_at and rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses.append(_step(model, opt, inputs, targets, args.micro_batches, args.clip, offloaded))
    if args.optimizer == "offload":  # (its weights' copies up, landed)
        opt.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds.append(time.perf_counter() - start)
    if args.save and step + 1 == args.save_at:
        dcp.save(_checkpoint(model, opt), checkpoint_id=args.save)
        if rank == 0:
            (Path(args.save) / "step.json").write_text(json.dumps({"step": step + 1}))


def train(args, device) -> None:
    """Train one optimizer (``args.optimizer``); rank 0 writes the losses, each rank's step times,
    link ledger and optimizer, and the trained weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(args.optimizer, args.bf16, args.unused, args.clip, device)
    offloaded = isinstance(opt, CPUOffloadAdam)
    data = batches(markov_corpus(LAB_CONFIG.vocab, 20_000), GLOBAL_BATCH, LAB_CONFIG.seq, seed=1)
    first = 0
    if args.load:
        resume(model, opt, args.load)
        first = json.loads((Path(args.load) / "step.json").read_text())["step"]
        for _ in range(first):
            next(data)
    losses, seconds = [], []
    traffic = opt.link.traffic.snapshot() if offloaded else None
    # (every copy the optimizer's link issues, labelled)
    with opt.link.record() if offloaded else contextlib.nullcontext() as recording:
        for step in range(first, first + args.steps):
            _train_step(args, model, opt, data, step, rank, world, device, losses, seconds)
    moved = None
    if offloaded:
        opt.synchronize()  # (a delayed update's last step, applied)
        after = opt.link.traffic.snapshot()
        traffic = {k: after[k] - traffic[k] for k in after}
        # gradients down and weights up, without the fingerprint read of weights edited by hand
        moved = {
            direction: sum(
                t.nbytes
                for t in recording.transfers
                if t.direction == direction and not t.label.endswith("edits")
            )
            / args.steps
            for direction in ("d2h", "h2d")
        }
    mean = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    ranks = [None] * world
    mine = {"seconds": seconds, "traffic": traffic, "moved": moved, "optimizer": repr(opt)}
    dist.all_gather_object(ranks, mine)
    weights = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        record = {
            "optimizer": args.optimizer,
            "world": world,
            "backend": dist.get_backend(),
            "steps": args.steps,
            "first_step": first,
            "micro_batches": args.micro_batches,
            "bf16": args.bf16,
            "losses": (mean / world).tolist(),
            "ranks": ranks,
        }
        Path(args.out).write_text(json.dumps(record, indent=1), encoding="utf-8")
        torch.save({k: v.float() for k, v in weights.items()}, f"{args.out}.pt")
    if offloaded:
        opt.close()


def compare(args, device) -> None:
    """Every optimizer of :data:`OPTIMIZERS` on its own copy of the model, timed in rounds: each
    round gives each in turn (in an order that rotates) ``args.per_round`` steps on the same
    batches, timed to the last step's update landed, so a delayed update is charged for the work
    it left behind. Rank 0 writes each round's seconds per step, each rank's link bytes per step
    and its optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = device.type == "cuda"
    contenders = {name: build(name, bf16, False, None, device) for name in OPTIMIZERS}
    data = batches(markov_corpus(LAB_CONFIG.vocab, 20_000), GLOBAL_BATCH, LAB_CONFIG.seq, seed=1)
    names = list(OPTIMIZERS)
    seconds = {name: [] for name in names}
    before = {
        name: opt.link.traffic.snapshot()
        for name, (_, opt) in contenders.items()
        if isinstance(opt, CPUOffloadAdam)
    }
    for round_ in range(args.compare):
        steps = [next(data) for _ in range(args.per_round)]
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            model, opt = contenders[name]
            offloaded = isinstance(opt, CPUOffloadAdam)
            where = torch.device("cpu") if name == "cpu-offload-policy" else device
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for inputs, targets in steps:
                x, y = inputs[rank::world].to(where), targets[rank::world].to(where)
                _step(model, opt, x, y, 1, None, offloaded)
            if offloaded:
                opt.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name].append((time.perf_counter() - start) / args.per_round)
    steps_taken = args.compare * args.per_round
    mine = {"traffic": {}, "optimizers": {}}
    for name, start in before.items():
        opt = contenders[name][1]
        after = opt.link.traffic.snapshot()
        mine["traffic"][name] = {k: (after[k] - start[k]) / steps_taken for k in after}
        mine["optimizers"][name] = repr(opt)
        mine.setdefault("threads", {})[name] = opt.threads
        opt.close()
    mine["shard_elements"] = sum(p.to_local().numel() for p in contenders["adamw"][0].parameters())
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        record = {
            "world": world,
            "backend": dist.get_backend(),
            "bf16": bf16,
            "rounds": args.compare,
            "per_round": args.per_round,
            "params": sum(p.numel() for p in contenders["adamw"][0].parameters()),
            "seconds": seconds,
            "ranks": ranks,
        }
        Path(args.out).write_text(json.dumps(record, indent=1), encoding="utf-8")


def launch_compare(
    processes: int = 2,
    rounds: int = 5,
    per_round: int = 3,
    out: str | os.PathLike = "fsdp_compare.json",
    timeout: float = 600,
) -> dict:
    """Run :func:`compare` on ``processes`` processes and return rank 0's record."""
    _torchrun(["--compare", str(rounds), "--per-round", str(per_round)], processes, out, timeout)
    return json.loads(Path(out).read_text(encoding="utf-8"))


def launch(
    optimizer: str = "offload",
    processes: int = 2,
    out: str | os.PathLike = "fsdp_offload.json",
    timeout: float = 300,
    **options,
) -> dict:
    """Run :func:`main` on ``processes`` gloo (or NCCL) processes and return rank 0's record,
    with ``weights`` (the trained full weights). ``options``: steps, micro_batches, clip, bf16,
    unused, save, save_at, load, as :func:`main` takes them."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    _check_launch(processes, out, options)
    check_positive(timeout, "timeout")
    arguments = ["--optimizer", optimizer]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            arguments.append(flag)
        elif value is not None and value is not False:  # (0 == False: a 0 is passed on)
            arguments += [flag, str(value)]
    _torchrun(arguments, processes, out, timeout)
    record = json.loads(Path(out).read_text(encoding="utf-8"))
    record["weights"] = torch.load(f"{out}.pt")
    return record


def _check_launch(processes, out, options: dict) -> None:
    """ValueError naming what :func:`launch` would otherwise leave to a rank's traceback."""
    check_integer(processes, "processes", expected="a whole number of processes ≥ 1")
    known = {"steps", "micro_batches", "clip", "bf16", "unused", "save", "save_at", "load"}
    known.add("die_at")  # (the tests': the last rank is killed at this step)
    for name in options:
        if name not in known:
            raise ValueError(
                f"{name}: launch takes no such option; it takes "
                f"{', '.join(sorted(known - {'die_at'}))}"
            )
    for name in ("steps", "micro_batches"):
        if options.get(name) is not None:
            check_integer(options[name], name, expected="a whole number ≥ 1")
    if options.get("save_at") is not None:
        check_integer(options["save_at"], "save_at", 0, expected="a whole number of steps ≥ 0")
    steps, save_at = options.get("steps") or DEFAULT_STEPS, options.get("save_at")
    if save_at is not None and save_at > steps:
        raise ValueError(f"save_at: expected a step up to steps ({steps}); got {save_at!r}")
    if options.get("clip") is not None:
        check_positive(options["clip"], "clip")
    for name in ("bf16", "unused"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise ValueError(f"{name}: expected True or False; got {options[name]!r}")
    if "save" in options and not str(options["save"] or "").strip():
        raise ValueError(f"save: expected a folder for the checkpoint; got {options['save']!r}")
    folder = Path(out).parent
    if not folder.is_dir() or Path(out).is_dir():
        raise ValueError(f"out: expected a file in an existing folder; got {str(out)!r}")
    load = options.get("load")
    if load is not None and not (Path(load) / ".metadata").is_file():
        raise ValueError(
            f"load: expected a folder holding a checkpoint (its .metadata); got {str(load)!r}"
        )


def _torchrun(arguments: list[str], processes: int, out, timeout: float) -> None:
    distributed.torchrun(
        "offloadlab.fsdp_offload", [*arguments, "--out", str(out)], processes, timeout
    )


if __name__ == "__main__":
    main()
