"""A committed entry opened to copy rows from, checked before anything is read from it.

Another build of the same recipe copies rows out of a published entry instead of decoding
them again (:mod:`cachekit.store.row_index` says which entries may hold them). The entry
is opened once, through one handle on its directory: its manifest is read and checked (its
signature too when ``CACHEKIT_SIGNING_KEY`` is set) and must name the recipe; its row
identities and block digests are read whole and must match their checksums in the
manifest; its data file is opened once, and its header and size must be the manifest's.
From then on the copy reads only that open file, so the entry may be cleared or pruned at
any moment: the bytes read are the ones the manifest describes, and each block is checked
against its digest before a row of it is used (:mod:`cachekit.engine.filling.copy_in`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, BinaryIO, Optional

import numpy as np

from .. import arrays
from ..errors import CacheCorruptError
from . import manifest as manifests
from .local import LocalStore
from .manifest import FileRecord, Manifest


@dataclass
class RowSource:
    """An entry's rows, open to be copied: ``data`` (the open data file, rows from byte
    ``offset``), its row identities ``ids`` ((rows, 2), or (rows, 4) with the identities
    of the files' digests for an entry built with ``validate="content"``), the digests of
    its blocks of ``block_rows`` rows, and for an images entry the files' stats when it was
    built."""

    key: str
    manifest: Manifest
    data: BinaryIO
    offset: int
    ids: np.ndarray
    blocks: np.ndarray
    block_rows: int
    stats: Optional[np.ndarray]

    @cached_property
    def failed(self) -> np.ndarray:
        """A mask of the entry's rows that failed when it was built (stored as zeros)."""
        return self.manifest.failed()

    def close(self) -> None:
        self.data.close()

    def __enter__(self) -> "RowSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_row_source(store: LocalStore, key: str, recipe: str) -> Optional[RowSource]:
    """The committed entry ``key`` of ``recipe`` opened to copy rows from, or None when it
    is gone, is of another recipe, lists no row files, or fails any check."""
    try:
        with store.layout.open_folder("entries") as entries, entries.child(key) as entry:
            manifest = manifests.read_at(entry, key)
            reuse = manifest.reuse
            ids_record = manifest.row_file(manifests.ROW_IDS_FILE)
            blocks_record = manifest.row_file(manifests.ROW_BLOCKS_FILE)
            if reuse is None or reuse.recipe != recipe or ids_record is None \
                    or blocks_record is None:
                return None
            rows = manifest.rows
            words = ids_record.shape[1] if len(ids_record.shape) == 2 else 0
            ids = _read(entry, ids_record, (rows, 4 if words == 4 else 2), "<u8")
            count = -(-rows // reuse.block_rows)
            blocks = _read(entry, blocks_record, (count, 16), "|u1")
            stats_record = manifest.row_file(manifests.ROW_STATS_FILE)
            stats = None if stats_record is None else _read(entry, stats_record, (rows, 2),
                                                            "<i8")
            data = entry.open_file(manifests.DATA_FILE)
            try:
                first = manifest.files[0]
                if os.fstat(data.fileno()).st_size != first.bytes:
                    raise CacheCorruptError(entry.path / first.name, "size differs from the "
                                            "manifest's")
                offset = arrays.check_header(data, entry.path / first.name, first.shape,
                                             first.np_dtype)
            except BaseException:
                data.close()
                raise
    except (OSError, ValueError):  # gone, a symlink, refused, corrupt (CacheCorruptError)
        return None
    return RowSource(key, manifest, data, offset, ids, blocks, reuse.block_rows, stats)


def _read(entry: Any, record: FileRecord, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if record.shape != shape or record.np_dtype != np.dtype(dtype):
        raise CacheCorruptError(entry.path / record.name, f"holds {record.dtype} "
                                f"{list(record.shape)}, not {dtype} {list(shape)}")
    return arrays.read_small(entry, record.name, shape, np.dtype(dtype), record.bytes,
                             record.checksum, manifests.ROW_FILES_LIMIT)
