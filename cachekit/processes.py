"""Processes as owners of builds, locks and claims: who this process is (:func:`owner`) and
whether a recorded owner on this host is still alive (:func:`owner_state`), telling a dead
owner from a live one across containers (same host name, other pid numbering) and pid
reuse."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from . import _fs


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


def process_name(pid: int) -> Optional[str]:
    """The name the kernel gives the process ``pid`` of this host (``/proc/PID/comm``: its
    program's, or what it set, at most 15 characters); None when there is none to read."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").strip() or None
    except OSError:
        return None


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
_STARTS: dict[int, Optional[int]] = {}
"""This process's start time by pid: it never changes while the pid is ours."""


def owner() -> dict[str, Any]:
    """This process as the owner of a build or lock: host, pid, pid namespace, start time.

    The namespace and start time let another process on the host tell a dead owner from a
    live one across containers (same host name, other pid numbering) and pid reuse.
    """
    pid = os.getpid()
    if pid not in _STARTS:  # (a forked child is another pid: read its own)
        fields = _proc_stat(pid)
        _STARTS[pid] = fields[1] if fields else None
    return {"host": _fs.host(), "pid": pid, "pidns": _PIDNS, "start": _STARTS[pid]}


def owner_state(record: Mapping[str, Any]) -> str:
    """"dead", "alive" or "unknown" for an owner recorded by :func:`owner`.

    Only an owner on this host and in this pid namespace can be judged; one elsewhere is
    "unknown", and the caller decides (trust a working lock, or wait for a lease).
    """
    pid = record.get("pid")
    if record.get("host") != _fs.host() or not isinstance(pid, int) or isinstance(pid, bool):
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
