"""Check, when ``fit`` starts, that every checkpoint folder the Trainer will write through ``AtomicCheckpointIO``
can hold checkpoints: a URL no store reads as meant, a missing bucket, credentials that cannot see it or a folder this
process may not write stop the run before its first step, not at its first save a training interval later. So does a
fit that loads no checkpoint into a folder that holds a committed run (``AtomicCheckpointIO.check_new_run``). It also
tells the plugin that a fit starts (a fit that resumed nothing is a new job: see ``AtomicCheckpointIO.begin_fit``),
and says in one line of its own which commit a resume continues, in place of Lightning's "Checkpoint directory ...
exists and is not empty" (kept for a folder the fit does not resume).

A ``CheckpointIO`` gets no call from Lightning before it saves (and the folder is a ``ModelCheckpoint`` setting the
plugin never sees), so the check is a callback. Lightning asks the functions that packages register under the entry
point groups ``lightning.pytorch.callbacks_factory`` and ``pytorch_lightning.callbacks_factory`` (see
``pyproject.toml``) for callbacks while it builds any Trainer; ours adds the check only when that Trainer's
checkpoint plugin is ours (the Trainer is found up the call stack: Lightning passes the functions nothing), so a
Trainer without the plugin gets no callback, and Lightning logs nothing about us for any Trainer. The check keeps no
state, so checkpoints carry nothing of it. ``ResumeStateCallback`` adds one to a Trainer with the plugin that lacks
it (a plugin set on the strategy after the Trainer was built, or the package run from a source tree without
installed entry points).

Behind Lightning's ``AsyncCheckpointIO``, the check tells the plugin it is wrapped (in every ``setup``): the plugin
then queues the removals it gets on the Trainer's thread behind the saves the wrapper runs on its worker thread. That
wrapper's ``teardown`` never calls the plugin's, so the check's ``teardown`` (and ``on_exception``) calls it.

On several processes, ``setup`` also makes every rank load the one checkpoint global rank 0 decides, whatever
``ckpt_path`` each was given (``io/resume_path.py``: a replaced node's ``find_latest_checkpoint`` answers differently),
and it answers ``ModelCheckpoint.file_exists`` from the plugin's catalogs (``_CatalogExists``), so a store outage
never ends a fit with a local tier through Lightning's own client, and a save that was cut off is no checkpoint.

The entry point is also the one call the package gets before ``fit`` creates the process group: for a Trainer with
the plugin it makes that group use this torchrun attempt's own keys in torchrun's store
(``elastic.scope_process_group``: a restarted rank would otherwise read the killed attempt's peer addresses).

The check runs in ``on_fit_start``: after every ``setup`` (``ModelCheckpoint.setup`` resolves a ``dirpath`` left
``None`` to ``<default_root_dir>/.../checkpoints``), before the sanity check and the first step. Every rank checks:
one that raised alone would leave the others waiting for it at the next collective. A ``default_root_dir`` that a
ModelCheckpoint without a dirpath will use is checked earlier, in ``setup``, before ``ModelCheckpoint.setup`` opens
its own client on it. Whether the fit resumed a checkpoint is
known once the checkpoint is loaded: in ``on_fit_start``, except under strategies that restore after setup (FSDP,
model parallel), whose check runs in ``on_train_start``, still before the first step.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Any

from lightning_resilient.torchrun import scope_process_group

__all__ = ["add_fit_start_check", "lightning_pytorch_callbacks", "pytorch_lightning_callbacks"]

log = logging.getLogger(__name__)

# ModelCheckpoint.setup's warning for a dirpath that holds files (Lightning 2.x words it so).
_NOT_EMPTY = r"Checkpoint directory .* exists and is not empty\."


class _Check:
    """The check itself, shared by the two namespaces' callback classes (each Trainer wants its own ``Callback``)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[tuple[Any, warnings.WarningMessage]] = []  # "not empty" warnings, kept until on_fit_start
        self._load_before: Any = None  # the plugin's last load when this fit started: a resume's is another

    @property
    def state_key(self) -> str:
        return "lightning_resilient.FitStartCheck"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before ModelCheckpoint.setup (Lightning runs checkpoint callbacks last), which lists its dirpath with its
        # own client: without credentials in the environment that fails with botocore's bare NoCredentialsError.
        self._held = []
        plugin = _plugin(trainer)
        if plugin is not None:
            # Behind Lightning's AsyncCheckpointIO, saves come from its worker thread and removals from this one.
            plugin.wrapped_by(_wrapper(trainer, plugin))
            # Every rank, at one point, before any load: with a local tier on several processes, the job's nodes.
            plugin.join_nodes(trainer)
            # Every rank loads the checkpoint rank 0 decides, whatever ckpt_path each was given (io/resume_path.py).
            from lightning_resilient.io.resume_path import AgreedRestore

            AgreedRestore.install(trainer, plugin)
        if stage != "fit" or plugin is None:
            return
        self._load_before = plugin.last_load
        from lightning_resilient.io.store import check_default_client, check_url

        if any(not getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks):
            # ModelCheckpoint.setup puts such a callback's folder under default_root_dir and opens it with its own
            # client, which fails on "S3://" in fsspec's words. (Every dirpath set is checked in on_fit_start.)
            check_url(str(trainer.default_root_dir))
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(dirpath, (str, os.PathLike)) and str(dirpath):
                check_default_client(str(dirpath))
        for callback in trainer.checkpoint_callbacks:
            self._hold_not_empty_warning(callback)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is None:
            return
        from lightning_resilient.io.calling_trainer import fit_roots
        from lightning_resilient.io.plugin_checks import check_filenames

        self._say_what_resumes(trainer, plugin)  # first: Lightning's warning, if kept, comes before a refusal below
        check_filenames(trainer)
        # A fit that resumed nothing is a new job, also with a plugin an earlier fit of this process used, unless it
        # continues that fit from its state in memory.
        plugin.begin_fit(resumed=getattr(trainer, "ckpt_path", None) is not None, trainer=trainer, pl_module=pl_module)
        for dirpath in fit_roots(trainer):
            plugin.check_root(dirpath)
        _answer_file_exists(trainer, plugin)
        plugin.check_retention(trainer)  # (a warning: keep_last smaller than what the ModelCheckpoints keep)
        if not _restores_after_setup(trainer):
            plugin.check_new_run(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None and _restores_after_setup(trainer):
            plugin.check_new_run(trainer)  # the checkpoint (if any) is loaded only after on_fit_start there

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        plugin = _plugin(trainer)
        if plugin is not None:
            plugin.end_fit(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._unhold(trainer)  # a fit that failed between this setup and ModelCheckpoint's (teardown is not called)
        plugin = _plugin(trainer)
        if plugin is not None and plugin.wrapped:
            # Lightning tears the wrapper down next and never the plugin (nor calls this teardown hook): the plugin's
            # teardown waits for what the wrapper still runs, then for its own work. The fit's exception is the one
            # raised; a teardown error after it is logged.
            try:
                plugin.teardown()
            except BaseException as exc:
                log.error("AtomicCheckpointIO's teardown after the failed fit failed too: %s: %s", type(exc).__name__,
                          exc)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unhold(trainer)
        plugin = _plugin(trainer)
        if plugin is not None and plugin.wrapped:
            # Lightning's AsyncCheckpointIO.teardown (the strategy's, just before this hook) waits for its worker and
            # raises a failed save's error, but never calls the teardown of the plugin it wraps: called here, so
            # the plugin's own background work is waited for (and its error raised) as without the wrapper.
            plugin.teardown()

    def _unhold(self, trainer: Any) -> None:
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback.__dict__.get("setup"), "_fit_start_check", None) is self:
                del callback.__dict__["setup"]
            if isinstance(callback.__dict__.get("file_exists"), _CatalogExists):
                del callback.__dict__["file_exists"]  # the callback is itself again after the fit
        from lightning_resilient.io.resume_path import AgreedRestore

        AgreedRestore.remove(trainer)  # (a stage that failed before its restore)
        self._held = []

    # -- Lightning's "not empty" warning, on a resume -----------------------------------------------------------
    def _hold_not_empty_warning(self, callback: Any) -> None:
        """Run ``callback``'s next ``setup`` (the one Lightning calls next) keeping its "exists and is not empty"
        warning until ``on_fit_start``, when it is known whether the fit resumes that folder (the load comes after
        every ``setup``). Any other warning of that call is shown as it came."""
        original = callback.setup  # its class's method, bound (or an instance's own)

        def setup(*args: Any, **kwargs: Any) -> Any:
            if callback.__dict__.get("setup") is setup:
                del callback.__dict__["setup"]  # once: the callback is itself again, picklable as before
            with warnings.catch_warnings(record=True) as caught:
                result = original(*args, **kwargs)
            for message in caught:
                if _not_empty(message):
                    self._held.append((callback, message))
                else:
                    _show(message)
            return result

        setup._fit_start_check = self  # type: ignore[attr-defined]  # our mark, found by teardown()
        callback.setup = setup

    def _say_what_resumes(self, trainer: Any, plugin: Any) -> None:
        """One line naming the commit a resume continues, in place of Lightning's "not empty" warning for the folder
        it resumes; that warning is shown for any other folder (a new run into a folder that holds one)."""
        held, self._held = self._held, []
        resumed = _resumed_root(trainer, plugin) if plugin.last_load is not self._load_before else None
        for callback, message in held:
            if resumed is None or plugin.root(str(callback.dirpath)).url != resumed:
                _show(message)
        last = plugin.last_load
        if resumed is not None and last is not None:
            from lightning.fabric.utilities import rank_zero_info

            name, _, folder = last.commit.rpartition("/")
            rank_zero_info(f"AtomicCheckpointIO: resuming the run in {resumed} from its checkpoint {name} (commit"
                           f" {folder})")


def _not_empty(message: warnings.WarningMessage) -> bool:
    return re.fullmatch(_NOT_EMPTY, str(message.message)) is not None


def _show(message: warnings.WarningMessage) -> None:
    """Show a warning caught by ``catch_warnings(record=True)`` as it would have been, from where it was raised."""
    warnings.warn_explicit(message.message, message.category, message.filename, message.lineno, source=message.source)


def _resumed_root(trainer: Any, plugin: Any) -> str | None:
    """The root (as the plugin names it) of a checkpoint folder of this fit that the fit resumed from, or None."""
    from lightning_resilient.io import paths
    from lightning_resilient.io.calling_trainer import fit_roots
    from lightning_resilient.io.catalog import normalize

    ckpt_path = getattr(trainer, "ckpt_path", None)
    if ckpt_path is None or plugin.last_load is None:
        return None
    path = normalize(os.fspath(ckpt_path))
    if paths.split_protocol(path)[0] in (None, "file", "local"):
        path = os.path.realpath(path)
    for dirpath in fit_roots(trainer):
        url = plugin.root(dirpath).url
        if path == url or path.startswith(url.rstrip("/") + "/"):
            return str(url)
    return None


class _CatalogExists:
    """``ModelCheckpoint.file_exists`` for a callback whose folder the plugin writes: global rank 0 answers from the
    plugin's catalogs (:meth:`AtomicCheckpointIO.knows_checkpoint`) instead of listing the store, and every rank takes
    its answer, as Lightning's does.

    Lightning asks at every save whether the name it is about to use exists (its version counter, ``-v1`` names),
    through its own client of the dirpath's store. With a local tier, in a store outage that call fails (botocore's
    ``EndpointConnectionError``, after ~14 s of the client's own retries) and ends the fit, though the save itself
    goes to the local tier; on any store, a save cut off earlier (its objects without a manifest) counts as a
    checkpoint of that name. A plain object (not a closure) so the callback stays picklable."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def __call__(self, filepath: Any, trainer: Any) -> bool:
        known = False
        if trainer.is_global_zero:
            from lightning_resilient.errors import CheckpointError, StoreSetupError

            try:
                known = bool(self.plugin.knows_checkpoint(filepath))
            except (CheckpointError, StoreSetupError, OSError) as exc:
                # A damaged pointer, a store that fails: the save that follows meets it and says so (or, behind a
                # local tier, goes on); this question must not end the fit first, nor leave the other ranks waiting
                # in the decision below. A bug is no such case: it propagates.
                log.warning("could not tell whether %s is a committed checkpoint (%s): taken as not", filepath, exc)
        return bool(trainer.strategy.reduce_boolean_decision(known, all=False))


def _answer_file_exists(trainer: Any, plugin: Any) -> None:
    """Answer every ModelCheckpoint's ``file_exists`` from the plugin (see :class:`_CatalogExists`); the fit check's
    teardown gives each callback its own method back."""
    for callback in trainer.checkpoint_callbacks:
        if hasattr(callback, "file_exists") and getattr(callback, "dirpath", None):
            callback.file_exists = _CatalogExists(plugin)


def _restores_after_setup(trainer: Any) -> bool:
    """Whether the Trainer's strategy loads the checkpoint after ``on_fit_start`` (FSDP, model parallel)."""
    return bool(getattr(trainer.strategy, "restore_checkpoint_after_setup", False))


def _wrapper(trainer: Any, plugin: Any) -> Any:
    """The Lightning wrapper (``AsyncCheckpointIO``) that holds ``plugin`` as its ``checkpoint_io`` in ``trainer``'s
    strategy, or None when the strategy holds the plugin itself."""
    strategy = getattr(trainer, "strategy", None)
    io = strategy.__dict__.get("_checkpoint_io") if hasattr(strategy, "__dict__") else None
    if io is None:
        io = getattr(strategy, "checkpoint_io", None)
    for _ in range(4):
        inner = getattr(io, "checkpoint_io", None)
        if io is plugin or inner is None:
            return None
        if inner is plugin:
            return io
        io = inner
    return None


def _plugin(trainer: Any) -> Any:
    """The Trainer's checkpoint plugin when it is ours (also behind Lightning's ``AsyncCheckpointIO`` wrapper)."""
    module = sys.modules.get("lightning_resilient.io.checkpoint_io")
    if module is None:
        return None  # never imported: no plugin of ours exists (and none is imported for a Trainer without one)
    strategy = getattr(trainer, "strategy", None)
    # The plugin the strategy holds, not its ``checkpoint_io`` property, which creates Lightning's default when it
    # holds none (the factory asks while the Trainer is being built).
    io = strategy.__dict__.get("_checkpoint_io") if hasattr(strategy, "__dict__") else None
    if io is None:
        io = getattr(strategy, "checkpoint_io", None)
    for _ in range(4):  # wrappers hold the plugin they wrap as ``checkpoint_io``
        if isinstance(io, module.AtomicCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def _callback_class(namespace: str) -> type:
    """``FitStartCheck`` for ``lightning.pytorch`` or ``pytorch_lightning``, built on first use so that loading the
    entry point imports nothing the Trainer has not imported already."""
    cached = _CLASSES.get(namespace)
    if cached is None:
        base: type
        if namespace == "lightning.pytorch":
            from lightning.pytorch import Callback

            base = Callback
        else:
            base = sys.modules["pytorch_lightning"].Callback  # the Trainer asking for it has imported it
        cached = _CLASSES[namespace] = type("FitStartCheck", (_Check, base), {
            "__module__": __name__,
            "__doc__": "Checks the checkpoint folders of ``AtomicCheckpointIO`` when ``fit`` starts (see module).",
            "__reduce__": lambda self: (_rebuild, (namespace,)),
        })
    return cached


def _rebuild(namespace: str) -> Any:
    return _callback_class(namespace)()


_CLASSES: dict[str, type] = {}


def _for_trainer_being_built(namespace: str) -> list[Any]:
    """The check for the Trainer whose callbacks Lightning is collecting, when its checkpoint plugin is ours."""
    if "lightning_resilient.io.checkpoint_io" not in sys.modules:
        return []  # no plugin of ours exists: the usual case of a program that does not use this package
    from lightning_resilient._namespaces import trainer_on_stack

    trainer = trainer_on_stack("_CallbackConnector")
    if trainer is None:  # a Lightning that calls the factory from elsewhere: without the plugin the check does nothing
        return [_callback_class(namespace)()]
    if _plugin(trainer) is None:
        return []
    # Before fit creates the process group (the strategy's setup_environment): under torchrun, this attempt's own.
    scope_process_group(trainer)
    # Lightning logs "Adding 1 callbacks from entry point ..." for what a factory returns, a line about something the
    # user never added: the check is part of the plugin, so it joins the list Lightning is building (as Lightning
    # would add it, right after this call) without that line.
    trainer.callbacks.append(_callback_class(namespace)())
    return []


def lightning_pytorch_callbacks() -> list[Any]:
    """Entry point ``lightning.pytorch.callbacks_factory``: the check, for a ``lightning.pytorch`` Trainer with the
    plugin."""
    return _for_trainer_being_built("lightning.pytorch")


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point ``pytorch_lightning.callbacks_factory``: the same for ``pytorch_lightning`` Trainers."""
    return _for_trainer_being_built("pytorch_lightning")


def add_fit_start_check(trainer: Any) -> None:
    """Give ``trainer`` the check when its checkpoint plugin is ours and it has none (the plugin was set on the
    strategy after the Trainer was built, or the package runs from a source tree without installed entry points)."""
    if _plugin(trainer) is not None and not any(isinstance(c, _Check) for c in trainer.callbacks):
        trainer.callbacks = [*trainer.callbacks, _callback_class("lightning.pytorch")()]


def __getattr__(name: str) -> Any:
    if name == "FitStartCheck":  # the lightning.pytorch class, built on first use
        return _callback_class("lightning.pytorch")
    raise AttributeError(name)
