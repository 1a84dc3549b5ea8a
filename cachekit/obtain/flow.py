"""Get a published entry for a request, building it first if needed.

A hit reads top to bottom: :func:`obtain` looks the key up (:mod:`.lookup`), checks the
manifest against the request, and returns; nothing a build needs is made. A miss goes to
:class:`_Miss`, which starts the request's build, waits for the key's build lock and for
the live builders it cannot see, joining their builds when it may (:mod:`.local_wait`);
with a remote tier it then downloads the key's entry or takes its lease
(:mod:`.remote`); holding the lock with no live builder left, it builds and commits,
resuming this user's dead builds of the key (:mod:`.commit`), and with a lease hands
what it built to the upload. The whole wait is bounded by one ``lock_timeout``
(:mod:`.wait`). The caller opens the entry.

This module only coordinates; where bytes live is the store's business
(:mod:`cachekit.store.local`). Correctness never depends on the lock, which only saves
duplicate work: a build happens in a private directory and is published by the store's
atomic commit, so if a broken lock lets two builders race, the first rename wins and the
other uses the winner's entry. Readers of published entries never take a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .. import liveness
from ..errors import BuildGone, CacheCorruptError
from ..messages import say
from ..store import LocalStore, Published, locks
from ..store.manifest import MANIFEST_FILE
from . import background
from .accounting import OwnWork
from .build import Request
from .commit import build_and_commit, raise_failure_seen_while_waiting
from .local_wait import LocalWait
from .lookup import find_entry
from .wait import Wait

if TYPE_CHECKING:
    from . import remote as remote_tier

_TAKEOVERS = 3
"""Times a call goes back to waiting after its own build was taken over."""


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


def obtain(store: LocalStore, request: Request, *, lock_timeout: Optional[float],
           join: bool = True,
           remote: Optional["remote_tier.Tier"] = None) -> Outcome:
    """The entry of ``request.key``, checked against ``request.expected``; built with the
    request's build (:meth:`Request.start`, on a miss only) if no process has yet.

    With ``join``, fill chunks of a live build of the key while waiting for it. With
    ``remote``, a local miss looks the key up there before building, and a build is
    uploaded in the background after its local commit (:mod:`cachekit.obtain.remote`); a
    local hit never touches the remote (it only warns of this process's background uploads
    to it that failed). A remote entry that disagrees with the request is refused before
    its download (a miss).

    Every entry is checked, whatever its source. One that disagrees (a manifest of another
    dtype, shape or row count, written by another process, user or host) is removed, with
    a note on stderr, and obtained again, once: built, unless another process published a
    good entry meanwhile. A second mismatch is CacheCorruptError."""
    options = _Options(lock_timeout, join, remote)
    outcome = _get(store, request, options)
    problem = _problem(request, outcome)
    if problem is None:
        return outcome
    _remove_mismatch(store, outcome.entry, problem)
    outcome = _get(store, request, options)
    problem = _problem(request, outcome)
    if problem is not None:
        raise CacheCorruptError(outcome.entry.path / MANIFEST_FILE, "the entry does not "
                                f"match the call, again after it was removed: {problem}",
                                "see who writes under the cache root")
    return outcome


@dataclass(frozen=True)
class _Options:
    lock_timeout: Optional[float]
    join: bool
    remote: Optional["remote_tier.Tier"]


def _problem(request: Request, outcome: Outcome) -> Optional[str]:
    expected = request.expected
    return None if expected is None else expected.check(outcome.entry.manifest)


def _get(store: LocalStore, request: Request, options: _Options) -> Outcome:
    """A hit, or on a miss what :class:`_Miss` comes by."""
    if options.remote is not None:
        background.warn_failed(options.remote.store)
    found = find_entry(store, request.key)
    if found is not None:
        return Outcome(found, "local")
    return _Miss(store, request, options).obtain()


class _Miss:
    """One call's way from a miss to a published entry: wait for the lock and the live
    builders (joining them), then, with a remote tier, download or take its lease, then
    build and commit; what the call spent on its own work counted in ``work``."""

    def __init__(self, store: LocalStore, request: Request, options: _Options) -> None:
        self.store, self.request, self.options = store, request, options
        self.key = request.key
        self.build = request.start()
        self.work = OwnWork()  # a build taken over was work of this process all the same

    def obtain(self) -> Outcome:
        """The entry. A build of ours that another process took over (we were paused past
        the lease, and it claimed our directory) stops writing at once: we then wait for,
        or join, the build that took it over, as any waiter does, and return its entry."""
        for attempt in range(_TAKEOVERS):
            try:
                return self._once()
            except BuildGone:
                if attempt == _TAKEOVERS - 1:
                    raise
                say(f"this process's build of entry {self.key[:12]} was taken over by "
                    "another process while this one was paused past the lease "
                    f"({liveness.lease_from_env():g} s); it wrote nothing more and now "
                    "waits for that build's entry")
        raise AssertionError("unreachable")

    def _once(self) -> Outcome:
        store, key, options = self.store, self.key, self.options
        asked = time.time()
        store.ensure_writable(key)
        build_lock = locks.make_lock(store.layout.lock_path(key))
        wait = Wait(key, options.lock_timeout)
        join = self.build.join if options.join and self.build.joinable else None
        local = LocalWait(store, key, wait, build_lock, join)
        found = local.for_lock()
        try:
            if found is None:
                found = local.for_live_builders()
            self.work.joined(local.join_seconds)
            if found is not None:
                return self._outcome(found, local.source(found), wait.seconds,
                                     local.rows_filled, waited_for_build=True)
            if self.request.raise_failures:
                raise_failure_seen_while_waiting(store, key, asked)
            waited = wait.seconds  # before the build: waiting, not building
            return self._download_or_build(wait, waited)
        finally:
            if local.locked:
                build_lock.release()

    def _download_or_build(self, wait: Wait, waited: float) -> Outcome:
        """Holding the lock with no live local builder left: with a remote tier, its entry
        or its lease (:func:`remote_tier.download_or_lease`); then build and commit (under
        the lease, uploading afterwards)."""
        remote = self.options.remote
        if remote is None:
            # "built" even when another builder's rename won the race: this call did the work.
            return self._outcome(build_and_commit(self.store, self.key, self.build, self.work),
                                 "built", waited)
        from . import remote as remote_tier

        expected = self.request.expected
        got = remote_tier.download_or_lease(remote, self.store, self.key, wait=wait,
                                            expect=None if expected is None else
                                            expected.check)
        if isinstance(got, Published):
            return self._outcome(got, "remote", waited)
        lease = got
        try:
            published = build_and_commit(self.store, self.key, self.build, self.work,
                                         None if lease is None else lease.progress)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None:
            remote_tier.share(remote, self.store, published, lease)
        return self._outcome(published, "built", waited)

    def _outcome(self, entry: Published, source: str, waited: float, rows_filled: int = 0,
                 waited_for_build: bool = False) -> Outcome:
        """The outcome of a call that waited ``waited`` seconds in all (joins included) and
        computed ``rows_filled`` rows of another process's build."""
        work = self.work
        return Outcome(entry, source, work.waited(waited),
                       build_seconds=round(work.build_seconds, 3),
                       decode_seconds=round(work.decode_seconds, 3), rows_filled=rows_filled,
                       join_seconds=round(work.joined_seconds, 3),
                       waited_for_build=waited_for_build)


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
            f"({problem}); obtaining it again", always=True)


