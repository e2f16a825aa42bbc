"""``python -m lightning_resilient.cli``: the ``lightning-resilient`` command without its console script, as the demo
runs its training jobs from a source tree that was never installed."""

from __future__ import annotations

import sys

from lightning_resilient.cli import main

sys.exit(main())
