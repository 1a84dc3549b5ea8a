"""Is that builder still working? The one rule that the coordinator, resume, ``ls``, ``clear``
and ``prune`` (and the soft lock) all ask, and the one heartbeat timer (:class:`Heartbeat`)
that every builder, chunk claim, lock holder and remote lease beats with.

A builder refreshes a heartbeat, the mtime of a file it holds open, from a timer thread
every lease / 4 seconds, whatever its progress: a build whose rows take longer than the
lease, or a ``memoize`` build that reports no progress at all, keeps beating. A builder is

- dead when it said it gave up (an interrupted build marks itself abandoned), when it is a
  gone process on this host (its pid is gone or was reused), when it is this very process
  but none of its heartbeats beats for that directory, when its heartbeat is older than
  the lease, or when its heartbeat is dated in the future by more than the clock skew
  allowance (lease / 4): a date in 2100 planted by a group member, or a clock that far
  ahead, is a fault, never a builder that stays alive for good;
- alive otherwise.

The lease is ``$CACHEKIT_LOCK_LEASE`` seconds (default 60). Hosts that share a cache root
must have clocks that agree to well within the lease (NTP does): a heartbeat is an mtime
written by one host and read against another host's clock.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from . import processes, units

LEASE_ENV = "CACHEKIT_LOCK_LEASE"
DEFAULT_LEASE_SECONDS = 60.0
BEATS_PER_LEASE = 4
SKEW_FRACTION = 1 / BEATS_PER_LEASE
"""How far in the future (as a fraction of the lease) a heartbeat may be dated and still
count: the clocks of hosts that share a root agree to well within it."""


def lease_from_env() -> float:
    """Seconds without a heartbeat after which a builder counts as dead ($CACHEKIT_LOCK_LEASE)."""
    return units.seconds_from_env(LEASE_ENV, DEFAULT_LEASE_SECONDS)


_BEATING_HERE: set[str] = set()
"""The directories this process's heartbeats are beating for, right now."""


def is_alive(owner: Optional[Mapping[str, Any]], heartbeat: float, *,
             abandoned: bool = False, where: Optional[Path] = None,
             lease: Optional[float] = None, now: Optional[float] = None) -> bool:
    """Whether the builder ``owner`` (a record made by :func:`cachekit.processes.owner`, or None
    when unknown) of the directory ``where``, whose heartbeat was last refreshed at
    ``heartbeat`` (seconds since the epoch), may still be working."""
    if abandoned:
        return False
    if owner is not None:
        state = processes.owner_state(owner)
        if state == "dead":
            return False
        if (where is not None and state == "alive" and owner.get("pid") == os.getpid()
                and str(where) not in _BEATING_HERE):
            return False  # ours, and no thread of ours is building there
    lease = lease_from_env() if lease is None else lease
    age = (time.time() if now is None else now) - heartbeat
    return -lease * SKEW_FRACTION <= age <= lease


def touch(fd: int) -> Callable[[], None]:
    """A beat that sets the mtime of the open file ``fd`` to now: a builder's, a claim's or
    a lock's heartbeat. The file is never opened by path, so a file swapped in under the
    same name is never touched."""
    def beat() -> None:
        try:
            os.utime(fd)
        except OSError:
            pass  # a transient error; the next beat comes well within the lease

    return beat


class Heartbeat:
    """Call ``beat()`` at once and then every lease / 4 seconds from a timer thread, until
    stopped: whatever the build's progress, so a build whose rows take longer than the
    lease still beats.

    ``beat`` is what one beat does: :func:`touch` of a file the caller holds open, or a
    rewrite of a remote lease's heartbeat object. It must not raise (a failed beat is
    simply missed; the next comes well within the lease). ``where``: the directory it beats
    for, which this process then counts as one of its own live builds. The heartbeats of a
    process share one timer thread (starting one is an entry in a table, not a thread),
    except one whose beat ``may_block`` (a request over the network), which gets its own,
    so that it never holds up another's beat.
    """

    def __init__(self, beat: Callable[[], None], lease: Optional[float] = None,
                 where: Optional[Path] = None, *, may_block: bool = False) -> None:
        self.beat = beat
        self.lease = lease_from_env() if lease is None else lease
        self.interval = self.lease / BEATS_PER_LEASE
        self.where = None if where is None else str(where)
        self.may_block = may_block
        self._stop = threading.Event()
        self._beating = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def start(self, *, at_once: bool = True) -> "Heartbeat":
        """Beat now (unless not ``at_once``: the first beat then comes an interval later)
        and on the timer from then on."""
        if self.where is not None:
            _BEATING_HERE.add(self.where)
        if at_once:
            self.beat_now()
        if self.may_block:
            self._thread = threading.Thread(target=self._run, name="cachekit-heartbeat",
                                            daemon=True)
            self._thread.start()
        else:
            _timer.add(self)
        return self

    def beat_now(self) -> None:
        """One beat, never at the same time as another of this heartbeat."""
        with self._beating:
            self.beat()

    def retarget(self, beat: Callable[[], None]) -> None:
        """Beat with ``beat`` from now on, at once and then on the timer: once this returns,
        no beat of the old kind runs or comes (a builder moves its heartbeat to its
        directory before its heartbeat file goes: see
        :meth:`cachekit.store.build_dirs.BuildDir.beat_on_directory`). A stopped heartbeat
        stays stopped."""
        with self._beating:
            self.beat = beat
        if not self._stop.is_set():
            self.beat_now()

    def stop(self) -> None:
        """Stop beating: no beat comes after this returns (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        else:
            _timer.remove(self)
        if self.where is not None:
            _BEATING_HERE.discard(self.where)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat_now()


class _Timer:
    """The thread that beats every heartbeat of the process whose beat cannot block, each
    on its own interval; made by the first one started."""

    IDLE_SECONDS = 3600.0

    def __init__(self) -> None:
        self._due: dict[Heartbeat, float] = {}
        self._changed = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._wakes_at = math.inf
        """When the thread wakes next (monotonic): a heartbeat due later wakes no one."""

    def add(self, heartbeat: Heartbeat) -> None:
        with self._changed:
            due = self._due[heartbeat] = time.monotonic() + heartbeat.interval
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cachekit-heartbeats",
                                                daemon=True)
                self._thread.start()
            if due < self._wakes_at:  # (each hold adds one: most are due after the next)
                self._changed.notify()

    def remove(self, heartbeat: Heartbeat) -> None:
        """Forget ``heartbeat``: once this returns, it never beats again (the beats run
        holding the same lock)."""
        with self._changed:
            self._due.pop(heartbeat, None)

    def _run(self) -> None:
        with self._changed:
            while True:
                self._wakes_at = self._beat_due(time.monotonic())
                self._changed.wait(max(0.0, self._wakes_at - time.monotonic()))

    def _beat_due(self, now: float) -> float:
        """Beat each heartbeat due at ``now``; when the next one is due. A heartbeat that
        a beat stopped (on this thread: a collection during a beat finalizes an Entry,
        whose hold record stops beating) is neither beaten nor scheduled again."""
        for heartbeat, due in list(self._due.items()):
            if due <= now and heartbeat in self._due:
                heartbeat.beat_now()
                if heartbeat in self._due:
                    self._due[heartbeat] = now + heartbeat.interval
        return min(self._due.values(), default=now + self.IDLE_SECONDS)


def _new_timer() -> None:
    """A forked child has no timer thread (and may hold a copy of a taken lock): it makes
    its own timer when it starts a heartbeat."""
    global _timer
    _timer = _Timer()


_timer = _Timer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_timer)
