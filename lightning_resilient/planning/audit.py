"""``TransferAudit``: find the host<->GPU transfers and syncs that keep the GPU waiting.

Three things stall a CUDA training loop and are cheap to fix once seen:

- ``pageable``: a batch tensor copied to the GPU from pageable (non-pinned) host memory. The driver stages it
  through a bounce buffer; the copy cannot overlap compute, ``non_blocking=True`` or not.
- ``blocking_copy``: a host-to-device copy made without ``non_blocking=True`` while the batch is moved (e.g. in
  an overridden ``transfer_batch_to_device``): the host waits for it.
- ``sync``: the host waits for the GPU inside the training step (``.item()``, ``.cpu()``, ``.tolist()``,
  printing a tensor, an ``if`` on a tensor value, a blocking ``.to("cuda")``...).

The decisions are pure and run on any machine (:func:`_classify_batch`, :func:`_classify_copy`, :class:`_Auditor`);
the callback only feeds them events from a wrapper around ``strategy.batch_to_device`` and from torch's CUDA
sync debug mode, which it turns to ``"warn"`` between ``on_train_batch_start`` and ``on_train_batch_end`` (so
a sync in another callback's ``on_train_batch_start`` counts too).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_resilient._checks import check_bool, check_positive_int
from lightning_resilient._namespaces import require_lightning_pytorch
from lightning_resilient._units import plural
from lightning_resilient._warnings import warn

__all__ = ["KINDS", "SYNC_MESSAGE", "TransferAudit", "TransferAuditWarning", "TransferKind"]

TransferKind = Literal["pageable", "blocking_copy", "sync"]
KINDS: tuple[TransferKind, ...] = ("pageable", "blocking_copy", "sync")
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's c10 warn_or_error_on_sync() text
_COUNTED = {"pageable": ("pageable tensor", "pageable tensors"), "blocking_copy": ("blocking copy", "blocking copies"),
            "sync": ("host sync", "host syncs")}  # how the summary counts each kind
_MAX_SITES = 20  # distinct details kept per kind: enough to point at the culprits, bounded on long runs

_FIXES: dict[str, str] = {
    "pageable": (
        "a batch tensor reached the GPU from pageable (non-pinned) host memory ({detail}): the copy is staged"
        " through a bounce buffer and cannot overlap compute. Fix: DataLoader(..., pin_memory=True) (Lightning"
        " then copies with non_blocking=True), or return pinned tensors from your collate_fn"),
    "blocking_copy": (
        "a blocking host-to-device copy while moving the batch ({detail}): the host waits for every such copy."
        " Fix: .to(device, non_blocking=True) from pinned memory (DataLoader(pin_memory=True)) in"
        " transfer_batch_to_device, or leave the transfer to Lightning, which passes non_blocking=True"),
    "sync": (
        "the training step made the host wait for the GPU (at {detail}): the CPU stops queueing work until the"
        " GPU drains. Fix: avoid .item(), .cpu(), .tolist(), float(tensor), printing tensors and Python ifs on"
        " tensor values in every step; log tensors with self.log(name, tensor, on_step=True), which syncs lazily"
        " when the logger flushes; run checks every N steps or at epoch end; move inputs with"
        " .to(device, non_blocking=True)"),
}


class TransferAuditWarning(UserWarning):
    """What :class:`TransferAudit` found, once per kind; filter this category to silence it."""


# -- the pure core -----------------------------------------------------------------------------------------------
def _describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def _classify_batch(batch: Any, device_type: str,
                    is_pinned: Callable[[torch.Tensor], bool] | None = None) -> list[tuple[TransferKind, str]]:
    """One ``("pageable", detail)`` event per host tensor in ``batch`` that is not pinned, when moving to
    ``device_type``; none when the target is the host itself.

    ``is_pinned`` defaults to ``Tensor.is_pinned``; tests pass their own to stand in for pinned memory.
    """
    if device_type == "cpu":
        return []
    pinned = is_pinned or torch.Tensor.is_pinned
    events: list[tuple[TransferKind, str]] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not pinned(t):
            events.append(("pageable", f"{_describe_tensor(t)} -> {device_type}"))
        return t

    apply_to_collection(batch, torch.Tensor, visit)
    return events


def _classify_copy(op: str, src_device_type: str, dst_device_type: str, non_blocking: bool,
                   device_type: str) -> bool:
    """Whether a copy op is a blocking host-to-``device_type`` copy (what ``blocking_copy`` flags)."""
    return (op in ("_to_copy", "copy_") and src_device_type == "cpu" and dst_device_type == device_type
            and device_type != "cpu" and not non_blocking)


class _CopyWatcher(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Sees every aten op while active; records blocking host->``device_type`` copies as ``blocking_copy`` events."""

    def __init__(self, device_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.events: list[tuple[TransferKind, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        if op == "_to_copy" and args and isinstance(args[0], torch.Tensor):
            dst = kwargs.get("device")
            dst_type = torch.device(dst).type if dst is not None else args[0].device.type
            src = args[0]
            blocking_args = (op, src.device.type, dst_type, bool(kwargs.get("non_blocking", False)))
        elif op == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            src, dst_t = args[1], args[0]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            blocking_args = (op, src.device.type, dst_t.device.type, bool(non_blocking))
        else:
            return func(*args, **kwargs)
        if _classify_copy(*blocking_args, device_type=self.device_type):
            self.events.append(("blocking_copy", (f"aten.{op} of {_describe_tensor(src)} cpu -> {blocking_args[2]}"
                                                  " without non_blocking=True")))
        return func(*args, **kwargs)


class _Auditor:
    """Counts events per kind and reports each kind once, through ``emit``, with the fix."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self.counts: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
        self.sites: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}

    def record(self, kind: TransferKind, detail: str) -> None:
        if kind not in _FIXES:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.counts[kind] += 1
        sites = self.sites[kind]
        if detail in sites or len(sites) < _MAX_SITES:
            sites[detail] += 1
        if self.counts[kind] == 1:
            self._emit(f"TransferAudit: {_FIXES[kind].format(detail=detail)}")

    def summary(self, batches: int) -> str:
        found = ", ".join(plural(self.counts[k], *_COUNTED[k]) for k in KINDS)
        top = [f"{kind}: {site} (x{n})" for kind in KINDS for site, n in self.sites[kind].most_common(3)]
        return (f"TransferAudit: {found} in {plural(batches, 'audited batch', 'audited batches')}"
                + (f"; top: {'; '.join(top)}" if top else ""))


class _SyncWindow:
    """Between ``open()`` and ``close()``: torch's sync debug mode at ``"warn"``, its warnings captured.

    Only the sync warnings are taken; every other warning goes on to whatever showed warnings before. The mode
    getter/setter are parameters so the window works (with a stand-in) where CUDA is absent.
    """

    def __init__(self, get_mode: Callable[[], Any], set_mode: Callable[[Any], None]) -> None:
        self._get_mode = get_mode
        self._set_mode = set_mode
        self._prev_mode: Any = None
        self._prev_show: Any = None
        self._sites: list[str] = []
        self.is_open = False
        self._thread: int | None = None
        self._hook = self._show  # one bound method, so "is ours still installed" can be asked with `is`

    def _show(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
              line: Any = None) -> None:
        if self.is_open and issubclass(category, UserWarning) and SYNC_MESSAGE in str(message):
            # The debug mode is process-wide: a sync in another thread (an async checkpoint writer, say) does not
            # stall the training step. Not counted, and not shown: it was only reported because the mode is on.
            if threading.get_ident() == self._thread:
                self._sites.append(f"{filename}:{lineno}")  # the line that called the syncing op
            return
        self._prev_show(message, category, filename, lineno, file, line)

    def open(self) -> None:
        if self.is_open:
            return
        self._prev_mode = self._get_mode()
        self._prev_show = warnings.showwarning
        self._thread = threading.get_ident()
        # warnings.showwarning is the documented hook for showing warnings; unlike catch_warnings it leaves the
        # filters (and so every module's once-only registry) alone.
        warnings.showwarning = self._hook
        self.is_open = True
        self._set_mode("warn")

    def close(self) -> list[str]:
        """Restore the mode and the hook; the call sites of the syncs seen since ``open()``."""
        if not self.is_open:
            return []
        self._set_mode(self._prev_mode)
        self.is_open = False
        if warnings.showwarning is self._hook:
            warnings.showwarning = self._prev_show
        # else: another hook was installed over ours; ours forwards everything while closed.
        sites, self._sites = self._sites, []
        return sites


# -- the callback ------------------------------------------------------------------------------------------------
class TransferAudit(Callback):
    """Flag pageable batch tensors, blocking host-to-device copies and host syncs in the training step.

    Each kind is reported once, as a :class:`TransferAuditWarning` naming the fix; ``counts`` and ``summary()``
    tell how often each happened, and a summary line is logged at the end. On a run that does not use a CUDA
    device it does nothing and says so once.

    Example::

        audit = TransferAudit(max_batches=200)  # audit the first 200 training batches
        trainer = Trainer(accelerator="gpu", devices=1, callbacks=[audit], max_steps=1000)
        trainer.fit(model, DataLoader(ds, batch_size=64))  # warns once: pageable memory -> pin_memory=True
        print(audit.counts)  # e.g. {'pageable': 202, 'blocking_copy': 0, 'sync': 0} (2 sanity-check batches)

    Every sync in the window counts, library ones included (e.g. the fp16 GradScaler's one ``.item()`` per
    step); the call sites in ``sites`` and the summary tell them apart. A blocking ``.to("cuda")`` inside the
    training step shows up as a ``sync``. Batches are inspected in validation too; syncs only in training.

    Args:
        syncs: audit host syncs in the training step (torch's CUDA sync debug mode, per batch).
        max_batches: stop auditing after this many training batches (None: the whole run).
    """

    def __init__(self, *, syncs: bool = True, max_batches: int | None = None) -> None:
        super().__init__()
        self.syncs = check_bool("syncs", syncs)
        self.max_batches = None if max_batches is None else check_positive_int("max_batches", max_batches)
        self.active = False  # True while hooked into a CUDA run
        self.batches = 0  # training batches audited
        self._auditor = _Auditor(emit=self._emit)
        self._window: _SyncWindow | None = None
        self._strategy: Any = None
        self._wrapper: Callable[..., Any] | None = None
        self._had_instance_attr = False
        self._replaced: Any = None
        self._filter: tuple[Any, ...] | None = None
        self._said_idle = False

    @property
    def counts(self) -> dict[str, int]:
        """How many times each kind was seen: ``{"pageable": n, "blocking_copy": n, "sync": n}``."""
        return {kind: self._auditor.counts[kind] for kind in KINDS}

    @property
    def sites(self) -> dict[str, dict[str, int]]:
        """Per kind, the distinct details (tensor, copy or call site) seen and how often (up to 20 per kind)."""
        return {kind: dict(self._auditor.sites[kind]) for kind in KINDS}

    def summary(self) -> str:
        """One line: the count of each kind, and the most frequent details."""
        return self._auditor.summary(self.batches)

    @staticmethod
    def _emit(message: str) -> None:
        warn(message, TransferAuditWarning, rank_zero=True)

    def _auditing(self) -> bool:
        return self.active and (self.max_batches is None or self.batches < self.max_batches)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        require_lightning_pytorch(trainer, "TransferAudit")
        self._stop()
        device = trainer.strategy.root_device
        if device.type != "cuda":
            if not self._said_idle:
                rank_zero_info("TransferAudit: no CUDA device in use, nothing to audit")
            self._said_idle = True
            return
        self._start(trainer.strategy, device.type, torch.cuda.get_sync_debug_mode, torch.cuda.set_sync_debug_mode)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._window is not None and self._auditing():
            self._window.open()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._auditing():
            return
        self.batches += 1
        if self._window is not None:
            for site in self._window.close():
                self._auditor.record("sync", site)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        was_active = self.active
        self._stop()
        if was_active:
            rank_zero_info(self.summary())

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()  # Lightning skips teardown hooks when fit raises: never leave the sync mode on

    # -- wiring --------------------------------------------------------------------------------------------------
    def _start(self, strategy: Any, device_type: str, get_mode: Callable[[], Any],
               set_mode: Callable[[Any], None]) -> None:
        """Hook into ``strategy`` for a run on ``device_type`` (tests pass a non-CUDA type and a stand-in mode)."""
        self._strategy = strategy
        self._had_instance_attr = "batch_to_device" in vars(strategy)
        self._replaced = vars(strategy).get("batch_to_device")
        inner = strategy.batch_to_device

        def audited_batch_to_device(batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
            if self._wrapper is not audited_batch_to_device or not self._auditing():
                return inner(batch, device=device, dataloader_idx=dataloader_idx)
            target = torch.device(device).type if device is not None else device_type
            for kind, detail in _classify_batch(batch, target):
                self._auditor.record(kind, detail)
            # Only the transfer runs under the dispatch mode (a handful of ops): the step itself pays nothing.
            with _CopyWatcher(target) as watcher:
                moved = inner(batch, device=device, dataloader_idx=dataloader_idx)
            for kind, detail in watcher.events:
                self._auditor.record(kind, detail)
            return moved

        self._wrapper = audited_batch_to_device
        # Lightning looks the hook up on the strategy instance at each call: an instance attribute shadows it.
        strategy.batch_to_device = audited_batch_to_device
        if self.syncs:
            self._window = _SyncWindow(get_mode, set_mode)
            # "default" would show a sync warning once per call site; every occurrence should be counted. Only
            # fires while the window has the debug mode on, so it changes nothing else.
            warnings.filterwarnings("always", message=re.escape(SYNC_MESSAGE), category=UserWarning)
            self._filter = warnings.filters[0]
        self.active = True

    def _stop(self) -> None:
        if self._window is not None:
            self._window.close()
            self._window = None
        if self._filter is not None:
            filters = cast(list[Any], warnings.filters)
            if self._filter in filters:
                filters.remove(self._filter)
            self._filter = None
        strategy, wrapper = self._strategy, self._wrapper
        self._strategy = self._wrapper = None
        if strategy is not None and wrapper is not None and vars(strategy).get("batch_to_device") is wrapper:
            if self._had_instance_attr:
                strategy.batch_to_device = self._replaced
            else:
                del strategy.batch_to_device
        self.active = False
