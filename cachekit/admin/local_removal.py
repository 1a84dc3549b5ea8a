"""The local removals: ``clear`` and ``prune`` of a root, and the budget's eviction
(:mod:`.budget`), members of the family of :mod:`.removal`.

To remove a local entry, its directory is first renamed out of ``entries/`` into
``tmp/deleting.KEY.HOST.PID.UUID`` in one atomic step, then deleted
(:meth:`cachekit.store.LocalStore.remove_entry`): a reader either finds the whole entry or
none, and a process that mapped the entry before keeps reading the same bytes (POSIX keeps
unlinked files alive while they are open or mapped). A removal that chose entries for
being unused (``prune``, a budget, ``clear --older-than``) passes over an entry a live
process holds (:mod:`cachekit.store.holds`). Build directories whose builder is alive
(:mod:`cachekit.liveness`) are never touched; they are reported as skipped. A dead build's
directory is judged again just before its removal, and removed by the same atomic rename,
so a builder that resumes it at that moment gets it whole or not at all.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .. import units
from ..store import FAILED, LocalStore, hold_records, holds
from ..store.row_index import INDEX_FOLDER
from . import lock_files, permissions
from .inspect import (BUILDING, ORPHANED, SHORT_KEY, EntryInfo, StrayIndex, TempDir, ago,
                      resolve_keys, scan, stored_bytes, temp_dir_info)
from .removal import (ENTRY, FAILURE_RECORD, HOLD_RECORD, LEFTOVER_DIRECTORY, LOCK_FILE,
                      STRAY_INDEX, Item, Removal, Skipped)


@dataclass(frozen=True, kw_only=True)
class LocalRemoval(Removal):
    """Entries, directories under ``tmp/`` and failure records to remove from a root.

    ``unused_since``: when an entry's key is there, the entry is spared at execution if it
    was used (hit) after that time, or a live process uses it now, because prune and
    ``older_than`` chose it for being unused.
    """

    store: LocalStore
    unused_since: dict[str, float] = field(default_factory=dict)
    kept: tuple[EntryInfo, ...] = ()
    """The entries a prune was told to keep, as its scan found them: counted, never
    removed."""
    counted: int = 0
    """The bytes a prune counted in the root (entries, and the directories under ``tmp/`` it
    may remove): less the entries and directories its report says it removed, what the
    root holds after it."""

    @property
    def temp_dirs(self) -> tuple[TempDir, ...]:
        return self.subjects(LEFTOVER_DIRECTORY)

    def remove(self, item: Item) -> Optional[str]:
        """Remove ``item``, then its key's lock file if free; why not when spared or gone."""
        if item.noun == LOCK_FILE:
            return None if lock_files.forget(self.store, item.subject) else \
                "a build holds it (or it is not this user's to take)"
        if item.noun == HOLD_RECORD:
            return hold_records.forget(self.store.layout, item.subject)
        if item.noun == STRAY_INDEX:
            return None if self.store.row_index.forget_stray(item.key) else "its entry is back"
        if item.noun == ENTRY:
            why_not = _remove_entry(self.store, item.subject,
                                    self.unused_since.get(item.key or ""))
        elif item.noun == LEFTOVER_DIRECTORY:
            why_not = _remove_temp_dir(self.store, item.subject)
        else:
            self.store.forget_record(FAILED, item.subject)
            why_not = None
        if why_not is None and item.key:
            lock_files.forget(self.store, item.key)
        return why_not


