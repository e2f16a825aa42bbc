"""The resume matrix: configurations Lightning users have, each run uninterrupted and stopped-then-resumed (see
``matrix.py``), compared bit for bit (``torch.equal`` on every weight; the failure names the first step where the
runs part and what differed: the samples, the dropout mask, the position or the loss). Each stopped attempt trains
two batches past its save, which the resume replays: its ``resume audit:`` line must say they were identical.

In-process, on 40 samples: a run costs well under a second. The real-SIGKILL versions of the main cases are in
``test_exact_resume.py``.
"""

from __future__ import annotations

import pytest
import torch

from .matrix import Config, Result, first_difference, run

MATRIX = [
    Config("step saves"),
    Config("step saves, resumed twice", stops=(1, 2)),
    Config("epoch-end saves with max_epochs", ckpt={"every_n_epochs": 1}, stops=(2,)),
    # Lightning keeps restarting the finished epoch when max_steps is set (iteration-based training).
    Config("epoch-end saves with max_steps", ckpt={"every_n_epochs": 1}, trainer={"max_steps": 30}, stops=(2,)),
    Config("epoch-end saves with max_epochs and max_steps", ckpt={"every_n_epochs": 1},
           trainer={"max_epochs": 2, "max_steps": 40}, stops=(1,)),
    Config("accumulation 4", trainer={"accumulate_grad_batches": 4}, ckpt={"every_n_train_steps": 2}, samples=64,
           stops=(2,)),
    Config("save_last only", ckpt={"save_last": True, "save_top_k": 0, "every_n_train_steps": 3}, stops=(2,)),
    # A user's own trainer.save_checkpoint in a callback listed before ResumeStateCallback.
    Config("a user's saver before the callback", ckpt={"every_n_train_steps": 100}, user_saver=7),
    Config("OnExceptionCheckpoint", on_exception=True),
    # A step save right before a mid-epoch validation, which a resume skips but whose loader Lightning sets up.
    Config("step save followed by validation", trainer={"val_check_interval": 0.5}, val=True),
    Config("monitor top-k at validation end", ckpt={"monitor": "val_loss", "save_top_k": 2},
           trainer={"val_check_interval": 0.5}, val=True, stops=(2,)),
    Config("monitor top-k at validation end, validation draws", ckpt={"monitor": "val_loss", "save_top_k": 2},
           trainer={"val_check_interval": 0.5}, val=True, val_noise=True, stops=(2,)),
    # A step save on an epoch's last batch, then the epoch-end validation: the next epoch's order is drawn after
    # that validation's and the new iterator's base seeds, however many iterators the resume makes.
    Config("last-batch step save followed by the epoch-end validation", val=True, stops=(2,)),
    Config("last-batch step save followed by the epoch-end validation, workers 2 persistent", val=True, stops=(2,),
           workers=2, persistent=True),
    Config("last-batch step save followed by the epoch-end validation, StatefulDataLoader", val=True, stops=(2,),
           stateful=True),
    Config("epoch-end saves at validation end, validation draws", ckpt={"every_n_epochs": 1}, val=True,
           val_noise=True),
    Config("reload_dataloaders_every_n_epochs=1, epoch-end saves", ckpt={"every_n_epochs": 1},
           trainer={"reload_dataloaders_every_n_epochs": 1}),
    Config("reload_dataloaders_every_n_epochs=1, epoch-end saves, workers 2", ckpt={"every_n_epochs": 1},
           trainer={"reload_dataloaders_every_n_epochs": 1}, workers=2),
    Config("workers 2", workers=2, stops=(3,)),
    Config("workers 2 persistent, resumed in epoch 0", workers=2, persistent=True),
    Config("workers 2 persistent, resumed in a later epoch", workers=2, persistent=True, stops=(5,)),
    # Random augmentation drawn in __getitem__ from Python's, NumPy's and torch's global RNGs, with no wrapper: the
    # callback seeds each sample (the persistent workers see each new epoch).
    Config("augmentation, workers 0", augment=True, stops=(3,)),
    Config("augmentation, workers 2", augment=True, workers=2, stops=(3,)),
    Config("augmentation, workers 2 persistent, resumed in a later epoch", augment=True, workers=2, persistent=True,
           stops=(5,)),
    Config("augmentation, StatefulDataLoader workers 2", augment=True, workers=2, stateful=True, stops=(3,)),
    Config("StatefulDataLoader workers 2, stepping batches", workers=2, stateful=True, stepping_batches=True,
           stops=(3,)),  # the counterpart of the case without the callback below (Lightning #20550)
    # A collate_fn that draws random numbers: seeded per batch, in the main process and in workers.
    Config("random collate_fn, workers 0", collate_noise=True, stops=(3,)),
    Config("random collate_fn, workers 2", collate_noise=True, workers=2, stops=(3,)),
]


def stopped_and_resumed(cfg: Config, tmp_path) -> tuple[Result, Result]:
    full = run(cfg, tmp_path / "full", None, resume=False)
    for i, stop in enumerate(cfg.stops):
        run(cfg, tmp_path / "part", stop, resume=i > 0)
    return full, run(cfg, tmp_path / "part", None, resume=True)


