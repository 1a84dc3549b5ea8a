"""Looking at a cache root: what is there, who is building, what is broken.

Nothing here changes an entry (a scan keeps only this user's memo of what it read, see
:mod:`cachekit.admin.listing_memo`). A build directory is live or orphaned by the one rule of
:mod:`cachekit.liveness` (its builder's heartbeat), the same rule builders use; no lock
is taken.

Inspection returns frozen dataclasses; a scan never aborts on a broken entry or a stray file,
it records a :class:`Problem` and goes on. Removal lives in :mod:`cachekit.admin.local_removal`, the
full integrity check in :mod:`cachekit.admin.integrity`.

An entry's last use is its directory's mtime: every hit sets it with one ``os.utime`` (see
:meth:`cachekit.store.LocalStore.lookup`), without a lock and without rewriting the immutable entry.

Temporary directories under ``tmp/`` are in one of four states:

- ``building``: its builder is alive (a fresh heartbeat, on this host or another); nothing
  ever touches it.
- ``orphaned``: its builder died or gave up; removable (else the next build of the key
  resumes from it).
- ``deleting``: an entry or orphan being removed by a live process on this host right now.
- ``leftover``: a removal that was interrupted (or runs on another host); removable.
"""

from __future__ import annotations

import collections
import datetime
import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, TypeVar

from .. import _fs, processes, units
from ..errors import CacheCorruptError, EntryNotFoundError, InvalidArgument, OtherFormatError
from ..key_names import KEY_HEX_LENGTH, is_key
from ..store import REMOVAL, LocalStore, parse_temp_name
from ..store import manifest as manifests
from . import disk_usage, listing_memo, permissions

BUILDING, ORPHANED, DELETING, LEFTOVER = "building", "orphaned", "deleting", "leftover"
REMOVABLE_STATES = frozenset({ORPHANED, LEFTOVER})
SHORT_KEY = 12
"""How many hex digits of a key people are shown (a unique prefix in practice)."""


