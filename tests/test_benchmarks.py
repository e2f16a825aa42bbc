"""The benchmark scripts run end to end (tiny sizes, on the CPU); their figures are not checked here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_precision_benchmark_smoke():
    text = load("precision_gpu").main(["--device", "cpu", "--d-model", "32", "--heads", "2", "--batch", "2",
                                       "--seq", "8", "--steps", "2", "--warmup", "1"])
    assert "AutoPrecision chooses:" in text
    assert text.count("(chosen)") == 1
    for precision in ("bf16-mixed", "16-mixed", "32-true"):
        assert f"| {precision}" in text
