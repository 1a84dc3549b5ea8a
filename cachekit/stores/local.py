"""The local entry store: published entries, build directories and locks under one root.

::

    ROOT/
      entries/KEY/manifest.json        published, immutable; the manifest is written last
      entries/KEY/data.npy, leaf_N.npy the files the manifest lists
      tmp/KEY.HOST.PID.UUID/           a private build directory: journal.json (owner,
                                       progress), heartbeat (its mtime is the builder's
                                       heartbeat), data files and fill checkpoints
      tmp/deleting.KEY.HOST.PID.UUID/  an entry or dead build being removed
      locks/KEY.lock                   build locks (they only save duplicate work)
      locks/KEY.failed.json            the rows of the last failed build, for its waiters

Commit is the correctness point: every listed file is fsynced and checksummed, the manifest
is written last, and the directory is renamed into ``entries/`` in one atomic step that
never replaces an existing entry, so a published entry is complete by construction and of
two racing builders the first rename wins.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from .. import _fs, arrays, liveness
from ..build import CHECKPOINT_SUFFIX
from .. import manifest as manifests
from .._version import __version__
from ..errors import CacheCorruptError, ReadOnlyCacheError, UnsignedEntryError
from ..keys import is_key
from ..manifest import FileRecord, Manifest

JOURNAL_FILE = "journal.json"
HEARTBEAT_FILE = "heartbeat"
DELETING_PREFIX = "deleting."
_CLAIMED = "claimed"
_JOURNAL_LIMIT = 1 << 20


def default_root() -> Path:
    """$CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else ~/.cache/cachekit."""
    explicit = os.environ.get("CACHEKIT_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cachekit"


@dataclass(frozen=True)
class Layout:
    """Where each kind of file of one cache root lives."""

    root: Path

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def entry_dir(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.lock"

    def failure_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.failed.json"


def parse_build_dir_name(name: str) -> tuple[Optional[str], str, Optional[int]]:
    """(key, host, pid) from a ``KEY.HOST.PID.UUID`` build directory name (the host may
    hold dots); key is None when the name is not one of those."""
    key, _, rest = name.partition(".")
    parts = rest.rsplit(".", 2)
    if not is_key(key) or len(parts) != 3:
        return None, "", None
    host, pid, _ = parts
    return key, host, int(pid) if pid.isdigit() else None


@dataclass(frozen=True)
class Published:
    """A published entry: its directory and its checked manifest."""

    path: Path
    manifest: Manifest


@dataclass(frozen=True)
class BuildState:
    """A build directory under ``tmp/`` as any process sees it: whose, how far, alive."""

    key: str
    path: Path
    owner: dict[str, Any]
    journal: Optional[dict[str, Any]]
    heartbeat: float
    alive: bool

    @property
    def abandoned(self) -> bool:
        return bool(self.journal and self.journal.get("abandoned") is True)

    @property
    def same_version(self) -> bool:
        """Its journal is of this key, cachekit version and entry format: safe to resume."""
        j = self.journal or {}
        return (j.get("key") == self.key and j.get("cachekit_version") == __version__
                and j.get("format") == manifests.FORMAT_VERSION)

    def describe(self) -> str:
        """``pid 4242 on node7 (2048/10000 rows, 20%)``, for people."""
        j = self.journal or {}
        done, total = j.get("done"), j.get("total")
        if _is_count(done) and _is_count(total) and total:
            progress = f"{done}/{total} rows, {100 * done / total:.0f}%"
        else:
            progress = "starting"
        return f"pid {self.owner.get('pid')} on {self.owner.get('host')} ({progress})"


class Build:
    """A build directory this process owns. Its heartbeat beats from :meth:`LocalStore.begin`
    until it is committed, abandoned or discarded."""

    def __init__(self, key: str, path: Path, journal: dict[str, Any], beat_fd: int) -> None:
        self.key = key
        self.path = path
        self.journal = journal
        self._beat_fd: Optional[int] = beat_fd
        self._heartbeat = liveness.Heartbeat(beat_fd, where=path).start()

    def progress(self, done: int, total: int) -> None:
        """Record rows done, for the messages of processes that wait for this build."""
        self.journal.update(done=done, total=total, updated=time.time())
        _write_journal(self.path, self.journal)

    def stop(self) -> None:
        """Stop the heartbeat (idempotent)."""
        self._heartbeat.stop()
        if self._beat_fd is not None:
            os.close(self._beat_fd)
            self._beat_fd = None

    def abandon(self) -> None:
        """Leave the directory for any later builder to resume (best effort)."""
        self.stop()
        try:
            _write_journal(self.path, {**self.journal, "abandoned": True})
        except OSError:
            _fs.remove_tree(self.path)

    def discard(self) -> None:
        self.stop()
        _fs.remove_tree(self.path)


class LocalStore:
    """Entries under one cache root: lookup, begin, commit, remove, scan."""

    def __init__(self, root: Path) -> None:
        self.layout = Layout(Path(root))

    @property
    def root(self) -> Path:
        return self.layout.root

    # Lookup ------------------------------------------------------------------------------

    def lookup(self, key: str) -> Optional[Published]:
        """The published entry for ``key``, or None. Takes no lock; records the use.

        CacheCorruptError when the entry exists but its manifest is missing or bad. With
        ``CACHEKIT_SIGNING_KEY`` set, an entry without a valid signature is refused: it is
        removed, with a note on stderr, and this returns None, so that the caller builds and
        publishes a signed entry in its place (UnsignedEntryError when it cannot be removed).
        """
        entry_dir = self.layout.entry_dir(key)
        try:
            found = manifests.read(entry_dir)
        except FileNotFoundError:
            if entry_dir.is_dir():  # published entries always hold their manifest
                raise CacheCorruptError(entry_dir / manifests.MANIFEST_FILE,
                                        "the manifest is missing") from None
            return None
        except UnsignedEntryError as refused:
            self._remove_refused(entry_dir, key, refused)
            return None
        mark_used(entry_dir)
        return Published(entry_dir, found)

    def _remove_refused(self, entry_dir: Path, key: str, refused: UnsignedEntryError) -> None:
        """Move the refused entry at ``entry_dir`` out of the way and delete it.

        Claimed by a rename first, then read again: if another process replaced it with a
        validly signed entry between our read and the rename, that one is put back instead.
        """
        try:
            trash = self._trash_path(key)
            claimed = self._claim(entry_dir, trash)
        except OSError:
            raise refused from None  # e.g. a read-only root: this process cannot replace it
        if not claimed:
            return  # another process removed it first
        try:
            manifests.read(trash, key)
            if _fs.rename_dir_no_replace(trash, entry_dir):
                return  # a signed entry, published meanwhile: keep it
        except (OSError, ValueError):
            pass  # still refused (or unreadable): delete it
        delete_tree(trash)
        print(f"cachekit: refused entry {key[:12]}: {refused.reason}; removed it, a signed "
              "entry is built in its place", file=sys.stderr, flush=True)

    def still_published(self, published: Published) -> bool:
        """Whether ``published`` is still the entry under its key (not cleared meanwhile)."""
        try:
            return manifests.read(published.path) == published.manifest
        except (OSError, ValueError):
            return False

    # Builds ------------------------------------------------------------------------------

    def ensure_writable(self, key: str) -> None:
        """Create the root's folders; ReadOnlyCacheError when a build could not be stored."""
        try:
            for directory in (self.layout.entries, self.layout.tmp, self.layout.locks):
                directory.mkdir(parents=True, exist_ok=True)
            if not (os.access(self.layout.locks, os.W_OK) and os.access(self.layout.tmp, os.W_OK)):
                raise PermissionError
        except PermissionError:
            raise ReadOnlyCacheError(self.root, key) from None
        except OSError as e:
            if e.errno == errno.EROFS:
                raise ReadOnlyCacheError(self.root, key) from None
            raise

    def builds(self, key: str) -> list[BuildState]:
        """Every build directory of ``key`` under ``tmp/``, live or dead."""
        try:
            names = sorted(n for n in os.listdir(self.layout.tmp) if n.startswith(f"{key}."))
        except FileNotFoundError:
            return []
        states = (self.build_state(self.layout.tmp / name) for name in names)
        return [s for s in states if s is not None and s.key == key]

    def build_state(self, path: Path) -> Optional[BuildState]:
        """Describe the build directory ``path``; None when it is gone or not a build."""
        key, host, pid = parse_build_dir_name(path.name)
        if key is None or not _fs.is_plain_dir(path):
            return None
        journal = read_journal(path)
        owner = journal if journal and "host" in journal and "pid" in journal else \
            {"host": host, "pid": pid}
        try:
            heartbeat = _heartbeat_time(path)
        except FileNotFoundError:
            return None
        alive = liveness.is_alive(owner, heartbeat, where=path,
                                  abandoned=bool(journal and journal.get("abandoned") is True))
        return BuildState(key, path, dict(owner), journal, heartbeat, alive)

    def begin(self, key: str) -> Build:
        """A fresh private build directory for ``key``, its heartbeat beating."""
        path = self.layout.tmp / f"{self.layout.entry_dir(key).name}.{_fs.unique_suffix()}"
        path.mkdir()
        try:
            beat_fd = _fs.create_held_file(path / HEARTBEAT_FILE)
            journal = {"key": key, "format": manifests.FORMAT_VERSION,
                       "cachekit_version": __version__, **_fs.owner(), "started": time.time()}
            _write_journal(path, journal)
        except BaseException:
            _fs.remove_tree(path)
            raise
        return Build(key, path, journal, beat_fd)

    def adopt(self, build: Build, dead: BuildState) -> bool:
        """Move a dead build's data files and checkpoints into ``build`` to resume from.

        The dead directory is claimed by renaming it into ``build``'s own directory, so of
        two processes adopting it at once exactly one gets it, and from that instant it is
        covered by this build's heartbeat. False when another process claimed it first.
        """
        claimed = build.path / _CLAIMED
        if not self._claim(dead.path, claimed):
            return False
        for name in os.listdir(claimed):
            if _is_resumable_file(name) and os.path.isfile(claimed / name) \
                    and not os.path.islink(claimed / name):
                os.rename(claimed / name, build.path / name)
        _fs.remove_tree(claimed)
        return True

    def remove_dead(self, dead: BuildState) -> None:
        """Remove a dead build's directory (claimed first, so only one process does)."""
        trash = self._trash_path(dead.key)
        if self._claim(dead.path, trash):
            _fs.remove_tree(trash)

    def seal(self, build: Build, files: Iterable[tuple[str, str]]) -> tuple[FileRecord, ...]:
        """fsync and checksum the data files of ``build`` as (name, leaf kind) pairs, in
        order; their shape and dtype come from (and are checked against) each .npy header."""
        records = []
        for index, (name, kind) in enumerate(files):
            if name != manifests.file_name(index):
                raise ValueError(f"file {index} of a build must be {manifests.file_name(index)}")
            path = build.path / name
            shape, dtype = arrays.read_header(path)  # header and size agree
            _fs.fsync_file(path)
            size, digest = arrays.checksum(path)
            records.append(FileRecord(name, shape, dtype.str, size, digest, kind))
        return tuple(records)

    def commit(self, build: Build, manifest: Manifest) -> tuple[Published, bool]:
        """Publish ``build`` with ``manifest`` (its files sealed); (entry, True) when this
        build's rename won, (the entry another builder published first, False) otherwise."""
        listed = {f.name for f in manifest.files}
        stray = [n for n in os.listdir(build.path) if n not in listed and not _is_build_state(n)]
        if stray:
            raise CacheCorruptError(build.path, f"unexpected files {sorted(stray)[:5]} in the "
                                                "build directory; nothing was published")
        manifests.write(build.path, manifest)  # the last file written
        build.stop()
        for name in os.listdir(build.path):  # from here to the rename a crash means rebuilding
            if _is_build_state(name):
                _fs.remove_file(build.path / name)
        _fs.fsync_dir(build.path)
        entry_dir = self.layout.entry_dir(build.key)
        for _ in range(3):
            if _fs.rename_dir_no_replace(build.path, entry_dir):
                break
            winner = self.lookup(build.key)  # another builder won the race: use its entry,
            if winner is not None:  # unless it is refused (not signed with our key)
                _fs.remove_tree(build.path)
                return winner, False
        else:
            _fs.remove_tree(build.path)
            raise FileNotFoundError(f"entry {build.key} vanished after another builder "
                                    "published it")
        try:
            _fs.fsync_dir(self.layout.entries)  # makes the rename durable; it is visible
        except OSError:
            pass  # the entry is complete either way; a power cut may only cost a rebuild
        return Published(entry_dir, manifest), True

    # Removal -----------------------------------------------------------------------------

    def remove(self, path: Path, key: str) -> bool:
        """Remove an entry or dead build directory: renamed into ``tmp/deleting.*`` first
        (readers see all of it or none; processes that mapped it keep their bytes), then
        deleted. False when it was already gone."""
        trash = self._trash_path(key)
        if not self._claim(path, trash):
            return False
        delete_tree(trash)
        return True

    def _trash_path(self, key: str) -> Path:
        self.layout.tmp.mkdir(parents=True, exist_ok=True)
        return self.layout.tmp / f"{DELETING_PREFIX}{key}.{_fs.unique_suffix()}"

    @staticmethod
    def _claim(path: Path, to: Path) -> bool:
        if not _fs.is_plain_dir(path):
            return False  # a symlink is never followed, nor made ours
        try:
            os.rename(path, to)
        except FileNotFoundError:
            return False
        return True

    # Scan --------------------------------------------------------------------------------

    def entry_dirs(self) -> list[Path]:
        """Everything directly under ``entries/`` (the caller tells entries from strays)."""
        return _children(self.layout.entries)

    def temp_dirs(self) -> list[Path]:
        """Everything directly under ``tmp/``."""
        return _children(self.layout.tmp)


