"""The rows a per-row build shares with committed entries of its recipe (its donors).

The row index (:mod:`cachekit.store.row_index`) names the entries that may hold rows of
the column; each is opened, checked and let go of (:mod:`cachekit.store.shared_rows`: what
was read is kept, not a handle), and only rows whose full identity matches, that did not
fail, and (with ``validate="path"`` or ``"stat"``) whose file's stat is the one recorded
when that entry was built, are shared: the build links or copies the files that hold them
(:mod:`cachekit.obtain.parts`) and decodes only the others.

A build of local paths under ``validate="path"`` does not stat every file it shares: it
checks them as a hit checks its entry's files (:mod:`cachekit.obtain.staleness`), a
sample now (:func:`stats_on_record`; every file when one of those changed) and every file
in the background once the entry is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import numpy as np

from .. import source_stats
from ..messages import say
from ..store import LocalStore
from ..store.index_format import Needles
from ..store.row_index import skipped_note
from ..store.shared_rows import SharedRows, open_shared_rows
from ..units import count
from .staleness import SAMPLE_ROWS


@dataclass(frozen=True)
class Rows:
    """A per-row build's rows as reuse sees them: the recipe, each row's identity (an
    (N, 2) ``<u8`` array of the value's; for ``validate="content"`` two more words, the
    identity of the file's digest), for images each file's (size, mtime_ns) now (None:
    not taken yet, the donors' records are checked by :func:`stats_on_record` instead),
    and whether a row is reused only where that stat is the one its donor recorded
    (``validate="path"`` or ``"stat"``; under ``"content"`` the digest words must match)."""

    recipe: str
    ids: np.ndarray
    stats: Optional[np.ndarray] = None
    same_stat: bool = False

    @cached_property
    def needles(self) -> Needles:
        """The rows' lookup hashes sorted for the row index, once: a call looks them up
        before its build's lock and again after it (10 ms a sort at 130,000 rows)."""
        return Needles(self.ids[:, 0])


@dataclass(frozen=True)
class Donor:
    """Rows ``src`` of the committed entry ``source`` that are rows ``dst`` of the build."""

    source: SharedRows
    src: np.ndarray
    dst: np.ndarray


@dataclass
class Donors:
    """The entries opened to share rows with (closed by :meth:`close`), the entries that
    could not be used, the row shape and dtype they hold (``template``), and of the rows
    left to compute those that a donor holds but failed (``failed_before``) or whose file
    changed since (``changed``)."""

    donors: list[Donor] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    index_note: str = ""
    """What the lookup says of the row index files it skipped, if any."""
    template: Optional[tuple[tuple[int, ...], np.dtype]] = None
    failed_before: int = 0
    changed: int = 0
    unopened: int = 0
    """Rows left to compute that the row index says are held by ``skipped`` entries."""

    @property
    def rows(self) -> int:
        return sum(len(d.dst) for d in self.donors)

    @property
    def files(self) -> int:
        """How many data files (told apart by checksum, as parts are named) hold the rows
        the donors lend, read from their manifests."""
        checksums = set()
        for donor in self.donors:
            files, _ = donor.source.locate(donor.src)
            checksums.update(donor.source.manifest.data_files[int(k)].checksum
                             for k in np.unique(files))
        return len(checksums)

    def close(self) -> None:
        for donor in self.donors:
            donor.source.close()

    def __enter__(self) -> "Donors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def find(store: LocalStore, key: str, rows: Rows,
         template: Optional[tuple[tuple[int, ...], Any]],
         healed: Optional[SharedRows] = None) -> Donors:
    """The committed entries of ``rows.recipe`` in ``store`` that hold rows of the column,
    opened and checked, and which of their rows to share: each row from one entry, this
    user's entries first, then those with the most rows. ``template``: the row shape and
    dtype the build makes (None: the first donor's). ``healed``: the stale entry of ``key``
    itself, opened before it was removed to be built again
    (:mod:`cachekit.obtain.staleness`): its rows come first, row for row, where their files
    did not change."""
    found = Donors()
    remaining = np.ones(len(rows.ids), dtype=bool)
    changed = np.zeros(len(rows.ids), dtype=bool)
    unopened = np.zeros(len(rows.ids), dtype=bool)
    failed_ids: list[np.ndarray] = []
    wanted = None if template is None else (tuple(template[0]), np.dtype(template[1]))
    index_skipped: list[str] = []

    def offer(source: SharedRows, src: np.ndarray, dst: np.ndarray) -> None:
        nonlocal wanted
        shape = (tuple(source.manifest.shape[1:]), source.manifest.dtype)
        if wanted is not None and shape != wanted:
            source.close()
            return
        failed_ids.append(source.ids[source.failed, :2])
        src, dst = _usable(source, src, dst, rows, changed)
        if not len(dst):
            source.close()
            return
        wanted = found.template = shape
        found.donors.append(Donor(source, src, dst))
        remaining[dst] = False

    read: dict[str, SharedRows] = {}

    def read_rows(key: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The hashes and rows an entry indexed by its row map offers, read from it."""
        source = open_shared_rows(store, key, rows.recipe)
        if source is None:
            return None
        source.release()
        read[key] = source
        offered = np.flatnonzero(~source.failed)
        return source.ids[offered, 0], offered

    try:
        if healed is not None:
            same = np.arange(min(len(rows.ids), healed.manifest.rows))
            offer(healed, same, same)
        for match in store.row_index.matches(rows.recipe, rows.needles, remaining,
                                             read_rows=read_rows, exclude=key,
                                             skipped=index_skipped):
            source = read.pop(match.key, None) or open_shared_rows(store, match.key,
                                                                   rows.recipe)
            if source is None:
                found.skipped.append(match.key)
                unopened[match.dst] = True
                continue
            source.release()  # (hundreds may lend rows: no handle kept on any)
            offer(source, match.src, match.dst)
    except BaseException:
        found.close()
        raise
    finally:
        for unused in read.values():
            unused.close()
    if index_skipped:
        found.index_note = skipped_note(rows.recipe, index_skipped)
    failed = _held(rows.ids, remaining, failed_ids)
    found.failed_before = int(failed.sum())
    found.changed = int((changed & remaining & ~failed).sum())
    found.unopened = int((unopened & remaining & ~failed & ~changed).sum())
    return found


def _held(ids: np.ndarray, remaining: np.ndarray, held: list[np.ndarray]) -> np.ndarray:
    """Which rows of ``remaining`` have their identity among ``held`` (the identities of
    rows that failed in a donor; the index, which skips them, has no part). Linear in the
    rows and the held ids: one sorted membership test on the first word, then a set of the
    full identities for the rows it leaves."""
    found = np.zeros(len(ids), dtype=bool)
    held_ids = np.concatenate(held)[:, :2] if held else ids[:0, :2]
    if not len(held_ids):
        return found
    rows = np.flatnonzero(remaining & np.isin(ids[:, 0], held_ids[:, 0]))
    if len(rows):
        known = set(map(tuple, held_ids.tolist()))
        found[rows] = [tuple(pair) in known for pair in ids[rows, :2].tolist()]
    return found


def _usable(source: SharedRows, src: np.ndarray, dst: np.ndarray, rows: Rows,
            changed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a match that may be shared: the same full identity, not failed, and
    for ``same_stat`` the same file stat as recorded. Marks in ``changed`` the rows of the
    build that this source holds with another stat."""
    inside = (src >= 0) & (src < source.manifest.rows)
    src, dst = src[inside], dst[inside]
    same = (source.ids[src, :2] == rows.ids[dst, :2]).all(axis=1) & ~source.failed[src]
    if rows.ids.shape[1] > 2:  # the file's digest must be the one the source decoded
        if source.ids.shape[1] != rows.ids.shape[1]:
            return src[:0], dst[:0]
        same &= (source.ids[src, 2:] == rows.ids[dst, 2:]).all(axis=1)
    if rows.same_stat:
        if source.stats is None:
            return src[:0], dst[:0]
        if rows.stats is None:  # the record is checked after (stats_on_record)
            same &= source.stats[src, 0] >= 0
            return src[same], dst[same]
        unchanged = (source.stats[src] == rows.stats[dst]).all(axis=1) & (rows.stats[dst, 0] >= 0)
        changed[dst[same & ~unchanged]] = True
        same &= unchanged
    return src[same], dst[same]


def stats_on_record(found: Donors, values: np.ndarray) -> Optional[np.ndarray]:
    """Each row's file stat for a build that found ``found`` without stat-ing its files
    (local paths, ``validate="path"``): the stat its donor recorded for a shared row, the
    file's now for the others. None when the file of one of a sample of the shared rows
    (:data:`~.staleness.SAMPLE_ROWS`, as a hit checks) differs from its record: the column
    changed in bulk, and the caller stats every row and finds the donors again. The files
    the sample misses are compared in the background once the entry is committed."""
    stats = np.full((len(values), 2), -1, dtype=np.int64)
    shared = np.zeros(len(values), dtype=bool)
    for donor in found.donors:
        stats[donor.dst] = donor.source.stats[donor.src]
        shared[donor.dst] = True
    held = np.flatnonzero(shared)
    picked = np.random.default_rng().choice(held, min(SAMPLE_ROWS, len(held)), replace=False)
    if (source_stats.file_stats(values[picked]) != stats[picked]).any():
        return None
    rest = np.flatnonzero(~shared)
    stats[rest] = source_stats.file_stats(values[rest])
    return stats


def say_shared(key: str, found: Donors, rows: int, taken: dict[str, int],
               copied: dict[str, int]) -> None:
    """Say on stderr how many rows the build shares and with how many entries (``taken``:
    the rows it took from each, by key), how many of them it copies (``copied``, by key: a
    contiguous build copies them all), and what the rows it decodes are: new, failed in
    the entry that holds them, changed, or held in an entry or a file it could not open or
    check; and which files of the row index it skipped."""
    if found.index_note:
        say(found.index_note, always=True)
    if found.donors or found.unopened:
        shared = sum(taken.values())
        new = rows - found.rows - found.failed_before - found.changed - found.unopened
        parts = [count(new, "new row")] if new else []
        if found.failed_before:
            parts.append(f"{found.failed_before} that failed before")
        if found.changed:
            parts.append(f"{found.changed} whose files changed")
        if found.unopened:
            parts.append(f"{found.unopened} in entries it could not open or check")
        if found.rows > shared:
            parts.append(f"{found.rows - shared} in files it could not open or check")
        rest = "decoding " + " and ".join(parts) if parts else "nothing left to decode"
        linked = {k: n - copied.get(k, 0) for k, n in taken.items()}
        took = [f"sharing {count(sum(linked.values()), 'row')} with {_entries(linked)} of "
                "the same recipe (stored once)"] if any(linked.values()) else []
        if any(copied.values()):
            took.append(f"copying {count(sum(copied.values()), 'row')} from "
                        f"{_entries(copied)}{'' if took else ' of the same recipe'}")
        lead = ", ".join(took) + "; " if took else ""
        say(f"entry {key[:12]}: {lead}{rest}")
    for skipped in found.skipped:
        say(f"entry {key[:12]}: entry {skipped[:12]} is gone or failed its checks; its rows "
            "are not reused")


def _entries(rows: dict[str, int]) -> str:
    """How many entries lend rows (``rows``: how many each lends, by key), in words."""
    lenders = sum(1 for n in rows.values() if n)
    return "1 entry" if lenders == 1 else f"{lenders} entries"
