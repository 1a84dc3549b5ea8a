"""A cache budget (``Cache(max_size=...)``, ``$CACHEKIT_MAX_SIZE``), kept after each commit
and before a build or a download writes (room made for what it writes): the least recently
used entries go, as ``cachekit prune`` removes them, never the entry the call returns nor
one that a live process uses (:mod:`cachekit.store.holds`)."""

from __future__ import annotations

from typing import Sequence

from .. import units
from ..messages import say
from ..store import LocalStore, holds
from ..store.manifest import Manifest
from .inspect import stored_bytes
from .local_removal import removal_for_prune
from .removal import ENTRY, LEFTOVER_DIRECTORY, RemovalReport


def keep_to_budget(store: LocalStore, max_size: int, returned: Manifest) -> None:
    """Remove the least recently used entries until the root fits ``max_size``, never
    the entry of manifest ``returned`` (which a call returns now); say what went (a note of
    the call's work), and warn in one line, a quiet call too, when the root is left over the
    budget: for that entry alone (its bytes on disk, as ``cachekit ls`` counts them), else
    for entries live processes use."""
    key = returned.key
    removal = removal_for_prune(store, max_size, keep=[key])
    report = removal.execute()
    _say_removed(report, max_size)
    left = removal.counted - sum(item.bytes for item in report.removed
                                 if item.noun in (ENTRY, LEFTOVER_DIRECTORY))
    in_use = [s.item for s in report.skipped if s.reason == holds.IN_USE]
    entries = "entry" if len(in_use) == 1 else "entries"
    size = next((e.bytes for e in removal.kept), returned.bytes)
    if size > max_size:  # the root could not fit whatever else went: one line says why
        alone, root = units.format_size(size), units.format_size(left)
        held = (f"; the root holds {root}, with {len(in_use)} {entries} live processes use"
                if in_use and root != alone else "")  # (not "24.7 MB" again, a few KB more)
        say(f"entry {key[:12]} alone ({alone}) is larger than the cache "
            f"budget of {units.format_size(max_size)}; it is returned all the same{held}",
            always=True)
    elif in_use and left > max_size:
        shown = units.format_size(stored_bytes(item.subject for item in in_use))
        share, them = ("it shares", "it") if len(in_use) == 1 else ("they share", "them")
        say(f"cache budget {units.format_size(max_size)}: the root holds "
            f"{units.format_size(left)}; live processes use {len(in_use)} {entries} "
            f"({shown}, the files {share} with others included) of it, kept until no "
            f"process holds {them}", always=True)


ROOM_SHARE = 0.01
"""The least share of the budget a build or download writes that has room made for it
first: the scan of the root that makes room grows with its entries and costs more than a
small build, and the root is then over the budget by that share at most until the
commit."""


def make_room(store: LocalStore, max_size: int, needed: int, keep: Sequence[str]) -> None:
    """Before a build or a download writes ``needed`` bytes (:data:`ROOM_SHARE` of the
    budget or more): remove the least recently used entries until the root and those bytes
    fit ``max_size``, as :func:`keep_to_budget` would once it commits, never the entries
    ``keep`` (first the key written, then the entries it shares rows with). Says what went;
    what is left over the budget is said after the commit."""
    if needed < max_size * ROOM_SHARE:
        return
    report = removal_for_prune(store, max(0, max_size - needed), keep=list(keep)).execute()
    _say_removed(report, max_size, f" to make room for the {units.format_size(needed)} "
                 f"entry {keep[0][:12]} is about to write")


def _say_removed(report: RemovalReport, max_size: int, why: str = "") -> None:
    removed = [item for item in report.removed if item.noun == ENTRY]
    if removed:
        say(f"cache budget {units.format_size(max_size)}: removed {len(removed)} least "
            f"recently used entr{'y' if len(removed) == 1 else 'ies'} "
            f"({units.format_size(sum(item.bytes for item in removed))}){why}")
