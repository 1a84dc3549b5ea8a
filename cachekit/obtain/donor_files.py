"""A donor's data file as a build uses it: checked whole before its rows are copied out,
hard-linked from the open file (this user's files only), or mapped to copy from
(:mod:`.parts`)."""

from __future__ import annotations

import os
import warnings
from typing import BinaryIO, Optional, Sequence

import numpy as np

from .. import _fs, arrays
from ..messages import prefix
from ..store.manifest import FileRecord
from ..store.kept import Kept
from ..store.shared_rows import SharedRows

_INTACT: Kept[bool] = Kept(1 << 16, lambda verdict: 64)
"""The files this process found :func:`intact`, by version and checksum: committed files
never change, so a file that several builds copy rows out of (a teammate's full entry, for
each of a member's folds) is read whole once while it stays the same."""


def mapped(f: BinaryIO, offset: int, record: FileRecord) -> np.ndarray:
    """The rows of the open donor file ``f`` (at byte ``offset``), read-only."""
    return np.memmap(f, dtype=record.np_dtype, mode="r", offset=offset, shape=record.shape)


def intact(f: BinaryIO, record: FileRecord, verdicts: dict[tuple[int, int], bool]) -> bool:
    """Whether the open donor file ``f`` holds the bytes its manifest's ``record`` names,
    read whole once per file (``verdicts``, by device and inode) and, found so, once per
    process while its version stays the same (:data:`_INTACT`). Rows are copied out of a
    file only once it is: a copy would carry damage into an entry whose own checksum then
    covers it, where a linked file stays the donor's, which ``verify`` checks in both."""
    stat = os.fstat(f.fileno())
    inode = (stat.st_dev, stat.st_ino)
    if inode not in verdicts:
        stamp = (_fs.file_version(stat), record.checksum)
        verdicts[inode] = bool(_INTACT.get(stamp)) or (
            arrays.checksum_of(f) == (record.bytes, record.checksum))
        if verdicts[inode]:
            _INTACT.put(stamp, True)
    return verdicts[inode]


def open_intact(lenders: Sequence[tuple[SharedRows, int, np.ndarray, np.ndarray]],
                verdicts: dict[tuple[int, int], bool]
                ) -> Optional[tuple[BinaryIO, np.ndarray]]:
    """The file that ``lenders`` (an offer's: each donor, and the file's index in its
    manifest) lend, open and mapped, from the first that opens it :func:`intact` (the
    same bytes under one name: a lender cleared meanwhile or whose copy is damaged leaves
    it to the next); None when none does."""
    for source, index, _, _ in lenders:
        try:
            f, offset = source.open_data(index)
        except (OSError, ValueError):
            continue
        finally:
            source.release()
        record = source.manifest.data_files[index]
        if intact(f, record, verdicts):
            return f, mapped(f, offset, record)
        warn_damaged(source, record)
        f.close()
    return None


def warn_damaged(source: SharedRows, record: FileRecord) -> None:
    """Warn that the file ``record`` of ``source`` is not :func:`intact`."""
    warnings.warn(f"{prefix()}: {record.name} of entry {source.key[:12]} differs from its "
                  "checksum (damaged on disk), so its rows are decoded, not copied; "
                  f"`cachekit verify {source.key[:12]}` names every entry that uses it",
                  RuntimeWarning, stacklevel=2)


def link(directory: _fs.DirHandle, f: BinaryIO, name: str) -> bool:
    """Link the open file ``f`` into ``directory`` as ``name`` if it is this user's: a
    group member's file stays writable by its owner, who could then change this entry."""
    return os.fstat(f.fileno()).st_uid == os.geteuid() and directory.link_open_file(f, name)


def link_row_file(directory: _fs.DirHandle, source: SharedRows, there: str,
                  record: FileRecord, here: str) -> bool:
    """Link the row file ``there`` of ``source`` as ``here``, if its size is its record's."""
    try:
        with source.open_file(there) as f:
            return os.fstat(f.fileno()).st_size == record.bytes and link(directory, f, here)
    except OSError:
        return False
