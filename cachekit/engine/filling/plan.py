"""A build as a plan: which rows, of what shape and dtype, cut into which chunks.

Every process that works on one build (its builder, joiners on this host or on other hosts
of a shared root, a process that resumes it after a crash) follows the one plan the builder
wrote into the build directory, so they agree on every chunk's rows and bytes.

Chunks are page-aligned inside the one data file: its ``.npy`` header is padded so that the
data start on a page boundary (:data:`PAGE_BYTES`), and every chunk but the last holds a
whole number of pages. Writers on different hosts then never share a page, which matters
on network filesystems, where two hosts writing parts of one page lose one another's bytes.
A chunk holds a multiple of ``page / gcd(row_bytes, page)`` rows (the fewest rows whose
bytes fill whole pages), at most about :data:`MAX_CHUNK_ROWS` rows and
:data:`MAX_CHUNK_BYTES` bytes, and small enough that each worker gets several chunks when the
row count allows (late joiners find work, and the last chunk finishes soon after the rest).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from ...errors import CacheCorruptError
from ...small_json import is_count

PAGE_BYTES = max(4096, mmap.PAGESIZE)
"""The alignment of the data start and of every chunk boundary (a memory page)."""
MAX_CHUNK_ROWS = 1024
"""Rows per chunk at most, unless one page-aligned unit of rows alone is more."""
MAX_CHUNK_BYTES = 32 << 20
"""Bytes per chunk at most (a process executor returns a chunk's rows as one array)."""
CHUNKS_PER_WORKER = 16
"""Chunks per worker to aim for, when the row count allows: enough that processes joining
late still find free chunks, and that the last chunks, which joiners hold, end close
together (docs/joining.md compares 16 with 8). Balance among one
process's own workers comes from the executors' pieces, which cut across chunks. Each chunk
costs a claim, an msync and a durable done record: a few milliseconds."""
PLAN_FORMAT = 1


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of a build: the unit of claiming, flushing and resuming."""

    index: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """One build: ``rows`` rows of ``row_shape`` and ``dtype``, the data at byte ``offset`` of
    the data file, cut into chunks of ``chunk_rows`` rows (the last one may be shorter)."""

    key: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    offset: int
    page: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.row_shape)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        step = self.chunk_rows
        return tuple(Chunk(i, start, min(self.rows, start + step))
                     for i, start in enumerate(range(0, self.rows, step)))

    def chunk_of(self, row: int) -> Chunk:
        """The chunk that holds ``row``."""
        index = row // self.chunk_rows
        return Chunk(index, index * self.chunk_rows, min(self.rows, (index + 1) * self.chunk_rows))

    def byte_range(self, chunk: Chunk) -> tuple[int, int]:
        """[first, end) bytes of ``chunk`` in the data file."""
        return (self.offset + chunk.start * self.row_bytes,
                self.offset + chunk.stop * self.row_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "key": self.key, "rows": self.rows,
                "row_shape": list(self.row_shape), "dtype": self.dtype.str,
                "chunk_rows": self.chunk_rows, "offset": self.offset, "page": self.page}

    @classmethod
    def from_json(cls, raw: Any) -> "Plan":
        """Parse a plan written by :meth:`to_json`; ValueError when it is malformed (it was
        read from a build directory, so it is checked like any other file there)."""
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            raise ValueError("not a plan of this cachekit version")
        shape = raw.get("row_shape")
        numbers = [raw.get(k) for k in ("rows", "chunk_rows", "offset", "page")]
        if not (isinstance(raw.get("key"), str) and isinstance(shape, list)
                and all(map(is_count, shape)) and all(map(is_count, numbers))
                and isinstance(raw.get("dtype"), str)):
            raise ValueError("malformed plan")
        rows, chunk_rows, offset, page = numbers
        dtype = np.dtype(raw["dtype"])
        if dtype.hasobject or chunk_rows < 1 or page < 1 or offset % page:
            raise ValueError("malformed plan")
        return cls(raw["key"], rows, tuple(shape), dtype, chunk_rows, offset, page)


def make_plan(key: str, rows: int, row_shape: tuple[int, ...], dtype: Any, workers: int, *,
              offset: int, page: Optional[int] = None,
              max_rows: Optional[int] = None) -> Plan:
    """The plan of a build of ``rows`` rows whose data start at ``offset`` (a multiple of
    ``page``, default :data:`PAGE_BYTES`) of the data file."""
    page = PAGE_BYTES if page is None else page
    dtype = np.dtype(dtype)
    if offset % page:
        raise ValueError(f"the data must start on a page boundary, not at byte {offset}")
    return Plan(key, rows, tuple(row_shape), dtype,
                chunk_rows(rows, math.prod(row_shape) * dtype.itemsize, workers, page=page,
                           max_rows=max_rows), offset, page)


def chunk_rows(rows: int, row_bytes: int, workers: int, *, page: Optional[int] = None,
               max_rows: Optional[int] = None) -> int:
    """Rows per chunk: a multiple of the page-aligned unit, at most ``max_rows`` (default
    :data:`MAX_CHUNK_ROWS`) and :data:`MAX_CHUNK_BYTES` unless one unit is more, and at most
    ``rows / (CHUNKS_PER_WORKER * workers)`` (so each worker gets that many chunks when
    there are rows enough)."""
    page = PAGE_BYTES if page is None else page
    max_rows = MAX_CHUNK_ROWS if max_rows is None else max_rows
    unit = page // math.gcd(row_bytes, page) if row_bytes else 1
    cap = min(max_rows, MAX_CHUNK_BYTES // row_bytes if row_bytes else max_rows)
    share = max(1, rows // (CHUNKS_PER_WORKER * max(1, workers)))
    wanted = min(cap, share)
    return max(unit, wanted // unit * unit if wanted >= unit else unit)


# The rows of a fill that computes only some rows of a build (a derived entry's new rows):
# its journal names them (``todo.npy``, written before the plan), so that joiners and
# resumers fill only those rows; the fill's key is made from the build's key and its rows
# (:func:`cachekit.keys.rest_key`), so a joiner or a resumer checks that the plan is the one
# of those rows.

TODO_FILE = "todo.npy"


def write_todo(journal_dir: _fs.DirHandle, todo: np.ndarray) -> None:
    arrays.write_small(journal_dir, TODO_FILE, np.ascontiguousarray(todo, dtype="<i8"))


def read_todo(journal_dir: _fs.DirHandle, rows: int) -> Optional[np.ndarray]:
    """The rows a fill computes, or None when its record is missing or not rows of a build
    of ``rows`` rows (ascending, each once)."""
    try:
        todo = np.array(arrays.open_readonly(journal_dir, TODO_FILE))
    except (OSError, CacheCorruptError):
        return None
    if todo.ndim != 1 or todo.dtype != np.dtype("<i8"):
        return None
    if len(todo) and (todo[0] < 0 or todo[-1] >= rows or (np.diff(todo) <= 0).any()):
        return None
    return todo


def take(values: Sequence[Any], todo: np.ndarray) -> Sequence[Any]:
    """The values of rows ``todo``."""
    if isinstance(values, np.ndarray):
        return values[todo]
    return [values[int(i)] for i in todo]
