"""Filesystem primitives with the durability and atomicity the cache relies on.

Platform and filesystem differences live here and nowhere else.
"""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import stat
import uuid
from contextlib import suppress
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Optional

from .file_modes import private_file_mode

_HOST = socket.gethostname()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_SIZE = 1 << 16
"""The most a read asks for past a file's size: ``os.read`` allocates what it asks for."""
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
NOT_A_FILE_ERRNOS = (errno.ELOOP, errno.EINVAL, errno.ENOTDIR, errno.EISDIR)
"""Errors of opening a path that is a symlink, a directory or another non-file."""
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)


def host() -> str:
    """This machine's name, recorded as the owner of builds and locks."""
    return _HOST


def cpu_affinity() -> frozenset[int]:
    """The CPUs this process may run on: its affinity set where the platform has one, else
    every CPU of the machine."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return frozenset(range(os.cpu_count() or 1))


def unique_suffix() -> str:
    """A name part no other process or thread on any host will pick: host, pid, uuid."""
    return f"{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


class DirHandle:
    """An open directory; every operation on it is relative to the handle and never follows
    a symlink at the final name, so a directory that another user renames away and replaces
    with a symlink (anyone in a shared cache's group can) is never written through.

    Opening refuses a symlink or a non-directory (``O_DIRECTORY|O_NOFOLLOW``); ``follow``
    allows one for a path the user gave (the cache root itself).
    """

    def __init__(self, fd: int, path: str | Path, name: Optional[str] = None) -> None:
        self.fd = fd
        self._where = (path, name)

    @cached_property
    def path(self) -> Path:
        """Where it was opened (``name`` inside ``path``, when given): for messages and
        for the callers that need one, made on first use."""
        base, name = self._where
        if isinstance(base, DirHandle):
            base = base.path
        elif not isinstance(base, Path):
            base = Path(base)
        return base if name is None else base / name

    @classmethod
    def open(cls, path: str | Path, *, follow: bool = False,
             parent: Optional["DirHandle"] = None) -> "DirHandle":
        flags = os.O_RDONLY | _DIRECTORY | (0 if follow else _NOFOLLOW)
        if parent is None:
            return cls(os.open(path, flags), path)
        with _naming(parent, str(path)):
            return cls(os.open(path, flags, dir_fd=parent.fd), parent, str(path))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DirHandle({str(self.path)!r})"

    def child(self, name: str) -> "DirHandle":
        """Open the subdirectory ``name``; ELOOP/ENOTDIR when it is a symlink or not a dir."""
        return DirHandle.open(name, parent=self)

    def mkdir(self, name: str, mode: int) -> None:
        with _naming(self, name):
            os.mkdir(name, mode, dir_fd=self.fd)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def create(self, name: str, mode: Optional[int] = None) -> int:
        """Create ``name`` fresh (never through a symlink, never over a file) for writing."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        with _naming(self, name):
            return os.open(name, flags, private_file_mode() if mode is None else mode,
                           dir_fd=self.fd)

    def open_file(self, name: str, *, writable: bool = False) -> BinaryIO:
        """Open the regular file ``name``: no symlink, no FIFO or device (never blocks)."""
        fd, _ = self._open_regular(name, os.O_RDWR if writable else os.O_RDONLY)
        return os.fdopen(fd, "r+b" if writable else "rb")

    def read_file(self, name: str, limit: int) -> bytes:
        """The bytes of the regular file ``name`` (opened as :meth:`open_file` opens it) up
        to its end, or ``limit + 1`` of them (the caller sees that it is too large), read
        from the descriptor, in one read when its size holds: ``ls`` reads every manifest
        so."""
        fd, st = self._open_regular(name, os.O_RDONLY)
        try:
            return read_to_end(fd, st.st_size, limit)
        finally:
            os.close(fd)

    def _open_regular(self, name: str, flags: int) -> tuple[int, os.stat_result]:
        """The descriptor of the regular file ``name`` opened with ``flags``, and its stat."""
        with _naming(self, name):
            fd = os.open(name, flags | _NOFOLLOW | _NONBLOCK, dir_fd=self.fd)
        return fd, _check_regular(fd, self, name)

    def write_new(self, name: str, data: bytes, *, durable: bool = True,
                  mode: Optional[int] = None) -> os.stat_result:
        """Create ``name`` fresh with ``data`` (fsynced with ``durable``; ``mode`` as
        :meth:`create` takes it); nothing left on error. The stat of the file written."""
        fd = self.create(name, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
            return os.fstat(fd)
        except BaseException:
            self.unlink(name)
            raise
        finally:
            os.close(fd)

    def publish_new(self, name: str, data: bytes) -> bool:
        """Make ``name`` hold ``data`` (fsynced) in one step, only if it does not exist yet:
        readers see all of it or nothing. False when it already existed (a hard link never
        replaces a file, on local and network filesystems alike)."""
        tmp = f".{name}.{unique_suffix()}.tmp"
        self.write_new(tmp, data)
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            # A filesystem without hard links (some FUSE and SMB mounts): check, then rename.
            # Two writers may then both succeed; they write records of the same chunk.
            try:
                self.lstat(name)
                return False
            except FileNotFoundError:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                return True
        finally:
            self.unlink(tmp)
        return True

    def replace_json(self, name: str, value: Any, *, mode: Optional[int] = None
                     ) -> os.stat_result:
        """Write ``value`` as JSON to ``name`` so readers see the old file or the new one
        (written under a dot name, then renamed); the new file's stat."""
        tmp = f".{name}.{unique_suffix()}.tmp"
        st = self.write_new(tmp, (json.dumps(value, sort_keys=True) + "\n").encode(),
                            durable=False, mode=mode)
        try:
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(tmp)
            raise
        return st

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def remove_empty_dir(self, name: str) -> bool:
        """Remove the directory ``name`` if it is empty (never a symlink: rmdir does not
        follow one); False when it is not empty, gone or not a directory."""
        try:
            os.rmdir(name, dir_fd=self.fd)
        except OSError:
            return False
        return True

    def rename(self, name: str, to: "DirHandle", new_name: str) -> None:
        os.rename(name, new_name, src_dir_fd=self.fd, dst_dir_fd=to.fd)

    def remove_tree(self, name: str) -> None:
        """Delete ``name`` and everything under it through directory handles, never
        following a symlink that another user swaps in (a name that is no directory when
        opened ``O_NOFOLLOW`` is unlinked), as ``shutil.rmtree(dir_fd=)`` does from Python
        3.11 on; a tree already gone is not an error."""
        try:
            folder = self.child(name)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                self.unlink(name)
            elif e.errno != errno.ENOENT:
                raise
            return
        with folder:
            for child in folder.names():
                folder.remove_tree(child)
        with suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=self.fd)

    def fsync(self) -> None:
        if os.name != "nt":
            os.fsync(self.fd)

    def touch(self, name: str) -> None:
        """Set the times of ``name`` in this directory to now, never following a symlink."""
        os.utime(name, dir_fd=self.fd, follow_symlinks=False)

    def chmod(self, mode: int) -> None:
        os.fchmod(self.fd, mode)

    def link_open_file(self, f: BinaryIO, name: str) -> bool:
        """Hard-link the open file ``f`` into this directory as ``name``: the very file that
        was opened and checked (linked through ``/proc/self/fd``, so no path is followed
        that another process could swap). False when it cannot be linked: another
        filesystem, ``fs.protected_hardlinks`` and another user's file, a file removed
        since it was opened, a filesystem without links."""
        try:
            os.link(f"/proc/self/fd/{f.fileno()}", name, dst_dir_fd=self.fd,
                    follow_symlinks=True)
        except OSError:
            return False
        return same_file(os.stat(name, dir_fd=self.fd, follow_symlinks=False),
                         os.fstat(f.fileno()))


class _naming:
    """Re-raise an OSError of a call relative to a handle with the full path as its filename
    (the call itself only knew the name inside the directory); the path is joined only
    then, as a call that succeeds needs none."""

    __slots__ = ("folder", "name")

    def __init__(self, folder: DirHandle, name: str) -> None:
        self.folder, self.name = folder, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if not isinstance(error, OSError):
            return
        path = str(self.folder.path / self.name)
        if error.filename is None or str(error.filename) == path:
            return
        raise type(error)(error.errno, error.strerror, path) from None


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def file_version(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another: the file (device, inode) and its
    size and mtime (a write changes the mtime, a rename the inode). Not the ctime, which
    every new hard link to the file changes."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remove_file(path: Path) -> None:
    try:
        os.unlink(path)
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
    return open(path, "rb", opener=lambda name, flags: open_regular_fd(
        name, follow_symlinks=follow_symlinks))


def open_regular_fd(path: str | Path, *, follow_symlinks: bool = False) -> int:
    """:func:`open_regular`'s descriptor, for a caller that keeps it rather than a file."""
    fd = os.open(path, os.O_RDONLY | (0 if follow_symlinks else _NOFOLLOW) | _NONBLOCK)
    _check_regular(fd, path)
    return fd


def read_capped(path: str | Path, max_bytes: int, *,
                follow_symlinks: bool = False) -> BinaryIO:
    """A regular file to parse, costing at most ``max_bytes`` of memory whatever its size.

    A file of at most ``max_bytes`` is read whole, in one read of the size it has when
    opened (to its end, at most ``max_bytes + 1`` bytes, if it grew meanwhile), and
    returned in memory (``io.BytesIO``): a decoder then parses bytes instead of
    making dozens of small reads. A larger file is returned open, so that the parser reads
    only what it needs. Opened and checked as :func:`open_regular` does, on one descriptor
    (the size checked is the opened file's); raises as it does. The caller closes it.
    """
    nofollow = 0 if follow_symlinks else _NOFOLLOW
    fd = os.open(path, os.O_RDONLY | nofollow | _NONBLOCK)
    size = _check_regular(fd, path).st_size
    try:
        if size > max_bytes:
            return open(path, "rb", opener=lambda name, flags: fd)  # keeps ``path`` as name
        data = read_to_end(fd, size, max_bytes)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return io.BytesIO(data)


def read_to_end(fd: int, size: int, limit: int) -> bytes:
    """The bytes of the open file ``fd`` of ``size`` bytes, read from its start to its end,
    at most ``limit + 1`` of them: one read, asking one byte past its size, when the size
    holds (a read that stops short of what it asked for has met the end); more when it
    grew or shrank meanwhile."""
    parts = [os.read(fd, min(size, limit) + 1)]
    got = len(parts[0])
    while parts[-1] and got <= limit and got != size:
        parts.append(os.read(fd, min(limit + 1 - got, _READ_SIZE)))
        got += len(parts[-1])
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _check_regular(fd: int, where: str | Path | DirHandle,
                   name: Optional[str] = None) -> os.stat_result:
    """The stat of ``fd``, opened with O_NONBLOCK (so a FIFO could not block the open), once
    it is known to be a regular file, switched back to blocking reads; closed and EINVAL
    otherwise (naming ``where``, or ``name`` inside the handle ``where``)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            path = where.path / str(name) if isinstance(where, DirHandle) else where
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return st


def preallocate_fd(fd: int, offset: int = 0, length: Optional[int] = None) -> None:
    """Reserve the blocks of the open file ``fd`` now (``length`` bytes from ``offset``;
    default the whole file), so a full disk fails here with ENOSPC.

    Without it a sparse memmap hits the full disk on a page write, and the kernel kills the
    process with SIGBUS instead of raising. Filesystems that cannot preallocate are skipped.
    """
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    try:
        size = os.fstat(fd).st_size - offset if length is None else length
        if size > 0:
            os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
