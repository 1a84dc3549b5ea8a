"""Removing from a remote tier: what ``cachekit clear --remote`` does. The removal is a
:class:`~cachekit.admin.removal.Removal` like the local ones, whose ``execute()`` does the
work, so ``--dry-run`` and confirmation cost nothing; what it may remove, and when, is
the scan's to say (:mod:`cachekit.admin.remote`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Iterable, Optional

from .. import units
from ..errors import RemoteUnavailableError
from ..store.remote import OTHERS, OURS, UNKNOWN, RemoteKey, RemoteStore
from ..store.remote_entry import PINS_FILE
from .inspect import SHORT_KEY, ago, resolve_keys
from .remote import (STORE_TIME_SLACK, UNREAD, Leftover, RemoteEntryInfo, RemoteScan,
                     entry_info, pool_names, quiet_seconds, scan, why_kept)
from .removal import ENTRY, Item, Removal, Skipped


LEFTOVER = "leftover"
"""What a remote removal's leftover items are (``Item.noun``)."""


@dataclass(frozen=True, kw_only=True)
class RemoteRemoval(Removal):
    """Remote entries and leftovers to remove. An entry goes manifest first, so readers stop
    seeing it at once and never see it without its data. Leftovers that stay are skipped,
    with why (an upload or build may still be going on, or the store's time is unknown)."""

    remote: RemoteStore
    failures: ClassVar[tuple[type[BaseException], ...]] = (RemoteUnavailableError,)

    @property
    def leftovers(self) -> tuple[Leftover, ...]:
        return self.subjects(LEFTOVER)

    def remove(self, item: Item) -> Optional[str]:
        remote = self.remote
        if item.noun == ENTRY:
            info: RemoteEntryInfo = item.subject
            if info.entry is not None and remote.named(info.key, info.entry.upload) == OTHERS:
                return "replaced by another upload since it was listed: a new entry"
            remote.remove([remote.manifest_path(info.key)], f"removing {info.url}")
            if info.entry is not None:
                remote.remove_upload(info.key, info.entry.upload)
            return None
        leftover: Leftover = item.subject
        if leftover.upload is not None:
            return _remove_orphan(remote, leftover)
        if leftover.pool:
            return _remove_unnamed(remote, leftover)
        remote.remove([o.path for o in leftover.objects],
                      f"removing the {leftover.what} of {leftover.key}")
        return None


def _remove_orphan(remote: RemoteStore, leftover: Leftover) -> Optional[str]:
    """Remove an orphaned upload unless a manifest names it now; withdraw a manifest that
    came to name it while its objects went (its uploader woke in between)."""
    assert leftover.upload is not None
    if remote.named(leftover.key, leftover.upload) in (OURS, UNKNOWN):
        return "published since it was listed, or its key's manifest could not be read"
    remote.remove([o.path for o in leftover.objects],
                  f"removing the {leftover.what} of {leftover.key}")
    remote.withdraw(leftover.key, leftover.upload)
    return None


def _remove_unnamed(remote: RemoteStore, leftover: Leftover) -> Optional[str]:
    """Remove pool objects unless a manifest names them now (every manifest is read
    again: an upload may have come to name one since the scan), or a recent upload relies
    on them (:func:`_pinned`). An upload that met one in the pool may still list it,
    publish a manifest naming it and check it between that reading and the removal: the
    manifests published since are read once more after it, and one that names a removed
    object is withdrawn, so its key is a miss, never a torn entry."""
    since = remote.clock()  # before the listing: manifests it misses are newer
    listed = remote.scan().keys
    infos = [info for info in map(partial(entry_info, remote), listed) if info is not None]
    named = pool_names(infos)
    if named is None:
        return UNREAD
    named |= _pinned(remote, listed, infos, since)
    going = [o.path for o in leftover.objects if o.path not in named]
    remote.remove(going, f"removing {leftover.what}")
    _withdraw_naming(remote, set(going), since)
    return None


def _pinned(remote: RemoteStore, listed: list[RemoteKey], infos: list[RemoteEntryInfo],
            now: Optional[float]) -> set[str]:
    """The pool objects that uploads in progress rely on (their ``pool.json``): those of
    the uploads no manifest names that, or whose key's lease, were touched within the
    quiet period by the store's clock ``now`` (or whose age is unknown)."""
    published = {info.key: info.entry.upload for info in infos if info.entry is not None}
    quiet = quiet_seconds()
    relied_on: set[str] = set()
    for item in listed:
        for upload, objects in item.uploads.items():
            if (upload != published.get(item.key)
                    and any(o.path.endswith(f"/{PINS_FILE}") for o in objects)
                    and why_kept(objects, item.leases, now, quiet)):
                relied_on |= remote.pinned(item.key, upload)
    return relied_on


