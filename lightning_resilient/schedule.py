"""LR schedules counted in real optimizer steps, whatever calls ``step()`` and however often.

With gradient accumulation a scheduler stepped per micro-batch runs K times too fast, and one sized from
``len(dataloader) * epochs`` is K times too long. :class:`AccumulationAwareScheduler` advances the scheduler it
wraps only when the optimizer really updated the weights since the last advance (an optimizer step skipped by
the fp16 GradScaler does not count), and :func:`warmup_schedule` sizes warmup + decay schedules from the
trainer's real optimizer-step count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from lightning_resilient._checks import check_bool, check_choice, check_int, check_number, check_optional_int
from lightning_resilient._warnings import warn

__all__ = ["AccumulationAwareScheduler", "ScheduleKind", "warmup_schedule"]

ScheduleKind = Literal["linear", "cosine", "onecycle", "constant"]


class AccumulationAwareScheduler(LRScheduler):
    """Advance ``scheduler`` once per ``frequency`` real optimizer steps, however often ``step()`` is called.

    Real steps are counted by a hook on the optimizer's ``step`` (``register_step_post_hook``), so calling
    ``step()`` after every micro-batch (plain PyTorch, Lightning manual optimization, or Lightning's automatic
    loop with ``accumulate_grad_batches``) gives the schedule per optimizer step. When the GradScaler skips an
    optimizer step (inf/NaN gradients) the optimizer's ``step`` is never called, so the schedule does not advance
    unless ``count_skipped_steps=True`` (which needs the ``scaler``).

    It is an ``LRScheduler`` itself, so Lightning accepts it from ``configure_optimizers`` and
    ``LearningRateMonitor`` reads it; ``state_dict``/``load_state_dict`` carry the wrapped scheduler's state and
    the step counters, so a resumed run continues the schedule exactly.

    Example (plain PyTorch, accumulating 4 micro-batches)::

        sched = AccumulationAwareScheduler(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000))
        for i, batch in enumerate(loader):
            loss(batch).backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
            sched.step()  # every micro-batch: advances once per optimizer step

    Args:
        scheduler: any ``torch.optim.lr_scheduler`` scheduler (``ReduceLROnPlateau`` included).
        frequency: advance once every this many real optimizer steps (Lightning's own ``frequency`` counts
            micro-batches; leave that at 1 and set this instead).
        count_skipped_steps: also count optimizer steps that the GradScaler skipped.
        scaler: the GradScaler whose skipped steps ``count_skipped_steps`` counts.
        total_steps: the schedule's length in optimizer steps, if known (set by :func:`warmup_schedule`). Past it
            the wrapped scheduler is no longer advanced, so the LR stays at its final value, with a warning.

    A ``OneCycleLR`` is never advanced past its own ``total_steps`` (torch raises "Tried to step ... times"
    there): the LR stays at its final value, with the same warning. A resume whose ``total_steps`` differs from
    the checkpoint's warns once, saying which length the resumed run follows (a ``OneCycleLR`` restores its own,
    a ``LambdaLR`` of :func:`warmup_schedule` takes this run's).
    """

    def __init__(
        self,
        scheduler: LRScheduler | Any,
        *,
        frequency: int = 1,
        count_skipped_steps: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        total_steps: int | None = None,
    ) -> None:
        optimizer = getattr(scheduler, "optimizer", None)
        if not isinstance(optimizer, Optimizer) or not callable(getattr(scheduler, "step", None)):
            raise TypeError("scheduler must be a torch.optim.lr_scheduler scheduler bound to an optimizer, got"
                            f" {type(scheduler).__name__}")
        if isinstance(scheduler, AccumulationAwareScheduler):
            raise TypeError("scheduler is already an AccumulationAwareScheduler: wrap the inner scheduler once")
        frequency = check_int("frequency", frequency, minimum=1, hint="optimizer steps")
        count_skipped_steps = check_bool("count_skipped_steps", count_skipped_steps)
        if count_skipped_steps and scaler is None:
            raise ValueError("count_skipped_steps=True needs scaler=<the GradScaler>, whose step() calls are counted")
        total_steps = check_optional_int("total_steps", total_steps, minimum=1,
                                         none_means="no warning when training runs past the schedule")
        # LRScheduler.__init__ is deliberately not called: it would take an initial step and patch
        # optimizer.step a second time. The wrapped scheduler already did both.
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.frequency = frequency
        self.count_skipped_steps = count_skipped_steps
        self.total_steps = total_steps
        self.base_lrs = list(getattr(scheduler, "base_lrs", [g["lr"] for g in optimizer.param_groups]))
        self.optimizer_steps = 0  # real optimizer steps seen (or attempted, with count_skipped_steps)
        self._consumed = 0  # optimizer steps already turned into schedule advances
        self.advances = 0
        self._warned_past_end = False
        if count_skipped_steps:
            assert scaler is not None
            self._hook = None
            inner_step = scaler.step

            def counting_step(optimizer: Optimizer, *args: Any, **kwargs: Any) -> float | None:
                if optimizer is self.optimizer:
                    self.optimizer_steps += 1
                return inner_step(optimizer, *args, **kwargs)

            scaler.step = counting_step  # type: ignore[method-assign]
        else:
            self._hook = optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1

    @property
    def last_epoch(self) -> int:
        return int(getattr(self.scheduler, "last_epoch", self.advances))

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        pass  # owned by the wrapped scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the wrapped scheduler if ``frequency`` real optimizer steps happened since the last advance.

        Arguments (e.g. ``metrics`` for ``ReduceLROnPlateau``) are passed through.
        """
        if self.optimizer_steps - self._consumed < self.frequency:
            return
        self._consumed += self.frequency
        self.advances += 1
        if self.total_steps is not None and self._consumed > self.total_steps:
            self._past_end(self.total_steps)
        elif isinstance(self.scheduler, OneCycleLR) and self.scheduler.last_epoch >= self.scheduler.total_steps:
            self._past_end(self.scheduler.total_steps)  # one more step() and torch raises "Tried to step"
        else:
            self.scheduler.step(*args, **kwargs)

    def _past_end(self, sized: int) -> None:
        # The wrapped scheduler stays where it ended: a OneCycleLR would raise, a periodic one would climb again.
        if self._warned_past_end:
            return
        self._warned_past_end = True
        warn(f"the LR schedule was sized for {sized} optimizer steps but training is at step {self._consumed}: the"
             " schedule has ended and the LR stays at its final value. Size it from"
             " trainer.estimated_stepping_batches or pass the right total_steps.", RuntimeWarning)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        last = getattr(self.scheduler, "get_last_lr", None)
        if callable(last):
            try:
                return list(last())
            except AttributeError:  # ReduceLROnPlateau before its first step on older torch
                pass
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float | torch.Tensor]:
        return self.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps,
                "consumed": self._consumed, "advances": self.advances, "frequency": self.frequency,
                "total_steps": self.total_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("frequency", self.frequency) != self.frequency:
            warn(f"resuming a schedule saved with frequency={state_dict['frequency']} under"
                 f" frequency={self.frequency}: the schedule continues at the new frequency", RuntimeWarning)
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.optimizer_steps = int(state_dict["optimizer_steps"])
        self._consumed = int(state_dict["consumed"])
        self.advances = int(state_dict["advances"])
        saved = state_dict.get("total_steps")  # absent in checkpoints written before it was saved
        if saved is None or self.total_steps is None or saved == self.total_steps:
            return
        if isinstance(self.scheduler, OneCycleLR):
            # torch restores OneCycleLR's own length and phases: the resumed run follows the saved schedule.
            planned, self.total_steps = self.total_steps, int(saved)
            if planned > saved:
                self._warned_past_end = True  # said here, before the steps it concerns
                warn(f"the resumed LR schedule (OneCycleLR, restored from the checkpoint) ends after {saved}"
                     f" optimizer steps but training now runs {planned}: the last steps train at the final"
                     " LR. To follow a longer schedule, start its LR schedule anew (a new run).", RuntimeWarning)
            else:
                warn(f"the resumed LR schedule (OneCycleLR, restored from the checkpoint) ends after {saved}"
                     f" optimizer steps but training now runs {planned}: it will never decay fully", RuntimeWarning)
        else:
            warn(f"the LR schedule was sized for {saved} optimizer steps when saved and for"
                 f" {self.total_steps} now: the resumed run follows the new length from step"
                 f" {self._consumed} on, so the LR changes from the saved trajectory", RuntimeWarning)
            if isinstance(self.scheduler, LambdaLR):
                # The optimizer came back with the saved schedule's LR for this step; LambdaLR's LR is a closed
                # form of its position, so recomputing the current position gives the new schedule's LR from the
                # first resumed step on (step() adds the 1 back; a chained scheduler could not be recomputed).
                self.scheduler.last_epoch -= 1
                self.scheduler.step()


