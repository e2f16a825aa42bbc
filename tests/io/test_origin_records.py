"""Origin records (io/origin_records.py): one record per writer epoch, created only if absent, on every store."""

from __future__ import annotations

from typing import Any

from lightning_resilient.io.lineage import ORIGINS_DIR, Origin
from lightning_resilient.io.origin_records import OriginRecords
from lightning_resilient.io.retry import RetryPolicy
from lightning_resilient.io.store import open_store


def _records(backend: Any) -> OriginRecords:
    return OriginRecords(open_store(backend.root, backend.storage_options, RetryPolicy(2, 0.01, 0.02)))


def test_one_epoch_one_record_one_writer(backend):
    records = _records(backend)
    assert records.newest() == (0, "")
    origin = Origin(None)
    assert records.create(1, origin, "writer-a", "root-1") is None
    assert records.create(1, origin, "writer-a", "root-1") is None  # its own (a retry whose first try landed)
    assert records.create(1, origin, "writer-b", "root-1") == "writer-a"  # another claim of the same epoch
    assert records.create(3, origin, "writer-b", "root-1") is None
    assert records.newest() == (3, "root-1") and records.newest_epoch() == 3
    # Nothing else lands among the records (no lock or temp file: the folder is listed by name).
    assert sorted(records.store.list_dir(ORIGINS_DIR)) == ["e0000000001.json", "e0000000003.json"]
