"""Backend errors mapped to exceptions whose messages name the URL and what to fix (credentials, bucket, URL).

s3fs, gcsfs and botocore each say "no credentials", "forbidden" or "no such bucket" in their own way; every store
call goes through :func:`translate_error`, so the user reads one message shape whatever the backend.
"""

from __future__ import annotations

import difflib
import os
import re

from lightning_resilient.errors import (
    BucketNotFoundError,
    StoreCredentialsError,
    StorePermissionError,
    StoreSetupError,
    StoreURLError,
)
from lightning_resilient.io.paths import split_protocol

__all__ = ["LOCAL_PROTOCOLS", "check_default_client", "check_store_extra", "check_url", "credentials_error",
           "is_unknown_protocol", "open_error", "permission_error", "translate_error"]

#: What ``split_protocol`` gives for a path on local disk (None: a plain path).
LOCAL_PROTOCOLS = (None, "file", "local")


# What to set when a store sees no (or not enough) credentials, per protocol: (environment, Python option, CLI
# option). The environment comes first: it also reaches ModelCheckpoint's own client, and keeps secrets out of
# configs and command lines.
_CREDENTIALS = {
    "s3": ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
           "storage_options={'profile': ...} (or {'key': ..., 'secret': ...})",
           """--storage-options '{"profile": "NAME"}'"""),
    "gs": (("GOOGLE_APPLICATION_CREDENTIALS (a service-account key file; or run `gcloud auth application-default"
            " login`)"), "storage_options={'token': '/path/to/key.json'}",
           """--storage-options '{"token": "/path/to/key.json"}'"""),
}
_CLOUD = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}


def credentials_error(url: str, what: str, *, detail: str | None = None,
                      client: str | None = None) -> StoreCredentialsError:
    """The error for a store that sees no credentials (``detail`` None) or refuses these ones (``detail``: the
    store's words). ``client``: whose client it was, when not ours (``ModelCheckpoint``), which storage options
    never reach, so only the environment helps."""
    cloud = _CLOUD.get(split_protocol(url)[0] or "")
    if cloud is None:  # another remote filesystem (http, az, ...): its credentials go in its storage options
        head = (f"no credentials to {what} {url}" if detail is None else
                f"access denied to {what} {url} ({detail}): check the credentials and their rights on it")
        return StoreCredentialsError(f"{head}; pass them as storage_options={{...}} (the options of its fsspec"
                                     " filesystem)",
                                     cli_message=f"{head}; pass them with --storage-options '{{...}}'")
    env, option, cli_option = _CREDENTIALS[cloud]
    if client is not None:
        head = (f"{client} lists {url} with its own client, which gets no storage_options and"
                f" {'finds no credentials' if detail is None else f'was refused ({detail})'}")
        endpoint = " (and AWS_ENDPOINT_URL for an S3-compatible store)" if cloud == "s3" else ""
        message = f"{head}: set {env} in the environment{endpoint}; storage_options reach only AtomicCheckpointIO"
        return StoreCredentialsError(message)
    if detail is None:
        head = f"no credentials to {what} {url}: set {env} in the environment"
    else:
        head = f"access denied to {what} {url} ({detail}): check the credentials ({env}) and their rights on it"
    return StoreCredentialsError(f"{head}, or pass {option}", cli_message=f"{head}, or pass {cli_option}")


def permission_error(url: str, what: str, detail: str) -> StorePermissionError:
    """The error for local disk refusing this process (a read-only folder, another user's): about the folder's
    permissions, never about cloud credentials."""
    return StorePermissionError(
        f"permission denied to {what} {url} ({detail}): the checkpoint folder (and the folders above it) must let"
        f" this user (uid {os.getuid()}) {'write' if what in _WRITES else 'read'} there. Fix its permissions or"
        " ownership, or choose another checkpoint dirpath.")


# The store operations (``Store._call``'s ``what``) that write.
_WRITES = frozenset({"write", "conditional write", "delete", "move", "sync"})


def _no_credentials(exc: BaseException) -> bool:
    text = str(exc)
    return (type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError")
            or "Unable to locate credentials" in text)


def _refused(exc: BaseException, protocol: str) -> bool:
    """An authorization refusal: a PermissionError (s3fs maps 403 to it), or GCS's 401/403 (gcsfs raises its
    HttpError for 401 and a plain OSError "Forbidden: ..." for 403)."""
    if isinstance(exc, PermissionError):
        return True
    if _CLOUD.get(protocol) != "gs":
        return False
    return getattr(exc, "code", None) in (401, 403) or str(exc).startswith("Forbidden")


