"""``python -m lightning_resilient.cli`` (``cli/__main__.py``): the command without its console script, as the demo
runs its training jobs from a source tree that was never installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_python_m_runs_the_command_and_returns_its_exit_status():
    # A fresh interpreter is the point: `-m` on a package runs its __main__.py, not its __init__.py as a script.
    ok = subprocess.run([sys.executable, "-m", "lightning_resilient.cli", "--help"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: lightning-resilient"), ok.stderr
    bad = subprocess.run([sys.executable, "-m", "lightning_resilient.cli"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: lightning-resilient"), bad.stderr
