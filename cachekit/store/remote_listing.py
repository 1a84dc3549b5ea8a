"""Listing a remote prefix: every key's objects (manifest, uploads, lease objects), the pool's
objects, objects cachekit never writes, and the store's own time (:func:`clock`), which ``cachekit ls
--remote`` and ``clear --remote`` judge ages by.

The functions work on a :class:`~cachekit.store.bucket.Bucket`;
:class:`~cachekit.store.remote.RemoteStore` has them as its methods ``scan`` and ``clock``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from ..errors import RemoteUnavailableError
from ..key_names import is_key
from .bucket import Bucket
from .manifest import MANIFEST_FILE
from .remote_entry import POOL_FOLDER, is_upload_id
from .remote_fs import modified

CLOCK_FOLDER = "clock"
PROBE_STALE_SECONDS = 3600.0


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


class Listing(NamedTuple):
    """What one listing of the prefix found."""

    keys: list[RemoteKey]
    unknown: list[RemoteObject]
    """Objects cachekit does not know."""
    pool: list[RemoteObject]
    """The pool's objects (see :mod:`.remote_entry`)."""


def scan(bucket: Bucket) -> Listing:
    """Every key's objects under the prefix, the pool's, and objects cachekit does not
    know."""
    root = bucket.root
    try:
        found = bucket.find(root)
    except FileNotFoundError:
        return Listing([], [], [])
    keys: dict[str, RemoteKey] = {}
    unknown: list[RemoteObject] = []
    pool: list[RemoteObject] = []
    for path, info in sorted(found.items()):
        if info.get("type") == "directory":
            continue
        obj = RemoteObject(path, int(info.get("size") or 0), modified(info))
        parts = path[len(root):].strip("/").split("/")
        if parts[0] == CLOCK_FOLDER and len(parts) == 2:
            continue  # a probe of :func:`clock`
        if parts[0] == POOL_FOLDER and len(parts) == 2 and is_upload_id(parts[1]):
            pool.append(obj)
            continue
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
    return Listing(sorted(keys.values(), key=lambda k: k.key), unknown, pool)


def clock(bucket: Bucket) -> Optional[float]:
    """The store's own time now, as its listings show objects' times: the time of a
    probe object written and listed for this, then removed. None when the store cannot
    say (no write permission, no times in its listings, a failing remote).

    Ages judged against it compare the store's times with each other, so they hold
    whatever this host's clock says. Probes that a killed caller left are removed."""
    folder = bucket.path(CLOCK_FOLDER)
    name = uuid.uuid4().hex
    probe = f"{folder}/{name}"
    try:
        bucket.write(probe, b"")
        listed = bucket.list(folder)
    except (RemoteUnavailableError, FileNotFoundError):
        return None
    times = {str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]: modified(info)
             for info in listed}
    now = times.get(name)
    stale = [f"{folder}/{other}" for other, when in times.items() if other != name
             and when is not None and now is not None and now - when > PROBE_STALE_SECONDS]
    try:
        bucket.remove([probe, *stale], f"removing {bucket.object_url(probe)}")
    except RemoteUnavailableError:
        pass  # the next probe removes it
    return now
