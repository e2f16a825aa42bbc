"""The cluster cost model: the worked example exactly, the value of time, the scaling benchmark's JSON, bad input."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lightning_resilient.planning import SCALING_SCHEMA, ClusterOption, compare, load_scaling

BIG = ClusterOption("256 GPUs", 256, 2.0, hours=48)
SMALL = ClusterOption("64 GPUs", 64, 2.0, hours=192)


@pytest.mark.parametrize("order", [[BIG, SMALL], [SMALL, BIG]])
def test_worked_example_equal_cost_so_the_faster_one_wins(order):
    c = compare(order)
    costs = {row.name: row.cost for row in c.rows}
    assert costs == {"256 GPUs": 24_576.0, "64 GPUs": 24_576.0}  # 256 x 2 x 48 and 64 x 2 x 192, exactly
    assert {row.name: row.hours for row in c.rows} == {"256 GPUs": 48.0, "64 GPUs": 192.0}
    assert all(row.total_cost == row.cost for row in c.rows)  # time has no value here
    assert c.winner.name == c.faster.name == c.cheaper.name == "256 GPUs"
    assert c.reason == "equal cost ($24,576.00 each), so the faster one: 256 GPUs takes 48.0 h instead of 192.0 h"
    assert [row.name for row in c.rows] == [o.name for o in order]  # rows keep the caller's order


def test_the_value_of_time_changes_the_winner():
    slow = ClusterOption("64 GPUs", 64, 2.0, hours=100)  # $12,800
    fast = ClusterOption("256 GPUs", 256, 2.0, hours=30)  # $15,360
    plain = compare([slow, fast])
    assert plain.winner.name == plain.cheaper.name == "64 GPUs" and plain.faster.name == "256 GPUs"
    assert plain.reason == ("64 GPUs costs less ($12,800.00 vs $15,360.00 for 256 GPUs) although it takes longer"
                            " (100.0 h vs 30.0 h)")

    timed = compare([replace(slow, value_per_hour=100.0), replace(fast, value_per_hour=100.0)])
    totals = {row.name: (row.cost, row.time_value, row.total_cost) for row in timed.rows}
    assert totals == {"64 GPUs": (12_800.0, 10_000.0, 22_800.0), "256 GPUs": (15_360.0, 3_000.0, 18_360.0)}
    assert timed.winner.name == "256 GPUs"
    assert timed.reason == ("counting the value of time, 256 GPUs is both cheaper ($18,360.00 vs $22,800.00 for"
                            " 64 GPUs) and faster (30.0 h vs 100.0 h)")


def test_hours_from_work_and_throughput():
    # 7.2e6 samples at 1000 samples/s = 7200 s = 2 h, however the work and the throughput are given.
    forms = [
        ClusterOption("a", 8, 3.0, throughput=1000.0, samples_to_target=7.2e6),
        ClusterOption("b", 8, 3.0, base_throughput=125.0, scaling_efficiency=1.0, samples_to_target=7.2e6),
        ClusterOption("c", 8, 3.0, throughput=1000.0, steps_to_target=7200, global_batch=1000),
        ClusterOption("d", 16, 3.0, base_throughput=125.0, scaling_efficiency=0.5, samples_to_target=7.2e6),
    ]
    for option in forms:
        assert option.wall_hours == pytest.approx(2.0, rel=1e-12)
    assert replace(forms[0], overhead_fraction=0.2).wall_hours == pytest.approx(2.5, rel=1e-12)
    assert compare(forms).rows[0].cost == pytest.approx(8 * 3.0 * 2.0)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"name": ""}, ValueError, "name must be a non-empty string"),
    ({"gpus": 0}, ValueError, "option 'x': gpus must be an int >= 1, got 0"),
    ({"gpus": 2.5}, TypeError, "gpus must be an int >= 1, got float 2.5"),
    ({"gpus": True}, TypeError, "gpus must be an int >= 1"),
    ({"price_per_gpu_hour": -1}, ValueError, "price_per_gpu_hour must be >= 0, got -1"),
    ({"price_per_gpu_hour": "2"}, TypeError, "price_per_gpu_hour must be a number"),
    ({"hours": 0}, ValueError, "hours must be > 0, got 0"),
    ({"hours": math.nan}, ValueError, "hours must be a finite number"),
    ({"hours": None}, ValueError, "needs hours=..., or the work"),
    ({"hours": 5, "throughput": 10.0}, ValueError, "give hours or work/throughput, not both"),
    ({"hours": None, "samples_to_target": 1e6}, ValueError, "needs exactly one of throughput=..."),
    ({"hours": None, "samples_to_target": 1e6, "steps_to_target": 10, "global_batch": 4, "throughput": 1.0},
     ValueError, "exactly one of samples_to_target"),
    ({"hours": None, "steps_to_target": 1000, "throughput": 10.0}, ValueError,
     "steps_to_target and global_batch go together"),
    ({"hours": None, "samples_to_target": 1e6, "base_throughput": 10.0}, ValueError,
     "base_throughput and scaling_efficiency go together"),
    ({"hours": None, "samples_to_target": 1e6, "throughput": 10.0, "base_throughput": 1.0,
      "scaling_efficiency": 0.9}, ValueError, "exactly one of throughput=..."),
    ({"overhead_fraction": 1.0}, ValueError, "overhead_fraction must be in \\[0, 1\\), got 1.0"),
    ({"value_per_hour": -5}, ValueError, "value_per_hour must be >= 0, got -5"),
    ({"global_batch": 0, "hours": None, "steps_to_target": 1, "throughput": 1.0}, ValueError,
     "global_batch must be an int >= 1"),
])
def test_every_field_is_validated(kwargs, error, message):
    fields: dict[str, Any] = {"name": "x", "gpus": 8, "price_per_gpu_hour": 2.0, "hours": 10.0, **kwargs}
    with pytest.raises(error, match=message):
        ClusterOption(**fields)


def test_compare_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one ClusterOption"):
        compare([])
    with pytest.raises(ValueError, match="two options are named '256 GPUs'"):
        compare([BIG, replace(BIG, hours=10)])
    with pytest.raises(TypeError, match=r"options\[1\] must be a ClusterOption, got dict"):
        compare([BIG, {"name": "x"}])  # type: ignore[list-item]


def test_markdown_table():
    table = compare([BIG, SMALL]).to_markdown().splitlines()
    assert table[0] == "| option | GPUs | $/GPU-h | time | cost | cost incl. time value |"
    assert table[2] == "| 256 GPUs | 256 | 2.00 | 48.0 h | $24,576.00 | $24,576.00 |"
    assert table[3] == "| 64 GPUs | 64 | 2.00 | 192.0 h | $24,576.00 | $24,576.00 |"
    assert table[-1].startswith("winner: 256 GPUs (equal cost ($24,576.00 each), so the faster one")


def test_short_times_read_in_minutes_or_seconds_and_two_different_figures_never_read_alike():
    quick = ClusterOption("1 GPU", 1, 2.0, hours=0.1)  # $0.2000 in 6 minutes
    slower = ClusterOption("2 GPUs", 2, 1.0, hours=0.10005)  # $0.2001 in 6.003 minutes
    c = compare([quick, slower])
    table = c.to_markdown().splitlines()
    assert table[2] == "| 1 GPU | 1 | 2.00 | 6.0 min | $0.20 | $0.20 |"
    assert c.reason == "1 GPU is both cheaper ($0.2000 vs $0.2001 for 2 GPUs) and faster (6.000 min vs 6.003 min)"
    seconds = compare([ClusterOption("a", 1, 1.0, hours=10 / 3600)]).to_markdown().splitlines()[2]
    assert seconds == "| a | 1 | 1.00 | 10.0 s | $0.00 | $0.00 |"


# -- the scaling benchmark's output ------------------------------------------------------------------------------
def scaling_doc() -> dict[str, Any]:
    def result(world: int, batch: int, throughput: float, efficiency: float, overhead: float) -> dict[str, Any]:
        return {"world_size": world, "global_batch": batch, "throughput_samples_per_s": throughput,
                "scaling_efficiency": efficiency, "step_seconds": batch / throughput, "save_seconds": 0.8,
                "load_seconds": 0.5, "checkpoint_overhead_fraction": overhead}

    return {"schema": SCALING_SCHEMA, "model": "tiny", "machine": "8x test box",
            "results": [result(8, 256, 2560.0, 1.0, 0.0), result(32, 1024, 9216.0, 0.9, 0.1)]}


def write(tmp_path: Path, doc: Any, name: str = "scaling.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_scaling_json_becomes_options_and_compares(tmp_path):
    path = write(tmp_path, scaling_doc())
    options = load_scaling(path, price_per_gpu_hour=2.0, steps_to_target={256: 72_000, 1024: 20_000})
    assert [(o.name, o.gpus, o.throughput, o.global_batch, o.steps_to_target) for o in options] == [
        ("8 GPUs", 8, 2560.0, 256, 72_000), ("32 GPUs", 32, 9216.0, 1024, 20_000)]
    # 8 GPUs: 72,000 x 256 = 18,432,000 samples / 2560 per s = 7200 s = 2 h, $2 x 8 x 2 = $32.
    # 32 GPUs: 20,000 x 1024 = 20,480,000 samples / 9216 per s = 2222.2 s, / (1 - 0.1) overhead = 0.6859 h.
    c = compare(options)
    rows = {row.name: row for row in c.rows}
    assert rows["8 GPUs"].hours == pytest.approx(2.0, rel=1e-12)
    assert rows["8 GPUs"].cost == pytest.approx(32.0, rel=1e-12)
    assert rows["32 GPUs"].hours == pytest.approx(20_480_000 / 9216 / 3600 / 0.9, rel=1e-12)
    assert rows["32 GPUs"].cost == pytest.approx(64 * 20_480_000 / 9216 / 3600 / 0.9, rel=1e-12)  # $43.90
    assert c.winner.name == "8 GPUs" and c.faster.name == "32 GPUs"

    no_overhead = load_scaling(path, price_per_gpu_hour=2.0, steps_to_target={256: 72_000, 1024: 20_000},
                               include_checkpoint_overhead=False)
    assert no_overhead[1].wall_hours == pytest.approx(20_480_000 / 9216 / 3600, rel=1e-12)
    # One target for every batch, as samples or as steps.
    by_samples = load_scaling(str(path), price_per_gpu_hour=1.0, samples_to_target=18_432_000, value_per_hour=10.0)
    assert by_samples[0].wall_hours == pytest.approx(2.0) and by_samples[0].value_per_hour == 10.0
    by_steps = load_scaling(path, price_per_gpu_hour=1.0, steps_to_target=1000)
    assert [o.steps_to_target for o in by_steps] == [1000, 1000]


def test_two_results_at_one_world_size_get_distinct_names(tmp_path):
    doc = scaling_doc()
    doc["results"].append(dict(doc["results"][1], global_batch=2048))
    options = load_scaling(write(tmp_path, doc), price_per_gpu_hour=2.0, steps_to_target=100)
    assert [o.name for o in options] == ["8 GPUs", "32 GPUs, batch 1024", "32 GPUs, batch 2048"]
    doc["results"].append(dict(doc["results"][0], world_size=1, global_batch=32))
    options = load_scaling(write(tmp_path, doc), price_per_gpu_hour=2.0, steps_to_target=100)
    assert options[-1].name == "1 GPU"


def _without(field: str) -> dict[str, Any]:
    doc = scaling_doc()
    del doc["results"][1][field]
    return doc


@pytest.mark.parametrize(("doc", "message"), [
    ("{not json", "not JSON"),
    ([1, 2], "expected a JSON object"),
    (dict(scaling_doc(), schema="lightning_resilient.scaling/2"),
     "schema must be 'lightning_resilient.scaling/1', got 'lightning_resilient.scaling/2'"),
    (dict(scaling_doc(), model=3), "model must be a string"),
    (dict(scaling_doc(), results=[]), "'results' must be a non-empty list"),
    (_without("load_seconds"), r"results\[1\] has no 'load_seconds' field"),
    (dict(scaling_doc(), results=[dict(scaling_doc()["results"][0], world_size=0)]),
     r"results\[0\]\.world_size must be an int >= 1, got 0"),
    (dict(scaling_doc(), results=[dict(scaling_doc()["results"][0], throughput_samples_per_s="fast")]),
     r"results\[0\]\.throughput_samples_per_s must be a number"),
    (dict(scaling_doc(), results=[dict(scaling_doc()["results"][0], checkpoint_overhead_fraction=1.5)]),
     r"results\[0\]\.checkpoint_overhead_fraction must be in \[0, 1\)"),
])
def test_a_bad_scaling_file_names_the_file_and_the_field(tmp_path, doc, message):
    path = write(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as info:
        load_scaling(path, price_per_gpu_hour=2.0, steps_to_target=100)
    assert str(path) in str(info.value)


def test_bad_arguments_to_load_scaling(tmp_path):
    path = write(tmp_path, scaling_doc())
    with pytest.raises(ValueError, match="steps_to_target gives steps only for global_batch 256: add 1024"):
        load_scaling(path, price_per_gpu_hour=2.0, steps_to_target={256: 100})
    with pytest.raises(ValueError, match="exactly one of steps_to_target"):
        load_scaling(path, price_per_gpu_hour=2.0)
    with pytest.raises(ValueError, match="exactly one of steps_to_target"):
        load_scaling(path, price_per_gpu_hour=2.0, steps_to_target=10, samples_to_target=10)
    with pytest.raises(ValueError, match="price_per_gpu_hour must be >= 0"):
        load_scaling(path, price_per_gpu_hour=-2.0, steps_to_target=10)
    with pytest.raises(ValueError, match=r"steps_to_target\[256\] must be > 0, got 0"):
        load_scaling(path, price_per_gpu_hour=2.0, steps_to_target={256: 0})
    with pytest.raises(FileNotFoundError, match="no such scaling file"):
        load_scaling(tmp_path / "missing.json", price_per_gpu_hour=2.0, steps_to_target=10)
