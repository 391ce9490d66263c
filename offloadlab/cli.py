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
import dataclasses
import errno
import json
import os
import re
import sys
from pathlib import Path
from types import MappingProxyType

from . import files, memory, units
from .units import format_bandwidth, format_count, format_duration, format_size

USAGE_ERROR = 2
FAULT = 1
READER_GONE = 128 + 13  # what a shell reports for a writer killed by SIGPIPE
INTERRUPTED = 128 + 2


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


class Fault(Exception):
    """A fault of the machine (a disk, a file system): one line on stderr, exit status 1."""


@contextlib.contextmanager
def arguments(**flags: str):
    """Mark where a command turns its arguments into the package's validated inputs.

    The package's constructors and parsers raise ValueError naming the argument; inside this block
    that is a usage error. Outside it a ValueError is a bug, and surfaces as one. ``flags`` maps
    the package's argument names to the flags the user typed (``duplex="--duplex"``).
    """
    try:
        yield
    except ValueError as error:
        message = str(error)
        for name, flag in flags.items():
            if message.startswith(f"{name}: "):
                message = flag + message[len(name) :]
        raise UsageError(message) from None


def _named_as_typed(message: str, args) -> str:
    """``message`` with a leading argument name the package used (``gpus_per_link: ...``)
    written as the flag the user typed (``--gpus-per-link: ...``)."""
    name, colon, rest = message.partition(": ")
    if colon and args is not None and name in vars(args) and name not in ("command", "run"):
        return f"--{name.replace('_', '-')}: {rest}"
    return message


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
_BANDWIDTH = _bounded(
    units.parse_bandwidth, 1, 1e15, "a bandwidth from 1 B/s to 1 PB/s, e.g. '32 GB/s'"
)
_DURATION = _bounded(
    units.parse_duration, 1e-9, 1e9, "a duration from 1 ns to 1e9 s, e.g. '250 ms'"
)
_MIN_PARAMS, _MAX_PARAMS = 1e6, 1e15


def _whole_count(text, name):
    """A parameter count, which is a whole number (10e9 is one, 1.5 is not) and a model's: a count
    below a million is a slip for billions ('8' for 8e9) and is refused with that reading."""
    count = units.parse_count(text, name)
    if not float(count).is_integer():
        raise ValueError(f"{name}: expected a whole number of parameters; got {text!r}")
    if count < _MIN_PARAMS:
        raise ValueError(
            f"{name}: expected a model's parameter count, at least {_MIN_PARAMS:.0e}; got "
            f"{text!r}: did you mean {count:g}e9?"
        )
    return count


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _rate_or_bare(unit: str, floor: float, example: str):
    """A rate in ``unit`` per second ('400 TFLOP/s', '3 G/s'), or a bare number of them of at least
    ``floor``: a smaller bare number is a slip for a prefix, refused with that reading."""
    prefixes = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}

    def parse(text, name):
        per_second = "(?:/s|S)" if unit else "/s"  # ('400 TFLOPS' as well as '400 tflop/s')
        match = re.fullmatch(
            rf"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]?){unit}{per_second}\s*", text, flags=re.IGNORECASE
        )
        if match:
            return units.check_positive(
                float(match.group(1)) * prefixes[match.group(2).lower()], name
            )
        if isinstance(text, str) and not _is_float(text):  # ('200 TFLOP': a unit, not per second)
            raise ValueError(f"{name}: expected {example} or a bare number; got {text!r}")
        value = units.check_positive(text, name)
        if value < floor:
            raise ValueError(
                f"{name}: expected {example} or a bare number of at least {floor:g}; got {text!r}: "
                f"did you mean '{value:g} {'T' if unit == 'FLOP' else 'G'}{unit}/s'?"
            )
        return value

    return parse


_PARAMS = _bounded(
    _whole_count, _MIN_PARAMS, _MAX_PARAMS, "a whole parameter count from 1e6 to 1e15, e.g. 10e9"
)
_FLOPS = _bounded(
    _rate_or_bare("FLOP", 1e9, "a rate such as '400 TFLOP/s'"),
    1,
    1e21,
    "FLOP/s from 1 to 1e21, e.g. '400 TFLOP/s'",
)
_PARAMS_PER_S = _bounded(
    _rate_or_bare("", 1e6, "a rate such as '3 G/s' (parameters per second)"),
    1,
    1e15,
    "parameters per second from 1 to 1e15, e.g. 3e9",
)


def _recompute(text: str):
    """``auto``, ``none``, ``all``, or a number of layers to checkpoint."""
    if text in ("auto", "none", "all"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto', 'none', 'all' or a number of layers; got {text!r}"
        ) from None


_FRACTION = _bounded(units.check_non_negative, 0, 0.999, "a fraction from 0 to 0.999")