def removal_for_clear(store: LocalStore, keys: Optional[Iterable[str]] = None, *,
                      older_than: Optional[float] = None,
                      now: Optional[float] = None) -> LocalRemoval:
    """Removing entries (all, or ``keys`` / unique prefixes), optionally only those not
    used for ``older_than`` seconds, with their orphaned build directories, interrupted
    removals and (unless ``older_than``) recorded build failures and the row index files of
    entries removed outside cachekit (which have no last use). Live builds are listed as
    skipped, and with ``older_than`` so are the entries a live process uses
    (:mod:`cachekit.store.holds`).
    """
    found = scan(store)
    now = time.time() if now is None else now
    failures = store.failure_keys()
    wanted: Optional[set[str]] = None
    if keys is not None:
        known = ([e.key for e in found.entries] + [t.key for t in found.temp_dirs] + failures
                 + [s.key for s in found.stray_index])
        wanted = set(resolve_keys(keys, known))

    def selected(key: str, used: float) -> bool:
        return ((wanted is None or key in wanted)
                and (older_than is None or now - used >= older_than))

    chosen = [e for e in found.entries if selected(e.key, e.last_used)]
    used = holds.in_use(store.layout, [e.key for e in chosen]) if older_than is not None \
        else set()
    in_use = [e for e in chosen if e.key in used]
    entries = _freeing(found.entries, [e for e in chosen if e.key not in used])
    temps = [t for t in found.temp_dirs if selected(t.key, t.modified)]
    records = [] if older_than is not None else [
        k for k in failures if wanted is None or k in wanted]
    strays = () if older_than is not None else [
        s for s in found.stray_index if wanted is None or s.key in wanted]
    lone_locks = () if older_than is not None else [
        k for k in lock_files.lone_keys(store, found, failures) if wanted is None or k in wanted]
    dead_holds = () if older_than is not None else [
        n for n in hold_records.dead(store.layout)
        if wanted is None or hold_records.key_of(n) in wanted]
    return LocalRemoval(
        items=_items(store, entries, [t for t in temps if t.removable], records, now, strays,
                     lone_locks, dead_holds),
        skipped=(*(Skipped(_entry_item(e, now), holds.IN_USE) for e in in_use),
                 *(_skip(t) for t in temps if not t.removable)),
        goal=f"in {store.root}", store=store,
        unused_since={e.key: e.last_used for e in entries} if older_than is not None else {})


def removal_for_prune(store: LocalStore, max_bytes: int,
                      keep: Iterable[str] = ()) -> LocalRemoval:
    """Removing the least recently used entries until the cache holds <= ``max_bytes``.

    The row index files of entries removed outside cachekit always go (they name nothing);
    orphaned build directories and interrupted removals go next (they are garbage); live
    builds are not counted and are listed as skipped; the entries ``keep`` names are
    counted and never removed (the entry a call returns, under a budget), and so are those
    only another user can remove (:mod:`.permissions`) and those a live process uses
    (:mod:`cachekit.store.holds`), listed as skipped.
    """
    keep = set(keep)
    found = scan(store)
    garbage = [t for t in found.temp_dirs if t.removable]
    holders = _holders(found.entries)
    total = counted = stored_bytes(found.entries) + sum(t.bytes for t in garbage)
    temps: list[TempDir] = []
    for temp in garbage:
        if total <= max_bytes:
            break
        temps.append(temp)
        total -= temp.bytes
    entries: list[EntryInfo] = []
    theirs: list[Skipped] = []
    now = time.time()
    for entry in sorted(found.entries, key=lambda e: (e.last_used, e.created, e.key)):
        if total <= max_bytes:
            break
        if entry.key in keep:
            continue
        owner = permissions.entry_owner(store, entry.key)
        why = permissions.only_owner(owner) if owner is not None else \
            holds.IN_USE if holds.held(store.layout, entry.key) else None
        if why is not None:  # counted, as it stays
            theirs.append(Skipped(_entry_item(entry, now), why))
            continue
        entries += _freeing([entry], [entry], holders)
        total -= entries[-1].own_bytes
    return LocalRemoval(
        items=_items(store, entries, temps, [], now, found.stray_index,
                     lock_files.lone_keys(store, found, store.failure_keys()),
                     hold_records.dead(store.layout)),
        skipped=(*theirs, *(_skip(t) for t in found.temp_dirs if not t.removable)),
        goal=f"to bring {store.root} to at most {units.format_size(max_bytes)}", store=store,
        unused_since={e.key: e.last_used for e in entries},
        kept=tuple(e for e in found.entries if e.key in keep), counted=counted)


def _holders(entries: Iterable[EntryInfo]) -> collections.Counter:
    """How many of ``entries`` hold each file (device, inode, size)."""
    return collections.Counter(f for e in entries for f in e.files)


def _freeing(entries: Iterable[EntryInfo], chosen: Iterable[EntryInfo],
             holders: Optional[collections.Counter] = None) -> list[EntryInfo]:
    """``chosen`` (of ``entries``), each with ``own_bytes`` the bytes its removal frees
    once the ones before it are removed: a file another entry still links frees nothing.
    ``holders``: the counts of :func:`_holders` to update (default: of ``entries``)."""
    holders = _holders(entries) if holders is None else holders
    out = []
    for entry in chosen:
        holders.subtract(entry.files)
        freed = sum(f[2] for f in set(entry.files) if holders[f] <= 0)
        out.append(dataclasses.replace(entry, shared_bytes=entry.bytes - freed))
    return out


