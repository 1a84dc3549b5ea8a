"""Looking at a remote tier: what ``cachekit ls|info --remote`` show, and what ``clear
--remote`` (:mod:`.remote_clear`) may remove, as frozen dataclasses.

Besides published entries, a remote holds what interrupted work left:

- an orphaned upload: data objects under ``entries/KEY/UPLOAD/`` that no manifest names (an
  uploader killed before its manifest, the loser of two concurrent uploads killed before it
  cleaned up, an uploader that could not tell whether its manifest landed). It is removed
  once its objects and every lease object of its key are untouched for twice the lease:
  a builder beats its lease all through its upload, so a live one keeps its upload.
- pool objects that no manifest names (``parts/HEX``: the row data that entries share, see
  :mod:`cachekit.store.remote_entry`): those the removed entries named go with them, and
  (whatever the selection) any other once untouched for twice the lease (an upload may be
  about to name it).
  Just before they go, every manifest is read again, and a pool object one names stays;
  just after, the manifests published meanwhile are read, and one that names a removed
  object (an upload met it in the pool in between) is withdrawn: its key is a miss.
- old lease generations: ``leases/KEY/GEN.*`` below the key's newest generation. The newest
  generation's two small objects always stay, so that generation numbers only rise and a
  holder that wakes late never writes into another holder's lease.

Ages are never read against this host's clock: each is the store's time of a probe object
(:meth:`~cachekit.store.remote.RemoteStore.clock`) minus the store's time of the objects,
so clocks that disagree change nothing. A store that cannot say its time gets no leftover
removed. Data a manifest may name is never removed either: just before an orphaned upload
goes, the key's manifest is read again, and read once more after: a manifest that names
the removed upload (its uploader woke from a pause in between) is withdrawn, so the key is
a miss, never a torn entry. The uploader itself checks its objects after its manifest wins
(:meth:`~cachekit.store.remote.RemoteStore.upload`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .. import liveness
from ..errors import CacheCorruptError, OtherFormatError
from ..store.remote import RemoteEntry, RemoteKey, RemoteObject, RemoteStore


@dataclass(frozen=True)
class RemoteEntryInfo:
    """One remote key with a manifest. Manifest fields are None when ``problem`` is set."""

    key: str
    url: str
    entry: Optional[RemoteEntry]
    bytes: int
    """Its manifest and every object it names (pool objects too)."""
    uploaded: Optional[float]
    problem: Optional[str] = None
    pool: frozenset[str] = frozenset()
    """The pool objects it names."""
    pooled_bytes: int = 0
    other_format: bool = False
    """Whether ``problem`` is only that another cachekit version made it: never used by
    this one, and not damaged."""

    @property
    def own_bytes(self) -> int:
        """Its manifest and upload: the bytes removing it frees besides pool objects,
        which other entries may name too."""
        return self.bytes - self.pooled_bytes

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
                "problem": self.problem, "other_format": self.other_format}


@dataclass(frozen=True)
class Leftover:
    """Objects of one key that interrupted work left: an orphaned upload or old leases."""

    key: str
    what: str  # "orphaned upload UPLOAD", "lease"
    objects: tuple[RemoteObject, ...]
    removable: bool
    upload: Optional[str] = None
    """The upload id of an orphaned upload."""
    pool: bool = False
    """Objects of the pool (``key`` is empty)."""
    kept_because: str = ""
    """Why a leftover that is not removable stays."""

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
    now: Optional[float] = None
    """The store's time when the scan began (None: the store could not say)."""
    pool: tuple[RemoteObject, ...] = ()
    """Every object of the pool."""

    def stored_bytes(self, entries: Optional[Iterable[RemoteEntryInfo]] = None) -> int:
        """The bytes of ``entries`` (default: every entry) on the store, each object
        counted once: their manifests and uploads, and the pool objects they name."""
        entries = list(self.entries if entries is None else entries)
        named = pool_names(entries) or set()
        return (sum(e.own_bytes for e in entries)
                + sum(o.size for o in self.pool if o.path in named))


RECENT = "recent: an upload or build may still be going on"
NO_CLOCK = "its age is unknown: the store's time could not be read"


def scan(remote: RemoteStore) -> RemoteScan:
    """Describe the remote: each published entry (its manifest read and checked: it names
    the upload that holds its data), and the leftovers of interrupted uploads and builds."""
    now = remote.clock()  # before the listing: ages only come out too young
    listed, unknown, pool = remote.scan()
    quiet = quiet_seconds()
    entries: list[RemoteEntryInfo] = []
    leftovers: list[Leftover] = []
    for item in listed:
        named = None
        info = entry_info(remote, item)
        if info is not None:
            entries.append(info)
            named = info.entry.upload if info.entry is not None else None
        for upload, objects in sorted(item.uploads.items()):
            if upload == named:
                continue
            why = why_kept(objects, item.leases, now, quiet)
            leftovers.append(Leftover(item.key, f"orphaned upload {upload}", tuple(objects),
                                      not why, upload=upload, kept_because=why))
        old = _older_generations(item.leases)
        if old:
            leftovers.append(Leftover(item.key, "lease", tuple(old), True))
    entries.sort(key=lambda e: (e.created, e.key))
    leftovers += _unnamed_pool(entries, pool, now, quiet)
    return RemoteScan(tuple(entries), tuple(leftovers), tuple(unknown),
                      tuple(item.key for item in listed), now, tuple(pool))


