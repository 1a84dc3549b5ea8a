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

from ..errors import CacheCorruptError
from ..key_names import is_key
from ..store import LocalStore, locks
from .inspect import Scan

SUFFIXES = (".lock", ".lock" + locks.SOFT_SUFFIX)
"""An OS lock's file, and a soft lock's (``CACHEKIT_LOCK=soft``: a killed holder's stays
until someone takes the lock over)."""


def lock_keys(store: LocalStore) -> list[str]:
    """The keys that have a build lock file in ``store`` (held, or left behind), once."""
    keys = {p.name[:-len(suffix)] for p in store.layout.paths_in("locks")
            for suffix in SUFFIXES if p.name.endswith(suffix)}
    return sorted(k for k in keys if is_key(k))


def lone_keys(store: LocalStore, found: Scan, failures: Iterable[str]) -> list[str]:
    """The keys with a lock file and no entry, build directory or failure record in
    ``found`` and ``failures`` (what a removal of those takes their lock file with)."""
    others = {e.key for e in found.entries} | {t.key for t in found.temp_dirs} | set(failures)
    return [k for k in lock_keys(store) if k not in others]


def forget(store: LocalStore, key: str) -> bool:
    """Remove ``key``'s build lock files when no process holds them: each taken at once
    and released, which removes it (a soft lock is taken over once its holder is dead),
    with an OS lock holder's record unless that beats. Whether one went. Never makes a lock
    file, and never follows a ``locks`` folder that is a symlink."""
    path = store.layout.lock_path(key)
    gone = False
    for lock in (locks.OsLock(path), locks.make_lock(path, "soft")):
        with contextlib.suppress(OSError, CacheCorruptError), \
                store.layout.open_folder("locks") as folder:
            folder.lstat(lock.path.name)  # none there: nothing to take, nor to make
            if lock.acquire(timeout=0):
                try:
                    if isinstance(lock, locks.OsLock) and not lock.holder_alive():
                        folder.unlink(lock.holder_path.name)  # (none: nothing done)
                finally:
                    lock.release()
                gone = True
    return gone
