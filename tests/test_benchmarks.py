"""The benchmark scripts run end to end (tiny sizes, on the CPU); their figures are not checked here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_checkpoint_io_benchmark_smoke(tmp_path):
    bench = load("checkpoint_io")
    out = tmp_path / "result"
    text = bench.main(["--sizes", "4", "--runs", "1", "--stores", "local", "--out", str(out)])
    for method in bench.METHODS:
        assert f"| local | {method} |" in text
    assert "## Targets" in text and (tmp_path / "result.png").stat().st_size > 0
    runs = json.loads((tmp_path / "result.json").read_text())["runs"]
    assert {r["method"] for r in runs} == set(bench.METHODS)
    assert all(r["save"] > 0 and r["load"] > 0 and r["blocked"] <= r["save"] for r in runs)
    # The modelled store: moto and the latency proxy, each in their own process, stopped afterwards.
    text = bench.main(["--sizes", "4", "--runs", "1", "--stores", "s3-latency", "--methods", "raw", "ours-async",
                       "--latency", "0.01", "--out", str(out)])
    assert "| s3-latency | ours-async |" in text
