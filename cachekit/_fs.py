"""Filesystem primitives with the durability and atomicity the cache relies on.

Platform and filesystem differences live here and nowhere else.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

_HOST = socket.gethostname()


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
    """Delete a directory tree; a tree that is already gone is not an error."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
