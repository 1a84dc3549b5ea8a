"""What ``ls`` read from each entry's manifest, kept for this user's next ``ls`` of the root
(``locks/listing.UID.json``), so that a listing reads again only the manifests that changed.

Reading and checking every manifest is most of what ``ls`` costs, and storing a row once
makes entries cheap, so a root may hold thousands of them. A published manifest is never
rewritten, so the memo keeps, for each entry, the identity of its manifest file (inode,
size, mtime and ctime in ns) and what was read from it; a manifest of another identity is
read again. The identity leaves the device out: the hosts that mount one network root see
it under device numbers of their own, and the same user's listings on each (a budget's
eviction after every commit among them) share the memo. No user can set a file's ctime: a
manifest replaced or written in place gets another identity, except when it changes twice
within one tick of a coarse filesystem clock, so a manifest changed less than
:data:`SETTLE_NS` before the memo is written is not kept (git's index treats "racily
clean" files the same way). Only manifests that read without a problem are kept.

The memo is a record of this user (:mod:`cachekit.store.failures`): honoured only when the
file belongs to this user and, with signing on, carries a valid signature with the key set
now (so a memo made without the key, or with another, is not used; one made with the key
holds only manifests signed with it, which read the same without it). It names its layout
and the entry format; a memo that is refused, unreadable or of another layout or format is
ignored and written anew. Writing it is best effort: on a root this user cannot write,
``ls`` reads every manifest each time.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..key_names import FORMAT_VERSION
from ..store import LocalStore, failures

SETTLE_NS = 2_000_000_000
"""How long before the memo is written a manifest must have last changed to be kept."""
FIELDS = ("kind", "rows", "shape", "dtype", "created", "column", "failed_rows", "params",
          "origin", "failed_build")
"""What an entry's listing takes from its manifest (:class:`~.inspect.EntryInfo` fields)."""
_SUBJECT = "ls"
_MADE = ["listing 2", FORMAT_VERSION]
"""The memo's layout and the entry format it read: a memo made otherwise is not used."""


def file_name() -> str:
    """This user's memo, in the root's ``locks/``."""
    return f"listing.{os.geteuid()}.json"


def identity(st: os.stat_result) -> list[int]:
    """What tells one manifest file from another, as the memo holds it: every entry of a
    root lies on the root's filesystem, whose inode numbers tell its files apart."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


@dataclass
class Memo:
    """The memo one listing reads, and what it keeps for the next."""

    known: dict[str, Any] = field(default_factory=dict)
    """The memo as read: key -> [identity, fields]."""
    kept: dict[str, Any] = field(default_factory=dict)
    """What this listing found, to be written: key -> [identity, fields]."""
    read_again: bool = False

    def look(self, key: str, manifest: os.stat_result) -> Optional[dict[str, Any]]:
        """The fields of :data:`FIELDS` the memo holds of entry ``key``'s manifest file, whose
        ``lstat`` is ``manifest``, as an ``EntryInfo`` takes them; None when it holds none of
        that very file."""
        record = self.known.get(key)
        if not (isinstance(record, list) and len(record) == 2 and record[0] == identity(manifest)
                and isinstance(record[1], dict) and record[1].keys() == set(FIELDS)
                and isinstance(record[1]["shape"], list)):
            return None
        self.kept[key] = record
        return {**record[1], "shape": tuple(record[1]["shape"])}

    def keep(self, key: str, manifest: os.stat_result, read: dict[str, Any]) -> None:
        """Remember ``read``, the fields of :data:`FIELDS` read from entry ``key``'s
        manifest file, whose ``lstat`` was ``manifest``."""
        self.read_again = True
        if manifest.st_ctime_ns <= time.time_ns() - SETTLE_NS:
            self.kept[key] = [identity(manifest), {f: read[f] for f in FIELDS}]


def load(store: LocalStore) -> Memo:
    """This user's memo of ``store``'s root, or an empty one."""
    try:
        with store.layout.open_folder("locks") as locks:
            record, _ = failures.read(locks, file_name(), _SUBJECT)
    except OSError:
        return Memo()
    if record is None or record.get("made") != _MADE or not isinstance(
            record.get("entries"), dict):
        return Memo()
    return Memo(known=record["entries"])


def save(store: LocalStore, memo: Memo) -> None:
    """Write what this listing kept, when it differs from the memo it read."""
    if not memo.read_again and memo.kept.keys() == memo.known.keys():
        return
    try:
        with store.layout.open_folder("locks") as locks:
            failures.write(locks, file_name(), _SUBJECT, {"made": _MADE,
                                                          "entries": memo.kept})
    except OSError:
        pass  # a root this user cannot write: the next ls reads every manifest again
