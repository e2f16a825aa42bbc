"""TransferAudit: a no-op on a real CPU run; its detection logic, fed injected events and fake device types."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch

from lightning_resilient.planning import TransferAudit, TransferAuditWarning
from lightning_resilient.planning.audit import SYNC_MESSAGE, _Auditor, _classify_batch, _classify_copy, _CopyWatcher

IDLE = "TransferAudit: no CUDA device in use, nothing to audit"


# -- the real CPU run: nothing hooked, nothing reported, said once ------------------------------------------------
def test_is_a_real_no_op_on_a_cpu_run(cpu_run):
    audit = cpu_run.audit
    assert cpu_run.logs.count(IDLE) == 1
    assert not audit.active
    assert audit.counts == {"pageable": 0, "blocking_copy": 0, "sync": 0}
    assert audit.batches == 0
    # Inside the run: the strategy's transfer hook untouched and warnings shown by whoever showed them before.
    assert len(cpu_run.probe.seen) == 6
    assert not any(seen["transfer_wrapped"] for seen in cpu_run.probe.seen)
    assert all(seen["showwarning"] is cpu_run.showwarning_before for seen in cpu_run.probe.seen)
    assert "batch_to_device" not in vars(cpu_run.trainer.strategy)
    assert not [w for w in cpu_run.caught if issubclass(w.category, TransferAuditWarning)]
    assert audit.summary() == "TransferAudit: 0 pageable tensors, 0 blocking copies, 0 host syncs in 0 audited batches"


# -- the pure core ------------------------------------------------------------------------------------------------
def test_classify_batch_flags_each_pageable_host_tensor_bound_for_an_accelerator():
    batch = {"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.int64), "label", 3],
             "on_device": torch.empty(2, device="meta")}
    events = _classify_batch(batch, "cuda")
    assert sorted(events) == [("pageable", "float32 (4, 8) -> cuda"), ("pageable", "int64 (4,) -> cuda")]
    assert _classify_batch(batch, "cpu") == []  # nothing crosses to a device
    assert _classify_batch(batch, "cuda", is_pinned=lambda t: True) == []  # pinned memory is what we want


@pytest.mark.parametrize(("op", "src", "dst", "non_blocking", "flagged"), [
    ("_to_copy", "cpu", "cuda", False, True),
    ("copy_", "cpu", "cuda", False, True),
    ("_to_copy", "cpu", "cuda", True, False),
    ("copy_", "cpu", "cuda", True, False),
    ("_to_copy", "cuda", "cpu", False, False),  # device to host: a sync, counted by the sync audit instead
    ("_to_copy", "cpu", "cpu", False, False),
    ("add", "cpu", "cuda", False, False),
])
def test_classify_copy(op, src, dst, non_blocking, flagged):
    assert _classify_copy(op, src, dst, non_blocking, device_type="cuda") is flagged


def test_copy_watcher_sees_blocking_copies_through_the_real_dispatcher():
    # The meta device stands in for the GPU: the copies really go through aten._to_copy / aten.copy_.
    host = torch.randn(3)
    with _CopyWatcher("meta") as watcher:
        host.to("meta")
        host.to("meta", non_blocking=True)
        torch.empty(3, device="meta").copy_(host)
        torch.empty(3, device="meta").copy_(host, non_blocking=True)
        host.to(torch.float64)
    assert watcher.events == [
        ("blocking_copy", "aten._to_copy of float32 (3,) cpu -> meta without non_blocking=True"),
        ("blocking_copy", "aten.copy_ of float32 (3,) cpu -> meta without non_blocking=True"),
    ]


def test_auditor_reports_each_kind_once_with_its_fix_and_counts_all():
    emitted: list[str] = []
    auditor = _Auditor(emit=emitted.append)
    for kind, n in (("pageable", 3), ("blocking_copy", 2), ("sync", 4)):
        for i in range(n):
            auditor.record(kind, f"{kind}-{i % 2}")
    assert dict(auditor.counts) == {"pageable": 3, "blocking_copy": 2, "sync": 4}
    assert len(emitted) == 3
    pageable, blocking, sync = emitted
    assert "pageable-0" in pageable and "DataLoader(..., pin_memory=True)" in pageable
    assert "blocking_copy-0" in blocking and ".to(device, non_blocking=True)" in blocking
    assert "at sync-0" in sync and ".item()" in sync and ".cpu()" in sync
    assert "self.log(name, tensor, on_step=True)" in sync
    assert auditor.sites["sync"] == {"sync-0": 2, "sync-1": 2}
    with pytest.raises(ValueError, match="kind must be one of pageable, blocking_copy, sync, got 'other'"):
        auditor.record("other", "x")  # type: ignore[arg-type]


# -- the callback's wiring, on a stand-in strategy and device ------------------------------------------------------
class FakeStrategy:
    """Moves a batch the blocking way, as an overridden transfer_batch_to_device might."""

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        return [t.to("meta") for t in batch]


def _a_sync_in_the_step() -> None:
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)  # what torch's sync debug mode says on .item() and friends


def _run_batches(audit: TransferAudit, strategy: FakeStrategy, n: int) -> None:
    for i in range(n):
        moved = strategy.batch_to_device([torch.randn(2), torch.randn(3)])
        assert [t.device.type for t in moved] == ["meta", "meta"]
        audit.on_train_batch_start(None, None, None, i)  # type: ignore[arg-type]
        _a_sync_in_the_step()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        audit.on_train_batch_end(None, None, None, None, i)  # type: ignore[arg-type]


def test_the_hooks_flag_injected_pageable_tensors_blocking_copies_and_syncs_once_per_kind():
    audit, strategy, modes = TransferAudit(), FakeStrategy(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        shown_by = warnings.showwarning
        audit._start(strategy, "meta", get_mode=lambda: 0, set_mode=modes.append)
        assert "batch_to_device" in vars(strategy)
        _run_batches(audit, strategy, 3)
        audit._stop()
        assert warnings.showwarning is shown_by and warnings.filters == filters
    assert "batch_to_device" not in vars(strategy)
    assert modes == ["warn", 0] * 3  # on for each step, back to what it was after it

    assert audit.counts == {"pageable": 6, "blocking_copy": 6, "sync": 3}
    assert audit.batches == 3
    reports = [str(w.message) for w in caught if issubclass(w.category, TransferAuditWarning)]
    assert len(reports) == 3
    assert [r.split(": ", 1)[1][:12] for r in reports] == ["a batch tens", "a blocking h", "the training"]
    # Only the sync warnings were taken; everything else still reaches the user, once per warn.
    assert [str(w.message) for w in caught if w.category is UserWarning] == ["an unrelated warning"] * 3
    (site, count), = audit.sites["sync"].items()
    assert site.startswith(__file__) and count == 3
    assert "3 host syncs in 3 audited batches" in audit.summary()


def test_max_batches_and_syncs_off():
    audit, strategy, modes = TransferAudit(max_batches=2, syncs=False), FakeStrategy(), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit._start(strategy, "meta", get_mode=lambda: 0, set_mode=modes.append)
        _run_batches(audit, strategy, 3)
        audit.on_exception(None, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert "batch_to_device" not in vars(strategy)
    assert modes == []  # syncs=False: the debug mode is never touched
    assert audit.counts == {"pageable": 4, "blocking_copy": 4, "sync": 0}  # the third batch is not audited
    assert audit.batches == 2
    assert [str(w.message) for w in caught if w.category is UserWarning].count(SYNC_MESSAGE) == 3


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_batches": 0}, ValueError, "max_batches must be an int >= 1, got 0"),
    ({"max_batches": 1.5}, TypeError, "max_batches must be an int >= 1"),
    ({"syncs": "yes"}, TypeError, "syncs must be True or False, got 'yes'"),
])
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        TransferAudit(**kwargs)


def test_syncs_in_other_threads_are_neither_counted_nor_shown():
    from lightning_resilient.planning.audit import _SyncWindow

    window = _SyncWindow(get_mode=lambda: 0, set_mode=lambda mode: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window.open()
        worker = threading.Thread(target=_a_sync_in_the_step, name="writer")
        worker.start()
        worker.join()
        _a_sync_in_the_step()
        sites = window.close()
    assert len(sites) == 1 and sites[0].startswith(__file__)
    assert caught == []  # the writer thread's sync was only reported because the mode was on
