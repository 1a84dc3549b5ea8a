"""What one call spent on its entry itself, as against waiting for another process.

A sweep sums these over its agents, so each process counts only its own work: the seconds
it built (its own build, from the build directory's creation to the commit, and the chunks
it filled of another process's build while it waited for it), and the part of those it
spent computing rows. Whatever else the call took, from its first look to the entry, was
waiting (or, with a remote tier, downloading).
"""

from __future__ import annotations

from typing import Optional


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

    def decoded(self, said: Optional[float], seconds: float) -> None:
        """Count as decoding the seconds a build said it computed rows (``said``; None:
        all of the ``seconds`` it took)."""
        self.decode_seconds += seconds if said is None else said
