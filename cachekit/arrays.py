"""Reading and writing an entry's ``.npy`` data files safely.

Opening a file checks its .npy header against the manifest's shape and dtype, and the file
size against header + prod(shape) x itemsize, on one descriptor that is then mapped, so
misread bytes are never returned and the file cannot be swapped between check and map.
"""

from __future__ import annotations

import hashlib
import io
import math
import mmap
import os
import re
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from . import _fs
from .checksums import hasher, hex_checksum
from .errors import CacheCorruptError
from ._fs import NOT_A_FILE_ERRNOS

CHECKSUM_BLOCK = 16 << 20
HEADER_ALIGN = np.lib.format.ARRAY_ALIGN
"""numpy's own alignment of the data start (64 bytes)."""
MAX_HEADER_BYTES = 1 << 20
"""The largest .npy header read: page-padded headers pass numpy's default of 10,000 bytes
on hosts with pages over 8 KiB."""


def create_array(directory: _fs.DirHandle, name: str, shape: tuple[int, ...],
                 dtype: np.dtype, *, align: int = HEADER_ALIGN,
                 reserve: bool = True) -> np.ndarray:
    """Create a zero-filled .npy file ``name`` of ``shape`` in ``directory``, its blocks
    reserved (a full disk fails here, not with SIGBUS later; ``reserve=False`` leaves it
    sparse for a caller that reserves the ranges it writes), and map it for writing: the
    map is made from the very file created, never reopened by name.

    The header is padded with spaces so the data start at a multiple of ``align`` bytes (numpy pads
    to 64; a build pads to a page, see :mod:`cachekit.engine.filling.plan`); ``np.load`` reads the
    file as usual."""
    dtype = np.dtype(dtype)
    fd = directory.create(name)
    with os.fdopen(fd, "r+b") as f:
        f.write(_padded_header(shape, dtype, align))
        f.flush()
        offset = f.tell()
        os.ftruncate(f.fileno(), offset + math.prod(shape) * dtype.itemsize)
        if reserve:
            _fs.preallocate_fd(f.fileno())
        return _map(f, shape, dtype, "r+", offset)


def data_offset(shape: tuple[int, ...], dtype: np.dtype, *, align: int = HEADER_ALIGN) -> int:
    """Where the data start in a file that :func:`create_array` makes with these arguments
    (the length of its padded header), known before the file exists."""
    return len(_padded_header(shape, np.dtype(dtype), align))


