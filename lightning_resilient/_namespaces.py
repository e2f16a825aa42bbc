"""The two names Lightning is installed under: ``lightning.pytorch`` (ours) and the standalone ``pytorch_lightning``.

``pip install lightning`` installs both, with the same code but distinct classes, so a ``pytorch_lightning.Trainer``
refuses a ``lightning.pytorch`` plugin or callback by type. The checkpoint plugin needs nothing of the Trainer's
classes, so it is registered with the other namespace's ``CheckpointIO`` (an ABC) and works under both. The
precision plugin derives from both namespaces' ``Precision`` (neither is an ABC) and drives the precision classes
of the Trainer that uses it, so it works under both too. The callbacks reach into Lightning's loops: under
``pytorch_lightning`` they say which import to use.

Both namespaces name their connector classes alike, which is how :func:`trainer_on_stack` finds the Trainer that
calls a plugin or an entry point that Lightning hands no Trainer.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["LIGHTNING_PYTORCH", "PYTORCH_LIGHTNING", "namespace_of", "register_checkpoint_io",
           "require_lightning_pytorch", "trainer_on_stack"]

LIGHTNING_PYTORCH = "lightning.pytorch"
PYTORCH_LIGHTNING = "pytorch_lightning"

_USE = ("import the Trainer and callbacks from `lightning.pytorch` (`from lightning.pytorch import Trainer`), not from"
        " `pytorch_lightning`: the two namespaces hold distinct classes (`pip install lightning` installs both), and"
        " lightning_resilient is built on `lightning.pytorch`")


def register_checkpoint_io(cls: type) -> None:
    """Make ``pytorch_lightning.Trainer(plugins=[cls()])`` accept ``cls`` when that namespace is in use: its
    ``CheckpointIO`` is ``lightning_fabric``'s, an ABC. Called when a plugin is created, by which time a script that
    builds a ``pytorch_lightning.Trainer`` has imported it (nothing is imported here)."""
    fabric = sys.modules.get("lightning_fabric.plugins.io.checkpoint_io")
    base = getattr(fabric, "CheckpointIO", None)
    if base is not None and not issubclass(cls, base):
        base.register(cls)


def namespace_of(trainer: Any) -> str:
    """The namespace ``trainer``'s class comes from: :data:`PYTORCH_LIGHTNING` or :data:`LIGHTNING_PYTORCH`."""
    return PYTORCH_LIGHTNING if type(trainer).__module__.split(".", 1)[0] == PYTORCH_LIGHTNING else LIGHTNING_PYTORCH


def require_lightning_pytorch(trainer: Any, who: str) -> None:
    """Raise a TypeError naming the import to use when ``trainer`` is a ``pytorch_lightning`` Trainer."""
    if namespace_of(trainer) == PYTORCH_LIGHTNING:
        raise TypeError(f"{who} was given a pytorch_lightning.Trainer: {_USE}")


def trainer_on_stack(owner: str) -> Any:
    """The Trainer of the innermost ``owner`` up the call stack (a Lightning connector class, such as
    ``"_CheckpointConnector"``, of either namespace: they hold their Trainer as ``trainer``), or None.

    Lightning hands a ``CheckpointIO`` no Trainer, nor a ``callbacks_factory`` entry point the Trainer being built;
    what they do depends on it (why a checkpoint loads; whether the Trainer uses our plugin)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        found = frame.f_locals.get("self")
        if type(found).__name__ == owner:
            return getattr(found, "trainer", None)
        frame = frame.f_back
    return None
