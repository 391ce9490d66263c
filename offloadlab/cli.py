"""The ``offloadlab`` command.

Each subcommand prints a human-readable table by default and a JSON object with
``--json``. Bad arguments print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import memory
from .units import format_count, format_size

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _shipped_models() -> list[str]:
    from . import architectures

    return architectures.shipped()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse calls this for unknown or missing arguments
        raise UsageError(f"{self.prog}: {message}")


def _cmd_state(args) -> int:
    breakdown = memory.state_bytes(args.params, args.recipe)
    if args.json:
        print(json.dumps(breakdown.to_dict(), indent=2))
        return 0
    recipe = memory.get_recipe(args.recipe)
    print(f"{format_count(breakdown.params)} parameters, recipe {recipe.name}: {recipe.description}")
    for kind, size in breakdown.by_kind.items():
        print(f"  {kind:<20} {recipe.bytes_per_param[kind]:>6g} B/param  {format_size(size):>10}")
    print(f"  {'total':<20} {recipe.total:>6g} B/param  {format_size(breakdown.total_bytes):>10}")
    fits = memory.fitting_gpus(breakdown.total_bytes)
    print("fits on: " + (", ".join(fits) + " cards" if fits else f"none of {', '.join(memory.GPU_SIZES)}")
          + " (by the memory each card reports: "
          + ", ".join(f"{name} → {format_size(size, binary=True)}" for name, size in memory.GPU_SIZES.items()) + ")")
    return 0


def _cmd_budget(args) -> int:
    from . import budget

    if (args.params is None) != (args.offload is None):
        raise UsageError("offloadlab budget: give --params and --offload together, or neither")
    offload = args.offload.split(",") if args.offload else ()
    result = budget.verdict(args.link, args.window, args.params, offload, duplex=args.duplex, recipe=args.recipe)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0


def _plan_workload(args):
    """The workload of ``plan``: a shipped model, a local config.json, or a bare parameter count."""
    from . import architectures, planner

    given = [name for name, value in (("--params", args.params), ("--model", args.model),
                                      ("--model-config", args.model_config)) if value is not None]
    if len(given) != 1:
        raise UsageError(f"offloadlab plan: expected exactly one of --params, --model or --model-config; "
                         f"got {' and '.join(given) or 'none'}")
    if args.params is not None:
        return planner.Workload(args.params, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                batch=args.batch, seq=args.seq)
    if any(v is not None for v in (args.layers, args.hidden, args.heads)):
        raise UsageError("offloadlab plan: --layers/--hidden/--heads go with --params; a model config has its shape")
    if args.model_config is not None and not Path(args.model_config).is_file():
        raise UsageError(f"--model-config: expected a config.json file; got {args.model_config!r}")
    architecture = architectures.load(args.model if args.model is not None else Path(args.model_config))
    return planner.Workload.of_model(architecture, batch=args.batch, seq=args.seq)


def _plan_hardware(args):
    """The node of ``plan``: the flags, or an ``offloadlab probe --json`` record with the flags over it."""
    from . import planner

    given = dict(gpu_memory=args.gpu_memory, link=args.link, host_memory=args.host_memory, cpu_adam=args.cpu_adam,
                 compute=args.compute, comm_fraction=args.comm_fraction, gpus_per_node=args.gpus_per_node,
                 interconnect=args.interconnect, gpus_per_link=args.gpus_per_link, nvme=args.nvme)
    if args.measured is None:
        for flag in ("gpu_memory", "link"):
            if given[flag] is None:
                raise UsageError(f"offloadlab plan: --{flag.replace('_', '-')} is required (or --measured FILE)")
        return planner.Hardware(**given)
    try:
        record = json.loads(Path(args.measured).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--measured: expected an `offloadlab probe --json` file; got {args.measured!r} "
                         f"({type(error).__name__})") from None
    return planner.Hardware.from_probe(record, **given)


def _cmd_plan(args) -> int:
    from . import engines, planner

    work = _plan_workload(args)
    hardware = _plan_hardware(args)
    if hardware.gpus_per_node == 1 and (args.interconnect is not None or args.gpus_per_link != 1):
        raise UsageError("offloadlab plan: --interconnect and --gpus-per-link need --gpus-per-node above 1")
    report = planner.plan(work, hardware)
    emitted = {}
    if args.emit:
        options = dict(accumulation=args.accumulation, nvme_path=args.nvme_path)
        if work.architecture is not None and work.architecture.family == "gpt2":
            options["blocks"] = "model.transformer.h"
        chosen = engines.setup(report, **options)
        if args.emit == "deepspeed":
            emitted = {"deepspeed": engines.deepspeed_config(chosen), "deepspeed_python": engines.deepspeed_snippet(chosen)}
        else:
            emitted = {"fsdp": engines.fsdp_snippet(chosen)}
    if args.json:
        payload = {"params": int(work.params) if float(work.params).is_integer() else work.params, "model": work.architecture.to_dict() if work.architecture else None,
                   "gpus_per_node": hardware.gpus_per_node, "measured": list(hardware.sources),
                   **report.to_dict(), **emitted}
        print(json.dumps(payload, indent=1))
        return 0
    if work.architecture is not None:
        a = work.architecture
        print(f"model {a.name} ({a.family}): {a.params:,} parameters, exact from its config — {a.layers} layers, "
              f"hidden {a.hidden}, {a.heads} heads ({a.kv_heads} key/value), MLP {a.intermediate}, vocabulary "
              f"{a.vocab}, head {'tied' if a.tied_embeddings else 'untied'}")
    if hardware.gpus_per_node > 1:
        print(f"node: {hardware.gpus_per_node} GPUs; each gets an {hardware.gpus_per_node}th of host memory and CPU "
              f"cores" + (f", and shares its link with {hardware.gpus_per_link - 1} other(s)"
                          if hardware.gpus_per_link > 1 else ""))
    for source in hardware.sources:
        print(f"measured: {source}")
    print(report.explain())
    on_drive = report.chosen is not None and getattr(getattr(report.chosen, "layout", None), "nvme_bytes", 0)
    if emitted and on_drive and not args.nvme_path:
        print(f"\nnote: the plan offloads to NVMe; the config names {engines.NVME_PATH_PLACEHOLDER} — pass "
              f"--nvme-path with a folder on the drive")
    if emitted and args.nvme_path and not on_drive:
        print("\nnote: the plan fits in host memory, so the configuration offloads there and --nvme-path is unused")
    for name, text in emitted.items():
        print(f"\n{name}:")
        print(json.dumps(text, indent=2) if isinstance(text, dict) else text)
    return 0


def _json_target(path: str | None, force: bool) -> Path | None:
    """The file --json names, refused up front if it exists (unless --force) or cannot be written."""
    if path is None:
        return None
    target = Path(path)
    if target.exists() and not force:
        raise UsageError(f"--json: {path} exists; pass --force to replace it")
    if not target.parent.is_dir():
        raise UsageError(f"--json: folder {target.parent} does not exist")
    return target


def _cmd_probe(args) -> int:
    from . import ladder, reference

    target = _json_target(args.json, args.force)
    if not Path(args.disk).is_dir():
        raise UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
    measured = ladder.measure(quick=args.quick, disk_folder=args.disk)
    mine = ladder.of_machine(measured)
    info = measured["machine"]
    print(f"this machine: {info.cpu}, {info.logical_cores} cores, {format_size(info.host_memory_bytes)} RAM; "
          f"accelerator: {info.accelerator.name or 'none'}")
    print(ladder.table(mine))
    if info.accelerator.kind == "none":
        print("not measured here: GPU memory bandwidth and the real PCIe link (no GPU); "
              "the host↔GPU rows come from the emulated link")
    records = [r.to_dict() for r in measured["records"]]
    if target is not None:
        payload = {"machine": info.to_dict(), "ladder": mine, "records": records}
        target.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {len(records)} records to {target}")
    if args.reference:
        kind = "emulated" if info.accelerator.kind == "none" else "measured"
        label = info.accelerator.name or info.cpu
        path = reference.save(args.reference, kind, label, records[0]["provenance"], records, overwrite=args.force)
        print(f"wrote reference {path}")
    return 0


def _cmd_bench(args) -> int:
    from . import bench

    target = _json_target(args.json, args.force)  # refuse a bad --json before a long run
    result = getattr(bench, args.name)(quick=args.quick)
    print(bench.format_result(result))
    if target is not None:
        target.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offloadlab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    state = commands.add_parser("state", help="bytes of training state for a model size")
    state.add_argument("--params", required=True, help="parameter count, e.g. 10e9")
    state.add_argument("--recipe", default=memory.DEFAULT_RECIPE, help=f"one of {', '.join(memory.RECIPES)}")
    state.add_argument("--json", action="store_true", help="print a JSON object")
    state.set_defaults(run=_cmd_state)

    budget = commands.add_parser("budget", help="the per-step bandwidth budget and an offload's verdict")
    budget.add_argument("--link", required=True, help="one direction's bandwidth, e.g. '25 GB/s'")
    budget.add_argument("--window", required=True, help="compute time to hide behind, e.g. '250 ms'")
    budget.add_argument("--params", help="parameter count, e.g. 10e9")
    budget.add_argument("--offload", help="comma-separated: optimizer, gradients, parameters, park-and-copy")
    budget.add_argument("--duplex", default="full",
                        help="full (default: each direction at the full rate at once), half (the directions share "
                             "it), or the rate each direction keeps while both run, e.g. '20 GB/s'")
    budget.add_argument("--recipe", default=memory.DEFAULT_RECIPE,
                        help=f"bytes per parameter of each kind of state: one of {', '.join(memory.RECIPES)}")
    budget.add_argument("--json", action="store_true", help="print a JSON object")
    budget.set_defaults(run=_cmd_budget)

    plan = commands.add_parser("plan", help="what to offload, in what order, and the predicted step")
    plan.add_argument("--params", help="parameter count, e.g. 30e9 (or --model / --model-config)")
    plan.add_argument("--model", help="a shipped model config: " + ", ".join(_shipped_models()))
    plan.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json to count exactly")
    plan.add_argument("--gpu-memory", help="GPU memory, e.g. '80 GB' (or from --measured)")
    plan.add_argument("--link", help="host↔GPU bandwidth per direction, e.g. '25 GB/s' (or from --measured)")
    plan.add_argument("--measured", metavar="FILE", help="an `offloadlab probe --json` record of this machine")
    plan.add_argument("--gpus-per-node", type=_positive_int, default=1,
                      help="GPUs sharing the node's host memory and cores (default 1)")
    plan.add_argument("--interconnect", help="GPU↔GPU bandwidth per direction, e.g. '450 GB/s' (default: assumed)")
    plan.add_argument("--gpus-per-link", type=_positive_int, default=1,
                      help="GPUs sharing one host link, e.g. 2 behind one PCIe switch (default 1)")
    plan.add_argument("--host-memory", help="host memory, e.g. '2 TB' (default: unlimited)")
    plan.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size (default 1)")
    plan.add_argument("--seq", type=_positive_int, default=2048, help="sequence length (default 2048)")
    plan.add_argument("--layers", type=_positive_int, help="transformer layers (with --hidden and --heads)")
    plan.add_argument("--hidden", type=_positive_int, help="hidden size")
    plan.add_argument("--heads", type=_positive_int, help="attention heads")
    plan.add_argument("--compute", type=float, help="sustained FLOP/s of the GPU (default: assumed)")
    plan.add_argument("--cpu-adam", type=float, help="CPU Adam throughput in params/s (default: assumed)")
    plan.add_argument("--comm-fraction", type=float, default=0.0,
                      help="fraction of the step already spent communicating (0–1)")
    plan.add_argument("--emit", choices=["deepspeed", "fsdp"], help="also print an equivalent configuration")
    plan.add_argument("--accumulation", type=_positive_int, default=1,
                      help="micro-batches per optimizer step, for --emit (default 1)")
    plan.add_argument("--nvme", help="plan on NVMe when host memory is short: the drive's sustained rate, e.g. '3 GB/s'")
    plan.add_argument("--nvme-path", help="with --emit: the folder on the NVMe drive that an NVMe plan offloads to")
    plan.add_argument("--json", action="store_true", help="print a JSON object")
    plan.set_defaults(run=_cmd_plan)

    probe = commands.add_parser("probe", help="measure this machine's memory tiers and links")
    probe.add_argument("--quick", action="store_true", help="small sizes: seconds on a CPU-only machine")
    probe.add_argument("--disk", default=".", help="folder whose disk to measure (default: here)")
    probe.add_argument("--json", metavar="FILE", help="write every record to FILE")
    probe.add_argument("--reference", metavar="NAME", help="also save the records as reference data NAME")
    probe.add_argument("--force", action="store_true", help="replace an existing --json or --reference file")
    probe.set_defaults(run=_cmd_probe)

    bench = commands.add_parser("bench", help="benchmarks against peers, reported as ratios")
    bench.add_argument("name", choices=["link", "overlap", "adam", "offload", "prefetch"], help="what to benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    bench.add_argument("--json", metavar="FILE", help="write the result to FILE")
    bench.add_argument("--force", action="store_true", help="replace an existing --json file")
    bench.set_defaults(run=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except (UsageError, ValueError) as error:
        print(f"offloadlab: error: {error}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
