"""Looking at, checking and cleaning a remote tier: what ``cachekit ls|info|verify|clear
--remote`` do. Inspection returns frozen dataclasses; removal is a plan whose ``execute()``
does the work, so ``--dry-run`` and confirmation cost nothing.

Besides published entries, a remote holds what interrupted work left:

- an orphaned upload: data objects under ``entries/KEY/UPLOAD/`` that no manifest names (an
  uploader killed before its manifest, or the loser of two concurrent uploads killed before
  it cleaned up), untouched for twice the lease time;
- a dead lease: ``leases/KEY/*`` whose newest object is older than the lease time.

Both ages are the store's modification times read against this host's clock, so they
assume clocks that agree to well within the lease (NTP). Builders never depend on them:
the lease rule itself compares no clocks (:mod:`cachekit.store.lease`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from .. import liveness
from ..errors import CacheCorruptError, RemoteUnavailableError
from .inspect import Problem, resolve_keys
from ..store.remote import RemoteEntry, RemoteKey, RemoteObject, RemoteStore


@dataclass(frozen=True)
class RemoteEntryInfo:
    """One remote key with a manifest. Manifest fields are None when ``problem`` is set."""

    key: str
    url: str
    entry: Optional[RemoteEntry]
    bytes: int
    uploaded: Optional[float]
    problem: Optional[str] = None

    @property
    def created(self) -> float:
        if self.entry is not None:
            return self.entry.manifest.created
        return self.uploaded or 0.0

    def to_json(self) -> dict:
        m = self.entry.manifest if self.entry is not None else None
        return {"key": self.key, "url": self.url, "kind": m.kind if m else None,
                "rows": m.rows if m else None, "shape": list(m.shape) if m else None,
                "dtype": m.dtype.name if m else None, "bytes": self.bytes,
                "created": self.created, "uploaded": self.uploaded,
                "upload": self.entry.upload if self.entry else None,
                "column": m.column if m else None, "params": m.params if m else None,
                "problem": self.problem}


@dataclass(frozen=True)
class Leftover:
    """Objects of one key that interrupted work left: an orphaned upload or a lease."""

    key: str
    what: str  # "orphaned upload UPLOAD", "lease"
    objects: tuple[RemoteObject, ...]
    removable: bool

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects)


@dataclass(frozen=True)
class RemoteScan:
    entries: tuple[RemoteEntryInfo, ...]
    leftovers: tuple[Leftover, ...]
    unknown: tuple[RemoteObject, ...]
    keys: tuple[str, ...]
    """Every key with any object, published or not."""


def scan(remote: RemoteStore) -> RemoteScan:
    """Describe the remote: each published entry (its manifest read and checked: it names
    the upload that holds its data), and the leftovers of interrupted uploads and builds."""
    listed, unknown = remote.scan()
    now = time.time()
    lease = liveness.lease_from_env()
    entries: list[RemoteEntryInfo] = []
    leftovers: list[Leftover] = []
    for item in listed:
        named = None
        if item.manifest is not None:
            info = _entry_info(remote, item)
            entries.append(info)
            named = info.entry.upload if info.entry is not None else None
        for upload, objects in sorted(item.uploads.items()):
            if upload == named:
                continue
            leftovers.append(Leftover(item.key, f"orphaned upload {upload}", tuple(objects),
                                      _older(objects, now, 2 * lease)))
        if item.leases:
            leftovers.append(Leftover(item.key, "lease", tuple(item.leases),
                                      _older(item.leases, now, lease)))
    entries.sort(key=lambda e: (e.created, e.key))
    return RemoteScan(tuple(entries), tuple(leftovers), tuple(unknown),
                      tuple(item.key for item in listed))


def _entry_info(remote: RemoteStore, item: RemoteKey) -> RemoteEntryInfo:
    assert item.manifest is not None
    url = remote.object_url(item.manifest.path)
    entry, problem = None, None
    try:
        entry = remote.lookup(item.key)
        if entry is None:
            problem = "the manifest went away while we looked"
    except CacheCorruptError as e:
        problem = e.reason
    size = item.manifest.size
    if entry is not None:
        size += sum(o.size for o in item.uploads.get(entry.upload, []))
    return RemoteEntryInfo(item.key, url, entry, size, item.manifest.modified, problem)


def _older(objects: Iterable[RemoteObject], now: float, age: float) -> bool:
    times = [o.modified for o in objects]
    return bool(times) and all(t is not None and now - t > age for t in times)


# Verify -------------------------------------------------------------------------------------


def verify(remote: RemoteStore, keys: Optional[Iterable[str]] = None, *,
           on_start: Optional[Callable[[int, int], None]] = None,
           on_bytes: Optional[Callable[[int], None]] = None) -> tuple[int, list[Problem]]:
    """Check remote entries (all, or ``keys`` and unique prefixes): manifest, signature,
    each object's size and checksum (every byte is read). (entries checked, problems)."""
    found = scan(remote)
    entries = list(found.entries)
    if keys is not None:
        wanted = set(resolve_keys(keys, [e.key for e in entries]))
        entries = [e for e in entries if e.key in wanted]
    if on_start is not None:
        on_start(len(entries), sum(e.bytes for e in entries))
    problems: list[Problem] = []
    for info in entries:
        problem = info.problem
        if problem is None and info.entry is not None:
            problem = _check(remote, info.entry, on_bytes)
        if problem is not None:
            problems.append(Problem(info.key, info.url, problem))  # type: ignore[arg-type]
    return len(entries), problems


