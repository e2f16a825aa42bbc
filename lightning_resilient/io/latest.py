"""``find_latest_checkpoint``: the auto-resume idiom's one call, over the durable root and, when the plugin has
one, its node-local tier.

It sits above both ``catalog.py`` (one root) and ``tier_view.py`` (the two tiers, which build on the catalog), so
neither imports the other back.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_resilient.io.catalog import as_str, check_not_a_file, latest_in_root, reader
from lightning_resilient.io.local_tier import local_tier_url
from lightning_resilient.io.tier_view import find_latest_tiered

__all__ = ["find_latest_checkpoint"]


def find_latest_checkpoint(root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                           local_tier: str | os.PathLike[str] | None = None) -> str | None:
    """The newest committed checkpoint of the current run under ``root``, for ``trainer.fit(ckpt_path=...)``.

    With ``local_tier`` (the plugin's ``local_tier`` folder), the newest of the root's lineage in either tier: a
    checkpoint this node's local tier holds but the root does not (yet) is returned as a URL in the root, which a
    plugin with that ``local_tier`` reads from the local tier (and falls back to the root's copy, or older, when the
    local copy fails verification).

    Returns None when the root holds no committed checkpoint of the current run (a first run). It reads the
    pointer and the newest checkpoint's manifest (which must verify); every byte of the data is verified when the
    checkpoint is loaded, and a damaged one is then replaced by the previous committed checkpoint of the same
    lineage, with a loud warning. A checkpoint of a branch abandoned by a rollback is never returned. A missing
    bucket raises ``FileNotFoundError``, and a root whose every checkpoint is damaged raises
    :class:`~lightning_resilient.CheckpointCorruptedError`, rather than returning None: either would otherwise
    silently restart training from scratch.
    """
    root = as_str(root)
    checkpoint_root = reader(root, storage_options)
    if local_tier is not None:
        check_not_a_file(checkpoint_root.store, root)  # the tiers' view reads the root's folders whatever it holds
        local = reader(local_tier_url(as_str(local_tier), checkpoint_root.url))
        found_tiered = find_latest_tiered(checkpoint_root, local)
        if found_tiered is not None:
            return found_tiered
    return latest_in_root(checkpoint_root, root)