def translate_error(exc: Exception, url: str, what: str) -> Exception:
    """Map backend errors to built-ins whose message says what to fix; keep the original as the cause."""
    text = str(exc)
    protocol = split_protocol(url)[0] or "file"
    if isinstance(exc, StoreSetupError):
        return exc
    if _no_credentials(exc):
        return credentials_error(url, what)
    if _refused(exc, protocol):
        detail = " ".join(text.split()) or type(exc).__name__
        if split_protocol(url)[0] in LOCAL_PROTOCOLS:
            return permission_error(url, what, detail)
        return credentials_error(url, what, detail=detail)
    if isinstance(exc, NotADirectoryError) and split_protocol(url)[0] in LOCAL_PROTOCOLS:
        blocker = _file_in_the_way(split_protocol(url)[1])
        if blocker is not None:
            return NotADirectoryError(
                f"{blocker!r} is a file, not a folder, so no checkpoint can be saved or found under it ({what}"
                f" {url}): a checkpoint root (the ModelCheckpoint dirpath) and every folder above it must be"
                " folders. Choose another dirpath, or move the file away.")
    names_bucket = "bucket" in text.lower() or "NoSuchBucket" in text
    if isinstance(exc, FileNotFoundError) and protocol in _CLOUD and names_bucket:
        bucket = split_protocol(url)[1].split("/", 1)[0]
        return BucketNotFoundError(f"bucket {bucket!r} does not exist ({what} {url}): create it or fix the"
                                   " checkpoint dirpath")
    return exc


def _file_in_the_way(path: str) -> str | None:
    """The nearest existing entry at or above the local ``path`` when it is not a folder (what made an operation
    under ``path`` fail with ENOTDIR); None when that entry is a folder."""
    path = os.path.abspath(path)
    while True:
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def check_default_client(url: str, client: str = "ModelCheckpoint") -> None:
    """Raise :class:`StoreCredentialsError` now when an ``s3://`` URL's default client (built without storage
    options, as Lightning's ``ModelCheckpoint`` builds the one it lists its dirpath with) finds no credentials.

    Credentials given only as ``storage_options`` reach this package's clients, not that one, which then fails at
    its first listing with botocore's bare ``NoCredentialsError``; this says to set them in the environment. It
    sends no request: botocore's own lookup (environment, AWS_PROFILE and the shared files, then the instance
    metadata unless AWS_EC2_METADATA_DISABLED) decides, as it will for that client."""
    check_store_extra(url)  # botocore comes with s3fs
    if _CLOUD.get(split_protocol(url)[0] or "") != "s3":
        return  # gcsfs falls back to anonymous access rather than failing for want of credentials
    import botocore.session

    if botocore.session.Session().get_credentials() is None:
        raise credentials_error(url, "list", client=client)


def check_store_extra(url: str) -> None:
    """Raise :class:`StoreURLError` with the pip command when ``url``'s store needs an extra of this package that is
    not installed (``s3://`` needs ``[s3]``, ``gs://`` needs ``[gcs]``); checked before any client is made."""
    from lightning_resilient._extras import PROTOCOL_EXTRAS, MissingExtraError, require

    extra = PROTOCOL_EXTRAS.get(split_protocol(url)[0] or "")
    if extra is None:
        return
    try:
        require(extra, f"cannot open {url!r}")
    except MissingExtraError as exc:
        raise StoreURLError(str(exc)) from None


_USE = "Use a local path, s3://bucket/prefix, gs://bucket/prefix or another fsspec URL whose filesystem is installed."
# A scheme (RFC 3986 letters; two at least, so that a Windows drive "C:/" stays a path), the slashes after its colon,
# and the rest.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(/*)(.*)", re.DOTALL)
# The protocols a misspelt one most likely meant, tried before every protocol fsspec knows.
_COMMON = ("s3", "gs", "gcs", "file", "memory", "http", "https", "az", "abfs", "hdfs")


