"""Get a published entry, building it first if needed: wait, build or resume, commit.

This module only coordinates; where bytes live is the store's business
(:mod:`cachekit.store.local`). Correctness never depends on the lock, which only saves
duplicate work: a build happens in a private directory and is published by the store's
atomic commit (:mod:`cachekit.obtain.commit`), so if a broken lock lets two builders race,
the first rename wins and the other uses the winner's entry. Readers of published entries
never take a lock.

A call that misses waits for the key's build lock and for the live builders it cannot see,
joining their builds when it may (:mod:`cachekit.obtain.local_wait`); with a remote tier it
then looks the key up remotely or waits for another host's lease
(:mod:`cachekit.obtain.remote`); the whole wait is bounded by one ``lock_timeout``
(:mod:`cachekit.obtain.wait`). Holding the lock with no live builder left, it builds,
resuming this user's dead builds of the key. Every entry it returns is checked against
what the call expects (:mod:`cachekit.obtain.expected`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from .. import liveness
from ..errors import BuildGone, CacheCorruptError
from ..messages import say
from ..store import LocalStore, Published, locks
from ..store.manifest import MANIFEST_FILE
from . import background
from .accounting import OwnWork
from .commit import BuildFunction, build_and_commit, raise_failure_seen_while_waiting
from .expected import Expected
from .local_wait import JoinFunction, LocalWait
from .wait import Wait

if TYPE_CHECKING:
    from . import remote as remote_tier

_TAKEOVERS = 3
"""Times a call goes back to waiting after its own build was taken over."""
Opened = TypeVar("Opened")


@dataclass(frozen=True)
class Outcome:
    """A published entry, and how this call came by it (``Entry.source``)."""

    entry: Published
    source: str
    wait_seconds: float = 0.0
    """Seconds spent waiting for another process's build, not counting those spent
    filling chunks of it."""
    build_seconds: float = 0.0
    """Seconds this process spent building the entry: its own build, and the chunks it
    filled of another's (0 when it built nothing)."""
    decode_seconds: float = 0.0
    """The part of ``build_seconds`` spent computing rows here."""
    rows_filled: int = 0
    """Rows this call computed for another process's build that it joined."""
    join_seconds: float = 0.0
    """Of ``build_seconds``, those spent computing rows of another process's build."""
    waited_for_build: bool = False
    """Whether the entry was published by another process while this call waited."""

    @property
    def word(self) -> str:
        """What this process did, in one word (``Entry.outcome``): "hit" (found it),
        "waited" (for another process's build), "joined" (computed rows of that build),
        "built", or "pulled" (downloaded it from the remote tier)."""
        return outcome_word(self.source, self.waited_for_build)

    @property
    def row_counts(self) -> tuple[int, int, int]:
        """(rows decoded by this call, rows other processes decoded for its build, rows
        copied from other entries): ``Entry.rows_decoded``, ``rows_joined``, ``rows_reused``.

        A builder's come from its manifest's origin (a build that resumed dead builds counts
        their rows as joined: other processes decoded them); a joiner decoded the rows it
        filled, and everyone else decoded or copied the rest, counted as joined. They add up
        to the entry's rows, and are all 0 on a hit."""
        manifest = self.entry.manifest
        if self.source == "built":
            origin = manifest.origin
            if origin is None or not origin.adds_up(manifest.rows):
                return manifest.rows, 0, 0  # no origin (memoize), or one that is not ours
            return origin.decoded, origin.joined, origin.rows_reused
        if self.source == "joined":
            decoded = min(self.rows_filled, manifest.rows)
            return decoded, manifest.rows - decoded, 0
        return 0, 0, 0


def outcome_word(source: str, waited_for_build: bool = False) -> str:
    """What a call whose entry came from ``source`` did, in one word (``Entry.outcome``)."""
    if source == "local":
        return "waited" if waited_for_build else "hit"
    return {"remote": "pulled"}.get(source, source)


