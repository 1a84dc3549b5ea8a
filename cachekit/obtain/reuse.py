"""Incremental builds, the coordinator's part: a per-row build copies the rows that committed
entries of its recipe already hold, and records what lets later builds copy its own.

- :func:`describe_rows`: the build's recipe (its key but for the rows) and each row's
  identity under it (:func:`cachekit.keys.row_identities`), plus, for images, each file's
  stat now.
- :func:`find_donors`: the row index (:mod:`cachekit.store.row_index`) names the entries
  that may hold rows of the column; each is opened and checked
  (:mod:`cachekit.store.row_source`), and only rows whose full identity matches, that did
  not fail, and (with ``validate="path"``) whose file's stat is the one recorded when that
  entry was built, are given to the engine to copy, block by checked block
  (:mod:`cachekit.engine.reuse`).
- :func:`row_files`: after the fill, the row identities, block digests and file stats
  written next to the data, and where the rows came from, for the manifest.
- :func:`index_entry`: the committed entry put into the row index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .. import arrays, keys
from .. import engine
from ..engine.reuse import Donor
from ..messages import say
from ..store import LocalStore, Published
from ..store import manifest as manifests
from ..store.manifest import FORMAT_VERSION, Origin, RowReuse
from ..store.row_index import RowIndex
from ..store.row_source import RowSource, open_row_source

BLOCK_BYTES = 1 << 20
"""Bytes of rows per checked block of an entry: a copy reads and checks whole blocks."""


@dataclass(frozen=True)
class Rows:
    """A per-row build's rows as reuse sees them: the recipe, each row's identity, for
    images each file's (size, mtime_ns) now, and whether a row is reused only where that
    stat is the one its donor recorded (``validate="path"``, whose identity has no stat)."""

    recipe: str
    ids: np.ndarray
    stats: Optional[np.ndarray] = None
    same_stat: bool = False


def describe_rows(kind: str, params: dict[str, Any], column: Any, material: dict[str, Any], *,
                  builder: Optional[dict[str, Any]], values: Any = None) -> Rows:
    """The :class:`Rows` of a build of ``column`` (keyed with ``params`` and ``material``,
    as the key was). ``builder`` (decoder versions) joins the recipe, so that rows decoded
    by another version of a decoder are never mixed into an entry. ``values``: the paths of
    an images build, whose stats are taken (unless the key already took them)."""
    extra = [material[name] for name in ("stat", "content") if name in material]
    ids, dtype = keys.row_identities(column, extra)
    recipe = keys.recipe({"kind": kind, "format": FORMAT_VERSION, "params": params,
                          "dtype": dtype, "builder": builder})
    stats = None
    if kind == "images":
        stats = material["stat"] if "stat" in material else keys.stat_signature(values)
    return Rows(recipe, ids, stats, kind == "images" and params.get("validate") == "path")


@dataclass
class Donors:
    """The entries opened to copy rows from (closed by :meth:`close`), as the engine's
    donors, and the entries that could not be used."""

    donors: list[Donor] = field(default_factory=list)
    sources: list[RowSource] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(d.dst) for d in self.donors)

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self.sources.clear()

    def __enter__(self) -> "Donors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def find_donors(store: LocalStore, key: str, rows: Rows,
                template: Optional[tuple[tuple[int, ...], Any]]) -> Donors:
    """The committed entries of ``rows.recipe`` in ``store`` that hold rows of the column,
    opened and checked, and which of their rows to copy: each row from one entry, the
    entries with the most rows first. ``template``: the row shape and dtype the build
    makes (None: the first donor's)."""
    found = Donors()
    remaining = np.ones(len(rows.ids), dtype=bool)
    wanted = None if template is None else (tuple(template[0]), np.dtype(template[1]))
    try:
        for match in RowIndex(store).matches(rows.recipe, rows.ids[:, 0], remaining,
                                             exclude=key):
            source = open_row_source(store, match.key, rows.recipe)
            if source is None:
                found.skipped.append(match.key)
                continue
            shape = (tuple(source.manifest.shape[1:]), source.manifest.dtype)
            src, dst = _usable(source, match.src, match.dst, rows)
            if (wanted is not None and shape != wanted) or not len(dst):
                source.close()
                continue
            wanted = shape
            found.sources.append(source)
            found.donors.append(Donor(source.key, source.data, source.offset,
                                      source.manifest.rows, shape[0], shape[1],
                                      source.block_rows, source.blocks, src, dst))
            remaining[dst] = False
    except BaseException:
        found.close()
        raise
    return found


def _usable(source: RowSource, src: np.ndarray, dst: np.ndarray, rows: Rows
            ) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a match that may be copied: the same full identity, not failed, and
    for ``same_stat`` the same file stat as recorded."""
    inside = (src >= 0) & (src < source.manifest.rows)
    src, dst = src[inside], dst[inside]
    same = (source.ids[src] == rows.ids[dst]).all(axis=1) & ~source.failed[src]
    if rows.same_stat:
        if source.stats is None or rows.stats is None:
            return src[:0], dst[:0]
        same &= (source.stats[src] == rows.stats[dst]).all(axis=1) & (rows.stats[dst, 0] >= 0)
    return src[same], dst[same]


@dataclass(frozen=True)
class RowFiles:
    """What a per-row build adds to its manifest: the row files (name, leaf kind), the data
    file's checksum (computed with its block digests), how its rows may be reused, and
    where they came from."""

    files: tuple[tuple[str, str], ...]
    digests: dict[str, str]
    reuse: RowReuse
    origin: Origin


def row_files(directory: Any, rows: Rows, filled: engine.Filled) -> RowFiles:
    """Write the row identities, the data's block digests and (images) the file stats into
    the build directory ``directory`` (a handle) next to its filled data file."""
    shape, dtype = filled.shape, np.dtype(filled.dtype)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    block_rows = max(1, BLOCK_BYTES // max(1, row_bytes))
    whole, blocks = arrays.block_checksums(directory, manifests.DATA_FILE, block_rows)
    arrays.write_small(directory, manifests.ROW_IDS_FILE, rows.ids)
    arrays.write_small(directory, manifests.ROW_BLOCKS_FILE, blocks)
    files = [(manifests.ROW_IDS_FILE, "numpy"), (manifests.ROW_BLOCKS_FILE, "numpy")]
    if rows.stats is not None:
        arrays.write_small(directory, manifests.ROW_STATS_FILE,
                           np.ascontiguousarray(rows.stats, dtype="<i8"))
        files.append((manifests.ROW_STATS_FILE, "numpy"))
    reused = sorted(((k, n) for k, n in filled.reused.items() if n), key=lambda kn: -kn[1])
    origin = Origin(tuple(reused), filled.decoded, filled.resumed + filled.rows_joined)
    return RowFiles(tuple(files), {manifests.DATA_FILE: whole},
                    RowReuse(rows.recipe, block_rows), origin)


def index_entry(store: LocalStore, published: Published, ids: Optional[np.ndarray] = None
                ) -> None:
    """Put the committed entry ``published`` into the row index (best effort), with its
    row identities ``ids`` (None: read from the entry, checked)."""
    manifest = published.manifest
    if manifest.reuse is None:
        return
    if ids is None:
        source = open_row_source(store, manifest.key, manifest.reuse.recipe)
        if source is None:
            return
        with source:
            ids = source.ids
            failed = source.failed
    else:
        failed = np.zeros(manifest.rows, dtype=bool)
        failed[[row for row, _, _ in manifest.failed_rows]] = True
    RowIndex(store).add(manifest.reuse.recipe, manifest.key, ids[:, 0], skip=failed)


def announce_donors(key: str, found: Donors, rows: int) -> None:
    """Say on stderr how many rows the build copies and from how many entries."""
    if found.donors:
        entries = "1 entry" if len(found.donors) == 1 else f"{len(found.donors)} entries"
        say(f"entry {key[:12]}: reusing {found.rows} rows from {entries} of the same recipe "
            f"(each block checked as it is copied); decoding the other {rows - found.rows}")
    for skipped in found.skipped:
        say(f"entry {key[:12]}: entry {skipped[:12]} is gone or failed its checks; its rows "
            "are not reused")


def announce_refused(key: str, filled: engine.Filled) -> None:
    """Say on stderr which donors' rows failed their block checks (and were decoded)."""
    for donor, count in filled.refused.items():
        say(f"entry {key[:12]}: {count} rows of entry {donor[:12]} failed their checks as "
            "they were copied; decoded them instead")
