"""``lightning-resilient cadence`` and ``cost``, run in-process through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_resilient.cli import main

from ..planning.test_cost import scaling_doc

WORKED_EXAMPLE = """\
options:
  - name: 256 GPUs
    gpus: 256
    price_per_gpu_hour: 2.0
    hours: 48
  - name: 64 GPUs
    gpus: 64
    price_per_gpu_hour: 2.0
    hours: 192
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# -- cadence -----------------------------------------------------------------------------------------------------
def test_cadence_prints_young_daly_and_their_waste(capsys):
    status, out, err = run(capsys, "cadence", "--save-seconds", "6", "--mtbf-hours", "2.8")
    assert status == 0 and err == ""
    assert "checkpoint cadence: save 6 s, MTBF 10080 s (2.8 h), restart 0 s" in out
    assert "| Young 1974 | 347.8 s (5.8 min) | 3.41% |" in out
    assert "| Daly 2006 | 343.8 s (5.7 min) | 3.41% |" in out
    assert "every_n_train_steps" not in out  # no step time given
    assert out.rstrip().endswith("recommended: checkpoint every 343.8 s (5.7 min) of training (Daly)")


def test_cadence_with_a_step_time_gives_every_n_train_steps(capsys):
    status, out, _ = run(capsys, "cadence", "--save-seconds", "6", "--mtbf-hours", "2.8", "--step-seconds", "0.5",
                         "--restart-seconds", "300")
    assert status == 0
    assert "| Young 1974 | 347.8 s (5.8 min) | 6.24% | 696 |" in out  # a 5 min restart adds ~2.8 points of waste
    assert "| Daly 2006 | 343.8 s (5.7 min) | 6.24% | 688 |" in out
    assert "ModelCheckpoint(every_n_train_steps=688)" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--save-seconds", "0", "--mtbf-hours", "2.8"], "--save-seconds must be > 0, got 0.0"),
    (["--save-seconds", "6", "--mtbf-hours", "nan"], "--mtbf-hours must be a finite number"),
    (["--save-seconds", "6", "--mtbf-hours", "2", "--restart-seconds", "-1"], "--restart-seconds must be >= 0"),
    (["--save-seconds", "6", "--mtbf-hours", "2", "--step-seconds", "0"], "--step-seconds must be > 0"),
])
def test_cadence_bad_numbers_exit_2_with_the_option_named(capsys, argv, message):
    status, out, err = run(capsys, "cadence", *argv)
    assert status == 2 and out == ""
    assert err.startswith("lightning-resilient cadence: error: ") and message in err


def test_cadence_missing_argument_is_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cadence", "--save-seconds", "6"])
    assert exit_info.value.code == 2
    assert "--mtbf-hours" in capsys.readouterr().err


# -- cost --------------------------------------------------------------------------------------------------------
def test_cost_reproduces_the_worked_example(capsys, tmp_path):
    path = tmp_path / "options.yaml"
    path.write_text(WORKED_EXAMPLE)
    status, out, err = run(capsys, "cost", str(path))
    assert status == 0 and err == ""
    assert out.splitlines() == [
        "| option | GPUs | $/GPU-h | time | cost | cost incl. time value |",
        "|---|---:|---:|---:|---:|---:|",
        "| 256 GPUs | 256 | 2.00 | 48.0 h | $24,576.00 | $24,576.00 |",
        "| 64 GPUs | 64 | 2.00 | 192.0 h | $24,576.00 | $24,576.00 |",
        "",
        ("winner: 256 GPUs (equal cost ($24,576.00 each), so the faster one: 256 GPUs takes 48.0 h instead of"
         " 192.0 h)"),
    ]


