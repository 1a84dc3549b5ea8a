"""Whether this process may remove a directory of a cache root that a team shares.

On a shared root (group-owned, setgid, every job under ``umask 002``) any member removes a
published entry: its directory is writable by the group. A build directory is not: its
builder makes it writable by itself alone (:func:`cachekit.file_modes.private_dir_mode`),
so that no other member plants files in a build. When that builder dies, only its user (or
root) can empty the directory. Another member's ``clear``, ``prune`` or budget would move
it into ``tmp/deleting.*`` and then fail on its first file: the bytes would stay, under a
name that no longer lets their owner resume the build. So a removal asks first, and leaves
such a directory to its owner, saying whose it is.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from .. import _fs
from ..store import LocalStore


def blocking_owner(folder: _fs.DirHandle, name: str) -> Optional[int]:
    """The owner (uid) of the first directory of the tree ``folder/name`` in which this
    process may not remove files (no write and search permission there, as the kernel
    judges it: ACLs and root's override count); None when it may remove the whole tree,
    and when ``name`` is no directory or is gone (the removal then says what it meets)."""
    try:
        st = folder.lstat(name)
        if not stat.S_ISDIR(st.st_mode):
            return None
        if not os.access(name, os.W_OK | os.X_OK, dir_fd=folder.fd, effective_ids=True):
            return st.st_uid
        with folder.child(name) as tree:
            with os.scandir(tree.fd) as listing:
                below = [item.name for item in listing if item.is_dir(follow_symlinks=False)]
            return next((uid for uid in (blocking_owner(tree, sub) for sub in below)
                         if uid is not None), None)
    except OSError:  # removed or replaced while we looked
        return None


def entry_owner(store: LocalStore, key: str) -> Optional[int]:
    """The other user who alone can remove the published entry ``key`` of ``store`` (a
    member who works under ``umask 022`` made it); None when this process can."""
    entries = store.layout.open_folder_if_any("entries")
    if entries is None:
        return None
    with entries:
        return blocking_owner(entries, key)


def user(uid: int) -> str:
    """``uid 1001``, with the user's name when the system knows it: ``alice (uid 1001)``."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def only_owner(uid: int) -> str:
    """Why a removal leaves a directory of ``uid``'s alone."""
    return f"{user(uid)} owns it: only they (or root) can remove it"
