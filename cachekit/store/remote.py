"""The remote entry store: entries shared through an object store (S3, GCS, Azure, a shared
folder), through fsspec. It only needs reads, plain writes, deletes, listings and one
conditional operation, the create-only write (``If-None-Match: *``, fsspec
``mode="create"``), which s3fs, gcsfs and adlfs all expose.

::

    PREFIX/entries/KEY/manifest.json        the commit point: written create-only, last;
                                            names its upload ("upload": UPLOAD)
    PREFIX/entries/KEY/UPLOAD/data.npy ...  the data objects of one upload (UPLOAD: 32 hex
                                            digits, fresh per upload)
    PREFIX/leases/KEY/GEN.json, GEN.beat    build leases (see :mod:`.remote_lease`)
    PREFIX/clock/PROBE                      for a moment: the store's time (:meth:`clock`)

Every upload writes its data objects under an upload id of its own, so two hosts uploading
one key at once never write the same object; then each tries to create the manifest, and
the store lets exactly one succeed. The loser removes its objects. An uploader killed at
any moment leaves objects that no manifest names (or nothing at all): never a manifest
naming missing or partial data. ``cachekit clear --remote`` lists and removes them. Without
working conditional writes (a store that lets both creates succeed), the last manifest
written wins and names a complete upload of its own: still one valid entry.

No uploader removes objects that a manifest may name: a create that fails without saying
"exists" may have landed, so the manifest is read back first. An uploader paused between
its data and its manifest may find, once its manifest wins, that a sweep removed its data:
it checks after every win and withdraws its manifest then (see :meth:`RemoteStore.upload`).

Remote data are untrusted: a manifest is read with a size cap and checked field by field
(:func:`cachekit.store.manifest.loads`: file names from the fixed set only, the signature with
``$CACHEKIT_SIGNING_KEY``), each object's size is checked before it is read, and every
checksum after, before anything is published locally; a mismatch is CacheCorruptError
naming the remote object, and the build directory it was downloaded into is discarded.

Every remote call is bounded by ``$CACHEKIT_REMOTE_TIMEOUT`` seconds (default 30), retries
included; a call that fails or runs out of time raises RemoteUnavailableError.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from .. import _fs
from . import manifest as manifests
from ..errors import CacheCorruptError, RemoteUnavailableError, UnsignedEntryError
from ..keys import is_key
from .manifest import MANIFEST_FILE, FileRecord, Manifest
from .local import LocalStore, Published
from .remote_fs import (CHECK, EXISTS, OTHER, REMOTE_ENV, TIMEOUT_ENV, Timeout,
    classify_failed_create, describe, filesystem, modified, redact, timeout_from_env,
    url_from_env, within)

__all__ = ["CHECK", "EXISTS", "NONE", "OTHER", "OTHERS", "OURS", "REMOTE_ENV", "TIMEOUT_ENV",
           "UNKNOWN", "RemoteEntry", "RemoteKey", "RemoteObject", "RemoteStore",
           "classify_failed_create", "redact", "timeout_from_env", "url_from_env"]

RANGE_BYTES = 16 << 20
"""Bytes per ranged read or written part: large enough for full speed, small enough that
one part always fits well within the timeout on a working link."""
PARALLEL_RANGES = 4
WRITEBACK_BYTES = 64 << 20
MANIFEST_RETRY_SECONDS = 0.2
PUBLISH_ATTEMPTS = 2
CLOCK_FOLDER = "clock"
PROBE_STALE_SECONDS = 3600.0
OURS, OTHERS, NONE, UNKNOWN = "ours", "others", "none", "unknown"
UPLOAD_FIELD = "upload"
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_ATTEMPTS = 3
T = TypeVar("T")


def is_upload_id(text: Any) -> bool:
    return isinstance(text, str) and _UPLOAD_ID.fullmatch(text) is not None


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


@dataclass(frozen=True)
class RemoteObject:
    """One object under the remote prefix, as a listing shows it."""

    path: str
    size: int
    modified: Optional[float]
    """Seconds since the epoch, by the store's clock; None when the store does not say."""


