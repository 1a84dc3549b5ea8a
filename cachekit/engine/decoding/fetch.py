"""Fetching the objects of a run of rows from a store, many at once, in bounded memory.

Where the rows run (a thread of the builder, one of cachekit's worker processes, a Dask
worker) a run of rows is handed to :func:`prefetch` before it is decoded: every remote URL
among them is queued at once on this process's :class:`_Pool` for its filesystem, which
runs the requests on fsspec's event loop (``_cat_file``, the async API s3fs, gcsfs, adlfs
and the HTTP filesystem share), up to ``concurrency`` of them in flight. The rows are then
decoded in order while later objects still arrive. Bytes fetched and not decoded yet count
against the process's ``window``: while it is full no new request starts, so memory stays
bounded whatever the number of rows.

The window also counts the requests in flight, each at the mean size of the objects
fetched so far: what a process holds is about ``window`` bytes, plus one object.

Each request asks for the cap plus one byte (a ranged GET) and, for S3 and HTTP(S),
counts the bytes as they arrive (:mod:`.bounded_read`): a larger object, or a compressed
answer, is a failed row, never a huge download. Each object has one deadline (the
settings' ``timeout``) for all of it: connect, headers, body and every attempt. Within it,
throttling (503 SlowDown, 429), a 5xx or a reset connection is retried with backoff up to
``attempts``; a missing object is FileNotFoundError; each then fails the row naming the
URL (without credentials, :mod:`cachekit.redaction`) and the reason, and ``on_error``
applies as to a file.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Iterator, Optional, Sequence

from ... import urls
from ...errors import CachekitError
from . import bounded_read, s3_direct
from .payload import Fetched

BACKOFF_SECONDS = 0.1
"""The first pause before a retry (doubled at each further one, with jitter, at most
:data:`BACKOFF_LIMIT`)."""
BACKOFF_LIMIT = 5.0
FIRST_GUESS_BYTES = 256 << 10
"""The size a request in flight is counted at in the window until objects came back."""


class FetchFailed(CachekitError, OSError):
    """An object that could not be fetched after its attempts: names the URL and why."""


class _Item:
    """One object to fetch: its URL, the filesystem's path for it, the cap, the future
    its row waits on, the bytes of its body read so far while it is in flight
    (``receiving``), and the bytes it holds in the window once fetched."""

    __slots__ = ("url", "path", "cap", "future", "held", "receiving", "cancelled")

    def __init__(self, url: str, path: str, cap: int) -> None:
        self.url, self.path, self.cap = url, path, cap
        self.future: Future = Future()
        self.held = self.receiving = 0
        self.cancelled = False


class _Pool:
    """The requests of one filesystem in this process: a FIFO queue of objects, at most
    ``concurrency`` in flight, and no new one started while ``window`` bytes are held (the
    queue is first in, first out, so a run's objects are all started before the next
    run's: a run being decoded never waits behind bytes held for a later one).

    Bodies count as they arrive: while the bytes held and being received pass the window,
    every request but the oldest in flight pauses before its next chunk, so however many
    large or endless answers are in flight a process holds about ``window`` bytes plus one
    object's cap (the oldest, which always goes on: it ends, or fails its cap or deadline,
    and the next one goes on)."""

    def __init__(self, fs: Any, settings: urls.FetchSettings, name: str = "") -> None:
        import fsspec.asyn

        self.fs, self.settings, self.name = fs, settings, name
        self.direct = (s3_direct.Reader(fs, settings) if settings.presigned
                       and name in ("s3", "s3a") and s3_direct.usable(fs) else None)
        self.is_async = isinstance(fs, fsspec.asyn.AsyncFileSystem)
        self.loop = getattr(fs, "loop", None) if self.is_async else None
        if self.loop is None:
            self.loop = fsspec.asyn.get_loop()
        self.queue: deque[_Item] = deque()
        self.lock = threading.Lock()
        self.blocked = False
        self.in_flight = 0
        self.held = self.receiving = 0
        self.reading: dict[int, _Item] = {}
        """The requests in flight by id, oldest first."""
        self.paused: list[asyncio.Future] = []
        """Requests waiting for room in the window before their next chunk."""
        self.fetched = self.fetched_bytes = 0
        self.most_in_flight = 0
        """The largest number of requests in flight so far (for tests and benchmarks)."""

    def submit(self, items: Sequence[_Item]) -> None:
        self.loop.call_soon_threadsafe(self._enqueue, list(items))

    def release(self, item: _Item, cancel: bool = False) -> None:
        """The row of ``item`` is decoded, or given up (``cancel``: not fetched if it has
        not started): its bytes leave the window. The loop is woken only when it stopped
        starting requests for want of room (one wake-up per row would cost a system call
        each); the counts change under the lock, so no release is missed."""
        with self.lock:
            item.cancelled = item.cancelled or cancel
            if not item.held:
                return
            self.held -= item.held
            item.held = 0
            wake, self.blocked = self.blocked or bool(self.paused), False
        if wake:
            self.loop.call_soon_threadsafe(self._pump)

    # On the loop ---------------------------------------------------------------------------

    def _enqueue(self, items: list[_Item]) -> None:
        self.queue.extend(items)
        self._pump()

    def _room(self) -> bool:
        """Whether one more request may start: fewer than ``concurrency`` in flight, and
        the bytes held plus those the requests in flight will bring (each as large as the
        objects so far, on average) within ``window``; one request always, when nothing
        is in flight and the window is not full."""
        settings = self.settings
        if self.in_flight >= settings.concurrency or self.held >= settings.window:
            return False
        each = self.fetched_bytes // self.fetched if self.fetched else FIRST_GUESS_BYTES
        return self.in_flight == 0 or self.held + (self.in_flight + 1) * each <= settings.window

    def _pump(self) -> None:
        with self.lock:
            while self.queue and self._room():
                item = self.queue.popleft()
                if item.cancelled or item.future.done():
                    continue
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                self.reading[id(item)] = item
                self.loop.create_task(self._run(item))
            # Stopped for want of room in the window (not of a free request slot, which
            # the next request to end gives back): a release must wake the loop.
            self.blocked = bool(self.queue) and self.in_flight < self.settings.concurrency
            paused, self.paused = self.paused, []
        for waiter in paused:
            if not waiter.done():
                waiter.set_result(None)

    async def _received(self, item: _Item, size: int) -> None:
        """``size`` more bytes of ``item``'s body arrived: count them, and pause before
        the next chunk while the window is full, unless ``item`` is the oldest in flight."""
        while True:
            with self.lock:
                if size:
                    item.receiving += size
                    self.receiving += size
                    size = 0
                full = self.held + self.receiving > self.settings.window
                if not full or next(iter(self.reading.values()), item) is item:
                    return
                waiter = self.loop.create_future()
                self.paused.append(waiter)
            await waiter

    def _forget_received(self, item: _Item) -> None:
        with self.lock:
            self.receiving -= item.receiving
            item.receiving = 0

    async def _run(self, item: _Item) -> None:
        try:
            result = await self._fetch(item)
        except BaseException as e:  # noqa: B036 - a row's failure, never the loop's
            result = FetchFailed(errno.EIO, f"fetch failed: {urls.describe(e)}",
                                 urls.shown(item.url))
        self._forget_received(item)
        with self.lock:
            self.in_flight -= 1
            self.reading.pop(id(item), None)
            if isinstance(result, Fetched):
                self.fetched += 1
                self.fetched_bytes += len(result.data)
                if not item.cancelled:
                    item.held = len(result.data)
                    self.held += item.held
        item.future.set_result(result)
        self._pump()

    async def _fetch(self, item: _Item) -> Any:
        """The object's bytes or its row's exception, within one deadline for all of it:
        every attempt's connect, headers and body (a trickling answer included)."""
        try:
            return await asyncio.wait_for(self._attempts(item), self.settings.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return self._late(item)

    def _late(self, item: _Item) -> FetchFailed:
        return FetchFailed(errno.ETIMEDOUT, f"the object was not read within its deadline of "
                                            f"{self.settings.timeout:g} s ({urls.TIMEOUT_ENV})",
                           urls.shown(item.url))

    async def _attempts(self, item: _Item) -> Any:
        settings, shown = self.settings, urls.shown(item.url)
        delay, reason = BACKOFF_SECONDS, ""
        for attempt in range(1, settings.attempts + 1):
            self._forget_received(item)  # what an earlier attempt read is gone
            try:
                data = await self._read(item)
            except asyncio.CancelledError:
                raise
            except (asyncio.TimeoutError, TimeoutError):
                return self._late(item)  # a client's own timeout: the deadline, said once
            except OSError as e:
                if e.errno in (errno.EFBIG, errno.EPROTO):  # a bound: final, said as it is
                    return e
                error: Exception = e
            except Exception as e:  # botocore, aiohttp and asyncio errors are not OSErrors
                error = e
            else:
                if len(data) > item.cap:
                    return OSError(errno.EFBIG, f"the object is larger than the read cap of "
                                                f"{item.cap} bytes (CACHEKIT_MAX_READ_BYTES); "
                                                "no more of it was read", shown)
                return Fetched(item.url, bytes(data))
            kind = urls.classify(error)
            if kind == urls.MISSING:
                return FileNotFoundError(errno.ENOENT, "no such object", shown)
            if urls.http_answer(error)[0] == 416:  # a range of an empty object
                return OSError(errno.EINVAL, "the object is empty", shown)
            reason = urls.describe(error)
            if kind == urls.FINAL or attempt == settings.attempts:
                break
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, BACKOFF_LIMIT)
        tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
        return FetchFailed(errno.EIO, f"fetch failed after {tries}: {reason}", shown)

    async def _read(self, item: _Item) -> bytes:
        """The first ``cap + 1`` bytes of the object, bounded as they arrive where the
        store is read by cachekit itself (:mod:`.bounded_read`: presigned S3, s3fs, HTTP);
        through the filesystem's ``_cat_file`` (a ranged read) for other stores."""
        def received(size: int) -> Any:
            return self._received(item, size)

        if self.direct is not None:
            return await self.direct.read(item.path, item.cap + 1, item.url, received)
        if self.name in ("s3", "s3a"):
            return await bounded_read.s3(self.fs, item.path, item.cap, item.url, received)
        if self.name in ("http", "https"):
            return await bounded_read.http(self.fs, item.path, item.cap, received)
        if self.is_async:
            return await self.fs._cat_file(item.path, start=0, end=item.cap + 1)
        return await self.loop.run_in_executor(
            None, lambda: self.fs.cat_file(item.path, start=0, end=item.cap + 1))


