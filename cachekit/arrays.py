"""Reading and writing an entry's ``.npy`` data files safely.

Opening a file checks its .npy header against the manifest's shape and dtype, and the file
size against header + prod(shape) x itemsize, on one descriptor that is then mapped, so
misread bytes are never returned and the file cannot be swapped between check and map.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from . import _fs
from .errors import CacheCorruptError
from .manifest import NOT_A_FILE_ERRNOS, FileRecord

CHECKSUM_BLOCK = 16 << 20


def create_array(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> np.memmap:
    """Create a zero-filled .npy file of ``shape`` and map it for writing."""
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


def open_record(entry_dir: Path, record: FileRecord, mode: str = "r") -> np.ndarray:
    """Map the entry file ``record`` describes, read-only (``"r"``) or copy-on-write (``"c"``)."""
    return open_file(entry_dir / record.name, record.shape, record.np_dtype, mode,
                     expected_bytes=record.bytes)


def open_file(path: Path, shape: tuple[int, ...], dtype: np.dtype, mode: str = "r", *,
              expected_bytes: int | None = None) -> np.ndarray:
    """Map one validated .npy file read-only (``mode="r"``) or copy-on-write (``mode="c"``)."""
    with _open_data(path) as f:
        offset = _validated_offset(f, path, shape, dtype, expected_bytes)
        if 0 in shape:  # mmap cannot map zero bytes; there is nothing to read
            empty = np.zeros(shape, dtype)
            empty.flags.writeable = mode != "r"
            return empty
        return np.memmap(f, dtype=dtype, mode=mode, offset=offset, shape=shape)


def data_offset(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Validate ``path``'s .npy header and size against shape/dtype; return the data offset."""
    with _open_data(path) as f:
        return _validated_offset(f, path, shape, dtype, None)


def read_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a .npy file's header, checked against the file's size."""
    with _open_data(path) as f:
        shape, dtype = _header(f, path)
        _validated_offset(f, path, shape, dtype, None)
    return shape, dtype


def checksum(path: Path) -> tuple[int, str]:
    """(size, blake2b-128) of a whole file, header included, read in large blocks."""
    hasher = hashlib.blake2b(digest_size=16)
    size = 0
    with _fs.open_regular(path) as f:
        for block in iter(lambda: f.read(CHECKSUM_BLOCK), b""):
            hasher.update(block)
            size += len(block)
    return size, "blake2b-128:" + hasher.hexdigest()


def _open_data(path: Path) -> BinaryIO:
    try:
        return _fs.open_regular(path)  # no symlink, no FIFO: never read outside the root
    except FileNotFoundError:
        raise CacheCorruptError(path, "data file is missing") from None
    except OSError as e:
        if e.errno not in NOT_A_FILE_ERRNOS:
            raise  # an I/O error (EIO, EACCES, ...) is not evidence of a corrupt entry
        raise CacheCorruptError(path, f"data file is not a regular file ({e})") from None


def _header(f: BinaryIO, path: Path) -> tuple[tuple[int, ...], np.dtype]:
    try:
        f.seek(0)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (OSError, ValueError, TypeError, SyntaxError) as e:
        raise CacheCorruptError(path, f"unreadable .npy header ({e})") from None
    if fortran_order:
        raise CacheCorruptError(path, "Fortran-ordered data is never stored")
    return tuple(shape), dtype


def _validated_offset(f: BinaryIO, path: Path, shape: tuple[int, ...], dtype: np.dtype,
                      expected_bytes: int | None) -> int:
    """Check an open .npy file's header and size against shape/dtype; return the offset."""
    size = os.fstat(f.fileno()).st_size
    if expected_bytes is not None and size != expected_bytes:
        # Before parsing anything: a manifest's numbers never size an allocation that the
        # file itself does not back.
        raise CacheCorruptError(path, f"file is {size} bytes, expected {expected_bytes} (its "
                                      "size in the manifest)")
    file_shape, file_dtype = _header(f, path)
    offset = f.tell()
    if file_shape != tuple(shape) or file_dtype != dtype:
        raise CacheCorruptError(
            path, f"header says {file_dtype} {tuple(file_shape)}, manifest says {dtype} {shape}"
        )
    expected = offset + math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if size != expected:
        raise CacheCorruptError(path, f"file is {size} bytes, expected {expected}")
    return offset
