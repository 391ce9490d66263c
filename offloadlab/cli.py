"""The ``offloadlab`` command.

Each subcommand prints a human-readable table by default and a JSON object with ``--json``
(strict JSON: every figure is finite, because every argument is bounded so that it stays so).

Exit status, with at most one line on stderr and never a traceback for any of these:

- 0: done.
- 2: a usage error. A bad argument (malformed, out of its range, or one the command cannot
  honour), found before anything runs: arguments are parsed and checked fully first.
- 1: a fault of the machine: an output that cannot be written, a disk that is read-only, full or
  failing. Outputs are checked before a long measurement; a measurement that ran is never lost:
  if its file cannot be written, its JSON goes to stdout instead.
- 141 (128 + SIGPIPE), silently: the reader of stdout went away (``| head``), as for any Unix
  tool that dies of SIGPIPE; files the command writes are written first.
- 130: interrupted (Ctrl-C).

Anything else is a bug and ends with Python's traceback: an internal error is not dressed up as
a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

from . import files, memory, units
from .units import format_count, format_size

USAGE_ERROR = 2
FAULT = 1
READER_GONE = 128 + 13  # what a shell reports for a writer killed by SIGPIPE
INTERRUPTED = 128 + 2


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


class Fault(Exception):
    """A fault of the machine (a disk, a file system): one line on stderr, exit status 1."""


@contextlib.contextmanager
def _arguments():
    """Mark where a command turns its arguments into the package's validated inputs.

    The package's constructors and parsers raise ValueError naming the argument; inside this block
    that is a usage error. Outside it a ValueError is a bug, and surfaces as one.
    """
    try:
        yield
    except ValueError as error:
        raise UsageError(str(error)) from None


def _bounded(parse, low: float, high: float, limits: str):
    """An argparse type: ``parse`` (from :mod:`units`), then ``low`` ≤ value ≤ ``high``.

    The bounds are wide enough for any real machine and narrow enough that no figure derived from
    the arguments (a time, a ratio) overflows to infinity or underflows to zero.
    """
    def convert(text: str) -> float:
        try:
            value = parse(text, "value")
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("value: ")) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {limits}; got {text!r}")
        return value
    return convert


_SIZE = _bounded(units.parse_size, 1, 1e18, "a size from 1 B to 1000 PB, e.g. '80 GB'")
_BANDWIDTH = _bounded(units.parse_bandwidth, 1, 1e15, "a bandwidth from 1 B/s to 1 PB/s, e.g. '32 GB/s'")
_DURATION = _bounded(units.parse_duration, 1e-9, 1e9, "a duration from 1 ns to 1e9 s, e.g. '250 ms'")
_PARAMS = _bounded(units.parse_count, 1, 1e15, "a parameter count from 1 to 1e15, e.g. 10e9")
_FLOPS = _bounded(units.check_positive, 1, 1e21, "FLOP/s from 1 to 1e21, e.g. 400e12")
_PARAMS_PER_S = _bounded(units.check_positive, 1, 1e15, "parameters per second from 1 to 1e15, e.g. 3e9")
_FRACTION = _bounded(units.check_non_negative, 0, 0.999, "a fraction from 0 to 0.999")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if not 1 <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to 10**9; got {text!r}")
    return value


def _name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, spaces around them ignored; an empty or repeated name is refused
    (a repeat is a slip: counting it twice would double its traffic, dropping it would hide the slip)."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names; got {text!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"expected each name once; got {text!r} ({', '.join(repeated)} repeated)")
    return names


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse calls this for every bad argument
        raise UsageError(f"{self.prog}: {re.sub(r'^argument ', '', message)}")


def _dumps(payload, indent: int = 2) -> str:
    """Strict JSON: a non-finite number is a bug here (the arguments are bounded), so it raises."""
    return json.dumps(payload, indent=indent, allow_nan=False)


def _cmd_state(args) -> int:
    with _arguments():
        breakdown = memory.state_bytes(args.params, args.recipe)
        recipe = memory.get_recipe(args.recipe)
    if args.json:
        print(_dumps(breakdown.to_dict()))
        return 0
    print(f"{format_count(breakdown.params)} parameters, recipe {recipe.name}: {recipe.description}")
    for kind, size in breakdown.by_kind.items():
        print(f"  {kind:<20} {recipe.bytes_per_param[kind]:>6g} B/param  {format_size(size):>10}")
    print(f"  {'total':<20} {recipe.total:>6g} B/param  {format_size(breakdown.total_bytes):>10}")
    fits = memory.fitting_gpus(breakdown.total_bytes)
    print("fits on: " + (", ".join(fits) + " cards" if fits else f"none of {', '.join(memory.GPU_SIZES)}"))
    return 0


def _cmd_budget(args) -> int:
    from . import budget

    if (args.params is None) != (args.offload is None):
        raise UsageError("offloadlab budget: give --params and --offload together, or neither")
    with _arguments():
        result = budget.verdict(args.link, args.window, args.params, args.offload or ())
    print(_dumps(result.to_dict()) if args.json else result.summary())
    return 0


def _cmd_plan(args) -> int:
    from . import planner

    with _arguments():
        work = planner.Workload(args.params, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                batch=args.batch, seq=args.seq)
        hardware = planner.Hardware(args.gpu_memory, args.link, host_memory=args.host_memory,
                                    cpu_adam=args.cpu_adam, compute=args.compute, comm_fraction=args.comm_fraction)
    report = planner.plan(work, hardware)
    emitted = None
    with _arguments():  # --emit cannot be honoured when nothing fits
        if args.emit == "deepspeed":
            emitted = planner.deepspeed_config(report)
        elif args.emit == "fsdp":
            emitted = planner.fsdp_snippet(report)
    if args.json:
        payload = report.to_dict()
        if emitted is not None:
            payload[args.emit] = emitted
        print(_dumps(payload, indent=1))
        return 0
    print(report.explain())
    if emitted is not None:
        print(f"\n{args.emit}:")
        print(_dumps(emitted) if isinstance(emitted, dict) else emitted)
    return 0


def _output_target(path: str | None, force: bool, flag: str = "--json") -> Path | None:
    """The file ``flag`` names, refused now — before a long measurement — if it could not be written
    later: usage errors for a bad name, a folder, a missing folder or an existing file without
    --force; a fault for a folder that refuses new files."""
    if path is None:
        return None
    with _arguments():
        try:
            return files.check_target(path, replace=force, name=flag, how_to_replace="--force")
        except OSError as error:
            raise Fault(f"{flag}: {error.strerror or error}") from None


def _save(saves: list[tuple[str, Path, object, str]], text: str) -> tuple[list[str], list[str]]:
    """Run each ``(flag, target, write, done)`` of ``saves``: ``write(target)`` saves a measurement.

    Returns (lines saying what was written, fault lines). When the machine refuses a write, ``text``
    — the same results as JSON — goes to stdout instead, so nothing measured is lost.
    """
    notes, faults = [], []
    for flag, target, write, done in saves:
        try:
            write(target)
        except OSError as error:
            faults.append(f"{flag}: could not write {target} ({error.strerror or error}); the results are on stdout")
        else:
            notes.append(done)
    if faults:
        print(text)
    return notes, faults


def _cmd_probe(args) -> int:
    from . import ladder, reference

    json_target = _output_target(args.json, args.force)
    if args.reference_dir is not None and not args.reference:
        raise UsageError("--reference-dir: give it with --reference NAME")
    if args.reference_dir is not None and not Path(args.reference_dir).is_dir():
        raise UsageError(f"--reference-dir: expected an existing folder; got {args.reference_dir!r}")
    reference_target = None
    if args.reference:
        try:
            reference_target = reference.target(args.reference, args.reference_dir, overwrite=args.force)
        except ValueError as error:  # the name or the folder the user gave
            raise UsageError(f"--reference: {str(error).removeprefix('name: ')}") from None
        except OSError as error:
            raise Fault(f"--reference: {error.strerror or error}") from None
    if not Path(args.disk).is_dir():
        raise UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
    measured = ladder.measure(quick=args.quick, disk_folder=args.disk)  # checks the disk before the sweeps
    mine = ladder.of_machine(measured)
    info = measured["machine"]
    records = [r.to_dict() for r in measured["records"]]
    text = _dumps({"machine": info.to_dict(), "ladder": mine, "records": records}, indent=1) + "\n"
    saves = []
    if json_target is not None:
        saves.append(("--json", json_target, lambda path: files.write_atomically(path, text, replace=args.force),
                      f"wrote {len(records)} records to {json_target}"))
    if reference_target is not None:
        kind = "emulated" if info.accelerator.kind == "none" else "measured"
        label = info.accelerator.name or info.cpu
        saves.append(("--reference", reference_target, lambda path: reference.write(
            path, kind, label, records[0]["provenance"], records, overwrite=args.force),
            f"wrote reference {reference_target}"))
    notes, faults = _save(saves, text)
    faults = measured["faults"] + faults
    print(f"this machine: {info.cpu}, {info.logical_cores} cores, {format_size(info.host_memory_bytes)} RAM; "
          f"accelerator: {info.accelerator.name or 'none'}")
    print(ladder.table(mine))
    if info.accelerator.kind == "none":
        print("not measured here: GPU memory bandwidth and the real PCIe link (no GPU); "
              "the host↔GPU rows come from the emulated link")
    for note in notes:
        print(note)
    if faults:
        raise Fault("; ".join(faults))
    return 0


def _cmd_bench(args) -> int:
    from . import bench

    target = _output_target(args.json, args.force)  # refuse a bad --json before a long run
    if args.disk is not None and args.name != "nvme":
        raise UsageError(f"--disk: only bench nvme uses a disk; got it with bench {args.name}")
    if args.name == "nvme":
        if not Path(args.disk or ".").is_dir():
            raise UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
        with _arguments():
            bench.check_nvme_folder(args.disk or ".", quick=args.quick)  # OSError: a fault, found before the run
        result = bench.nvme(quick=args.quick, folder=args.disk or ".")
    else:
        result = getattr(bench, args.name)(quick=args.quick)
    text = _dumps(result, indent=1) + "\n"
    saves = [] if target is None else [("--json", target, lambda path: files.write_atomically(path, text, args.force),
                                        f"wrote the result to {target}")]
    notes, faults = _save(saves, text)
    print(bench.format_result(result))
    for note in notes:
        print(note)
    if faults:
        raise Fault("; ".join(faults))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offloadlab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    state = commands.add_parser("state", help="bytes of training state for a model size")
    state.add_argument("--params", required=True, type=_PARAMS, help="parameter count, e.g. 10e9")
    state.add_argument("--recipe", default=memory.DEFAULT_RECIPE, help=f"one of {', '.join(memory.RECIPES)}")
    state.add_argument("--json", action="store_true", help="print a JSON object")
    state.set_defaults(run=_cmd_state)

    budget = commands.add_parser("budget", help="the per-step bandwidth budget and an offload's verdict")
    budget.add_argument("--link", required=True, type=_BANDWIDTH, help="link bandwidth, e.g. '32 GB/s'")
    budget.add_argument("--window", required=True, type=_DURATION, help="compute time to hide behind, e.g. '250 ms'")
    budget.add_argument("--params", type=_PARAMS, help="parameter count, e.g. 10e9")
    budget.add_argument("--offload", type=_name_list,
                        help="comma-separated: optimizer, gradients, parameters, park-and-copy")
    budget.add_argument("--json", action="store_true", help="print a JSON object")
    budget.set_defaults(run=_cmd_budget)

    plan = commands.add_parser("plan", help="what to offload, in what order, and the predicted step")
    plan.add_argument("--params", required=True, type=_PARAMS, help="parameter count, e.g. 30e9")
    plan.add_argument("--gpu-memory", required=True, type=_SIZE, help="GPU memory, e.g. '80 GB'")
    plan.add_argument("--link", required=True, type=_BANDWIDTH, help="host↔GPU bandwidth, e.g. '60 GB/s'")
    plan.add_argument("--host-memory", type=_SIZE, help="host memory, e.g. '2 TB' (default: unlimited)")
    plan.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size (default 1)")
    plan.add_argument("--seq", type=_positive_int, default=2048, help="sequence length (default 2048)")
    plan.add_argument("--layers", type=_positive_int, help="transformer layers (with --hidden and --heads)")
    plan.add_argument("--hidden", type=_positive_int, help="hidden size")
    plan.add_argument("--heads", type=_positive_int, help="attention heads")
    plan.add_argument("--compute", type=_FLOPS, help="sustained FLOP/s of the GPU (default: assumed)")
    plan.add_argument("--cpu-adam", type=_PARAMS_PER_S, help="CPU Adam throughput in params/s (default: assumed)")
    plan.add_argument("--comm-fraction", type=_FRACTION, default=0.0,
                      help="fraction of the step already spent communicating (0–1)")
    plan.add_argument("--emit", choices=["deepspeed", "fsdp"], help="also print an equivalent configuration")
    plan.add_argument("--json", action="store_true", help="print a JSON object")
    plan.set_defaults(run=_cmd_plan)

    probe = commands.add_parser("probe", help="measure this machine's memory tiers and links")
    probe.add_argument("--quick", action="store_true", help="small sizes: seconds on a CPU-only machine")
    probe.add_argument("--disk", default=".", help="folder whose disk to measure (default: here)")
    probe.add_argument("--json", metavar="FILE", help="write every record to FILE")
    probe.add_argument("--reference", metavar="NAME",
                       help="also save the records as reference data NAME, in your reference folder "
                            "($OFFLOADLAB_REFERENCE_DIR, else ~/.local/share/offloadlab/reference)")
    probe.add_argument("--reference-dir", metavar="DIR",
                       help="save the --reference file in DIR instead (make gpu-check: offloadlab/reference)")
    probe.add_argument("--force", action="store_true", help="replace an existing --json or --reference file")
    probe.set_defaults(run=_cmd_probe)

    bench = commands.add_parser("bench", help="benchmarks against peers, reported as ratios")
    bench.add_argument("name", choices=["link", "overlap", "adam", "offload", "prefetch", "nvme"],
                       help="what to benchmark")
    bench.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    bench.add_argument("--json", metavar="FILE", help="write the result to FILE")
    bench.add_argument("--force", action="store_true", help="replace an existing --json file")
    bench.add_argument("--disk", metavar="DIR", help="folder for bench nvme's scratch files (default: here)")
    bench.set_defaults(run=_cmd_bench)
    return parser


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush cannot fail on the closed pipe
    (the recipe of Python's signal documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout is not a file (captured in a test)
        pass


def _error(message: str) -> None:
    print(f"offloadlab: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv``; returns the exit status (see the module's docstring)."""
    try:
        args = build_parser().parse_args(argv)
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below
        return status
    except UsageError as error:
        _error(str(error))
        return USAGE_ERROR
    except BrokenPipeError:  # before OSError, of which it is a kind
        _stdout_gone()
        return READER_GONE
    except Fault as error:
        _error(str(error))
        return FAULT
    except OSError as error:  # what the machine refused: a disk, a file system, a device
        _error(f"{error.filename}: {error.strerror}" if error.filename and error.strerror else
               error.strerror or str(error))
        return FAULT
    except KeyboardInterrupt:
        _error("interrupted")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
