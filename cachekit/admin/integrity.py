"""The full integrity check of published entries: manifest, .npy headers and sizes, checksums.

Opening an entry already checks the manifest, header and size; only this check also reads
every byte, to compare each data file with the checksum its manifest recorded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import _fs, arrays
from ..store import manifest as manifests
from ..errors import CacheCorruptError
from .inspect import (EntryInfo, Problem, list_entries, moved, resolve_keys,
                      without_other_formats)
from ..store import LocalStore
from ..store.row_view import read_row_map


def verify(store: LocalStore, keys: Optional[Iterable[str]] = None, *,
           on_start: Optional[Callable[[int, int], None]] = None,
           on_bytes: Optional[Callable[[int], None]] = None,
           on_other: Optional[Callable[[list[EntryInfo]], None]] = None) -> list[Problem]:
    """Fully check entries (all, or ``keys`` and unique prefixes of them); return the
    problems found, [] when all is well. Without ``keys``, items in ``entries/`` that are
    not entries count as problems too. Entries of another entry format (another cachekit
    version made them) are not checked and are no problem: this version never uses them;
    ``on_other`` is given them. With ``keys``, the other entries that link a damaged file
    are checked and reported too: rows are stored once, and each of them lends its files.

    ``on_start(entries, bytes)`` is called with what is about to be checked (each file
    once, however many entries link it), once more for entries added for a damaged file,
    and ``on_bytes(n)`` after each entry with the bytes of its files not counted before,
    for a progress bar.
    """
    everything, problems = list_entries(store)
    entries = everything
    if keys is not None:
        wanted = set(resolve_keys(keys, [e.key for e in entries]))
        entries = [e for e in entries if e.key in wanted]
        problems = [p for p in problems if p.key in wanted]
    kept = without_other_formats(entries, on_other)
    unused = {e.key for e in entries} - {e.key for e in kept}  # (list_entries said why)
    problems = [p for p in problems if p.key not in unused]
    hashed: dict[tuple[int, ...], str] = {}
    damaged: set[tuple[int, int]] = set()
    counted: set[tuple[int, int, int]] = set()
    checked: set[str] = set()
    while kept:
        if on_start is not None:
            on_start(len(kept), sum(f[2] for f in {f for e in kept for f in e.files} - counted))
        for entry in kept:
            checked.add(entry.key)
            problem = None
            if entry.problem is None:
                problem = check_entry(entry.path, hashed, damaged)
            elif entry.key not in {p.key for p in problems}:  # a sharer list_entries found bad
                problem = Problem(entry.key, entry.path, entry.problem)
            if problem is not None:
                problems.append(problem)
            if on_bytes is not None:
                on_bytes(sum(f[2] for f in set(entry.files) - counted))
            counted.update(entry.files)
        # Entries left out by ``keys`` that link a damaged file: a rebuild of a cleared entry
        # would link that file again from them, so they are as broken as the ones asked for.
        kept = [e for e in everything if e.key not in checked and not e.other_format
                and any(f[:2] in damaged for f in e.files)]
    return problems


def check_entry(path: Path, hashed: Optional[dict[tuple[int, ...], str]] = None,
                damaged: Optional[set[tuple[int, int]]] = None) -> Optional[Problem]:
    """The problem with the entry at ``path``, or None when every file matches its manifest
    (and a derived entry's row map points inside its files). ``hashed``: checksums of files
    read already, by (device, inode, size, mtime), so a file that several entries link is
    read once, and each of them is told when it does not match. ``damaged`` is given the
    (device, inode) of a file whose bytes do not match."""
    hashed = {} if hashed is None else hashed
    try:
        identity = path.lstat()
    except FileNotFoundError:
        return None  # removed (cachekit clear) since it was listed
    problem, bad = _problem(path, hashed)
    if problem is not None and moved(path, identity):
        return None  # removed, or removed and built again, while we checked: not a problem
    if bad is not None and damaged is not None:
        damaged.add(bad)
    return problem


def _problem(path: Path, hashed: dict[tuple[int, ...], str]
             ) -> tuple[Optional[Problem], Optional[tuple[int, int]]]:
    """:func:`check_entry`'s finding, before it asks whether the directory was replaced,
    with the (device, inode) of a data file whose bytes do not match."""
    try:
        manifest = manifests.read(path)
        if not manifest.contiguous:
            read_row_map(path, manifest)
        for record in manifest.files:
            record.open(path)  # checks the .npy header and the size
            seen = _fs.file_version(os.lstat(path / record.name))
            if seen not in hashed:
                hashed[seen] = arrays.checksum(path / record.name)[1]
            actual = hashed[seen]
            if actual != record.checksum:
                return Problem(path.name, path, f"checksum mismatch in {record.name}: manifest "
                               f"says {record.checksum}, the file has {actual}"), seen[:2]
    except FileNotFoundError:
        return Problem(path.name, path, f"{manifests.MANIFEST_FILE} is missing"), None
    except CacheCorruptError as e:
        return Problem(path.name, path, _naming_its_file(e, path)), None
    except OSError as e:
        return Problem(path.name, path, f"unreadable: {e}"), None
    return None, None


def _naming_its_file(error: CacheCorruptError, entry_dir: Path) -> str:
    """``error``'s reason, after the name of the entry's file it is about when the reason
    does not say it: several entries may link one damaged file."""
    file = Path(error.path)
    if file.parent != entry_dir or file.name in error.reason:
        return error.reason
    return f"{file.name}: {error.reason}"
