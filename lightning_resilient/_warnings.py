"""``warn``: a warning of this package, shown at the user's line that led to it.

Most of the package's warnings are raised inside Lightning's calls (a callback hook, the plugin's save or load, a
scheduler step), so a fixed ``stacklevel`` names a line of Lightning's (``lightning/pytorch/trainer/call.py``) or of
this package: a user reads the warning under a file they never wrote. ``warn`` names the innermost frame outside
this package, Lightning, torch and Python's own modules: the user's ``trainer.fit(...)`` or the script line that
called this package. A warning raised in a background thread (a persist, a copy between nodes), where no user frame
is on the stack, names the line of this package that raised it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from types import FrameType

__all__ = ["warn"]


def _folders() -> tuple[str, ...]:
    """The folders whose frames are never the user's (with a trailing separator)."""
    found = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "torch", "jsonargparse"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            found.append(os.path.dirname(os.path.abspath(path)))
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        found.append(os.path.abspath(stdlib))
    return tuple(os.path.join(f, "") for f in found)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside :func:`_folders` for a ``warnings.warn`` called in
    :func:`warn` (1: :func:`warn` itself; 2: its caller); 2 when every frame is inside them."""
    folders = _folders()
    frame: FrameType | None = sys._getframe(2)  # the caller of warn(): warnings.warn's stacklevel 2
    level = 2
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(folders) and not frame.f_code.co_filename.startswith("<"):
            return level
        frame = frame.f_back
        level += 1
    return 2


def warn(message: str, category: type[Warning] = UserWarning, *, rank_zero: bool = False) -> None:
    """``warnings.warn(message, category)`` at the user's line (see the module docstring); ``rank_zero``: only on
    global rank 0 of a job (as Lightning's ``rank_zero_warn``)."""
    if rank_zero:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if int(getattr(rank_zero_only, "rank", 0) or 0) != 0:
            return
    warnings.warn(message, category, stacklevel=_user_stacklevel())
