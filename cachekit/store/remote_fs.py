"""How cachekit talks to an object store through fsspec: the filesystem for a URL (with
timeouts for S3), every call bounded by one deadline, what a failed create-only write means
whatever the store, URLs shown without credentials, and a transfer's progress bar. The
bucket layer (:mod:`cachekit.store.bucket`) is built on these; nothing here knows about
entries.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from .. import redaction, units, urls
from ..errors import CachekitError, InvalidArgument

REMOTE_ENV = "CACHEKIT_REMOTE"
TIMEOUT_ENV = "CACHEKIT_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
T = TypeVar("T")


def url_from_env() -> Optional[str]:
    """``$CACHEKIT_REMOTE``, or None when it is unset or empty (local only)."""
    return os.environ.get(REMOTE_ENV) or None


def timeout_from_env() -> float:
    """Seconds per remote call, ``$CACHEKIT_REMOTE_TIMEOUT`` (default 30)."""
    return units.seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def redact(url: str) -> str:
    """``url`` as messages show it: :func:`cachekit.redaction.url`."""
    return redaction.url(url)


# Failed create-only writes ----------------------------------------------------------------

EXISTS, CHECK, OTHER = "exists", "check", "other"


def classify_failed_create(error: BaseException) -> str:
    """What a failed create-only write says about the object, as each store answers it:

    - EXISTS: it exists (or another writer is creating it): FileExistsError (s3fs for AWS's
      412 with ``<Condition>If-None-Match</Condition>``, gcsfs, adlfs, local files); an
      HTTP 412 or 409 anywhere in the exception's causes, e.g. SeaweedFS's 412 without a
      Condition, which s3fs turns into ``OSError(EINVAL)``, or a 409
      ``ConditionalRequestConflict`` (``OSError(EBUSY)``).
    - CHECK: an OSError (EINVAL, EBUSY, EEXIST) that may mean it, with no HTTP answer to
      tell: the caller looks whether the object exists.
    - OTHER: a failure that is not about the object existing.
    """
    if isinstance(error, FileExistsError):
        return EXISTS
    status, code = urls.http_answer(error)
    if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
        return EXISTS
    if isinstance(error, OSError) and error.errno in (errno.EINVAL, errno.EBUSY, errno.EEXIST):
        return CHECK
    return OTHER


CLIENT_RETRIES = ("s3", "s3a")
"""Protocols whose client retries transient failures itself, as :func:`filesystem` sets it
up (botocore's standard retry mode, and s3fs's own retries): cachekit tries each call to
them once (:class:`~cachekit.store.bucket.Bucket`), so that a remote that is down costs
one round of the client's retries, not one per attempt of cachekit's too."""


def filesystem(url: str, timeout: float) -> tuple[Any, str]:
    """(fsspec filesystem, root path) for ``url``, with connect/read timeouts and retries
    set for S3 (within the user's own fsspec configuration)."""
    try:
        import fsspec
        import fsspec.config
    except ImportError:
        raise ImportError("a remote tier needs fsspec and the store's package: "
                          'pip install "cachekit[remote]" (fsspec, s3fs; gcsfs for GCS, '
                          "adlfs for Azure)") from None
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    # A filesystem of our own: fsspec's instance cache keys on arguments, not on the
    # environment (AWS_ENDPOINT_URL, credentials) that the store reads when it connects.
    options: dict[str, Any] = {"skip_instance_cache": True}
    # No listing kept: fsspec would answer info and exists from a listing made before, and
    # another host may have sent or removed that object since (a push would then not send
    # a pool object that is gone). Every answer is the store's, now.
    options["use_listings_cache"] = False
    if protocol in ("file", "local"):
        options["auto_mkdir"] = True  # object stores have no folders to make first
    if protocol in CLIENT_RETRIES:
        config = {"connect_timeout": min(timeout, 10.0), "read_timeout": timeout,
                  "retries": {"max_attempts": 3, "mode": "standard"}}
        user = (fsspec.config.conf.get(protocol) or {}).get("config_kwargs") or {}
        options["config_kwargs"] = {**config, **user}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise ImportError(f"no fsspec filesystem for {redact(url)!r}: {e}; for S3: "
                          'pip install "cachekit[remote]"') from None
    except ValueError as e:  # "Protocol not known: foo"
        raise InvalidArgument(f"remote {redact(url)!r} is not a URL fsspec can open: "
                              f"{e}") from None
    return fs, root.rstrip("/")


class Timeout(CachekitError):
    """A remote call still running at its deadline (turned into RemoteUnavailableError)."""


def within(deadline: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in a daemon thread and wait for it until ``deadline`` (monotonic); a call
    still running then is left behind (it cannot be stopped) and Timeout raised."""
    box: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, name="cachekit-remote-call", daemon=True).start()
    if not finished.wait(max(0.0, deadline - time.monotonic())):
        raise Timeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def describe(error: BaseException) -> str:
    status, code = urls.http_answer(error)
    answer = f" (HTTP {status}{' ' + code if code else ''})" if status or code else ""
    return f"{type(error).__name__}: {str(error)[:300]}{answer}"


def modified(info: dict[str, Any]) -> Optional[float]:
    """An object's modification time from a listing (S3 LastModified, local mtime, GCS
    updated), as seconds since the epoch."""
    for name in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = info.get(name)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                import datetime

                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def progress_bar(show: bool, total: int, description: str) -> Any:
    """A tqdm bar of ``total`` bytes for a push or pull, or None when not shown (tqdm is
    imported only then)."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=description, leave=False)
