"""Holds that other machines see: a record per held entry in ``ROOT/holds/``, its mtime a
heartbeat.

A hold (:mod:`cachekit.store.holds`) is a flock on the entry's directory, which the
processes of one machine see, but Linux's NFS client keeps a directory's flock to the
machine that took it. So each hold also keeps a record, ``holds/KEY.HOST.PID.UUID``: its
owner as :func:`cachekit.processes.owner` writes it, written a lease / 4 after the hold
was taken (a hit writes nothing; under a dot name, renamed once whole) and its
mtime refreshed as often by the process's heartbeat timer, removed as the hold is let go.
A removal of unused entries passes over an entry that another host's record shows alive
by the rule of :mod:`cachekit.liveness` (a heartbeat younger than the lease). This host's
records are left to the flock, which tells exactly: a record that a killed process left
holds nothing back here, and on another host for one lease at most; ``prune``, a budget
and ``clear`` count and remove such records (:func:`dead`, :func:`forget`).

A record that cannot be written (a root this user cannot write, a ``holds`` folder that
is a symlink) is not: the hold is then seen on its machine only, and so is a hold in its
first lease / 4.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from .. import _fs, file_modes, liveness, processes
from ..errors import CacheCorruptError
from .layout import Layout

FOLDER = "holds"
_RECORD_LIMIT = 4096
"""Bytes of a record read at most: an owner is about a hundred."""
_UNFINISHED = "."
"""What a record's name starts with while it is written (``DirHandle.replace_json``'s
temporary name; no record's name does)."""


class Record:
    """This process's record of one hold, written by the heartbeat's first beat, a lease /
    4 after the hold was taken, and refreshed by each beat until :meth:`remove`.

    A hit thus writes nothing (a process that lets its entry go sooner writes no record),
    and no descriptor of the record stays open: a root's filesystem can still be
    remounted read-only under a process that holds an entry of it."""

    def __init__(self, layout: Layout, key: str) -> None:
        self.pid = os.getpid()
        self.layout, self.key = layout, key
        self.name = f"{key}.{_fs.unique_suffix()}"
        self.made: Optional[tuple[int, int]] = None
        """(device, inode) of the record once written."""
        self.removed = False
        self.heartbeat = liveness.Heartbeat(self._beat).start(at_once=False)

    def _beat(self) -> None:
        """Refresh the record, or write it; write it again when a removal took it for a
        dead one (this process was paused for longer than a lease)."""
        if self.removed:
            return
        with contextlib.suppress(OSError, CacheCorruptError):
            if self.made is not None:
                with self.layout.open_folder(FOLDER) as folder:
                    if self._ours(folder):
                        os.utime(self.name, dir_fd=folder.fd, follow_symlinks=False)
                        return
            self._write()

    def _write(self) -> None:
        """Write the record, in a ``holds`` folder made if need be, while the entry is
        there: never in a root removed since (a beat would make it again), nor for an
        entry removed since (which it would not protect)."""
        with _fs.DirHandle.open(self.layout.root, follow=True) as root:
            with root.child("entries") as entries:
                entries.lstat(self.key)
            try:
                root.mkdir(FOLDER, file_modes.shared_dir_mode())
            except FileExistsError:
                pass
            with root.child(FOLDER) as folder:  # (the group reads it; named once whole)
                st = folder.replace_json(self.name, processes.owner(),
                                         mode=file_modes.file_mode())
                self.made = st.st_dev, st.st_ino
                if self.removed:  # meanwhile, on this thread: a collection let the hold go
                    folder.unlink(self.name)

    def _ours(self, folder: _fs.DirHandle) -> bool:
        try:
            st = folder.lstat(self.name)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.made

    def remove(self) -> None:
        """Stop beating and remove the record, if it is still this process's own (a forked
        child, such as a DataLoader worker, leaves its parent's record alone)."""
        self.removed = True
        self.heartbeat.stop()
        if self.made is None or os.getpid() != self.pid:
            return
        with contextlib.suppress(OSError, CacheCorruptError), \
                self.layout.open_folder(FOLDER) as folder:
            if self._ours(folder):
                folder.unlink(self.name)


