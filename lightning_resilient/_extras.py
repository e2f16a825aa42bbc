"""Optional dependencies (the package's extras): checked before a command starts any work.

A command that needs an extra says so at once, with the command that installs it, instead of failing with a
``ModuleNotFoundError`` after minutes of work. The object stores are extras too (``s3``, ``gcs``; ``all`` is both):
a root on a store whose filesystem is not installed is refused the same way (see :data:`PROTOCOL_EXTRAS`).
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "MissingExtraError", "PROTOCOL_EXTRAS", "missing", "require"]

# extra -> (importable module, the requirement that provides it); pyproject.toml's [project.optional-dependencies].
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (("s3fs", "s3fs"),),
    "gcs": (("gcsfs", "gcsfs"),),
    "cli": (("jsonargparse", "jsonargparse[signatures]"), ("docstring_parser", "jsonargparse[signatures]"),
            ("typeshed_client", "jsonargparse[signatures]")),
    "demo": (("jsonargparse", "jsonargparse[signatures]"), ("docstring_parser", "jsonargparse[signatures]"),
             ("typeshed_client", "jsonargparse[signatures]"), ("moto", "moto[server]"), ("flask", "moto[server]"),
             ("boto3", "boto3"), ("matplotlib", "matplotlib"), ("s3fs", "s3fs")),
}

# fsspec protocol -> the extra that installs its filesystem (fsspec itself knows these protocols, and fails only
# when the root is opened, with its own words).
PROTOCOL_EXTRAS: dict[str, str] = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency a command needs is not installed; the message is the command that installs it."""


def missing(extra: str) -> list[str]:
    """The requirements of ``extra`` that are not installed (each named once, in the order of :data:`EXTRAS`)."""
    out: list[str] = []
    for module, requirement in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None and requirement not in out:
            out.append(requirement)
    return out


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming the install command when ``extra`` is not fully installed.

    ``what``: who needs it, the message's first words (``"lightning-resilient demo"``).
    """
    absent = missing(extra)
    if absent:
        raise MissingExtraError(
            f"{what}: needs {', '.join(absent)} (the [{extra}] extra), not installed here: pip install"
            f" 'lightning-resilient[{extra}]' (in a clone: pip install -e '.[{extra}]')", name=absent[0])