@dataclass(frozen=True)
class RemoteKey:
    """Every object of one key in a listing: the manifest, uploads, lease objects."""

    key: str
    manifest: Optional[RemoteObject] = None
    uploads: dict[str, list[RemoteObject]] = field(default_factory=dict)
    leases: list[RemoteObject] = field(default_factory=list)
    strays: list[RemoteObject] = field(default_factory=list)
    """Objects under the key that cachekit never writes."""


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
        manifest = entry.manifest
        objects = [self.upload_path(entry.key, entry.upload, f.name) for f in manifest.files]
        self._check_sizes(manifest.files, objects)
        build = local.begin(entry.key)
        bar = _bar(progress, manifest.bytes, f"cachekit pull {entry.key[:12]}")
        try:
            done, digests = 0, {}
            for record, path in zip(manifest.files, objects):
                fd = build.dir.create(record.name)
                hasher = hashlib.blake2b(digest_size=16)  # as it arrives: no second read
                with os.fdopen(fd, "wb") as out, _Writeback(fd) as writeback:
                    for block in self.read_ranges(path, record.bytes):
                        out.write(block)
                        hasher.update(block)
                        done += len(block)
                        writeback.written(out)
                        if bar is not None:
                            bar.update(len(block))
                        build.progress(manifest.rows * done // max(manifest.bytes, 1),
                                       manifest.rows)
                digests[record.name] = "blake2b-128:" + hasher.hexdigest()
            try:
                sealed = local.seal(build, [(f.name, f.kind) for f in manifest.files], digests)
            except CacheCorruptError as e:
                raise CacheCorruptError(self.object_url(objects[0]), e.reason,
                                        self._fix(entry.key)) from None
            for got, want, path in zip(sealed, manifest.files, objects):
                if got != want:
                    raise CacheCorruptError(self.object_url(path), _mismatch(got, want),
                                            self._fix(entry.key))
            published, won = local.commit(build, manifest)
        except BaseException:
            build.discard()
            raise
        finally:
            if bar is not None:
                bar.close()
        return published, won

    def _check_sizes(self, records: Sequence[FileRecord], objects: Sequence[str]) -> None:
        """Each object's size against its record, before reading a byte of it."""
        for record, path in zip(records, objects):
            url = self.object_url(path)
            try:
                info = self.call(f"reading {url}", self.fs.info, path)
            except FileNotFoundError:
                raise CacheCorruptError(url, "a data object the manifest lists is missing",
                                        self._fix(path.split("/")[-3])) from None
            size = info.get("size")
            if size != record.bytes:
                raise CacheCorruptError(url, f"object is {size} bytes, the manifest says "
                                             f"{record.bytes}", self._fix(path.split("/")[-3]))

    def read_ranges(self, path: str, size: int) -> Iterator[bytes]:
        """The first ``size`` bytes of the object ``path``, in order, as ranged reads made
        a few at a time in parallel (one remote call, one timeout, each). A short read is
        CacheCorruptError: the object is shorter than it said."""
        starts = list(range(0, size, RANGE_BYTES))
        url = self.object_url(path)

        def fetch(start: int) -> bytes:
            end = min(start + RANGE_BYTES, size)
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

    @staticmethod
    def _fix(key: str) -> str:
        return (f"nothing was published locally; remove the remote entry with `cachekit "
                f"clear --remote {key[:12]}` and it is built and uploaded again on next use")

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
        manifest = published.manifest
        key = manifest.key
        if self.lookup(key) is not None:
            return False
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            upload = uuid.uuid4().hex
            won = self._publish(published, upload, progress)
            if not won:
                return False
            objects = [self.upload_path(key, upload, f.name) for f in manifest.files]
            try:
                self._check_sizes(manifest.files, objects)
                return True
            except CacheCorruptError as e:
                if not self.withdraw(key, upload) and self.lookup(key) is not None:
                    return False  # another upload is the entry now
                if attempt == PUBLISH_ATTEMPTS:
                    raise CacheCorruptError(e.path, f"{e.reason} after its manifest was "
                                            "published; the manifest was withdrawn",
                                            "upload it again (`cachekit push`)") from None
        raise AssertionError("unreachable")

    def _publish(self, published: Published, upload: str, progress: bool) -> bool:
        """Data objects under ``upload``, then the manifest naming them, create-only: True
        when ours is the key's manifest now, False when another one is (ours removed)."""
        manifest = published.manifest
        key = manifest.key
        bar = _bar(progress, manifest.bytes, f"cachekit push {key[:12]}")
        try:
            objects = [self.upload_path(key, upload, f.name) for f in manifest.files]
            try:
                for record, path in zip(manifest.files, objects):
                    self._put(published, record, path, bar)
                self._check_sizes(manifest.files, objects)  # all there before the commit
            except BaseException:
                self.remove_upload(key, upload, quiet=True)  # no manifest can name it yet
                raise
            body = manifests.dumps(manifest, {UPLOAD_FIELD: upload})
            path = self.manifest_path(key)

            def settle() -> None:
                # The create we gave up on has ended, maybe long after: if it made our
                # manifest after a sweep took our data, withdraw it.
                try:
                    if self.named(key, upload) == OURS:
                        self._check_sizes(manifest.files, objects)
                except CacheCorruptError:
                    self.withdraw(key, upload)

            try:
                won = self.create(path, body, f"publishing {self.object_url(path)}",
                                  after_abandoned=_quietly(settle))
            except Exception:
                # The create may have landed while its answer was lost or came late.
                named = self.named(key, upload)
                if named == OURS:
                    return True
                if named == OTHERS:  # create-only: ours can never land now
                    self.remove_upload(key, upload, quiet=True)
                    return False
                raise  # no manifest yet, or cannot tell: leave the upload for the sweep
        finally:
            if bar is not None:
                bar.close()
        if won:
            return True
        # Refused as existing. A create retried after its answer was lost meets its own
        # manifest: a win. Otherwise ours never lands, so its data can go (unless the
        # manifest there cannot be read: it might be ours, half written on a shared folder).
        named = self.named(key, upload)
        if named in (OTHERS, NONE):
            self.remove_upload(key, upload, quiet=True)
        return named == OURS

    def named(self, key: str, upload: str) -> str:
        """Whom the key's manifest names: OURS (``upload``), OTHERS (another upload), NONE
        (there is no manifest), or UNKNOWN (the remote fails, or the manifest is unreadable)."""
        try:
            found = self.lookup(key)
        except (RemoteUnavailableError, CacheCorruptError):
            return UNKNOWN
        if found is None:
            return NONE
        return OURS if found.upload == upload else OTHERS

    def withdraw(self, key: str, upload: str) -> bool:
        """Remove the key's manifest if it names ``upload`` (whose data went missing), then
        what is left of that upload. True when a manifest was removed."""
        if self.named(key, upload) != OURS:
            return False
        path = self.manifest_path(key)
        self.remove([path], f"withdrawing {self.object_url(path)}")
        self.remove_upload(key, upload, quiet=True)
        return True

    def _put(self, published: Published, record: FileRecord, path: str, bar: Any) -> None:
        """Copy one local entry file to ``path`` in parts (one call, one timeout, each)."""
        url = self.object_url(path)
        with _fs.open_regular(published.path / record.name) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record.bytes:
                raise CacheCorruptError(published.path / record.name, f"file is {size} bytes, "
                                        f"the manifest says {record.bytes}")
            if size <= RANGE_BYTES:
                self.call(f"writing {url}", self.fs.pipe_file, path, f.read())
                if bar is not None:
                    bar.update(size)
                return
            out = self.call(f"writing {url}", self.fs.open, path, "wb", block_size=RANGE_BYTES)
            try:
                for block in iter(lambda: f.read(RANGE_BYTES), b""):
                    self.call(f"writing {url}", out.write, block)
                    if bar is not None:
                        bar.update(len(block))
                self.call(f"writing {url}", out.close)
            except BaseException:
                _discard(out)
                raise

    # Listing and removal ---------------------------------------------------------------------

    def scan(self) -> tuple[list[RemoteKey], list[RemoteObject]]:
        """Every key's objects under the prefix, and objects cachekit does not know."""
        root = self.root
        try:
            self.fs.invalidate_cache()
            found = self.call(f"listing {self.display}", self.fs.find, root, detail=True)
        except FileNotFoundError:
            return [], []
        keys: dict[str, RemoteKey] = {}
        unknown: list[RemoteObject] = []
        for path, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            obj = RemoteObject(path, int(info.get("size") or 0), modified(info))
            parts = path[len(root):].strip("/").split("/")
            if parts[0] == CLOCK_FOLDER and len(parts) == 2:
                continue  # a probe of :meth:`clock`
            if len(parts) < 3 or parts[0] not in ("entries", "leases") or not is_key(parts[1]):
                unknown.append(obj)
                continue
            item = keys.setdefault(parts[1], RemoteKey(parts[1]))
            if parts[0] == "leases" and len(parts) == 3:
                item.leases.append(obj)
            elif parts[2:] == [MANIFEST_FILE]:
                keys[parts[1]] = RemoteKey(item.key, obj, item.uploads, item.leases, item.strays)
            elif len(parts) == 4 and is_upload_id(parts[2]):
                item.uploads.setdefault(parts[2], []).append(obj)
            else:
                item.strays.append(obj)
        return sorted(keys.values(), key=lambda k: k.key), unknown

    def clock(self) -> Optional[float]:
        """The store's own time now, as its listings show objects' times: the time of a
        probe object written and listed for this, then removed. None when the store cannot
        say (no write permission, no times in its listings, a failing remote).

        Ages judged against it compare the store's times with each other, so they hold
        whatever this host's clock says. Probes that a killed caller left are removed."""
        folder = self.path(CLOCK_FOLDER)
        name = uuid.uuid4().hex
        probe = f"{folder}/{name}"
        try:
            self.call(f"writing {self.object_url(probe)}", self.fs.pipe_file, probe, b"")
            self.fs.invalidate_cache(folder)
            listed = self.call(f"listing {self.object_url(folder)}", self.fs.ls, folder,
                               detail=True)
        except (RemoteUnavailableError, FileNotFoundError):
            return None
        times = {str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]: modified(info)
                 for info in listed if isinstance(info, dict)}
        now = times.get(name)
        stale = [f"{folder}/{other}" for other, when in times.items() if other != name
                 and when is not None and now is not None and now - when > PROBE_STALE_SECONDS]
        try:
            self.remove([probe, *stale], f"removing {self.object_url(probe)}")
        except RemoteUnavailableError:
            pass  # the next probe removes it
        return now

    def remove(self, paths: Sequence[str], what: str) -> None:
        """Delete objects (missing ones are not an error)."""
        for path in paths:
            try:
                self.call(what, self.fs.rm_file, path)
            except FileNotFoundError:
                pass

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


