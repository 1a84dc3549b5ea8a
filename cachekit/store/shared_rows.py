"""A committed entry opened to share rows with a new build, checked before anything is
read from it.

Another build of the same recipe references rows of a published entry instead of decoding
them again (:mod:`cachekit.store.row_index` says which entries may hold them). The entry
is opened once, through one handle on its directory: its manifest is read and checked (its
signature too when ``CACHEKIT_SIGNING_KEY`` is set) and must name the recipe; its row
identities (and a derived entry's row map) are read whole and must match their checksums
in the manifest. A data file is opened through that handle only when a build links or copies it
(:meth:`SharedRows.open_data`), and its header and size must be the manifest's; the link is
then made from the open file itself (:meth:`cachekit._fs.DirHandle.link_open_file`), so
the entry may be cleared or pruned at any moment and no path is followed that another
process could swap. A build may share rows with hundreds of entries, more than a process
may hold open: it lets go of each handle once the entry's rows are read
(:meth:`SharedRows.release`), and a later open of one of its files opens the entry again,
which must then be the very entry read (its directory and manifest the same files).

What an entry's checked files say is kept for the process's next builds (the
:data:`MEMO_BYTES` last read): ten folds of one column open the same entry ten times, and
at 130,000 rows its identities and stats are 4 MB to read and checksum each time. A
committed entry never changes, so what was read holds while its directory is the same
(device, inode) and its manifest and the row files read are the same files, unchanged
(device, inode, size, mtime: a write changes the mtime, a rename the inode; not the
ctime, which every build that links a file changes, nor the directory's mtime, which
every hit sets), under the same signing key; the directory is opened, and those files
stat'ed, on every open all the same.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, BinaryIO, Optional

import numpy as np

from .. import _fs, arrays
from ..errors import CacheCorruptError
from . import manifest as manifests
from . import signing
from .kept import Kept
from .local import LocalStore
from .manifest import Manifest
from .row_view import read_row_file, row_map_at


@dataclass
class SharedRows:
    """An entry's rows, open to be shared: its open directory, its row identities ``ids``
    ((rows, 2), or (rows, 4) with the identities of the files' digests for an entry built
    with ``validate="content"``), for an images entry the files' stats when it was built,
    and for a derived entry its row map ``where`` ((rows, 2): file, row)."""

    key: str
    manifest: Manifest
    directory: Optional[_fs.DirHandle]
    """The entry's open directory; None once :meth:`release` let go of it."""
    ids: np.ndarray
    stats: Optional[np.ndarray]
    where: Optional[np.ndarray] = None
    store: Optional[LocalStore] = None
    """Where the entry was opened from by its key, to open it again after
    :meth:`release`; None for an entry that is no longer under its key (one set aside to be
    built again), whose handle is kept."""
    stamp: tuple[Any, ...] = ()
    """What the entry was when its rows were read (:func:`_stamp`)."""

    @cached_property
    def failed(self) -> np.ndarray:
        """A mask of the entry's rows that failed when it was built (stored as zeros)."""
        return self.manifest.failed()

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the index in ``manifest.data_files`` of the file holding each of ``rows``, the
        row in that file)."""
        if self.where is None:
            return np.zeros(len(rows), dtype=np.intp), np.asarray(rows, dtype=np.intp)
        return (self.where[rows, 0].astype(np.intp), self.where[rows, 1].astype(np.intp))

    def open_data(self, index: int) -> tuple[BinaryIO, int]:
        """Data file ``index`` (of ``manifest.data_files``) open, its size and header the
        manifest's: (the file, the byte its rows start at). OSError or CacheCorruptError
        when it is gone or differs."""
        record = self.manifest.data_files[index]
        directory = self._opened()
        f = directory.open_file(record.name)
        try:
            if os.fstat(f.fileno()).st_size != record.bytes:
                raise CacheCorruptError(directory.path / record.name,
                                        "size differs from the manifest's")
            offset = arrays.check_header(f, directory.path / record.name, record.shape,
                                         record.np_dtype)
        except BaseException:
            f.close()
            raise
        return f, offset

    def open_file(self, name: str) -> BinaryIO:
        """The entry's file ``name``, open for reading (OSError when it is gone)."""
        return self._opened().open_file(name)

    def release(self) -> None:
        """Close the entry's directory, if it can be opened again by its key: what was read
        of it stays, and :meth:`open_data` and :meth:`open_file` open it again."""
        if self.store is not None and self.directory is not None:
            self.directory.close()
            self.directory = None

    def _opened(self) -> _fs.DirHandle:
        """The entry's directory, opened again after :meth:`release` if need be: the entry
        now under the key must be the one read, or FileNotFoundError."""
        if self.directory is not None:
            return self.directory
        assert self.store is not None
        entry = _open_entry(self.store, self.key)
        try:
            if _stamp(entry, self.key) != self.stamp:
                raise FileNotFoundError(f"entry {self.key[:12]} changed since its rows were "
                                        "read")
        except BaseException:
            entry.close()
            raise
        self.directory = entry
        return entry

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
            self.directory = None

    def __enter__(self) -> "SharedRows":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


