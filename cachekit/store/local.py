"""The local entry store: published entries, build directories and locks under one root
(:mod:`.layout` draws it).

Lookup takes no lock and writes nothing (its caller records the use, and removes what it
refused); a build is a private directory under ``tmp/``
(:class:`~.build_dirs.BuildDir`) that :mod:`.commit` publishes by one atomic rename; removal
renames first, then deletes. Every operation goes through directory handles opened without
following symlinks, so nothing planted under a shared root is ever written or deleted
through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from .. import _fs, file_modes, liveness, processes
from . import commit as commits
from . import failures
from . import manifest as manifests
from .row_index import RowIndex
from .._version import __version__
from ..errors import CacheCorruptError, ReadOnlyCacheError, UnsignedEntryError
from ..key_names import is_key
from ..messages import say
from .build_dirs import HEARTBEAT_FILE, RESUMED_PREFIX, BuildDir, BuildState, read_state
from .layout import Layout, Published, Refused, check_root
from .manifest import FileRecord, Manifest
from .temp_names import build_dir_name, parse_build_dir_name, trash_name

__all__ = ["LocalStore", "MakeRoom"]

MakeRoom = Callable[[int, list[str]], None]
"""Told the bytes a build or a download is about to write into a local store and the keys
it must keep (its own first, then the entries it shares rows with): removes the least
recently used entries that leave that much room within the cache's budget."""


