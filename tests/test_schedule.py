"""LR schedules per real optimizer step: accumulation, fp16-skipped steps, frequency, manual optimization, resume."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_resilient import AccumulationAwareScheduler, AtomicCheckpointIO, warmup_schedule
from lightning_resilient.io.pointer import POINTER_NAME, Pointer

N = 64  # samples
B = 2  # micro-batch size
EPOCHS = 2


def data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def plain_run(k: int, batch: int, *, wrap: bool = True, frequency: int = 1) -> tuple[list[float], float]:
    """Plain PyTorch, accumulating k micro-batches, scheduler stepped after every micro-batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = EPOCHS * N // (batch * k) // frequency
    inner = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    sched: Any = AccumulationAwareScheduler(inner, frequency=frequency) if wrap else inner
    seen = []
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(data(batch)):
            (torch.nn.functional.mse_loss(model(x), y) / k).backward()
            if (i + 1) % k == 0:
                seen.append(opt.param_groups[0]["lr"])
                opt.step()
                opt.zero_grad()
            sched.step()
    return seen, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_plain_pytorch_lr_per_optimizer_step_matches_the_big_batch_run(k):
    reference, ref_final = plain_run(1, B * k)
    seen, final = plain_run(k, B)
    assert seen == reference
    assert final == ref_final == 0.0  # cosine to 0, reached exactly after the last optimizer step
    assert len(seen) == EPOCHS * N // (B * k)


def test_without_the_wrapper_accumulation_runs_the_schedule_k_times_too_fast():
    reference, _ = plain_run(1, B * 4)
    seen, _ = plain_run(4, B, wrap=False)
    assert seen != reference
    assert seen[len(seen) // 2] < reference[len(reference) // 2]


def test_frequency_counts_optimizer_steps_not_micro_batches():
    seen, _ = plain_run(4, B, frequency=2)
    # The LR changes every second optimizer step: pairs of equal values.
    assert all(seen[i] == seen[i + 1] for i in range(0, len(seen) - 1, 2))
    assert len(set(seen)) == len(seen) // 2
    reference, _ = plain_run(1, B * 4, frequency=2)
    assert seen == reference


def _scaled_step(model, opt, scaler, sched, *, poison: bool) -> None:
    loss = model(torch.ones(1, 4)).sum()
    scaler.scale(loss).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("count_skipped", [False, True])
def test_gradscaler_skipped_step_does_not_advance_unless_asked(count_skipped):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    sched = AccumulationAwareScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                                       count_skipped_steps=count_skipped, scaler=scaler if count_skipped else None)
    _scaled_step(model, opt, scaler, sched, poison=False)
    assert sched.get_last_lr() == [0.5]
    _scaled_step(model, opt, scaler, sched, poison=True)  # inf gradients: the scaler skips opt.step()
    assert sched.get_last_lr() == ([0.25] if count_skipped else [0.5])
    _scaled_step(model, opt, scaler, sched, poison=False)
    assert sched.get_last_lr() == ([0.125] if count_skipped else [0.25])


def test_resume_mid_schedule_continues_exactly():
    def run(split: int | None) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = warmup_schedule(opt, "cosine", total_steps=16, warmup_steps=3)
        lrs = []
        for i, (x, y) in enumerate(list(data(B)) * 2):
            if split is not None and i == split:
                state = {"opt": opt.state_dict(), "sched": sched.state_dict()}
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                sched = warmup_schedule(opt, "cosine", total_steps=16, warmup_steps=3)
                opt.load_state_dict(state["opt"])
                sched.load_state_dict(state["sched"])
            torch.nn.functional.mse_loss(model(x), y).backward()
            if (i + 1) % 4 == 0:
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                opt.zero_grad()
            sched.step()
        return lrs

    assert run(split=None) == run(split=13)  # resumed between two optimizer steps, mid-accumulation


# -- through Lightning -----------------------------------------------------------------------------------------

