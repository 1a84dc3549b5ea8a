"""The files of a published entry, kept open while an :class:`~cachekit.Entry` lives.

An entry's rows are mapped from descriptors that stay open, so that its rows can be
mapped again from the very files that were mapped first: copy-on-write for
``entry.tensor()``, in a forked DataLoader worker, and in a worker that ``spawn`` or
``forkserver`` (Python 3.14's default on Linux) started, which receives the descriptors
themselves. That holds after ``clear``, ``prune`` or another process's budget removed the
entry, and after its key was built again in place: a removal unlinks names, and an open
descriptor keeps its file. Any other pickle (a task sent to a Dask worker) carries no
descriptor, and that process opens the entry by its path.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .. import arrays
from .manifest import ROW_MAP_FILE, FileRecord, Manifest
from .row_view import Rows, RowView, row_map_in

PASSED_FILES = 128
"""The most descriptors a child that multiprocessing starts is sent, all of its entries'
together (``forkserver`` refuses to start a child sent more than 252); an entry past
that opens its files by path there."""


class EntryFiles:
    """Descriptors of the files that ``manifest``'s rows are read from: its data files and,
    for a derived entry, its row map. They close when the object is collected or closed."""

    def __init__(self, entry_dir: Path, descriptors: dict[str, int]) -> None:
        self.path = entry_dir
        self._descriptors = descriptors
        self._closer = weakref.finalize(self, _close, list(descriptors.values()))

    @classmethod
    def open(cls, entry_dir: Path, manifest: Manifest) -> "EntryFiles":
        """Open the files of the entry ``manifest`` describes in ``entry_dir``;
        CacheCorruptError when one is missing or is not a regular file."""
        names = [(record.name, "data file") for record in manifest.data_files]
        if not manifest.contiguous:
            names.append((ROW_MAP_FILE, "row map"))
        descriptors: dict[str, int] = {}
        try:
            for name, what in names:
                descriptors[name] = arrays.open_data(entry_dir / name, what)
        except BaseException:
            _close(descriptors.values())
            raise
        return cls(entry_dir, descriptors)

    def rows(self, manifest: Manifest, mode: str = "r") -> Rows:
        """The rows, as :func:`open_rows` maps them, from these descriptors: every file
        checked again against ``manifest`` (the manifest these files were opened for)."""
        if manifest.contiguous:
            return self._map(manifest.files[0], mode)
        files = [self._map(record, "r") for record in manifest.data_files]
        where = row_map_in(self._descriptors[ROW_MAP_FILE], self.path / ROW_MAP_FILE,
                           manifest)
        return RowView(files, where)

    def _map(self, record: FileRecord, mode: str) -> np.ndarray:
        return arrays.map_descriptor(self._descriptors[record.name], self.path / record.name,
                                     record.shape, record.np_dtype, mode,
                                     expected_bytes=record.bytes)

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> "EntryFiles":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Passed as descriptors to a child that multiprocessing is starting (``spawn``,
        ``forkserver``); in any other pickle, nothing (None)."""
        from multiprocessing import context, reduction

        starting = context.get_spawning_popen()
        if starting is None or not self._closer.alive:
            return (_nothing, ())
        sent = len(getattr(starting, "_fds", ()))  # (the child's other descriptors so far)
        if sent + len(self._descriptors) > PASSED_FILES:
            return (_nothing, ())
        passed = {name: reduction.DupFd(fd) for name, fd in self._descriptors.items()}
        return (_received, (str(self.path), passed))


def open_rows(entry_dir: Path, manifest: Manifest, mode: str = "r") -> Rows:
    """The rows of the published entry ``manifest`` describes in ``entry_dir``: its data
    file mapped read-only (``"r"``) or copy-on-write (``"c"``), or for a derived entry a
    :class:`~cachekit.store.row_view.RowView` over its data files, through its checked
    row map. The mappings outlive the descriptors, which are closed."""
    with EntryFiles.open(entry_dir, manifest) as files:
        return files.rows(manifest, mode)


def _close(descriptors: Iterable[int]) -> None:
    for fd in descriptors:
        os.close(fd)


def _nothing() -> None:
    return None


def _received(path: str, passed: dict[str, Any]) -> EntryFiles:
    return EntryFiles(Path(path), {name: dup.detach() for name, dup in passed.items()})
