"""A donor's data file as a build uses it: checked whole before its rows are copied out,
hard-linked from the open file (this user's files only), or mapped to copy from
(:mod:`.parts`)."""

from __future__ import annotations

import os
import warnings
from typing import BinaryIO

import numpy as np

from .. import _fs, arrays
from ..messages import prefix
from ..store.manifest import FileRecord
from ..store.shared_rows import SharedRows


def mapped(f: BinaryIO, offset: int, record: FileRecord) -> np.ndarray:
    """The rows of the open donor file ``f`` (at byte ``offset``), read-only."""
    return np.memmap(f, dtype=record.np_dtype, mode="r", offset=offset, shape=record.shape)


def intact(f: BinaryIO, record: FileRecord, verdicts: dict[tuple[int, int], bool]) -> bool:
    """Whether the open donor file ``f`` holds the bytes its manifest's ``record`` names,
    read whole once per file (``verdicts``, by device and inode). Rows are copied out of a
    file only once it is: a copy would carry damage into an entry whose own checksum then
    covers it, where a linked file stays the donor's, which ``verify`` checks in both."""
    stat = os.fstat(f.fileno())
    inode = (stat.st_dev, stat.st_ino)
    if inode not in verdicts:
        verdicts[inode] = arrays.checksum_of(f) == (record.bytes, record.checksum)
    return verdicts[inode]


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
