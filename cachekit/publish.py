"""Get a published entry, building it first if needed: lock, re-check, build, publish.

Correctness never depends on the lock, which only saves duplicate work. An entry is built
in a private directory, its data fsynced, its manifest written last, and the directory
renamed into ``entries/`` in one atomic step; a published entry is complete by construction.
If a broken lock lets two builders race, the first rename wins and the loser discards its
copy and uses the winner's. Readers of published entries never take a lock.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import filelock

from . import _fs, store
from ._version import __version__
from .errors import LockTimeout, ReadOnlyCacheError

JOURNAL_FILE = "journal.json"
POLL_SECONDS = 0.25
WAIT_REPORT_SECONDS = 10.0

ChunkCallback = Callable[[int, int], None]
BuildFunction = Callable[[Path, ChunkCallback], "dict[str, Any]"]
"""Builds into the given directory, reporting (rows done, rows total); returns manifest fields."""


@dataclass(frozen=True)
class Outcome:
    """A published entry's directory and manifest, and how this call came by it."""

    entry_dir: Path
    manifest: dict[str, Any]
    hit: bool
    wait_seconds: float = 0.0


def find(layout: store.Layout, key: str) -> Optional[Outcome]:
    """The published entry for ``key``, or None. Takes no lock; records the use."""
    entry_dir = layout.entry_dir(key)
    try:
        manifest = store.read_manifest(entry_dir)
    except FileNotFoundError:
        return None
    mark_used(entry_dir)
    return Outcome(entry_dir, manifest, hit=True)


def mark_used(entry_dir: Path) -> None:
    """Record a use as the entry directory's mtime (`cachekit prune` removes the least
    recently used first): one syscall, no lock, the immutable entry is not rewritten."""
    try:
        os.utime(entry_dir)
    except OSError:
        pass  # a read-only or foreign-owned cache root must still serve hits


def obtain(
    layout: store.Layout,
    key: str,
    build: BuildFunction,
    *,
    lock_timeout: Optional[float],
    announce: bool = True,
) -> Outcome:
    """Return the entry for ``key``, building it with ``build`` if no process has yet."""
    found = find(layout, key)
    if found is not None:
        return found
    _ensure_writable(layout, key)
    lock = filelock.FileLock(str(layout.lock_path(key)))
    started = time.monotonic()
    found = _wait_for_lock(layout, key, lock, lock_timeout, announce)
    waited = time.monotonic() - started
    if found is not None:
        return Outcome(found.entry_dir, found.manifest, hit=True, wait_seconds=waited)
    try:
        found = find(layout, key)  # another process may have published while we waited
        if found is not None:
            return Outcome(found.entry_dir, found.manifest, hit=True, wait_seconds=waited)
        return _build_and_publish(layout, key, build, waited)
    finally:
        lock.release()


def _ensure_writable(layout: store.Layout, key: str) -> None:
    try:
        for directory in (layout.entries, layout.tmp, layout.locks):
            directory.mkdir(parents=True, exist_ok=True)
        if not os.access(layout.locks, os.W_OK) or not os.access(layout.tmp, os.W_OK):
            raise PermissionError
    except PermissionError:
        raise ReadOnlyCacheError(layout.root, key) from None
    except OSError as e:
        if e.errno == 30:  # EROFS: a read-only mount
            raise ReadOnlyCacheError(layout.root, key) from None
        raise


def _wait_for_lock(layout, key, lock, lock_timeout, announce) -> Optional[Outcome]:
    """Acquire ``lock``; return early with the entry if its builder publishes meanwhile."""
    started = time.monotonic()
    next_report = started + POLL_SECONDS * 4
    while True:
        remaining = None if lock_timeout is None else lock_timeout - (time.monotonic() - started)
        try:
            lock.acquire(timeout=POLL_SECONDS if remaining is None else max(0.0, min(POLL_SECONDS, remaining)))
            return None
        except filelock.Timeout:
            pass
        found = find(layout, key)
        if found is not None:
            return found
        if remaining is not None and remaining <= POLL_SECONDS:
            raise LockTimeout(layout.lock_path(key), lock_timeout, describe_builder(layout, key))
        if announce and time.monotonic() >= next_report:
            waited = time.monotonic() - started
            print(
                f"cachekit: waited {waited:.0f} s for {describe_builder(layout, key)} "
                f"to build entry {key[:12]}",
                file=sys.stderr,
                flush=True,
            )
            next_report = time.monotonic() + WAIT_REPORT_SECONDS


def describe_builder(layout: store.Layout, key: str) -> str:
    """Who is building ``key`` and how far it got, from the newest build journal."""
    journals = []
    for build_dir in layout.build_dirs(key):
        try:
            with open(build_dir / JOURNAL_FILE, encoding="utf-8") as f:
                journals.append(json.load(f))
        except (OSError, ValueError):
            continue
    journals = [j for j in journals if isinstance(j, dict)]
    if not journals:
        return "another process"
    j = max(journals, key=lambda j: j.get("updated", 0))
    done, total = j.get("done", 0), j.get("total", 0)
    share = f", {100 * done / total:.0f}%" if total else ""
    return f"pid {j.get('pid')} on {j.get('host')} ({done}/{total} rows{share})"


def _build_and_publish(layout, key, build, waited) -> Outcome:
    build_dir = layout.new_build_dir(key)
    journal = {"key": key, "host": _fs.host(), "pid": os.getpid(), "started": time.time()}

    def on_chunk(done: int, total: int) -> None:
        journal.update(done=done, total=total, updated=time.time())
        _fs.write_json_atomic(build_dir / JOURNAL_FILE, journal, durable=False)

    started = time.monotonic()
    try:
        on_chunk(0, 0)
        fields = build(build_dir, on_chunk)
        _fs.remove_file(build_dir / JOURNAL_FILE)
        for path in build_dir.iterdir():
            _fs.fsync_file(path)
        manifest = {
            **fields,
            "format": store.FORMAT_VERSION,
            "key": key,
            "created": time.time(),
            "build_seconds": round(time.monotonic() - started, 3),
            "builder": {"host": _fs.host(), "pid": os.getpid()},
            "cachekit_version": __version__,
            "checksum": store.checksum(build_dir / store.DATA_FILE),
        }
        _fs.write_json_atomic(build_dir / store.MANIFEST_FILE, manifest)  # last file written
        _fs.fsync_dir(build_dir)
        entry_dir = layout.entry_dir(key)
        if not _fs.rename_dir_no_replace(build_dir, entry_dir):
            _fs.remove_tree(build_dir)  # another builder won the race: use its entry
            winner = find(layout, key)
            if winner is None:
                raise FileNotFoundError(f"entry {key} vanished after another builder published it")
            return Outcome(winner.entry_dir, winner.manifest, hit=False, wait_seconds=waited)
        _fs.fsync_dir(layout.entries)
    except BaseException:
        _fs.remove_tree(build_dir)
        raise
    return Outcome(entry_dir, manifest, hit=False, wait_seconds=waited)