# Helpers ------------------------------------------------------------------------------------


class _Writeback:
    """Flush a download to disk while it arrives: every WRITEBACK_BYTES an fdatasync runs in
    a thread of its own, so the fsync before the local commit finds little left to write
    (docs/object-stores.md, "How fast")."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0  # the position the last flush started from
        self.thread: Optional[threading.Thread] = None

    def __enter__(self) -> "_Writeback":
        return self

    def written(self, out: Any) -> None:
        position = out.tell()
        if position - self.pending < WRITEBACK_BYTES or (
                self.thread is not None and self.thread.is_alive()):
            return
        out.flush()
        self.pending = position
        self.thread = threading.Thread(target=self._sync, name="cachekit-writeback",
                                       daemon=True)
        self.thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError:
            pass  # the fsync before the commit reports any real error

    def __exit__(self, *exc: Any) -> None:
        if self.thread is not None:
            self.thread.join()


def _mismatch(got: FileRecord, want: FileRecord) -> str:
    if got.bytes != want.bytes:
        return f"downloaded {got.bytes} bytes, the manifest says {want.bytes}"
    if got.checksum != want.checksum:
        return (f"checksum mismatch: the manifest says {want.checksum}, the object has "
                f"{got.checksum}")
    return (f"header says {got.dtype} {list(got.shape)}, the manifest says {want.dtype} "
            f"{list(want.shape)}")


def _bar(show: bool, total: int, description: str) -> Any:
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=description, leave=False)


def _quietly(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` for a thread nobody waits for: what it raises has nowhere to go."""
    def run() -> None:
        try:
            fn()
        except Exception:  # the sweep and the readers deal with what is left
            pass

    return run


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
