"""``lightning-resilient``: the operator's command line, the package above every other.

This module owns the parser and the entry point (``main``, ``build_parser``, and ``train``, which hands its arguments
to LightningCLI). Each group of subcommands is a module that registers itself here through an
``add_commands(subparsers)`` function, and every subcommand sets ``func(args) -> int`` (the exit status):

- :mod:`~lightning_resilient.cli.root_commands`: ``ls``, ``verify``, ``gc``, ``export`` and ``goodput``, on a
  checkpoint root (``io/``) and its training run's attempt records and goodput ledger (``state/``).
- :mod:`~lightning_resilient.cli.planning_commands`: ``cadence`` and ``cost`` (``planning/``).
- :mod:`lightning_resilient.demo`: ``demo``.

The command line sits above ``io/``, ``planning/`` and ``state/``, so those import none of it and neither imports a
layer above it. The command modules import torch, Lightning and the cloud clients only inside the commands, so
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Modules that contribute subcommands, each with ``add_commands(subparsers)``.
_COMMAND_MODULES = (
    "lightning_resilient.cli.root_commands",
    "lightning_resilient.cli.planning_commands",
    "lightning_resilient.demo",
)

_TRAIN_HELP = """\
usage: lightning-resilient train {fit,validate,test,predict} -c CONFIG [-c CONFIG ...]
                                 [--OPTION VALUE ...]

LightningCLI (ResilientCLI) with auto-resume: fit resumes from the newest committed checkpoint
under the ModelCheckpoint dirpath, or starts fresh when there is none, so after a kill the
same command is simply run again.

  lightning-resilient train fit -c configs/base.yaml -c configs/local.yaml
  lightning-resilient train fit -c configs/base.yaml -c configs/local.yaml --trainer.max_steps 500

options of fit beside LightningCLI's own (-c/--config, --trainer.*, --model.*, --data.*,
--ckpt_path):
  --auto_resume BOOL  look up the checkpoint to resume from when no --ckpt_path is given
                      (default true)

lightning-resilient train fit --help lists every option of the trainer, model and data (it
imports Lightning: a few seconds). Needs the [cli] extra: pip install 'lightning-resilient[cli]'.
"""


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


def _train(argv: list[str]) -> int:
    """``lightning-resilient train ARGS``: LightningCLI parses ARGS (fit/validate/..., -c, --trainer.*) itself."""
    if argv in ([], ["-h"], ["--help"]):
        # LightningCLI's own help needs Lightning imported; the short one answers at once.
        print(_TRAIN_HELP, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from lightning_resilient._extras import MissingExtraError, require
    from lightning_resilient.errors import StoreSetupError

    try:
        require("cli", "lightning-resilient train")
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)  # "lightning-resilient train: needs ...: pip install ..."
        return 2
    from lightning_resilient.training_cli import main as train

    try:
        train(argv)
    except StoreSetupError as exc:  # a missing bucket, no credentials, a URL no filesystem knows: one line
        print(f"lightning-resilient train: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return _train(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))
