"""Where a cache root is, and where each kind of file of it lives.

::

    ROOT/
      entries/KEY/manifest.json        published, immutable; the manifest is written last
      entries/KEY/data.npy, leaf_N.npy the files the manifest lists (a per-row entry's
                                       row_ids.npy, row_blocks.npy, row_stats.npy too)
      index/RECIPE/KEY.npy             the row index of each recipe (a hint, see row_index)
      tmp/KEY.HOST.PID.UUID/           a private build directory: state.json (owner,
                                       progress), heartbeat (its mtime is the builder's
                                       heartbeat), data files and the builder's working
                                       files (a fill's chunk journal); resumed.N/, dead
                                       builds of this user it claimed to copy chunks from
      tmp/deleting.KEY.HOST.PID.UUID/  an entry or dead build being removed
      locks/KEY.lock                   build locks, while held (they only save duplicate work)
      locks/KEY.lock.holder            who holds the OS lock, its mtime their heartbeat
      locks/KEY.failed.json            the rows of the last failed build, for its waiters
      locks/KEY.stale.json             files of entry KEY that changed since its build
      locks/listing.UID.json           what user UID's last ``ls`` read of each manifest
      holds/KEY.HOST.PID.UUID          a live process holds entry KEY (see hold_records),
                                       its mtime a heartbeat
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator, Optional

from .. import _fs, file_modes
from ..errors import CacheCorruptError, CacheRootError, UnsignedEntryError
from ..key_names import is_key
from .manifest import Manifest


def default_root() -> Path:
    """$CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else ~/.cache/cachekit."""
    explicit = os.environ.get("CACHEKIT_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cachekit"


def check_root(root: Path) -> None:
    """CacheRootError when ``root``, or the nearest of its parents that exists, is not a
    directory (a root that does not exist yet is made by the first build)."""
    for path in (root, *root.parents):
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there (yet), or a parent further up is the blocker
        except OSError:
            return  # e.g. no permission to look: the first real use says so, in its words
        if not stat.S_ISDIR(mode):
            raise CacheRootError(root, path)
        return


def _root_not_made(root: Path, error: OSError) -> OSError:
    """``error``, raised making ``root`` (a parent that refuses new folders, such as
    ``/proc``, or no permission), said as the cache root that could not be made: the same
    OSError type, so that what caught it still does."""
    if type(error).__module__ != "builtins":  # (one of cachekit's own: said already)
        return error
    at = "" if error.filename in (None, str(root)) else f" at {error.filename}"
    return type(error)(error.errno, f"the cache root {root} cannot be made ({error.strerror}"
                       f"{at}); give Cache(root) (or --root, or CACHEKIT_DIR) a directory this "
                       "user can write, or a path where one can be made")


FAILED, STALE = "failed", "stale"
"""The records kept beside an entry: its last build failed, its files changed since."""


@dataclass(frozen=True)
class Layout:
    """Where each kind of file of one cache root lives."""

    root: Path

    @property
    def entries(self) -> Path:
        return self.folder("entries")

    @property
    def tmp(self) -> Path:
        return self.folder("tmp")

    @property
    def locks(self) -> Path:
        return self.folder("locks")

    def folder(self, name: str) -> Path:
        """The path of the root's folder ``name``, joined once per layout."""
        known = self._folders.get(name)
        if known is None:
            known = self._folders[name] = self.root / name
        return known

    @cached_property
    def _folders(self) -> dict[str, Path]:
        return {}

    def entry_dir(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.lock"

    def record_path(self, key: str, kind: str) -> Path:
        """``locks/KEY.KIND.json``: a record beside entry ``key`` (FAILED, STALE)."""
        if kind not in (FAILED, STALE):
            raise ValueError(f"not a kind of record: {kind!r}")
        return self.locks / f"{self.entry_dir(key).name}.{kind}.json"

    def failure_path(self, key: str) -> Path:
        return self.record_path(key, FAILED)

    def open_folder(self, name: str, *, create: bool = False) -> _fs.DirHandle:
        """The root's folder ``name`` (entries, tmp, locks or index) as a handle, made when
        ``create``: every operation of the store and its row index inside the root goes
        through such handles, so no planted symlink is ever written or deleted through.

        FileNotFoundError when it does not exist; CacheCorruptError when it is a symlink or
        not a directory. (Opened first and made only when missing: the folders exist on every
        call but the first, and making one costs a read of the umask.)"""
        try:
            return self._open_child(name)
        except FileNotFoundError:
            if not create:
                raise
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _root_not_made(self.root, e) from None
        with _fs.DirHandle.open(self.root, follow=True) as root:
            try:
                root.mkdir(name, file_modes.shared_dir_mode())
            except FileExistsError:
                pass
        return self._open_child(name)

    def _open_child(self, name: str) -> _fs.DirHandle:
        """The root's folder ``name`` in one open: the root may be a symlink the user made,
        the folder never is (``O_NOFOLLOW`` applies to the last component alone)."""
        path = self.folder(name)
        try:
            return _fs.DirHandle.open(path)
        except OSError as e:
            if e.errno not in _fs.NOT_A_FILE_ERRNOS:
                raise
            raise CacheCorruptError(path, "it is a symlink or not a directory, and cachekit "
                                    "never follows one", "remove it, and cachekit makes a "
                                    "real directory") from None

    def open_folder_if_any(self, name: str) -> Optional[_fs.DirHandle]:
        """:meth:`open_folder`, or None when the folder does not exist (yet)."""
        try:
            return self.open_folder(name)
        except FileNotFoundError:
            return None


    def paths_in(self, name: str) -> list[Path]:
        """Everything directly under the root's folder ``name`` ([] when it is missing)."""
        directory = self.open_folder_if_any(name)
        if directory is None:
            return []
        with directory:
            return [directory.path / child for child in directory.names()]

    @contextlib.contextmanager
    def open_entry(self, key: str) -> Iterator[Optional[_fs.DirHandle]]:
        """The directory of the entry of ``key`` by handle, None when there is none;
        CacheCorruptError for a symlink or file in its place."""
        entries = self.open_folder_if_any("entries")
        if entries is None:
            yield None
            return
        with entries:
            try:
                entry = entries.child(key)
            except FileNotFoundError:
                entry = None
            except OSError as e:
                if e.errno not in _fs.NOT_A_FILE_ERRNOS:
                    raise
                raise CacheCorruptError(self.entry_dir(key), "an entry is never a "
                                        "symlink or a file") from None
        if entry is None:
            yield None
            return
        with entry:
            yield entry

    def still_entry(self, key: str, entry: _fs.DirHandle) -> bool:
        """Whether the directory open as ``entry`` is still ``entries/KEY``: False once a
        removal renamed it aside (``clear``, ``prune`` and the budget do that first)."""
        try:
            with self.open_folder("entries") as entries:
                return _fs.same_file(entries.lstat(key), os.fstat(entry.fd))
        except FileNotFoundError:
            return False


@dataclass(frozen=True)
class Published:
    """A published entry: its directory and its checked manifest."""

    path: Path
    manifest: Manifest


@dataclass(frozen=True)
class Refused:
    """An entry that a lookup found and refused (no valid signature under
    ``CACHEKIT_SIGNING_KEY``): the caller decides to remove it."""

    key: str
    error: UnsignedEntryError
