"""Checking a remote tier's entries byte by byte: what ``cachekit verify --remote`` does."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from .. import checksums
from ..errors import CacheCorruptError
from ..store.remote import NONE, OTHERS, RemoteEntry, RemoteStore
from .inspect import Problem, resolve_keys, without_other_formats
from .remote import RemoteEntryInfo, scan


def verify(remote: RemoteStore, keys: Optional[Iterable[str]] = None, *,
           on_start: Optional[Callable[[int, int], None]] = None,
           on_bytes: Optional[Callable[[int], None]] = None,
           on_other: Optional[Callable[[list[RemoteEntryInfo]], None]] = None
           ) -> tuple[int, list[Problem]]:
    """Check remote entries (all, or ``keys`` and unique prefixes): manifest, signature,
    each object's size and checksum (every byte is read; a pool object that several
    entries name, once). (entries checked, problems). Entries of another cachekit version
    are not checked and are no problem (never used by this one); ``on_other`` is given
    them. With ``keys``, the other entries that name a damaged pool object are checked and
    reported too."""
    found = scan(remote)
    entries = list(found.entries)
    if keys is not None:
        wanted = set(resolve_keys(keys, [e.key for e in entries]))
        entries = [e for e in entries if e.key in wanted]
    entries = without_other_formats(entries, on_other)
    problems: list[Problem] = []
    digests: dict[str, str] = {}
    damaged: set[str] = set()
    checked: set[str] = set()
    while entries:
        if on_start is not None:  # each object once: a pool object read already, not again
            unread = {path for e in entries for path in e.pool} - digests.keys()
            on_start(len(entries), sum(e.own_bytes for e in entries)
                     + sum(o.size for o in found.pool if o.path in unread))
        for info in entries:
            checked.add(info.key)
            problem, bad = info.problem, None
            if problem is None and info.entry is not None:
                problem, bad = _check(remote, info.entry, digests, on_bytes)
                if problem is not None and remote.named(info.key, info.entry.upload) in (
                        NONE, OTHERS):
                    continue  # removed, or uploaded again, while it was read: no problem
            if bad is not None:
                damaged.add(bad)
            if problem is not None:
                problems.append(Problem(info.key, info.url, problem))  # type: ignore[arg-type]
        # Entries left out by ``keys`` that name a damaged pool object: it goes only with the
        # last entry that names it, and until then a push finds it there and sends it not.
        entries = [e for e in found.entries if e.key not in checked and not e.other_format
                   and not e.pool.isdisjoint(damaged)]
    return len(checked), problems


def _check(remote: RemoteStore, entry: RemoteEntry, digests: dict[str, str],
           on_bytes: Optional[Callable[[int], None]]) -> tuple[Optional[str], Optional[str]]:
    """(what is wrong with ``entry``'s objects, the object found wrong), or (None, None);
    ``digests`` holds the checksums of the objects read so far."""
    m = entry.manifest
    for record, path in zip(m.files, entry.objects(remote)):
        if path not in digests:
            try:
                remote.check_sizes(entry.key, [record], [path])
                digests[path] = _digest(remote, path, record.bytes, on_bytes)
            except CacheCorruptError as e:
                return f"{record.name}: {e.reason}", path
            except FileNotFoundError:
                return f"{record.name}: the object went missing while it was read", path
        if digests[path] != record.checksum:
            return (f"checksum mismatch in {record.name}: the manifest says {record.checksum},"
                    f" the object has {digests[path]}"), path
    return None, None


def _digest(remote: RemoteStore, path: str, size: int,
            on_bytes: Optional[Callable[[int], None]]) -> str:
    whole = checksums.hasher()
    for block in remote.read_ranges(path, size):
        whole.update(block)
        if on_bytes is not None:
            on_bytes(len(block))
    return checksums.hex_checksum(whole)