def delete_tree(path: Path) -> None:
    """Delete ``path``; retry once when another remover raced us and rmtree stopped early."""
    _fs.remove_tree(path)
    if os.path.lexists(path):
        _fs.remove_tree(path)


def mark_used(entry_dir: Path) -> None:
    """Record a use as the entry directory's mtime (prune removes the least recently used
    first): one syscall, no lock, the immutable entry is not rewritten."""
    try:
        os.utime(entry_dir)
    except OSError:
        pass  # a read-only or foreign-owned cache root must still serve hits


def read_journal(build_dir: Path) -> Optional[dict[str, Any]]:
    """The journal of a build directory (owner, key, progress), or None when unreadable."""
    try:
        with _fs.open_regular(build_dir / JOURNAL_FILE) as f:
            journal = json.loads(f.read(_JOURNAL_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    return journal if isinstance(journal, dict) else None


def _write_journal(build_dir: Path, journal: dict[str, Any]) -> None:
    _fs.write_json_atomic(build_dir / JOURNAL_FILE, journal, durable=False)


def _heartbeat_time(build_dir: Path) -> float:
    """The builder's last heartbeat: the heartbeat file's mtime, or, in the instant between
    creating the directory and the file, the directory's own."""
    try:
        return os.lstat(build_dir / HEARTBEAT_FILE).st_mtime
    except FileNotFoundError:
        return os.lstat(build_dir).st_mtime


def _is_build_state(name: str) -> bool:
    """Files of a build in progress that are never published."""
    return (name in (JOURNAL_FILE, HEARTBEAT_FILE) or name.endswith(CHECKPOINT_SUFFIX)
            or (name.startswith(".") and name.endswith(".tmp")))


def _is_resumable_file(name: str) -> bool:
    return name == manifests.DATA_FILE or name == manifests.DATA_FILE + CHECKPOINT_SUFFIX


def _children(directory: Path) -> list[Path]:
    try:
        return sorted(directory / name for name in os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
