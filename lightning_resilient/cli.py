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
    "lightning_resilient.io.commands",
    "lightning_resilient.planning.commands",
    "lightning_resilient.demo",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="lightning-resilient",
        description="Inspect, verify and clean checkpoint roots; plan checkpoint cadence and cluster cost; train"
                    " through LightningCLI with auto-resume; run the demo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("train", help="LightningCLI with auto-resume: lightning-resilient train fit -c CONFIG ..."
                                 " (everything after 'train' goes to LightningCLI)", add_help=False)
    for module in _COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        # LightningCLI parses its own arguments (fit/validate/..., -c, --trainer.*): hand them over untouched.
        from lightning_resilient.training_cli import main as train

        train(argv[1:])
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