def _padded_header(shape: tuple[int, ...], dtype: np.dtype, align: int) -> bytes:
    """A .npy header (format 1.0, or 2.0 when it needs more than 64 KiB) for a C-ordered
    array, padded so that its length is a multiple of ``align`` (and of 64)."""
    align = math.lcm(max(1, align), np.lib.format.ARRAY_ALIGN)
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(dtype), tuple(shape))
    for version, prefix, limit in (((1, 0), 10, 0xFFFF), ((2, 0), 12, 0xFFFFFFFF)):
        total = -(-(prefix + len(text) + 1) // align) * align
        if total - prefix <= limit:
            body = (text + " " * (total - prefix - len(text) - 1) + "\n").encode("latin1")
            length = len(body).to_bytes(prefix - 8, "little")
            return np.lib.format.magic(*version) + length + body
    raise ValueError(f"a .npy header for shape {tuple(shape)} is too large")


def flush(array: np.ndarray) -> None:
    """msync a writable map (an empty array maps nothing and needs none)."""
    if isinstance(array, np.memmap):
        array.flush()


def flush_bytes(array: np.ndarray, first: int, end: int) -> None:
    """msync bytes [first, end) of the file behind the writable map ``array`` (file
    offsets), so a chunk is on disk before its done record says so, without writing back
    pages of chunks that other threads or processes are still filling."""
    mapped = getattr(array, "_mmap", None)
    if not isinstance(array, np.memmap) or mapped is None or end <= first:
        flush(array)
        return
    base = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY  # where numpy's map starts
    low = (first - base) // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.flush(low, min(end - base, len(mapped)) - low)


def _map(f: BinaryIO, shape: tuple[int, ...], dtype: np.dtype, mode: str,
         offset: int) -> np.ndarray:
    if 0 in shape:  # mmap cannot map zero bytes; there is nothing to read or write
        empty = np.zeros(shape, dtype)
        empty.flags.writeable = mode != "r"
        return empty
    return np.memmap(f, dtype=dtype, mode=mode, offset=offset, shape=shape)


def open_file(path: Path, shape: tuple[int, ...], dtype: np.dtype, mode: str = "r", *,
              expected_bytes: int | None = None) -> np.ndarray:
    """Map one validated .npy file read-only (``mode="r"``) or copy-on-write (``mode="c"``)."""
    fd = open_data(path)
    try:
        return map_descriptor(fd, path, shape, dtype, mode, expected_bytes=expected_bytes)
    finally:
        os.close(fd)


def map_descriptor(fd: int, path: Path, shape: tuple[int, ...], dtype: np.dtype,
                   mode: str = "r", *, expected_bytes: int | None = None) -> np.ndarray:
    """Map the open .npy file ``fd`` (``path`` names it in errors) as :func:`open_file` maps
    a path. Its header is read by position, so threads may map one descriptor at once."""
    f = _Positional(fd, str(path))
    offset = _validated_offset(f, path, shape, dtype, expected_bytes)
    return _map(f, shape, dtype, mode, offset)


def seal(directory: _fs.DirHandle, name: str, digest: Optional[str] = None
         ) -> tuple[tuple[int, ...], np.dtype, int, str]:
    """(shape, dtype, size, checksum) of a .npy file this process wrote into ``directory``,
    after checking its header against its size: one open descriptor. ``digest``: the
    checksum of the bytes the writer wrote, computed as it wrote them, which saves reading
    the file again. (The build's seal fsyncs its files together afterwards.)"""
    path = directory.path / name
    try:
        f = directory.open_file(name)
    except FileNotFoundError:
        raise CacheCorruptError(path, "a data file the build made is missing") from None
    except OSError as e:
        if e.errno not in NOT_A_FILE_ERRNOS:
            raise
        raise CacheCorruptError(path, f"a data file of the build is not a regular file ({e}); "
                                      "nothing was published") from None
    with f:
        shape, dtype = _header(f, path)
        _validated_offset(f, path, shape, dtype, None)
        if digest is None:
            size, digest = checksum_of(f)
        else:
            size = os.fstat(f.fileno()).st_size
    return shape, dtype, size, digest


def checksum_of_bytes(data: Any) -> str:
    """The checksum of ``data`` (any C-contiguous buffer)."""
    whole = hasher()
    whole.update(data)
    return hex_checksum(whole)


def block_checksums(directory: _fs.DirHandle, name: str, block_rows: int
                    ) -> tuple[str, np.ndarray]:
    """(the whole file's checksum, a (B, 16) uint8 array of each block's digest) of the
    .npy file ``name`` of ``directory``: block ``b`` holds its rows [b * block_rows,
    (b + 1) * block_rows). One read of the file: a reader that copies some rows out of it
    checks only the blocks it reads (:func:`block_digest`)."""
    path = directory.path / name
    whole = hasher()
    with directory.open_file(name) as f:
        shape, dtype = _header(f, path)
        offset = _validated_offset(f, path, shape, dtype, None)
        rows = shape[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        count = -(-rows // block_rows) if rows else 0
        blocks = np.zeros((count, 16), dtype=np.uint8)
        fd = f.fileno()
        whole.update(_pread_all(fd, offset, 0, path))
        position = offset
        for b in range(count):
            size = (min(rows, (b + 1) * block_rows) - b * block_rows) * row_bytes
            data = _pread_all(fd, size, position, path)
            whole.update(data)
            blocks[b] = np.frombuffer(block_digest(data), dtype=np.uint8)
            position += size
    return hex_checksum(whole), blocks


def block_digest(data: Any) -> bytes:
    """The 16-byte digest of one block of rows (:func:`block_checksums`)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def _pread_all(fd: int, size: int, position: int, path: Path) -> bytes:
    data = os.pread(fd, size, position)
    if len(data) != size:
        raise CacheCorruptError(path, "the file is shorter than its rows")
    return data


def write_small(directory: _fs.DirHandle, name: str, array: np.ndarray) -> str:
    """Write ``array`` as a new .npy file ``name`` of ``directory`` (an entry's per-row
    records: row identities, block digests, file stats), as :func:`create_array` lays it
    out; its checksum, so that the seal need not read it again. Not flushed: a build's
    commit fsyncs every file it publishes."""
    array = np.ascontiguousarray(array)
    data = _padded_header(array.shape, array.dtype, HEADER_ALIGN) + array.tobytes()
    directory.write_new(name, data, durable=False)
    return checksum_of_bytes(data)


def read_small(directory: _fs.DirHandle, name: str, shape: tuple[int, ...], dtype: np.dtype,
               size: int, digest: str, limit: int) -> np.ndarray:
    """Read the whole .npy file ``name`` of ``directory`` into memory, checked: its size is
    ``size`` (at most ``limit``), its checksum ``digest``, its header ``shape`` and
    ``dtype``. CacheCorruptError when anything disagrees; the array is read-only."""
    with directory.open_file(name) as f:
        return read_small_at(f.fileno(), directory.path / name, shape, dtype, size, digest,
                             limit)


def read_small_at(fd: int, path: Path, shape: tuple[int, ...], dtype: np.dtype, size: int,
                  digest: str, limit: int) -> np.ndarray:
    """:func:`read_small` of the open file ``fd`` (``path`` names it in errors), read by
    position."""
    if size > limit:
        raise CacheCorruptError(path, f"the file is said to be {size} bytes, more than "
                                f"{limit}")
    data = os.pread(fd, size + 1, 0)
    if len(data) != size:
        raise CacheCorruptError(path, f"file is {len(data)} bytes, expected {size}")
    if checksum_of_bytes(data) != digest:
        raise CacheCorruptError(path, "checksum mismatch")
    f = io.BytesIO(data)
    file_shape, file_dtype = _header(f, path)
    offset = f.tell()
    if file_shape != tuple(shape) or file_dtype != np.dtype(dtype):
        raise CacheCorruptError(path, f"header says {file_dtype} {tuple(file_shape)}, "
                                f"expected {np.dtype(dtype)} {tuple(shape)}")
    if size != offset + math.prod(shape) * np.dtype(dtype).itemsize:
        raise CacheCorruptError(path, f"file is {size} bytes, not as its header says")
    array = np.frombuffer(data, dtype=np.dtype(dtype), offset=offset,
                          count=math.prod(shape)).reshape(shape)
    return array


def open_readonly(directory: _fs.DirHandle, name: str) -> np.ndarray:
    """Map any well-formed .npy file ``name`` of ``directory`` read-only, whatever its
    shape and dtype (the caller checks them); CacheCorruptError when it is malformed."""
    with directory.open_file(name) as f:
        shape, dtype = _header(f, directory.path / name)
        if dtype.hasobject:
            raise CacheCorruptError(directory.path / name, "a dtype of Python objects")
        offset = _validated_offset(f, directory.path / name, shape, dtype, None)
        return _map(f, shape, dtype, "r", offset)


def checksum(path: Path) -> tuple[int, str]:
    """(size, blake2b-128) of a whole file, header included, read in large blocks."""
    with _fs.open_regular(path) as f:
        return checksum_of(f)


def checksum_of(f: BinaryIO) -> tuple[int, str]:
    """(size, blake2b-128) of the whole of the open file ``f``, read from its start."""
    whole = hasher()
    size = 0
    f.seek(0)
    for block in iter(lambda: f.read(CHECKSUM_BLOCK), b""):
        whole.update(block)
        size += len(block)
    return size, hex_checksum(whole)


def open_data(path: Path, what: str = "data file") -> int:
    """A descriptor of the entry's file ``path`` (``what`` it is, for errors), opened
    read-only: no symlink, no FIFO (never read outside the root); CacheCorruptError when
    it is missing or not a file."""
    try:
        return _fs.open_regular_fd(path)
    except FileNotFoundError:
        raise CacheCorruptError(path, f"{what} is missing") from None
    except OSError as e:
        if e.errno not in NOT_A_FILE_ERRNOS:
            raise  # an I/O error (EIO, EACCES, ...) is not evidence of a corrupt entry
        raise CacheCorruptError(path, f"{what} is not a regular file ({e})") from None


class _Positional:
    """The little of a read-only file that numpy's header parser and ``np.memmap`` use,
    over a descriptor, with a position of its own: reads are ``pread``s, so that no two
    users of one descriptor move each other's offset."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd, self.name, self._at = fd, name, 0

    def fileno(self) -> int:
        return self._fd

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._at
        elif whence == os.SEEK_END:
            offset += os.fstat(self._fd).st_size
        self._at = offset
        return offset

    def tell(self) -> int:
        return self._at

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, os.fstat(self._fd).st_size - self._at)
        data = os.pread(self._fd, size, self._at)
        self._at += len(data)
        return data


def check_header(f: BinaryIO, path: Path, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Check an open .npy file's header and size against shape/dtype; return the offset."""
    return _validated_offset(f, path, shape, dtype, None)


_PLAIN_HEADER = re.compile(rb"\{'descr': '([<>|=][a-z]\d{1,2})', 'fortran_order': False, "
                           rb"'shape': \(((?:\d+, )*\d+,?|)\), \} *\n")
"""The header numpy writes for a plain dtype, parsed without ``ast.literal_eval`` (a build
and an open read a few dozen headers); any other header goes to numpy's parser."""


def _brief(error: Exception, limit: int = 200) -> str:
    """``error``'s message on one line and at most ``limit`` characters: numpy quotes a
    header it cannot parse whole, and a header is padded to 4 KiB with spaces."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _header(f: BinaryIO, path: Path) -> tuple[tuple[int, ...], np.dtype]:
    try:
        f.seek(0)
        start = f.read(10)
        if start[:8] == b"\x93NUMPY\x01\x00":
            length = int.from_bytes(start[8:10], "little")
            plain = _PLAIN_HEADER.fullmatch(f.read(length))
            if plain is not None:
                shape = tuple(int(n) for n in plain[2].split(b",") if n.strip())
                return shape, np.dtype(plain[1].decode("ascii"))
        f.seek(0)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(
                f, max_header_size=MAX_HEADER_BYTES)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(
                f, max_header_size=MAX_HEADER_BYTES)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (OSError, ValueError, TypeError, SyntaxError) as e:
        raise CacheCorruptError(path, f"unreadable .npy header ({_brief(e)})") from None
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
