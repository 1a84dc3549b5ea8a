"""The names of the directories under a cache root's ``tmp/``: what each one is, whose, and
of which key, read from its name alone.

::

    KEY.HOST.PID.UUID            a build directory of KEY, made by process PID on HOST
    deleting.KEY.HOST.PID.UUID   an entry or dead build of KEY being removed by PID on HOST

The host may hold dots; the pid and uuid never do. Every name is made fresh with
:func:`cachekit._fs.unique_suffix`, so no two processes on any host pick the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import _fs
from ..key_names import is_key

DELETING_PREFIX = "deleting."
BUILD, REMOVAL = "build", "removal"


@dataclass(frozen=True)
class TempName:
    """What a name under ``tmp/`` says: a build directory (``kind`` BUILD) or a removal in
    progress (REMOVAL), of ``key``, made by process ``pid`` (None when not a number) on
    ``host``."""

    kind: str
    key: str
    host: str
    pid: Optional[int]


def parse_temp_name(name: str) -> Optional[TempName]:
    """Read a name under ``tmp/``; None when cachekit never makes a name like it."""
    kind = REMOVAL if name.startswith(DELETING_PREFIX) else BUILD
    key, host, pid = parse_build_dir_name(name[len(DELETING_PREFIX):] if kind == REMOVAL
                                          else name)
    return None if key is None else TempName(kind, key, host, pid)


def parse_build_dir_name(name: str) -> tuple[Optional[str], str, Optional[int]]:
    """(key, host, pid) from a ``KEY.HOST.PID.UUID`` build directory name; key is None when
    the name is not one of those."""
    key, _, rest = name.partition(".")
    parts = rest.rsplit(".", 2)
    if not is_key(key) or len(parts) != 3:
        return None, "", None
    host, pid, _ = parts
    return key, host, int(pid) if pid.isdigit() else None


def build_dir_name(key: str) -> str:
    """A fresh build directory name for ``key``."""
    return f"{key}.{_fs.unique_suffix()}"


def trash_name(key: str) -> str:
    """A fresh name to move something of ``key`` to before deleting it."""
    return f"{DELETING_PREFIX}{key}.{_fs.unique_suffix()}"