def _steps_from_trainer(trainer: Any) -> int:
    steps = trainer.estimated_stepping_batches
    if steps is None or (isinstance(steps, float) and not math.isfinite(steps)) or steps <= 0:
        raise ValueError(
            "cannot size the LR schedule: the trainer does not know how many optimizer steps it will take"
            f" (estimated_stepping_batches={steps!r}; the training loader has no length and max_steps is not"
            " set). Set Trainer(max_steps=...) or pass total_steps=... explicitly."
        )
    return int(steps)


def warmup_schedule(
    optimizer: Optimizer,
    kind: ScheduleKind = "cosine",
    *,
    trainer: Any | None = None,
    total_steps: int | None = None,
    warmup_steps: int | float = 0,
    min_lr_ratio: float = 0.0,
    max_lr: float | list[float] | None = None,
    frequency: int = 1,
    count_skipped_steps: bool = False,
    scaler: torch.amp.GradScaler | None = None,
) -> AccumulationAwareScheduler:
    """A warmup + decay schedule counted in optimizer steps, ready to return from ``configure_optimizers``.

    Args:
        optimizer: the optimizer whose ``lr`` is the peak (after warmup).
        kind: ``"linear"`` or ``"cosine"`` decay to ``min_lr_ratio * lr``, ``"constant"`` after warmup, or
            ``"onecycle"`` (torch's ``OneCycleLR``; ``max_lr`` defaults to the optimizer's lr).
        trainer: take the length from ``trainer.estimated_stepping_batches`` (which already divides by
            ``accumulate_grad_batches``), e.g. ``self.trainer`` inside ``configure_optimizers``.
        total_steps: the length in optimizer steps instead (or as a check against the trainer's count).
        warmup_steps: optimizer steps of linear warmup, or a fraction (< 1) of the total: the LR rises for that
            many steps and the next one trains at the peak (from 0 for ``"linear"``, ``"cosine"`` and
            ``"constant"``, from OneCycleLR's ``max_lr / 25`` for ``"onecycle"``). With 0 the first step trains at
            the peak (for ``"onecycle"``, one step into its decay: OneCycleLR's ``pct_start=0``).
        min_lr_ratio: final LR as a fraction of the peak.
        frequency: change the LR once every this many optimizer steps (the schedule is sized in those changes,
            so it still ends at the last step); see :class:`AccumulationAwareScheduler` for the rest.

    The schedule reaches its end value exactly at the last optimizer step. Example::

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-4)
            sched = warmup_schedule(opt, "cosine", trainer=self.trainer, warmup_steps=0.05)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    """
    check_choice("kind", kind, ("linear", "cosine", "onecycle", "constant"))
    if trainer is None and total_steps is None:
        raise ValueError("pass trainer=... (its estimated_stepping_batches sizes the schedule) or total_steps=...")
    total_steps = check_optional_int("total_steps", total_steps, minimum=1, none_means="the trainer's count")
    if trainer is not None:
        planned = _steps_from_trainer(trainer)
        if total_steps is None:
            total_steps = planned
        elif total_steps < planned:
            warn(f"the LR schedule ends after {total_steps} optimizer steps but training runs {planned}:"
                 " the last steps train at the final LR", RuntimeWarning)
        elif total_steps > planned * 1.1:
            warn(f"training ends after {planned} optimizer steps, far before the LR schedule's"
                 f" {total_steps}: it will never decay fully", RuntimeWarning)
    assert total_steps is not None
    frequency = check_int("frequency", frequency, minimum=1, hint="optimizer steps")
    steps = check_number("warmup_steps", warmup_steps, minimum=0,
                         hint="a number of steps, or a fraction of them below 1")
    # Below 1, a fraction of the schedule (0.05; 0 is no warmup either way); from 1 on, a number of steps (5, 5.0).
    warmup = round(steps * total_steps) if steps < 1 else int(steps)
    if warmup >= total_steps and kind != "constant":
        raise ValueError(f"warmup_steps ({warmup}) must be shorter than the schedule ({total_steps} steps)")
    if not 0.0 <= check_number("min_lr_ratio", min_lr_ratio) <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    # The inner schedule moves once per `frequency` optimizer steps, so it is sized in those advances: the end after
    # total_steps optimizer steps (the floor: steps past the last advance keep the final LR), the peak once at least
    # warmup_steps steps trained below it (a warmup rounds up to whole advances).
    if total_steps < frequency:
        raise ValueError(f"frequency ({frequency}) must be at most the schedule's {total_steps} optimizer steps:"
                         " the schedule would never advance")
    total_advances, warmup = total_steps // frequency, -(-warmup // frequency)
    if warmup >= total_advances and kind != "constant":
        raise ValueError(f"warmup_steps ({warmup_steps}) leave no decay at frequency={frequency}: the schedule has"
                         f" {total_advances} advances and the warmup takes {warmup} of them")

    inner: LRScheduler
    if kind == "onecycle":
        peak = max_lr if max_lr is not None else [g["lr"] for g in optimizer.param_groups]
        # OneCycleLR rises until position pct_start * (total_steps + 1) - 1, which is `warmup` here: the step after
        # the warmup trains at the peak, as for the other kinds. A rise that ends at position 0 would divide by
        # zero in torch, so no warmup is pct_start=0 (torch's "no rise": the decay starts at once).
        inner = OneCycleLR(optimizer, max_lr=peak, total_steps=total_advances + 1,
                           pct_start=(warmup + 1) / (total_advances + 1) if warmup else 0.0, anneal_strategy="cos")
    else:
        inner = LambdaLR(optimizer, _lambda(kind, total_advances, warmup, min_lr_ratio))
    return AccumulationAwareScheduler(inner, frequency=frequency, count_skipped_steps=count_skipped_steps,
                                      scaler=scaler, total_steps=total_steps)


def _factor(kind: str, total: int, warmup: int, floor: float, step: int) -> float:
    # step = optimizer steps taken; the LR for the next update. factor(total) is the schedule's end.
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)  # exactly floor at the end
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _lambda(kind: str, total: int, warmup: int, floor: float) -> Callable[[int], float]:
    # A partial of a module-level function, not a closure: the scheduler pickles (ddp_spawn, torch.save(trainer)),
    # and LambdaLR's state_dict still stores nothing of it (an empty __dict__), so a resume with a longer
    # total_steps takes the new schedule, as before.
    return functools.partial(_factor, kind, total, warmup, floor)
