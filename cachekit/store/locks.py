"""Build locks: which one process builds a missing entry while the others wait.

A lock only saves duplicate work; correctness never depends on it (the atomic commit of
:mod:`cachekit.store.commit` does). Choose one with the environment variable
``CACHEKIT_LOCK``, the same way for every process that shares a cache root:

``os`` (default)
    ``filelock.FileLock``: flock(2), released by the kernel when its holder dies. Right for
    local disks and for network filesystems whose locks work. Its holder also keeps a
    record ``KEY.lock.holder`` (owner; its mtime a heartbeat) from a lease / 4 after it took
    the lock, so that a waiter can tell a holder that works from a process that only sits
    on the lock. The holder removes the lock file as it releases it, and a process that
    takes the lock then checks that the name still leads to the file it locked (else it
    locked a removed file and tries again), so lock files do not pile up one per key.
``soft``
    A lock file created with O_EXCL that records its owner (host, pid) and whose mtime the
    holder refreshes from a heartbeat thread. It is stale, and taken over, when its holder
    is dead by the rule of :mod:`cachekit.liveness` (a gone process on this host, or a
    heartbeat older than ``CACHEKIT_LOCK_LEASE`` seconds, default 60). For filesystems where
    flock is absent or silently ineffective (some NFS, Lustre and GPFS mounts).
``none``
    No lock: processes that miss at once all build, and the first to publish wins.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Optional

from .. import _fs, file_modes, liveness, processes, small_json
from ..errors import CacheCorruptError, InvalidArgument

LOCK_ENV = "CACHEKIT_LOCK"
KINDS = ("os", "soft", "none")
SOFT_SUFFIX = ".soft"
HOLDER_SUFFIX = ".holder"
_POLL_SECONDS = 0.05
_FLOCK_TRY_SECONDS = 0.25
"""At most this long between two tries of a held OS lock (filelock's default is 0.05 s, and
each try opens the lock file: a waiter's CPU went mostly into them)."""
_RECORD_LIMIT = 4096


def kind_from_env() -> str:
    """The lock kind named by $CACHEKIT_LOCK (default "os"); InvalidArgument (a
    ValueError) for anything else."""
    kind = os.environ.get(LOCK_ENV, "").strip().lower() or "os"
    if kind not in KINDS:
        raise InvalidArgument(f"{LOCK_ENV}={os.environ[LOCK_ENV]!r} must be one of "
                              f"{', '.join(KINDS)}")
    return kind


class BuildLock:
    """What publish needs from a lock. ``exclusive``: holding it keeps other builders out."""

    exclusive = True

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def acquire(self, timeout: float) -> bool:
        """Try for up to ``timeout`` seconds; True once held."""
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def release_hint(self) -> str:
        """How a user frees this lock when its holder is stuck, for error messages."""
        raise NotImplementedError

    def holder_alive(self) -> bool:
        """Whether whoever holds the lock shows a heartbeat (by :mod:`cachekit.liveness`).
        A waiter stops waiting for a holder that shows none for a lease."""
        return False

    def holder_is_ours(self) -> bool:
        """Whether the holder's record belongs to this user: another user's holder is
        waited for only a bounded time (see :mod:`cachekit.obtain.local_wait`)."""
        return False


class OsLock(BuildLock):
    """flock(2) through filelock; the lock file respects the umask (for shared caches).

    Holding it for more than a lease / 4, the holder keeps ``KEY.lock.holder``: its owner
    record, the mtime refreshed by a heartbeat on the open file (written through a handle on
    the lock folder, replaced by rename, never written through a name)."""

    def __init__(self, path: Path) -> None:
        import filelock  # here: a hit takes no lock, and filelock takes 15 ms to import

        super().__init__(path)
        self._lock = filelock.FileLock(str(path), mode=file_modes.file_mode())
        self._record: Optional[_HolderRecord] = None

    @property
    def holder_path(self) -> Path:
        return self.path.with_name(self.path.name + HOLDER_SUFFIX)

    def acquire(self, timeout: float) -> bool:
        forever = timeout is None or timeout < 0
        deadline = time.monotonic() + (0.0 if forever else timeout)
        while True:
            left = -1.0 if forever else max(0.0, deadline - time.monotonic())
            if not self._flock(left):
                return False
            if self._locked_file_is_named():
                self._record = _HolderRecord(self.holder_path)
                return True
            # We locked a file its last holder removed as it released it: lock the new one.
            self._lock.release()
            if not forever and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)  # (not a hot loop where a stale cache misleads lstat)

    def _flock(self, timeout: float) -> bool:
        import filelock  # loaded by __init__ already

        # For a short timeout, one try now and one at its end: the caller's loop sets the pace.
        every = _FLOCK_TRY_SECONDS if timeout < 0 else min(timeout, _FLOCK_TRY_SECONDS)
        try:
            self._lock.acquire(timeout=timeout, poll_interval=every)
        except filelock.Timeout:
            return False
        except OSError as e:
            if e.errno not in _fs.NOT_A_FILE_ERRNOS:
                raise
            raise CacheCorruptError(self.path, f"the lock file is a symlink or not a file "
                                    f"({e.strerror})", "remove it, and cachekit makes a new "
                                    "one") from None
        return True

    def _locked_file(self) -> Optional[os.stat_result]:
        """The file filelock locked; None where filelock keeps its descriptor to itself or
        holds a soft marker instead (flock missing): then the lock file stays in place."""
        context = getattr(self._lock, "_context", None)
        fd = getattr(context, "lock_file_fd", None)
        if getattr(context, "soft_fallback", False) or not isinstance(fd, int):
            return None
        return os.fstat(fd)

    def _locked_file_is_named(self) -> bool:
        locked = self._locked_file()
        try:
            return locked is None or _fs.same_file(os.lstat(self.path), locked)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell (say ESTALE): trust the lock, as filelock alone does

    def release(self) -> None:
        """Release the lock, removing the lock file first (while still holding it, and
        only when the name still leads to it): a waiter that opened it before then finds
        it unnamed once it gets it, and takes the new one."""
        if self._record is not None:
            self._record.remove()
            self._record = None
        try:
            locked = self._locked_file()
            if locked is not None:
                with _fs.DirHandle.open(self.path.parent) as folder:
                    if _fs.same_file(folder.lstat(self.path.name), locked):
                        folder.unlink(self.path.name)
        except OSError:
            pass  # gone, or not ours to remove (a sticky folder): it only stays behind
        finally:
            self._lock.release()

    def holder_alive(self) -> bool:
        try:
            with _fs.DirHandle.open(self.path.parent) as folder:
                with folder.open_file(self.holder_path.name) as f:
                    beat = os.fstat(f.fileno()).st_mtime
                    record = small_json.read_dict(f, _RECORD_LIMIT)
        except OSError:
            return False
        return liveness.is_alive(record, beat)

    def holder_is_ours(self) -> bool:
        try:
            with _fs.DirHandle.open(self.path.parent) as folder:
                with folder.open_file(self.holder_path.name) as f:
                    return os.fstat(f.fileno()).st_uid == os.geteuid()
        except OSError:
            return False

    def release_hint(self) -> str:
        return ("the kernel releases this lock when its holder exits: wait for that process "
                "or stop it")


