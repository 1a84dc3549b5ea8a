"""The files a per-row build writes next to its data file, for its manifest: the row
identities, the data's block digests, for images the files' stats, and for a derived entry
the row map and the parts it links (:mod:`.parts`); and the empty data file of a build
whose every row is another entry's.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

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
    """What a per-row build adds to its manifest: the row files and parts (name, leaf
    kind), the checksums known without reading the files again (the data file's, computed
    with its block digests; each part's, its donor's), how its rows may be reused, and
    where they came from."""

    files: tuple[tuple[str, str], ...]
    digests: dict[str, str]
    reuse: RowReuse
    origin: Origin
    linked: frozenset[str] = frozenset()
    """The parts: links to files of committed entries."""


def write_row_files(directory: _fs.DirHandle, rows: Rows, filled: Filled,
                    held: Parts) -> RowFiles:
    """Write the row identities, the data's block digests, (images) the file stats and (a
    derived entry) the row map into the build directory next to its data file, each
    checksummed as it is written. A derived entry that decoded none of its rows writes only
    its row map: its parts' copies of the row files describe every row."""
    shape, dtype = filled.shape, np.dtype(filled.dtype)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    block_rows = max(1, BLOCK_BYTES // max(1, row_bytes))
    whole, blocks = arrays.block_checksums(directory, manifests.DATA_FILE, block_rows)
    own = held.own_rows if held.derived else slice(None)  # they describe data.npy's rows
    digests = {manifests.DATA_FILE: whole}
    files: list[tuple[str, str]] = []

    def write(name: str, array: np.ndarray) -> None:
        digests[name] = arrays.write_small(directory, name, array)
        files.append((name, "numpy"))

    linked: frozenset[str] = frozenset()
    if not held.derived or len(held.own_rows):
        write(manifests.ROW_IDS_FILE, rows.ids[own])
        write(manifests.ROW_BLOCKS_FILE, blocks)
        if rows.stats is not None:
            write(manifests.ROW_STATS_FILE, np.asarray(rows.stats[own], dtype="<i8"))
    if held.derived:
        write(manifests.ROW_MAP_FILE, held.row_map())
        shared = {**dict(zip(held.names, held.records)), **held.sidecars}
        files += [(name, "numpy") for name in sorted(shared)]
        digests.update((name, record.checksum) for name, record in shared.items())
        linked = frozenset(shared)
    reused = sorted(((k, n) for k, n in held.shared.items() if n), key=lambda kn: -kn[1])
    origin = Origin(tuple(reused), filled.decoded, filled.resumed + filled.rows_joined)
    return RowFiles(tuple(files), digests, RowReuse(rows.recipe, block_rows), origin, linked)


def no_rows(directory: _fs.DirHandle, template: Any) -> Filled:
    """An empty own data file: every row of the build is another entry's. Its bytes are the
    same in every such build of a row shape and dtype, and no file of a build is changed
    once written, so this process links the one it wrote last in the same root (kept open,
    and linked from the open file) while that has a name: a link allocates no inode, as a
    create does (the storage benchmark times a create, which a disk busy with a large
    removal slows)."""
    shape, dtype = (0, *template[0]), np.dtype(template[1])
    builds = os.stat("..", dir_fd=directory.fd)  # the root's build folder: files of this root
    kind = (builds.st_dev, builds.st_ino, shape, dtype.str)
    with _EMPTY_DATA_LOCK:
        written = _EMPTY_DATA.get(kind)
        if written is None or not directory.link_open_file(written, manifests.DATA_FILE):
            arrays.write_small(directory, manifests.DATA_FILE, np.zeros(shape, dtype))
            _EMPTY_DATA[kind] = directory.open_file(manifests.DATA_FILE)
            if written is not None:
                written.close()
    return Filled(shape=shape, dtype=dtype)


_EMPTY_DATA: dict[tuple[int, int, tuple[int, ...], str], BinaryIO] = {}
"""The empty data file this process wrote last in each root's build folder (device, inode)
for each row shape and dtype, open."""
_EMPTY_DATA_LOCK = threading.Lock()


@atexit.register
def _close_empty_data() -> None:
    with _EMPTY_DATA_LOCK:
        while _EMPTY_DATA:
            _EMPTY_DATA.popitem()[1].close()


def _new_lock_after_fork() -> None:
    """A forked child's lock, which no thread of its own holds (its files stay open)."""
    global _EMPTY_DATA_LOCK
    _EMPTY_DATA_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)