@pytest.mark.parametrize("cfg", MATRIX, ids=[c.name for c in MATRIX])
def test_resumed_run_is_bit_identical(cfg, tmp_path):
    full, resumed = stopped_and_resumed(cfg, tmp_path)
    assert resumed.steps, "the resumed run trained no step"
    difference = first_difference(full.steps, resumed.steps)
    assert difference is None, difference
    for key, value in full.weights.items():
        assert torch.equal(value, resumed.weights[key]), f"{key} differs"
    # Lightning's "not resumable" warning is replaced by one line of ours when the position was restored, and no
    # warning of ours claims a difference that is not there.
    ours = ("ended before the epoch ended", "ResumeStateCallback", "validation that ran right after")
    assert not [w for w in full.warnings + resumed.warnings if any(o in w for o in ours)], resumed.warnings
    # The resume audit compared the batches the stopped attempt trained past its save, and found them identical
    # (OnExceptionCheckpoint saves at the failing step: nothing was trained past it).
    (audit,) = resumed.audit()
    expected = "nothing to compare" if cfg.on_exception else "were identical on the only rank"
    assert expected in audit, audit
    restored = [line for line in resumed.lines if "restored the data position" in line]
    assert all("continues exactly" in line for line in restored), restored


# Stock Lightning, the same runs without ResumeStateCallback: each differs after the resume, so the callback is what
# makes the matrix above exact.
WITHOUT = [
    # Augmentation drawn in 2 workers from the global RNGs, stopped two batches past a mid-epoch save.
    Config("no callback: augmentation, workers 2", augment=True, workers=2, resume_state=False, stops=(3,)),
    # Stock Lightning restores a StatefulDataLoader's position itself, but not when configure_optimizers reads
    # estimated_stepping_batches: that builds the loader before the loops' state is loaded, and the saved position is
    # dropped (Lightning #20550): the resumed epoch starts over.
    Config("no callback: StatefulDataLoader workers 2, stepping batches", stateful=True, workers=2,
           stepping_batches=True, resume_state=False, stops=(3,)),
]


@pytest.mark.parametrize("cfg", WITHOUT, ids=[c.name for c in WITHOUT])
def test_without_the_callback_the_resumed_run_differs(cfg, tmp_path):
    full, resumed = stopped_and_resumed(cfg, tmp_path)
    difference = first_difference(full.steps, resumed.steps)
    assert difference is not None
    if cfg.stepping_batches:
        assert "samples differ" in difference, difference  # the position, not only the RNG
    assert not all(torch.equal(value, resumed.weights[key]) for key, value in full.weights.items())


def test_a_validation_that_draws_after_a_save_is_warned_about_and_is_what_differs(tmp_path):
    """Lightning skips the validation that followed the checkpoint a run resumes from, so random numbers that
    validation drew cannot be replayed: the callback says so when that validation runs, naming the step and the
    fix, and that is exactly where the runs part."""
    cfg = Config("step save followed by validation that draws", trainer={"val_check_interval": 0.5}, val=True,
                 val_noise=True)
    full, resumed = stopped_and_resumed(cfg, tmp_path)
    warned = [w for w in full.warnings if "validation that ran right after the checkpoint of step 5" in w]
    assert len(warned) == 1 and "own torch.Generator" in warned[0]
    difference = first_difference(full.steps, resumed.steps)
    assert difference is not None and difference.startswith("first divergent step 5 (batch 5): dropout mask")
    # Without draws in that validation, the same configuration is exact (the matrix row above) and not warned.
    quiet = run(Config("quiet", trainer={"val_check_interval": 0.5}, val=True), tmp_path / "quiet", None, False)
    assert not [w for w in quiet.warnings if "validation that ran right after" in w]


def test_lightnings_not_resumable_warning_is_replaced_by_what_was_restored(tmp_path, caplog):
    import logging

    cfg = Config("step saves")
    run(cfg, tmp_path / "part", 1, resume=False)
    with caplog.at_level(logging.INFO):
        resumed = run(cfg, tmp_path / "part", None, resume=True)
    assert not [w for w in resumed.warnings if "ended before the epoch ended" in w]
    restored = "ResumeStateCallback: restored the data position"
    lines = [r.getMessage() for r in caplog.records if restored in r.getMessage()]
    assert lines == [(f"{restored}: epoch 0, after 5 of 10 batches (20 samples), per-sample seeding (seed 1234),"
                      " and the RNG states of every rank, so this run continues exactly where the checkpoint was"
                      " saved")]


def test_one_callback_reused_by_several_trainers_wraps_each_trainers_loops(tmp_path):
    from lightning.pytorch import Callback, Trainer

    from lightning_resilient import ResumeStateCallback

    from ..models import TinyModel, tiny_loader

    def wraps(trainer):
        loops = trainer.fit_loop
        return [getattr(getattr(owner, name), "_resume_state_wrap", None)
                for owner, name in ((loops, "_load_combined_loader_states"), (loops.epoch_loop, "reset"),
                                    (loops.epoch_loop.val_loop, "increment_progress_to_evaluation_end"))]

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            self.seen = wraps(trainer)

    callback = ResumeStateCallback()
    for i in range(3):
        probe = Probe()
        trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, callbacks=[callback, probe])
        trainer.fit(TinyModel(), tiny_loader())
        assert probe.seen == [callback] * 3, i  # during the fit, every loop hook of this trainer is wrapped
        assert wraps(trainer) == [None] * 3, i  # and after it, the loops are Lightning's own again
