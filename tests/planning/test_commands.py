"""``lightning-resilient cadence`` and ``cost``, run in-process through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_resilient.cli import main

from .test_cost import scaling_doc

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
        "winner: 256 GPUs (equal cost ($24,576.00 each), so the faster one: 256 GPUs takes 48.0 h instead of"
        " 192.0 h)",
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
    ("options:\n  - {name: a, gpus: 8, price_per_gpu_hour: 2, hours: 1}\n  - {name: a, gpus: 4,"
     " price_per_gpu_hour: 2, hours: 1}\n", "two options are named 'a'"),
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
