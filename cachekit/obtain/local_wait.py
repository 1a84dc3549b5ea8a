"""Waiting on this host's side: for the key's build lock, then for the live builders the
lock cannot see, joining their builds meanwhile.

A process that misses takes the key's build lock (one builder per host, or per root where
locks work across hosts). Holding it, it also waits while another builder of the key is
alive by the heartbeat rule of :mod:`cachekit.liveness`: a builder on another host whose
lock this host cannot see. The lock only saves duplicate work (the store's atomic commit
keeps a race correct), so a lock whose holder shows no sign of life for a whole lease is
not waited for at all.

While it waits, a process given a join function (a per-row build, ``Cache(join=True)``)
joins a live build of the key made by its own user, on this host or another: it fills the
chunks nobody holds (see :func:`cachekit.engine.filling.joiner.join`), then goes on
waiting for the builder's commit, and says that it joined and how many chunks it filled.
Another user's build is never joined. A build of this host is joined only with the cores
it leaves free (its builder records its CPUs and workers; see
:mod:`cachekit.engine.filling.cores`): where the builder and the joiners before us use
every core, we only wait, at a waiter's pace, and say so.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Union

from .. import _fs, liveness
from ..engine.filling.cores import Spare, spare_cores
from ..engine.filling.joiner import Joined
from ..messages import say
from ..store import BuildState, LocalStore, Published, locks
from .lookup import find_entry
from .wait import POLL_SECONDS, WAITING, Awaited, Wait, Waiting

JOIN_POLL_SECONDS = 0.05
"""How often a process that may join looks for a build to join: a joiner that starts late
fills fewer chunks."""

FOREIGN_WAIT_LEASES = 10
"""How many leases a call waits at most, even with ``lock_timeout=None``, while everything
it waits for belongs to another user (a teammate's build, or what a group member planted):
then it builds in a directory of its own and publishes atomically (a duplicate build at
worst). Builds and lock holders of its own user are waited for as long as they beat."""

JoinFunction = Callable[[_fs.DirHandle, Optional[Spare]], Optional[Joined]]
"""Fills free chunks of another process's live build, given its directory by handle and,
for a build of this host, the cores we may add to it (None: a build of another host)."""


class LocalWait:
    """The local part of one call's ``wait``: the lock, then the live builders; ``locked``
    once this process holds ``lock`` (the caller releases it)."""

    def __init__(self, store: LocalStore, key: str, wait: Wait, lock: locks.BuildLock,
                 join: Optional[JoinFunction] = None) -> None:
        self.store, self.key, self.wait, self.lock, self.join = store, key, wait, lock, join
        self.poll = POLL_SECONDS if join is None else JOIN_POLL_SECONDS
        """Seconds between looks: a joiner's, until every build we could join has no core
        for us (then a waiter's)."""
        self.filled = self.rows_filled = 0
        self.join_seconds = 0.0  # spent filling chunks: working, not waiting
        self.said_no_core: set[str] = set()
        self.locked = False
        self.said_foreign_bound = False
        self.lease = liveness.lease_from_env()
        self.last_sign_of_life = time.monotonic()
        self.awaited = Awaited(str(lock.path), self._builder, lock.release_hint())

    def for_lock(self) -> Optional[Published]:
        """Acquire the lock; return early with the entry if its builder publishes meanwhile.

        A lock whose holder shows no sign of life for a whole lease (no heartbeat of its
        own, no live build of the key) blocks nobody forever: we then go on without it and
        build in a directory of our own, which the atomic commit makes safe (a duplicate
        build at worst, if that holder was in fact about to build)."""
        return self.wait.until(self._try_lock, self.awaited, lambda: self.poll)

    def _try_lock(self, seconds: float) -> Union[Optional[Published], Waiting]:
        if self.lock.acquire(timeout=seconds):
            self.locked = True
            return None
        found = find_entry(self.store, self.key)
        if found is not None:
            return found
        states = self.store.builds(self.key)
        self._join_live_builds(states)
        if self._past_foreign_bound(states):
            return None
        if self._holder_shows_no_life(states):
            say(f"the build lock of entry {self.key[:12]} has been held for "
                    f"{self.wait.seconds:.0f} s by a process that shows no heartbeat; this "
                    "process builds in a directory of its own and publishes atomically (if "
                    "that holder builds after all, the first to publish wins)")
            return None
        return WAITING

    def _holder_shows_no_life(self, states: list[BuildState]) -> bool:
        """Whether neither the lock's holder nor any build of the key (``states``) has shown
        a heartbeat for a lease, as this process saw on its own clock. Looked at once a
        lease has passed since the last sign of life: a heartbeat counts as alive for a
        lease after it beat, so one look then covers the whole lease."""
        now = time.monotonic()
        if now - self.last_sign_of_life <= self.lease:
            return False
        if self.lock.holder_alive() or any(s.alive for s in states):
            self.last_sign_of_life = now
            return False
        return True

    def _past_foreign_bound(self, states: list[BuildState]) -> bool:
        """Whether this call has waited FOREIGN_WAIT_LEASES leases and nothing it waits for
        belongs to this user: then it stops waiting (said once) and builds."""
        if self.wait.seconds <= FOREIGN_WAIT_LEASES * self.lease:
            return False
        holder_ours = (not self.locked and self.lock.holder_is_ours()
                       and self.lock.holder_alive())
        if holder_ours or any(
                s.alive and s.uid == os.geteuid() for s in states):
            return False
        if not self.said_foreign_bound:
            say(f"waited {self.wait.seconds:.0f} s ({FOREIGN_WAIT_LEASES} leases) for "
                f"{describe_builder(states)} to build entry {self.key[:12]}, a build of "
                "another user; this process builds in a directory of its own and publishes "
                "atomically (the first to publish wins)")
        self.said_foreign_bound = True
        return True

    def for_live_builders(self) -> Optional[Published]:
        """Holding the lock, wait while a builder of the key is alive (on another host, or
        with ``CACHEKIT_LOCK=none``); the entry if one publishes it, else None."""
        return self.wait.until(self._look_at_builders, self.awaited, lambda: self.poll)

    def _look_at_builders(self, seconds: float) -> Union[Optional[Published], Waiting]:
        found = find_entry(self.store, self.key)
        if found is not None:
            return found
        states = self.store.builds(self.key)
        if not any(state.alive for state in states) or self._past_foreign_bound(states):
            # A commit renames its build into entries/: one that lands between our two
            # looks leaves no build and an entry, which we then use rather than rebuild.
            return find_entry(self.store, self.key)
        if not self._join_live_builds(states):
            time.sleep(seconds)  # after a join, look at once: we may have filled the last chunk
        return WAITING

    def _join_live_builds(self, states: list[BuildState]) -> int:
        """Fill free chunks of each live build of the key (of ``states``) that this user
        owns; the chunks filled. A build on another host of a shared root counts as well as
        one here."""
        if self.join is None:
            return 0
        filled = 0
        joinable = may_help = False
        for state in states:
            if not (state.alive and state.uid == os.geteuid() and state.same_version):
                continue
            joinable = True
            spare = None  # a build of another host: we bring cores of our own
            if state.on_this_host:
                recorded = state.cpus
                if recorded is None:
                    may_help = True
                    continue  # its builder has not yet said which CPUs it uses
                spare = spare_cores(*recorded)
                if not spare.count:
                    self._say_no_core(state, "the build already uses every core here")
                    continue
            try:
                directory = self.store.open_build_dir(state)
            except OSError:
                continue  # gone meanwhile, or not a directory we may follow
            started = time.monotonic()
            with directory:
                joined = self.join(directory, spare)
            if joined is not None and joined.no_core:
                self._say_no_core(state, "the build and the processes joining it already use "
                                  "every core here")
                continue
            may_help = True
            if joined is None or not joined.chunks:
                continue
            self.join_seconds += time.monotonic() - started
            filled += joined.chunks
            self.filled += joined.chunks
            self.rows_filled += joined.rows
            self.wait.joined_seconds, self.wait.rows_joined = self.join_seconds, self.rows_filled
            say(f"joined the build of entry {self.key[:12]} by {state.describe()}: "
                f"filled {joined.chunks} of its {joined.total_chunks} chunks "
                f"({joined.rows} rows)")
        self.poll = JOIN_POLL_SECONDS if may_help or not joinable else POLL_SECONDS
        return filled

    def _say_no_core(self, state: BuildState, why: str) -> None:
        """Say once per build that we wait for it instead of joining it, and why."""
        if str(state.path) not in self.said_no_core:
            say(f"waits for the build of entry {self.key[:12]} by {state.describe()} "
                f"without joining it: {why}")
        self.said_no_core.add(str(state.path))

    def source(self, found: Published) -> str:
        """The source of an entry another process published while we waited: "joined" when
        we filled chunks of it (and say so), else "local"."""
        if not self.filled:
            return "local"
        builder = found.manifest.builder
        say(f"entry {self.key[:12]} published by pid {builder.get('pid')} on "
            f"{builder.get('host')}; this process filled {self.filled} chunks "
            f"({self.rows_filled} of {found.manifest.rows} rows)")
        return "joined"

    def _builder(self) -> str:
        return describe_builder(self.store.builds(self.key))


def describe_builder(states: list[BuildState]) -> str:
    """Who is building and how far it got: the live build with the newest heartbeat."""
    live = [s for s in states if s.alive]
    if not live:
        return "another process"
    return max(live, key=lambda s: s.heartbeat).describe()
