"""The full integrity check of published entries: manifest, .npy headers and sizes, checksums.

Opening an entry already checks the manifest, header and size; only this check also reads
every byte, to compare each data file with the checksum its manifest recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import arrays
from ..store import manifest as manifests
from ..errors import CacheCorruptError
from .inspect import Problem, list_entries, resolve_keys
from ..store import LocalStore


def verify(store: LocalStore, keys: Optional[Iterable[str]] = None, *,
           on_start: Optional[Callable[[int, int], None]] = None,
           on_bytes: Optional[Callable[[int], None]] = None) -> list[Problem]:
    """Fully check entries (all, or ``keys`` and unique prefixes of them); return the
    problems found, [] when all is well. Without ``keys``, items in ``entries/`` that are
    not entries count as problems too.

    ``on_start(entries, bytes)`` is called once with what is about to be checked, and
    ``on_bytes(n)`` after each entry with its size, for a progress bar.
    """
    entries, problems = list_entries(store)
    if keys is not None:
        wanted = set(resolve_keys(keys, [e.key for e in entries]))
        entries = [e for e in entries if e.key in wanted]
        problems = [p for p in problems if p.key in wanted]
    if on_start is not None:
        on_start(len(entries), sum(e.bytes for e in entries))
    for entry in entries:
        if entry.problem is None:  # else list_entries reported it already
            problem = check_entry(entry.path)
            if problem is not None:
                problems.append(problem)
        if on_bytes is not None:
            on_bytes(entry.bytes)
    return problems


def check_entry(path: Path) -> Optional[Problem]:
    """The problem with the entry at ``path``, or None when every file matches its manifest."""
    try:
        manifest = manifests.read(path)
        for record in manifest.files:
            arrays.open_record(path, record)  # checks the .npy header and the size
            _, actual = arrays.checksum(path / record.name)
            if actual != record.checksum:
                return Problem(path.name, path, f"checksum mismatch in {record.name}: manifest "
                                                f"says {record.checksum}, the file has {actual}")
    except (FileNotFoundError, CacheCorruptError, OSError) as e:
        if not path.exists():
            return None  # removed (cachekit clear) while we checked: not a problem
        if isinstance(e, FileNotFoundError):
            return Problem(path.name, path, f"{manifests.MANIFEST_FILE} is missing")
        if isinstance(e, CacheCorruptError):
            return Problem(path.name, path, e.reason)
        return Problem(path.name, path, f"unreadable: {e}")
    return None