def obtain(store: LocalStore, key: str, build_fn: BuildFunction, *,
           lock_timeout: Optional[float], announce: bool = True,
           join: Optional[JoinFunction] = None,
           remote: Optional["remote_tier.Tier"] = None,
           expect: Optional[Expected] = None, raise_failures: bool = True) -> Outcome:
    """Return the entry for ``key``, building it with ``build_fn`` if no process has yet.

    With ``join``, fill chunks of a live build of the key while waiting for it. With
    ``remote``, a local miss looks the key up there before building, and a build is
    uploaded in the background after its local commit (:mod:`cachekit.obtain.remote`); a
    local hit never touches the remote (it only warns of this process's background uploads
    to it that failed). A remote entry that disagrees with ``expect`` is refused before
    its download (a miss); the local entry returned is checked by :func:`obtain_and_open`.
    ``raise_failures``: whether a failure of the build this call waited for, recorded by
    this user, is raised here (False for builds that store failed rows as zeros, which
    never record one).

    A build of ours that another process took over (we were paused past the lease, and it
    claimed our directory) stops writing at once: we then wait for, or join, the build that
    took it over, as any waiter does, and return its entry."""
    work = OwnWork()  # a build taken over was work of this process all the same
    for attempt in range(_TAKEOVERS):
        try:
            return _obtain_once(store, key, build_fn, lock_timeout=lock_timeout,
                                announce=announce, join=join, remote=remote, expect=expect,
                                work=work, raise_failures=raise_failures)
        except BuildGone:
            if attempt == _TAKEOVERS - 1:
                raise
            if announce:
                say(f"this process's build of entry {key[:12]} was taken over by another "
                    "process while this one was paused past the lease "
                    f"({liveness.lease_from_env():g} s); it wrote nothing more and now "
                    "waits for that build's entry")
    raise AssertionError("unreachable")


def _obtain_once(store: LocalStore, key: str, build_fn: BuildFunction, *,
                 lock_timeout: Optional[float], announce: bool,
                 join: Optional[JoinFunction],
                 remote: Optional["remote_tier.Tier"],
                 expect: Optional[Expected], work: OwnWork,
                 raise_failures: bool) -> Outcome:
    asked = time.time()
    if remote is not None:
        background.warn_failed(remote.store)
    found = store.lookup(key)
    if found is not None:
        return _outcome(found, "local", 0.0, work)
    store.ensure_writable(key)
    build_lock = locks.make_lock(store.layout.lock_path(key))
    wait = Wait(key, lock_timeout, announce)
    local = LocalWait(store, key, wait, build_lock, join)
    found = local.for_lock()
    try:
        if found is None:
            found = local.for_live_builders()
        work.joined(local.join_seconds)
        if found is not None:
            return _outcome(found, local.source(found), wait.seconds, work, local.rows_filled,
                            waited_for_build=True)
        if raise_failures:
            raise_failure_seen_while_waiting(store, key, asked)
        waited = wait.seconds  # before the build: waiting, not building
        commit = work.timed(lambda fn: build_and_commit(store, key, fn, announce))
        if remote is not None:
            from . import remote as remote_tier

            published, source = remote_tier.obtain(
                remote, store, key, build_fn, commit, wait=wait,
                expect=None if expect is None else expect.check)
            return _outcome(published, source, waited, work)
        # "built" even when another builder's rename won the race: this call did the work.
        return _outcome(commit(build_fn), "built", waited, work)
    finally:
        if local.locked:
            build_lock.release()


def _outcome(entry: Published, source: str, waited: float, work: OwnWork,
             rows_filled: int = 0, waited_for_build: bool = False) -> Outcome:
    """The outcome of a call that waited ``waited`` seconds in all (joins included) and
    computed ``rows_filled`` rows of another process's build."""
    return Outcome(entry, source, work.waited(waited), build_seconds=round(work.build_seconds, 3),
                   decode_seconds=round(work.decode_seconds, 3), rows_filled=rows_filled,
                   join_seconds=round(work.joined_seconds, 3),
                   waited_for_build=waited_for_build)


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
        say(f"removed entry {entry.manifest.key[:12]}: it does not match the call "
            f"({problem}); obtaining it again")


