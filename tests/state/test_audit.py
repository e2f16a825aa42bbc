"""The resume audit: what a step's record holds, how a resume compares the steps it replays, and the one
``resume audit:`` line each resume logs (identical, DIFFER with the first step, rank and what, or nothing to
compare), in-process with real Trainers on local disk (``matrix.py``). Real kills, DDP and S3 are in
``test_exact_resume.py``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_resilient.cli import main
from lightning_resilient.io.folders import ATTEMPTS_DIR
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store
from lightning_resilient.state.attempts import AttemptRecord, StepDigest, list_attempts, read_record, record_name
from lightning_resilient.state.audit import (
    RankOutcome,
    Replay,
    add_sample_sets,
    audit_line,
    digest_batch,
    digest_indices,
    digest_sample_set,
    sample_line,
)
from lightning_resilient.state.elastic import split_rest

from .matrix import Config, first_difference, run


# -- digests -------------------------------------------------------------------------------------------------------
def test_a_batch_digest_sees_values_shapes_dtypes_and_nesting():
    x = torch.randn(8, 3, 16, 16)
    base = digest_batch({"x": x, "y": [torch.arange(8), "name"]})
    assert base == digest_batch({"x": x.clone(), "y": [torch.arange(8), "name"]})
    changed = x.clone()
    changed[5, 1, 7, 4] += 1e-3  # one element of the strided slice (every 6th of 6144): sample 5 changed
    unseen = x.clone()
    unseen[5, 1, 7, 3] += 1e-3  # an element between two of the slice's: a strided slice does not see it
    assert digest_batch({"x": unseen, "y": [torch.arange(8), "name"]}) == base
    others = [{"x": changed, "y": [torch.arange(8), "name"]}, {"x": x, "y": [torch.arange(8), "other"]},
              {"x": x.double(), "y": [torch.arange(8), "name"]},
              {"x": x.reshape(8, 768), "y": [torch.arange(8), "name"]}, {"z": x, "y": [torch.arange(8), "name"]}]
    digests = {digest_batch(o) for o in others}
    assert len(digests) == len(others) and base not in digests
    # Non-contiguous tensors, bf16, bool and NumPy arrays are read without copying the whole tensor.
    t = torch.randn(64, 64)
    assert digest_batch(t.t()) == digest_batch(t.t().contiguous())
    assert len({digest_batch(t.bfloat16()), digest_batch(t > 0), digest_batch(t.numpy())}) == 3


def test_index_digests_follow_the_order_and_the_values():
    assert digest_indices([3, 1, 2]) == digest_indices(np.array([3, 1, 2])) == digest_indices(torch.tensor([3, 1, 2]))
    assert digest_indices([3, 1, 2]) != digest_indices([1, 2, 3])
    assert digest_indices(["a", "b"]) != digest_indices(["b", "a"])


def test_a_sample_set_digest_ignores_the_order_and_adds_up_over_batches():
    assert digest_sample_set([3, 1, 2]) == digest_sample_set(np.array([2, 3, 1])) == digest_sample_set(
        torch.tensor([1, 2, 3]))
    together = digest_sample_set([5, 9, 0, 7])
    assert add_sample_sets(digest_sample_set([5, 9]), digest_sample_set([0, 7])) == together
    assert together != digest_sample_set([5, 9, 0, 8]) and together != digest_sample_set([5, 9, 0, 7, 7])
    assert add_sample_sets(digest_sample_set([]), together) == together


def parts(*batches: list[int]) -> list[tuple[int, str]]:
    return [(len(b), digest_sample_set(b)) for b in batches]


def test_across_a_change_of_world_size_the_samples_are_compared_where_both_attempts_trained_as_many():
    """Then: 2 ranks, 2 per batch (stretches of 4); now: 1 rank, 2 per batch, then 4 ranks, 2 per batch."""
    then = [(4, add_sample_sets(digest_sample_set([0, 1]), digest_sample_set([2, 3]))),
            (4, add_sample_sets(digest_sample_set([4, 5]), digest_sample_set([6, 7])))]
    same = sample_line(then, [parts([1, 0], [3, 2], [5, 4], [7, 6])], interrupted="a1", world_then=2, world_now=1,
                       steps=(3, 6), resumed_step=3, changed=[])
    assert same.outcome == "identical" and same.compared == 8, same.line
    assert same.line.startswith("resume audit: the 8 samples this run trained after the checkpoint of step 3"
                                " (global steps 3 to 6 on 1 rank(s)) are the same samples")
    wider = sample_line(then, [parts([0, 1], [8, 9]), parts([2, 3], [10, 11]), parts([4, 5], [12, 13]),
                               parts([6, 7], [14, 15])], interrupted="a1", world_then=2, world_now=4, steps=(3, 4),
                        resumed_step=3, changed=[])
    assert wider.outcome == "identical" and wider.compared == 8  # the first stretch of 8 holds the same samples
    moved = sample_line(then, [parts([0, 1], [4, 9])], interrupted="a1", world_then=2, world_now=1, steps=(3, 4),
                        resumed_step=3, changed=["world size 2 then, 1 now"])
    assert moved.outcome == "differs" and "DIFFER" in moved.line and "the first 4 samples are not the same set" in (
        moved.line) and "Changed since then: world size 2 then, 1 now." in moved.line
    unknown = sample_line(then, [[None]], interrupted="a1", world_then=2, world_now=1, steps=(3, 3),
                          resumed_step=3, changed=[])
    assert unknown.outcome == "nothing"


def test_after_two_to_one_to_two_processes_the_line_says_what_was_compared_not_that_the_run_stopped():
    """Issue 39: a job of 2 ranks (4 per batch) saved at step 3 and was killed; it resumed on 1 rank, which saved at
    step 9 (48 of the epoch's 64 samples trained) and was killed after 3 more batches (12 samples); the job resumed on 2
    ranks from step 9 and trained the rest of the epoch, 2 stretches of 8. The interrupted attempt's counts (4, 8, 12)
    and this run's (8, 16) meet only at 8: its last 4 samples cannot be compared, but this run did train them. The
    stretches are cut as ResumeStateCallback cuts them (elastic.split_rest)."""
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))

    def batches(start: int, world: int, rank: int) -> list[tuple[int, str]]:
        split = split_rest(order, start, world=world, rank=rank, batch_size=4, drop_last=False).batches
        return parts(*split)

    then = batches(24, 1, 0)[6:9]  # the 1-rank attempt's batches after its save at step 9 (its 7th to 9th)
    now = [batches(48, 2, rank) for rank in (0, 1)]
    result = sample_line(then, now, interrupted="a000002-abcdef", world_then=1, world_now=2, steps=(9, 10),
                         resumed_step=9, changed=[])
    assert result.outcome == "identical" and result.compared == 8, result.line
    assert "stopped" not in result.line, result.line  # it trained the rest of the epoch: 16 samples
    assert result.line.startswith(
        "resume audit: the first 8 of the 16 samples this run trained after the checkpoint of step 9 (global steps 9"
        " to 10 on 2 rank(s)) are the same samples, stretch by stretch of the epoch's order, as the first 8 of the 12"
        " the interrupted attempt a000002-abcdef trained after it on 1 rank(s) (its other 4 samples were not"
        " compared: this run's batches and its never end at the same count of samples past the first 8, and sample"
        " sets are compared only where both end)"), result.line

    # Where this run did stop first (its fit ended after one stretch), the line says how far it got.
    short = sample_line(then, [b[:1] for b in now], interrupted="a000002-abcdef", world_then=1, world_now=2,
                        steps=(9, 9), resumed_step=9, changed=[])
    assert short.outcome == "identical" and short.compared == 8, short.line
    assert short.line.startswith(
        "resume audit: the 8 samples this run trained after the checkpoint of step 9 (global step 9 on 2 rank(s)) are"
        " the same samples, stretch by stretch of the epoch's order, as the first 8 of the 12 the interrupted attempt"
        " a000002-abcdef trained after it on 1 rank(s) (its other 4 samples were not compared: this run's comparison"
        " ended after 8 samples of the epoch, fewer than its 12)"), short.line


# -- the comparison and its line -----------------------------------------------------------------------------------
def steps(n: int, start: int = 5, **change) -> list[StepDigest]:
    out = [StepDigest(0, i, i, f"i{i}", f"d{i}", float(i)) for i in range(start, start + n)]
    return [StepDigest(**{**s.__dict__, **change}) if s.batch == start + 1 else s for s in out] if change else out


def outcome(rank: int, then: list[StepDigest], now: list[StepDigest], resumed: int = 5) -> RankOutcome:
    replay = Replay(rank, AttemptRecord("a1", rank, 2, 0.0, steps=then), resumed)
    for s in now:
        replay.check(s)
    return replay.outcome()


def test_identical_replays_say_how_many_and_what_was_compared():
    result = audit_line([outcome(0, steps(3), steps(5)), outcome(1, steps(3), steps(5))], interrupted="a1",
                        changed=[], world_then=2, resumed_step=5)
    assert result.outcome == "identical" and result.compared == 3
    assert result.line == ("resume audit: the 3 replayed training step(s) (global steps 5 to 7) were identical on"
                           " every rank (2 ranks) to what the interrupted attempt a1 recorded: same sample indices,"
                           " input bytes and loss.")


def test_the_first_difference_names_the_step_the_rank_and_what():
    data = outcome(1, steps(3), steps(3, data="other"))
    loss = outcome(0, steps(3), steps(3, loss=0.25))
    result = audit_line([loss, data], interrupted="a1", changed=["batch size 4 then, 8 now"], world_then=2,
                        resumed_step=5)
    assert result.outcome == "differs"
    assert result.line.startswith("resume audit: the replayed training steps DIFFER from the interrupted attempt a1:"
                                  " first at global step 6 (epoch 0, batch 6) on rank 0: loss (6.0 then, 0.25 now)"
                                  " differ; 1 replayed step(s) before it were identical.")
    assert result.line.endswith("Changed since then: batch size 4 then, 8 now.")
    indices = audit_line([outcome(0, steps(3), steps(3, indices="x"))], interrupted="a1", changed=[], world_then=1,
                         resumed_step=5)
    assert "on rank 0: data (sample indices) differ" in indices.line


def test_a_changed_world_size_differs_even_where_the_ranks_it_kept_agree():
    result = audit_line([outcome(0, steps(3), steps(3))], interrupted="a1", changed=[], world_then=2, resumed_step=5)
    assert result.outcome == "differs" and "world size (2 rank(s) then, 1 now)" in result.line


def test_a_run_that_stops_before_the_end_of_the_replay_says_so_and_nothing_compared_is_not_identical():
    result = audit_line([outcome(0, steps(4), steps(2))], interrupted="a1", changed=[], world_then=1, resumed_step=5)
    assert result.outcome == "identical" and "last 2)" in result.line and "on the only rank" in result.line
    nothing = audit_line([outcome(0, steps(2, start=1), steps(2))], interrupted="a1", changed=[], world_then=1,
                         resumed_step=5)
    assert nothing.outcome == "nothing" and nothing.line.startswith("resume audit: nothing to compare")


# -- in a Trainer ------------------------------------------------------------------------------------------------
def resume_with(tmp_path, first: Config, then: Config):
    run(first, tmp_path / "part", 1, resume=False)  # stopped two batches after its save at step 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(then, tmp_path / "part", None, resume=True)


def audit_of(result) -> str:
    (line,) = result.audit()
    return line


@pytest.mark.parametrize(("change", "what"), [
    ({"batch_size": 5}, "data (sample indices) differ"),
    ({"seed": 2}, "data (input bytes) differ"),
    ({"shift": 1.0}, "data (input bytes) differ"),
], ids=["batch size", "seed", "dataset"])
def test_a_resume_with_a_changed_run_differs_at_the_first_replayed_step(tmp_path, change, what):
    first = Config("first", augment=True, seed=1)
    resumed = resume_with(tmp_path, first, Config("then", **{"augment": True, "seed": 1, **change}))
    line = audit_of(resumed)
    assert line.startswith("resume audit: the replayed training steps DIFFER from the interrupted attempt a000001-")
    assert f"first at global step 5 (epoch 0, batch 5) on rank 0: {what}" in line
    if "batch_size" in change:
        assert "batch size 4 then, 5 now" in line
    if "seed" in change:
        assert "per-sample seed 1 then, 2 now" in line
        assert [w for w in resumed.warnings if "seed_everything gave this run 2" in w]
        (restored,) = [x for x in resumed.lines if "restored the data position" in x]
        assert "Not restored: the per-sample seed (1 then, 2 now" in restored and "continues exactly" not in restored


def test_a_gradient_changed_in_the_last_replayed_step_differs_though_its_data_and_loss_are_the_same(tmp_path):
    """Noise added to the gradients of the last replayed step only (after its backward): its data and loss are what
    the interrupted attempt recorded, its update is not. The digest of a sample of the parameters after each step
    finds it; the first replayed step is identical."""
    resumed = resume_with(tmp_path, Config("first"), Config("then", grad_noise_at=6))
    line = audit_of(resumed)
    assert ("first at global step 6 (epoch 0, batch 6) on rank 0: parameters after the step (same data and loss: the"
            " gradients or the optimizer's update) differ; 1 replayed step(s) before it were identical") in line, line
    clean = resume_with(tmp_path / "clean", Config("first"), Config("then"))
    assert "same sample indices, input bytes, loss and parameters after each step" in audit_of(clean)


def test_records_copied_from_another_root_are_ignored_never_taken_for_the_interrupted_attempt(tmp_path, caplog):
    """Root A's attempt records copied into root B (a folder copied whole, say) before B's run: B's interrupted
    attempt stopped at its save, A's (the same training) ran past it. Each record names its root's incarnation, so B's
    resume ignores A's (with a warning) and says it has nothing to compare, never "identical to" an attempt that never
    ran there."""
    import shutil

    from lightning_resilient.io.folders import ATTEMPTS_DIR

    cfg = Config("first")
    run(cfg, tmp_path / "a", 1, resume=False)  # stopped two batches after its save at step 5
    shutil.copytree(tmp_path / "a" / ATTEMPTS_DIR, tmp_path / "b" / ATTEMPTS_DIR)
    run(Config("at the save", overrun=0), tmp_path / "b", 1, resume=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = run(cfg, tmp_path / "b", None, resume=True)
    line = audit_of(resumed)
    assert line.startswith("resume audit: nothing to compare") and "a000001" in line and "another root" in line, line
    assert "ignored the record(s) of attempt(s) a000001" in caplog.text


def test_without_per_sample_seeding_worker_augmentation_differs_and_no_line_claims_otherwise(tmp_path):
    """The mechanism matters: the same run with per_sample_seeding=False resumes with other augmentation (2 workers
    draw it), the restored line says what was not restored, and the audit finds the difference."""
    cfg = Config("off", augment=True, workers=2, stops=(3,), callback={"per_sample_seeding": False})
    full = run(cfg, tmp_path / "full", None, resume=False)
    run(cfg, tmp_path / "part", 3, resume=False)
    resumed = run(cfg, tmp_path / "part", None, resume=True)
    assert first_difference(full.steps, resumed.steps) is not None
    (restored,) = [x for x in resumed.lines if "restored the data position" in x]
    assert "continues exactly" not in restored and "exact" not in restored.replace("exactly", "")
    assert ("Not restored: random numbers drawn while the dataset is read in the 2 worker process(es) (per-sample"
            " seeding is off)") in restored
    assert "DIFFER" in audit_of(resumed) and "data (input bytes)" in audit_of(resumed)


def test_nothing_past_the_checkpoint_is_nothing_to_compare_never_identical(tmp_path):
    cfg = Config("at the save", overrun=0)
    resumed = resume_with(tmp_path, cfg, cfg)
    line = audit_of(resumed)
    assert line.startswith("resume audit: nothing to compare: no earlier attempt recorded a training step after"
                           " step 5")
    assert "identical" not in line


def test_a_damaged_or_newer_record_is_reported_and_skipped_never_fatal(tmp_path, caplog):
    import logging

    cfg = Config("damaged")
    run(cfg, tmp_path / "part", 1, resume=False)
    store = open_store(str(tmp_path / "part"), {}, RetryPolicy())
    (attempt,) = list_attempts(store)
    path = store.path(record_name(attempt, 0))
    lines = Path(path).read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    with open(path, "w") as f:  # a newer format
        f.write(json.dumps({**header, "format": 99}) + "\n" + "".join(lines[1:]))
    with caplog.at_level(logging.WARNING, logger="lightning_resilient.state.audit"):
        resumed = run(cfg, tmp_path / "part", None, resume=True)
    assert "format 99" in caplog.text and "skipped" in caplog.text
    # The warning says what was skipped; the one line that starts with "resume audit:" is the verdict.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage().startswith("resume audit")]
    assert audit_of(resumed).startswith("resume audit: nothing to compare: the record of the interrupted attempt")
    assert resumed.steps  # training went on


def test_an_iterable_without_state_warns_at_fit_start_and_nothing_claims_exactness(tmp_path):
    from .test_data_position import Stream, fit

    make = lambda: DataLoader(Stream(), batch_size=4)  # noqa: E731
    with pytest.warns(RuntimeWarning) as caught:
        fit(tmp_path, make, steps=5, every=3)
    (message,) = [str(w.message) for w in caught if "cannot make a resume of this run exact" in str(w.message)]
    assert "Stream is an IterableDataset without state_dict()/load_state_dict()" in message
    assert "restarts the data from its beginning" in message and "StatefulDataLoader" in message  # the fix
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger()  # rank_zero_info's logger depends on the namespace imported last; both propagate
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(tmp_path, make, ckpt=str(tmp_path / "epoch=0-step=3.ckpt"))
    finally:
        logger.removeHandler(handler)
    assert not [x for x in lines if "exact" in x]
    (audit,) = [x for x in lines if x.startswith("resume audit:")]
    # The data restarted from its beginning: the first replayed step reads other samples.
    assert "DIFFER" in audit and "global step 3 (epoch 0, batch 3) on rank 0: data (input bytes)" in audit


def test_audit_off_records_nothing_and_says_nothing(tmp_path):
    cfg = Config("off", callback={"audit": False, "ledger": False})
    resumed = resume_with(tmp_path, cfg, cfg)
    assert resumed.audit() == [] and not (tmp_path / "part" / ATTEMPTS_DIR).exists()


def test_audit_off_keeps_the_ledger_without_step_digests(tmp_path, capsys):
    cfg = Config("ledger only", callback={"audit": False})
    resumed = resume_with(tmp_path, cfg, cfg)
    assert resumed.audit() == []  # no comparison, no line
    store = open_store(str(tmp_path / "part"), {}, RetryPolicy())
    first, second = (read_record(store, a, 0) for a in list_attempts(store))
    assert first.steps == [] and second.steps == [] and second.audit is None  # nothing digested
    assert first.progress is not None and first.progress.step == 7 and second.resumed_step == 5
    assert second.end == "finished" and second.timings is not None and second.timings.saves >= 1
    # ls shows how far each attempt got from the ledger, with no step digests (it showed "-").
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "part")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| a00000")]
    assert "| fresh start | 7 |" in rows[0] and "| step 5 | 30 | finished |" in rows[1], rows


def test_ls_shows_each_attempt_and_its_audit(tmp_path, capsys):
    cfg = Config("ls")
    run(cfg, tmp_path / "part", 1, resume=False)
    run(cfg, tmp_path / "part", None, resume=True)
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "part")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| a00000")]
    assert len(rows) == 2
    # Stopped (by an exception here; a SIGKILLed attempt shows "killed (or running)") two batches after its save.
    # "last step": the global step reached (the ledger's progress: the batch that started at step 6 ended at 7).
    assert "| fresh start | 7 | stopped by Stop: stopped 2 batch(es) after save 1 | - |" in rows[0]
    assert "| step 5 | 30 | finished | identical: 2 replayed training step(s) (global steps 5 to 6) |" in rows[1]
    store = open_store(str(tmp_path / "part"), {}, RetryPolicy())
    second = read_record(store, list_attempts(store)[1], 0)
    assert second.audit is not None and second.audit.outcome == "identical" and second.resumed_step == 5