def test_cost_with_time_value_and_a_scaling_file(capsys, tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "scaling.json").write_text(json.dumps(scaling_doc()))
    path = tmp_path / "options.yaml"
    path.write_text("""\
value_per_hour: 10
price_per_gpu_hour: 2.0
options:
  - {name: rented 4 GPUs, gpus: 4, hours: 5}
scaling:
  path: bench/scaling.json
  steps_to_target: {256: 72000, "1024": 20000}
""")
    status, out, err = run(capsys, "cost", str(path))
    assert status == 0, err
    # 4 x $2 x 5 h = $40, + $50 of time; 8 GPUs: $32 + $20; 32 GPUs: 0.68587 h -> $43.896 + $6.859 = $50.755.
    assert "| rented 4 GPUs | 4 | 2.00 | 5.0 h | $40.00 | $90.00 |" in out
    assert "| 8 GPUs | 8 | 2.00 | 2.0 h | $32.00 | $52.00 |" in out
    assert "| 32 GPUs | 32 | 2.00 | 41.2 min | $43.90 | $50.75 |" in out
    assert out.rstrip().splitlines()[-1] == ("winner: 32 GPUs (counting the value of time, 32 GPUs is both cheaper"
                                             " ($50.75 vs $52.00 for 8 GPUs) and faster (41.2 min vs 2.0 h))")


def test_cost_accepts_a_bare_scaling_path(capsys, tmp_path):
    (tmp_path / "scaling.json").write_text(json.dumps(scaling_doc()))
    path = tmp_path / "options.yaml"
    path.write_text("scaling: scaling.json\nprice_per_gpu_hour: 1.0\nsamples_to_target: 18432000\n")
    status, out, _ = run(capsys, "cost", str(path))
    assert status == 0
    assert "| 8 GPUs | 8 | 1.00 | 2.0 h | $16.00 | $16.00 |" in out


@pytest.mark.parametrize(("text", "message"), [
    (None, "no such file"),
    ("options: [\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping with 'options' and/or 'scaling', got list"),
    ("", "got an empty file"),
    ("optoins: []\n", "unknown field 'optoins'"),
    ("options: {name: a}\n", "options must be a list of mappings, got dict"),
    ("options: [3]\n", "options[0] must be a mapping of ClusterOption fields, got 3"),
    ("options:\n  - {name: a, gpu: 8, price_per_gpu_hour: 2, hours: 1}\n", "options[0]: unknown field 'gpu'"),
    ("options:\n  - {name: a, price_per_gpu_hour: 2, hours: 1}\n", "options[0] has no 'gpus' field"),
    ("options:\n  - {name: a, gpus: 0, price_per_gpu_hour: 2, hours: 1}\n",
     "options[0]: option 'a': gpus must be an int >= 1, got 0"),
    ("options:\n  - {name: a, gpus: 8, price_per_gpu_hour: two, hours: 1}\n",
     "options[0]: option 'a': price_per_gpu_hour must be a number, got str 'two'"),
    ("options:\n  - {name: a, gpus: 8, price_per_gpu_hour: 2}\n", "options[0]: option 'a': needs hours=..."),
    (("options:\n  - {name: a, gpus: 8, price_per_gpu_hour: 2, hours: 1}\n  - {name: a, gpus: 4,"
      " price_per_gpu_hour: 2, hours: 1}\n"), "two options are named 'a'"),
    ("options: []\n", "no options"),
    ("scaling: {path: s.json, steps_to_target: 10}\n", "scaling has no 'price_per_gpu_hour' field"),
    ("scaling: {path: s.json, price: 2}\n", "scaling: unknown field 'price'"),
])
def test_cost_bad_files_exit_2_naming_the_file_and_field(capsys, tmp_path, text, message):
    path = tmp_path / "options.yaml"
    if text is not None:
        path.write_text(text)
    status, out, err = run(capsys, "cost", str(path))
    assert status == 2 and out == ""
    assert err.startswith(f"lightning-resilient cost: error: {path}: ")
    assert message in err
    assert "Traceback" not in err


def test_cost_bad_scaling_file_is_named(capsys, tmp_path):
    (tmp_path / "scaling.json").write_text(json.dumps(dict(scaling_doc(), schema="other")))
    path = tmp_path / "options.yaml"
    path.write_text("scaling: {path: scaling.json, price_per_gpu_hour: 2, steps_to_target: 10}\n")
    status, _, err = run(capsys, "cost", str(path))
    assert status == 2
    assert f"{path}: scaling: {tmp_path / 'scaling.json'}: schema must be 'lightning_resilient.scaling/1'" in err


