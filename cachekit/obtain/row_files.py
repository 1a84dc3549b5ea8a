"""The files a per-row build writes next to its data file, for its manifest: the row
identities, the data's block digests, for images the files' stats, and for a derived entry
the row map and the parts it links (:mod:`.parts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _fs, arrays
from ..engine.filling.builder import Filled
from ..store import manifest as manifests
from ..store.manifest import Origin, RowReuse
from .donors import Rows
from .parts import Parts

BLOCK_BYTES = 1 << 20
"""Bytes of rows per block digest of ``row_blocks.npy``. Rows are shared by link now, so
no build reads them; the file stays in the format (``verify`` checks it like any other)."""


@dataclass(frozen=True)
class RowFiles:
    """What a per-row build lists in its manifest: its data file (unless it decoded no
    row), row files and parts (name, leaf kind), the checksums known without reading the
    files again (the data file's, computed with its block digests; each part's, its
    donor's), how its rows may be reused, and where they came from."""

    files: tuple[tuple[str, str], ...]
    digests: dict[str, str]
    reuse: RowReuse
    origin: Origin
    linked: frozenset[str] = frozenset()
    """The parts: links to files of committed entries."""


def write_row_files(directory: _fs.DirHandle, rows: Rows, filled: Filled, held: Parts,
                    copied: dict[str, int], repeated: int = 0) -> RowFiles:
    """Write the row identities, the data's block digests, (images) the file stats and (a
    derived entry) the row map into the build directory next to its data file, each
    checksummed as it is written. A derived entry that decoded none of its rows has no data
    file and writes only its row map: its parts' copies of the row files describe every
    row. One whose rows only repeat others (it links no part) renames its data file to a
    part of its own, with that part's row files (:func:`_own_part`): the format's row map
    comes with parts, and a later build links that file as it links any part. ``copied``:
    the rows of other entries copied, not linked, by key, and ``repeated``: the rows that
    repeat an earlier row of the column (for its origin)."""
    shape, dtype = filled.shape, np.dtype(filled.dtype)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    block_rows = max(1, BLOCK_BYTES // max(1, row_bytes))
    own = held.own_rows if held.derived else slice(None)  # they describe data.npy's rows
    digests: dict[str, str] = {}
    files: list[tuple[str, str]] = []

    def write(name: str, array: np.ndarray) -> None:
        digests[name] = arrays.write_small(directory, name, array)
        files.append((name, "numpy"))

    shared = {**dict(zip(held.names, held.records)), **held.sidecars}
    own_part = held.derived and held.has_own and not held.names
    if not own_part and (not held.derived or held.has_own):
        whole, blocks = arrays.block_checksums(directory, manifests.DATA_FILE, block_rows)
        digests[manifests.DATA_FILE] = whole
        files.append((manifests.DATA_FILE, "numpy"))
        described = _described(rows, own)
        write(manifests.ROW_IDS_FILE, described.pop(manifests.ROW_IDS_FILE))
        write(manifests.ROW_BLOCKS_FILE, blocks)
        for name, array in described.items():
            write(name, array)
    if held.derived:
        write(manifests.ROW_MAP_FILE, held.row_map())  # (first, with no data file)
        parts = {name: record.checksum for name, record in shared.items()}
        if own_part:  # (the row map's file 0)
            parts.update(_own_part(directory, rows, own))
        files += [(name, "numpy") for name in sorted(parts)]
        digests.update(parts)
    reused, copies = ([(k, n) for k, n in sorted(by_key.items(), key=lambda kn: -kn[1]) if n]
                      for by_key in (held.shared, copied))
    origin = Origin(tuple(reused), filled.decoded, filled.resumed + filled.rows_joined,
                    tuple(copies), repeated)
    return RowFiles(tuple(files), digests, RowReuse(rows.recipe, block_rows), origin,
                    frozenset(shared))


def _own_part(directory: _fs.DirHandle, rows: Rows, own: np.ndarray) -> dict[str, str]:
    """Rename the build's data file to the part its checksum names, and write that part's
    row files (the identities, and stats, of ``own``, the rows it holds): the checksum of
    each, by name."""
    with directory.open_file(manifests.DATA_FILE) as f:
        _, digest = arrays.checksum_of(f)
    part = manifests.part_name(digest)
    directory.rename(manifests.DATA_FILE, directory, part)
    written = {part: digest}
    for row_file, array in _described(rows, own).items():
        name = manifests.sidecar_name(part, row_file)
        written[name] = arrays.write_small(directory, name, array)
    return written


def _described(rows: Rows, own: np.ndarray | slice) -> dict[str, np.ndarray]:
    """The row files that describe the rows ``own`` of a data file, by name: their
    identities, and (images) their files' stats."""
    described = {manifests.ROW_IDS_FILE: rows.ids[own]}
    if rows.stats is not None:
        described[manifests.ROW_STATS_FILE] = np.asarray(rows.stats[own], dtype="<i8")
    return described