def _duplex(text: str):
    """``full``, ``half``, or the rate each direction keeps while both run (a bandwidth)."""
    if text in ("full", "half"):
        return text
    try:
        _BANDWIDTH(text)
        return text  # as typed: a refusal against --link (in budget) quotes it
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected 'full', 'half' or the rate each direction keeps while both "
            f"run, e.g. '20 GB/s'; got {text!r}"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if not 1 <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to 10**9; got {text!r}")
    return value


def _shipped_models() -> list[str]:
    from . import architectures

    return architectures.shipped()


def _name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names, spaces around them ignored; an empty or repeated name is refused (a
    repeat is a slip: counting it twice would double its traffic, dropping it would hide the
    slip)."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names; got {text!r}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"expected each name once; got {text!r} ({', '.join(repeated)} repeated)"
        )
    return names


class Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        self._words = list(sys.argv[1:] if args is None else args)  # for error() to quote
        return super().parse_known_args(args, namespace)

    def error(self, message):  # argparse calls this for every bad argument
        # `--params -5e9`: argparse takes a value that starts with '-' for an option
        flag = re.fullmatch(r"argument (--[a-z-]+)(?:/\S+)?: expected one argument", message)
        words = getattr(self, "_words", [])
        if flag and flag.group(1) in words[:-1]:
            value = words[words.index(flag.group(1)) + 1]
            if value.startswith("-"):
                raise UsageError(
                    f"{self.prog}: {flag.group(1)}: got {value!r}, which reads as an option; "
                    f"write {flag.group(1)}={value}"
                )
        raise UsageError(f"{self.prog}: {re.sub(r'^argument ', '', message)}")

    # argparse's own swallows a failed write (--help > /dev/full)
    def _print_message(self, message, file=None):
        if message:
            (file or sys.stdout).write(message)


def dumps(payload, indent: int = 2) -> str:
    """Strict JSON: a non-finite number is a bug here (the arguments are bounded), so it raises.
    The library's read-only tables are written as the objects they are."""
    return json.dumps(payload, indent=indent, allow_nan=False, default=_as_object)


def _as_object(value):
    if isinstance(value, MappingProxyType):
        return dict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _cmd_state(args) -> int:
    with arguments():
        breakdown = memory.state_bytes(args.params, args.recipe)
        recipe = memory.get_recipe(args.recipe)
    if args.json:
        print(dumps(breakdown.to_dict()))
        return 0
    print(
        f"{format_count(breakdown.params)} parameters, recipe {recipe.name}: {recipe.description}"
    )
    for kind, size in breakdown.by_kind.items():
        print(f"  {kind:<20} {recipe.bytes_per_param[kind]:>6g} B/param  {format_size(size):>10}")
    print(f"  {'total':<20} {recipe.total:>6g} B/param  {format_size(breakdown.total_bytes):>10}")
    fits = memory.fitting_gpus(breakdown.total_bytes)
    print(
        "fits on: "
        + (", ".join(fits) + " cards" if fits else f"none of {', '.join(memory.GPU_SIZES)}")
        + " (by the memory each card reports: "
        + ", ".join(
            f"{name} → {format_size(size, binary=True)}" for name, size in memory.GPU_SIZES.items()
        )
        + ")"
    )
    return 0


def _cmd_budget(args) -> int:
    from . import budget

    if (args.params is None) != (args.offload is None):
        raise UsageError("offloadlab budget: give --params and --offload together, or neither")
    with arguments(duplex="--duplex"):
        result = budget.verdict(
            args.link,
            args.window,
            args.params,
            args.offload or (),
            duplex=args.duplex,
            recipe=args.recipe,
            micro_batches=args.micro_batches,
        )
    print(dumps(result.to_dict()) if args.json else result.summary())
    return 0


def _cmd_overlap(args) -> int:
    import math

    from . import overlap

    if (args.bytes is None) != (args.window is None):
        raise UsageError("offloadlab overlap: give --bytes and --window together, or neither")
    tokens = overlap.crossover_tokens(args.compute, args.link)
    behind_backward = overlap.crossover_tokens(args.compute, args.link, flops_per_param_token=4)
    stage = overlap.stage(args.bytes, args.link, args.window) if args.bytes is not None else None
    if args.json:
        condition = (
            {
                "transfer_s": stage.t_transfer,
                "hidden": stage.hidden,
                "stall_s": stage.stall,
                "regime": stage.regime,
            }
            if stage
            else dict.fromkeys(("transfer_s", "hidden", "stall_s", "regime"))
        )
        print(
            dumps(
                {
                    "bandwidth_bytes_per_s": args.link,
                    "flops": args.compute,
                    "crossover_tokens": tokens,
                    "crossover_tokens_backward_only": behind_backward,
                    "crossover_assumes": _CROSSOVER_ASSUMES,
                    "bytes": args.bytes,
                    "window_s": args.window,
                    **condition,
                }
            )
        )
        return 0
    if stage is not None:
        print(
            f"overlap: {format_size(args.bytes)} over {format_bandwidth(args.link)} takes "
            f"{format_duration(stage.t_transfer)}; the window is "
            f"{format_duration(stage.t_compute)} → {stage.regime}"
            + (f": the GPU waits {format_duration(stage.stall)}" if stage.stall else "")
        )

    def whole(t: float) -> str:  # the fewest whole tokens that reach T*
        return f"{max(1, math.ceil(t - 1e-9)):,}"

    print(
        f"crossover: T* = R/(2B) = {format_count(args.compute)}FLOP/s ÷ (2 × "
        f"{format_bandwidth(args.link)}): from {whole(behind_backward)} tokens per step with "
        f"backward as the window (an offloaded optimizer's); R/(3B): from {whole(tokens)} with "
        f"all of forward and backward (copies that can start before backward)"
    )
    print(f"  assumes {_CROSSOVER_ASSUMES}")
    return 0


