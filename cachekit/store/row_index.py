"""The per-recipe row index: which committed entries hold which rows, found without reading
them (but for entries that hold no row of their own, below).

::

    ROOT/index/RECIPE/KEY.npy     one file per entry of that recipe, written after its commit

Each file (:mod:`cachekit.store.index_format`) holds the entry's row hashes (the first half
of each row's identity, :func:`cachekit.keys.row_identities`) sorted, the entry's row of
each, and a bitmap of the hashes' top bits. A lookup tests the bitmap first and
binary-searches only the hashes that pass (about one in nine of those absent), with the
column's hashes sorted once, so it reads each entry's file once and not the entry itself
(``benchmarks/bench_incremental.py`` times it; docs/incremental.md has the figures).

An entry that holds no row of its own (every row is in files of other entries) is indexed
by a hard link to its row map instead (``row_map.npy``, a (rows, 2) ``<u4`` array): the
link makes no new file, and a lookup that reaches it reads the rows' hashes from the entry
through the caller (``read_rows``). It reaches it only for rows that the entries it took
them from no longer hold (their files are larger, 17 bytes a row against 8, so they come
first): once those are gone, it lends them.

The index is a hint and nothing more. A file is written to a temporary name and renamed, so
a reader sees a whole file or none; a crash between an entry's commit and its index file
costs a later build some reuse, never a wrong row. Whatever a file says, the build that
reuses rows checks them against the entry itself (:mod:`cachekit.store.shared_rows`): its
manifest, the row identities it lists, and the header and size of every data file it
links. The store removes an entry's files with the entry (:meth:`RowIndex.forget`); the
file of an entry removed any other way is deleted by the next lookup that meets it, or by
``prune`` and ``clear`` (:meth:`RowIndex.forget_stray`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol

from .. import _fs, file_modes
from ..errors import CacheCorruptError
from ..key_names import is_key
from ..messages import say
from . import signing
from .layout import Layout
from .records import ROW_MAP_FILE

if TYPE_CHECKING:  # numpy, and what works with it, are imported where rows are looked up:
    import numpy as np  # listing the index (``cachekit ls``) needs neither

    from .index_format import Match, Needles

INDEX_FOLDER = "index"
STALE_TEMP_SECONDS = 3600.0
ReadRows = Callable[[str], Optional["tuple[np.ndarray, np.ndarray]"]]
"""``read_rows(key)``: (the lookup hashes, the rows) of the committed entry ``key`` that
may be offered, read from the entry and checked; None when it cannot be."""


class Rooted(Protocol):
    """What the index needs of its store: the root's layout (a
    :class:`~cachekit.store.local.LocalStore` has one). Typed so, not as LocalStore, because
    the store owns its index (``LocalStore.row_index``): this module never imports it."""

    @property
    def layout(self) -> Layout: ...


class RowIndex:
    """The row index of one local store: ``RowIndex(store)``, or the store's own
    ``store.row_index``. Its folders are opened through the store's layout, as the store
    opens its own (never through a symlink)."""

    def __init__(self, store: Rooted) -> None:
        self.layout = store.layout

    def add(self, recipe: str, key: str, hashes: np.ndarray,
            skip: Optional[np.ndarray] = None) -> None:
        """Index the committed entry ``key`` of ``recipe``: ``hashes`` its rows' lookup
        hashes in row order, ``skip`` a mask of rows not to offer (failed rows). Best
        effort: an error (a read-only root) leaves the entry unindexed."""
        from .index_format import index_array

        if not (is_key(recipe) and is_key(key)):
            raise ValueError("a recipe and a key are 32 hex digits")
        try:
            with self.layout.open_folder(INDEX_FOLDER, create=True) as index:
                with _recipe_folder(index, recipe) as folder:
                    _write(folder, f"{key}.npy", index_array(hashes, skip))
        except OSError:
            pass

    def link(self, recipe: str, key: str) -> bool:
        """Index the committed entry ``key`` of ``recipe``, which holds no row of its own
        and offers every row, by a hard link to its row map (one rename, no new file; a
        lookup reads its rows through ``read_rows``). False when it cannot be linked (the
        entry is gone, a filesystem without links): :meth:`add` it instead."""
        if not (is_key(recipe) and is_key(key)):
            raise ValueError("a recipe and a key are 32 hex digits")
        try:
            with self.layout.open_folder("entries") as entries, entries.child(key) as entry, \
                    entry.open_file(ROW_MAP_FILE) as row_map, \
                    self.layout.open_folder(INDEX_FOLDER, create=True) as index, \
                    _recipe_folder(index, recipe) as folder:
                tmp = _temp_name(f"{key}.npy")
                if not folder.link_open_file(row_map, tmp):
                    folder.unlink(tmp)
                    return False
                try:
                    os.replace(tmp, f"{key}.npy", src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
                except BaseException:
                    folder.unlink(tmp)
                    raise
            return True
        except OSError:
            return False

    def matches(self, recipe: str, needles: Needles, remaining: np.ndarray, *,
                read_rows: ReadRows, exclude: str = "", skipped: Optional[list[str]] = None
                ) -> Iterator[Match]:
        """For each indexed entry of ``recipe`` (but ``exclude``), the rows still True in
        ``remaining`` whose hash (``needles``: the column's, sorted once) it holds; the
        caller clears in ``remaining`` the rows it takes before it asks for the next entry.
        This user's entries come first, then those with the most rows; an entry indexed by
        its row map (:meth:`link`) is read through ``read_rows``. The files skipped (and
        why) are said on stderr, or added to ``skipped`` for the caller to say
        (:func:`skipped_note`)."""
        said = skipped is None
        skipped = [] if skipped is None else skipped
        try:
            with self.layout.open_folder(INDEX_FOLDER) as index, index.child(recipe) as folder, \
                    self.layout.open_folder("entries") as entries:
                for key in self._keys_by_size(folder, exclude, skipped):
                    live = remaining[needles.order]
                    if not live.any():
                        return
                    found = self._match(folder, entries, key, needles, live, skipped,
                                        read_rows)
                    if found is not None and len(found.dst):
                        yield found
        except (FileNotFoundError, NotADirectoryError, CacheCorruptError):
            return
        except OSError:
            return  # a symlink planted in place of the folder (ELOOP), an unreadable one
        finally:
            if said and skipped:
                say(skipped_note(recipe, skipped), always=True)

    def files(self, key: Optional[str] = None) -> dict[str, list[tuple[int, int, int]]]:
        """(device, inode, size) of the index files of each key (or of ``key`` alone), in
        every recipe's folder: bytes that belong to their entry (:meth:`forget` removes
        them with it)."""
        found: dict[str, list[tuple[int, int, int]]] = {}
        try:
            index = self.layout.open_folder_if_any(INDEX_FOLDER)
        except OSError:
            return found
        if index is None:
            return found
        with index:
            for recipe in (name for name in index.names() if is_key(name)):
                for name, file in _files_in(index, recipe, key):
                    found.setdefault(name, []).append(file)
        return found

    def forget(self, key: str) -> bool:
        """Remove the index files of the entry ``key`` (which was removed), in every
        recipe's folder, and the folders this leaves empty. True when none is left; False
        when one stayed (another member's, in a folder that forbids removing it). Best
        effort otherwise: a symlink in place of a folder is never followed, and the index is
        only ever a hint (a file another process adds to a folder removed meanwhile is lost,
        and its entry is decoded)."""
        kept = False
        try:
            index = self.layout.open_folder_if_any(INDEX_FOLDER)
            if index is None:
                return True
            with index:
                recipes = [name for name in index.names() if is_key(name)]
                for recipe in recipes:
                    try:
                        with index.child(recipe) as folder:
                            try:
                                folder.unlink(f"{key}.npy")
                            except OSError:
                                kept = True
                                continue
                            empty = not folder.names()
                    except OSError:
                        continue
                    if empty:
                        index.remove_empty_dir(recipe)
        except OSError:
            return False
        return not kept

    def forget_stray(self, key: str) -> bool:
        """Remove the index files of ``key`` when no entry ``key`` is published: the files
        of an entry removed outside cachekit, which name nothing (what a lookup does when it
        meets one). False, and nothing removed, when the entry is there; PermissionError
        when a file stays (:meth:`forget`)."""
        try:
            with self.layout.open_folder("entries") as entries:
                if _published(entries, key):
                    return False
        except FileNotFoundError:
            pass
        if not self.forget(key):
            raise PermissionError(f"could not remove the row index file of {key[:12]}")
        return True

    def _keys_by_size(self, folder: _fs.DirHandle, exclude: str,
                      skipped: list[str]) -> list[str]:
        """The entries indexed in ``folder``: this user's first (a build links their files
        and copies another user's rows), then most rows first; with signing on, only the
        files of this user (another member's index is not signed, so not trusted)."""
        sized = []
        uid = os.geteuid()
        trusted_uid = uid if signing.enabled() else None
        for name in folder.names():
            if name.startswith(".") and name.endswith(".tmp"):
                _drop_if_stale(folder, name)
                continue
            key = name[:-4] if name.endswith(".npy") else ""
            if not is_key(key) or key == exclude:
                continue
            try:
                st = folder.lstat(name)
            except FileNotFoundError:
                continue
            if trusted_uid is not None and st.st_uid != trusted_uid:
                skipped.append(f"{name} belongs to uid {st.st_uid}")
                continue
            sized.append((st.st_uid != uid, -st.st_size, -st.st_mtime, key))
        return [key for *_, key in sorted(sized)]

    def _match(self, folder: _fs.DirHandle, entries: _fs.DirHandle, key: str,
               needles: Needles, live: np.ndarray, skipped: list[str],
               read_rows: ReadRows) -> Optional[Match]:
        """The rows still ``live`` of ``needles`` whose hashes the entry ``key`` holds.

        The file is mapped, never read whole: its bitmap's bits are tested in place and its
        hashes binary-searched, so a lookup's memory is bounded by the column looked up
        whatever a planted file claims; a file whose size or bitmap disagrees with the row
        count in its header is skipped (``skipped`` says why). A row map (:meth:`link`)
        says only that its entry holds rows: they are read through ``read_rows``."""
        from .. import arrays
        from .index_format import is_row_map, search_index, search_rows

        if not _published(entries, key):
            folder.unlink(f"{key}.npy")  # its entry was removed: the file names nothing
            return None
        try:
            flat = arrays.open_readonly(folder, f"{key}.npy")
        except OSError:
            return None
        except CacheCorruptError:
            skipped.append(f"{key}.npy is malformed")
            return None
        if is_row_map(flat):
            return search_rows(key, read_rows(key), needles, live)
        found = search_index(key, flat, needles, live)
        if found is None:
            skipped.append(f"{key}.npy is not an index of its row count")
        return found


def skipped_note(recipe: str, skipped: list[str]) -> str:
    """What a lookup says of the index files of ``recipe`` it ``skipped`` (why, each)."""
    return (f"skipped {len(skipped)} row index file{'s' if len(skipped) > 1 else ''} of "
            f"recipe {recipe[:12]} ({skipped[0]}): the index is a hint, so those entries "
            "lend no rows to this build")


def _recipe_folder(index: _fs.DirHandle, recipe: str) -> _fs.DirHandle:
    """The index's folder of ``recipe``, made when missing."""
    try:
        return index.child(recipe)
    except FileNotFoundError:
        pass
    try:
        index.mkdir(recipe, file_modes.shared_dir_mode())
    except FileExistsError:
        pass
    return index.child(recipe)


def _files_in(index: _fs.DirHandle, recipe: str, only: Optional[str] = None
              ) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """(key, (device, inode, size)) of each entry's file in the folder of ``recipe`` (of
    the entry ``only``, when given); what is removed or swapped meanwhile is left out."""
    try:
        with index.child(recipe) as folder:
            for name in folder.names() if only is None else [f"{only}.npy"]:
                key = name[:-len(".npy")]
                if not (name.endswith(".npy") and is_key(key)):
                    continue
                try:
                    st = folder.lstat(name)
                except OSError:
                    continue
                yield key, (st.st_dev, st.st_ino, st.st_size)
    except OSError:
        return


def _published(entries: _fs.DirHandle, key: str) -> bool:
    try:
        entries.lstat(key)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: leave the file alone


def _drop_if_stale(folder: _fs.DirHandle, name: str) -> None:
    """Remove the temporary file ``name`` of a writer that died before its rename: one
    older than :data:`STALE_TEMP_SECONDS` (a writer renames within milliseconds)."""
    try:
        if time.time() - folder.lstat(name).st_mtime > STALE_TEMP_SECONDS:
            folder.unlink(name)
    except OSError:
        pass


def _temp_name(name: str) -> str:
    """A name to make ``name`` under, then rename: one a lookup skips (and removes once
    stale, :func:`_drop_if_stale`)."""
    return f".{name}.{_fs.unique_suffix()}.tmp"


def _write(folder: _fs.DirHandle, name: str, array: np.ndarray) -> None:
    """Write ``array`` as ``name`` in one step: readers see the old file, the new one or
    none, never a part."""
    from .. import arrays

    tmp = _temp_name(name)
    try:
        arrays.write_small(folder, tmp, array)
        os.replace(tmp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    except BaseException:
        folder.unlink(tmp)
        raise