class Recorder(LightningModule):
    def __init__(self, kind: str = "cosine", manual_k: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.kind = kind
        self.lrs: list[float] = []
        self.manual_k = manual_k
        if manual_k is not None:
            self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.manual_k is None:
            return loss
        opt = self.optimizers()
        sched = self.lr_schedulers()
        self.manual_backward(loss / self.manual_k)
        if (batch_idx + 1) % self.manual_k == 0:
            self.lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
        sched.step()  # every micro-batch: the wrapper turns it into one advance per optimizer step
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.manual_k is None:
            self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.manual_k is not None:
            total = EPOCHS * N // (B * self.manual_k)
            sched = warmup_schedule(opt, self.kind, total_steps=total, warmup_steps=2, min_lr_ratio=0.1)
        else:
            sched = warmup_schedule(opt, self.kind, trainer=self.trainer, warmup_steps=2, min_lr_ratio=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(model: LightningModule, batch: int, k: int, ckpt_path: str | None = None, **kwargs: Any) -> Trainer:
    kwargs.setdefault("enable_checkpointing", "callbacks" in kwargs)
    trainer = Trainer(max_epochs=EPOCHS, accumulate_grad_batches=k, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer.fit(model, data(batch), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("kind", ["cosine", "linear", "onecycle"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_lightning_accumulation_lr_matches_the_big_batch_run(k, kind):
    reference = Recorder(kind)
    fit(reference, B * k, 1)
    model = Recorder(kind)
    trainer = fit(model, B, k)
    assert model.lrs == reference.lrs
    assert len(model.lrs) == EPOCHS * N // (B * k) == trainer.global_step
    end = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    if kind == "onecycle":  # OneCycleLR ends at initial_lr / final_div_factor (its default 1e4)
        optimizer = trainer.lr_scheduler_configs[0].scheduler.optimizer
        assert end == optimizer.param_groups[0]["initial_lr"] / 1e4
    else:
        assert end == 0.1 * 0.1  # min_lr_ratio * lr: the schedule's end, exactly after the last step
    assert model.lrs[-1] > end  # ...and not before it


def test_lightning_manual_optimization_with_accumulation():
    reference = Recorder()
    fit(reference, B * 4, 1)
    manual = Recorder(manual_k=4)
    fit(manual, B, 1)
    assert manual.lrs == reference.lrs


def test_learning_rate_monitor_reads_through_the_wrapper(tmp_path):
    model = Recorder()
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=4, accelerator="cpu", enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                      logger=CSVLogger(tmp_path), callbacks=[LearningRateMonitor(logging_interval="step")])
    trainer.fit(model, data(B))
    lines = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = lines[0].split(",").index("lr-SGD")
    logged = [float(line.split(",")[column]) for line in lines[1:] if line.split(",")[column]]

    def runs(values: list[float]) -> list[float]:  # the monitor logs every micro-batch: collapse repeats
        return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]

    assert runs(logged) == runs(model.lrs) and len(runs(model.lrs)) > 3


class StopAt(Callback):
    """Ends the first run at a step, as a kill would, after its checkpoint there was written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_lightning_resume_continues_the_lr_trajectory(memory_backend):
    uninterrupted = Recorder()
    fit(uninterrupted, B, 4)
    root = memory_backend.root
    first = Recorder()
    fit(first, B, 4, plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=5), StopAt(5)])
    assert len(first.lrs) == 5
    resumed = Recorder()
    fit(resumed, B, 4, plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=root)], ckpt_path=root)
    assert first.lrs + resumed.lrs == uninterrupted.lrs


# -- sizing and errors -----------------------------------------------------------------------------------------

def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)


def test_unknown_step_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot size the LR schedule.*max_steps"):
        warmup_schedule(_opt(), trainer=SimpleNamespace(estimated_stepping_batches=float("inf")))
    with pytest.raises(ValueError, match=r"pass trainer=... .* or total_steps"):
        warmup_schedule(_opt())


def test_mismatched_lengths_warn():
    with pytest.warns(RuntimeWarning, match="ends after 50 optimizer steps but training runs 100"):
        warmup_schedule(_opt(), trainer=SimpleNamespace(estimated_stepping_batches=100), total_steps=50)
    with pytest.warns(RuntimeWarning, match="far before the LR schedule"):
        warmup_schedule(_opt(), trainer=SimpleNamespace(estimated_stepping_batches=100), total_steps=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warmup_schedule(_opt(), trainer=SimpleNamespace(estimated_stepping_batches=100), total_steps=105)


def test_running_past_the_schedule_warns_once():
    opt = _opt()
    sched = warmup_schedule(opt, "linear", total_steps=2)
    for _ in range(2):
        opt.step()
        sched.step()
    opt.step()
    with pytest.warns(RuntimeWarning, match="sized for 2 optimizer steps"):
        sched.step()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()


@pytest.mark.parametrize("kwargs, error", [
    ({"frequency": 0}, "frequency must be an int >= 1"),
    ({"count_skipped_steps": True}, "count_skipped_steps=True needs scaler"),
    ({"total_steps": 0}, "total_steps must be an int >= 1 or None"),
])
def test_wrapper_validates_arguments(kwargs, error):
    with pytest.raises(ValueError, match=error):
        AccumulationAwareScheduler(torch.optim.lr_scheduler.StepLR(_opt(), 1), **kwargs)


def test_wrapper_rejects_a_non_scheduler():
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.lr_scheduler scheduler"):
        AccumulationAwareScheduler(object())


@pytest.mark.parametrize("kwargs, error", [
    ({"kind": "exp", "total_steps": 10}, "kind must be"),
    ({"total_steps": 10, "warmup_steps": 10}, "must be shorter than the schedule"),
    ({"total_steps": 10, "warmup_steps": -1}, "warmup_steps must be"),
    ({"total_steps": 10, "min_lr_ratio": 2.0}, "min_lr_ratio must be in"),
])
def test_builder_validates_arguments(kwargs, error):
    with pytest.raises(ValueError, match=error):
        warmup_schedule(_opt(), **kwargs)


class Poisoned(Recorder):
    """Forces inf gradients on the 3rd optimizer step, so the fp16 GradScaler skips it."""

    def __init__(self) -> None:
        super().__init__("linear")
        self.calls = 0

    def on_after_backward(self) -> None:
        # Before the scaler's unscale_ looks for infs: the 2nd micro-batch of the 3rd optimizer step (K=2).
        self.calls += 1
        if self.calls == 6:
            self.net.weight.grad[0, 0] = float("inf")


@pytest.mark.parametrize("wrapped", [True, False])
def test_lightning_fp16_skipped_step_does_not_advance_the_schedule(wrapped, monkeypatch):
    from lightning.pytorch.plugins.precision import MixedPrecision

    if not wrapped:  # what stock Lightning does with a plain scheduler (#5558): it steps on the skipped step
        import lightning_resilient.schedule as schedule

        monkeypatch.setattr(schedule, "AccumulationAwareScheduler", lambda inner, **kw: inner)
    model = Poisoned()
    # A small scale: fp16 gradients on the CPU would otherwise overflow on their own in the first steps.
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      plugins=[plugin])
    trainer.fit(model, data(B))
    steps = len(model.lrs)
    skipped_repeats = model.lrs[3] == model.lrs[2]  # the LR after the skipped step is the one it would have used
    assert skipped_repeats is wrapped
    if wrapped:
        assert trainer.lr_scheduler_configs[0].scheduler.optimizer_steps == steps - 1


# -- onecycle for every warmup, and past its end --------------------------------------------------------------------

def _momentum_opt() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0, momentum=0.9)  # OneCycleLR cycles momentum


def _lrs(opt: torch.optim.Optimizer, sched: AccumulationAwareScheduler, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("total, warmup, rise", [(100, 0, 0), (100, 1, 1), (12, 0.1, 1), (10, 2, 2), (10, 9, 9)])
def test_onecycle_trains_for_every_warmup_and_peaks_after_it(total, warmup, rise):
    # warmup_steps=0 and a warmup of one step once divided by zero inside torch's OneCycleLR.
    opt = _momentum_opt()
    sched = warmup_schedule(opt, "onecycle", total_steps=total, warmup_steps=warmup)
    seen = _lrs(opt, sched, total)
    assert seen[:rise + 1] == sorted(seen[:rise + 1]) and seen[rise:] == sorted(seen[rise:], reverse=True)
    if rise:
        assert seen[0] == pytest.approx(1.0 / 25) and seen[rise] == pytest.approx(1.0)  # initial_lr, then max_lr
    else:
        assert 0.99 < seen[0] < 1.0  # no rise: the first step is one step into the decay from max_lr
    assert sched.get_last_lr()[0] == opt.param_groups[0]["initial_lr"] / 1e4 < seen[-1]  # the end, after the last


@pytest.mark.parametrize("kind", ["linear", "onecycle"])
def test_warmup_steps_count_the_same_for_every_kind(kind):
    opt = _momentum_opt()
    seen = _lrs(opt, warmup_schedule(opt, kind, total_steps=10, warmup_steps=3), 10)
    assert max(seen) == seen[3] == pytest.approx(1.0) and seen[2] < seen[3]  # three steps below the peak


@pytest.mark.parametrize("kind", ["linear", "cosine", "onecycle"])
@pytest.mark.parametrize("frequency", [2, 3])
def test_a_schedule_changing_every_few_steps_still_ends_at_the_last_step(kind, frequency):
    # It was sized in optimizer steps but advanced once per `frequency` of them: frequency=2 ended halfway.
    opt = _momentum_opt()
    reference = _momentum_opt()
    sched = warmup_schedule(opt, kind, total_steps=12, warmup_steps=3, min_lr_ratio=0.1, frequency=frequency)
    ends = warmup_schedule(reference, kind, total_steps=12, warmup_steps=3, min_lr_ratio=0.1)
    seen = _lrs(opt, sched, 12)
    _lrs(reference, ends, 12)
    assert opt.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"])  # the end, after the last
    assert all(seen[i] == seen[i - i % frequency] for i in range(12))  # a change every `frequency` steps
    peak = next(i for i, lr in enumerate(seen) if lr == pytest.approx(1.0))
    assert peak == -(-3 // frequency) * frequency and max(seen[:peak]) < 1.0  # at least 3 steps below the peak
    assert seen[peak:] == sorted(seen[peak:], reverse=True) and seen[-1] > opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"frequency \(13\) must be at most the schedule's 12 optimizer steps"):
        warmup_schedule(_momentum_opt(), kind, total_steps=12, frequency=13)
    with pytest.raises(ValueError, match="leave no decay at frequency=5"):
        warmup_schedule(_momentum_opt(), kind, total_steps=12, warmup_steps=9, frequency=5)


def test_a_onecycle_run_past_its_end_keeps_the_final_lr_and_warns_once():
    opt = _momentum_opt()
    sched = warmup_schedule(opt, "onecycle", total_steps=4, warmup_steps=1)
    _lrs(opt, sched, 4)
    final = opt.param_groups[0]["lr"]
    with pytest.warns(RuntimeWarning, match="sized for 4 optimizer steps but training is at step 5"):
        seen = _lrs(opt, sched, 4)  # torch would raise "Tried to step 6 times" at the 2nd, and bounce at the 1st
    assert seen == [final] * 4 and opt.param_groups[0]["lr"] == final


def test_a_wrapped_onecycle_is_never_stepped_past_its_total_steps():
    opt = _momentum_opt()
    inner = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5)
    sched = AccumulationAwareScheduler(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lrs(opt, sched, 5)  # torch's own range: position 5 is allowed
    held = opt.param_groups[0]["lr"]
    with pytest.warns(RuntimeWarning, match="sized for 5 optimizer steps but training is at step 6"):
        seen = _lrs(opt, sched, 3)
    assert seen == [held] * 3 and inner.last_epoch == 5


def test_training_cli_trains_a_onecycle_schedule_without_warmup(tmp_path, monkeypatch):
    from lightning_resilient.cli import main

    configs = Path(__file__).parents[1] / "configs"
    for warmup, steps in (("0", 4), ("0.1", 12)):  # 0.1 of 12 is one step: it divided by zero too
        (tmp_path / warmup).mkdir()
        monkeypatch.chdir(tmp_path / warmup)  # the config's checkpoint folder is relative: one run each
        main(["train", "fit", "-c", str(configs / "base.yaml"), "-c", str(configs / "local.yaml"),
              "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false",
              "--trainer.enable_model_summary", "false", "--model.schedule", "onecycle",
              "--model.warmup_steps", warmup, "--model.hidden", "16"])  # the schedule is the point, not the model
        root = tmp_path / warmup / "runs/run-1/checkpoints"
        assert Pointer.from_bytes((root / POINTER_NAME).read_bytes(), where=str(root)).latest.step == steps


# -- a resume that changes the schedule's length ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["onecycle", "cosine"])
def test_a_resume_with_more_max_steps_warns_which_schedule_it_follows(tmp_path, kind):
    uninterrupted = Recorder(kind)
    fit(uninterrupted, B, 1, max_steps=10)
    first = Recorder(kind)
    fit(first, B, 1, max_steps=10, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10)])
    assert first.lrs == uninterrupted.lrs
    resumed = Recorder(kind)
    message = ("ends after 10 optimizer steps but training now runs 18: the last steps train at the final LR"
               if kind == "onecycle" else "sized for 10 optimizer steps when saved and for 18 now")
    with pytest.warns(RuntimeWarning, match=message) as caught:
        trainer = fit(resumed, B, 1, max_steps=18, ckpt_path=str(tmp_path / "epoch=0-step=10.ckpt"),
                      callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    assert trainer.global_step == 18 and len(resumed.lrs) == 8  # torch's OneCycleLR once raised at step 12
    assert sum("LR schedule" in str(w.message) for w in caught) == 1  # one warning, not one more at its end
    end = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    if kind == "onecycle":  # the restored schedule ended at step 10: its final LR from then on
        assert resumed.lrs == [end] * 8
    else:  # the new, longer cosine from the first resumed step on, as if it had been 18 steps long from the start
        longer = Recorder(kind)
        fit(longer, B, 1, max_steps=18)
        assert resumed.lrs == longer.lrs[10:] and end == 0.1 * 0.1
