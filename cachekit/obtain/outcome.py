"""What :func:`cachekit.obtain.flow.obtain` was asked (:class:`Options`) and what it
returns (:class:`Outcome`): shared by the hit's path (:mod:`.flow`) and the miss's
(:mod:`.miss`), which import it, never each other's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..store import Published

if TYPE_CHECKING:
    from . import remote as remote_tier


@dataclass(frozen=True)
class Options:
    """How :func:`~.flow.obtain` was asked to get the entry (its keyword arguments)."""

    lock_timeout: Optional[float]
    join: bool
    remote: Optional["remote_tier.Tier"]


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
    carried: tuple[int, int] = (0, 0)
    """Rows decoded and joined by earlier attempts of the same call (:meth:`after`)."""

    def after(self, earlier: Optional["Outcome"]) -> "Outcome":
        """This outcome, with the work of ``earlier`` (if any) counted in: an attempt of the
        same call whose entry was then built again (a contiguous copy of its rows, a heal) or
        removed before it was opened. The rows it decoded were this call's work, though the
        entry now holds them as a copy."""
        if earlier is None:
            return self
        decoded, joined, _ = earlier.row_counts
        return dataclasses.replace(
            self, wait_seconds=self.wait_seconds + earlier.wait_seconds,
            build_seconds=self.build_seconds + earlier.build_seconds,
            decode_seconds=self.decode_seconds + earlier.decode_seconds,
            join_seconds=self.join_seconds + earlier.join_seconds, carried=(decoded, joined))

    @property
    def word(self) -> str:
        """What this process did, in one word (``Entry.outcome``): "hit" (found it),
        "waited" (for another process's build), "joined" (computed rows of that build),
        "built", or "pulled" (downloaded it from the remote tier)."""
        return outcome_word(self.source, self.waited_for_build)

    @property
    def committed_here(self) -> bool:
        """Whether this process put the entry into the root (it built or pulled it): the
        calls that answer for the cache's budget."""
        return self.source in ("built", "remote")

    @property
    def row_counts(self) -> tuple[int, int, int]:
        """(rows decoded by this call, rows other processes decoded for its build, rows
        shared with other entries): ``Entry.rows_decoded``, ``rows_joined``, ``rows_reused``.

        A builder's come from its manifest's origin (a build that resumed dead builds counts
        their rows as joined: other processes decoded them). A joiner decoded the rows it
        filled, shares the rows the build shares (the origin's reused rows), and counts the
        rest as joined: the builder and the other joiners decoded them. They add up to the
        entry's rows, and are all 0 on a hit (unless :attr:`carried` says this call built
        the entry before it was built again)."""
        decoded, joined, reused = self._own_row_counts()
        if self.carried == (0, 0):
            return decoded, joined, reused
        rows = self.entry.manifest.rows
        decoded = min(rows, decoded + self.carried[0])
        joined = min(rows - decoded, joined + self.carried[1])
        return decoded, joined, rows - decoded - joined

    def _own_row_counts(self) -> tuple[int, int, int]:
        manifest = self.entry.manifest
        origin = manifest.origin
        if origin is not None and not origin.adds_up(manifest.rows):
            origin = None  # not this build's
        if self.source == "built":
            if origin is None:  # (memoize has none)
                return manifest.rows, 0, 0
            return origin.decoded, origin.joined, origin.rows_reused
        if self.source == "joined":
            reused = 0 if origin is None else origin.rows_reused
            decoded = min(self.rows_filled, manifest.rows - reused)
            return decoded, manifest.rows - reused - decoded, reused
        return 0, 0, 0


def outcome_word(source: str, waited_for_build: bool = False) -> str:
    """What a call whose entry came from ``source`` did, in one word (``Entry.outcome``)."""
    if source == "local":
        return "waited" if waited_for_build else "hit"
    return {"remote": "pulled"}.get(source, source)
