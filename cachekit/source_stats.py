"""Each row's stat signature, for a column of local paths, URLs, or both: what
``validate="stat"`` keys, what an entry records per row (``row_stats.npy``) and what row
reuse compares; and each local file's content digest, what ``validate="content"`` keys.

A local path (or ``file://`` URL) is :func:`file_stats`' (size, mtime_ns). A remote object
is (size, tag) from the store's listings: one LIST per prefix (the URL up to its last
``/``), however many of its objects the column holds, never one HEAD per object, except for
stores that cannot list (``http(s)://``: one HEAD each, run concurrently). Every listing
and HEAD has the fetch settings' deadline. The tag is the first of the object's version id,
generation, ETag or MD5 the listing gives (its modification time otherwise), as a signed
64-bit hash: an object rewritten in place has another ETag (and, mostly, size), so it is
another row. An object that is missing, or whose listing failed, is (-1, -1), like a file
that cannot be stat'ed: it is never reused, and fails alone when it is fetched.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np

from . import _fs, urls

READ_BLOCK = 1 << 20
"""Bytes read at a time to digest a file."""
LIST_THREADS = 8
"""Prefixes listed at once."""
TAG_FIELDS = ("VersionId", "version_id", "generation", "ETag", "etag", "md5Hash",
              "content_md5", "LastModified", "last_modified", "mtime", "updated")
"""Listing fields that name an object's version, in order of preference."""
NO_LISTING = ("http", "https")
"""Protocols whose filesystems cannot list a folder: one HEAD (``info``) per object."""


def stat_signature(values: Sequence[Any], storage_options: Optional[dict[str, Any]] = None,
                   settings: Optional[urls.FetchSettings] = None) -> np.ndarray:
    """(size, mtime_ns) of each local file, (size, tag) of each remote object, as an
    int64 (N, 2) array; (-1, -1) where there is none."""
    out, remote = local_stat_signature(values)
    if not remote:
        return out
    settings = settings or urls.FetchSettings()
    groups: dict[tuple[str, str], list[int]] = {}
    for row in remote:
        url = values[row]
        groups.setdefault((urls.protocol(url) or "", url.rsplit("/", 1)[0]), []).append(row)
    jobs = [(name, prefix, rows) for (name, prefix), rows in groups.items()]

    def run(job: tuple[str, str, list[int]]) -> None:
        name, prefix, rows = job
        fs = urls.filesystem(name, storage_options, settings)
        found = _listed(fs, name, prefix, [values[r] for r in rows], settings)
        for row in rows:
            info = found.get(fs._strip_protocol(values[row]))
            if info is not None:
                out[row] = signature(info)

    if len(jobs) == 1:
        run(jobs[0])
    else:
        with ThreadPoolExecutor(min(LIST_THREADS, len(jobs)),
                                thread_name_prefix="cachekit-list") as pool:
            list(pool.map(run, jobs))
    return out


def local_stat_signature(values: Sequence[Any]) -> tuple[np.ndarray, list[int]]:
    """(size, mtime_ns) of each local file (a path or ``file://`` URL) as an int64 (N, 2)
    array, and the rows that are remote objects, left at (-1, -1): no request is made."""
    if plain_paths(values):
        return file_stats(values), []
    remote = [i for i, v in enumerate(values) if urls.is_remote(v)]
    at = set(remote)
    names = [("\0" if i in at else urls.local_path(v)) if isinstance(v, str) else v
             for i, v in enumerate(values)]  # "\0" is no file name: (-1, -1)
    return file_stats(names), remote


def plain_paths(values: Sequence[Any]) -> bool:
    """Whether every value is a str without ``://``: local paths (checked in C for a
    column's object array; a Python loop for other sequences)."""
    if isinstance(values, np.ndarray) and values.dtype == object:
        import pandas as pd

        if pd.api.types.infer_dtype(values, skipna=False) != "string":
            return False
        try:
            return "://" not in "\0".join(values)
        except TypeError:
            return False
    return all(isinstance(v, str) and "://" not in v for v in values)


def signature(info: dict[str, Any]) -> tuple[int, int]:
    """(size, tag) of one object's listing details; (-1, -1) without a size."""
    size = info.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return -1, -1
    tag = next((info[name] for name in TAG_FIELDS if info.get(name) not in (None, "")), "")
    digest = hashlib.blake2b(str(tag).encode("utf-8", "surrogatepass"), digest_size=8)
    return size, int.from_bytes(digest.digest(), "little", signed=True)


