"""Where ``AtomicCheckpointIO`` stands between the fits of the Trainers that use it.

The fit-start check (``io/fit_check.py``) tells the plugin when a ``fit`` begins and when it ends normally;
:class:`FitLifecycle` keeps what that means: whether a fit runs now (a load then is that fit's business, not a load
outside a Trainer), whether it continues the previous fit from its state in memory (the same job: ``trainer.fit``
called again with a higher ``max_steps``) or is a new job, the checkpoint folders it writes, and its Trainer (weakly
held), whose ModelCheckpoints report the names retention keeps. A copy of the plugin (``ddp_spawn``, ``deepcopy``)
keeps whether a fit runs or continues and its folders, but neither that Trainer nor where the last fit ended.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from lightning_resilient.io.calling_trainer import fit_roots
from lightning_resilient.io.catalog import normalize
from lightning_resilient.io.reported import reported_names

__all__ = ["FitLifecycle"]


class FitLifecycle:
    """The fits of one plugin: the current one's state, and where the last one ended (see the module docstring)."""

    def __init__(self) -> None:
        self.fitting = False  # a Trainer's fit of this plugin is running (between its fit-start check and its end)
        self.continuing = False  # the current fit continues the previous one from its state in memory
        self.dirpaths: list[str] = []  # the checkpoint folders of the current (or last) fit
        self._trainer: weakref.ref[Any] | None = None  # the Trainer of that fit (its ModelCheckpoints' state)
        self._last: _FitEnd | None = None  # where the last fit ended (a next fit may continue it)

    def __getstate__(self) -> dict[str, Any]:
        # A copy keeps whether a fit runs or continues and its folders; the Trainer and the last fit's end belong to
        # the original (and weak references do not pickle).
        state = self.__dict__.copy()
        state["_trainer"] = state["_last"] = None
        return state

    def begin(self, *, resumed: bool, trainer: Any = None, pl_module: Any = None) -> bool:
        """A ``fit`` of ``trainer`` on ``pl_module`` starts; ``resumed``: it loaded a checkpoint. Returns whether it is
        a new job that starts from nothing (it neither resumed nor continues the previous fit in memory): the roots an
        earlier fit of the plugin claimed are then claimed anew (see ``AtomicCheckpointIO.begin_fit``)."""
        last, self._last = self._last, None
        self.fitting = True
        if trainer is not None:
            self.dirpaths = [normalize(d) for d in fit_roots(trainer)]
            self._trainer = weakref.ref(trainer)
        self.continuing = last is not None and trainer is not None and last.continued_by(trainer, pl_module)
        return not (resumed or self.continuing)

    def end(self, trainer: Any, pl_module: Any) -> None:
        """A ``fit`` of ``trainer`` on ``pl_module`` ended normally: a next fit of the same two that starts where this
        one ended continues it."""
        self._last = _FitEnd(weakref.ref(trainer), weakref.ref(pl_module), int(getattr(trainer, "global_step", 0)))
        self.fitting = False

    def torn_down(self) -> None:
        """The plugin's teardown: no fit runs (a fit that failed ends here: Lightning tears the strategy down)."""
        self.fitting = False

    def reported_by_trainer(self, folder: str) -> list[str] | None:
        """The names in ``folder`` that the ModelCheckpoints of the fit report now, read from its Trainer (a
        weights-only save carries no callback state); None without a Trainer, or one with no ModelCheckpoint."""
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            return None
        return reported_names([c.state_dict() for c in getattr(trainer, "checkpoint_callbacks", [])
                               if callable(getattr(c, "state_dict", None))], folder)


@dataclass(frozen=True)
class _FitEnd:
    """Where the last fit of a plugin ended: its Trainer and LightningModule (weakly held) and its global step."""

    trainer: weakref.ref[Any]
    module: weakref.ref[Any]
    step: int

    def continued_by(self, trainer: Any, pl_module: Any) -> bool:
        """Whether a fit of ``trainer`` on ``pl_module`` starts where this one ended, from its state in memory."""
        return (self.step > 0 and self.trainer() is trainer and self.module() is pl_module
                and int(getattr(trainer, "global_step", -1)) == self.step)