_POOLS: dict[tuple[int, str, bytes], _Pool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(name: str, storage_options: Optional[dict[str, Any]],
             settings: urls.FetchSettings) -> _Pool:
    """This process's pool for protocol ``name`` (with ``storage_options``, ``settings``)."""
    key = (os.getpid(), name, urls.configuration_token(name, storage_options, settings))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = _Pool(urls.filesystem(name, storage_options, settings),
                                       settings, name)
        return pool


class Batch:
    """The rows of one run, each as its decoder reads it: a local path or ``file://`` URL
    as it is, a remote URL as its :class:`Fetched` bytes or the exception of its failed
    fetch. Iterate once, in order; :meth:`close` (also on garbage collection) gives up
    what was not decoded, so its bytes leave the window."""

    def __init__(self, values: Sequence[Any], max_read_bytes: int,
                 storage_options: Optional[dict[str, Any]],
                 settings: urls.FetchSettings) -> None:
        self.values = values
        self.items: list[Optional[tuple[_Pool, _Item]]] = [None] * len(values)
        queued: dict[str, list[_Item]] = {}
        pools: dict[str, _Pool] = {}
        cap = max(0, max_read_bytes)
        for i, value in enumerate(values):
            name = urls.protocol(value)
            if name is None or name in urls.LOCAL_PROTOCOLS:
                continue
            pool = pools.get(name)
            if pool is None:
                pool = pools[name] = pool_for(name, storage_options, settings)
                queued[name] = []
            item = _Item(value, pool.fs._strip_protocol(value), cap)
            self.items[i] = (pool, item)
            queued[name].append(item)
        for name, items in queued.items():
            pools[name].submit(items)
        self.closed = False

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        for value, entry in zip(self.values, self.items):
            if entry is None:
                yield value
                continue
            pool, item = entry
            try:
                yield item.future.result()
            finally:
                pool.release(item)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for entry in self.items:
            if entry is not None:
                entry[0].release(entry[1], cancel=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # an interpreter shutting down: nothing left to release
            pass


def prefetch(values: Sequence[Any], max_read_bytes: int,
             storage_options: Optional[dict[str, Any]] = None,
             settings: Optional[urls.FetchSettings] = None) -> Any:
    """``values`` as their decoder reads them: ``values`` itself when none is a remote URL
    (no fsspec import), else a :class:`Batch` whose objects are being fetched already."""
    if not urls.remote_protocols(values):
        return values
    return Batch(values, max_read_bytes, storage_options, settings or urls.FetchSettings())


def fetch_one(url: str, max_read_bytes: int, storage_options: Optional[dict[str, Any]] = None,
              settings: Optional[urls.FetchSettings] = None) -> Any:
    """The :class:`Fetched` bytes of one remote URL, or the exception of its failed fetch."""
    batch = Batch([url], max_read_bytes, storage_options, settings or urls.FetchSettings())
    try:
        return next(iter(batch))
    finally:
        batch.close()


def content_signature(values: Sequence[Any], workers: int, max_read_bytes: int,
                      storage_options: Optional[dict[str, Any]] = None,
                      settings: Optional[urls.FetchSettings] = None) -> Any:
    """:func:`cachekit.source_stats.file_digests` of a column of paths and URLs: a 16-byte
    blake2b of each file's or object's bytes, zeros where unreadable (a remote object
    larger than the cap included). The objects are fetched as rows are, in one window."""
    import hashlib

    import numpy as np

    from ... import source_stats

    remote = [i for i, v in enumerate(values) if urls.is_remote(v)]
    local = [("\0" if urls.is_remote(v) else urls.local_path(v)) if isinstance(v, str) else v
             for v in values]
    out = source_stats.file_digests(local, workers)  # "\0": zeros, filled in below
    if not remote:
        return out
    out = np.array(out)
    batch = Batch([values[i] for i in remote], max_read_bytes, storage_options,
                  settings or urls.FetchSettings())
    try:
        for row, got in zip(remote, batch):
            if isinstance(got, Fetched):
                digest = hashlib.blake2b(got.data, digest_size=16).digest()
                out[row] = np.frombuffer(digest, dtype=np.uint8)
    finally:
        batch.close()
    return out
