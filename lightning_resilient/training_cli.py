"""``ResilientCLI``: LightningCLI that resumes by itself.

Rerunning the same ``fit`` command after a kill continues from the newest committed checkpoint under the
configured checkpoint root (the ``dirpath`` of the run's ``ModelCheckpoint``, written through
:class:`~lightning_resilient.AtomicCheckpointIO`), and starts fresh when there is none: no ``--ckpt_path`` to
edit between attempts. An explicit ``--ckpt_path`` still wins (``--ckpt_path last`` is the root's newest committed
checkpoint, on every store); ``--auto_resume false`` turns the lookup off (over a root that holds a run, the fit then
stops at its start unless the plugin's ``new_run`` is set). Checkpoint URLs in the config that no store would read as
meant (``s3:/bucket`` with one slash, ``S3://``) are refused before anything is built.

Use it in place of ``LightningCLI`` in your script, or run any LightningModule through it::

    lightning-resilient train fit -c configs/base.yaml -c configs/s3.yaml
    python -m lightning_resilient.training_cli fit -c configs/base.yaml -c configs/local.yaml
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from lightning_resilient._warnings import warn
from lightning_resilient.io import AtomicCheckpointIO, find_latest_checkpoint
from lightning_resilient.io.store import check_default_client, check_store_extra, check_url

__all__ = ["REDACTED", "RedactingSaveConfigCallback", "ResilientCLI", "is_secret_key", "main", "redact_storage_options",
           "redact_url", "resume_path"]

log = logging.getLogger(__name__)


REDACTED = "<redacted>"
# Words that make a key of fsspec storage options a credential: s3fs key/secret/token, botocore's aws_* and camelCase
# names (accessKeyId, SecretAccessKey, sessionToken), gcsfs token, adlfs account_key/sas_token/connection_string,
# passwords of ssh/ftp/webdav filesystems, HTTP headers (Authorization, Cookie, x-goog-api-key,
# X-Amz-Security-Token) and basic auth (auth=[user, password]). A key is split into words (at _ - . and camelCase),
# so signature_version or a key named "monkey" are no credential.
_SECRET_WORDS = frozenset({"key", "apikey", "secret", "token", "password", "passwd", "pwd", "credential",
                           "credentials", "sas", "auth", "authorization", "cookie"})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# Query parameters of a URL that carry a signature or a credential (pre-signed S3/GCS URLs, SAS tokens), besides
# those named by the words above.
_SECRET_QUERY = frozenset({"sig", "signature", "x-amz-signature", "x-goog-signature"})
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?:(?P<userinfo>[^@/?#]*)@)?(?P<rest>[^?#]*)"
                  r"(?:\?(?P<query>[^#]*))?(?P<fragment>#.*)?$", re.DOTALL)


def is_secret_key(key: str) -> bool:
    """Whether a storage-options key (or an HTTP header name) names a credential (see ``_SECRET_WORDS``)."""
    words = [w.lower() for w in _WORDS.findall(key)]
    return bool(_SECRET_WORDS.intersection(words)) or "connectionstring" in "".join(words)


def redact_url(value: str) -> str:
    """``value`` with the credentials a URL may carry redacted: its userinfo (``https://user:pw@host``) and the
    values of query parameters that are signatures or credentials; any other string as it is."""
    match = _URL.match(value)
    if match is None:
        return value
    userinfo, query = match.group("userinfo"), match.group("query")
    out = match.group("scheme") + (f"{REDACTED}@" if userinfo else "") + match.group("rest")
    if query is not None:
        params = []
        for param in query.split("&"):
            name, eq, _ = param.partition("=")
            secret = bool(eq) and (name.lower() in _SECRET_QUERY or is_secret_key(name))
            params.append(f"{name}={REDACTED}" if secret else param)
        out += "?" + "&".join(params)
    return out + (match.group("fragment") or "")


def redact_storage_options(config: Any, *, inside: bool = False) -> Any:
    """A copy of ``config`` (dicts, lists, jsonargparse Namespaces) that holds no credential: in any
    ``storage_options``, every credential-like key (``key``, ``secret``, ``token``, ``aws_secret_access_key``,
    ``accessKeyId``, ``apikey``, ``auth``, HTTP headers such as ``Authorization``, ``Cookie`` or ``x-goog-api-key``,
    also as ``[name, value]`` pairs) maps to :data:`REDACTED`; anywhere in the config, a URL's userinfo and
    signature or credential query parameters are redacted. Everything else is kept as it is."""
    if isinstance(config, Namespace):
        out = Namespace()  # type: ignore[no-untyped-call]  # jsonargparse leaves Namespace.__init__ unannotated
        for key, value in vars(config).items():
            setattr(out, key, _redacted(key, value, inside))
        return out
    if isinstance(config, dict):
        return {key: _redacted(key, value, inside) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        if inside and len(config) == 2 and isinstance(config[0], str) and is_secret_key(config[0]):
            pair = [config[0], REDACTED]  # a header as a (name, value) pair
            return tuple(pair) if isinstance(config, tuple) else pair
        items = [redact_storage_options(value, inside=inside) for value in config]
        return tuple(items) if isinstance(config, tuple) else items
    if isinstance(config, str):
        return redact_url(config)
    return config


def _redacted(key: Any, value: Any, inside: bool) -> Any:
    if inside and isinstance(key, str) and is_secret_key(key) and value is not None:
        return REDACTED
    return redact_storage_options(value, inside=inside or key == "storage_options")


class RedactingSaveConfigCallback(SaveConfigCallback):
    """LightningCLI's config saver, minus credentials: ``storage_options`` are written with their secrets redacted
    (the run itself uses the real values). Put credentials in the environment or a profile rather than a config."""

    def __init__(self, parser: LightningArgumentParser, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(parser, redact_storage_options(config), *args, **kwargs)


class ResilientCLI(LightningCLI):
    """A ``LightningCLI`` whose ``fit`` resumes from the newest committed checkpoint when run again.

    Takes the arguments of ``LightningCLI``. Two defaults differ, both so that the same command can simply be run
    again: ``fit`` looks up the checkpoint to resume from (``--auto_resume``, default true), and the saved
    ``config.yaml`` of a previous attempt is overwritten instead of aborting the run. The saved ``config.yaml``
    never holds credentials: secrets in any ``storage_options`` are redacted (:class:`RedactingSaveConfigCallback`).

    Example::

        from lightning_resilient.training_cli import ResilientCLI

        if __name__ == "__main__":
            ResilientCLI(MyModel, MyDataModule)
    """

    def __init__(self, *args: Any, save_config_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if len(args) < 3:  # save_config_callback is LightningCLI's third positional argument
            kwargs.setdefault("save_config_callback", RedactingSaveConfigCallback)
        # A rerun after a kill writes the same config into the same folder: that is the point, not a mistake.
        kwargs["save_config_kwargs"] = {"overwrite": True, **(save_config_kwargs or {})}
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if isinstance(args, list) and args and sys.argv[-len(args):] == args:
            # ``lightning-resilient train ARGS`` hands its own command line over: not the mix of Python arguments
            # and command line that LightningCLI's warning is about.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                super().parse_arguments(parser, args)
            return
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--auto_resume", type=bool, default=True,
            help="fit: resume from the newest committed checkpoint under the ModelCheckpoint dirpath when no"
                 " --ckpt_path is given (lightning_resilient.AtomicCheckpointIO); start fresh when there is none")

    def before_instantiate_classes(self) -> None:
        # Before ModelCheckpoint is built: it opens a client on its dirpath and fails on "S3://" with fsspec's own
        # "Protocol not known", takes "s3:/bucket" (one slash) for a local folder, and on a store whose extra is not
        # installed says only "Install s3fs to access S3" (we name the pip command).
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        for url in _locations(config.get("trainer") if config is not None else None):
            check_url(url)
            check_store_extra(url)

    def before_fit(self) -> None:
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                check_default_client(str(callback.dirpath))  # before ModelCheckpoint's bare NoCredentialsError
        config = self.config_init["fit"]
        if config.get("ckpt_path") == "last" and isinstance(self.trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            # Lightning resolves "last" by listing last*.ckpt, which finds nothing on S3/GCS (it drops the protocol):
            # with our plugin it is the root's newest committed checkpoint, on every store.
            config["ckpt_path"] = resume_path(self.trainer)
            return
        if config.get("ckpt_path") is not None or not config.get("auto_resume", True):
            return
        config["ckpt_path"] = resume_path(self.trainer)


def _locations(config: Any) -> list[str]:
    """The checkpoint locations in a trainer config: every ``dirpath`` (of any callback) and ``default_root_dir``."""
    found: list[str] = []
    items = vars(config).items() if isinstance(config, Namespace) else config.items() if isinstance(config, dict) \
        else enumerate(config) if isinstance(config, (list, tuple)) else []
    for key, value in items:
        if key in ("dirpath", "default_root_dir") and isinstance(value, str) and value:
            found.append(value)
        elif isinstance(value, (Namespace, dict, list, tuple)):
            found += _locations(value)
    return found


def resume_path(trainer: Any) -> str | None:
    """The checkpoint a rerun of ``trainer``'s fit should resume from, or None to start fresh."""
    roots = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if not roots:
        warn("auto_resume: no ModelCheckpoint with a dirpath is configured, so there is no checkpoint root"
             " to resume from; training starts fresh. Set dirpath on the ModelCheckpoint callback.", rank_zero=True)
        return None
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, AtomicCheckpointIO):
        warn(f"auto_resume needs lightning_resilient.AtomicCheckpointIO in trainer.plugins (this run uses"
             f" {type(io).__name__}); training starts fresh. Add it, or pass --ckpt_path.", rank_zero=True)
        return None
    root = str(roots[0])
    latest = find_latest_checkpoint(root, io.storage_options, local_tier=io.local_tier)
    if latest is None:
        rank_zero_info(f"auto_resume: no committed checkpoint under {root}: starting fresh")
        return None
    rank_zero_info(f"auto_resume: resuming from {latest}")
    # The root itself, not the commit found: under DDP every process runs this lookup, and the one that decides is
    # global rank 0 when the checkpoint is loaded (the newest then, should another job have committed meanwhile).
    return root


def main(args: list[str] | None = None) -> None:
    """Run any LightningModule / LightningDataModule named by ``class_path`` in the config, with auto-resume."""
    ResilientCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args)


if __name__ == "__main__":
    main()
