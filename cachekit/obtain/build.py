"""The seam between the public face and :func:`cachekit.obtain.obtain`: what a call asks
for (a :class:`Request`) and, on a miss only, how its entry is made (a :class:`Build`).

A request is what a hit needs: the key, what the entry must look like, and whether a
failure recorded by the build it waited for is raised. Only when the key is not published
does obtain call :meth:`Request.start` for the build, which fills a build directory, may
fill chunks of another process's live build of the key (``join``), and hears once its own
commit published the entry (``committed``). The per-row calls implement both in
:mod:`cachekit.obtain.row_build`, memoize in :mod:`cachekit.memoize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ..errors import ImageDecodeError
from ..store.manifest import Origin, RowReuse
from .expected import Expected

if TYPE_CHECKING:  # the build's side of the seam: a hit imports none of the engine
    from .._fs import DirHandle
    from ..engine.filling.claimed import ChunkCallback
    from ..engine.filling.cores import Spare
    from ..engine.filling.joiner import Joined
    from ..store import BuildDir, Published

__all__ = ["Build", "Built", "Request"]


@dataclass(frozen=True)
class Built:
    """What a build made in its directory, for the manifest."""

    kind: str
    rows: int
    files: tuple[tuple[str, str], ...]
    """(file name, leaf kind) of each data file, in order: ``(("data.npy", "numpy"),)``."""
    failed_rows: tuple = ()
    params: Optional[dict[str, Any]] = None
    column: Optional[str] = None
    structure: Optional[dict[str, Any]] = None
    builder: Optional[dict[str, Any]] = None
    """More about what built it, for the manifest's ``builder``: e.g. decoder versions."""
    decode_seconds: Optional[float] = None
    """Seconds the build spent computing rows here (None: all of its time)."""
    digests: Optional[dict[str, str]] = None
    """Checksums of data files that the build computed as it wrote them, by name."""
    durable: frozenset[str] = frozenset()
    """Data files linked from committed entries: their commit fsynced them."""
    reuse: Optional[RowReuse] = None
    """How later builds may share the rows of a per-row entry (its recipe)."""
    origin: Optional[Origin] = None
    """Where a per-row entry's rows came from."""
    failure: Optional[ImageDecodeError] = None
    """Rows failed under ``on_error="raise"``: the rows that decoded are committed as the
    key's kept rows (:func:`cachekit.keys.kept_key`), a source for later builds, and this
    error is raised."""


class Build(Protocol):
    """How the entry of one request is made, once obtain found it missing."""

    joinable: bool
    """Whether :meth:`join` may fill chunks of another process's build (per-row builds)."""

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
