"""Build lock files left behind, and removing those no process holds.

A lock's holder removes ``locks/KEY.lock`` as it releases it
(:meth:`cachekit.store.locks.OsLock.release`), so a root keeps a lock file only while a
build holds it, and otherwise only what a killed builder, or an older cachekit (which kept
one lock file per key ever built), left. A removal takes those with the key's entry, build
directory or failure record, and ``clear`` and ``prune`` take the ones of keys that have
none of these left.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

from .. import _fs
from ..errors import CacheCorruptError
from ..store import LocalStore, locks
from .inspect import Scan

SUFFIXES = (".lock", ".lock" + locks.SOFT_SUFFIX, ".lock" + locks.HOLDER_SUFFIX)
"""An OS lock's file, a soft lock's (``CACHEKIT_LOCK=soft``: a killed holder's stays until
someone takes the lock over), and an OS lock holder's record (a killed holder's stays when
the next holder held the lock too briefly to write its own)."""


def lone_keys(store: LocalStore, found: Scan, failures: Iterable[str]) -> list[str]:
    """The keys with a lock file and no entry, build directory or failure record in
    ``found`` and ``failures`` (what a removal of those takes their lock file with)."""
    others = {e.key for e in found.entries} | {t.key for t in found.temp_dirs} | set(failures)
    return [k for k in store.keys_in_locks(*SUFFIXES) if k not in others]


def forget(store: LocalStore, key: str) -> bool:
    """Remove ``key``'s build lock files that no process holds (each taken at once and
    released, which removes it; a soft lock is taken over once its holder is dead), then
    an OS lock holder's record that shows no heartbeat. Whether a lock file went. Never
    makes a lock file, and never follows a ``locks`` folder that is a symlink."""
    path = store.layout.lock_path(key)
    os_lock = locks.OsLock(path)
    gone = False
    with contextlib.suppress(OSError, CacheCorruptError), \
            store.layout.open_folder("locks") as folder:
        for lock in (os_lock, locks.make_lock(path, "soft")):
            if _there(folder, lock.path.name) and lock.acquire(timeout=0):
                lock.release()
                gone = True
        if _there(folder, os_lock.holder_path.name) and not os_lock.holder_alive():
            folder.unlink(os_lock.holder_path.name)
            gone = True
    return gone


def _there(folder: _fs.DirHandle, name: str) -> bool:
    try:
        folder.lstat(name)
    except FileNotFoundError:
        return False
    return True
