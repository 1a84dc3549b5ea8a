"""Image sources given as fsspec URLs (``s3://``, ``gs://``, ``az://``, ``https://``,
``file://``): which values of a column are URLs, the filesystem that reads them, how a
failed request is classified (missing, worth retrying, or final), the fetch settings a call
runs with, and URLs as messages show them.

A ``file://`` URL is a local file: it is read, stat'ed and capped exactly like the path it
names, without fsspec. Any other URL is read through fsspec, whose own configuration
(``fsspec.config``, the store's environment variables such as ``AWS_ENDPOINT_URL``, and the
optional ``storage_options`` of ``Cache.images``) supplies endpoints and credentials:
cachekit never puts them in a key, a log or an error message (:func:`shown`).

A base module: importing it imports neither fsspec nor a store's package; they are
imported the first time a remote URL is read (:func:`filesystem`).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import pickle
import re
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from . import redaction, units
from .errors import CachekitError, InvalidArgument

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
LOCAL_PROTOCOLS = ("file", "local")
INSTALL_HINT = 'pip install "cachekit[remote]"'

TIMEOUT_ENV = "CACHEKIT_SOURCE_TIMEOUT"
ATTEMPTS_ENV = "CACHEKIT_SOURCE_ATTEMPTS"
CONCURRENCY_ENV = "CACHEKIT_SOURCE_CONCURRENCY"
WINDOW_ENV = "CACHEKIT_SOURCE_WINDOW"
PRESIGNED_ENV = "CACHEKIT_SOURCE_PRESIGNED"


class MissingRemoteSupport(CachekitError, ImportError):
    """A column holds URLs that need fsspec (or a store's package) which is not installed."""


@dataclass(frozen=True)
class FetchSettings:
    """How objects are fetched: ``timeout`` seconds for each object, all of it (connect,
    headers, body, a listing or HEAD, every attempt: a trickling answer fails its row),
    ``attempts`` per object within that deadline (throttling such as 503 SlowDown, 5xx,
    connection resets: retried with backoff), ``concurrency`` requests in
    flight per process, and ``window`` bytes fetched but not decoded yet per process (the
    memory bound: a new request waits while the window is full). ``presigned``: read s3
    objects by presigned GETs (cachekit.engine.decoding.s3_direct) rather than through
    s3fs's ``_cat_file``, a third of the CPU per object."""

    timeout: float = 30.0
    attempts: int = 5
    concurrency: int = 64
    window: int = 256 << 20
    presigned: bool = True

    @classmethod
    def from_env(cls) -> "FetchSettings":
        """The settings of ``$CACHEKIT_SOURCE_TIMEOUT`` (seconds), ``_ATTEMPTS``,
        ``_CONCURRENCY`` and ``_WINDOW`` (a size such as ``128M``), read by the caller so
        that workers elsewhere (a cluster) fetch as the caller asked; and
        ``$CACHEKIT_SOURCE_PRESIGNED=0`` for s3fs's own reads."""
        return cls(timeout=units.seconds_from_env(TIMEOUT_ENV, cls.timeout),
                   attempts=_count_from_env(ATTEMPTS_ENV, cls.attempts),
                   concurrency=_count_from_env(CONCURRENCY_ENV, cls.concurrency),
                   window=max(1, units.size_from_env(WINDOW_ENV, cls.window)),
                   presigned=os.environ.get(PRESIGNED_ENV, "1").strip() != "0")


def _count_from_env(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise InvalidArgument(f"{name}={text!r} must be a whole number >= 1")
    return int(text)


# Which values are URLs ----------------------------------------------------------------------

def protocol(value: Any) -> Optional[str]:
    """The protocol of a URL value (``"s3"``, ``"file"``, ...), or None for a local path
    (anything without ``scheme://``, a Windows drive path included)."""
    if not isinstance(value, str):
        return None
    match = _URL.match(value)
    return match.group(1).lower() if match else None


def is_remote(value: Any) -> bool:
    """Whether ``value`` is a URL read through fsspec (not ``file://``)."""
    name = protocol(value)
    return name is not None and name not in LOCAL_PROTOCOLS


def local_path(value: str) -> str:
    """The local path of a ``file://`` URL (``file:///data/a.jpg`` -> ``/data/a.jpg``);
    any other value unchanged."""
    if protocol(value) not in LOCAL_PROTOCOLS:
        return value
    parsed = urllib.parse.urlsplit(value)
    path = urllib.parse.unquote(parsed.path)  # url2pathname's result on POSIX, without
    # importing urllib.request (http.client: 13 ms at start-up)
    if parsed.netloc not in ("", "localhost"):  # file://relative/path, as fsspec reads it
        path = parsed.netloc + path
    return path


def column_protocols(column: Any) -> set[str]:
    """:func:`remote_protocols` of a pandas Series. A column of strings held by pyarrow is
    first searched for ``:`` in its bytes, so that a column of plain paths (a hit's common
    case) never becomes a Python str per row."""
    if getattr(column.dtype, "storage", None) == "pyarrow":
        import numpy as np

        # (validity, offsets, the values' bytes) of each chunk; any ":" sends it the long way
        buffers = [chunk.buffers() for chunk in column.array.__arrow_array__().chunks]
        if all(len(b) == 3 for b in buffers) and not any(
                b[2] is not None and (np.frombuffer(b[2], np.uint8) == ord(":")).any()
                for b in buffers):
            return set()
    return remote_protocols(column.to_numpy(dtype=object))


def remote_protocols(values: Iterable[Any]) -> set[str]:
    """The protocols of the remote URLs among ``values``."""
    try:
        if ":" not in "".join(values):  # one pass in C (memchr): a column of paths has no URL
            return set()
    except TypeError:
        pass  # a value that is not a str: looked at one by one
    found = set()
    for value in values:
        if isinstance(value, str) and "://" in value[:40]:
            name = protocol(value)
            if name is not None and name not in LOCAL_PROTOCOLS:
                found.add(name)
    return found


def check_available(protocols: Iterable[str]) -> None:
    """MissingRemoteSupport naming the package to install when fsspec, or the package of
    the filesystem of one of ``protocols``, is not installed; InvalidArgument for a protocol
    fsspec does not know. Imports fsspec, not the stores' packages."""
    protocols = sorted(protocols)
    if not protocols:
        return
    try:
        import fsspec  # noqa: F401 (only whether it is installed)
    except ImportError:
        raise MissingRemoteSupport(
            f"the column holds {protocols[0]}:// URLs, which are read through fsspec: "
            f"{INSTALL_HINT} (fsspec, s3fs; gcsfs for gs://, adlfs for az://)") from None
    from fsspec.registry import known_implementations, registry

    for name in protocols:
        try:
            if name in registry:
                continue  # imported already
            known = known_implementations.get(name)
            if known is None:
                raise ValueError(name)
            # Found, not imported: a hit needs no store package (s3fs takes 0.3 s to import)
            package = known["class"].split(".", 1)[0]
            if importlib.util.find_spec(package) is None:
                raise ImportError(known.get("err") or f"no module named {package!r}")
        except ImportError as e:
            raise MissingRemoteSupport(
                f"the column holds {name}:// URLs, whose fsspec filesystem cannot be "
                f"imported ({e}); {INSTALL_HINT} for s3://, gcsfs for gs://, adlfs for "
                "az://") from None
        except ValueError:
            raise InvalidArgument(f"the column holds {name}:// URLs, a protocol fsspec does "
                                  "not know") from None


def shown(url: str) -> str:
    """``url`` as messages show it (:func:`cachekit.redaction.url`): no userinfo, query
    or fragment, so that no credential or signature reaches a log or an error."""
    return redaction.url(url)


# Filesystems --------------------------------------------------------------------------------

_FILESYSTEMS: dict[tuple[int, str, bytes], Any] = {}
"""This process's filesystems by (pid, protocol, :func:`configuration_token`)."""
_LOCK = threading.Lock()


_STORE_ENV = ("AWS_", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_", "HTTP_PROXY", "HTTPS_PROXY")


def configuration_token(name: str, storage_options: Optional[dict[str, Any]],
                        settings: FetchSettings) -> bytes:
    """What a filesystem made for protocol ``name`` depends on: the options, the settings,
    fsspec's configuration and the store's environment variables (an endpoint or
    credentials set later in the process make another filesystem). A digest, never shown."""
    import hashlib

    env = sorted((k, v) for k, v in os.environ.items() if k.upper().startswith(_STORE_ENV))
    conf = sys.modules.get("fsspec.config")
    parts = (name, sorted((storage_options or {}).items(), key=lambda kv: kv[0]), settings,
             env, repr(getattr(conf, "conf", None)))
    try:
        raw = pickle.dumps(parts)
    except Exception:  # an option that does not pickle (a session object): its repr
        raw = repr(parts).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=16).digest()


def filesystem(name: str, storage_options: Optional[dict[str, Any]],
               settings: FetchSettings) -> Any:
    """The fsspec filesystem of protocol ``name`` for this process (made once per process,
    options and settings): the user's fsspec configuration plus ``storage_options``, and
    for S3 a connection pool as large as the concurrency, the request timeout, and no
    retries of its own (cachekit's fetch retries, with backoff, up to ``attempts``)."""
    options = dict(storage_options or {})
    key = (os.getpid(), name, configuration_token(name, storage_options, settings))
    with _LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is not None:
            return fs
        check_available([name])
        import fsspec
        import fsspec.config

        if name in ("s3", "s3a"):
            config = {"connect_timeout": settings.timeout, "read_timeout": settings.timeout,
                      "max_pool_connections": max(10, settings.concurrency),
                      "retries": {"total_max_attempts": 1, "mode": "standard"}}
            user = (fsspec.config.conf.get(name) or {}).get("config_kwargs") or {}
            options["config_kwargs"] = {**config, **user, **options.get("config_kwargs", {})}
        # Our own instance: fsspec's instance cache keys on arguments, not on the
        # environment (endpoint, credentials) that the store reads when it connects.
        fs = fsspec.filesystem(name, skip_instance_cache=True, **options)
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own retry loop: cachekit's counts every attempt
        _FILESYSTEMS[key] = fs
        return fs


# Failures -----------------------------------------------------------------------------------

MISSING, RETRY, FINAL = "missing", "retry", "final"
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "TooManyRequests"}


def classify(error: BaseException) -> str:
    """What a failed request means: MISSING (no such object: a failed row, like a missing
    file), RETRY (a timeout, throttling, a 5xx, a reset or refused connection: worth another
    attempt after a pause) or FINAL (anything else: access denied, a bad request)."""
    if isinstance(error, FileNotFoundError):
        return MISSING
    status, code = http_answer(error)
    if status == 404 or code in ("NoSuchKey", "NotFound", "NoSuchBucket"):
        return MISSING
    if isinstance(error, PermissionError) or status in (401, 403):
        return FINAL
    if (status is not None and (status >= 500 or status in (408, 429))) \
            or code in _TRANSIENT_CODES:
        return RETRY
    # (asyncio.TimeoutError is TimeoutError since Python 3.11; before, only asyncio's is)
    timeouts = (TimeoutError, sys.modules['asyncio'].TimeoutError) \
        if 'asyncio' in sys.modules else (TimeoutError,)
    if isinstance(error, (*timeouts, ConnectionError)):
        return RETRY
    names = {type(e).__name__ for e in _causes(error)}
    if names & {"ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
                "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                "ConnectTimeoutError", "IncompleteRead", "ResponseParserError",
                "ServerTimeoutError", "ClientConnectorError", "FSTimeoutError"}:
        return RETRY
    if isinstance(error, OSError) and error.errno in (errno.ECONNRESET, errno.ETIMEDOUT,
                                                      errno.ECONNREFUSED, errno.EPIPE):
        return RETRY
    return FINAL


def _causes(error: BaseException) -> list[BaseException]:
    seen, out = set(), []
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def http_answer(error: BaseException) -> tuple[Optional[int], Optional[str]]:
    """(HTTP status, error code) of the first exception in ``error``'s causes that carries
    one: botocore's ClientError (``.response``), gcsfs's HttpError (``.code``), aiohttp's
    and azure's errors (``.status``, ``.status_code``)."""
    for current in _causes(error):
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            status = meta.get("HTTPStatusCode")
            code = (response.get("Error") or {}).get("Code")
            if isinstance(status, int) or isinstance(code, str):
                return (status if isinstance(status, int) else None,
                        code if isinstance(code, str) else None)
        for name in ("status_code", "status", "code"):
            value = getattr(current, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
                return value, None
    return None, None


def describe(error: BaseException) -> str:
    """A failed request's reason for a message: the error's type and HTTP answer, and its
    text as :func:`cachekit.redaction.text` shows it (no credential of any URL in it)."""
    status, code = http_answer(error)
    answer = f" (HTTP {status}{' ' + code if code else ''})" if status or code else ""
    return f"{type(error).__name__}: {redaction.text(str(error) or repr(error))[:200]}{answer}"