def record(entry_dir: Path) -> Record:
    """A record of this process's hold of the entry at ``entry_dir`` (``ROOT/entries/KEY``)."""
    return Record(Layout(entry_dir.parent.parent), entry_dir.name)


def held_elsewhere(layout: Layout, keys: Iterable[str]) -> set[str]:
    """Which of the entries ``keys`` a live process of another host holds, by its record."""
    wanted = set(keys)
    return {key for key, _ in _alive_elsewhere(layout, lambda key: key in wanted)}


def holders_elsewhere(layout: Layout, key: str) -> list[tuple[str, str]]:
    """(host, pid) of each live process of another host that holds the entry ``key``, as
    its record says them (any JSON a group member wrote: shown, never used)."""
    return sorted((str(owner.get("host")), str(owner.get("pid")))
                  for _, owner in _alive_elsewhere(layout, lambda found: found == key))


def _alive_elsewhere(layout: Layout, wanted: Callable[[str], bool]
                     ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(key, owner) of each record of another host's live process that holds a key
    ``wanted`` says yes to."""
    for folder, name, key in _records(layout):
        if wanted(key):
            owner = _owner(folder, name)
            if owner is not None and owner[0].get("host") != _fs.host() \
                    and liveness.is_alive(*owner):
                yield key, owner[0]


def dead(layout: Layout) -> list[str]:
    """The records of the root ``layout`` that hold nothing, of any entry: their processes
    are gone (killed, or ended by a SIGTERM, which runs no exit handler: a process removes
    its own as it lets go) or show no heartbeat for a lease; and those a writer killed
    before naming them. A removal of entries takes them (:func:`forget`), so that they do
    not pile up under entries that stay. A holder only paused writes its record again."""
    return [name for folder, name, _ in _records(layout, unfinished=True)
            if _dead(folder, name)]


def forget(layout: Layout, name: str) -> Optional[str]:
    """Remove the record ``name`` if it still holds nothing: None when it is gone, else
    why it stays."""
    try:
        with layout.open_folder(FOLDER) as folder:
            if not _dead(folder, name):
                return "its process holds the entry again"
            folder.unlink(name)
    except FileNotFoundError:
        pass
    return None


def key_of(name: str) -> str:
    """The key of the entry that the record ``name`` holds."""
    return name.lstrip(_UNFINISHED).partition(".")[0]


def _dead(folder: _fs.DirHandle, name: str) -> bool:
    """Whether the record ``name`` holds nothing: its process is gone or shows no
    heartbeat for a lease, or it is no record; or, still unnamed, its writer was killed
    before naming it (its mtime older than a lease)."""
    if name.startswith(_UNFINISHED):
        try:
            return not liveness.is_alive(None, folder.lstat(name).st_mtime)
        except FileNotFoundError:
            return True  # (named since, or removed: nothing to keep under this name)
        except OSError:
            return False
    owner = _owner(folder, name)
    return owner is None or not liveness.is_alive(*owner)


def _records(layout: Layout, unfinished: bool = False
             ) -> Iterator[tuple[_fs.DirHandle, str, str]]:
    """Each record of the root ``layout`` (and with ``unfinished``, each one being
    written): the open folder, its name, the key it holds."""
    try:
        folder = layout.open_folder(FOLDER)
    except (OSError, CacheCorruptError):
        return
    with folder:
        for name in folder.names():
            if unfinished or not name.startswith(_UNFINISHED):
                yield folder, name, key_of(name)


def _owner(folder: _fs.DirHandle, name: str) -> Optional[tuple[dict[str, Any], float]]:
    """The owner a record names and its last heartbeat; None when it is gone or no record."""
    try:
        with folder.open_file(name) as f:
            owner = json.loads(f.read(_RECORD_LIMIT))
            beat = os.fstat(f.fileno()).st_mtime
    except (OSError, ValueError, CacheCorruptError):
        return None
    return (owner, beat) if isinstance(owner, dict) else None