class NoLock(BuildLock):
    """Always free: every process that misses builds; the first rename wins."""

    exclusive = False

    def acquire(self, timeout: float) -> bool:
        return True

    def release(self) -> None:
        pass

    def release_hint(self) -> str:
        return "there is no lock (CACHEKIT_LOCK=none)"


class SoftLock(BuildLock):
    """An O_EXCL lock file with an owner record and a heartbeat (its mtime).

    Staleness is judged by the waiter with :func:`cachekit.liveness.is_alive`. A stale file
    is moved aside by rename, so of two waiters that judge it stale only one removes it;
    one that finds it moved a live lock instead puts it back.
    """

    def __init__(self, path: Path, lease: Optional[float] = None) -> None:
        super().__init__(path)
        self.lease = liveness.lease_from_env() if lease is None else lease
        self._fd: Optional[int] = None
        self._identity: Optional[tuple[int, int]] = None
        self._heartbeat: Optional[liveness.Heartbeat] = None

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._try_create():
                return True
            self._break_if_stale()
            if self._try_create():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(_POLL_SECONDS, remaining))

    def release_hint(self) -> str:
        return (f"a soft lock is taken over {self.lease:g} s after its holder's last "
                f"heartbeat; if you know its holder is gone, delete {self.path}")

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._fd is None:
            return
        try:
            current = os.lstat(self.path)
            if (current.st_dev, current.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass  # taken over after our lease ran out; nothing of ours to remove
        finally:
            os.close(self._fd)
            self._fd = self._identity = None

    def holder_alive(self) -> bool:
        try:
            beat = os.lstat(self.path).st_mtime
        except FileNotFoundError:
            return False
        return liveness.is_alive(self.owner(), beat, lease=self.lease)

    def holder_is_ours(self) -> bool:
        try:
            return os.lstat(self.path).st_uid == os.geteuid()
        except OSError:
            return False

    def owner(self) -> Optional[dict[str, Any]]:
        """The record of the current holder, or None when free or unreadable."""
        try:
            with _fs.open_regular(self.path) as f:
                return small_json.read_dict(f, _RECORD_LIMIT)
        except OSError:
            return None

    def _try_create(self) -> bool:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, file_modes.file_mode())
        except FileExistsError:
            return False
        try:
            record = {**processes.owner(), "lease": self.lease, "acquired": time.time()}
            os.write(fd, json.dumps(record).encode() + b"\n")
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _fs.remove_file(self.path)
            raise
        self._fd, self._identity = fd, (st.st_dev, st.st_ino)
        self._heartbeat = liveness.Heartbeat(liveness.touch(fd), self.lease).start()
        return True

    def _break_if_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise CacheCorruptError(self.path, "the lock file is a symlink or not a file",
                                    "remove it, and cachekit makes a new one")
        if not liveness.is_alive(self.owner(), st.st_mtime, lease=self.lease):
            self._take_over(st)

    def _take_over(self, judged: os.stat_result) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale.{_fs.unique_suffix()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another waiter moved it first
        try:
            moved = os.lstat(aside)
            if (moved.st_ino, moved.st_mtime_ns) != (judged.st_ino, judged.st_mtime_ns):
                # It changed between our look and the rename: a live lock. Put it back.
                try:
                    os.link(aside, self.path)
                except OSError as e:
                    if e.errno != errno.EEXIST:
                        raise
        finally:
            _fs.remove_file(aside)


class _HolderRecord:
    """The OS lock holder's record: written as a fresh file by its heartbeat's first beat,
    renamed over the last holder's, and beating until removed.

    The first beat comes a lease / 4 after the lock is taken, well before a waiter asks
    (a waiter first looks for a sign of life a lease after it began to wait), so a lock held
    for less than that, such as by a build that decodes no row, writes no record: each file
    made costs a metadata write, which a busy or network filesystem makes slow. A record
    that cannot be written is tried again at the next beat; without one, waiters go on
    without us after a lease (slower, and safe)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.folder: Optional[_fs.DirHandle] = None
        self.fd: Optional[int] = None
        self.heartbeat = liveness.Heartbeat(self._beat).start(at_once=False)

    def _beat(self) -> None:
        if self.fd is not None:
            liveness.touch(self.fd)()
            return
        try:
            self._write()
        except OSError:
            pass  # tried again at the next beat

    def _write(self) -> None:
        folder = _fs.DirHandle.open(self.path.parent)
        try:
            tmp = f".{self.path.name}.{_fs.unique_suffix()}.tmp"
            fd = folder.create(tmp, file_modes.file_mode())
            try:
                os.write(fd, json.dumps(processes.owner()).encode() + b"\n")
                os.rename(tmp, self.path.name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
            except BaseException:
                os.close(fd)
                folder.unlink(tmp)
                raise
        except BaseException:
            folder.close()
            raise
        self.folder, self.fd = folder, fd

    def remove(self) -> None:
        """Stop beating and remove the record, if one was written and is still ours."""
        self.heartbeat.stop()
        if self.folder is None or self.fd is None:
            return
        try:
            if _fs.same_file(self.folder.lstat(self.path.name), os.fstat(self.fd)):
                self.folder.unlink(self.path.name)
        except OSError:
            pass  # replaced or gone: a stale record only lets waiters go on after a lease
        finally:
            os.close(self.fd)
            self.folder.close()
            self.folder = self.fd = None


def make_lock(path: Path, kind: Optional[str] = None) -> BuildLock:
    """The build lock of ``kind`` (None: from $CACHEKIT_LOCK) for the OS lock path ``path``."""
    kind = kind_from_env() if kind is None else kind
    if kind == "os":
        return OsLock(path)
    if kind == "soft":
        return SoftLock(Path(path).with_name(Path(path).name + SOFT_SUFFIX))
    if kind == "none":
        return NoLock(path)
    raise ValueError(f"lock kind must be one of {', '.join(KINDS)}, not {kind!r}")