class LocalStore:
    """Entries under one cache root: lookup, begin, commit, remove, scan.

    The root's ``entries/``, ``tmp/`` and ``locks/`` must be real directories: each is
    opened with ``O_DIRECTORY|O_NOFOLLOW`` for every operation, and all that happens inside
    happens through those handles, so no planted symlink is ever written or deleted through.
    """

    def __init__(self, root: Path) -> None:
        check_root(Path(root))  # here, not eleven frames into the first build
        self.layout = Layout(Path(root))
        self.row_index = RowIndex(self)
        """Which of this store's entries hold which rows (a hint; its files go with their
        entries: :meth:`remove_entry`)."""

    @property
    def root(self) -> Path:
        return self.layout.root

    # Lookup ------------------------------------------------------------------------------

    def lookup(self, key: str) -> Union[Published, Refused, None]:
        """The published entry for ``key``, or None. Takes no lock and writes nothing: the
        caller records the use (:meth:`record_use`).

        CacheCorruptError when the entry exists but its manifest is missing or bad (an
        entry that a removal takes away while we read it is a miss). With
        ``CACHEKIT_SIGNING_KEY`` set, an entry without a valid signature is returned as
        :class:`Refused`, for the caller to remove (:meth:`remove_refused`) and build again.
        """
        entry_dir = self.layout.entry_dir(key)
        with self.layout.open_entry(key) as entry:
            if entry is None:
                return None
            try:
                return Published(entry_dir, manifests.read_at(entry, key))
            except FileNotFoundError:
                if not self.layout.still_entry(key, entry):
                    return None  # removed while we read it (renamed aside, then deleted)
                raise CacheCorruptError(entry_dir / manifests.MANIFEST_FILE,
                                        "the manifest is missing") from None
            except UnsignedEntryError as refused:
                return Refused(key, refused)

    def record_use(self, published: Published) -> None:
        """Mark ``published`` as used now, for prune and the budget (the entry's directory
        time; nothing in it is rewritten). Best effort: a read-only or foreign-owned root
        must still serve hits."""
        try:
            with self.layout.open_folder("entries") as entries:
                entries.touch(published.manifest.key)
        except (OSError, CacheCorruptError):
            pass

    def remove_refused(self, refused: Refused) -> None:
        """Move the refused entry out of ``entries/`` and delete it, and say so.

        Claimed by a rename first, then read again: if another process replaced it with a
        validly signed entry between our read and the rename, that one is put back instead.
        """
        key = refused.key
        trash = trash_name(key)
        try:
            with self.layout.open_folder("entries") as entries, \
                    self.layout.open_folder("tmp", create=True) as tmp:
                if not stat.S_ISDIR(entries.lstat(key).st_mode):
                    return
                entries.rename(key, tmp, trash)
                try:
                    with tmp.child(trash) as moved:
                        manifests.read_at(moved, key)
                    tmp.rename(trash, entries, key)
                    return  # a signed entry, published meanwhile: keep it
                except (OSError, ValueError):
                    pass  # still refused (or unreadable, or a new entry took the name)
                tmp.remove_tree(trash)
        except FileNotFoundError:
            return  # another process removed it first
        except OSError:
            raise refused.error from None  # e.g. a read-only root: cannot replace it
        say(f"refused entry {key[:12]}: {refused.error.reason}; removed it, a signed entry is "
            "built in its place", always=True)

    def still_published(self, published: Published) -> bool:
        """Whether ``published`` is still the entry under its key (not cleared meanwhile)."""
        try:
            return manifests.read(published.path) == published.manifest
        except (OSError, ValueError):
            return False

    # Builds ------------------------------------------------------------------------------

    def ensure_writable(self, key: str) -> None:
        """Create the root's folders; ReadOnlyCacheError when a build could not be stored."""
        try:
            for name in ("entries", "tmp", "locks"):
                self.layout.open_folder(name, create=True).close()
            if not (os.access(self.layout.locks, os.W_OK) and os.access(self.layout.tmp, os.W_OK)):
                raise PermissionError
        except PermissionError:
            raise ReadOnlyCacheError(self.root, key) from None
        except OSError as e:
            if e.errno == errno.EROFS:
                raise ReadOnlyCacheError(self.root, key) from None
            raise

    def builds(self, key: str, *, besides: Optional[str] = None) -> list[BuildState]:
        """Every build directory of ``key`` under ``tmp/``, live or dead, but ``besides``."""
        tmp = self.layout.open_folder_if_any("tmp")
        if tmp is None:
            return []
        with tmp:
            names = (n for n in tmp.names() if n.startswith(f"{key}.") and n != besides)
            states = (self._state(tmp, n) for n in names)
            return [s for s in states if s is not None and s.key == key]

    def build_state(self, path: Path) -> Optional[BuildState]:
        """Describe the build directory ``tmp/NAME``; None when it is gone or not a build."""
        tmp = self.layout.open_folder_if_any("tmp")
        if tmp is None:
            return None
        with tmp:
            return self._state(tmp, path.name)

    def _state(self, tmp: _fs.DirHandle, name: str) -> Optional[BuildState]:
        key, host, pid = parse_build_dir_name(name)
        if key is None:
            return None
        try:
            directory = tmp.child(name)
        except OSError:
            return None  # gone, a symlink or a file: not a build of ours to judge
        with directory:
            record = read_state(directory)
            itself = os.fstat(directory.fd)
            try:
                heartbeat = directory.lstat(HEARTBEAT_FILE).st_mtime
            except FileNotFoundError:  # a build that has not yet written its record
                heartbeat = itself.st_mtime
        uid = itself.st_uid
        owner = record if record and "host" in record and "pid" in record else \
            {"host": host, "pid": pid}
        alive = liveness.is_alive(owner, heartbeat, where=directory.path,
                                  abandoned=bool(record and record.get("abandoned") is True))
        return BuildState(key, directory.path, dict(owner), record, heartbeat, alive, uid)

    def begin(self, key: str) -> BuildDir:
        """A fresh build directory for ``key``, private to this process (no group or other
        write), its heartbeat beating."""
        name = build_dir_name(self.layout.entry_dir(key).name)
        tmp = self.layout.open_folder("tmp", create=True)
        try:
            tmp.mkdir(name, file_modes.private_dir_mode())
            directory = self._open_own(tmp, name)
        except BaseException:
            tmp.close()
            raise
        record = {"key": key, "format": manifests.FORMAT_VERSION,
                  "cachekit_version": __version__, **processes.owner(), "started": time.time()}
        return BuildDir(key, tmp, name, directory, record)

    def open_build_dir(self, state: BuildState) -> _fs.DirHandle:
        """Open another process's build directory to read it (never a symlink)."""
        with self.layout.open_folder("tmp") as tmp:
            return tmp.child(state.path.name)

    @staticmethod
    def _open_own(tmp: _fs.DirHandle, name: str) -> _fs.DirHandle:
        """Open the build directory just made as ``tmp/NAME``, checking that it is still
        ours: in a shared root another member may swap it at once for a symlink or a
        directory of theirs."""
        try:
            directory = tmp.child(name)
        except OSError as e:
            if e.errno not in _fs.NOT_A_FILE_ERRNOS:
                tmp.remove_tree(name)
                raise
            raise CacheCorruptError(tmp.path / name, "the new build directory was replaced by "
                                    "another process before it was opened", "nothing was "
                                    "written; try again, and see who writes under the root"
                                    ) from None
        st = os.fstat(directory.fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            directory.close()
            raise CacheCorruptError(tmp.path / name, "the new build directory was replaced by "
                                    "another user's", "nothing was written; try again, and "
                                    "see who writes under the root")
        return directory

    def claim_dead(self, build: BuildDir, dead: BuildState) -> Optional[_fs.DirHandle]:
        """Claim a dead build of this user for ``build`` to resume from: moved into
        ``build``'s directory by one rename (of two processes claiming it at once exactly
        one gets it, and a builder of it that wakes from a pause finds its build gone), then
        opened read-only and kept in ``build.resume_from``. The build copies from it only
        what it verifies; nothing in it is ever written again.

        None when it is gone, or is not a private directory of this user (another user's
        build state is never resumed, copied or joined)."""
        if dead.uid != os.geteuid():
            return None
        name = f"{RESUMED_PREFIX}{len(build.resume_from)}"
        try:
            build.tmp.rename(dead.path.name, build.dir, name)
        except FileNotFoundError:
            return None
        try:
            claimed = build.dir.child(name)
        except OSError:
            build.dir.remove_tree(name)  # swapped for a symlink or file meanwhile: unlinked
            return None
        st = os.fstat(claimed.fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            claimed.close()
            build.dir.remove_tree(name)
            return None
        build.resume_from.append(claimed)
        return claimed

    def remove_dead(self, dead: BuildState) -> None:
        """Remove a dead build's directory (claimed first, so only one process does)."""
        try:
            self.remove_temp(dead.path.name, dead.key)
        except PermissionError:
            pass  # another user's: `cachekit clear` reports it, and its owner can remove it

    def seal(self, build: BuildDir, files: Iterable[tuple[str, str]],
             digests: Optional[dict[str, str]] = None,
             durable: Iterable[str] = ()) -> tuple[FileRecord, ...]:
        """:func:`cachekit.store.commit.seal`: checksum the data files of ``build``,
        checked against their .npy headers (the commit fsyncs them)."""
        return commits.seal(build, files, digests, durable)

    def commit(self, build: BuildDir, manifest: Manifest, *,
               scratch: Callable[[str], bool] = lambda name: False) -> tuple[Published, bool]:
        """Publish ``build`` with ``manifest`` (its files sealed); (entry, True) when this
        build's rename won, (the entry another builder published first, False) otherwise.

        ``scratch(name)``: whether a file or folder of the build directory is the builder's
        own working state (removed before the rename); any other name the manifest does not
        list stops the commit."""
        with self.layout.open_folder("entries", create=True) as entries:
            return commits.commit(build, manifest, entries, self._winner, scratch=scratch)

    # Records beside an entry: its build failed (FAILED), its files changed (STALE) ---------

    def _winner(self, key: str) -> Optional[Published]:
        """For a commit that lost the race: the entry another builder published under
        ``key``; None when it is refused (removed: the commit then renames again)."""
        found = self.lookup(key)
        if isinstance(found, Refused):
            self.remove_refused(found)
            return None
        return found

    def write_record(self, kind: str, key: str, record: dict[str, Any]) -> None:
        """Write the ``kind`` record of ``key`` (``locks/KEY.KIND.json``, replaced whole,
        signed with signing on: :mod:`cachekit.store.failures`)."""
        with self.layout.open_folder("locks", create=True) as folder:
            failures.write(folder, self.layout.record_path(key, kind).name, key, record)

    def read_record(self, kind: str, key: str) -> tuple[Optional[dict[str, Any]],
                                                        Optional[str]]:
        """The ``kind`` record of ``key`` when it may be honoured, else why not (see
        :func:`cachekit.store.failures.read`)."""
        try:
            with self.layout.open_folder("locks") as folder:
                return failures.read(folder, self.layout.record_path(key, kind).name, key)
        except OSError:
            return None, None

    def forget_record(self, kind: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError), self.layout.open_folder("locks") as folder:
            folder.unlink(self.layout.record_path(key, kind).name)

    def failure_keys(self) -> list[str]:
        """Keys with a recorded build failure."""
        return self.keys_in_locks(self.layout.failure_path("0" * 32).name[32:])

    def keys_in_locks(self, *suffixes: str) -> list[str]:
        """The keys of the files ``locks/KEY`` + one of ``suffixes``, each once, sorted."""
        keys = {p.name[:-len(suffix)] for p in self.layout.paths_in("locks")
                for suffix in suffixes if p.name.endswith(suffix)}
        return sorted(k for k in keys if is_key(k))

    # Removal -----------------------------------------------------------------------------

    def remove_entry(self, key: str) -> bool:
        """Remove a published entry: renamed into ``tmp/deleting.*`` first (readers see all
        of it or none; processes that mapped it keep their bytes), then deleted. False when
        it was already gone. A planted symlink is unlinked, never followed."""
        aside = self.set_aside(key)
        if aside:
            self.remove_temp(aside, key)
        return aside is not None

    def set_aside(self, key: str) -> Optional[str]:
        """Rename the entry ``key`` into ``tmp/deleting.*`` (a removal under way) and return
        that name, for :meth:`remove_temp` once a handle opened on it before (a build
        linking its files) is done. None when it was gone; "" for a symlink or file there
        (unlinked)."""
        with self.layout.open_folder("entries") as entries, \
                self.layout.open_folder("tmp", create=True) as tmp:
            aside = self._move_out(entries, key, tmp, key)
        if aside is not None:
            self.row_index.forget(key)  # its rows are no longer there to share
        return aside

    def remove_temp(self, name: str, key: str) -> bool:
        """Remove the build directory or leftover ``tmp/NAME`` the same way."""
        with self.layout.open_folder("tmp") as tmp:
            trash = self._move_out(tmp, name, tmp, key)
            if trash:
                tmp.remove_tree(trash)
            return trash is not None

    @staticmethod
    def _move_out(parent: _fs.DirHandle, name: str, tmp: _fs.DirHandle,
                  key: str) -> Optional[str]:
        """Rename the directory ``parent/NAME`` to a fresh ``tmp/deleting.*`` name, returned;
        "" for a symlink or file there (unlinked, never followed); None when it is gone."""
        try:
            if not stat.S_ISDIR(parent.lstat(name).st_mode):
                parent.unlink(name)
                return ""
            trash = trash_name(key)
            parent.rename(name, tmp, trash)
        except FileNotFoundError:
            return None
        return trash

    # Scan --------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys that have a directory under ``entries/``, sorted (:meth:`lookup` tells
        whether each is a valid entry)."""
        entries = self.layout.open_folder_if_any("entries")
        if entries is None:
            return []
        with entries:
            found = []
            for name in entries.names():
                try:
                    if is_key(name) and stat.S_ISDIR(entries.lstat(name).st_mode):
                        found.append(name)
                except FileNotFoundError:
                    continue  # removed while we looked
            return sorted(found)

    def temp_dirs(self) -> list[Path]:
        """Everything directly under ``tmp/``."""
        return self.layout.paths_in("tmp")
