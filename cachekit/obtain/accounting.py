"""What one call spent on its entry itself, as against waiting for another process.

A sweep sums these over its agents, so each process counts only its own work: the seconds
it built (its own build, from the build directory's creation to the commit, and the chunks
it filled of another process's build while it waited for it), and the part of those it
spent computing rows. Whatever else the call took, from its first look to the entry, was
waiting (or, with a remote tier, downloading).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..store import BuildDir, Published
from .commit import BuildFunction, Built, ChunkCallback


class OwnWork:
    """Seconds one call spent building (``build_seconds``), of which ``decode_seconds``
    computing rows, and of which ``joined_seconds`` filling another process's build."""

    def __init__(self) -> None:
        self.build_seconds = self.decode_seconds = self.joined_seconds = 0.0

    def joined(self, seconds: float) -> None:
        """Count ``seconds`` spent filling chunks of another process's build: all of it
        computing rows (the builder, not the joiner, copies and commits them)."""
        self.joined_seconds += seconds
        self.build_seconds += seconds
        self.decode_seconds += seconds

    def waited(self, seconds: float) -> float:
        """The part of ``seconds`` since the call's wait began that was not spent joining."""
        return round(max(0.0, seconds - self.joined_seconds), 3)

    def timed(self, commit: Callable[[BuildFunction], Published]
              ) -> Callable[[BuildFunction], Published]:
        """``commit`` (build with the build function it is given, then commit), counting
        its seconds as building, and the seconds the build function says it computed rows
        (all of its own time when it does not say) as decoding."""

        def timed_commit(build_fn: BuildFunction) -> Published:
            said: list[Optional[float]] = []
            timed: list[float] = []

            def build(current: BuildDir, on_chunk: ChunkCallback) -> Built:
                started = time.monotonic()
                made = build_fn(current, on_chunk)
                timed.append(time.monotonic() - started)
                said.append(made.decode_seconds)
                return made

            started = time.monotonic()
            try:
                return commit(build)
            finally:
                self.build_seconds += time.monotonic() - started
                if timed:
                    self.decode_seconds += timed[-1] if said[-1] is None else said[-1]

        return timed_commit