def _items(store: LocalStore, entries: Iterable[EntryInfo], temps: Iterable[TempDir],
           records: Iterable[str], now: float, strays: Iterable[StrayIndex] = (),
           lone_locks: Iterable[str] = (), dead_holds: Iterable[str] = ()
           ) -> tuple[Item, ...]:
    """The items of a local removal: garbage (stray index files, then ``tmp/``) first,
    then entries, then failure records, then lock files and hold records left behind."""
    items = [Item(s.key, STRAY_INDEX, f"the row index file of {s.key[:SHORT_KEY]}",
                  store.root / INDEX_FOLDER, s.bytes,
                  f"{s.key[:SHORT_KEY]}  row index of an entry removed outside cachekit  "
                  f"{units.format_size(s.bytes)}", s) for s in strays]
    items += [_temp_item(t) for t in temps]
    items += [_entry_item(e, now) for e in entries]
    items += [Item(k, FAILURE_RECORD, f"the failure record of {k[:SHORT_KEY]}",
                   store.layout.failure_path(k), 0,
                   f"{k[:SHORT_KEY]}  recorded build failure", k) for k in records]
    items += [Item(k, LOCK_FILE, f"the lock file of {k[:SHORT_KEY]}", store.layout.lock_path(k),
                   0, "", k) for k in lone_locks]
    items += [Item(hold_records.key_of(n), HOLD_RECORD, f"the hold record {n}",
                   store.root / hold_records.FOLDER / n, 0, "", n) for n in dead_holds]
    return tuple(items)


def _entry_item(e: EntryInfo, now: float) -> Item:
    return Item(e.key, ENTRY, e.key, e.path, e.own_bytes,
                f"{e.key[:SHORT_KEY]}  {e.kind or '?':<7} {units.format_size(e.own_bytes):>9}  "
                f"last used {ago(e.last_used, now)}", e)


def _temp_item(temp: TempDir) -> Item:
    return Item(temp.key, LEFTOVER_DIRECTORY, temp.path.name, temp.path, temp.bytes,
                f"{temp.path.name}  {temp.state} ({temp.owner})  {units.format_size(temp.bytes)}",
                temp)


def _skip(temp: TempDir) -> Skipped:
    return Skipped(_temp_item(temp), _kept_because(temp))


def _kept_because(temp: TempDir) -> str:
    """Why a directory under ``tmp/`` stays: live, or another user's to remove."""
    if temp.blocked_by is not None:
        return permissions.only_owner(temp.blocked_by)
    doing = "being built" if temp.state == BUILDING else "being removed"
    return f"{doing} by {temp.owner}"


def _remove_entry(store: LocalStore, entry: EntryInfo, unused_since: Optional[float]
                  ) -> Optional[str]:
    """Remove a published entry; why not when it was spared or already gone."""
    try:
        if unused_since is not None and entry.path.stat().st_mtime > unused_since:
            return "used since the removal was planned"
        owner = permissions.entry_owner(store, entry.key)
        if owner is not None:
            return permissions.only_owner(owner)
        chosen_as_unused = unused_since is not None  # then not while a process uses it
        with holds.unused(store.layout, entry.key) if chosen_as_unused \
                else contextlib.nullcontext(True) as free:
            if not free:
                return holds.IN_USE
            aside = store.set_aside(entry.key)  # under the lock: the rename alone
        if aside is None:
            return "already removed by another process"
        if aside:
            store.remove_temp(aside, entry.key)
    except FileNotFoundError:
        return "already removed by another process"
    return None


def _remove_temp_dir(store: LocalStore, temp: TempDir) -> Optional[str]:
    """Remove an orphaned build directory (judged dead again first) or an interrupted
    removal; why not when it came alive, or is gone."""
    if temp.state != ORPHANED:
        store.remove_temp(temp.path.name, temp.key)
        return None
    now = temp_dir_info(store, temp.path)
    if now is None:
        return "already removed by another process"
    if not now.removable:
        return _kept_because(now)
    if not store.remove_temp(temp.path.name, temp.key):
        return "already removed, or resumed, by another process"
    return None