MEMO_BYTES = 64 << 20
"""Bytes of row files (identities, stats, row maps) kept for the process's next builds."""


@dataclass(frozen=True)
class _Checked:
    """What an entry's manifest and row files said when they were read and checked."""

    manifest: Manifest
    ids: np.ndarray
    stats: Optional[np.ndarray]
    where: Optional[np.ndarray]
    files: tuple[tuple[Any, ...], ...]
    """Each row file's :func:`cachekit._fs.file_version`, taken before the files were
    read."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.ids, self.stats, self.where) if a is not None)


_memo: Kept[_Checked] = Kept(MEMO_BYTES, lambda checked: checked.nbytes)


def open_shared_rows(store: LocalStore, key: str, recipe: str) -> Optional[SharedRows]:
    """The committed entry ``key`` of ``recipe`` opened to share rows, or None when it is
    gone, is of another recipe, lists no row identities, or fails any check."""
    try:
        entry = _open_entry(store, key)
    except OSError:
        return None
    try:
        checked, stamp = _checked(entry, key)
        reuse = checked.manifest.reuse
        if reuse is None or reuse.recipe != recipe:
            raise ValueError("not rows of this recipe")
    except (OSError, ValueError):  # gone, a symlink, refused, corrupt (CacheCorruptError)
        entry.close()
        return None
    except BaseException:
        entry.close()
        raise
    return SharedRows(key, checked.manifest, entry, checked.ids, checked.stats, checked.where,
                      store, stamp)


def _open_entry(store: LocalStore, key: str) -> _fs.DirHandle:
    with store.layout.open_folder("entries") as entries:
        return entries.child(key)


def _checked(entry: _fs.DirHandle, key: str) -> tuple[_Checked, tuple[Any, ...]]:
    """The manifest and row files of the open entry ``key``: read and checked, or as the
    process read them before when they and the directory are the same files, unchanged;
    and the entry's stamp, taken before they were read."""
    stamp = _stamp(entry, key)
    known = _memo.get(stamp)
    if known is not None and _row_file_stamps(entry, known.manifest) == known.files:
        return known, stamp
    checked = _read(entry, key)
    if _stamp(entry, key) == stamp and \
            _row_file_stamps(entry, checked.manifest) == checked.files:  # none changed meanwhile
        _memo.put(stamp, checked)
    return checked, stamp


def _read(entry: _fs.DirHandle, key: str) -> _Checked:
    manifest = manifests.read_at(entry, key)
    if manifest.reuse is None:
        raise ValueError("its rows are not offered for reuse")
    files = _row_file_stamps(entry, manifest)
    where = None if manifest.contiguous else row_map_at(entry, manifest)
    ids = read_row_file(entry, manifest, manifests.ROW_IDS_FILE, where)
    stats = read_row_file(entry, manifest, manifests.ROW_STATS_FILE, where)
    if ids is None or ids.shape[1] not in (2, 4) or ids.dtype != np.dtype("<u8") or (
            stats is not None and (stats.shape[1] != 2 or stats.dtype != np.dtype("<i8"))):
        raise ValueError("no row identities, or row files of another layout")
    for array in (ids, stats, where):
        if array is not None:
            array.setflags(write=False)  # shared by every build of the process
    return _Checked(manifest, ids, stats, where, files)


def _stamp(entry: _fs.DirHandle, key: str) -> tuple[Any, ...]:
    """What tells an entry apart from any other under its name: its directory (device and
    inode: every hit sets its mtime, the entry's last use), its manifest as a file, and the
    signing key its manifest was checked under (the key's digest, never the key)."""
    directory = os.fstat(entry.fd)
    secret = signing.key()
    return (key, directory.st_dev, directory.st_ino,
            _fs.file_version(entry.lstat(manifests.MANIFEST_FILE)),
            None if secret is None else hashlib.sha256(secret).digest())


def _row_file_stamps(entry: _fs.DirHandle, manifest: Manifest) -> tuple[tuple[Any, ...], ...]:
    """The stamps of the files of ``manifest`` that are not data files (the row files that
    are read whole), in its order."""
    data = {f.name for f in manifest.data_files}
    return tuple(_fs.file_version(entry.lstat(f.name)) for f in manifest.files
                 if f.name not in data)