def _listed(fs: Any, name: str, prefix: str, members: list[str],
            settings: urls.FetchSettings) -> dict[str, dict[str, Any]]:
    """The listing details of ``prefix``'s objects by their filesystem path (for stores
    that cannot list, of ``members``, HEADs run concurrently); {} when it cannot be had.
    Each listing and each HEAD has the settings' deadline, all attempts included."""
    if name in NO_LISTING:
        infos = _run(fs, _heads(fs, members, settings), settings, len(members),
                     [None] * len(members))
        return {fs._strip_protocol(url): info for url, info in zip(members, infos)
                if info is not None}
    path = fs._strip_protocol(prefix)
    fs.invalidate_cache(path)  # a listing seen before may be stale: always a fresh LIST
    if getattr(fs, "async_impl", False):
        def ls() -> Any:
            return fs._ls(path, detail=True)
    else:  # a filesystem without an async API: its blocking call in a thread
        def ls() -> Any:
            import asyncio

            return asyncio.to_thread(fs.ls, path, detail=True)
    listing = _run(fs, _within(ls, settings), settings, 1)
    return {info["name"]: info for info in listing or []
            if isinstance(info, dict) and info.get("type", "file") == "file"}


async def _heads(fs: Any, members: list[str], settings: urls.FetchSettings) -> list[Any]:
    """``fs._info`` of each of ``members``, at most ``concurrency`` at once, each within
    the deadline; None for one that is missing or cannot be had."""
    import asyncio

    slots = asyncio.Semaphore(settings.concurrency)

    async def one(url: str) -> Any:
        async with slots:
            return await _within(lambda: fs._info(url), settings)

    return list(await asyncio.gather(*(one(url) for url in members)))


async def _within(call: Any, settings: urls.FetchSettings) -> Any:
    """``await call()``, retried with backoff on timeouts and throttling up to the
    settings' attempts, all within the deadline; None when what it asks for is missing,
    cannot be had, or the deadline runs out."""
    import asyncio

    async def attempts() -> Any:
        delay = 0.1
        for attempt in range(1, settings.attempts + 1):
            try:
                return await call()
            except Exception as e:  # botocore and aiohttp errors are not OSErrors
                if urls.classify(e) != urls.RETRY or attempt == settings.attempts:
                    return None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        return None

    try:
        return await asyncio.wait_for(attempts(), settings.timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return None


def _run(fs: Any, coroutine: Any, settings: urls.FetchSettings, count: int,
         default: Any = None) -> Any:
    """Run ``coroutine`` on ``fs``'s event loop from this thread; ``default`` if it has
    not ended in time (it bounds itself: each object within the deadline, ``concurrency``
    at once; this outer limit is a backstop)."""
    import fsspec.asyn

    rounds = -(-max(1, count) // max(1, settings.concurrency))
    loop = getattr(fs, "loop", None) or fsspec.asyn.get_loop()
    try:
        return fsspec.asyn.sync(loop, lambda: coroutine,
                                timeout=settings.timeout * (rounds + 1))
    except fsspec.asyn.FSTimeoutError:
        return default


def file_stats(paths: Sequence[str]) -> np.ndarray:
    """(size, mtime_ns) of each file as an int64 (N, 2) array; (-1, -1) where stat fails,
    or where the path is no file name at all (a NUL byte): that row fails alone when it is
    decoded, never the whole call."""
    found = []
    add, stat = found.extend, os.stat  # (a fold of 100k rows makes 100k calls)
    for path in paths:
        try:
            st = stat(path)
        except (OSError, ValueError):
            add((-1, -1))
            continue
        add((st.st_size, st.st_mtime_ns))
    return np.array(found, dtype="<i8").reshape(len(paths), 2)


def file_digests(paths: Sequence[str], workers: int) -> np.ndarray:
    """A 16-byte blake2b of each file's bytes as a (N, 16) uint8 array; zeros where unreadable."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(_file_digest, paths))
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(paths), 16)


def _file_digest(path: str) -> bytes:
    hasher = hashlib.blake2b(digest_size=16)
    try:
        with _fs.open_regular(path, follow_symlinks=True) as f:  # a FIFO would block
            for block in iter(lambda: f.read(READ_BLOCK), b""):
                hasher.update(block)
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return bytes(16)
    return hasher.digest()
