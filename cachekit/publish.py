"""Get a published entry, building it first if needed: lock, re-check, build, publish.

Correctness never depends on the lock, which only saves duplicate work. An entry is built
in a private directory, its data fsynced, its manifest written last, and the directory
renamed into ``entries/`` in one atomic step; a published entry is complete by construction.
If a broken lock lets two builders race, the first rename wins and the loser discards its
copy and uses the winner's. Readers of published entries never take a lock.

A build killed part way leaves its directory in ``tmp/`` with a journal (key, cachekit
version, owner, progress) and the fill's checkpoint. The next builder of the key claims a
dead builder's directory by renaming it to its own name (so two resumers never share one)
and continues from the checkpoint. A builder is dead when it is a gone process on this
host, or, for one on another host, when we hold a lock that works (``os`` or ``soft``).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from . import _fs, build, locks, store
from ._version import __version__
from .errors import CacheCorruptError, ImageDecodeError, LockTimeout, ReadOnlyCacheError

JOURNAL_FILE = "journal.json"
POLL_SECONDS = 0.25
WAIT_REPORT_SECONDS = 10.0
_JOURNAL_LIMIT = 1 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

ChunkCallback = build.ChunkCallback
BuildFunction = Callable[[Path, ChunkCallback], "dict[str, Any]"]
"""Builds into the given directory, reporting (rows done, rows total); returns manifest fields."""
Opened = TypeVar("Opened")


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
        if entry_dir.is_dir():  # published entries always hold their manifest
            raise CacheCorruptError(entry_dir / store.MANIFEST_FILE, "the manifest is missing"
                                    ) from None
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
    lock: Optional[str] = None,
) -> Outcome:
    """Return the entry for ``key``, building it with ``build`` if no process has yet.

    ``lock``: "os", "soft" or "none" (see :mod:`cachekit.locks`); None reads $CACHEKIT_LOCK.
    """
    asked = time.time()
    found = find(layout, key)
    if found is not None:
        return found
    build_lock = locks.make_lock(layout.lock_path(key), lock)
    _ensure_writable(layout, key)
    started = time.monotonic()
    found = _wait_for_lock(layout, key, build_lock, lock_timeout, announce)
    waited = time.monotonic() - started
    if found is not None:
        return Outcome(found.entry_dir, found.manifest, hit=True, wait_seconds=waited)
    try:
        found = find(layout, key)  # another process may have published while we waited
        if found is not None:
            return Outcome(found.entry_dir, found.manifest, hit=True, wait_seconds=waited)
        _raise_failure_seen_while_waiting(layout, key, asked)
        return _build_and_publish(layout, key, build, waited, build_lock.exclusive, announce)
    finally:
        build_lock.release()


def _failure_path(layout: store.Layout, key: str) -> Path:
    return layout.locks / f"{layout.entry_dir(key).name}.failed.json"


def _record_failure(layout: store.Layout, key: str, error: ImageDecodeError) -> None:
    """Tell the processes waiting for this build that it failed, and why, so that they
    raise the same error instead of each decoding every row again (K agents, one build)."""
    try:
        _fs.write_json_atomic(_failure_path(layout, key), {
            "time": time.time(), **_fs.owner(), "failures": [list(f) for f in error.failures],
        }, durable=False)
    except OSError:
        pass  # waiters then build again and fail the same way: slower, still correct


def _raise_failure_seen_while_waiting(layout: store.Layout, key: str, asked: float) -> None:
    """Re-raise a build failure recorded after this call asked for the entry. A later call
    builds again: the files may have been fixed in the meantime."""
    try:
        with _fs.open_regular(_failure_path(layout, key)) as f:
            record = json.loads(f.read(_JOURNAL_LIMIT * 64))
        failed_at, failures = record["time"], record["failures"]
        if not _is_number(failed_at) or failed_at < asked:
            return
        rows = [(int(r), str(p), str(why)) for r, p, why in failures]
    except (OSError, ValueError, KeyError, TypeError):
        return
    raise ImageDecodeError(rows)


def obtain_and_open(layout: store.Layout, key: str, build: BuildFunction,
                    open_entry: Callable[[Outcome], Opened], **options: Any) -> Opened:
    """:func:`obtain`, then ``open_entry(outcome)``.

    ``cachekit clear`` may remove the entry between reading its manifest and opening its
    data; that is not corruption, so obtain it again (a rebuild) instead of raising.
    """
    for attempt in range(3):
        outcome = obtain(layout, key, build, **options)
        try:
            return open_entry(outcome)
        except (CacheCorruptError, FileNotFoundError):
            if attempt == 2 or _still_published(outcome):
                raise
    raise AssertionError("unreachable")


def _still_published(outcome: Outcome) -> bool:
    try:
        return store.read_manifest(outcome.entry_dir) == outcome.manifest
    except (OSError, ValueError):
        return False


def _ensure_writable(layout: store.Layout, key: str) -> None:
    try:
        for directory in (layout.entries, layout.tmp, layout.locks):
            directory.mkdir(parents=True, exist_ok=True)
        if not os.access(layout.locks, os.W_OK) or not os.access(layout.tmp, os.W_OK):
            raise PermissionError
    except PermissionError:
        raise ReadOnlyCacheError(layout.root, key) from None
    except OSError as e:
        if e.errno == errno.EROFS:
            raise ReadOnlyCacheError(layout.root, key) from None
        raise


def _wait_for_lock(layout, key, lock, lock_timeout, announce) -> Optional[Outcome]:
    """Acquire ``lock``; return early with the entry if its builder publishes meanwhile."""
    started = time.monotonic()
    next_report = started + POLL_SECONDS * 4
    while True:
        remaining = None if lock_timeout is None else lock_timeout - (time.monotonic() - started)
        slice_ = POLL_SECONDS if remaining is None else max(0.0, min(POLL_SECONDS, remaining))
        if lock.acquire(timeout=slice_):
            return None
        found = find(layout, key)
        if found is not None:
            return found
        if remaining is not None and remaining <= POLL_SECONDS:
            raise LockTimeout(lock.path, lock_timeout, describe_builder(layout, key))
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
    journals = [j for j in (read_journal(d) for d in layout.build_dirs(key)) if j is not None]
    if not journals:
        return "another process"
    j = max(journals, key=lambda j: j.get("updated", 0) if _is_number(j.get("updated")) else 0)
    done, total = j.get("done", 0), j.get("total", 0)
    if _is_number(done) and _is_number(total) and total:
        progress = f"{done}/{total} rows, {100 * done / total:.0f}%"
    else:
        progress = "starting"
    return f"pid {j.get('pid')} on {j.get('host')} ({progress})"


def read_journal(build_dir: Path) -> Optional[dict[str, Any]]:
    """The journal of a build directory (owner, key, progress), or None when unreadable."""
    try:
        with _fs.open_regular(build_dir / JOURNAL_FILE) as f:
            journal = json.loads(f.read(_JOURNAL_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    return journal if isinstance(journal, dict) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _build_and_publish(layout, key, build_fn, waited, exclusive, announce) -> Outcome:
    claimed = _claim_dead_build(layout, key, exclusive)
    build_dir, resumed_from = claimed if claimed is not None else (layout.new_build_dir(key), 0)
    if resumed_from and announce:
        print(f"cachekit: resuming the build of entry {key[:12]} from row {resumed_from}, "
              "where a builder that died stopped", file=sys.stderr, flush=True)
    journal = {"key": key, "format": store.FORMAT_VERSION, "cachekit_version": __version__,
               **_fs.owner(), "started": time.time(), "resumed_from": resumed_from}

    def on_chunk(done: int, total: int) -> None:
        journal.update(done=done, total=total, updated=time.time())
        _fs.write_json_atomic(build_dir / JOURNAL_FILE, journal, durable=False)

    started = time.monotonic()
    try:
        on_chunk(resumed_from, 0)
        fields = build_fn(build_dir, on_chunk)
        for path in _published_files(build_dir):
            _fs.fsync_file(path)
        data_checksum = store.checksum(build_dir / store.DATA_FILE)
        manifest = {
            **fields,
            "format": store.FORMAT_VERSION,
            "key": key,
            "created": time.time(),
            "build_seconds": round(time.monotonic() - started, 3),
            "builder": {"host": _fs.host(), "pid": os.getpid()},
            "cachekit_version": __version__,
            "checksum": data_checksum,
        }
        _fs.write_json_atomic(build_dir / store.MANIFEST_FILE, manifest)  # last file written
        _remove_build_state(build_dir)  # from here to the rename, a crash means starting over
        _fs.fsync_dir(build_dir)
        entry_dir = layout.entry_dir(key)
        if not _fs.rename_dir_no_replace(build_dir, entry_dir):
            _fs.remove_tree(build_dir)  # another builder won the race: use its entry
            winner = find(layout, key)
            if winner is None:
                raise FileNotFoundError(f"entry {key} vanished after another builder published it")
            return Outcome(winner.entry_dir, winner.manifest, hit=False, wait_seconds=waited)
    except KeyboardInterrupt:
        _abandon(build_dir, journal)  # keep the finished chunks for the next run
        raise
    except BaseException as e:
        _fs.remove_tree(build_dir)
        if isinstance(e, ImageDecodeError):
            _record_failure(layout, key, e)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise OSError(e.errno, f"{e.strerror} while building cache entry {key} under "
                          f"{layout.root}; nothing was published. Free space there, or point "
                          "CACHEKIT_DIR at a larger disk", e.filename) from e
        raise
    try:
        _fs.fsync_dir(layout.entries)  # makes the rename durable; it is already visible
        _fs.remove_file(_failure_path(layout, key))  # an earlier failure is history now
    except OSError:
        pass  # the entry is complete either way; a power cut may only cost a rebuild
    return Outcome(entry_dir, manifest, hit=False, wait_seconds=waited)


def _is_build_state(name: str) -> bool:
    """Files of a build in progress that are never published."""
    return (name == JOURNAL_FILE or name.endswith(build.CHECKPOINT_SUFFIX)
            or (name.startswith(".") and name.endswith(".tmp")))


def _published_files(build_dir: Path) -> list[Path]:
    return [p for p in build_dir.iterdir() if not _is_build_state(p.name)]


def _remove_build_state(build_dir: Path) -> None:
    for path in build_dir.iterdir():
        if _is_build_state(path.name):
            _fs.remove_file(path)


def _abandon(build_dir: Path, journal: dict[str, Any]) -> None:
    """Mark an interrupted build as free for any later builder to resume (best effort)."""
    try:
        _fs.write_json_atomic(build_dir / JOURNAL_FILE, {**journal, "abandoned": True},
                              durable=False)
    except OSError:
        _fs.remove_tree(build_dir)


def _claim_dead_build(layout: store.Layout, key: str,
                      exclusive: bool) -> Optional[tuple[Path, int]]:
    """Take over the most advanced resumable directory a dead builder of ``key`` left.

    Returns (our directory, rows done) or None. Dead builders' directories that cannot be
    resumed are removed. Each directory is claimed by renaming it to a name of our own, so
    when two processes try at once exactly one gets it.
    """
    candidates: list[tuple[int, Path]] = []
    for build_dir in layout.build_dirs(key):
        if not _fs.is_plain_dir(build_dir):
            continue  # not ours to touch (remove_tree would unlink a symlink, nothing more)
        journal = read_journal(build_dir)
        if not _builder_gone(build_dir, journal, key, exclusive):
            continue
        checkpoint = build.read_checkpoint(build_dir / store.DATA_FILE)
        if journal is not None and _same_build(journal, key) and checkpoint is not None:
            candidates.append((checkpoint.done, build_dir))
            continue
        mine = _claim(layout, key, build_dir)
        if mine is not None:
            _fs.remove_tree(mine)
    resumed: Optional[tuple[Path, int]] = None
    for done, build_dir in sorted(candidates, key=lambda c: c[0], reverse=True):
        mine = _claim(layout, key, build_dir)
        if mine is None:
            continue  # another process claimed it first
        checkpoint = build.read_checkpoint(mine / store.DATA_FILE)  # re-read: it is ours now
        if resumed is not None or checkpoint is None:
            _fs.remove_tree(mine)  # less advanced than the one we resume: of no more use
            continue
        _remove_build_state_except_checkpoints(mine)
        resumed = mine, checkpoint.done
    return resumed


def _claim(layout: store.Layout, key: str, build_dir: Path) -> Optional[Path]:
    mine = layout.tmp / f"{key}.{_fs.unique_suffix()}"
    try:
        os.rename(build_dir, mine)
    except FileNotFoundError:
        return None
    return mine


def _remove_build_state_except_checkpoints(build_dir: Path) -> None:
    for path in build_dir.iterdir():
        if _is_build_state(path.name) and not path.name.endswith(build.CHECKPOINT_SUFFIX):
            _fs.remove_file(path)


def _same_build(journal: dict[str, Any], key: str) -> bool:
    """The journal is of this key, written by this cachekit version and entry format."""
    return (journal.get("key") == key and journal.get("cachekit_version") == __version__
            and journal.get("format") == store.FORMAT_VERSION)


def _silent_for_a_lease(build_dir: Path, journal: Optional[dict[str, Any]]) -> bool:
    """No progress recorded in ``build_dir`` for longer than the lock lease."""
    updated = (journal or {}).get("updated")
    if not _is_number(updated):
        try:
            updated = build_dir.stat().st_mtime
        except OSError:
            return False
    return time.time() - updated > locks.lease_from_env()


def _builder_gone(build_dir: Path, journal: Optional[dict[str, Any]], key: str,
                  exclusive: bool) -> bool:
    """Whether the process that made ``build_dir`` can no longer be writing to it."""
    if journal is not None and journal.get("abandoned") is True:
        return True
    owner = journal
    if owner is None:  # no readable journal: the directory's name still says whose it is
        name_key, host, pid = store.parse_build_dir_name(build_dir.name)
        owner = {"host": host, "pid": pid} if name_key == key and pid is not None else None
    state = _fs.owner_state(owner) if owner is not None else "unknown"
    if state == "unknown":
        # On another host: we hold a lock that should exclude its builder, but a lock can
        # fail silently on network filesystems, so also ask for a lease of silence.
        return exclusive and _silent_for_a_lease(build_dir, owner)
    if state == "alive" and owner is not None and owner.get("pid") == os.getpid():
        return exclusive  # our own process: under the lock, no thread of ours builds it
    return state == "dead"
