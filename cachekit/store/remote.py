"""The remote entry store: entries shared through an object store (S3, GCS, Azure, a shared
folder), through fsspec. It only needs reads, plain writes, deletes, listings and one
conditional operation, the create-only write (``If-None-Match: *``, fsspec
``mode="create"``), which s3fs, gcsfs and adlfs all expose.

::

    PREFIX/entries/KEY/manifest.json        the commit point: written create-only, last;
                                            names its upload ("upload": UPLOAD)
    PREFIX/entries/KEY/UPLOAD/data.npy ...  the data objects of one upload (UPLOAD: 32 hex
                                            digits, fresh per upload)
    PREFIX/leases/KEY/GEN.json, GEN.beat    build leases (see :mod:`.lease`)
    PREFIX/clock/PROBE                      for a moment: the store's time (:meth:`clock`)

Every upload writes its data objects under an upload id of its own, so two hosts uploading
one key at once never write the same object; then each tries to create the manifest, and
the store lets exactly one succeed (:mod:`.remote_upload`). The loser removes its objects.
An uploader killed at any moment leaves objects that no manifest names (or nothing at all):
never a manifest naming missing or partial data. ``cachekit clear --remote`` lists them
(:mod:`.remote_listing`) and removes them. Without working conditional writes (a store
that lets both creates succeed), the last manifest written wins and names a complete
upload of its own: still one valid entry.

Remote data are untrusted: a manifest is read with a size cap and checked field by field
(:func:`cachekit.store.manifest.loads`: file names from the fixed set only, the signature with
``$CACHEKIT_SIGNING_KEY``), each object's size is checked before it is read, and every
checksum after, before anything is published locally (:mod:`.remote_download`); a mismatch
is CacheCorruptError naming the remote object, and the build directory it was downloaded
into is discarded.

Every remote call is bounded by ``$CACHEKIT_REMOTE_TIMEOUT`` seconds (default 30), retries
included; a call that fails or runs out of time raises RemoteUnavailableError.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from . import manifest as manifests
from . import remote_download, remote_listing, remote_upload
from ..errors import CacheCorruptError, RemoteUnavailableError, UnsignedEntryError
from ..keys import is_key
from .layout import Published
from .local import LocalStore
from .manifest import MANIFEST_FILE, FileRecord, Manifest
from .remote_download import fix_for
from .remote_fs import (CHECK, EXISTS, OTHER, REMOTE_ENV, TIMEOUT_ENV, Timeout,
    classify_failed_create, describe, filesystem, redact, timeout_from_env, url_from_env,
    within)
from .remote_listing import RemoteKey, RemoteObject
from .remote_upload import NONE, OTHERS, OURS, UNKNOWN, UPLOAD_FIELD, is_upload_id

__all__ = ["CHECK", "EXISTS", "NONE", "OTHER", "OTHERS", "OURS", "REMOTE_ENV", "TIMEOUT_ENV",
           "UNKNOWN", "RemoteEntry", "RemoteKey", "RemoteObject", "RemoteStore",
           "classify_failed_create", "redact", "timeout_from_env", "url_from_env"]

RANGE_BYTES = 16 << 20
"""Bytes per ranged read or written part: large enough for full speed, small enough that
one part always fits well within the timeout on a working link."""
PARALLEL_RANGES = 4
MANIFEST_RETRY_SECONDS = 0.2
_ATTEMPTS = 3
T = TypeVar("T")


# Values -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteEntry:
    """A published remote entry: its checked manifest and the upload holding its data."""

    manifest: Manifest
    upload: str
    url: str
    """The manifest object's URL, for messages."""

    @property
    def key(self) -> str:
        return self.manifest.key


# The store ----------------------------------------------------------------------------------


