"""Filesystem primitives with the durability and atomicity the cache relies on.

Platform and filesystem differences live here and nowhere else.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Optional

_HOST = socket.gethostname()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
NOT_A_FILE_ERRNOS = (errno.ELOOP, errno.EINVAL, errno.ENOTDIR, errno.EISDIR)
"""Errors of opening a path that is a symlink, a directory or another non-file."""


def host() -> str:
    """This machine's name, recorded as the owner of builds and locks."""
    return _HOST


def unique_suffix() -> str:
    """A name part no other process or thread on any host will pick: host, pid, uuid."""
    return f"{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside ``path`` durable."""
    if os.name == "nt":  # Windows cannot open a directory for fsync; NTFS journals metadata.
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Create ``path`` fresh (never through a symlink, never over an existing file), write
    ``data`` and, with ``durable``, fsync it. A failure leaves no file behind."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, file_mode())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_file(path)
        raise
    os.close(fd)


def create_held_file(path: Path) -> int:
    """Create an empty ``path`` fresh and return its open descriptor (for a heartbeat)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, file_mode())


def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` so readers see the old file or the new one, never part.

    With ``durable`` the bytes are fsynced before the rename that makes them visible.
    """
    tmp = path.with_name(f".{path.name}.{unique_suffix()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_file(tmp)
        raise


def rename_dir_no_replace(src: Path, dst: Path) -> bool:
    """Atomically rename directory ``src`` to ``dst``; False when ``dst`` already exists.

    POSIX ``rename`` refuses a non-empty target with ENOTEMPTY or EEXIST, and a published
    entry is never empty, so the first publisher wins and later ones see False.
    """
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) or isinstance(e, FileExistsError):
            return False
        raise
    return True


def remove_file(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_tree(path: Path) -> None:
    """Delete a directory tree; a tree that is already gone is not an error.

    A symlink is unlinked, never followed: a tampered cache cannot make us delete elsewhere.
    """
    try:
        if os.path.islink(path):
            os.unlink(path)
        else:
            shutil.rmtree(path)
    except FileNotFoundError:
        pass


def is_plain_dir(path: Path) -> bool:
    """True for a real directory (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str | Path, *, follow_symlinks: bool = False) -> BinaryIO:
    """Open a regular file for reading without following a final symlink or blocking on a FIFO.

    Raises FileNotFoundError when it is missing and OSError when it is a symlink (ELOOP) or
    not a regular file, so a tampered entry can neither point a reader outside the cache
    nor hang it. The file object keeps ``path`` as its name (numpy's memmap records it).
    ``follow_symlinks`` is for user files (image paths), where links are legitimate.
    """
    nofollow = 0 if follow_symlinks else _NOFOLLOW

    def opener(name: str, flags: int) -> int:
        fd = os.open(name, os.O_RDONLY | nofollow | _NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(name))
            if _NONBLOCK:
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return open(path, "rb", opener=opener)


def umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)  # not thread-safe, hence only a fallback off Linux
    os.umask(current)
    return current


def file_mode() -> int:
    """The permission bits a new file gets under the umask (0o664 under ``umask 002``)."""
    return 0o666 & ~umask()


def preallocate(path: Path) -> None:
    """Reserve the blocks of ``path`` now, so a full disk fails here with ENOSPC.

    Without it a sparse memmap hits the full disk on a page write, and the kernel kills the
    process with SIGBUS instead of raising. Filesystems that cannot preallocate are skipped.
    """
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host (zombies count as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat_fields = _proc_stat(pid)
    return stat_fields is None or stat_fields[0] != "Z"


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) from /proc, or None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


_PIDNS = _pid_namespace()


def owner() -> dict[str, Any]:
    """This process as the owner of a build or lock: host, pid, pid namespace, start time.

    The namespace and start time let another process on the host tell a dead owner from a
    live one across containers (same host name, other pid numbering) and pid reuse.
    """
    pid = os.getpid()
    fields = _proc_stat(pid)
    return {"host": _HOST, "pid": pid, "pidns": _PIDNS,
            "start": fields[1] if fields else None}


def owner_state(record: Mapping[str, Any]) -> str:
    """"dead", "alive" or "unknown" for an owner recorded by :func:`owner`.

    Only an owner on this host and in this pid namespace can be judged; one elsewhere is
    "unknown", and the caller decides (trust a working lock, or wait for a lease).
    """
    pid = record.get("pid")
    if record.get("host") != _HOST or not isinstance(pid, int) or isinstance(pid, bool):
        return "unknown"
    if pid <= 0:
        return "unknown"
    pidns = record.get("pidns")
    if pidns is not None and _PIDNS is not None and pidns != _PIDNS:
        return "unknown"
    if not pid_alive(pid):
        return "dead"
    start = record.get("start")
    fields = _proc_stat(pid)
    if isinstance(start, int) and fields is not None and fields[1] != start:
        return "dead"  # the pid was reused by another process
    return "alive"
