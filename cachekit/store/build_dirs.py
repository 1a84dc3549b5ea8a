"""Build directories under ``tmp/``: the one a process owns (:class:`BuildDir`), and any one
as another process sees it (:class:`BuildState`: whose, how far, alive or dead).

A build directory holds ``state.json`` (the build's record: owner, key, cachekit version,
the CPUs its builder may run on and how many rows it runs at once, progress) and
``heartbeat`` (its mtime is the builder's heartbeat, see :mod:`cachekit.liveness`) once the
build has something to say (see :class:`BuildDir`), the data files, and
whatever working files the builder keeps next to them (a per-row fill's chunk journal,
through which joiners of the same user fill chunks of it too). Its name is
``KEY.HOST.PID.UUID``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .. import _fs, liveness, small_json
from ..messages import printable
from . import manifest as manifests
from .._version import __version__
from ..errors import BuildGone
from ..small_json import is_count

STATE_FILE = "state.json"
"""The build's record (owner, key, versions, progress). Build directories of older
versions hold a ``journal.json`` instead: they have no record, so they are never resumed."""
RESUMED_PREFIX = "resumed."
"""Dead builds of this user claimed by a new build, inside its directory, until the build
has copied from them what it could verify."""
PROGRESS_SECONDS = 0.5
"""Rows done are rewritten into state.json at most this often (waiters print them)."""
HEARTBEAT_FILE = "heartbeat"
_STATE_LIMIT = 1 << 20


@dataclass(frozen=True)
class BuildState:
    """A build directory under ``tmp/`` as any process sees it: whose, how far, alive."""

    key: str
    path: Path
    owner: dict[str, Any]
    record: Optional[dict[str, Any]]
    """Its ``state.json``; None when missing or unreadable."""
    heartbeat: float
    alive: bool
    uid: int = -1

    @property
    def abandoned(self) -> bool:
        return bool(self.record and self.record.get("abandoned") is True)

    @property
    def same_version(self) -> bool:
        """Its record is of this key, cachekit version and entry format: safe to resume."""
        record = self.record or {}
        return (record.get("key") == self.key and record.get("cachekit_version") == __version__
                and record.get("format") == manifests.FORMAT_VERSION)

    @property
    def on_this_host(self) -> bool:
        """Its builder runs on this host (by host name), on the CPUs this process sees."""
        return self.owner.get("host") == _fs.host()

    @property
    def cpus(self) -> Optional[tuple[frozenset[int], int]]:
        """(the CPUs its builder may run on, how many rows it runs at once), as its record
        says; None until the builder has said (see :meth:`BuildDir.record_cpus`)."""
        record = self.record or {}
        cpus, workers = record.get("cpus"), record.get("workers")
        if not (isinstance(cpus, list) and cpus and all(map(is_count, cpus))
                and is_count(workers) and workers > 0):
            return None
        return frozenset(cpus), workers

    def describe(self) -> str:
        """``pid 4242 on node7 (2048/10000 rows, 20%)``, for people."""
        record = self.record or {}
        progress = small_json.progress(record.get("done"), record.get("total"))
        return printable(f"pid {self.owner.get('pid')} on {self.owner.get('host')} "
                         f"({progress})")  # from a file another member may write


class BuildDir:
    """A build directory this process owns, open as ``dir``: every file of the build is made
    through that handle. Its heartbeat beats from :meth:`LocalStore.begin` until it is
    committed, abandoned or discarded.

    Its record (``state.json``) and ``heartbeat`` file are written when it first has
    something to say: the CPUs a fill runs on (before anyone can join it), its progress, its
    start for a build that says nothing else (:meth:`announce`), or its heartbeat's first
    beat, a lease / 4 after it began. Until then another process
    knows its owner from its name and takes the directory's mtime (set by the mkdir) for
    its heartbeat. A build that decodes nothing, a fold of rows other entries hold, is done
    long before, and makes neither file: each costs a create and an unlink, metadata writes
    that a busy or network filesystem makes slow while the build's other work stays as it
    was."""

    def __init__(self, key: str, tmp: _fs.DirHandle, name: str, directory: _fs.DirHandle,
                 record: dict[str, Any]) -> None:
        self.key = key
        self.name = name
        self.tmp = tmp
        self.dir = directory
        self.path = directory.path
        self.record = record
        self._beat_fd: Optional[int] = None
        self._recorded = False
        self._writing = threading.Lock()
        """Held while the record is changed or written: the first beat, on the heartbeat
        thread, may write it as the build writes its progress."""
        self._progress_written = -math.inf
        self._heartbeat = liveness.Heartbeat(self._beat, where=self.path).start(at_once=False)
        self.resume_from: list[_fs.DirHandle] = []
        """Dead builds claimed to resume from (``resumed.N`` inside this directory)."""
        self.unsynced: list[str] = []
        """Files sealed but not fsynced yet: the commit fsyncs them with the manifest and
        the directory, all at once (:mod:`cachekit.flushing`)."""

    def _beat(self) -> None:
        """One heartbeat: the first writes the record and the heartbeat file."""
        try:
            self._write_record()
        except (OSError, BuildGone):
            return  # tried again at the next beat
        if self._beat_fd is not None:
            liveness.touch(self._beat_fd)()

    def _write_record(self, **changes: Any) -> None:
        """Update the record with ``changes`` and write it (with the heartbeat file, the
        first time); BuildGone once the directory is gone (taken over while we were
        paused)."""
        with self._writing:
            if self._recorded and not changes:
                return
            self.record.update(changes)
            try:
                if self._beat_fd is None and not self._recorded:
                    self._beat_fd = self.dir.create(HEARTBEAT_FILE)
                self.dir.replace_json(STATE_FILE, self.record)
            except FileNotFoundError:
                raise BuildGone(str(self.path)) from None
            self._recorded = True

    def still_ours(self) -> bool:
        """Whether ``tmp/NAME`` is still this build's directory: False once another process
        took it over (it claims a dead build by renaming it into its own)."""
        try:
            return _fs.same_file(self.tmp.lstat(self.name), os.fstat(self.dir.fd))
        except FileNotFoundError:
            return False

    def drop_resumed(self) -> None:
        """Close and remove the dead builds claimed to resume from."""
        for handle in self.resume_from:
            handle.close()
        self.resume_from.clear()
        for name in self.dir.names():
            if name.startswith(RESUMED_PREFIX):
                self.dir.remove_tree(name)

    def announce(self) -> None:
        """Write the record and the heartbeat file now, for a build that may run long
        without a word (a memoize call): from its start, another process then judges it by
        its full owner record (pid namespace and start time too), not by its name alone."""
        self._write_record()

    def record_cpus(self, workers: int) -> None:
        """Record the CPUs this process may run on and how many rows its build runs at once
        (``workers``), before the build can be joined: a joiner on this host joins only
        with the cores these leave free (see :mod:`cachekit.engine.filling.cores`)."""
        self._write_record(cpus=sorted(_fs.cpu_affinity()), workers=workers)

    def progress(self, done: int, total: int) -> None:
        """Record rows done, for the messages of processes that wait for this build: at most
        every PROGRESS_SECONDS (a rewrite costs a file and a rename; a build of small
        chunks would spend a few percent of its time on them), and when the last row is in."""
        now = time.monotonic()
        if done < total and now - self._progress_written < PROGRESS_SECONDS:
            return
        self._progress_written = now
        self._write_record(done=done, total=total, updated=time.time())

    def beat_on_directory(self) -> None:
        """Make the directory's own mtime the heartbeat, which is what another process reads
        once the heartbeat file is gone: the commit removes it with the other working files
        and then flushes every file, which on a busy disk can take longer than a lease.
        Until the rename the build beats on, so no waiter takes it for dead and claims
        it."""
        self._heartbeat.retarget(liveness.touch(self.dir.fd))
        if self._beat_fd is not None:
            os.close(self._beat_fd)
            self._beat_fd = None

    def stop(self) -> None:
        """Stop the heartbeat (idempotent)."""
        self._heartbeat.stop()
        if self._beat_fd is not None:
            os.close(self._beat_fd)
            self._beat_fd = None

    def close(self) -> None:
        self.stop()
        for handle in self.resume_from:
            handle.close()
        self.resume_from.clear()
        self.dir.close()
        self.tmp.close()

    def abandon(self) -> None:
        """Leave the directory for any later builder to resume (best effort)."""
        if self.dir.fd < 0:
            return  # already committed, abandoned or discarded
        self.stop()
        try:
            self.dir.replace_json(STATE_FILE, {**self.record, "abandoned": True})
        except OSError:
            self._remove()
        self.close()

    def discard(self) -> None:
        if self.dir.fd < 0:
            return  # already committed, abandoned or discarded
        self.stop()
        self._remove()
        self.close()

    def _remove(self) -> None:
        """Delete our directory, by name only while the name is still ours. Once it is not
        (another process claimed it to resume from, or ``clear`` is removing it as dead),
        that process removes it: we leave it alone."""
        for attempt in range(3):  # a joiner may add a record while the tree goes
            try:
                if self.still_ours():
                    self.tmp.remove_tree(self.name)
                return
            except OSError:
                if attempt == 2:
                    raise


def read_state(directory: _fs.DirHandle) -> Optional[dict[str, Any]]:
    """The record of a build directory (owner, key, progress), or None when it is missing
    or unreadable."""
    try:
        with directory.open_file(STATE_FILE) as f:
            return small_json.read_dict(f, _STATE_LIMIT)
    except OSError:
        return None


def is_build_state(name: str) -> bool:
    """The store's own files of a build in progress, which are never published."""
    return (name in (STATE_FILE, HEARTBEAT_FILE) or name.startswith(RESUMED_PREFIX)
            or (name.startswith(".") and name.endswith(".tmp")))


