"""Get a published entry, building it first if needed: wait, build or resume, commit.

This module only coordinates; where bytes live is the store's business
(:mod:`cachekit.store.local`). Correctness never depends on the lock, which only saves
duplicate work: a build happens in a private directory and is published by the store's
atomic commit, so if a broken lock lets two builders race, the first rename wins and the
other uses the winner's entry. Readers of published entries never take a lock.

A process that misses takes the key's build lock (one builder per host, or per root where
locks work across hosts). Holding it, it also waits while another builder of the key is
alive by the heartbeat rule of :mod:`cachekit.liveness`: a builder on another host whose
lock this host cannot see. When no live builder is left, it claims the dead builds of
the key that its own user made with this cachekit version (the build then copies their
verified done chunks into a file of its own) and removes this user's other dead ones; another
user's build state is never resumed, copied or joined.

While it waits, a process given a join function (a per-row build, ``Cache(join=True)``)
joins a live build of the key made by its own user, on this host or another: it fills the
chunks nobody holds (see :func:`cachekit.engine.join`), then goes on waiting for the
builder's commit, and says that it joined and how many chunks it filled.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from .. import _fs, liveness
from .. import engine as build
from ..store import locks
from .._version import __version__
from ..errors import CacheCorruptError, ImageDecodeError, LockTimeout
from .expected import Expected
from ..engine.journal import is_journal_name
from ..errors import BuildGone
from ..store.manifest import MANIFEST_FILE, Manifest
from ..store import BuildDir, BuildState, LocalStore, Published

if TYPE_CHECKING:
    from . import remote as remote_tier

POLL_SECONDS = 0.25
JOIN_POLL_SECONDS = 0.05
"""How often a process that may join looks for a build to join: a joiner that starts late
fills fewer chunks."""
WAIT_REPORT_SECONDS = 10.0
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TAKEOVERS = 3
"""Times a call goes back to waiting after its own build was taken over."""

ChunkCallback = build.ChunkCallback


@dataclass(frozen=True)
class Built:
    """What a build function made in its directory, for the manifest."""

    kind: str
    rows: int
    files: tuple[tuple[str, str], ...]
    """(file name, leaf kind) of each data file, in order: ``(("data.npy", "numpy"),)``."""
    failed_rows: tuple = ()
    params: Optional[dict[str, Any]] = None
    column: Optional[str] = None
    structure: Optional[dict[str, Any]] = None
    builder: Optional[dict[str, Any]] = None
    """More about what built it, for the manifest's ``builder``: e.g. decoder versions."""


BuildFunction = Callable[[BuildDir, ChunkCallback], Built]
"""Fills the build's directory, reporting (rows done, rows total) after each chunk."""
JoinFunction = Callable[[_fs.DirHandle], Optional[build.Joined]]
"""Fills free chunks of another process's live build, given its directory by handle."""
Opened = TypeVar("Opened")


@dataclass(frozen=True)
class Outcome:
    """A published entry, and how this call came by it (``Entry.source``)."""

    entry: Published
    source: str
    wait_seconds: float = 0.0


