"""The objects a writer may reference by digest instead of uploading them again.

A commit's manifest names each object with its digest and size. A later save whose object has the same bytes (the
same digest and size) may name the stored one instead of writing a copy:

- without ``dedup``, only objects of a commit of the same step: ``ModelCheckpoint(save_last=True)`` saves the state
  of a top-k save again under ``last.ckpt``. Checkpoints of different steps never share bytes, so one corrupted
  object can never take several of them down;
- with ``dedup`` (incremental saves, ``io/incremental.py``), objects of any step this writer committed, and those
  of the checkpoint the job resumed from (an earlier writer epoch's: a resumed job's first save finds its frozen base
  there, by digest), in folders the pointer keeps live. A tier's persist looks up by digest what the durable root
  already holds (:meth:`KnownObjects.like`).

Only folders live in the pointer are ever referenced: :meth:`KnownObjects.keep_live` forgets the rest before a save,
and the pointer update that commits it checks again, inside its conditional write (``RootWriter.publish``). That is
what makes a reference to an earlier writer epoch's object as safe as one to this writer's own: nothing deletes a
live folder (a fenced writer deletes only what its own last pointer had retired, and it cannot update the pointer
any more).
"""

from __future__ import annotations

from lightning_resilient.io.manifest import Manifest, ObjectEntry
from lightning_resilient.io.pointer import Pointer

__all__ = ["KnownObjects"]


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0]


class KnownObjects:
    """(digest, size) -> root-relative path of the objects a writer stored or loaded, and the step they were of."""

    def __init__(self, *, dedup: bool) -> None:
        self.dedup = dedup
        self._paths: dict[tuple[str, int], str] = {}
        self._step: int | None = None

    def for_save(self, step: int | None, *, incremental: bool) -> dict[tuple[str, int], str]:
        """What a save of ``step`` may reference: any step's objects for an ``incremental`` save (filtered by
        :meth:`keep_live` when it was prepared), else only those of a commit of the same step."""
        if incremental:
            return self._paths
        return self._paths if step is not None and step == self._step else {}

    def remember(self, manifest: Manifest, pointer: Pointer | None = None,
                 held: list[ObjectEntry] | None = None) -> None:
        """``manifest`` was committed (``pointer``: the pointer its commit wrote) or loaded: its objects are known
        from now on (``held``: only those this root stores). Without ``dedup``, a new step forgets the others."""
        if manifest.step != self._step and not self.dedup:
            self._paths = {}
        self._step = manifest.step
        live = pointer.live_folders() if pointer is not None else None
        self._paths = {k: v for k, v in self._paths.items() if live is None or _folder_of(v) in live}
        for obj in manifest.objects if held is None else held:  # only what this root stores may be referenced
            self._paths[(obj.digest, obj.size)] = obj.path

    def keep_live(self, live: set[str]) -> None:
        """Forget the objects outside the ``live`` folders (a removal since the last commit may have retired one)."""
        self._paths = {k: v for k, v in self._paths.items() if _folder_of(v) in live}

    def clear(self) -> None:
        self._paths = {}

    def like(self, obj: ObjectEntry, live: set[str]) -> str | None:
        """The path of a known object with ``obj``'s bytes (its digest and size), in one of the ``live`` folders;
        None when none is known."""
        path = self._paths.get((obj.digest, obj.size))
        return path if path is not None and _folder_of(path) in live else None
