"""Removing entries safely while other processes read and build: plans, then execution.

A plan (:func:`plan_clear`, :func:`plan_prune`) only looks; its ``execute()`` does the work,
so ``--dry-run`` and confirmation prompts cost nothing. To remove an entry, its directory is
first renamed out of ``entries/`` into ``tmp/deleting.KEY.HOST.PID.UUID`` in one atomic
step, then deleted (:meth:`cachekit.store.LocalStore.remove`): a reader either finds the
whole entry or none, and a process that mapped the entry before keeps reading the same
bytes (POSIX keeps unlinked files alive while they are open or mapped). Build directories
whose builder is alive (:mod:`cachekit.liveness`) are never touched; they are reported as
skipped. A dead build's directory is judged again just before its removal, and removed by
the same atomic rename, so a builder that resumes it at that moment gets it whole or not at
all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from .inspect import BUILDING, ORPHANED, EntryInfo, TempDir, resolve_keys, scan, temp_dir_info
from ..store import LocalStore


@dataclass(frozen=True)
class Skipped:
    """Something a plan or its execution left alone, and why."""

    key: Optional[str]
    path: Path
    reason: str


@dataclass(frozen=True)
class RemovalReport:
    """What ``RemovalPlan.execute()`` did."""

    removed_entries: tuple[EntryInfo, ...]
    removed_temp_dirs: tuple[TempDir, ...]
    skipped: tuple[Skipped, ...]
    failed: tuple[Skipped, ...]
    """Items whose removal raised an error (e.g. permissions); the reason says which."""

    @property
    def freed_bytes(self) -> int:
        return sum(e.bytes for e in self.removed_entries) + sum(t.bytes for t in self.removed_temp_dirs)


@dataclass(frozen=True)
class RemovalPlan:
    """Entries and temporary directories to remove, and what was left alone and why.

    ``unused_since``: when set, an entry used (hit) after this time is spared at execution,
    because prune and ``older_than`` chose it for being unused.
    """

    store: LocalStore
    entries: tuple[EntryInfo, ...]
    temp_dirs: tuple[TempDir, ...]
    skipped: tuple[Skipped, ...] = ()
    unused_since: dict[str, float] = field(default_factory=dict)
    failure_records: tuple[str, ...] = ()
    """Keys whose recorded build failure (``locks/KEY.failed.json``) goes too."""

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries) + sum(t.bytes for t in self.temp_dirs)

    def __len__(self) -> int:
        return len(self.entries) + len(self.temp_dirs) + len(self.failure_records)

    def execute(self) -> RemovalReport:
        """Remove everything in the plan that is still safe to remove."""
        removed_entries: list[EntryInfo] = []
        removed_temps: list[TempDir] = []
        skipped = list(self.skipped)
        failed: list[Skipped] = []
        for temp in self.temp_dirs:
            outcome = _remove_temp_dir(self.store, temp)
            _sort(outcome, temp, removed_temps, skipped, failed)
        for entry in self.entries:
            outcome = _remove_entry(self.store, entry, self.unused_since.get(entry.key))
            _sort(outcome, entry, removed_entries, skipped, failed)
        for key in self.failure_records:
            try:
                self.store.forget_failure(key)
            except OSError as e:
                failed.append(Skipped(key, self.store.layout.failure_path(key), str(e)))
        return RemovalReport(tuple(removed_entries), tuple(removed_temps), tuple(skipped),
                             tuple(failed))


def plan_clear(store: LocalStore, keys: Optional[Iterable[str]] = None, *,
               older_than: Optional[float] = None, now: Optional[float] = None) -> RemovalPlan:
    """Plan removing entries (all, or ``keys`` / unique prefixes), optionally only those not
    used for ``older_than`` seconds, with their orphaned build directories, interrupted
    removals and (unless ``older_than``) recorded build failures. Live builds are listed as
    skipped.
    """
    found = scan(store)
    now = time.time() if now is None else now
    failures = store.failure_keys()
    wanted: Optional[set[str]] = None
    if keys is not None:
        known = [e.key for e in found.entries] + [t.key for t in found.temp_dirs] + failures
        wanted = set(resolve_keys(keys, known))

    def selected(key: str, used: float) -> bool:
        return (wanted is None or key in wanted) and (older_than is None or now - used >= older_than)

    entries = tuple(e for e in found.entries if selected(e.key, e.last_used))
    temps = [t for t in found.temp_dirs if selected(t.key, t.modified)]
    unused_since = {e.key: e.last_used for e in entries} if older_than is not None else {}
    records = () if older_than is not None else tuple(
        k for k in failures if wanted is None or k in wanted)
    return RemovalPlan(store, entries, tuple(t for t in temps if t.removable),
                       tuple(_skip_live(t) for t in temps if not t.removable), unused_since,
                       records)


def plan_prune(store: LocalStore, max_bytes: int) -> RemovalPlan:
    """Plan removing the least recently used entries until the cache holds <= ``max_bytes``.

    Orphaned build directories and interrupted removals go first (they are garbage); live
    builds are not counted and are listed as skipped.
    """
    found = scan(store)
    garbage = [t for t in found.temp_dirs if t.removable]
    total = sum(e.bytes for e in found.entries) + sum(t.bytes for t in garbage)
    temps: list[TempDir] = []
    for temp in garbage:
        if total <= max_bytes:
            break
        temps.append(temp)
        total -= temp.bytes
    entries: list[EntryInfo] = []
    for entry in sorted(found.entries, key=lambda e: (e.last_used, e.created, e.key)):
        if total <= max_bytes:
            break
        entries.append(entry)
        total -= entry.bytes
    live = tuple(_skip_live(t) for t in found.temp_dirs if not t.removable)
    return RemovalPlan(store, tuple(entries), tuple(temps), live,
                       {e.key: e.last_used for e in entries})


def _skip_live(temp: TempDir) -> Skipped:
    doing = "being built" if temp.state == BUILDING else "being removed"
    return Skipped(temp.key, temp.path, f"{doing} by {temp.owner}")


def _remove_entry(store: LocalStore, entry: EntryInfo, unused_since: Optional[float]):
    """Remove a published entry; a Skipped when it was spared or already gone."""
    try:
        if unused_since is not None and entry.path.stat().st_mtime > unused_since:
            return Skipped(entry.key, entry.path, "used since the plan was made")
        if not store.remove_entry(entry.key):
            return Skipped(entry.key, entry.path, "already removed by another process")
    except FileNotFoundError:
        return Skipped(entry.key, entry.path, "already removed by another process")
    except OSError as e:
        return e
    return None


def _remove_temp_dir(store: LocalStore, temp: TempDir):
    """Remove an orphaned build directory (judged dead again first) or an interrupted
    removal; a Skipped when it came alive, or is gone."""
    try:
        if temp.state != ORPHANED:
            store.remove_temp(temp.path.name, temp.key)
            return None
        now = temp_dir_info(store, temp.path)
        if now is None:
            return Skipped(temp.key, temp.path, "already removed by another process")
        if now.state != ORPHANED:
            return _skip_live(now)
        if not store.remove_temp(temp.path.name, temp.key):
            return Skipped(temp.key, temp.path, "already removed, or resumed, by another process")
    except OSError as e:
        return e
    return None


def _sort(outcome, item, removed: list, skipped: list[Skipped], failed: list[Skipped]) -> None:
    """File ``item`` by ``outcome``: None removed, a Skipped spared, an OSError failed."""
    if outcome is None:
        removed.append(item)
    elif isinstance(outcome, Skipped):
        skipped.append(outcome)
    else:
        failed.append(Skipped(item.key, item.path, str(outcome)))