def _check(remote: RemoteStore, entry: RemoteEntry,
           on_bytes: Optional[Callable[[int], None]]) -> Optional[str]:
    import hashlib

    for record in entry.manifest.files:
        path = remote.upload_path(entry.key, entry.upload, record.name)
        try:
            remote._check_sizes([record], [path])
            hasher = hashlib.blake2b(digest_size=16)
            for block in remote.read_ranges(path, record.bytes):
                hasher.update(block)
                if on_bytes is not None:
                    on_bytes(len(block))
        except CacheCorruptError as e:
            return f"{record.name}: {e.reason}"
        actual = "blake2b-128:" + hasher.hexdigest()
        if actual != record.checksum:
            return (f"checksum mismatch in {record.name}: the manifest says {record.checksum},"
                    f" the object has {actual}")
    return None


# Clear --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteRemovalPlan:
    """Remote entries and leftovers to remove. An entry goes manifest first, so readers stop
    seeing it at once and never see it without its data."""

    remote: RemoteStore
    entries: tuple[RemoteEntryInfo, ...]
    leftovers: tuple[Leftover, ...]
    kept: tuple[Leftover, ...] = field(default=())
    """Leftovers too recent to remove (an upload or build may still be going on)."""

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries) + sum(x.bytes for x in self.leftovers)

    def __len__(self) -> int:
        return len(self.entries) + len(self.leftovers)

    def execute(self) -> list[tuple[str, str]]:
        """Remove everything in the plan; returns (what, error) for each failure."""
        failed: list[tuple[str, str]] = []
        for info in self.entries:
            try:
                self.remote.remove([self.remote.manifest_path(info.key)],
                                   f"removing {info.url}")
                if info.entry is not None:
                    self.remote.remove_upload(info.key, info.entry.upload)
            except RemoteUnavailableError as e:
                failed.append((info.url, str(e)))
        for leftover in self.leftovers:
            try:
                self.remote.remove([o.path for o in leftover.objects],
                                   f"removing the {leftover.what} of {leftover.key}")
            except RemoteUnavailableError as e:
                failed.append((f"{leftover.key} {leftover.what}", str(e)))
        return failed


def plan_clear(remote: RemoteStore, keys: Optional[Iterable[str]] = None, *,
               older_than: Optional[float] = None) -> RemoteRemovalPlan:
    """Entries to remove (all, ``keys``/prefixes, or those created longer than
    ``older_than`` seconds ago), with the removable leftovers of the same keys (of every key
    when no ``keys`` are given)."""
    found = scan(remote)
    entries = list(found.entries)
    wanted: Optional[set[str]] = None
    if keys is not None:
        wanted = set(resolve_keys(keys, found.keys))
        entries = [e for e in entries if e.key in wanted]
    if older_than is not None:
        now = time.time()
        entries = [e for e in entries if now - e.created > older_than]
    leftovers = [x for x in found.leftovers if wanted is None or x.key in wanted]
    # A removed entry's lease goes with it, whatever its age.
    gone = {e.key for e in entries}
    return RemoteRemovalPlan(
        remote, tuple(entries),
        tuple(x for x in leftovers if x.removable or (x.what == "lease" and x.key in gone)),
        tuple(x for x in leftovers if not (x.removable or (x.what == "lease" and x.key in gone))))
