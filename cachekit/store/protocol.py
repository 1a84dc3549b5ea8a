"""What the cache asks of any place where entries live, the local root and a remote bucket
alike: find a key's entry, remove it, list the keys that have one.

Both :class:`~cachekit.store.local.LocalStore` and
:class:`~cachekit.store.remote.RemoteStore` have this shape (a test checks their
signatures). Building is the local store's alone: a build runs in a local build directory
(``begin``, ``seal``, ``commit``), and a remote store is filled from a published local
entry (``upload``) and read back into one (``download``), so that every entry a process
maps was checked and committed by the local store.
"""

from __future__ import annotations

from typing import Optional, Protocol, TypeVar, runtime_checkable

EntryT = TypeVar("EntryT", covariant=True)


@runtime_checkable
class Store(Protocol[EntryT]):
    """Entries by key. ``EntryT`` is what a store hands back for a key: a
    :class:`~cachekit.store.layout.Published` local directory, or a
    :class:`~cachekit.store.remote.RemoteEntry`."""

    def lookup(self, key: str) -> Optional[EntryT]:
        """The published entry of ``key``, or None. CacheCorruptError when one is there
        but broken."""
        ...

    def remove_entry(self, key: str) -> bool:
        """Remove the entry of ``key`` so that no reader finds it from now on; False when
        there was none."""
        ...

    def keys(self) -> list[str]:
        """The keys that have an entry (maybe a broken one), sorted."""
        ...
