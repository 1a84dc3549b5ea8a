"""Building an entry in a directory of this process's own and committing it.

The build happens in a private build directory (:class:`cachekit.store.BuildDir`) and is
published by the store's atomic commit, so if a broken lock lets two builders race, the
first rename wins and the other uses the winner's entry. Before building, the process
claims the dead builds of the key that its own user made with this cachekit version (the
build then copies their verified done chunks into a file of its own) and removes this
user's other dead ones; another user's build state is never resumed, copied or joined.

A build whose rows fail to decode leaves a failure record, so that the processes waiting
for it raise the same error instead of each decoding every row again; a full disk or quota
is said in words that name the entry and the fix.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Optional

import numpy as np

from .. import _fs, keys, processes
from .._version import __version__
from ..engine.filling.claimed import ChunkCallback
from ..engine.filling.journal import is_journal_name
from ..errors import BuildGone, Failure, ImageDecodeError
from ..messages import say
from ..store import FAILED, BuildDir, LocalStore, Published
from ..store.manifest import FAILURE_DETAILS, Manifest, failed_fields, parse_failed_mask
from .accounting import OwnWork
from .build import Build

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def build_and_commit(store: LocalStore, key: str, build: Build, work: OwnWork,
                     also_report: Optional[ChunkCallback] = None) -> Published:
    """Build ``key`` with ``build`` in a new build directory, resuming this user's dead
    builds of it, and commit it: the published entry (another builder's, if its commit won
    the race). Its seconds count as ``work``; ``also_report`` hears the progress too (a
    remote lease's heartbeat). BuildGone when another process took the directory over
    meanwhile."""
    started = time.monotonic()
    try:
        return _build_and_commit(store, key, build, work, also_report)
    finally:
        work.build_seconds += time.monotonic() - started


def _build_and_commit(store: LocalStore, key: str, build: Build, work: OwnWork,
                      also_report: Optional[ChunkCallback]) -> Published:
    try:
        current = store.begin(key)
    except OSError as e:
        if e.errno in _DISK_FULL:
            raise _disk_full(e, store, key) from e
        raise
    started = time.monotonic()
    try:
        claimed = _claim_dead_builds(store, current)
        if claimed:
            say(f"resuming the build of entry {key[:12]} from {claimed} dead build(s) of "
                "this user: their done chunks whose bytes match their checksums are "
                "copied, only the other chunks are filled")
        on_chunk = current.progress if also_report is None else _both(current.progress,
                                                                      also_report)
        building = time.monotonic()
        made = build.build(current, on_chunk)
        work.decoded(made.decode_seconds, time.monotonic() - building)
        current.drop_resumed()
        if not current.still_ours():
            raise BuildGone(str(current.path))
        files = store.seal(current, made.files, made.digests, made.durable)
        published_key = key if made.failure is None else keys.kept_key(key)
        if made.failure is not None:
            _remove_kept(store, key)  # its good rows were copied into this build
        manifest = Manifest(
            key=published_key, kind=made.kind, rows=made.rows, files=files,
            created=time.time(), failed_build=None if made.failure is None else key,
            **failed_fields(made.rows, made.failed_rows), params=made.params or {},
            column=made.column,
            structure=made.structure,
            builder={"host": _fs.host(), "pid": os.getpid(), **(made.builder or {})},
            build_seconds=round(time.monotonic() - started, 3), cachekit_version=__version__,
            reuse=made.reuse, origin=made.origin)
        published, won = store.commit(current, manifest, scratch=is_journal_name)
    except KeyboardInterrupt:
        current.abandon()  # keep the finished chunks for the next run
        raise
    except BaseException as e:
        taken_over = isinstance(e, Exception) and _taken_over(current)
        current.discard()  # (only while the directory is still ours)
        if taken_over and not isinstance(e, BuildGone):
            # Taken over while paused: whatever failed (a file of the build directory gone,
            # a row read from it) is the takeover's doing. Wait for the new owner's entry.
            raise BuildGone(str(current.path)) from e
        if isinstance(e, ImageDecodeError):
            _record_failure(store, key, e)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise _disk_full(e, store, key) from e
        raise
    if won:
        build.committed(published)
    if made.failure is not None:
        say(f"entry {key[:12]}: kept the {made.rows - len(made.failure.failures)} rows "
            f"that decoded (as {published_key[:12]}); a later build of these rows reuses "
            "them and decodes only the rest")
        _record_failure(store, key, made.failure)
        raise made.failure
    if won:
        store.forget_record(FAILED, key)  # an earlier failure is history now
        if made.reuse is not None:  # (only a per-row build keeps rows when it fails)
            _remove_kept(store, key)
        _say_who_joined(manifest)
    return published


def _both(first: ChunkCallback, second: ChunkCallback) -> ChunkCallback:
    def report(done: int, total: int) -> None:
        first(done, total)
        second(done, total)

    return report


def _remove_kept(store: LocalStore, key: str) -> None:
    """Remove the rows an earlier failed build of ``key`` kept, if any (best effort): the
    build now under way copied them."""
    try:
        store.remove_entry(keys.kept_key(key))
    except OSError:
        pass


def _taken_over(current: BuildDir) -> bool:
    """Whether another process took ``current`` over (False once it is closed: committed,
    abandoned or discarded, it was ours to the end)."""
    if current.dir.fd < 0:
        return False
    try:
        return not current.still_ours()
    except OSError:
        return False


def _say_who_joined(manifest: Manifest) -> None:
    """Say, once the builder committed, which processes joined its build and how many rows
    each computed, so that its output shows every row was computed once."""
    joined = manifest.builder.get("joined") or []
    if not joined:
        return
    theirs = sum(j["rows"] for j in joined)
    who = ", ".join(f"pid {j['pid']} on {j['host']} {j['rows']}" for j in joined)
    say(f"built entry {manifest.key[:12]} with {len(joined)} joining process"
        f"{'es' if len(joined) > 1 else ''}, which computed {theirs} of its {manifest.rows} "
        f"rows ({who}); this process made the other {manifest.rows - theirs}")


def raise_failure_seen_while_waiting(store: LocalStore, key: str, asked: float) -> None:
    """Re-raise a build failure recorded while this call waited (not before it asked, and
    never one dated in the future). A later call builds again: the files may be fixed. A
    record this user did not write (or, with signing on, one not validly signed) is
    ignored, and said once."""
    record, refused = store.read_record(FAILED, key)
    if refused is not None:
        say(f"ignored the failure record of entry {key[:12]}: {refused}; this process "
            "builds the entry itself", always=True)
        return
    try:
        failed_at, failures = record["time"], record["failures"]
        if not isinstance(failed_at, (int, float)) or not asked <= failed_at <= time.time():
            return
        rows = [(int(r), str(p), str(why)) for r, p, why in failures]
        total, cwd, fix = record.get("rows"), record.get("cwd"), record.get("fix")
        if record.get("failed_mask") is not None and isinstance(total, int):
            rows += _undetailed(rows, parse_failed_mask(record["failed_mask"], total, ValueError))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return
    raise ImageDecodeError(rows, total if isinstance(total, int) else None,
                           cwd if isinstance(cwd, str) else None,
                           fix if isinstance(fix, str) else None)  # the builder's hint


def _undetailed(detailed: list[Failure], mask: np.ndarray) -> list[Failure]:
    """The failures of a record's mask that it does not detail (only the first
    FAILURE_DETAILS are), each with no value and a reason that says so."""
    known = {row for row, _, _ in detailed}
    return [(int(row), "", f"failed in the build this process waited for (its first "
                           f"{FAILURE_DETAILS} failures are recorded with their reasons)")
            for row in np.flatnonzero(mask) if int(row) not in known]


def _record_failure(store: LocalStore, key: str, error: ImageDecodeError) -> None:
    """Tell the processes waiting for this build that it failed, and why, so that they
    raise the same error instead of each decoding every row again (K agents, one build).
    The record's size is bounded: the first failures detailed, every failed row a bit."""
    try:
        failed = failed_fields(error.rows, error.failures) if error.rows else {
            "failed_rows": error.failures[:FAILURE_DETAILS], "failed_mask": None}
        store.write_record(FAILED, key, {"time": time.time(), **processes.owner(),
                                         "failures": [list(f) for f in failed["failed_rows"]],
                                         "failed_mask": failed["failed_mask"],
                                         "rows": error.rows, "cwd": error.cwd,
                                         "fix": error.fix})
    except OSError:
        pass  # waiters then build again and fail the same way: slower, still correct


def _disk_full(error: OSError, store: LocalStore, key: str) -> OSError:
    """A full disk or quota, said in words that name the entry and the fix."""
    return OSError(error.errno, f"{error.strerror} while building cache entry {key} under "
                   f"{store.root}; nothing was published. Free space there, or point "
                   "CACHEKIT_DIR at a larger disk", error.filename)


def _claim_dead_builds(store: LocalStore, current: BuildDir) -> int:
    """Claim the dead builds of the key that this user made with this cachekit version
    for ``current`` to copy verified chunks from; remove this user's others. Another user's
    build state is never resumed, copied or joined: it is left for its owner (``cachekit
    clear`` removes it). Returns the number claimed."""
    claimed = 0
    for state in store.builds(current.key, besides=current.name):
        if state.alive or state.uid != os.geteuid():
            continue
        if state.same_version and store.claim_dead(current, state) is not None:
            claimed += 1
        else:
            store.remove_dead(state)
    return claimed
