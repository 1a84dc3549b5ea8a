"""An entry's rows as a reader sees them: the data file's memmap for a contiguous entry,
a read-only :class:`RowView` for a derived one.

A derived entry (docs/incremental.md) holds the rows it decoded (if any) in its own
``data.npy`` and links the data files of the entries it shares rows with (its parts); its
row map says, for each row, which file holds it and where. The map is read whole and
checked against its checksum and against the files' row counts before anything is read
through it, so a map that points outside its files is a
:class:`~cachekit.errors.CacheCorruptError`, never wrong pixels; a process keeps the maps
it checked while their files stay the same.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from .. import _fs, arrays
from ..units import count
from ..errors import CacheCorruptError
from .kept import Kept
from .manifest import ROW_FILES_LIMIT, ROW_MAP_FILE, FileRecord, Manifest, sidecar_name

GATHER_ROWS = 4096
"""Rows whose files are looked up per step of a gather."""
COPY_BYTES = 64 << 20
"""Bytes of rows copied per step when a view is written elsewhere (memory stays flat)."""
KEPT_MAP_BYTES = 64 << 20
"""Bytes of checked row maps a process keeps (:func:`row_map_at`): a hit, its stale-file
check and the background check each open the map, which is 8 bytes a row."""
_kept_maps: Kept[np.ndarray] = Kept(KEPT_MAP_BYTES, lambda where: where.nbytes)


def copy_step(row_bytes: int) -> int:
    """Rows per step of a copy of rows of ``row_bytes`` bytes each: :data:`COPY_BYTES`."""
    return max(1, COPY_BYTES // max(1, row_bytes))


class RowView:
    """Read-only rows held by several data files, in the entry's row order.

    ``len``, ``shape``, ``dtype`` and ``ndim`` are the entry's; an integer gives a row,
    and a slice, a boolean mask or an array of integers gives a new numpy array of those
    rows; ``numpy.asarray(view)`` gathers every row. Any other index numpy takes (a tuple
    over the row's axes too, ``None``, ``...``) gives what numpy gives for the gathered
    array, reading only the rows it names."""

    def __init__(self, files: Sequence[np.ndarray], where: np.ndarray) -> None:
        # Plain ndarray views (each keeps its mapping alive): np.memmap's
        # __array_finalize__ is a large share of a batch's fancy index.
        self._files = [np.asarray(f) for f in files]
        self._file, self._row = where[:, 0], where[:, 1]  # (numpy indexes with <u4 as is)
        self._only = int(self._file[0]) if len(where) and (
            self._file.min() == self._file.max()) else None
        """The file that holds every row, if one does (a fold of one entry): a gather is
        then numpy's own."""
        first = self._files[0]
        self.shape: tuple[int, ...] = (len(where), *first.shape[1:])
        self.dtype: np.dtype = first.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<cachekit.RowView {self.dtype}{list(self.shape)} over {count(len(self._files), 'file')}>"

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:  # (numpy 2's protocol: the rows are gathered, always a copy)
            raise ValueError("a derived entry's rows are gathered from several files into "
                             "a new array: numpy.asarray(entry.array, copy=False) cannot "
                             "avoid a copy; ask for a contiguous entry (contiguous=True) "
                             "to map one file")
        out = self.take(np.arange(len(self)))
        return out if dtype is None else out.astype(dtype, copy=False)

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The gathered rows through DLPack: ``torch.as_tensor(view)`` and
        ``torch.tensor(view)`` take them as one array this way (without it, torch reads
        a view row by row, as a sequence, tens of times slower)."""
        return np.asarray(self).__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._files[0].__dlpack_device__()

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (tuple, bool, np.bool_)) or index is None or index is Ellipsis:
            return self._within_rows(index if isinstance(index, tuple) else (index,))
        if _is_integer(index):
            i = operator.index(index)
            if not -len(self) <= i < len(self):
                raise IndexError(f"index {i} is out of range for {len(self)} rows")
            i %= len(self)
            return self._files[self._file[i]][self._row[i]]
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        wanted = _row_index(index)
        if wanted.dtype == bool:
            if wanted.ndim > 1:  # (it selects along the next axes too)
                return np.asarray(self)[wanted]
            if wanted.shape != (len(self),):
                raise IndexError(f"a boolean index of {len(self)} rows has shape "
                                 f"{wanted.shape}")
            return self.take(np.flatnonzero(wanted))
        return self.take(wanted)

    def _in_range(self, rows: np.ndarray) -> np.ndarray:
        """Integer ``rows``, negative from the end, as row numbers; IndexError for one out
        of range."""
        n = len(self)
        low, high = (rows.min(), rows.max()) if rows.size else (0, 0)
        if low < -n or high >= n:
            bad = rows[(rows < -n) | (rows >= n)].flat[0]
            raise IndexError(f"index {int(bad)} is out of range for {n} rows")
        return np.where(rows < 0, rows + n, rows) if low < 0 else rows

    def _within_rows(self, parts: tuple[Any, ...]) -> np.ndarray:
        """``self[parts]`` for a tuple index, as numpy indexes the gathered array: the rows
        its first-axis part names are gathered, and the whole index applied to them with
        that part pointing into the gathered rows (so numpy orders the axes of mixed
        indexes, and raises its own errors). An Ellipsis first, then integers and slices
        of the row's axes (``view[..., 0]``), reads every row a step at a time; any other
        Ellipsis or a boolean scalar before the rows' part, or a boolean array of more
        than one axis, gathers every row."""
        at = next((i for i, part in enumerate(parts) if part is not None), None)
        head = None if at is None else parts[at]
        if at == 0 and head is Ellipsis and self._rows_lead(parts[1:]):
            return self._in_steps((slice(None), *parts))
        if head is None or head is Ellipsis or isinstance(head, (bool, np.bool_)):
            return np.asarray(self)[parts]
        if _is_integer(head):
            rows, head = self[head][np.newaxis], 0
        elif isinstance(head, slice):
            rows, head = self[head], slice(None)
        else:
            wanted = _row_index(head)
            if wanted.dtype == bool and wanted.ndim > 1:
                return np.asarray(self)[parts]
            if wanted.dtype == bool:
                rows, head = self[wanted], np.arange(int(wanted.sum()))
            else:
                wanted = self._in_range(wanted)
                chosen = np.unique(wanted)
                rows, head = self.take(chosen), np.searchsorted(chosen, wanted)
        return rows[(*parts[:at], head, *parts[at + 1:])]

    def _rows_lead(self, after: tuple[Any, ...]) -> bool:
        """Whether ``self[(..., *after)]`` keeps every row on its first axis: ``after``
        holds only integers, slices and None, and leaves the Ellipsis the row's axis."""
        basic = all(part is None or isinstance(part, slice) or _is_integer(part)
                    for part in after)
        return basic and len(self) > 0 and sum(p is not None for p in after) < self.ndim

    def _in_steps(self, index: tuple[Any, ...]) -> np.ndarray:
        """``np.asarray(self)[index]`` for an ``index`` that takes every row in order and
        keeps them on the first axis, gathered a step of rows at a time (:func:`copy_step`):
        memory holds the result and one step, not every row whole."""
        step = copy_step(self.nbytes // len(self))
        out: Optional[np.ndarray] = None
        for start in range(0, len(self), step):
            rows = np.arange(start, min(start + step, len(self)))
            piece = self.take(rows)[index]
            if out is None:
                out = np.empty((len(self), *piece.shape[1:]), dtype=piece.dtype)
            out[start:start + len(rows)] = piece
            del piece  # (often a view of the step's rows: they go before the next step)
        assert out is not None
        return out

    def __setitem__(self, index: Any, value: Any) -> None:
        # numpy's own error for the read-only memmap of a contiguous entry: one except
        # clause holds for both kinds of entry.
        raise ValueError("assignment destination is read-only")

    def take(self, rows: np.ndarray) -> np.ndarray:
        """A new array of ``rows`` (integers, negative from the end), read file by file."""
        rows = np.asarray(rows, dtype=np.intp)
        flat = self._in_range(rows).reshape(-1)
        shape = (*rows.shape, *self.shape[1:])
        if self._only is not None:
            return self._files[self._only][self._row[flat]].reshape(shape)
        out = np.empty((len(flat), *self.shape[1:]), dtype=self.dtype)
        for start in range(0, len(flat), GATHER_ROWS):
            part = flat[start:start + GATHER_ROWS]
            files, at, into = self._file[part], self._row[part], out[start:start + len(part)]
            first = files[0] if len(files) else 0
            if (files == first).all():  # the common case: one file serves the whole step
                # ("clip": rows were checked against the files; "raise" buffers the copy)
                np.take(self._files[first], at, axis=0, out=into, mode="clip")
                continue
            for f in np.unique(files):
                here = np.flatnonzero(files == f)
                into[here] = self._files[f][at[here]]
        return out.reshape(shape)


def _is_integer(index: Any) -> bool:
    return isinstance(index, (int, np.integer)) and not isinstance(index, bool)


def _row_index(index: Any) -> np.ndarray:
    """``index`` (a boolean mask or integers) as an array; IndexError for anything else."""
    wanted = np.asarray(index)
    if wanted.size == 0 and not isinstance(index, np.ndarray):  # ([] is float64 to numpy)
        wanted = wanted.astype(np.intp)
    if wanted.dtype != bool and wanted.dtype.kind not in "iu":
        raise IndexError("only integers, slices, boolean masks and integer arrays index "
                         "the rows of an entry")
    return wanted


Rows = Union[np.ndarray, RowView]
"""An entry's rows: a read-only memmap (contiguous) or a :class:`RowView` (derived)."""


def open_row_file(entry_dir: Path, manifest: Manifest, name: str) -> Optional[Rows]:
    """The row file ``name`` (row identities or file stats) of every row, mapped as the
    rows are: the file itself for a contiguous entry, a :class:`RowView` over the
    entry's own file and its parts' copies for a derived one; None when there is none.
    Nothing is read until rows are asked for (a hit checks a sample of the stats)."""
    if manifest.contiguous:
        own = manifest.row_file(name)
        return None if own is None else own.open(entry_dir)
    found = _derived_row_files(entry_dir, manifest, name)
    if found is None:
        return None
    own, copies, width = found
    files = [record.open(entry_dir) for record in ([own] if own else []) + copies]
    return RowView([f[:, :width] for f in files], read_row_map(entry_dir, manifest))


def _derived_row_files(entry_dir: Path, manifest: Manifest, name: str
                       ) -> Optional[tuple[Optional[FileRecord], list[FileRecord], int]]:
    """Of the derived entry's row file ``name``: its own record (None for an entry that
    holds no row of its own), its parts' copies, and the words of a row the entry reads
    (a part's identities may hold two more, its files' digests); None when its rows have
    no such file. CacheCorruptError when a copy is missing or of another layout."""
    if not manifest.has_row_records(name):
        return None
    own = _own_row_file(entry_dir, manifest, name)
    copies = [manifest.row_file(sidecar_name(part.name, name)) for part in manifest.parts]
    present = [copy for copy in copies if copy is not None and len(copy.shape) == 2]
    if len(present) != len(copies):
        raise CacheCorruptError(entry_dir / name, "a part's copy is missing or of another "
                                "layout")
    first = own if own is not None else present[0]
    width = first.shape[1] if own is not None else min(copy.shape[1] for copy in present)
    if any(copy.dtype != first.dtype or copy.shape[1] < width for copy in present):
        raise CacheCorruptError(entry_dir / name, "a part's copy is of another layout")
    return own, present, width


def _own_row_file(entry_dir: Path, manifest: Manifest, name: str) -> Optional[FileRecord]:
    """The record of the entry's own row file ``name``, if it lists one: a record of each
    row of its data file, or CacheCorruptError."""
    own, data = manifest.row_file(name), manifest.own
    if own is not None and (len(own.shape) != 2 or data is None
                            or own.shape[:1] != data.shape[:1]):
        raise CacheCorruptError(entry_dir / name, f"holds {list(own.shape)}, not a record of "
                                "each row of the data file")
    return own


def read_row_map(entry_dir: Path, manifest: Manifest) -> np.ndarray:
    """The derived entry's (rows, 2) row map, read whole, its checksum and every pair
    checked against its files' rows; CacheCorruptError when any is wrong."""
    try:
        with _fs.DirHandle.open(entry_dir) as directory:
            return row_map_at(directory, manifest)
    except FileNotFoundError:  # (removed since its data files were opened)
        raise CacheCorruptError(entry_dir / ROW_MAP_FILE, "row map is missing") from None
    except OSError as e:
        if e.errno not in _fs.NOT_A_FILE_ERRNOS:
            raise
        raise CacheCorruptError(entry_dir, "an entry is never a symlink or a file") from None


def row_map_at(directory: _fs.DirHandle, manifest: Manifest) -> np.ndarray:
    """:func:`read_row_map` of the open entry directory ``directory``: read and checked
    once per process while the file is the same (device, inode, size, mtime) and the
    manifest records the same checksum and row counts; read-only."""
    record = manifest.row_file(ROW_MAP_FILE)
    assert record is not None
    return _kept_row_map(manifest, directory.lstat(record.name),
                         lambda: _read_small(directory, record), directory.path / record.name)


def row_map_in(fd: int, path: Path, manifest: Manifest) -> np.ndarray:
    """:func:`row_map_at` of the derived entry's row map file, open as ``fd`` (``path``
    names it in errors)."""
    record = manifest.row_file(ROW_MAP_FILE)
    assert record is not None
    return _kept_row_map(manifest, os.fstat(fd), lambda: arrays.read_small_at(
        fd, path, record.shape, record.np_dtype, record.bytes, record.checksum,
        ROW_FILES_LIMIT), path)


def _kept_row_map(manifest: Manifest, st: os.stat_result, read: Callable[[], np.ndarray],
                  path: Path) -> np.ndarray:
    """The row map kept for this version ``st`` of its file, else ``read()`` and checked."""
    record = manifest.row_file(ROW_MAP_FILE)
    assert record is not None
    rows = tuple(f.shape[0] for f in manifest.data_files)
    same = (_fs.file_version(st), record.checksum, rows)
    where = _kept_maps.get(same)
    if where is None:
        where = read()
        check_row_map(where, rows, path)
        where.setflags(write=False)
        _kept_maps.put(same, where)
    return where


def read_row_file(directory: _fs.DirHandle, manifest: Manifest, name: str,
                  where: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """The row file ``name`` (row identities or file stats) of every row of the open entry
    ``directory``, read whole and checked against its checksum; None when the entry has
    none. A derived entry's are gathered through its row map (``where``, read when not
    given) from its own file, of the rows it decoded, and its parts' copies of theirs;
    identities keep the entry's own width (a part's may hold two more words)."""
    if manifest.contiguous:
        own = _own_row_file(directory.path, manifest, name)
        return None if own is None else _read_small(directory, own)
    found = _derived_row_files(directory.path, manifest, name)
    if found is None:
        return None
    own, copies, width = found
    where = row_map_at(directory, manifest) if where is None else where
    pieces = [_read_small(directory, record) for record in ([own] if own else []) + copies]
    out = np.empty((manifest.rows, width), dtype=pieces[0].dtype)
    files = where[:, 0]
    for index, piece in enumerate(pieces):
        here = np.flatnonzero(files == index)
        out[here] = piece[where[here, 1].astype(np.intp), :width]
    return out


def _read_small(directory: _fs.DirHandle, record: Any) -> np.ndarray:
    return arrays.read_small(directory, record.name, record.shape, record.np_dtype,
                             record.bytes, record.checksum, ROW_FILES_LIMIT)


def check_row_map(where: np.ndarray, rows: Sequence[int], path: Any) -> None:
    """CacheCorruptError unless every (file, row) pair of ``where`` names a row of one of
    the files, whose row counts are ``rows``."""
    counts = np.asarray(rows, dtype=np.int64)
    files = where[:, 0].astype(np.int64)
    if len(files) and (files.max() >= len(counts) or
                       (where[:, 1].astype(np.int64) >= counts[files]).any()):
        raise CacheCorruptError(path, "the row map points outside the entry's data files")