def test_the_commands_are_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "cadence" in out and "cost" in out


def test_missing_scaling_json_is_named(capsys, tmp_path: Path):
    path = tmp_path / "options.yaml"
    path.write_text("scaling: {path: missing.json, price_per_gpu_hour: 2, steps_to_target: 10}\n")
    status, _, err = run(capsys, "cost", str(path))
    assert status == 2 and f"{tmp_path / 'missing.json'}: no such scaling file" in err


# -- cadence with two tiers --------------------------------------------------------------------------------------
TIERS = ["--local-save-seconds", "2", "--durable-save-seconds", "40", "--process-mtbf-hours", "6",
         "--node-mtbf-hours", "48", "--local-restart-seconds", "60", "--durable-restart-seconds", "300"]


def test_cadence_with_two_tiers_prints_both_intervals_and_the_config(capsys):
    status, out, err = run(capsys, "cadence", *TIERS, "--state-gb", "10", "--step-seconds", "0.5")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[:3] == [
        "two-tier checkpoint cadence",
        "  local tier:   save 2 s, restart 60 s; process failures: MTBF 21600 s (6.0 h)",
        ("  durable tier: save 40 s, persist blocks 0 s, restart 300.0 s (5.0 min); node losses: MTBF 172800 s"
         " (48.0 h)"),
    ]
    assert "| plan | local every | persist_every | durable every | waste | every_n_train_steps | store GB/h |" in lines
    # A free persist: every save persisted (10 GB every 277.8 s of wall time = 130 GB/h), against Daly's 20 min
    # with every save blocking 40 s on S3 and every failure restarting from it.
    assert "| two tiers, least waste | 275.8 s (4.6 min) | 1 | 275.8 s (4.6 min) | 1.90% | 552 | 130 |" in lines
    assert "| two tiers | 238.4 s (4.0 min) | 4 | 953.4 s (15.9 min) | 2.13% | 477 | 37.4 |" in lines
    assert "| durable only (Daly) | - | - | 1212.8 s (20.2 min) | 7.77% | 2426 | 28.7 |" in lines
    assert lines[-3:] == [
        ("recommended: save locally every 275.8 s (4.6 min) of training, persist every save: 1.90% waste, against"
         " 7.77% with every checkpoint written to the durable store"),
        "  AtomicCheckpointIO(local_tier=<node-local dir>, persist_every=1)",
        "  ModelCheckpoint(dirpath=<durable root>, every_n_train_steps=552)",
    ]


def test_cadence_with_a_blocking_persist_persists_every_few_saves(capsys):
    status, out, _ = run(capsys, "cadence", *TIERS, "--persist-blocking-seconds", "4")
    assert status == 0
    assert "| two tiers, least waste | 291.5 s (4.9 min) | 4 | 1166.0 s (19.4 min) | 2.49% |" in out
    assert "as often as uploads allow" not in out
    assert ("recommended: save locally every 291.5 s (4.9 min) of training, persist every 4 saves = every 1166.0 s"
            " (19.4 min): 2.49% waste") in out
    assert "AtomicCheckpointIO(local_tier=<node-local dir>, persist_every=4)" in out
    assert "ModelCheckpoint" not in out and "store GB/h" not in out  # no step time, no state size


def test_cadence_with_a_traffic_cap(capsys):
    status, out, _ = run(capsys, "cadence", *TIERS, "--state-gb", "10", "--max-store-gb-per-hour", "28")
    assert status == 0
    assert "| two tiers, <= 28 GB/h | 220.5 s (3.7 min) | 6 | 1322.9 s (22.0 min) | 2.26% | 27 |" in out
    assert "AtomicCheckpointIO(local_tier=<node-local dir>, persist_every=6)" in out
    # A cap the least-waste plan already meets changes nothing.
    status, out, _ = run(capsys, "cadence", *TIERS, "--state-gb", "10", "--max-store-gb-per-hour", "500")
    assert status == 0 and "<= 500 GB/h" not in out and "persist_every=1)" in out


