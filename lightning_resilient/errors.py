"""Exceptions raised by lightning_resilient.

Each one says what went wrong and what to do about it. Errors about stored checkpoints derive from
:class:`CheckpointError`, so a caller can catch the family at once; errors about a store that cannot be used as
configured (no such bucket, no credentials, a URL no filesystem knows) derive from :class:`StoreSetupError` and
from the built-in a caller would expect (``FileNotFoundError``, ``PermissionError``, ``ValueError``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BucketNotFoundError",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CollectiveError",
    "PersistFailedError",
    "ResumeMismatchError",
    "RunExistsError",
    "SettingTypeError",
    "ShardedCheckpointError",
    "StaleWriterError",
    "StoreCredentialsError",
    "StorePermissionError",
    "StoreSetupError",
    "StoreURLError",
    "UnfencedStoreError",
    "UnsupportedFormatError",
]


class SettingTypeError(TypeError, ValueError):
    """An argument of the wrong type (``keep_last="3"``), raised when the object is made. It is a ``TypeError``, and
    also a ``ValueError``: earlier versions raised one or the other for different settings, and code that catches
    either keeps working."""


class CheckpointError(Exception):
    """Base class of every error this package raises about stored checkpoints."""


class StaleWriterError(CheckpointError):
    """This job was superseded: a newer job claimed the checkpoint root after this one did.

    Raised on the stale job's next save (or removal). Its checkpoints never become ``latest``; the job should
    stop, because another job is now training from the same root.
    """

    def __init__(self, root: str, own_epoch: int, current_epoch: int, current_writer: str, *,
                 recreated: bool = False) -> None:
        self.root = root
        self.own_epoch = own_epoch
        self.current_epoch = current_epoch
        self.current_writer = current_writer
        #: The root was deleted and written again since this job claimed it (another incarnation of it, whatever
        #: its writer epoch), rather than claimed by a newer job.
        self.recreated = recreated
        if recreated:
            message = (f"this job writes {root!r} as writer epoch {own_epoch}, but that root was deleted and written"
                       f" again since (now by {current_writer}, writer epoch {current_epoch}): it holds another run,"
                       " so this job is stale and its save was not committed. Stop this job; to keep training it,"
                       " resume it into a ModelCheckpoint dirpath of its own.")
        else:
            message = (f"this job writes {root!r} as writer epoch {own_epoch}, but writer epoch {current_epoch}"
                       f" ({current_writer}) has claimed it since: another job resumed from this root, so this job is"
                       " stale and its save was not committed. Stop this job; the newer one continues the run.")
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (its fields and notes), as DCP and the ranks of a job pass errors to one another.
        return (_stale_writer, (self.root, self.own_epoch, self.current_epoch, self.current_writer, self.recreated),
                self.__dict__)


class CheckpointCorruptedError(CheckpointError):
    """A stored object failed verification (missing, wrong size, wrong checksum or unparsable).

    ``object`` names the first bad object found.
    """

    def __init__(self, message: str, *, object: str | None = None) -> None:  # shadows the builtin: the natural name
        self.object = object
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), tuple(self.args), self.__dict__)


def _stale_writer(root: str, own_epoch: int, current_epoch: int, current_writer: str,
                  recreated: bool) -> StaleWriterError:
    return StaleWriterError(root, own_epoch, current_epoch, current_writer, recreated=recreated)


class PersistFailedError(CheckpointError):
    """With a local tier: persists to the durable tier kept failing past the bound the plugin sets
    (``max_persist_failures`` in a row, or ``max_seconds_without_durable``). Raised by the save after the bound
    was passed (that save is committed to the local tier first); the last failure is its ``__cause__``."""


class CollectiveError(RuntimeError):
    """A collective this package runs between the processes of a job (the resume decision, a sharded save across the
    nodes' local tiers, the copies between nodes) failed or timed out: another process took another path, ended or
    hangs. The message names this rank, the operation and the bound (``AtomicCheckpointIO(collective_timeout=...)``
    or the job's process-group timeout)."""


class ResumeMismatchError(ValueError):
    """The ranks of one job were given checkpoints of different roots (or a plain file beside a root): no single
    decision resumes them all. Raised on every rank, naming what each was given and the fix."""


class UnsupportedFormatError(CheckpointError):
    """A pointer, manifest or resume record has a format this lightning_resilient does not read: a newer version
    wrote it, or a development build from before the first release (format 1). Never garbage: it is kept."""


class ShardedCheckpointError(CheckpointError, ValueError):
    """A sharded (per-rank, ``torch.distributed.checkpoint``) checkpoint was loaded the way a full one is.

    Resume it with the strategy that wrote it (:class:`~lightning_resilient.AtomicModelParallelStrategy` or
    :class:`~lightning_resilient.AtomicFSDPStrategy`), or consolidate it with
    :func:`lightning_resilient.io.sharded.load_full`.
    """


class StoreSetupError(Exception):
    """The store cannot be used as configured; the message says what to fix, in a line or two.

    ``lightning-resilient`` prints the message alone (no traceback) and exits with status 2. ``cli_message`` is the
    same message with its hints phrased for the command line (``--storage-options`` instead of the Python argument).
    """

    def __init__(self, message: str, *, cli_message: str | None = None) -> None:
        super().__init__(message)
        self.cli_message = cli_message or message


class BucketNotFoundError(StoreSetupError, FileNotFoundError):
    """The bucket of an S3/GCS checkpoint root does not exist (or the credentials cannot see it)."""


class StoreCredentialsError(StoreSetupError, PermissionError):
    """No credentials reach the store, or they may not do what was asked; the message names what to set."""


class StorePermissionError(StoreSetupError, PermissionError):
    """Local disk refuses this process what was asked (a read-only checkpoint folder, another user's): the message is
    about the folder's permissions, not about credentials."""


class RunExistsError(StoreSetupError, FileExistsError):
    """A ``fit`` that resumes no checkpoint was started into a checkpoint folder that holds a committed run: it would
    train from step 0 and leave that run behind (an abandoned branch). Raised when ``fit`` starts, before its first
    step; the message names the checkpoint to resume. ``AtomicCheckpointIO(new_run=True)`` says the fit is meant to
    start a new run there."""


class StoreURLError(StoreSetupError, ValueError):
    """A URL no installed fsspec filesystem can open (an unknown protocol, or its filesystem is not installed)."""


class UnfencedStoreError(StoreSetupError):
    """The store accepts conditional writes without enforcing them (a server, or a proxy in front of it, that ignores
    ``If-Match`` / ``If-None-Match`` or ``ifGenerationMatch``), so writer fencing cannot work: two jobs writing the
    root at once would overwrite each other's pointer and lose checkpoints. Raised when ``fit`` starts (and before a
    job's first write), unless ``AtomicCheckpointIO(allow_unfenced_store=True)`` says that one job at a time writes
    the root."""
