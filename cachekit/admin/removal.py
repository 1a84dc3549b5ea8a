"""Removing entries safely while other processes read and build: one family of removals,
local and remote, each made by looking only and carried out by ``execute()``.

Because making a removal changes nothing, ``--dry-run`` and the confirmation prompt cost
nothing, and the command line shows, confirms and reports every removal the same way: a
:class:`Removal` has its :class:`Item` s (what will go), what it leaves alone
(:class:`Skipped`, each with why) and its goal; ``execute()`` removes each item that is
still safe to remove and returns a :class:`RemovalReport`. This module holds the family; the
local removals are :mod:`.local_removal`'s, the remote one is
:class:`cachekit.admin.remote_clear.RemoteRemoval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional, Union

from .. import units

ENTRY, LEFTOVER_DIRECTORY, FAILURE_RECORD = "entry", "leftover directory", "failure record"
STRAY_INDEX, LOCK_FILE, HOLD_RECORD = "stray index file", "lock file", "hold record"
"""What an :class:`Item` is (``Item.noun``): a published entry, a directory under ``tmp/``
left by a dead builder or an interrupted removal, a key's recorded build failure, the row
index files of an entry removed outside cachekit, a lock file left behind, and the record
of a hold whose process is gone (these two have no ``line``: they are only counted)."""


@dataclass(frozen=True)
class Item:
    """One thing a removal takes away (or leaves alone), as people are shown it."""

    key: Optional[str]
    noun: str
    """What it is, in the singular: ``entry``, ``leftover directory``, ..."""
    name: str
    """Its short name in messages, e.g. a directory's name."""
    path: Union[Path, str]
    """Where it is: a path, or a URL of the remote."""
    bytes: int
    line: str
    """Its line in the list a removal shows before it asks."""
    subject: Any = field(compare=False)
    """What the inspection found: an EntryInfo, a TempDir, a key, ..."""


@dataclass(frozen=True)
class Skipped:
    """Something a removal or its execution left alone (or failed to remove), and why."""

    item: Item
    reason: str

    @property
    def key(self) -> Optional[str]:
        return self.item.key

    @property
    def path(self) -> Union[Path, str]:
        return self.item.path

    @property
    def name(self) -> str:
        return self.item.name


@dataclass(frozen=True)
class RemovalReport:
    """What ``Removal.execute()`` did: what went, what stayed and why (what the removal
    skipped from the start first), and what could not be removed (the reason says why)."""

    removed: tuple[Item, ...]
    skipped: tuple[Skipped, ...]
    failed: tuple[Skipped, ...]

    @property
    def freed_bytes(self) -> int:
        return sum(item.bytes for item in self.removed)

    @property
    def removed_entries(self) -> tuple[Any, ...]:
        """What the inspection found of each removed entry (an EntryInfo locally)."""
        return tuple(item.subject for item in self.removed if item.noun == ENTRY)

    @property
    def removed_temp_dirs(self) -> tuple[TempDir, ...]:
        """The removed directories under a local root's ``tmp/``."""
        return tuple(item.subject for item in self.removed if item.noun == LEFTOVER_DIRECTORY)

    def summary(self) -> str:
        """E.g. ``2 entries and 1 leftover directory, freed 1.2 MB``."""
        return f"{counted(self.removed)}, freed {units.format_size(self.freed_bytes)}"


@dataclass(frozen=True, kw_only=True)
class Removal:
    """Things to remove (``items``, in the order they go), what is left alone and why
    (``skipped``), and what the removal is for (``goal``, e.g. ``in /data/cache``).

    A member of the family says how one item goes (:meth:`remove`) and which errors mean
    that an item could not be removed (``failures``); the rest is common to all.
    """

    items: tuple[Item, ...]
    skipped: tuple[Skipped, ...] = ()
    goal: str
    failures: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def entries(self) -> tuple[Any, ...]:
        """What the inspection found of each entry to remove."""
        return self.subjects(ENTRY)

    def subjects(self, noun: str) -> tuple[Any, ...]:
        return tuple(item.subject for item in self.items if item.noun == noun)

    def summary(self) -> str:
        """What a dry run would remove, e.g. ``3 entries (1.2 MB) in /data/cache``."""
        return f"{counted(self.items)} ({units.format_size(self.bytes)}) {self.goal}"

    def remove(self, item: Item) -> Optional[str]:
        """Remove ``item`` if it is still safe to: None when it went, else why it stays.
        Raises one of ``failures`` when it could not be removed."""
        raise NotImplementedError

    def execute(self) -> RemovalReport:
        """Remove every item that is still safe to remove, in order."""
        removed: list[Item] = []
        skipped = list(self.skipped)
        failed: list[Skipped] = []
        for item in self.items:
            try:
                reason = self.remove(item)
            except self.failures as e:
                failed.append(Skipped(item, str(e)))
                continue
            if reason is None:
                removed.append(item)
            else:
                skipped.append(Skipped(item, reason))
        return RemovalReport(tuple(removed), tuple(skipped), tuple(failed))


def counted(items: Iterable[Item]) -> str:
    """``items`` counted by what they are, entries first and always: ``0 entries and 2
    leftover directories``."""
    counts = {ENTRY: 0}
    for item in items:
        counts[item.noun] = counts.get(item.noun, 0) + 1
    return " and ".join(f"{n} {noun if n == 1 else _plural(noun)}" for noun, n in counts.items()
                        if n or noun == ENTRY)


def _plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
