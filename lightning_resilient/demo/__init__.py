"""The demo: every plugin on, a training job SIGKILLed mid-upload on an embedded S3 server, resumed bit for bit.

``DemoModel`` and ``DemoData`` are what the example configs in ``configs/`` train; ``AnnouncingCheckpointIO`` lets
the demo driver see its saves. They are imported on first use (PEP 562), so that ``lightning-resilient --help``
does not import Lightning. Run the demo with ``make demo``, ``lightning-resilient demo`` or
``python -m lightning_resilient.demo``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lightning_resilient._lazy import lazy_exports

__all__ = ["AnnouncingCheckpointIO", "DemoData", "DemoModel", "add_commands", "main"]

_WHERE = {
    "AnnouncingCheckpointIO": "lightning_resilient.demo.events",
    "DemoData": "lightning_resilient.demo.model",
    "DemoModel": "lightning_resilient.demo.model",
}

if TYPE_CHECKING:
    from lightning_resilient.demo.events import AnnouncingCheckpointIO
    from lightning_resilient.demo.model import DemoData, DemoModel

# What `--help` shows (plain text: argparse prints it as it is).
DESCRIPTION = """\
Train a small model through lightning-resilient train with every plugin on, checkpointing to
an S3 server (moto) started in this process; SIGKILL the job in the middle of a checkpoint
upload; run the same command again (it resumes from the newest committed checkpoint); run
the same training uninterrupted; and print a post-mortem: what the kill hit, what the
restart resumed from, and whether the final weights are bit-identical. Writes its configs,
the report and a loss plot under --out-dir. Needs the [demo] extra (pip install 'lightning-
resilient[demo]').
"""


__getattr__, __dir__ = lazy_exports('lightning_resilient.demo', _WHERE, globals())


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps to train (default 60)")
    parser.add_argument("--kill-step", type=int, default=30,
                        help="kill the job while it uploads this step's checkpoint (a multiple of --every; default 30)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many optimizer steps (default 10)")
    parser.add_argument("--out-dir", default="demo_output",
                        help="where configs, records, report and plot go (default demo_output; emptied first)")
    parser.add_argument("--preempt", action="store_true",
                        help="instead of a SIGKILL mid-upload, a preemption notice (SIGTERM) after the checkpoint of"
                             " --kill-step: PreemptionCheckpoint saves the step in progress, the restart recomputes"
                             " none")


def _run(args: argparse.Namespace) -> int:
    from lightning_resilient._extras import MissingExtraError, require
    from lightning_resilient.demo.driver import run_demo, scenario_error

    problem = scenario_error(args.max_steps, args.kill_step, args.every, flags=True)
    if problem:
        print(f"lightning-resilient demo: {problem}", file=sys.stderr)
        return 2
    try:
        require("demo", "lightning-resilient demo")  # before any work, not after three trainings
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)  # "lightning-resilient demo: needs ...: pip install ..."
        return 2

    try:
        return run_demo(max_steps=args.max_steps, kill_step=args.kill_step, every=args.every, out_dir=args.out_dir,
                        preempt=args.preempt)
    except ValueError as exc:
        print(f"lightning-resilient demo: {exc}", file=sys.stderr)
        return 2


def add_commands(subparsers: Any) -> None:
    """Register ``lightning-resilient demo``."""
    parser = subparsers.add_parser("demo", help="train, SIGKILL mid-upload, resume: the whole suite on embedded S3",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(parser)
    parser.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_resilient.demo", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(parser)
    return _run(parser.parse_args(argv))
