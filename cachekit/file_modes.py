"""The permission bits cachekit gives what it creates on a cache root.

A root may be shared by a group: a published entry and the root's folders take the umask's
mode, so that members can remove them; a build directory and the files in it are never
writable by group or others, so that no member plants a file in another's build.
"""

from __future__ import annotations

import os


def private_dir_mode() -> int:
    """A build directory's mode as ``mkdir`` is given it: no write for group or others,
    whatever the umask (members of a shared cache's group must not plant files in
    another's build); the kernel takes the umask off."""
    return 0o755


def private_file_mode() -> int:
    """A file cachekit creates, as ``open`` is given it: never writable by group or others
    (the kernel takes the umask off)."""
    return 0o644


def shared_dir_mode() -> int:
    """A published entry's mode: the umask's, so members of the group can remove it."""
    return 0o777 & ~umask()


def umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    try:  # Linux 4.7+: the second line of /proc/self/status (the first is the name)
        fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            head = os.read(fd, 512)
        finally:
            os.close(fd)
        for line in head.split(b"\n"):
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)  # not thread-safe, hence only a fallback off Linux
    os.umask(current)
    return current


def file_mode() -> int:
    """The permission bits a new file gets under the umask (0o664 under ``umask 002``)."""
    return 0o666 & ~umask()
