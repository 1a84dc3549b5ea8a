"""Which entries live processes use: ``prune``, a budget and ``clear --older-than`` leave
those alone.

While an :class:`~cachekit.Entry` lives, its process holds a shared flock(2) on the entry's
directory (:func:`hold`); so does a process that unpickles it and opens it by its path, and
the workers a fork makes share their parent's (a worker that ``spawn`` or ``forkserver``
starts reads the files its parent keeps open: :mod:`cachekit.store.entry_files`). A
removal that chose entries for being unused takes the lock exclusively, without waiting,
around its rename (:func:`unheld`), and passes over an entry it cannot take: the entry is
in use. Evicting it would free no disk anyway (a process that maps a removed file keeps
its blocks), and another process that opens it by its path would find it gone.

The kernel drops a lock with the last descriptor of its holder: when the Entry is
collected, or the process ends (SIGKILL too), so a hold never outlives its holder. Holds
are seen by the processes of one machine (Linux's NFS client keeps a directory's flock
local), so each hold also keeps a record that other machines see (:mod:`hold_records`).
Where flock fails, nothing is held, and removals work as they would without holds. A
process holds at most :data:`MAX_HOLDS` entries at once (a descriptor each); the ones it
opens beyond are not held, which it says once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Optional

from .. import _fs
from ..messages import say
from . import hold_records
from .layout import Layout

MAX_HOLDS = 256
IN_USE = "in use by a live process"
"""Why a removal of unused entries passes over one (``Skipped.reason``)."""

_HELD_FOR_A_RENAME = 0.05
"""Seconds a new hold waits out a removal's exclusive lock (held across one rename)."""

_count = 0
_said_full = False
_count_guard = threading.RLock()  # (a collected Hold may close inside another's count)


class Hold:
    """A shared lock on one entry directory and its record for other machines, released by
    :meth:`close`, by collection, or at interpreter exit. The release is a
    ``weakref.finalize``: exit runs it while modules still stand, where a ``__del__`` of an
    Entry left in a global would find this module's names already gone (and print a
    traceback at the end of every such script)."""

    def __init__(self, fd: int, record: hold_records.Record) -> None:
        global _count
        self.fd = fd
        with _count_guard:
            _count += 1
        self._release = weakref.finalize(self, _release, fd, record)

    def close(self) -> None:
        self.fd = -1
        self._release()


def _release(fd: int, record: hold_records.Record) -> None:
    global _count
    record.remove()
    os.close(fd)
    with _count_guard:
        _count -= 1


def hold(entry_dir: Path) -> Optional[Hold]:
    """Hold the entry at ``entry_dir`` for this process; None when it cannot be held (gone,
    flock unsupported, :data:`MAX_HOLDS` reached: said once a process). A removal that
    locks it at this moment is waited out (it holds the lock across one rename); one that
    has moved the entry already leaves this a hold on a removed entry, which holds nothing
    back."""
    global _said_full
    if _count >= MAX_HOLDS:
        if not _said_full:
            _said_full = True
            say(f"this process holds {MAX_HOLDS} entries, the most it holds at once; "
                f"{entry_dir.name[:12]} and the others it opens beyond are not held, so "
                "`prune`, budgets and `clear --older-than` may remove them as it uses them "
                "(let go of the Entry objects it no longer uses)", always=True)
        return None
    try:
        fd = os.open(entry_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    deadline = time.monotonic() + _HELD_FOR_A_RENAME
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return Hold(fd, hold_records.record(entry_dir))
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


@contextlib.contextmanager
def unheld(entries: _fs.DirHandle, key: str) -> Iterator[bool]:
    """Whether no live process holds the entry ``entries/KEY``, kept so while the block
    runs on this machine (the entry locked exclusively: a process here that opens it
    meanwhile waits for the block, or holds nothing). True also when it cannot tell (flock
    fails there) or the entry is gone: the caller then removes as it would without holds.
    A process of another machine holds it by its record (:mod:`hold_records`), from a
    lease / 4 after it took the entry."""
    with _here(entries, key) as free:
        yield free is None or (
            free and not hold_records.held_elsewhere(Layout(entries.path.parent), [key]))


@contextlib.contextmanager
def _here(entries: _fs.DirHandle, key: str) -> Iterator[Optional[bool]]:
    """Whether no process of this machine holds the entry ``entries/KEY`` (as
    :func:`unheld` keeps it); None when it is gone."""
    try:
        folder: Optional[_fs.DirHandle] = entries.child(key)
    except OSError:
        folder = None
    with folder if folder is not None else contextlib.nullcontext():
        yield None if folder is None else _locked(folder, entries, key)


def _locked(folder: _fs.DirHandle, entries: _fs.DirHandle, key: str) -> bool:
    """Lock the entry directory ``folder`` exclusively, without waiting: False when a
    live process holds it, or ``entries/KEY`` is another directory now (a new entry)."""
    try:
        fcntl.flock(folder.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK)
    try:
        return _fs.same_file(os.fstat(folder.fd), entries.lstat(key))
    except FileNotFoundError:
        return True


def holders(entry_dir: Path) -> list[int]:
    """The pids of this machine's processes that hold the entry at ``entry_dir``, as the
    kernel lists its locks (``/proc/locks``; a hold a forked child inherited shows the pid
    that took it); empty where that list cannot be read or names another device number
    than stat gives (btrfs subvolumes)."""
    try:
        st = os.lstat(entry_dir)
        with open("/proc/locks", encoding="ascii", errors="replace") as listing:
            lines = listing.read().splitlines()
    except OSError:
        return []
    node = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = {int(fields[4]) for fields in map(str.split, lines)  # (a waiter's has "->")
            if fields[1:2] == ["FLOCK"] and fields[3:4] == ["READ"] and fields[5:6] == [node]
            and fields[4].isdigit()}
    return sorted(pid for pid in pids if pid > 0)


def held(layout: Layout, key: str) -> bool:
    """Whether a live process holds the entry ``key`` of the root ``layout`` now."""
    return bool(in_use(layout, [key]))


@contextlib.contextmanager
def unused(layout: Layout, key: str) -> Iterator[bool]:
    """:func:`unheld` for the entry ``key`` of the root ``layout``."""
    with layout.open_folder("entries") as entries, unheld(entries, key) as free:
        yield free


def in_use(layout: Layout, keys: Iterable[str]) -> set[str]:
    """Which of the entries ``keys`` of the root ``layout`` live processes hold now."""
    entries = layout.open_folder_if_any("entries")
    if entries is None:
        return set()
    keys = list(keys)
    found = hold_records.held_elsewhere(layout, keys)
    with entries:
        for key in keys:
            if key not in found:
                with _here(entries, key) as free:
                    if free is False:
                        found.add(key)
    return found