def test_cadence_says_when_a_local_tier_does_not_pay(capsys):
    status, out, _ = run(capsys, "cadence", "--local-save-seconds", "30", "--save-seconds", "10",
                         "--process-mtbf-hours", "1000", "--node-mtbf-hours", "5", "--persist-blocking-seconds", "10",
                         "--step-seconds", "1")
    assert status == 0
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("recommended: no local tier: save to the durable store every ")
    assert "two tiers would waste" in last and last.endswith(")")
    assert "AtomicCheckpointIO" not in out


def test_cadence_durable_aliases_and_state_size_in_the_single_tier_form(capsys):
    status, out, _ = run(capsys, "cadence", "--durable-save-seconds", "6", "--mtbf-hours", "2.8",
                         "--durable-restart-seconds", "300", "--state-gb", "10")
    assert status == 0
    assert "| method | interval | waste | store GB/h |" in out
    assert "| Daly 2006 | 343.8 s (5.7 min) | 6.24% | 103 |" in out  # 10 GB every 349.8 s


@pytest.mark.parametrize(("argv", "message"), [
    (["--local-save-seconds", "2", "--save-seconds", "40", "--process-mtbf-hours", "6"],
     "the following arguments are required with --local-save-seconds (a two-tier plan): --node-mtbf-hours"),
    (["--node-mtbf-hours", "48"], ("the following arguments are required with --node-mtbf-hours (a two-tier plan):"
                                   " --local-save-seconds, --durable-save-seconds, --process-mtbf-hours")),
    (["--local-save-seconds", "2", "--process-mtbf-hours", "6", "--node-mtbf-hours", "48"],
     "the following arguments are required with --local-save-seconds (a two-tier plan): --durable-save-seconds"),
    ([*TIERS, "--mtbf-hours", "5"], "argument --mtbf-hours: not allowed with --local-save-seconds"),
    ([*TIERS, "--max-store-gb-per-hour", "10"], "argument --max-store-gb-per-hour: needs --state-gb"),
    ([], "the following arguments are required: --save-seconds, --mtbf-hours"),
])
def test_cadence_two_tier_usage_errors_name_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["cadence", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"lightning-resilient cadence: error: {message}" in err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--local-save-seconds", "0", "--local-save-seconds must be > 0, got 0.0"),
    ("--durable-save-seconds", "-1", "--durable-save-seconds must be > 0, got -1.0"),
    ("--process-mtbf-hours", "nan", "--process-mtbf-hours must be a finite number, got nan"),
    ("--node-mtbf-hours", "inf", "--node-mtbf-hours must be a finite number, got inf"),
    ("--local-restart-seconds", "-5", "--local-restart-seconds must be >= 0, got -5.0"),
    ("--durable-restart-seconds", "-5", "--durable-restart-seconds must be >= 0, got -5.0"),
    ("--persist-blocking-seconds", "-1", "--persist-blocking-seconds must be >= 0, got -1.0"),
    ("--state-gb", "0", "--state-gb must be > 0, got 0.0"),
    ("--step-seconds", "0", "--step-seconds must be > 0, got 0.0"),
])
def test_cadence_two_tier_bad_numbers_exit_2_with_the_option_named(capsys, flag, value, message):
    argv = list(TIERS)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    status, out, err = run(capsys, "cadence", *argv)
    assert status == 2 and out == ""
    assert err == f"lightning-resilient cadence: error: {message}\n"


def test_cadence_help_shows_both_forms(capsys):
    with pytest.raises(SystemExit):
        main(["cadence", "--help"])
    out = capsys.readouterr().out
    assert "--local-save-seconds S --durable-save-seconds S --process-mtbf-hours H --node-mtbf-hours H" in out
    for flag in ("--save-seconds S, --durable-save-seconds S", "--restart-seconds R, --durable-restart-seconds R",
                 "--local-restart-seconds", "--persist-blocking-seconds", "--state-gb", "--max-store-gb-per-hour"):
        assert flag in out
