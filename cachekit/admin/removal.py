"""Removing entries safely while other processes read and build: one family of removals,
local and remote, each made by looking only and carried out by ``execute()``.

Because making a removal changes nothing, ``--dry-run`` and the confirmation prompt cost
nothing, and the command line shows, confirms and reports every removal the same way: a
:class:`Removal` has its :class:`Item` s (what will go), what it leaves alone
(:class:`Skipped`, each with why) and its goal; ``execute()`` removes each item that is
still safe to remove and returns a :class:`RemovalReport`. This module holds the family and
the local removals (:func:`removal_for_clear`, :func:`removal_for_prune`); the remote one is
:class:`cachekit.admin.remote_clear.RemoteRemoval`.

To remove a local entry, its directory is first renamed out of ``entries/`` into
``tmp/deleting.KEY.HOST.PID.UUID`` in one atomic step, then deleted
(:meth:`cachekit.store.LocalStore.remove_entry`): a reader either finds the whole entry or
none, and a process that mapped the entry before keeps reading the same bytes (POSIX keeps
unlinked files alive while they are open or mapped). Build directories whose builder is
alive (:mod:`cachekit.liveness`) are never touched; they are reported as skipped. A dead
build's directory is judged again just before its removal, and removed by the same atomic
rename, so a builder that resumes it at that moment gets it whole or not at all.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional, Union

from .. import units
from ..store import FAILED, LocalStore
from ..store.row_index import INDEX_FOLDER
from . import lock_files, permissions
from .inspect import (BUILDING, ORPHANED, SHORT_KEY, EntryInfo, StrayIndex, TempDir, ago,
                      resolve_keys, scan, stored_bytes, temp_dir_info)

ENTRY, LEFTOVER_DIRECTORY, FAILURE_RECORD = "entry", "leftover directory", "failure record"
STRAY_INDEX, LOCK_FILE = "stray index file", "lock file"
"""What an :class:`Item` is (``Item.noun``): a published entry, a directory under ``tmp/``
left by a dead builder or an interrupted removal, a key's recorded build failure, the row
index files of an entry removed outside cachekit, a lock file left behind (no ``line``)."""


@dataclass(frozen=True)
class Item:
    """One thing a removal takes away (or leaves alone), as people are shown it."""

    key: Optional[str]
    noun: str
    """What it is, in the singular: ``entry``, ``leftover directory``, ..."""
    name: str
    """Its short name in messages, e.g. a directory's name."""
    path: Union[Path, str]
    """Where it is: a path, or a URL of the remote."""
    bytes: int
    line: str
    """Its line in the list a removal shows before it asks."""
    subject: Any = field(compare=False)
    """What the inspection found: an EntryInfo, a TempDir, a key, ..."""


@dataclass(frozen=True)
class Skipped:
    """Something a removal or its execution left alone (or failed to remove), and why."""

    item: Item
    reason: str

    @property
    def key(self) -> Optional[str]:
        return self.item.key

    @property
    def path(self) -> Union[Path, str]:
        return self.item.path

    @property
    def name(self) -> str:
        return self.item.name


@dataclass(frozen=True)
class RemovalReport:
    """What ``Removal.execute()`` did: what went, what stayed and why (what the removal
    skipped from the start first), and what could not be removed (the reason says why)."""

    removed: tuple[Item, ...]
    skipped: tuple[Skipped, ...]
    failed: tuple[Skipped, ...]

    @property
    def freed_bytes(self) -> int:
        return sum(item.bytes for item in self.removed)

    @property
    def removed_entries(self) -> tuple[Any, ...]:
        """What the inspection found of each removed entry (an EntryInfo locally)."""
        return tuple(item.subject for item in self.removed if item.noun == ENTRY)

    @property
    def removed_temp_dirs(self) -> tuple[TempDir, ...]:
        """The removed directories under a local root's ``tmp/``."""
        return tuple(item.subject for item in self.removed if item.noun == LEFTOVER_DIRECTORY)

    def summary(self) -> str:
        """E.g. ``2 entries and 1 leftover directory, freed 1.2 MB``."""
        return f"{counted(self.removed)}, freed {units.format_size(self.freed_bytes)}"