def open_error(url: str, exc: BaseException) -> StoreURLError:
    """The error for a URL whose filesystem fsspec does not know (``ValueError``) or cannot import
    (``ImportError``): what was wrong, the URL most likely meant, and what would work."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    match = _SCHEME.fullmatch(url)
    meant = _meant(match.group(1), match.group(3)) if match is not None and not isinstance(exc, ImportError) else None
    return _url_error(url, reason, meant)


def check_url(url: str) -> None:
    """Refuse, with :class:`StoreURLError`, a checkpoint location that no store would read as it was meant:

    - a scheme with one slash (``s3:/bucket/run``), which fsspec reads as the local folder ``./s3:/bucket/run`` (a
      run would "train fine" into it);
    - a scheme fsspec does not know (``s4://``), or one in capitals (``S3://``: protocols are lower case);
    - a local path with a folder named like a protocol (``/home/me/s3:/bucket/run``): what such a URL becomes once made
      a local path (``ModelCheckpoint`` makes its dirpath absolute; ``pathlib.Path("s3://b")`` is ``s3:/b``).

    - a blank location (``" "``), a folder named only with whitespace (``"/data/ /run"``), or whitespace at the start
      (``" s3://bucket/run"``): a stray space in a config, which would quietly make a folder named with spaces;
    - an S3 or GCS URL without a bucket (``s3://``, ``s3:///run``: an empty variable in ``s3://${BUCKET}/run``), which
      the client would send as it is and refuse in its own words;
    - an S3 or GCS URL with a query or fragment (``s3://bucket/run?versionId=1``): s3fs and gcsfs read it as an
      object's version, and a checkpoint location is a folder (or a file) in the bucket as it is now.

    The message names the URL most likely meant. A plain path, a URL fsspec knows and fsspec's chained URLs
    (``simplecache::s3://...``) pass; a known protocol whose filesystem is not installed is reported when the store
    is opened (``open_error``)."""
    _check_blank(url)
    if "::" in url:
        return
    match = _SCHEME.fullmatch(url)
    if match is None:
        _check_path(url)
        return
    scheme, slashes, rest = match.groups()
    if slashes == "/":
        where = os.path.abspath(url)
        raise _url_error(url, f"'{scheme}:' is followed by one slash, so it would be read as the local folder"
                              f" {where!r}", _meant(scheme, rest))
    if len(slashes) < 2:
        return  # "name:rest", a local name with a colon in it
    from fsspec import available_protocols

    if scheme in available_protocols():
        if scheme in _CLOUD:
            _check_bucket_url(url, scheme, slashes[2:] + rest)
        return
    what = ("protocols are lower case" if scheme.lower() in available_protocols()
            else f"fsspec knows no protocol {scheme!r}")
    raise _url_error(url, what, _meant(scheme, slashes[2:] + rest))


def _check_blank(url: str) -> None:
    """Refuse a blank location, whitespace at its start, or a folder whose name is only whitespace."""
    if not url.strip():
        raise StoreURLError(f"cannot open {url!r}: the checkpoint location is blank, which would make a folder"
                            " named with spaces in the working folder. Set the ModelCheckpoint dirpath (or the root)"
                            f" to a folder or URL. {_USE}")
    parts = url.split("/")
    blank = next((part for part in parts if part and not part.strip()), None)
    if blank is not None:  # ("/data/ /run": ModelCheckpoint(dirpath=" ") saves into "<working folder>/ ")
        meant = "/".join(part for part in parts if part == "" or part.strip())
        raise _url_error(url, f"it has a folder named {blank!r}, only whitespace (a stray space in a config?)", meant)
    if url.lstrip() != url:  # (" s3://bucket/run" would be the local folder " s3:"; a trailing space can be a name)
        raise _url_error(url, "it starts with whitespace (a stray space in a config?), which would become part of a"
                              " folder's name", url.lstrip())


def _check_bucket_url(url: str, scheme: str, after: str) -> None:
    """Refuse an S3/GCS URL without a bucket, or with a query or fragment (``after``: what follows ``scheme://``)."""
    bucket = after.partition("/")[0]
    if not bucket:
        raise StoreURLError(
            f"cannot open {url!r}: it names no bucket ({scheme}://BUCKET/prefix; an empty variable in the config?)."
            f" Put the bucket right after '{scheme}://'. {_USE}")
    # s3fs splits "?versionId=" off a key, gcsfs "?generation=" and "#<generation>" (a "#" is a name to s3fs).
    marks = ("?", "#") if _CLIENT[scheme] == "gcsfs" else ("?",)
    cut = min((i for i in (after.find(mark) for mark in marks) if i >= 0), default=-1)
    if cut >= 0:
        meant = f"{scheme}://{after[:cut].rstrip('/')}"
        raise _url_error(url, f"{after[cut:]!r} is a query or fragment, which {_CLIENT[scheme]} would read as an"
                              " object version; a checkpoint location is a folder (or file) of the bucket as it is"
                              " now, without one", meant)


# The filesystem that reads each cloud protocol's URLs.
_CLIENT = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def _check_path(path: str) -> None:
    """Refuse a local path with a folder named ``<protocol>:`` (``/home/me/s3:/bucket/run``)."""
    from fsspec import available_protocols

    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.endswith(":") and part[:-1].lower() in available_protocols() and len(part) > 2:
            rest = "/".join(parts[i + 1:])
            raise _url_error(path, f"it has a folder named {part!r}, which is what a URL with one slash after"
                                   f" '{part}' becomes once made a local path (ModelCheckpoint makes its dirpath"
                                   " absolute)", _meant(part[:-1], rest))


def _meant(scheme: str, rest: str) -> str | None:
    """The URL ``<scheme>:<rest>`` most likely meant: its protocol in lower case, or the known one closest to it."""
    from fsspec import available_protocols

    known = set(available_protocols())
    lower = scheme.lower()
    protocol = lower if lower in known else next(
        iter(difflib.get_close_matches(lower, [p for p in _COMMON if p in known], n=1, cutoff=0.5)
             or difflib.get_close_matches(lower, sorted(known), n=1, cutoff=0.6)), None)
    if protocol is None:
        return None
    if protocol in ("file", "local"):
        return "/" + rest.lstrip("/")  # the path itself: file:/tmp/x means /tmp/x
    return f"{protocol}://{rest.lstrip('/')}"


def _url_error(url: str, reason: str, meant: str | None) -> StoreURLError:
    hint = f" Did you mean {meant!r}?" if meant is not None and meant != url else ""
    return StoreURLError(f"cannot open {url!r}: {reason}.{hint} {_USE}")


def is_unknown_protocol(exc: BaseException) -> bool:
    """fsspec's errors for a protocol it does not know, or whose filesystem package is not installed."""
    return isinstance(exc, ImportError) or str(exc).startswith("Protocol not known")
