"""The ``offloadlab`` command.

Each subcommand prints a human-readable table by default and a JSON object with
``--json``. Bad arguments print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import memory
from .units import format_count, format_size

USAGE_ERROR = 2


class UsageError(Exception):
    """A bad argument: reported as one line on stderr, exit status 2."""


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
    print("fits on: " + (", ".join(fits) + " cards" if fits else f"none of {', '.join(memory.GPU_SIZES)}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offloadlab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    state = commands.add_parser("state", help="bytes of training state for a model size")
    state.add_argument("--params", required=True, help="parameter count, e.g. 10e9")
    state.add_argument("--recipe", default=memory.DEFAULT_RECIPE, help=f"one of {', '.join(memory.RECIPES)}")
    state.add_argument("--json", action="store_true", help="print a JSON object")
    state.set_defaults(run=_cmd_state)
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
