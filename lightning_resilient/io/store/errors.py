"""Backend errors mapped to exceptions whose messages name the URL and what to fix (credentials, bucket, URL).

s3fs, gcsfs and botocore each say "no credentials", "forbidden" or "no such bucket" in their own way; every store
call goes through :func:`translate_error`, so the user reads one message shape whatever the backend.
"""

from __future__ import annotations

from lightning_resilient.errors import BucketNotFoundError, StoreCredentialsError, StoreSetupError, StoreURLError
from lightning_resilient.io._paths import split_protocol

__all__ = ["check_default_client", "check_store_extra", "credentials_error", "is_unknown_protocol", "open_error",
           "translate_error"]


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
    cloud = _CLOUD.get(split_protocol(url)[0] or "", "s3")
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
        return credentials_error(url, what, detail=" ".join(text.split()) or type(exc).__name__)
    names_bucket = "bucket" in text.lower() or "NoSuchBucket" in text
    if isinstance(exc, FileNotFoundError) and protocol in _CLOUD and names_bucket:
        bucket = split_protocol(url)[1].split("/", 1)[0]
        return BucketNotFoundError(f"bucket {bucket!r} does not exist ({what} {url}): create it or fix the"
                                   " checkpoint dirpath")
    return exc


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


def open_error(url: str, exc: BaseException) -> StoreURLError:
    """The error for a URL whose filesystem fsspec does not know (``ValueError``) or cannot import
    (``ImportError``): what was wrong and what would work."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return StoreURLError(f"cannot open {url!r}: {reason}. Use a local path, s3://bucket/prefix, gs://bucket/prefix"
                         " or another fsspec URL whose filesystem is installed.")


def is_unknown_protocol(exc: BaseException) -> bool:
    """fsspec's errors for a protocol it does not know, or whose filesystem package is not installed."""
    return isinstance(exc, ImportError) or str(exc).startswith("Protocol not known")