@dataclass(frozen=True)
class EntryInfo:
    """One published entry. Manifest fields are None when ``problem`` says it is unreadable."""

    key: str
    kind: Optional[str]
    rows: Optional[int]
    shape: Optional[tuple[int, ...]]
    dtype: Optional[str]
    bytes: int
    created: float
    last_used: float
    path: Path
    column: Optional[str] = None
    failed_rows: int = 0
    params: Optional[dict[str, Any]] = None
    problem: Optional[str] = None
    other_format: bool = False
    """Whether ``problem`` is only that another cachekit version made it (another entry
    format): this version never uses it, and it is not damaged."""
    origin: Optional[dict[str, Any]] = None
    """Where a per-row entry's rows came from when it was built: ``reused`` ([key, rows]
    of each entry they were shared with), ``decoded`` (by its builder) and ``joined`` (by
    other processes for its build); None for entries that do not say."""
    failed_build: Optional[str] = None
    """Set for the rows a failed build kept: the key whose build failed. Not an entry (no
    call hits it), a source of rows for later builds; removed like an entry."""
    shared_bytes: int = 0
    """Of ``bytes``, those of files that other entries of the root hold too (a row is
    stored once: derived entries link the data files they share)."""
    files: tuple[tuple[int, int, int], ...] = field(default=(), compare=False, repr=False)
    """(device, inode, size) of each of its files: what the root's total counts once."""

    @property
    def own_bytes(self) -> int:
        """Bytes that removing this entry alone would free."""
        return self.bytes - self.shared_bytes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the objects of ``cachekit ls --json``)."""
        return {
            "key": self.key, "kind": self.kind, "rows": self.rows,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype, "bytes": self.bytes, "created": self.created,
            "last_used": self.last_used, "path": str(self.path), "column": self.column,
            "failed_rows": self.failed_rows, "params": self.params, "problem": self.problem,
            "other_format": self.other_format, "origin": self.origin,
            "failed_build": self.failed_build,
            "own_bytes": self.own_bytes, "shared_bytes": self.shared_bytes,
        }


@dataclass(frozen=True)
class TempDir:
    """A directory under ``tmp/``: a build in progress or left by a dead builder, or a removal."""

    key: str
    path: Path
    state: str
    bytes: int
    modified: float
    owner: str
    """Who made it, e.g. ``pid 4242 on node7 (2048/10000 rows)``."""
    blocked_by: Optional[int] = None
    """For an orphan or a leftover: the uid of the other user whose directory in it this
    process may not empty (a teammate's build, private to its builder), who alone removes it
    (:mod:`.permissions`)."""

    @property
    def removable(self) -> bool:
        """Whether this process may remove it now: dead, and all of it this user's to empty."""
        return self.state in REMOVABLE_STATES and self.blocked_by is None


@dataclass(frozen=True)
class StrayIndex:
    """The row index files of an entry removed outside cachekit (``ROOT/index/*/KEY.npy``
    with no ``entries/KEY``): bytes no entry holds, which name nothing. A lookup that meets
    one removes it, and so do ``prune``, ``clear --all`` and ``clear KEY``."""

    key: str
    bytes: int


@dataclass(frozen=True)
class Problem:
    """Something wrong on disk: a corrupt entry, or an item cachekit did not put there."""

    key: Optional[str]
    path: Path
    message: str


@dataclass(frozen=True)
class Scan:
    """Everything under one cache root at one moment."""

    root: Path
    entries: tuple[EntryInfo, ...]
    temp_dirs: tuple[TempDir, ...]
    problems: tuple[Problem, ...]
    stray_index: tuple[StrayIndex, ...] = ()

    @property
    def bytes(self) -> int:
        """Bytes on disk: each file once, however many entries link it."""
        return (stored_bytes(self.entries) + sum(t.bytes for t in self.temp_dirs)
                + sum(s.bytes for s in self.stray_index))


def stored_bytes(entries: Iterable[EntryInfo]) -> int:
    """The bytes ``entries`` hold on disk, each file once however many of them link it."""
    return sum(size for _, _, size in {f for e in entries for f in e.files})


def scan(store: LocalStore) -> Scan:
    """Describe every entry and temporary directory of ``store``; never raises for bad items.
    Reads again only the manifests that changed since this user's last scan
    (:mod:`~cachekit.admin.listing_memo`), and keeps what it read for the next."""
    indexed = store.row_index.files()
    memo = listing_memo.load(store)
    entries, problems = list_entries(store, indexed, memo)
    listing_memo.save(store, memo)
    temp_dirs, temp_problems = list_temp_dirs(store)
    named = {e.key for e in entries} | {p.path.name for p in problems if p.key is None}
    strays = tuple(StrayIndex(key, sum(f[2] for f in set(files)))
                   for key, files in sorted(indexed.items()) if key not in named)
    return Scan(store.root, tuple(entries), tuple(temp_dirs), tuple(problems + temp_problems),
                strays)


def list_entries(store: LocalStore, indexed: Optional[dict[str, list[tuple[int, int, int]]]]
                 = None, memo: Optional[listing_memo.Memo] = None
                 ) -> tuple[list[EntryInfo], list[Problem]]:
    """Published entries (sorted by creation), and problems met on the way. An entry's
    files include its row index files (``indexed``: ``store.row_index.files()``, listed before
    the entries), which go with it. With ``memo``, what it holds of a manifest is not read
    again, and what is read is kept in it."""
    entries: list[EntryInfo] = []
    problems: list[Problem] = []
    indexed = store.row_index.files() if indexed is None else indexed
    folder = store.layout.open_folder_if_any("entries")
    if folder is None:
        return [], []
    sizes = disk_usage.FileSizes(f for files in indexed.values() for f in files)
    found = []
    with folder, os.scandir(folder.fd) as listed:
        for item in sorted(listed, key=lambda item: item.name):
            if not is_key(item.name) or not item.is_dir():
                problems.append(Problem(None, folder.path / item.name,
                                        "not a cache entry (cachekit did not make it)"))
                continue
            fields = _entry_fields(folder, item.name, sizes, indexed.get(item.name, ()), memo)
            if fields is not None:  # (else removed while we looked)
                found.append(fields)
    holders = collections.Counter(f for fields in found for f in fields["files"])
    for fields in found:
        info = EntryInfo(**fields, shared_bytes=sum(f[2] for f in fields["files"]
                                                    if holders[f] > 1))
        entries.append(info)
        if info.problem is not None:
            problems.append(Problem(info.key, info.path, info.problem))
    entries.sort(key=lambda e: (e.created, e.key))
    return entries, problems


def _entry_fields(entries: _fs.DirHandle, key: str, sizes: disk_usage.FileSizes,
                  also: Iterable[disk_usage.FileId] = (),
                  memo: Optional[listing_memo.Memo] = None) -> Optional[dict[str, Any]]:
    """The :class:`EntryInfo` fields but ``shared_bytes`` of the entry directory ``key`` of
    the open ``entries`` folder, with the files ``also`` that go with it outside, each file
    once (the index file of an entry that holds no row of its own is its row map); None
    when it no longer exists. Everything is read through one handle of the directory; a
    name that is a symlink is a problem, never followed. ``sizes``: the files the listing
    met, ``memo``: what an earlier listing read of manifests (see :func:`list_entries`)."""
    try:
        directory = entries.child(key)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in _fs.NOT_A_FILE_ERRNOS:
            raise
        return _broken_entry(entries.path / key, also)
    path = directory.path  # (made once: the manifest's messages name it too)
    with directory:
        st = os.fstat(directory.fd)
        try:
            known: Optional[os.stat_result] = directory.lstat(manifests.MANIFEST_FILE)
        except OSError:
            known = None
        else:
            sizes.saw(known)
        files = tuple(dict.fromkeys(sizes.files_at(directory, st.st_dev) + tuple(also)))
        listed = {"key": key, "bytes": sum(f[2] for f in files), "last_used": st.st_mtime,
                  "path": path, "files": files}
        remembered = None if memo is None or known is None else memo.look(key, known)
        if remembered is not None:
            return {**listed, **remembered}
        try:
            manifest = manifests.read_at(directory, key)
        except FileNotFoundError:
            if moved(entries.path / key, st):  # removed, or removed and built again
                return None
            problem = f"{manifests.MANIFEST_FILE} is missing"
            other_format = False
        except CacheCorruptError as e:
            problem = e.reason
            other_format = isinstance(e, OtherFormatError)
        else:
            read = {"kind": manifest.kind, "rows": manifest.rows, "shape": manifest.shape,
                    "dtype": manifest.data_files[0].dtype_name,
                    "created": manifest.created, "column": manifest.column,
                    "failed_rows": manifest.failed_count, "params": manifest.params,
                    "origin": None if manifest.origin is None else manifest.origin.to_json(),
                    "failed_build": manifest.failed_build}
            if memo is not None and known is not None:
                memo.keep(key, known, read)
            return {**listed, **read}
    return {**listed, "kind": None, "rows": None, "shape": None, "dtype": None,
            "created": st.st_mtime, "problem": problem, "other_format": other_format}


def moved(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` no longer names the directory ``st`` was taken of: removed, or
    removed and built again (by another process, while a listing or a check read it)."""
    try:
        return not _fs.same_file(path.lstat(), st)
    except FileNotFoundError:
        return True


def _broken_entry(path: Path, also: Iterable[tuple[int, int, int]]) -> Optional[dict[str, Any]]:
    """The :class:`EntryInfo` fields of an entry's name that is a symlink (to a directory:
    the caller skips others): a problem, never read through, with the bytes of the link
    itself."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    files = tuple(dict.fromkeys(((st.st_dev, st.st_ino, st.st_size), *also)))
    return {"key": path.name, "kind": None, "rows": None, "shape": None, "dtype": None,
            "bytes": sum(f[2] for f in files), "created": st.st_mtime,
            "last_used": st.st_mtime, "path": path, "files": files,
            "problem": "an entry is never a symlink or a file"}


def list_temp_dirs(store: LocalStore) -> tuple[list[TempDir], list[Problem]]:
    """Directories under ``tmp/`` with their state, and problems met on the way."""
    temp_dirs: list[TempDir] = []
    problems: list[Problem] = []
    for item in store.temp_dirs():
        info = temp_dir_info(store, item)
        if info is None:
            if item.exists():
                problems.append(Problem(None, item, "not a cachekit temporary directory"))
            continue
        temp_dirs.append(info)
    temp_dirs.sort(key=lambda t: (t.modified, t.path.name))
    return temp_dirs, problems


def temp_dir_info(store: LocalStore, path: Path) -> Optional[TempDir]:
    """Describe ``tmp/KEY.HOST.PID.UUID`` or ``tmp/deleting.KEY.HOST.PID.UUID``; else None."""
    named = parse_temp_name(path.name)
    if named is None or not _fs.is_plain_dir(path):
        return None
    key, host, pid = named.key, named.host, named.pid
    try:
        modified = path.stat().st_mtime
        size = disk_usage.tree_bytes(path)
    except FileNotFoundError:
        return None
    if named.kind == REMOVAL:
        alive = processes.owner_state({"host": host, "pid": pid}) == "alive"
        return TempDir(key, path, DELETING if alive else LEFTOVER, size, modified,
                       f"removal by pid {pid} on {host}", None if alive else _blocker(path))
    state = store.build_state(path)
    if state is None:
        return None
    description = state.describe() + (", abandoned" if state.abandoned else "")
    return TempDir(key, path, BUILDING if state.alive else ORPHANED, size,
                   max(modified, state.heartbeat), description,
                   None if state.alive else _blocker(path))


def _blocker(path: Path) -> Optional[int]:
    try:
        with _fs.DirHandle.open(path.parent) as folder:
            return permissions.blocking_owner(folder, path.name)
    except OSError:
        return None


class _Versioned(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def other_format(self) -> bool: ...


Versioned = TypeVar("Versioned", bound=_Versioned)


def without_other_formats(entries: list[Versioned],
                          on_other: Optional[Callable[[list[Versioned]], None]]
                          ) -> list[Versioned]:
    """``entries`` (local or remote) but those of another entry format, which ``verify``
    leaves unchecked: another cachekit version made them, this one never uses them, and
    they are not damaged. ``on_other`` is given them."""
    others = [e for e in entries if e.other_format]
    if others and on_other is not None:
        on_other(others)
    return [e for e in entries if not e.other_format]


def resolve_keys(prefixes: Iterable[str], known: Iterable[str]) -> list[str]:
    """Expand each key or unique key prefix to a full key among ``known``, in order.

    Raises InvalidArgument (a ValueError) for text that is not hex or for an ambiguous
    prefix (naming every match), and EntryNotFoundError (also a KeyError) when nothing
    matches.
    """
    known = sorted(set(known))
    resolved: list[str] = []
    for prefix in prefixes:
        text = prefix.lower()
        if not text or len(text) > KEY_HEX_LENGTH or any(c not in string.hexdigits for c in text):
            raise InvalidArgument(f"not a cache key or key prefix: {prefix!r} (keys are "
                                  f"{KEY_HEX_LENGTH} hex digits, see `cachekit ls`)")
        matches = [k for k in known if k.startswith(text)]
        if not matches:
            raise EntryNotFoundError(f"no cache entry matches {prefix!r} (see `cachekit ls`)")
        if len(matches) > 1:
            raise InvalidArgument(f"key prefix {prefix!r} is ambiguous; it matches "
                                  f"{', '.join(matches)}")
        if matches[0] not in resolved:
            resolved.append(matches[0])
    return resolved


def local_time(t: float) -> Optional[datetime.datetime]:
    """``t`` (seconds since the epoch) as a local time; None when it is not one, as in a
    manifest that says it was created at 1e300, -1e300 or NaN."""
    try:
        return datetime.datetime.fromtimestamp(t)
    except (OverflowError, OSError, ValueError):
        return None


def ago(t: float, now: float) -> str:
    """How long before ``now`` the time ``t`` was, for people; ``?`` when ``t`` is no time."""
    return "?" if local_time(t) is None else units.format_age(now - t)