_CROSSOVER_ASSUMES = (
    "optimizer offload of mixed-precision training (2 B per parameter each way: 16-bit "
    "gradients down, 16-bit weights up), full duplex, 6 FLOPs per parameter per token "
    "(4 in backward); the model's size cancels"
)


def _plan_workload(args):
    """The workload of ``plan``: a shipped model, a local config.json or snapshot folder, or a bare
    count.

    A model of a family :mod:`offloadlab.architectures` has a formula for is counted by it
    (``--count auto``, the default: the same count, checked against transformers in the tests, in
    a fraction of a second); any other, or with ``--count transformers``, by transformers' own
    code on the meta device, where transformers is installed."""
    from . import model_count, planner

    given = [
        name
        for name, value in (
            ("--params", args.params),
            ("--model", args.model),
            ("--model-config", args.model_config),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise UsageError(
            f"offloadlab plan: expected exactly one of --params, --model or --model-config; "
            f"got {' and '.join(given) or 'none'}"
        )
    if args.params is not None:
        if args.count != "auto":
            raise UsageError(
                "--count: says how a model's config is counted; --params gives a count, with no "
                "config to count (give --model or --model-config)"
            )
        return planner.Workload(
            args.params,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            batch=args.batch,
            seq=args.seq,
            attention=args.attention,
        )
    if any(v is not None for v in (args.layers, args.hidden, args.heads)):
        raise UsageError(
            "offloadlab plan: --layers/--hidden/--heads go with --params; a model config has its "
            "shape"
        )
    source = args.model if args.model is not None else args.model_config
    if args.model_config is not None and not Path(args.model_config).exists():
        raise UsageError(
            f"--model-config: expected a config.json file or the folder of a model snapshot; got "
            f"{args.model_config!r}"
        )
    if args.count == "transformers" and not model_count.available():
        raise UsageError(
            "--count: transformers is not installed here (pip install transformers), so it cannot "
            "count the model; use --count formula"
        )
    # (the package names its argument "model", or the file it read: the flag typed is named)
    flag = "--model" if args.model is not None else "--model-config"
    try:
        with arguments(model=flag):
            architecture = _architecture(args, source)
    except UsageError as error:
        if str(error).startswith(f"{flag}: "):
            raise
        raise UsageError(f"{flag}: {error}") from None
    if architecture.params > _MAX_PARAMS:  # the bound --params has, so no derived figure overflows
        raise UsageError(
            f"--model-config: expected a model of at most {_MAX_PARAMS:.0e} parameters; "
            f"{source!r} describes {architecture.params:.3g}"
        )
    return planner.Workload.of_model(
        architecture, batch=args.batch, seq=args.seq, attention=args.attention
    )


def _architecture(args, source):
    """The model ``--model`` names or ``--model-config`` holds (an ``Architecture``), counted as
    ``--count`` says."""
    from . import architectures, model_count

    config, name, notes = architectures.read_config(
        source if args.model is not None else Path(source)
    )
    known = config.get("model_type") in architectures.FAMILIES
    if args.count == "formula" or (args.count == "auto" and known) or not model_count.available():
        return dataclasses.replace(architectures.from_config(config, name), notes=notes)
    from .models import saved_bytes_by_layer  # (transformers is here, so torch is too)

    return model_count.architecture(config, name, notes, saved_bytes_by_layer)


_MEASURED_MAX_BYTES = 16 * 2**20  # a probe record is tens of kB; /dev/zero is endless


def _plan_hardware(args):
    """The node of ``plan``: the flags, or an ``offloadlab probe --json`` record with the flags
    over it."""
    from . import planner

    # a checked figure, passed on with its unit (a bare Python number would be bytes)
    def exact(value, unit):
        return None if value is None else f"{value!r} {unit}"

    given = dict(
        gpu_memory=exact(args.gpu_memory, "B"),
        link=exact(args.link, "B/s"),
        host_memory=exact(args.host_memory, "B"),
        cpu_adam=args.cpu_adam,
        compute=args.compute,
        comm_fraction=args.comm_fraction,
        gpus_per_node=args.gpus_per_node,
        interconnect=exact(args.interconnect, "B/s"),
        gpus_per_link=args.gpus_per_link,
        nvme=exact(args.nvme, "B/s"),
        nodes=args.nodes,
        network=exact(args.network, "B/s"),
    )
    if args.measured is None:
        for flag in ("gpu_memory", "link"):
            if given[flag] is None:
                raise UsageError(
                    f"offloadlab plan: --{flag.replace('_', '-')} is required (or --measured FILE)"
                )
        with arguments():
            return planner.Hardware(**given)

    def refused(reason: str) -> UsageError:
        return UsageError(
            f"--measured: expected an `offloadlab probe --json` file; got {args.measured!r} "
            f"({reason})"
        )

    try:
        # a pipe too: --measured <(ssh gpu-host cat probe.json)
        text = files.read_input(args.measured, _MEASURED_MAX_BYTES)
    except OSError as error:
        raise refused(error.strerror or type(error).__name__) from None
    if not text:
        raise refused("empty: nothing was written to it")
    if len(text) > _MEASURED_MAX_BYTES:
        raise refused(f"more than {_MEASURED_MAX_BYTES // 2**20} MiB")
    try:
        record = json.loads(text.decode("utf-8"))
    except ValueError as error:  # UnicodeDecodeError, JSONDecodeError
        raise refused(type(error).__name__) from None
    except RecursionError:  # thousands of nested brackets: no probe record looks like that
        raise refused("nesting too deep to read") from None
    with arguments():
        return planner.Hardware.from_probe(record, **given)


def _cmd_plan(args) -> int:
    from . import engines, planner

    if args.nvme_path is not None and not args.emit:
        raise UsageError("--nvme-path: give it with --emit (the configuration it goes into)")
    if args.nvme_path is not None and not args.nvme_path.strip():
        raise UsageError("--nvme-path: expected a folder on the NVMe drive; got an empty name")
    if args.nvme_path:
        folder = Path(args.nvme_path)
        for part in (folder, *folder.parents):  # (the folder, or the nearest part that exists)
            if part.is_symlink() and not part.exists():
                raise UsageError(f"--nvme-path: {str(part)!r} is a link to nothing")
            if part.exists():
                if not part.is_dir():
                    raise UsageError(
                        f"--nvme-path: expected a folder on the NVMe drive; {str(part)!r} is a file"
                    )
                break
    with arguments():
        work = _plan_workload(args)
    hardware = _plan_hardware(args)
    if hardware.gpus_per_node == 1 and (args.interconnect is not None or args.gpus_per_link != 1):
        raise UsageError(
            "offloadlab plan: --interconnect and --gpus-per-link need --gpus-per-node above 1"
        )
    if isinstance(args.recompute, int) and not 0 <= args.recompute <= work.layers:
        raise UsageError(
            f"--recompute: expected a number of layers from 0 to {work.layers}; got "
            f"{args.recompute}"
        )
    report = planner.plan(work, hardware, recompute=args.recompute, micro_batches=args.accumulation)
    emitted, note = {}, None
    if args.emit:
        if report.chosen is None:
            raise UsageError(
                f"offloadlab plan: --emit {args.emit}: nothing fits on this hardware, so there is "
                f"no configuration to emit (run without --emit to see what binds)"
            )
        options = dict(accumulation=args.accumulation, nvme_path=args.nvme_path)
        if work.architecture is not None:
            options["blocks"] = {
                "gpt2": "model.transformer.h",
                "falcon": "model.transformer.h",
                "bloom": "model.transformer.h",
                "gpt_neox": "model.gpt_neox.layers",
                "opt": "model.model.decoder.layers",
            }.get(work.architecture.family, "model.model.layers")
            if args.model_config is not None:
                # FSDP2's script builds the model from its config alone: the file given, whatever
                # its name; DeepSpeed's loads a snapshot's weights: the folder
                given = Path(args.model_config)
                on_its_own = given.is_dir() or args.emit == "fsdp"
                options["model"] = str(given if on_its_own else given.parent)
        try:
            picked, note = engines.plan_for(report, args.emit)
        except ValueError as error:
            raise UsageError(
                f"offloadlab plan: --emit {args.emit}: {str(error).removeprefix('engine: ')}"
            ) from None
        with arguments():
            chosen = engines.setup(report, args.emit, **options)
        if args.emit == "deepspeed" and report.share is not None:
            chosen, share_note = engines.with_share(chosen, report.share)
            note = "; ".join(n for n in (note, share_note) if n) or None
        if args.emit == "deepspeed":
            emitted = {
                "deepspeed": engines.deepspeed_config(chosen),
                "deepspeed_python": engines.deepspeed_snippet(chosen),
            }
        else:
            emitted = {"fsdp": engines.fsdp_snippet(chosen)}
        emitted["emitted_plan"] = {**picked.to_dict(), "note": note}
    if args.json:
        payload = {
            "params": int(work.params) if float(work.params).is_integer() else work.params,
            "active_params": work.active_params,
            "model": work.architecture.to_dict() if work.architecture else None,
            "gpus_per_node": hardware.gpus_per_node,
            "nodes": hardware.nodes,
            "measured": list(hardware.sources),
            **report.to_dict(),
            **emitted,
        }
        print(dumps(payload, indent=1))
        return 0
    if work.architecture is not None:
        a = work.architecture
        active = (
            f" ({a.active_params:,} active per token: {a.experts_per_token} of {a.experts} experts)"
            if a.experts
            else ""
        )
        print(
            f"model {a.name} ({a.family}): {a.params:,} parameters{active}, exact from its config "
            f"— {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} key/value), "
            f"MLP {a.intermediate}, vocabulary {a.vocab}, head "
            f"{'tied' if a.tied_embeddings else 'untied'}"
        )
        print(f"counted by: {a.counted_by}" + "".join(f"; {n}" for n in a.notes))
    if hardware.gpus > 1:
        print(
            (f"{hardware.nodes} nodes of " if hardware.nodes > 1 else "node: ")
            + f"{hardware.gpus_per_node} GPUs; each gets 1/{hardware.gpus_per_node} of "
            + ("its node's " if hardware.nodes > 1 else "")
            + "host memory and CPU cores"
            + (
                f", and shares its link with {hardware.gpus_per_link - 1} other(s)"
                if hardware.gpus_per_link > 1
                else ""
            )
            + (
                f"; the state is sharded over all {hardware.gpus} GPUs"
                if hardware.nodes > 1
                else ""
            )
        )
    for source in hardware.sources:
        print(f"measured: {source}")
    print(report.explain())
    on_drive = report.chosen is not None and getattr(
        getattr(report.chosen, "layout", None), "nvme_bytes", 0
    )
    if emitted and on_drive and not args.nvme_path:
        print(
            f"\nnote: the plan offloads to NVMe; the config names {engines.NVME_PATH_PLACEHOLDER} "
            f"— pass --nvme-path with a folder on the drive"
        )
    if emitted and args.nvme_path and not on_drive:
        print(
            "\nnote: the plan fits in host memory, so the configuration offloads there and "
            "--nvme-path is unused"
        )
    if note:
        print(f"\nnote: --emit {args.emit}: {note}")
    for name, text in emitted.items():
        if name == "emitted_plan":
            continue
        print(f"\n{name}:")
        print(dumps(text) if isinstance(text, dict) else text)
    return 0


def output_target(path: str | None, force: bool, flag: str = "--json") -> Path | None:
    """The file ``flag`` names, refused now — before a long measurement — if it could not be written
    later: usage errors for a bad name, a folder, a missing folder or an existing file without
    --force; a fault for a folder that refuses new files."""
    if path is None:
        return None
    with arguments():
        try:
            return files.check_target(path, replace=force, name=flag, how_to_replace="--force")
        except OSError as error:
            if error.errno == errno.ENAMETOOLONG:  # the name the user gave, not the machine
                raise UsageError(f"{flag}: the name is too long: {path!r}") from None
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
            faults.append(
                f"{flag}: could not write {target} ({error.strerror or error}); the results are on "
                "stdout"
            )
        else:
            notes.append(done)
    if faults:
        print(text)
    return notes, faults


def show_and_save_json(
    shown: str, text: str, target: Path | None, force: bool, what: str, more: tuple = ()
) -> int:
    """Write ``text`` (``what``, as JSON) to ``--json``'s ``target`` when one is given (and
    ``more`` saves, as :func:`_save` takes them), print ``shown``, then say what was written; a
    write the machine refused is a fault (exit 1)."""

    def write(path):
        files.write_atomically(path, text, force)

    saves = [] if target is None else [("--json", target, write, f"wrote {what} to {target}")]
    notes, faults = _save([*saves, *more], text)
    print(shown)
    for note in notes:
        print(note)
    if faults:
        raise Fault("; ".join(faults))
    return 0


def _cmd_probe(args) -> int:
    from . import ladder, reference

    json_target = output_target(args.json, args.force)
    if args.reference_dir is not None and args.reference is None:
        raise UsageError("--reference-dir: give it with --reference NAME")
    if args.reference_dir is not None and not (
        args.reference_dir and Path(args.reference_dir).is_dir()
    ):
        raise UsageError(
            f"--reference-dir: expected an existing folder; got {args.reference_dir!r}"
        )
    reference_target = None
    if args.reference is not None:
        try:
            reference_target = reference.target(
                args.reference, args.reference_dir, overwrite=args.force, how_to_replace="--force"
            )
        except ValueError as error:  # the name or the folder the user gave
            raise UsageError(f"--reference: {str(error).removeprefix('name: ')}") from None
        except OSError as error:
            if error.errno == errno.ENAMETOOLONG:  # the name the user gave, not the machine
                raise UsageError(f"--reference: the name is too long: {args.reference!r}") from None
            # the folder refuses a file: name the folder and where it came from
            folder = args.reference_dir or reference.user_folder()
            origin = (
                ""
                if args.reference_dir
                else f" (from ${reference.USER_FOLDER_VARIABLE})"
                if os.environ.get(reference.USER_FOLDER_VARIABLE)
                else " (your reference folder)"
            )
            raise Fault(
                f"--reference: cannot write in {str(folder)!r}{origin}: {error.strerror or error}"
            ) from None
    if None not in (json_target, reference_target) and (
        Path(json_target).resolve() == Path(reference_target).resolve()
    ):
        raise UsageError(f"--reference: names the --json file {args.json!r}; give another name")
    if not args.disk or not Path(args.disk).is_dir():
        raise UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
    try:  # the disk is checked before the sweeps: an OSError here is the folder --disk chose
        measured = ladder.measure(quick=args.quick, disk_folder=args.disk)
    except OSError as error:
        raise OSError(error.errno, f"--disk: {error.strerror}") from None
    mine = ladder.of_machine(measured)
    info = measured["machine"]
    records = [r.to_dict() for r in measured["records"]]
    text = dumps({"machine": info.to_dict(), "ladder": mine, "records": records}, indent=1) + "\n"
    saves = []
    if json_target is not None:
        saves.append(
            (
                "--json",
                json_target,
                lambda path: files.write_atomically(path, text, replace=args.force),
                f"wrote {len(records)} records to {json_target}",
            )
        )
    if reference_target is not None:
        kind = "emulated" if info.accelerator.kind == "none" else "measured"
        label = info.accelerator.name or info.cpu
        saves.append(
            (
                "--reference",
                reference_target,
                lambda path: reference.write(
                    path, kind, label, records[0]["provenance"], records, overwrite=args.force
                ),
                f"wrote reference {reference_target}",
            )
        )
    notes, faults = _save(saves, text)
    faults = measured["faults"] + faults
    print(
        f"this machine: {info.cpu}, {info.logical_cores} cores, "
        f"{format_size(info.host_memory_bytes)} RAM; accelerator: {info.accelerator.name or 'none'}"
    )
    print(ladder.table(mine))
    if info.accelerator.kind == "none":
        print(
            "not measured here: GPU memory bandwidth and the real PCIe link (no GPU); "
            "the host↔GPU rows come from the emulated link"
        )
    for note in notes:
        print(note)
    if faults:
        raise Fault("; ".join(faults))
    return 0


def _cmd_bench(args) -> int:
    from . import bench, trace

    target = output_target(args.json, args.force)  # refuse a bad --json before a long run
    trace_target = output_target(args.trace, args.force, "--trace")
    if trace_target is not None and trace_target == target:
        raise UsageError(f"--trace: names the --json file {args.json!r}; give another file")
    if trace_target is not None and args.name not in bench.TIMELINES:
        raise UsageError(
            f"--trace: only bench {' and '.join(bench.TIMELINES)} records a timeline; got bench "
            f"{args.name}"
        )
    if args.disk is not None and args.name != "nvme":
        raise UsageError(f"--disk: only bench nvme uses a disk; got it with bench {args.name}")
    if args.name == "nvme":
        if args.disk == "" or not Path(args.disk or ".").is_dir():  # ('' would be the cwd)
            raise UsageError(f"--disk: expected an existing folder; got {args.disk!r}")
        with arguments():
            try:  # OSError: a fault, found before the run, named by the flag that chose the folder
                bench.check_nvme_folder(args.disk or ".", quick=args.quick)
            except OSError as error:
                raise OSError(error.errno, f"--disk: {error.strerror}") from None
        result = bench.nvme(quick=args.quick, folder=args.disk or ".")
    else:
        if args.name == "adam":
            _refuse_a_stale_peer_build()
        result = getattr(bench, args.name)(quick=args.quick)
    text = dumps(result, indent=1) + "\n"
    more = []
    if trace_target is not None:
        timeline = dumps(trace.chrome_trace(result["timeline"], f"bench {args.name}"))
        more.append(
            (
                "--trace",
                trace_target,
                lambda path: files.write_atomically(path, timeline, args.force),
                f"wrote the timeline to {trace_target} (open it in ui.perfetto.dev)",
            )
        )
    shown = bench.format_result(result)
    return show_and_save_json(shown, text, target, args.force, "the result", tuple(more))


def _refuse_a_stale_peer_build() -> None:
    """bench adam builds DeepSpeed's CPU Adam at first use; a lock left by a killed build made it
    wait forever (issue 37, item 13). The other peers (torchao, Accelerate) build nothing."""
    from . import bench

    lock = bench.stale_peer_build_lock()
    if lock is not None:
        raise Fault(f"bench adam: a killed DeepSpeed build left {lock}: delete it, then run again")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = Parser(prog="offloadlab", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"offloadlab {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    state = commands.add_parser("state", help="bytes of training state for a model size")
    state.add_argument("--params", required=True, type=_PARAMS, help="parameter count, e.g. 10e9")
    state.add_argument(
        "--recipe", default=memory.DEFAULT_RECIPE, help=f"one of {', '.join(memory.RECIPES)}"
    )
    state.add_argument("--json", action="store_true", help="print a JSON object")
    state.set_defaults(run=_cmd_state)

    budget = commands.add_parser(
        "budget", help="the per-step bandwidth budget and an offload's verdict"
    )
    budget.add_argument(
        "--link", required=True, type=_BANDWIDTH, help="one direction's bandwidth, e.g. '25 GB/s'"
    )
    budget.add_argument(
        "--window", required=True, type=_DURATION, help="compute time to hide behind, e.g. '250 ms'"
    )
    budget.add_argument(
        "--params", type=_PARAMS, help="parameter count, e.g. 10e9 (given with --offload)"
    )
    budget.add_argument(
        "--offload",
        type=_name_list,
        help="comma-separated: optimizer, gradients, parameters, park-and-copy (given with "
        "--params)",
    )
    budget.add_argument(
        "--duplex",
        default="full",
        type=_duplex,
        help="full (default: both directions at once, each at its one-way rate), half (they share "
        "it), or the rate each direction keeps while both run, e.g. '20 GB/s'",
    )
    budget.add_argument(
        "--recipe",
        default=memory.DEFAULT_RECIPE,
        help=f"bytes per parameter of each kind of state: one of {', '.join(memory.RECIPES)}",
    )
    budget.add_argument(
        "--micro-batches",
        type=_positive_int,
        default=1,
        help="forward and backward passes per optimizer step (default 1); --window is all of "
        "their compute",
    )
    budget.add_argument("--json", action="store_true", help="print a JSON object")
    budget.set_defaults(run=_cmd_budget)

    overlap = commands.add_parser(
        "overlap", help="the overlap condition and the crossover tokens T*"
    )
    overlap.add_argument(
        "--link", required=True, type=_BANDWIDTH, help="one direction's bandwidth, e.g. '25 GB/s'"
    )
    overlap.add_argument(
        "--compute", required=True, type=_FLOPS, help="sustained FLOP/s of the GPU, e.g. 200e12"
    )
    overlap.add_argument(
        "--bytes", type=_SIZE, help="bytes one direction moves in the step, e.g. '20 GB'"
    )
    overlap.add_argument(
        "--window", type=_DURATION, help="compute the copy can hide behind, e.g. '250 ms'"
    )
    overlap.add_argument("--json", action="store_true", help="print a JSON object")
    overlap.set_defaults(run=_cmd_overlap)

    plan = commands.add_parser(
        "plan", help="what to offload, in what order, and the predicted step"
    )
    plan.add_argument(
        "--params", type=_PARAMS, help="parameter count, e.g. 30e9 (or --model / --model-config)"
    )
    plan.add_argument("--model", help="a shipped model config: " + ", ".join(_shipped_models()))
    plan.add_argument(
        "--model-config",
        metavar="PATH",
        help="a Hugging Face config.json, or the folder of a model snapshot, to count exactly",
    )
    plan.add_argument(
        "--count",
        choices=["auto", "transformers", "formula"],
        default="auto",
        help="how a model is counted: auto (default: the formula for a family it knows, else "
        "transformers' meta-device build when installed), transformers, or formula",
    )
    plan.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="sdpa (default: flash or memory-efficient attention, no seq × seq scores kept) or "
        "eager",
    )
    plan.add_argument(
        "--recompute",
        type=_recompute,
        default="auto",
        help="activation checkpointing: auto (default: none, every layer, or the fewest layers "
        "that fit), none, all, or a number of layers",
    )
    plan.add_argument(
        "--gpu-memory", type=_SIZE, help="GPU memory, e.g. '80 GB' (or from --measured)"
    )
    plan.add_argument(
        "--link",
        type=_BANDWIDTH,
        help="host↔GPU bandwidth per direction, e.g. '25 GB/s' (or from --measured)",
    )
    plan.add_argument(
        "--measured", metavar="FILE", help="an `offloadlab probe --json` record of this machine"
    )
    plan.add_argument(
        "--gpus-per-node",
        type=_positive_int,
        default=1,
        help="GPUs sharing the node's host memory and cores (default 1)",
    )
    plan.add_argument(
        "--interconnect",
        type=_BANDWIDTH,
        help="GPU↔GPU bandwidth per direction, e.g. '450 GB/s' (default: assumed)",
    )
    plan.add_argument(
        "--nodes",
        type=_positive_int,
        default=1,
        help="nodes of --gpus-per-node GPUs each, the state sharded over them all (default 1)",
    )
    plan.add_argument(
        "--network",
        type=_BANDWIDTH,
        help="bandwidth between nodes, per GPU and direction, e.g. '50 GB/s' for a 400 Gb/s NIC "
        "(default: assumed)",
    )
    plan.add_argument(
        "--gpus-per-link",
        type=_positive_int,
        default=1,
        help="GPUs sharing one host link, e.g. 2 behind one PCIe switch (default 1)",
    )
    plan.add_argument(
        "--host-memory", type=_SIZE, help="host memory, e.g. '2 TB' (default: unlimited)"
    )
    plan.add_argument("--batch", type=_positive_int, default=1, help="micro-batch size (default 1)")
    plan.add_argument(
        "--seq", type=_positive_int, default=2048, help="sequence length (default 2048)"
    )
    plan.add_argument(
        "--layers", type=_positive_int, help="transformer layers (with --hidden and --heads)"
    )
    plan.add_argument("--hidden", type=_positive_int, help="hidden size")
    plan.add_argument("--heads", type=_positive_int, help="attention heads")
    plan.add_argument(
        "--compute",
        type=_FLOPS,
        help="sustained FLOP/s of the GPU, e.g. '400 TFLOP/s' or 400e12 (default: assumed)",
    )
    plan.add_argument(
        "--cpu-adam",
        type=_PARAMS_PER_S,
        help="CPU Adam throughput in params/s, e.g. 3e9 or '3 G/s' (default: assumed)",
    )
    plan.add_argument(
        "--comm-fraction",
        type=_FRACTION,
        default=0.0,
        help="fraction of the step already spent communicating (0–1)",
    )
    plan.add_argument(
        "--emit", choices=["deepspeed", "fsdp"], help="also print an equivalent configuration"
    )
    plan.add_argument(
        "--accumulation",
        type=_positive_int,
        default=1,
        help="micro-batches per optimizer step (default 1): the compute an offloaded optimizer's "
        "traffic hides behind, whether its share is parked or updated in place, and --emit's "
        "gradient accumulation",
    )
    plan.add_argument(
        "--nvme",
        type=_BANDWIDTH,
        help="plan on NVMe when host memory is short: the drive's sustained rate, e.g. '3 GB/s'",
    )
    plan.add_argument(
        "--nvme-path",
        help="with --emit: the folder on the NVMe drive that an NVMe plan offloads to",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON object")
    plan.set_defaults(run=_cmd_plan)

    probe = commands.add_parser("probe", help="measure this machine's memory tiers and links")
    probe.add_argument(
        "--quick", action="store_true", help="small sizes: seconds on a CPU-only machine"
    )
    probe.add_argument("--disk", default=".", help="folder whose disk to measure (default: here)")
    probe.add_argument("--json", metavar="FILE", help="write every record to FILE")
    probe.add_argument(
        "--reference",
        metavar="NAME",
        help="also save the records as reference data NAME, in your reference folder "
        "($OFFLOADLAB_REFERENCE_DIR, else ~/.local/share/offloadlab/reference)",
    )
    probe.add_argument(
        "--reference-dir",
        metavar="DIR",
        help="save the --reference file in DIR instead (make gpu-check: offloadlab/reference)",
    )
    probe.add_argument(
        "--force", action="store_true", help="replace an existing --json or --reference file"
    )
    probe.set_defaults(run=_cmd_probe)

    bench = commands.add_parser("bench", help="benchmarks against peers, reported as ratios")
    bench.add_argument(
        "name",
        choices=["link", "overlap", "adam", "offload", "activations", "fsdp", "prefetch", "nvme"],
        help="what to benchmark",
    )
    bench.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    bench.add_argument("--json", metavar="FILE", help="write the result to FILE")
    bench.add_argument(
        "--trace",
        metavar="FILE",
        help="write the recorded timeline to FILE, for Perfetto (bench activations)",
    )
    bench.add_argument(
        "--force", action="store_true", help="replace an existing --json or --trace file"
    )
    bench.add_argument(
        "--disk", metavar="DIR", help="folder for bench nvme's scratch files (default: here)"
    )
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


def _print_what_the_terminal_can_show() -> None:
    """Output in an encoding without →, ×, — (PYTHONIOENCODING=latin-1, an old terminal) shows
    them as '?' rather than failing halfway through a report."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError):  # not a text file (captured in a test)
            pass


def _error(message: str) -> None:
    print(f"offloadlab: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the command line ``argv`` (with ``parser``: another command's, whose subcommands set
    ``run`` as these do); returns the exit status (see the module's docstring)."""
    if sys.stdout is None:  # started with standard output closed (`>&-`)
        _error("standard output is closed; run the command with it open (or redirect it to a file)")
        return FAULT
    _print_what_the_terminal_can_show()
    args = None
    try:
        try:
            args = (parser or build_parser()).parse_args(argv)
        except SystemExit:  # --help, printed: sent to a full disk or a closed pipe, it fails here
            sys.stdout.flush()
            raise
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below
        return status
    except UsageError as error:
        _error(_named_as_typed(str(error), args))
        return USAGE_ERROR
    except BrokenPipeError:  # before OSError, of which it is a kind
        _stdout_gone()
        return READER_GONE
    except Fault as error:
        _error(str(error))
        return FAULT
    except OSError as error:  # what the machine refused: a disk, a file system, a device
        _error(
            f"{error.filename}: {error.strerror}"
            if error.filename and error.strerror
            else error.strerror or str(error)
        )
        _stdout_gone()  # what could not be written is not written again at exit
        return FAULT
    except KeyboardInterrupt:
        _error("interrupted")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
