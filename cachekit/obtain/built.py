"""What a build made in its directory, for the manifest (:class:`Built`): the miss's side of
the seam of :mod:`.build`, imported on a miss only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ImageDecodeError
from ..store.manifest import Origin, RowReuse


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
