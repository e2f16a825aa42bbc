"""``lightning-resilient``: the operator's command line.

Each group of subcommands lives next to the code it drives and registers itself here through an
``add_commands(subparsers)`` function; every subcommand sets ``func(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Modules that contribute subcommands, each with ``add_commands(subparsers)``.
_COMMAND_MODULES = (
    "lightning_resilient.planning.commands",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="lightning-resilient",
        description="Inspect, verify and clean checkpoint roots; plan checkpoint cadence and cluster cost.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
