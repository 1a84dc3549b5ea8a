"""The bucket layer: one fsspec URL as a place to put, read, list and delete objects, with
every call bounded by one timeout (retries included). It knows paths and objects, never
entries: :mod:`.remote_entry` says where an entry's objects lie, :mod:`.remote_upload`,
:mod:`.remote_download` and :mod:`.remote_listing` work on a :class:`Bucket`, and
:class:`~cachekit.store.remote.RemoteStore` is the face on top of them all.

Besides plain writes, reads and deletes a bucket needs one conditional operation, the
create-only write (``If-None-Match: *``, fsspec ``mode="create"``), which s3fs, gcsfs and
adlfs all expose (:meth:`Bucket.create`).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Callable, Iterable, Iterator, Optional, TypeVar

from .. import urls
from ..errors import CacheCorruptError, InvalidArgument, RemoteUnavailableError
from .remote_fs import (CHECK, CLIENT_RETRIES, EXISTS, TIMEOUT_ENV, Timeout,
                        classify_failed_create, describe, filesystem, redact,
                        timeout_from_env, within)

RANGE_BYTES = 16 << 20
"""Bytes per ranged read or written part: large enough for full speed, small enough that
one part always fits well within the timeout on a working link."""
PARALLEL_RANGES = 4
ATTEMPTS = 3
"""Tries per call (while its timeout lasts) to a store whose client does not retry by itself
(:data:`~.remote_fs.CLIENT_RETRIES`: one try): transient failures are retried with backoff."""
T = TypeVar("T")


class Bucket:
    """Objects under one fsspec URL. The filesystem is made on first use (fsspec is
    imported then, not before: a local hit never imports it), and again after a fork."""

    def __init__(self, url: str, *, timeout: Optional[float] = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"remote must be an fsspec URL such as s3://bucket/prefix, "
                             f"not {url!r}")
        scheme, sep, rest = url.partition("://")
        if sep and not rest.strip("/"):  # fsspec would take "s3:" for a local folder
            raise InvalidArgument(f"remote must name a bucket or folder after {scheme}://, "
                                  f"not {redact(url)!r} (for example s3://bucket/prefix or "
                                  "file:///mnt/shared/cachekit)")
        self.url = url.rstrip("/")
        self.display = redact(self.url)
        self.attempts = 1 if sep and scheme.lower() in CLIENT_RETRIES else ATTEMPTS
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display!r})"

    # The filesystem and its paths -----------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, made for this process on first use."""
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                self._fs, self._root = filesystem(self.url, self.timeout)
                self._pid = os.getpid()
            return self._fs

    @property
    def root(self) -> str:
        """The URL's path as the filesystem names it (no protocol, no trailing slash)."""
        self.fs  # noqa: B018 (made on first use)
        return self._root

    @property
    def part_bytes(self) -> int:
        """Bytes per ranged read or written part (:data:`RANGE_BYTES`, read at each use so
        that a test can make parts small)."""
        return RANGE_BYTES

    def path(self, *parts: str) -> str:
        """The filesystem path of ``parts`` joined under the root."""
        return "/".join([self.root, *parts])

    def object_url(self, path: str) -> str:
        """``path`` (a filesystem path under the root) as a URL for messages."""
        return self.display + path[len(self.root):] if path.startswith(self.root) else path

    # Calls ----------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` against the remote within one timeout, retrying transient
        failures with backoff while time remains (:attr:`attempts` tries: one where the
        store's client retries by itself). FileNotFoundError (no such object)
        passes through; any other failure, the bucket itself missing (S3's NoSuchBucket)
        or running out of time is RemoteUnavailableError."""
        deadline = time.monotonic() + self.timeout
        delay = 0.2
        for attempt in range(1, self.attempts + 1):
            try:
                return within(deadline, fn, *args, **kwargs)
            except FileNotFoundError as e:
                if urls.http_answer(e)[1] == "NoSuchBucket":
                    raise RemoteUnavailableError(self.display, what, describe(e)) from None
                raise
            except RemoteUnavailableError:
                raise
            except Timeout:
                raise RemoteUnavailableError(self.display, what, f"no answer within "
                                             f"{self.timeout:g} s ({TIMEOUT_ENV})") from None
            except Exception as e:  # botocore, aiohttp and asyncio errors are not OSErrors
                if (attempt == self.attempts or isinstance(e, PermissionError)
                        or time.monotonic() + delay >= deadline):
                    raise RemoteUnavailableError(self.display, what, describe(e)) from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def create(self, path: str, data: bytes, what: str, *,
               after_abandoned: Optional[Callable[[], None]] = None) -> bool:
        """Write ``data`` to ``path`` only if no object is there: True when this call made
        it, False when one exists (however the store says so; see
        :func:`~cachekit.store.remote_fs.classify_failed_create`).

        A write still running at the deadline goes on in its thread, and fsspec may send
        it again (its retries) after this call has raised: ``after_abandoned()`` then runs
        in that thread when it ends, to check what it did."""
        abandoned = threading.Event()

        def attempt() -> Optional[bool]:
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except Exception as e:
                verdict = classify_failed_create(e)
                if verdict == EXISTS:
                    return False
                if verdict == CHECK:
                    return None
                raise
            finally:
                if abandoned.is_set() and after_abandoned is not None:
                    after_abandoned()

        try:
            made = self.call(what, attempt)
        except BaseException:
            abandoned.set()
            raise
        if made is None:
            if self.call(what, self.fs.exists, path):
                return False
            raise RemoteUnavailableError(self.display, what, "the store refused a create-only "
                                         "write of an object that does not exist")
        return made

    def write(self, path: str, data: bytes) -> None:
        """Write (or overwrite) the object ``path`` with ``data`` in one call."""
        self.call(f"writing {self.object_url(path)}", self.fs.pipe_file, path, data)

    def write_file(self, path: str, source: IO[bytes], size: int,
                   done: Callable[[int], None] = lambda n: None) -> None:
        """Copy ``size`` bytes of the open local file ``source`` to the object ``path``:
        one call when it fits in a part, else in parts (one call, one timeout, each).
        ``done(n)`` is told of every ``n`` bytes sent. A multipart write that fails is
        abandoned, never completed."""
        url = self.object_url(path)
        part = self.part_bytes
        if size <= part:
            self.call(f"writing {url}", self.fs.pipe_file, path, source.read())
            done(size)
            return
        out = self.call(f"writing {url}", self.fs.open, path, "wb", block_size=part)
        try:
            for block in iter(lambda: source.read(part), b""):
                self.call(f"writing {url}", out.write, block)
                done(len(block))
            self.call(f"writing {url}", out.close)
        except BaseException:
            _discard(out)
            raise

    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the object ``path`` (fewer when it is shorter);
        FileNotFoundError when there is none."""
        return self.call(f"reading {self.object_url(path)}", self.fs.cat_file, path,
                         start=start, end=end)

    def size(self, path: str) -> Any:
        """The size the store gives now for the object ``path`` (as it says it: checked by
        the caller); FileNotFoundError when there is none."""
        info = self.call(f"reading {self.object_url(path)}", self.fs.info, path)
        return info.get("size")

    def exists(self, path: str) -> bool:
        """Whether the object ``path`` is there now."""
        return bool(self.call(f"reading {self.object_url(path)}", self.fs.exists, path))

    def read_ranges(self, path: str, size: int) -> Iterator[bytes]:
        """The first ``size`` bytes of the object ``path``, in order, as ranged reads made
        a few at a time in parallel (one remote call, one timeout, each). A short read is
        CacheCorruptError: the object is shorter than it said."""
        part = self.part_bytes
        starts = list(range(0, size, part))
        url = self.object_url(path)

        def fetch(start: int) -> bytes:
            end = min(start + part, size)
            block = self.read(path, start, end)
            if len(block) != end - start:
                raise CacheCorruptError(url, f"object ended at byte {start + len(block)}, "
                                             f"short of {size}")
            return block

        with ThreadPoolExecutor(PARALLEL_RANGES, thread_name_prefix="cachekit-get") as pool:
            pending = [pool.submit(fetch, s) for s in starts[:PARALLEL_RANGES]]
            queued = len(pending)
            try:
                while pending:
                    block = pending.pop(0).result()
                    if queued < len(starts):
                        pending.append(pool.submit(fetch, starts[queued]))
                        queued += 1
                    yield block
            finally:
                for future in pending:
                    future.cancel()

    # Listing and removal --------------------------------------------------------------------

    def find(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under ``prefix`` with its listing details, fresh (the filesystem
        keeps no listing: :func:`.remote_fs.filesystem`); FileNotFoundError when there is
        nothing there."""
        found = self.call(f"listing {self.object_url(prefix)}", self.fs.find, prefix,
                          detail=True)
        return dict(found)

    def list(self, folder: str) -> list[dict[str, Any]]:
        """The entries directly in ``folder`` with their details, fresh;
        FileNotFoundError when there is nothing there."""
        listed = self.call(f"listing {self.object_url(folder)}", self.fs.ls, folder,
                           detail=True)
        return [info for info in listed if isinstance(info, dict)]

    def remove(self, paths: Iterable[str], what: str) -> None:
        """Delete objects (missing ones are not an error)."""
        for path in paths:
            try:
                self.call(what, self.fs.rm_file, path)
            except FileNotFoundError:
                pass

    def remove_tree(self, prefix: str, *, quiet: bool = False) -> None:
        """Delete every object under ``prefix`` (best effort with ``quiet``)."""
        try:
            names = list(self.find(prefix))
            self.remove(names, f"removing {self.object_url(prefix)}")
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            if not quiet:
                raise


def _discard(f: Any) -> None:
    """Abandon a partly written remote file without completing it (best effort)."""
    for name in ("discard", "_abort_mpu"):
        method = getattr(f, name, None)
        if callable(method):
            try:
                method()
                return
            except Exception:  # already failing; the orphaned parts are the store's to expire
                return