def _withdraw_naming(remote: RemoteStore, gone: set[str], since: Optional[float]) -> None:
    """Withdraw every manifest that names one of the removed pool objects ``gone``,
    reading those published at or after the store's time ``since`` (all of them when
    that is unknown): the older ones were read before the removal, and named none."""
    for item in remote.scan().keys:
        found = item.manifest
        if found is None or (since is not None and found.modified is not None
                             and found.modified < since - STORE_TIME_SLACK):
            continue
        info = entry_info(remote, item)
        if info is not None and info.entry is not None and info.pool & gone:
            remote.withdraw(item.key, info.entry.upload)


def removal_for_clear(remote: RemoteStore, keys: Optional[Iterable[str]] = None, *,
                      older_than: Optional[float] = None) -> RemoteRemoval:
    """Removing entries (all, ``keys``/prefixes, or those uploaded longer than
    ``older_than`` seconds ago), with the removable leftovers of the same keys (of every key
    when no ``keys`` are given)."""
    found = scan(remote)
    entries = list(found.entries)
    wanted: Optional[set[str]] = None
    if keys is not None:
        wanted = set(resolve_keys(keys, found.keys))
        entries = [e for e in entries if e.key in wanted]
    if older_than is not None:
        entries = [e for e in entries if _age(e, found.now) > older_than]
    leftovers = [x for x in found.leftovers
                 if (wanted is None and not x.pool) or x.key in (wanted or ())]
    leftovers += _pool_freed(found, entries)
    now = time.time()
    # An entry's own objects: the pool objects it frees are the pool leftover's, counted
    # once and only when no other entry names them.
    items = [Item(e.key, ENTRY, e.key, e.url, e.own_bytes,
                  f"{e.key[:SHORT_KEY]}  {e.entry.manifest.kind if e.entry else '?':<7} "
                  f"{units.format_size(e.own_bytes):>9}  created {ago(e.created, now)}", e)
             for e in entries]
    items += [_leftover_item(remote, x) for x in leftovers if x.removable]
    return RemoteRemoval(items=tuple(items), goal=f"in {remote.display}", remote=remote,
                         skipped=tuple(Skipped(_leftover_item(remote, x), x.kept_because)
                                       for x in leftovers if not x.removable))


def _pool_freed(found: RemoteScan, removed: list[RemoteEntryInfo]) -> list[Leftover]:
    """The pool objects to remove with ``removed``: those they name that no other entry
    names, and the old ones that none names (whatever the selection: they belong to no
    key)."""
    gone = {e.key for e in removed}
    kept = pool_names(e for e in found.entries if e.key not in gone)
    unnamed = [x for x in found.leftovers if x.pool]
    if kept is None:
        return unnamed  # kept, and says why: a manifest could not be read
    theirs = set().union(*(e.pool for e in removed)) - kept
    # One removable leftover, so that its removal reads the manifests again only once.
    going = tuple(o for o in found.pool if o.path in theirs) + tuple(
        o for x in unnamed if x.removable for o in x.objects)
    out = [Leftover("", "pool objects no entry names", going, True, pool=True)
           ] if going else []
    return out + [x for x in unnamed if not x.removable]


def _leftover_item(remote: RemoteStore, leftover: Leftover) -> Item:
    folder = leftover.objects[0].path.rsplit("/", 1)[0] if leftover.objects else ""
    return Item(leftover.key, LEFTOVER, f"the {leftover.what} of {leftover.key[:SHORT_KEY]}",
                remote.object_url(folder), leftover.bytes,
                f"{leftover.key[:SHORT_KEY]}  {leftover.what}  "
                f"{units.format_size(leftover.bytes)}", leftover)


def _age(entry: RemoteEntryInfo, now: Optional[float]) -> float:
    """Seconds since ``entry`` was uploaded, by the store's clock; by this host's clock from
    its manifest's creation time when the store cannot say. Removing an entry never tears
    one (its manifest goes first), so here a skewed clock only moves the day it goes."""
    if now is not None and entry.uploaded is not None:
        return now - entry.uploaded
    return time.time() - entry.created
