"""Copying a chunk's verified bytes from another file into the builder's own data file: from
a joiner's rows file (:mod:`.builder`) or from a dead build's data file or rows files
(:mod:`.resume`).

A file is copied from only once its header and size are the plan's (:func:`open_checked`,
the one place a partly filled file's header is checked), and a chunk only where its bytes
match the checksum in its done record (:func:`copy_chunk`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from ... import _fs, arrays
from .journal import Done, digest
from .plan import Chunk, Plan


def open_checked(directory: _fs.DirHandle, name: str, planned: Plan) -> Optional[Any]:
    """Open the partly filled file ``name`` of ``directory`` (a joiner's rows file, or a
    build's data file) to read chunks from: a regular file of this user whose header and
    size are the plan's; else None."""
    try:
        f = directory.open_file(name)
    except OSError:
        return None
    try:
        if os.fstat(f.fileno()).st_uid != os.geteuid():
            raise ValueError("another user's file")
        if arrays.check_header(f, directory.path / name, planned.shape,
                               planned.dtype) != planned.offset:
            raise ValueError("a file whose layout differs from the plan's")
    except (OSError, ValueError):
        f.close()
        return None
    return f


def copy_chunk(source: Any, planned: Plan, chunk: Chunk, record: Done,
               out: np.ndarray) -> bool:
    """Copy the bytes of ``chunk`` from the open file ``source`` (laid out as ``planned``)
    into ``out`` and flush them, if they match ``record``'s checksum; False otherwise."""
    rows = read_chunk(source, planned, chunk, record)
    if rows is None:
        return False
    out[chunk.start:chunk.stop] = rows
    arrays.flush_bytes(out, *planned.byte_range(chunk))
    return True


def read_chunk(source: Any, planned: Plan, chunk: Chunk, record: Done) -> Optional[np.ndarray]:
    """The rows of ``chunk`` read from the open file ``source`` (laid out as ``planned``),
    if their bytes match ``record``'s checksum; None otherwise.

    The bytes are read once into memory, checked there and used from there: a process
    that still writes into ``source`` cannot change what is copied after the check."""
    first, end = planned.byte_range(chunk)
    try:
        data = os.pread(source.fileno(), end - first, first)
    except OSError:
        return None
    if len(data) != end - first or digest(data) != record.digest:
        return None
    return np.frombuffer(data, planned.dtype).reshape((chunk.rows, *planned.row_shape))