class RemoteStore:
    """Entries under one fsspec URL. The filesystem is made on first use (fsspec is imported
    then, not before: a local hit never imports it), and again after a fork."""

    def __init__(self, url: str, *, timeout: Optional[float] = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"remote must be an fsspec URL such as s3://bucket/prefix, "
                             f"not {url!r}")
        self.url = url.rstrip("/")
        self.display = redact(self.url)
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteStore({self.display!r})"

    # fsspec ---------------------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                self._fs, self._root = filesystem(self.url, self.timeout)
                self._pid = os.getpid()
            return self._fs

    @property
    def root(self) -> str:
        self.fs  # noqa: B018 (made on first use)
        return self._root

    @property
    def part_bytes(self) -> int:
        """Bytes per ranged read or written part (:data:`RANGE_BYTES`, read at each use)."""
        return RANGE_BYTES

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def object_url(self, path: str) -> str:
        """``path`` (a filesystem path under the root) as a URL for messages."""
        return self.display + path[len(self.root):] if path.startswith(self.root) else path

    def manifest_path(self, key: str) -> str:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.path("entries", key, MANIFEST_FILE)

    def upload_path(self, key: str, upload: str, name: str = "") -> str:
        if not is_key(key) or not is_upload_id(upload):
            raise ValueError(f"not a cache key and upload id: {key!r} {upload!r}")
        return self.path("entries", key, upload, *([name] if name else []))

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` against the remote within one timeout, retrying transient
        failures with backoff while time remains. FileNotFoundError passes through; any
        other failure, or running out of time, is RemoteUnavailableError."""
        deadline = time.monotonic() + self.timeout
        delay = 0.2
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                return within(deadline, fn, *args, **kwargs)
            except (FileNotFoundError, RemoteUnavailableError):
                raise
            except Timeout:
                raise RemoteUnavailableError(self.display, what, f"no answer within "
                                             f"{self.timeout:g} s ({TIMEOUT_ENV})") from None
            except Exception as e:  # botocore, aiohttp and asyncio errors are not OSErrors
                if (attempt == _ATTEMPTS or isinstance(e, PermissionError)
                        or time.monotonic() + delay >= deadline):
                    raise RemoteUnavailableError(self.display, what, describe(e)) from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def create(self, path: str, data: bytes, what: str, *,
               after_abandoned: Optional[Callable[[], None]] = None) -> bool:
        """Write ``data`` to ``path`` only if no object is there: True when this call made
        it, False when one exists (however the store says so; see
        :func:`classify_failed_create`).

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

    # Lookup ---------------------------------------------------------------------------------

    def lookup(self, key: str) -> Optional[RemoteEntry]:
        """The published remote entry of ``key``, or None. CacheCorruptError (naming the
        manifest object) when its manifest is too large, malformed, of another key, or not
        validly signed while ``$CACHEKIT_SIGNING_KEY`` is set."""
        path = self.manifest_path(key)
        url = self.object_url(path)
        for attempt in (1, 2):
            try:
                raw = self.call(f"reading {url}", self.fs.cat_file, path, start=0,
                                end=manifests.MANIFEST_LIMIT + 1)
            except FileNotFoundError:
                return None
            try:
                return self.parse_manifest(raw, url, key)
            except UnsignedEntryError:
                raise
            except CacheCorruptError:
                # On a shared folder (file://) a create-only write is O_EXCL and then a
                # write, so a reader may catch a manifest half written: read it once more.
                if attempt == 2:
                    raise
                time.sleep(MANIFEST_RETRY_SECONDS)
        raise AssertionError("unreachable")

    @staticmethod
    def parse_manifest(raw: bytes, url: str, key: str) -> RemoteEntry:
        manifest = manifests.loads(raw, url, key)  # size cap, schema, signature
        upload = json.loads(raw).get(UPLOAD_FIELD)
        if not is_upload_id(upload):
            raise CacheCorruptError(url, f"the manifest names no valid upload ({upload!r})",
                                    f"remove it with `cachekit clear --remote {key[:12]}`")
        return RemoteEntry(manifest, upload, url)

    # Download -------------------------------------------------------------------------------

    def download(self, entry: RemoteEntry, local: LocalStore, *,
                 progress: bool = False) -> tuple[Published, bool]:
        """Download ``entry`` into a fresh build directory of ``local``, check every size
        and checksum against its manifest, then publish it with the local store's atomic
        commit. Returns (published entry, whether this call's commit won). On any failure
        the build directory is discarded: nothing is published."""
        return remote_download.download(self, entry, local, progress=progress)

    def check_sizes(self, records: Sequence[FileRecord], objects: Sequence[str]) -> None:
        """Each object's size against its record, before reading a byte of it."""
        for record, path in zip(records, objects):
            url = self.object_url(path)
            try:
                info = self.call(f"reading {url}", self.fs.info, path)
            except FileNotFoundError:
                raise CacheCorruptError(url, "a data object the manifest lists is missing",
                                        fix_for(path.split("/")[-3])) from None
            size = info.get("size")
            if size != record.bytes:
                raise CacheCorruptError(url, f"object is {size} bytes, the manifest says "
                                             f"{record.bytes}", fix_for(path.split("/")[-3]))

    def read_ranges(self, path: str, size: int) -> Iterator[bytes]:
        """The first ``size`` bytes of the object ``path``, in order, as ranged reads made
        a few at a time in parallel (one remote call, one timeout, each). A short read is
        CacheCorruptError: the object is shorter than it said."""
        part = self.part_bytes
        starts = list(range(0, size, part))
        url = self.object_url(path)

        def fetch(start: int) -> bytes:
            end = min(start + part, size)
            block = self.call(f"reading {url}", self.fs.cat_file, path, start=start, end=end)
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

    # Upload ---------------------------------------------------------------------------------

    def upload(self, published: Published, *, progress: bool = False) -> bool:
        """Upload a local entry: its data objects under a fresh upload id, then the manifest,
        create-only. True when this call published the remote entry; False when one was
        there already (its own objects are then removed).

        Data a manifest may name is never removed: when the create fails in a way that does
        not say "exists" (no answer in time, a lost connection), the manifest is looked up
        first, and an upload that may still be named is left for ``cachekit clear
        --remote``. After a win, the objects are checked once more: a sweep that judged a
        paused uploader dead may have removed them meanwhile. Then the manifest is withdrawn
        and the entry uploaded again under a fresh id (once)."""
        return remote_upload.upload(self, published, progress=progress)

    def named(self, key: str, upload: str) -> str:
        """Whom the key's manifest names: OURS (``upload``), OTHERS (another upload), NONE
        (there is no manifest), or UNKNOWN (the remote fails, or the manifest is unreadable)."""
        return remote_upload.named(self, key, upload)

    def withdraw(self, key: str, upload: str) -> bool:
        """Remove the key's manifest if it names ``upload`` (whose data went missing), then
        what is left of that upload. True when a manifest was removed."""
        return remote_upload.withdraw(self, key, upload)

    # Listing and removal ---------------------------------------------------------------------

    def scan(self) -> tuple[list[RemoteKey], list[RemoteObject]]:
        """Every key's objects under the prefix, and objects cachekit does not know."""
        return remote_listing.scan(self)

    def clock(self) -> Optional[float]:
        """The store's own time now, as its listings show objects' times; None when the
        store cannot say (see :func:`cachekit.store.remote_listing.clock`)."""
        return remote_listing.clock(self)

    def remove(self, paths: Sequence[str], what: str) -> None:
        """Delete objects (missing ones are not an error)."""
        for path in paths:
            try:
                self.call(what, self.fs.rm_file, path)
            except FileNotFoundError:
                pass

    def keys(self) -> list[str]:
        """The keys that have a manifest under the prefix, sorted (one listing)."""
        listed, _ = self.scan()
        return [item.key for item in listed if item.manifest is not None]

    def remove_entry(self, key: str) -> bool:
        """Remove the entry of ``key``: its manifest first (readers stop finding it at
        once, and never find it without its data), then the upload it named. False when
        there was no manifest. A manifest too broken to name its upload leaves that upload
        to ``cachekit clear --remote``."""
        try:
            found = self.lookup(key)
        except CacheCorruptError:
            found = None
        path = self.manifest_path(key)
        url = self.object_url(path)
        self.fs.invalidate_cache(path)
        if found is None and not self.call(f"reading {url}", self.fs.exists, path):
            return False
        self.remove([path], f"removing {url}")
        if found is not None:
            self.remove_upload(key, found.upload)
        return True

    def remove_upload(self, key: str, upload: str, *, quiet: bool = False) -> None:
        """Delete the objects of one upload (best effort with ``quiet``)."""
        prefix = self.upload_path(key, upload)
        try:
            self.fs.invalidate_cache()
            names = self.call(f"listing {self.object_url(prefix)}", self.fs.find, prefix)
            self.remove(names, f"removing {self.object_url(prefix)}")
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            if not quiet:
                raise
