"""Waiting for another process's build of a key within the call's ``lock_timeout``.

A call that misses may wait twice: for the key's local build lock and the live builders
it cannot see (:mod:`cachekit.obtain.local_wait`), then, with a remote tier, for another
host's lease on the key (:mod:`cachekit.obtain.remote`). Both are the same loop, here: look
(try the lock, look for the entry, take the lease), else wait one poll; give up with
LockTimeout, naming the holder and how to get past it, once the deadline is reached; and
say every ``WAIT_REPORT_SECONDS`` whom we wait for, so that a user whose job seems stuck
sees why. One :class:`Wait` spans the whole call, so the deadline and the reports carry
over from the local wait to the remote one: ``lock_timeout`` bounds the call's wait in all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

from ..errors import LockTimeout
from ..messages import say

POLL_SECONDS = 0.25
"""How often a waiter that does not join looks again."""
FIRST_REPORT_SECONDS = 1.0
"""When a waiter first says whom it waits for: a wait shorter than this goes unsaid."""
WAIT_REPORT_SECONDS = 10.0
"""How often it says so again."""

T = TypeVar("T")


class Waiting:
    """The type of :data:`WAITING`."""

    def __repr__(self) -> str:
        return "WAITING"


WAITING = Waiting()
"""What a step of :meth:`Wait.until` returns when it found nothing: wait on."""


@dataclass(frozen=True)
class Awaited:
    """Whom a wait is for: ``where``, the lock or lease a LockTimeout names; ``describe()``,
    the holder and how far it got (``pid 4242 on node7 (2048/10000 rows, 20%)``), asked
    afresh each time it is said; ``hint``, how to get past a stuck holder; ``note``, said
    after each report (`` (remote s3://bucket/prefix)``)."""

    where: str
    describe: Callable[[], str]
    hint: str = ""
    note: str = ""


class Wait:
    """One call's wait for the build of ``key``: at most ``timeout`` seconds from its
    creation (None: for good)."""

    def __init__(self, key: str, timeout: Optional[float]) -> None:
        self.key, self.timeout = key, timeout
        self.started = time.monotonic()
        self.next_report = self.started + FIRST_REPORT_SECONDS
        self.joined_seconds = 0.0
        """Of :attr:`seconds`, those spent computing rows of the build waited for."""
        self.rows_joined = 0
        """The rows computed for it meanwhile."""

    @property
    def seconds(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.started

    def remaining(self) -> Optional[float]:
        """Seconds left before the deadline (negative once past it); None: no deadline."""
        return None if self.timeout is None else self.timeout - self.seconds

    def until(self, step: Callable[[float], Union[T, Waiting]], awaited: Awaited,
              poll: Union[float, Callable[[], float]] = POLL_SECONDS) -> T:
        """What ``step`` returns first that is not :data:`WAITING`.

        ``step(seconds)`` looks once and, finding nothing, waits up to ``seconds`` (at most
        ``poll``, never past the deadline; it may wait less, e.g. after doing useful work)
        and returns WAITING. ``poll`` may be a function, asked before each step (a step
        may learn that looking often no longer pays). After the step that ran up to the
        deadline, LockTimeout naming ``awaited``; until then, a report naming it every
        WAIT_REPORT_SECONDS."""
        while True:
            every = poll() if callable(poll) else poll
            remaining = self.remaining()
            result = step(every if remaining is None else max(0.0, min(every, remaining)))
            if not isinstance(result, Waiting):
                return result
            if remaining is not None and remaining <= every:
                raise LockTimeout(awaited.where, self.timeout, awaited.describe(),
                                  awaited.hint)
            self.report(awaited)

    def report(self, awaited: Awaited) -> None:
        """Say whom we wait for, if a report is due."""
        if time.monotonic() >= self.next_report:
            waited = max(0.0, self.seconds - self.joined_seconds)
            worked = (f" (and computed {self.rows_joined} of its rows in "
                      f"{self.joined_seconds:.0f} s)" if self.rows_joined else "")
            say(f"waited {waited:.0f} s for {awaited.describe()} to build entry "
                f"{self.key[:12]}{worked}{awaited.note}")
            self.next_report = time.monotonic() + WAIT_REPORT_SECONDS
