"""The benchmark scripts run end to end (tiny sizes, on the CPU); their figures are not checked here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests import procs

BENCH = Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.subprocess = procs.SUBPROCESS  # its worker processes are forked from the suite's server (tests/procs.py)
    return module


def test_precision_benchmark_smoke(tmp_path):
    text = load("precision_gpu").main(["--device", "cpu", "--d-model", "32", "--heads", "2", "--batch", "2",
                                       "--seq", "8", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "p")])
    assert "AutoPrecision chooses:" in text
    assert text.count("(chosen)") == 1
    for precision in ("bf16-mixed", "16-mixed", "32-true"):
        assert f"| {precision}" in text
    written = (tmp_path / "p.md").read_text()
    assert written.startswith("# Mixed precision") and "Machine: " in written


@pytest.mark.slow  # nine fresh interpreters (each command's --help): test_cli_first_hour.py checks the --help texts
def test_first_hour_benchmark_smoke(tmp_path):
    """--help timings only (the demo is test_demo's); the suite time is recorded, not run."""
    text = load("first_hour").main(["--no-demo", "--runs", "1", "--out", str(tmp_path / "f"), "--suite-time", "17:18",
                                    "--suite-source", "a CI run"])
    assert "Machine: " in text and "| `lightning-resilient ls --help` |" in text
    assert "| `make test` (the whole suite) | 17:18 | a CI run |" in text
    assert json.loads((tmp_path / "f.json").read_text())["help"][0]["median_s"] > 0


@pytest.mark.slow
def test_checkpoint_io_benchmark_smoke(tmp_path):
    bench = load("checkpoint_io")
    out = tmp_path / "result"
    # (tiered: on the modelled store below; s3torchconnector writes S3 only and is left out of a local run)
    local = [m for m in bench.METHODS if m not in ("ours-tiered", "s3torchconnector")]
    text = bench.main(["--sizes", "4", "--runs", "1", "--stores", "local", "--methods", *local, "--pause", "0",
                       "--out", str(out)])
    for method in local:
        assert f"| local | {method} |" in text
    assert "## Targets" in text and (tmp_path / "result.png").stat().st_size > 0
    runs = json.loads((tmp_path / "result.json").read_text())["runs"]
    assert {r["method"] for r in runs} == set(local)
    assert all(r["save"] > 0 and r["load"] > 0 and r["blocked"] <= r["save"] for r in runs)
    # The modelled store: moto and the latency proxy, each in their own process, stopped afterwards.
    text = bench.main(["--sizes", "4", "--runs", "1", "--stores", "s3-latency", "--methods", "ours-sync", "ours-async",
                       "ours-tiered", "s3torchconnector", "--latency", "0.01", "--pause", "0", "--out", str(out)])
    assert "| s3-latency | ours-async |" in text and "| s3-latency | ours-tiered |" in text
    # Where each save's CPU went: the client, moto and the proxy, each read (the servers' in clock ticks of 10 ms,
    # which a 4 MB save may not fill), and the client's own surely spent.
    assert "## Where a save's CPU went" in text and "| 4 MB | s3-latency | ours-sync |" in text
    modelled = [r for r in json.loads((tmp_path / "result.json").read_text())["runs"] if r["method"] == "ours-sync"]
    assert modelled and all(r["save_cpu_client"] > 0 for r in modelled)
    assert all(r[f"save_cpu_{who}"] >= 0 for r in modelled for who in ("store", "proxy"))  # (NaN: unread, fails)
    # AWS's S3LightningCheckpoint, where benchmarks/requirements.txt is installed (never a dependency of the package)
    if importlib.util.find_spec("s3torchconnector") is not None:
        assert "| s3-latency | s3torchconnector |" in text
        assert "| save >= 1.5x faster than s3torchconnector | s3-latency |" in text
    else:
        assert "| s3torchconnector |" not in text
    # The tiered rows: both resumes measured, the store bytes per hour, and their targets checked.
    assert "## Tiered (local tier + store)" in text and "| 4 MB | s3-latency |" in text
    assert "| tiered blocked <= async blocked | s3-latency |" in text
    assert "| resume from local tier >= 5x faster than from the store | s3-latency |" in text


@pytest.mark.slow
def test_scaling_benchmark_smoke(tmp_path):
    from lightning_resilient.planning import SCALING_SCHEMA, load_scaling

    bench = load("scaling")
    # The GPU path's decisions, fed GPU facts (CI has no GPU).
    assert bench.default_world_sizes(8) == [1, 2, 4, 8] and bench.default_world_sizes(6) == [1, 2, 4, 6]
    assert bench.launched_world({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == (8, 2)
    assert bench.launched_world({"SLURM_NTASKS": "32", "SLURM_NNODES": "4"}) == (8, 4)
    assert bench.launched_world({}) is None
    gpu = bench.trainer_kwargs({"device": "cuda", "devices": 8, "num_nodes": 2, "precision": "bf16-mixed",
                                "warmup": 2, "steps": 3, "accumulate": 4})
    assert (gpu["accelerator"], gpu["strategy"], gpu["max_steps"]) == ("gpu", "ddp", 5)

    out = tmp_path / "scaling"
    text = bench.main(["--device", "cpu", "--world-sizes", "1", "2", "--steps", "4", "--warmup", "1",
                       "--every-n-steps", "2", "--out", str(out)])
    doc = json.loads((tmp_path / "scaling.json").read_text())
    assert doc["schema"] == SCALING_SCHEMA and set(doc) == {"schema", "model", "machine", "results"}
    assert [r["world_size"] for r in doc["results"]] == [1, 2]
    assert [r["global_batch"] for r in doc["results"]] == [16, 32]
    for r in doc["results"]:
        assert r["throughput_samples_per_s"] > 0 and r["step_seconds"] > 0 and r["load_seconds"] > 0
        assert r["save_seconds"] > 0 and 0 < r["checkpoint_overhead_fraction"] < 1 and r["saves"] == 2
    assert doc["results"][0]["scaling_efficiency"] == 1.0
    assert doc["results"][1]["cluster_environment"] == "LightningEnvironment"  # two ranks, started by Lightning
    assert "| 1 | 16 |" in text and "| 2 | 32 |" in text and doc["machine"] in text
    options = load_scaling(tmp_path / "scaling.json", price_per_gpu_hour=2.0, samples_to_target=10_000)
    assert [o.gpus for o in options] == [1, 2]
    assert (tmp_path / "scaling.png").stat().st_size > 0


@pytest.mark.slow
def test_scaling_nodes_simulation_smoke(tmp_path):
    """The script's --nodes path (its launcher, its counting proxy per node) with one node of 2 processes, trained then
    resumed once with and once without the node cache: the fewest processes that show the contrast. Two nodes of two
    processes each, one store read per node, are proven by tests/io/test_multinode.py."""
    bench = load("scaling")
    out = tmp_path / "nodes"
    text = bench.main(["--nodes", "1", "--procs-per-node", "2", "--runs", "1", "--width", "128",
                       "--every-n-steps", "2", "--out", str(out)])
    doc = json.loads((tmp_path / "nodes.json").read_text())
    assert doc["schema"] == "lightning_resilient.scaling_nodes/1"
    assert {"model", "machine", "nodes", "procs_per_node", "runs", "commit", "checkpoint_bytes", "resumed_step",
            "load_definition", "resume_definition", "results", "per_run"} <= set(doc)
    assert (doc["nodes"], doc["procs_per_node"], doc["runs"], doc["resumed_step"]) == (1, 2, 1, 4)
    assert "-step=4.ckpt/" in doc["commit"] and doc["checkpoint_bytes"] > 100_000  # ~0.6 MB: data dominates
    rows = {(r["node_cache"], r["node"]): r for r in doc["results"]}
    assert set(rows) == {(True, 0), (False, 0)}
    size = doc["checkpoint_bytes"]
    for (cache, node), r in rows.items():
        assert r["runs"] == 1 and r["store_reads"] > 0
        assert 0 < r["load_seconds"] < r["resume_seconds"] and r["load_start_seconds"] < r["resume_seconds"]
        # Bytes counted on the wire through this node's proxy, against the commit's size listed on the store: with
        # the node cache one process of the node reads every object and the other only the manifest (~1x); without
        # it each of the 2 processes reads every object (>= 2x), which shows the counting sees every process.
        per_checkpoint = r["checkpoint_bytes_read"] / size
        if cache:
            assert 1.0 <= per_checkpoint < 1.3 and r["bytes_read_ratio"] < 1.4, (node, r)
        else:
            assert 2.0 <= per_checkpoint < 2.3, (node, r)
        assert r["store_bytes_read"] >= r["checkpoint_bytes_read"]
    assert "| node cache | node | store reads | MB read | x checkpoint | load s | resume s |" in text
    assert "| on | 0 |" in text and "| off | 0 |" in text and doc["machine"] in text
    assert (tmp_path / "nodes.md").read_text().startswith("# Multi-node resume")


@pytest.mark.slow
def test_preemption_benchmark_smoke(tmp_path):
    text = load("preemption").main(["--sizes", "5", "--stores", "local", "--runs", "1", "--out", str(tmp_path / "p")])
    doc = json.loads((tmp_path / "p.json").read_text())
    (row,) = doc["rows"]
    assert row["size_mb"] == 5 and row["store"] == "local"
    assert 0 < row["save_s"] <= row["to_commit_s"] < row["to_exit_s"]  # measured from the signal: save, then exit
    assert "| 5 MB | local |" in text


@pytest.mark.slow
def test_resume_audit_benchmark_smoke(tmp_path):
    text = load("resume_audit").main(["--steps", "5", "--runs", "1", "--trainer-steps", "6",
                                      "--out", str(tmp_path / "a")])
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["schema"] == "lightning_resilient.resume_audit/1" and doc["machine"] in text
    assert {(w["batch"], w["store"]) for w in doc["audit_work"]} == {
        (b, s) for b in ("tokens 8x512", "images 64x3x224x224")
        for s in ("local disk", "object store (memory://) + node spool")}
    assert [t["steps_between_saves"] for t in doc["store_traffic"]] == [100, 1000]
    assert doc["store_traffic"][0]["requests_per_hour"] == 120 and "requests per hour" in text
    assert doc["trainer"]["hooks_on_s"] > 0 and doc["trainer"]["hooks_off_s"] > 0
    assert "| audit=True (default) |" in text and "## Target" in text
    assert (tmp_path / "a.md").read_text().startswith("# Resume audit")


@pytest.mark.slow
def test_step_time_benchmark_smoke(tmp_path):
    """An async save (this checkout against itself as the baseline) and a replication between 2 gloo processes."""
    text = load("step_time").main(["--size-mb", "4", "--runs", "1", "--idle-steps", "2", "--ops", "10", "--loops",
                                   "gpu", "--cases", "async-save", "replicate", "--baseline", str(BENCH.parent),
                                   "--out", str(tmp_path / "s")])
    assert "| async-save (baseline) | gpu |" in text and "| async-save | gpu |" in text
    assert "| replicate | gpu |" in text and "receiver's tier" in text
    summary = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert summary["async-save/gpu"]["background_s"] > 0
    assert summary["replicate/gpu"]["tier1_mb"] >= 4  # the whole commit on the receiving node


@pytest.mark.parametrize("store", ["local", pytest.param("s3-latency", marks=pytest.mark.slow)])
def test_incremental_benchmark_smoke(tmp_path, store):
    text = load("incremental").main(["--base-mib", "4", "--saves", "3", "--repeat", "1",
                                     "--dir", str(tmp_path), "--store", store, "--out", str(tmp_path / "i")])
    assert "| lora | sync | on |" in text and "| full | async | off |" in text
    runs = json.loads((tmp_path / "i.json").read_text())["runs"]
    for background in (False, True):
        lora = next(r for r in runs if r["case"] == "lora" and r["dedup"] and r["async"] == background)
        assert lora["saves"][-1]["written"] <= 4 * lora["trainable_bytes"]
