"""A call's way from a miss to a published entry (:func:`cachekit.obtain.flow.obtain` hands
it over when the lookup finds nothing): start the request's build (one that computes
nothing, its rows all committed, is built and committed at once, with no lock), wait for
the key's build lock and for the live builders it cannot see, joining their builds when it
may (:mod:`.local_wait`); with a remote tier download the key's entry or take its lease
(:mod:`.remote`); holding the lock with no live builder left, build and commit
(:mod:`.commit`). Only a miss imports this module and what it needs.
"""

from __future__ import annotations

import time

from .. import liveness
from ..errors import BuildGone
from ..messages import say
from ..store import LocalStore, Published, locks
from .accounting import OwnWork
from .build import Request
from .commit import build_and_commit, raise_failure_seen_while_waiting
from .local_wait import LocalWait
from .outcome import Options, Outcome
from .wait import Wait

_TAKEOVERS = 3
"""Times a call goes back to waiting after its own build was taken over."""


class Miss:
    """One call's way from a miss to a published entry: wait for the lock and the live
    builders (joining them), then, with a remote tier, download or take its lease, then
    build and commit; what the call spent on its own work counted in ``work``."""

    def __init__(self, store: LocalStore, request: Request, options: Options) -> None:
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
        if options.remote is None and self.build.computes_nothing():
            # Milliseconds of linking: nothing to wait for, or to join; another process
            # doing the same at once costs as little, and the first commit wins.
            return self._built(0.0)
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
        the lease, uploading afterwards). A build that replaces the key's entry never
        downloads it again (:attr:`~.build.Build.replaces`); one that heals it replaces
        the remote's copy of the stale entry, or downloads another host's healed entry
        (:attr:`~.build.Build.heals`)."""
        remote = self.options.remote
        if remote is None or (self.build.replaces and self.build.heals is None):
            return self._built(waited)
        from . import remote as remote_tier

        expected = self.request.expected
        got = remote_tier.download_or_lease(remote, self.store, self.key, wait=wait,
                                            expect=None if expected is None else
                                            expected.check, stale=self.build.heals)
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

    def _built(self, waited: float) -> Outcome:
        """Build and commit here, with no remote tier: "built" even when another builder's
        rename won the race, for this call did the work."""
        return self._outcome(build_and_commit(self.store, self.key, self.build, self.work),
                             "built", waited)

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