def obtain(store: LocalStore, key: str, build_fn: BuildFunction, *,
           lock_timeout: Optional[float], announce: bool = True,
           join: Optional[JoinFunction] = None,
           remote: Optional["remote_tier.Tier"] = None,
           expect: Optional[Expected] = None) -> Outcome:
    """Return the entry for ``key``, building it with ``build_fn`` if no process has yet.

    With ``join``, fill chunks of a live build of the key while waiting for it. With
    ``remote``, a local miss looks the key up there before building, and a build is
    uploaded after its local commit (:mod:`cachekit.obtain.remote`); a local hit never
    touches the remote. A remote entry that disagrees with ``expect`` is refused before
    its download (a miss); the local entry returned is checked by :func:`obtain_and_open`.

    A build of ours that another process took over (we were paused past the lease, and it
    claimed our directory) stops writing at once: we then wait for, or join, the build that
    took it over, as any waiter does, and return its entry."""
    for attempt in range(_TAKEOVERS):
        try:
            return _obtain_once(store, key, build_fn, lock_timeout=lock_timeout,
                                announce=announce, join=join, remote=remote, expect=expect)
        except BuildGone:
            if attempt == _TAKEOVERS - 1:
                raise
            if announce:
                print(f"cachekit: pid {os.getpid()}'s build of entry {key[:12]} was taken over "
                      "by another process while this one was paused past the lease "
                      f"({liveness.lease_from_env():g} s); it wrote nothing more and now "
                      "waits for that build's entry", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _obtain_once(store: LocalStore, key: str, build_fn: BuildFunction, *,
                 lock_timeout: Optional[float], announce: bool,
                 join: Optional[JoinFunction],
                 remote: Optional["remote_tier.Tier"],
                 expect: Optional[Expected]) -> Outcome:
    asked = time.time()
    found = store.lookup(key)
    if found is not None:
        return Outcome(found, "local")
    store.ensure_writable(key)
    build_lock = locks.make_lock(store.layout.lock_path(key))
    waiting = _Wait(store, key, lock_timeout, announce, build_lock, join)
    found = waiting.for_lock()
    try:
        if found is None:
            found = waiting.for_live_builders()
        if found is not None:
            return Outcome(found, waiting.published(found), waiting.seconds)
        _raise_failure_seen_while_waiting(store, key, asked)
        waited = waiting.seconds  # before the build: waiting, not building
        if remote is not None:
            from . import remote as remote_tier

            published, source = remote_tier.obtain(
                remote, store, key, build_fn,
                lambda fn: _build_and_commit(store, key, fn, announce),
                remaining=waiting._remaining(), announce=announce,
                expect=None if expect is None else expect.check)
            return Outcome(published, source, waited)
        # "built" even when another builder's rename won the race: this call did the work.
        return Outcome(_build_and_commit(store, key, build_fn, announce), "built", waited)
    finally:
        if waiting.locked:
            build_lock.release()


def obtain_and_open(store: LocalStore, key: str, build_fn: BuildFunction,
                    open_entry: Callable[[Outcome], Opened], *,
                    expect: Optional[Expected] = None, **options: Any
                    ) -> tuple[Outcome, Opened]:
    """:func:`obtain`, the entry checked against the call's ``expect``, then
    ``open_entry(outcome)``.

    Every entry is checked, whatever its source. One that disagrees (a manifest of another
    dtype, shape or row count, written by another process, user or host) is removed, with
    a note on stderr, and obtained again, once: built, unless another process published a
    good entry meanwhile. A second mismatch is CacheCorruptError.

    ``cachekit clear`` may remove the entry between reading its manifest and opening its
    data; that is not corruption, so obtain it again (a rebuild) instead of raising.
    """
    removed = False
    for attempt in range(3):
        outcome = obtain(store, key, build_fn, expect=expect, **options)
        problem = None if expect is None else expect.check(outcome.entry.manifest)
        if problem is not None and not removed:
            _remove_mismatch(store, outcome.entry, problem)
            removed = True
            outcome = obtain(store, key, build_fn, expect=expect, **options)
            problem = expect.check(outcome.entry.manifest) if expect is not None else None
        if problem is not None:
            raise CacheCorruptError(outcome.entry.path / MANIFEST_FILE, "the entry does not "
                                    f"match the call, again after it was removed: {problem}",
                                    "see who writes under the cache root")
        try:
            return outcome, open_entry(outcome)
        except (CacheCorruptError, FileNotFoundError):
            if attempt == 2 or store.still_published(outcome.entry):
                raise
    raise AssertionError("unreachable")


def _remove_mismatch(store: LocalStore, entry: Published, problem: str) -> None:
    """Remove ``entry``, which disagrees with the call as ``problem`` says, unless another
    process replaced it meanwhile, and say so (always, as for an entry refused for its
    signature); CacheCorruptError when this process cannot remove it."""
    try:
        removed = store.still_published(entry) and store.remove_entry(entry.manifest.key)
    except OSError as e:
        raise CacheCorruptError(entry.path / MANIFEST_FILE,
                                f"the entry does not match the call: {problem}") from e
    if removed:
        print(f"cachekit: removed entry {entry.manifest.key[:12]}: it does not match the "
              f"call ({problem}); obtaining it again", file=sys.stderr, flush=True)


class _Wait:
    """Waiting for the build lock, then for live builders the lock cannot see, within one
    ``lock_timeout``, saying every so often whom we wait for."""

    def __init__(self, store: LocalStore, key: str, timeout: Optional[float], announce: bool,
                 lock: locks.BuildLock, join: Optional[JoinFunction] = None) -> None:
        self.store, self.key, self.timeout, self.announce, self.lock = (
            store, key, timeout, announce, lock)
        self.join = join
        self.poll = POLL_SECONDS if join is None else JOIN_POLL_SECONDS
        self.filled = self.rows_filled = 0
        self.started = time.monotonic()
        self.next_report = self.started + POLL_SECONDS * 4
        self.locked = False
        self.lease = liveness.lease_from_env()
        self.last_sign_of_life = self.started

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def for_lock(self) -> Optional[Published]:
        """Acquire the lock; return early with the entry if its builder publishes meanwhile.

        A lock whose holder shows no sign of life for a whole lease (no heartbeat of its
        own, no live build of the key) blocks nobody forever: we then go on without it and
        build in a directory of our own, which the atomic commit makes safe (a duplicate
        build at worst, if that holder was in fact about to build)."""
        while True:
            remaining = self._remaining()
            slice_ = self.poll if remaining is None else max(0.0, min(self.poll, remaining))
            if self.lock.acquire(timeout=slice_):
                self.locked = True
                return None
            found = self.store.lookup(self.key)
            if found is not None:
                return found
            self._join_live_builds()
            if self._holder_shows_no_life():
                if self.announce:
                    print(f"cachekit: the build lock of entry {self.key[:12]} has been held for "
                          f"{self.seconds:.0f} s by a process that shows no heartbeat; "
                          f"pid {os.getpid()} builds in a directory of its own and publishes "
                          "atomically (if that holder builds after all, the first to publish "
                          "wins)", file=sys.stderr, flush=True)
                return None
            self._tick(remaining)

    def _holder_shows_no_life(self) -> bool:
        """Whether neither the lock's holder nor any build of the key has shown a heartbeat
        for a lease, as this process saw on its own clock."""
        now = time.monotonic()
        if self.lock.holder_alive() or any(s.alive for s in self.store.builds(self.key)):
            self.last_sign_of_life = now
        return now - self.last_sign_of_life > self.lease

    def for_live_builders(self) -> Optional[Published]:
        """Holding the lock, wait while a builder of the key is alive (on another host, or
        with ``CACHEKIT_LOCK=none``); the entry if one publishes it, else None."""
        while True:
            found = self.store.lookup(self.key)
            if found is not None:
                return found
            if not any(state.alive for state in self.store.builds(self.key)):
                return None
            if self._join_live_builds():
                continue  # look for the entry at once: we may have filled the last chunk
            remaining = self._remaining()
            time.sleep(self.poll if remaining is None else max(0.0, min(self.poll, remaining)))
            self._tick(remaining)

    def _join_live_builds(self) -> int:
        """Fill free chunks of each live build of the key that this user owns; the chunks
        filled. A build on another host of a shared root counts as well as one here."""
        if self.join is None:
            return 0
        filled = 0
        for state in self.store.builds(self.key):
            if not (state.alive and state.uid == os.geteuid() and state.same_version):
                continue
            try:
                directory = self.store.open_build_dir(state)
            except OSError:
                continue  # gone meanwhile, or not a directory we may follow
            with directory:
                joined = self.join(directory)
            if joined is None or not joined.chunks:
                continue
            filled += joined.chunks
            self.filled += joined.chunks
            self.rows_filled += joined.rows
            if self.announce:
                print(f"cachekit: joined the build of entry {self.key[:12]} by "
                      f"{state.describe()}: filled {joined.chunks} of its "
                      f"{joined.total_chunks} chunks ({joined.rows} rows)", file=sys.stderr,
                      flush=True)
        return filled

    def published(self, found: Published) -> str:
        """The source of an entry another process published while we waited: "joined" when
        we filled chunks of it (and say so), else "local"."""
        if not self.filled:
            return "local"
        builder = found.manifest.builder
        if self.announce:
            print(f"cachekit: entry {self.key[:12]} published by pid {builder.get('pid')} on "
                  f"{builder.get('host')}; this process filled {self.filled} chunks "
                  f"({self.rows_filled} of {found.manifest.rows} rows)", file=sys.stderr,
                  flush=True)
        return "joined"

    def _remaining(self) -> Optional[float]:
        return None if self.timeout is None else self.timeout - self.seconds

    def _tick(self, remaining: Optional[float]) -> None:
        if remaining is not None and remaining <= POLL_SECONDS:
            raise LockTimeout(self.lock.path, self.timeout, self._builder(),
                              self.lock.release_hint())
        if self.announce and time.monotonic() >= self.next_report:
            print(f"cachekit: waited {self.seconds:.0f} s for {self._builder()} "
                  f"to build entry {self.key[:12]}", file=sys.stderr, flush=True)
            self.next_report = time.monotonic() + WAIT_REPORT_SECONDS

    def _builder(self) -> str:
        return describe_builder(self.store.builds(self.key))


def describe_builder(states: list[BuildState]) -> str:
    """Who is building and how far it got: the live build with the newest heartbeat."""
    live = [s for s in states if s.alive]
    if not live:
        return "another process"
    return max(live, key=lambda s: s.heartbeat).describe()


def _raise_failure_seen_while_waiting(store: LocalStore, key: str, asked: float) -> None:
    """Re-raise a build failure recorded while this call waited (not before it asked, and
    never one dated in the future). A later call builds again: the files may be fixed."""
    record = store.read_failure(key)
    try:
        failed_at, failures = record["time"], record["failures"]
        if not isinstance(failed_at, (int, float)) or not asked <= failed_at <= time.time():
            return
        rows = [(int(r), str(p), str(why)) for r, p, why in failures]
    except (ValueError, KeyError, TypeError, IndexError):
        return
    raise ImageDecodeError(rows)


def _record_failure(store: LocalStore, key: str, error: ImageDecodeError) -> None:
    """Tell the processes waiting for this build that it failed, and why, so that they
    raise the same error instead of each decoding every row again (K agents, one build)."""
    try:
        store.record_failure(key, {"time": time.time(), **_fs.owner(),
                                   "failures": [list(f) for f in error.failures]})
    except OSError:
        pass  # waiters then build again and fail the same way: slower, still correct


def _build_and_commit(store: LocalStore, key: str, build_fn: BuildFunction,
                      announce: bool) -> Published:
    try:
        current = store.begin(key)
    except OSError as e:
        if e.errno in _DISK_FULL:
            raise _disk_full(e, store, key) from e
        raise
    started = time.monotonic()
    try:
        claimed = _claim_dead_builds(store, current)
        if claimed and announce:
            print(f"cachekit: resuming the build of entry {key[:12]} from {claimed} dead "
                  "build(s) of this user: their done chunks whose bytes match their "
                  "checksums are copied, only the other chunks are filled", file=sys.stderr,
                  flush=True)
        made = build_fn(current, current.progress)
        current.drop_resumed()
        if not current.still_ours():
            raise BuildGone(str(current.path))
        files = store.seal(current, made.files)
        manifest = Manifest(
            key=key, kind=made.kind, rows=made.rows, files=files, created=time.time(),
            failed_rows=tuple(made.failed_rows), params=made.params or {}, column=made.column,
            structure=made.structure,
            builder={"host": _fs.host(), "pid": os.getpid(), **(made.builder or {})},
            build_seconds=round(time.monotonic() - started, 3), cachekit_version=__version__)
        published, won = store.commit(current, manifest, scratch=is_journal_name)
    except KeyboardInterrupt:
        current.abandon()  # keep the finished chunks for the next run
        raise
    except BaseException as e:
        current.discard()
        if isinstance(e, ImageDecodeError):
            _record_failure(store, key, e)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise _disk_full(e, store, key) from e
        raise
    if won:
        store.forget_failure(key)  # an earlier failure is history now
    return published


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
    for state in store.builds(current.key):
        if state.alive or state.path == current.path or state.uid != os.geteuid():
            continue
        if state.same_version and store.claim_dead(current, state) is not None:
            claimed += 1
        else:
            store.remove_dead(state)
    return claimed
