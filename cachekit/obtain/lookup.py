"""Looking a key up for a call: the store only reads (:meth:`LocalStore.lookup`); what a
call does with what it found is decided here, in one place: it records the use of an entry
(for prune and the budget) and removes one refused for its signature, so that a signed
entry is built in its place.
"""

from __future__ import annotations

from typing import Optional

from ..store import LocalStore, Published, Refused


def find_entry(store: LocalStore, key: str) -> Optional[Published]:
    """The published entry of ``key``, its use recorded; None when there is none, or when
    it was refused (then removed, with a note; UnsignedEntryError when this process cannot
    remove it)."""
    found = store.lookup(key)
    if isinstance(found, Refused):
        store.remove_refused(found)
        return None
    if found is not None:
        store.record_use(found)
    return found