@dataclass(frozen=True, kw_only=True)
class Removal:
    """Things to remove (``items``, in the order they go), what is left alone and why
    (``skipped``), and what the removal is for (``goal``, e.g. ``in /data/cache``).

    A member of the family says how one item goes (:meth:`remove`) and which errors mean
    that an item could not be removed (``failures``); the rest is common to all.
    """

    items: tuple[Item, ...]
    skipped: tuple[Skipped, ...] = ()
    goal: str
    failures: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def entries(self) -> tuple[Any, ...]:
        """What the inspection found of each entry to remove."""
        return self.subjects(ENTRY)

    def subjects(self, noun: str) -> tuple[Any, ...]:
        return tuple(item.subject for item in self.items if item.noun == noun)

    def summary(self) -> str:
        """What a dry run would remove, e.g. ``3 entries (1.2 MB) in /data/cache``."""
        return f"{counted(self.items)} ({units.format_size(self.bytes)}) {self.goal}"

    def remove(self, item: Item) -> Optional[str]:
        """Remove ``item`` if it is still safe to: None when it went, else why it stays.
        Raises one of ``failures`` when it could not be removed."""
        raise NotImplementedError

    def execute(self) -> RemovalReport:
        """Remove every item that is still safe to remove, in order."""
        removed: list[Item] = []
        skipped = list(self.skipped)
        failed: list[Skipped] = []
        for item in self.items:
            try:
                reason = self.remove(item)
            except self.failures as e:
                failed.append(Skipped(item, str(e)))
                continue
            if reason is None:
                removed.append(item)
            else:
                skipped.append(Skipped(item, reason))
        return RemovalReport(tuple(removed), tuple(skipped), tuple(failed))


def counted(items: Iterable[Item]) -> str:
    """``items`` counted by what they are, entries first and always: ``0 entries and 2
    leftover directories``."""
    counts = {ENTRY: 0}
    for item in items:
        counts[item.noun] = counts.get(item.noun, 0) + 1
    return " and ".join(f"{n} {noun if n == 1 else _plural(noun)}" for noun, n in counts.items()
                        if n or noun == ENTRY)


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


# The local removals ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LocalRemoval(Removal):
    """Entries, directories under ``tmp/`` and failure records to remove from a root.

    ``unused_since``: when an entry's key is there, the entry is spared at execution if it
    was used (hit) after that time, because prune and ``older_than`` chose it for being
    unused.
    """

    store: LocalStore
    unused_since: dict[str, float] = field(default_factory=dict)
    kept: tuple[EntryInfo, ...] = ()
    """The entries a prune was told to keep, as its scan found them: counted, never
    removed."""

    @property
    def temp_dirs(self) -> tuple[TempDir, ...]:
        return self.subjects(LEFTOVER_DIRECTORY)

    def remove(self, item: Item) -> Optional[str]:
        """Remove ``item``, then its key's lock file if free; why not when spared or gone."""
        if item.noun == LOCK_FILE:
            return None if lock_files.forget(self.store, item.subject) else \
                "a build holds it (or it is not this user's to take)"
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
    skipped.
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

    entries = _freeing(found.entries, [e for e in found.entries if selected(e.key, e.last_used)])
    temps = [t for t in found.temp_dirs if selected(t.key, t.modified)]
    records = [] if older_than is not None else [
        k for k in failures if wanted is None or k in wanted]
    strays = () if older_than is not None else [
        s for s in found.stray_index if wanted is None or s.key in wanted]
    lone_locks = () if older_than is not None else [
        k for k in lock_files.lone_keys(store, found, failures) if wanted is None or k in wanted]
    return LocalRemoval(
        items=_items(store, entries, [t for t in temps if t.removable], records, now, strays,
                     lone_locks),
        skipped=tuple(_skip(t) for t in temps if not t.removable),
        goal=f"in {store.root}", store=store,
        unused_since={e.key: e.last_used for e in entries} if older_than is not None else {})


def removal_for_prune(store: LocalStore, max_bytes: int,
                      keep: Iterable[str] = ()) -> LocalRemoval:
    """Removing the least recently used entries until the cache holds <= ``max_bytes``.

    The row index files of entries removed outside cachekit always go (they name nothing);
    orphaned build directories and interrupted removals go next (they are garbage); live
    builds are not counted and are listed as skipped; the entries ``keep`` names are
    counted and never removed (the entry a call returns, under a budget), and so are those
    only another user can remove (:mod:`.permissions`), listed as skipped.
    """
    keep = set(keep)
    found = scan(store)
    garbage = [t for t in found.temp_dirs if t.removable]
    holders = _holders(found.entries)
    total = stored_bytes(found.entries) + sum(t.bytes for t in garbage)
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
        if owner is not None:  # counted, as it stays
            theirs.append(Skipped(_entry_item(entry, now), permissions.only_owner(owner)))
            continue
        entries += _freeing([entry], [entry], holders)
        total -= entries[-1].own_bytes
    return LocalRemoval(
        items=_items(store, entries, temps, [], now, found.stray_index,
                     lock_files.lone_keys(store, found, store.failure_keys())),
        skipped=(*theirs, *(_skip(t) for t in found.temp_dirs if not t.removable)),
        goal=f"to bring {store.root} to at most {units.format_size(max_bytes)}", store=store,
        unused_since={e.key: e.last_used for e in entries},
        kept=tuple(e for e in found.entries if e.key in keep))


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
           lone_locks: Iterable[str] = ()) -> tuple[Item, ...]:
    """The items of a local removal: garbage (stray index files, then ``tmp/``) first,
    then entries, then failure records, then lock files left behind."""
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
        if not store.remove_entry(entry.key):
            return "already removed by another process"
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
