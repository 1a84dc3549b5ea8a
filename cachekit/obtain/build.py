"""The seam between the public face and :func:`cachekit.obtain.obtain`: what a call asks
for (a :class:`Request`) and, on a miss only, how its entry is made (a :class:`Build`).

A request is what a hit needs: the key, what the entry must look like, and whether a
failure recorded by the build it waited for is raised. Only when the key is not published
does obtain call :meth:`Request.start` for the build, which fills a build directory, may
fill chunks of another process's live build of the key (``join``), and hears once its own
commit published the entry (``committed``), and tells what it made in a
:class:`~.built.Built`. The per-row calls implement both in
:mod:`cachekit.obtain.row_build`, memoize in :mod:`cachekit.memoize`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

from .expected import Expected

if TYPE_CHECKING:  # the build's side of the seam: a hit imports none of it
    from .._fs import DirHandle
    from ..engine.filling.claimed import ChunkCallback
    from ..engine.filling.cores import Spare
    from ..engine.filling.joiner import Joined
    from ..store import BuildDir, Published
    from ..store.manifest import Manifest
    from .built import Built

__all__ = ["Build", "Request"]


class Build(Protocol):
    """How the entry of one request is made, once obtain found it missing."""

    joinable: bool
    """Whether :meth:`join` may fill chunks of another process's build (per-row builds)."""
    replaces: bool
    """Whether it builds the key again in place of its entry, set aside (to be made
    contiguous, or healed): unless it heals, the remote tier's copy of the key is then
    never downloaded instead, for it is that entry's."""
    heals: Optional["Manifest"]
    """The manifest of the entry it builds again because files of its rows changed (None
    otherwise): a remote tier's copy that is that very entry is replaced by the build, and
    one that is another entry of the key (healed by another host) is downloaded instead."""

    def computes_nothing(self) -> bool:
        """Whether the build would compute no value: every row is held by a committed entry
        already. Such a build takes milliseconds, so it is made without the key's build
        lock (a duplicate costs as little, and the atomic commit settles a race)."""

    def build(self, current: BuildDir, on_chunk: ChunkCallback) -> Built:
        """Fill ``current``, reporting (rows done, rows total) after each chunk."""

    def join(self, directory: DirHandle, spare: Optional[Spare]) -> Optional[Joined]:
        """Fill free chunks of another process's live build of the key, given its directory
        and, for a build of this host, the cores we may add (None: another host's)."""

    def committed(self, published: Published) -> None:
        """This build's commit published ``published`` (not called when another builder's
        commit won the race)."""


class Request(Protocol):
    """What one call asks obtain for: all that a hit uses."""

    key: str
    expected: Optional[Expected]
    """What the entry must look like, checked whatever its source."""
    raise_failures: bool
    """Whether a failure recorded by the build this call waited for is raised here (False
    for builds that store failed rows as zeros, which never record one)."""

    def start(self) -> Build:
        """The build of the key: called on a miss only."""

    def close(self) -> None:
        """Let go of what the request and its build hold open for a build that never ran
        (the entries whose rows it found, an entry set aside to be built again): called
        once the call ends, however it ends."""