def pool_names(entries: Iterable[RemoteEntryInfo]) -> Optional[set[str]]:
    """The pool objects that ``entries`` name; None when a manifest could not be read (it
    may name any)."""
    named: set[str] = set()
    for info in entries:
        if info.entry is None:
            return None
        named |= info.pool
    return named


UNREAD = "a manifest could not be read, and may name them"


def _unnamed_pool(entries: list[RemoteEntryInfo], pool: list[RemoteObject],
                  now: Optional[float], quiet: float) -> list[Leftover]:
    """The pool objects that no manifest names: removable when untouched for ``quiet``
    seconds, kept (with why) when recent."""
    named = pool_names(entries)
    unnamed = [o for o in pool if named is None or o.path not in named]
    if not unnamed:
        return []
    if named is None:
        return [Leftover("", "unnamed pool objects", tuple(unnamed), False,
                         kept_because=UNREAD, pool=True)]
    out = []
    old = tuple(o for o in unnamed if not why_kept([o], [], now, quiet))
    if old:
        out.append(Leftover("", "unnamed pool objects", old, True, pool=True))
    young = tuple(o for o in unnamed if o not in old)
    if young:
        out.append(Leftover("", "recent pool objects", young, False, pool=True,
                            kept_because=why_kept(list(young), [], now, quiet)))
    return out


STORE_TIME_SLACK = 1.0
"""Seconds added to every age limit: S3 gives objects' times in whole seconds."""


def quiet_seconds() -> float:
    """How long an upload's objects and its key's lease must stay untouched before it
    counts as dead: twice the lease, and the slack of the store's whole seconds."""
    return 2 * liveness.lease_from_env() + STORE_TIME_SLACK


def _newest(objects: Iterable[RemoteObject]) -> Optional[float]:
    times = [o.modified for o in objects]
    return None if not times or None in times else max(t for t in times if t is not None)


def why_kept(upload: list[RemoteObject], leases: list[RemoteObject],
                  now: Optional[float], quiet: float) -> str:
    """Why an orphaned upload must stay (empty when it may go): it or its key's lease was
    touched within ``quiet`` seconds by the store's clock ``now``, or that is unknown."""
    for objects in (upload, leases):
        if not objects:
            continue
        newest = _newest(objects)
        if now is None or newest is None:
            return NO_CLOCK
        if now - newest <= quiet:
            return RECENT
    return ""


def _older_generations(leases: Iterable[RemoteObject]) -> list[RemoteObject]:
    """The lease objects below the newest generation that has a record (``GEN.json``)."""
    def generation(obj: RemoteObject) -> tuple[int, str]:
        stem, _, suffix = obj.path.rsplit("/", 1)[-1].partition(".")
        return (int(stem) if stem.isdigit() else -1), suffix

    leases = list(leases)
    records = [g for g, suffix in map(generation, leases) if suffix == "json" and g > 0]
    newest = max(records, default=None)
    return [o for o in leases if newest is None or generation(o)[0] < newest]


def entry_info(remote: RemoteStore, item: RemoteKey) -> Optional[RemoteEntryInfo]:
    """The entry whose manifest the listing ``item`` shows, its manifest read now; None
    when the listing shows none, or it was removed since (a clear elsewhere): no entry."""
    if item.manifest is None:
        return None
    url = remote.object_url(item.manifest.path)
    entry, problem, other_format = None, None, False
    try:
        entry = remote.lookup(item.key)
        if entry is None:
            return None
    except CacheCorruptError as e:
        problem, other_format = e.reason, isinstance(e, OtherFormatError)
    size = item.manifest.size
    pool: frozenset[str] = frozenset()
    pooled_bytes = 0
    if entry is not None:
        size += sum(o.size for o in item.uploads.get(entry.upload, []))
        m = entry.manifest
        in_pool = [(f, p) for f, p in zip(m.files, entry.objects(remote)) if entry.pooled(f)]
        pool = frozenset(p for _, p in in_pool)
        pooled_bytes = sum(f.bytes for f, _ in in_pool)
    return RemoteEntryInfo(item.key, url, entry, size + pooled_bytes, item.manifest.modified,
                           problem, pool, pooled_bytes, other_format)
