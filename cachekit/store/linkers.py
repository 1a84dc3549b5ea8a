"""Which of an entry's data files removing unused entries would free: a derived entry links
the data files of the entries it shares rows with, and a file's blocks go only with its
last name.

A file that no other entry links goes with the entry; one that other entries link goes
with them, unless a live process uses one of them (:func:`cachekit.store.holds.in_use`),
which keeps it. Finding the other names lists each entry's directory: a listing gives each
name's inode without a stat.
"""

from __future__ import annotations

import os
from typing import Iterable

from ..key_names import is_key
from . import holds
from .layout import Layout
from .manifest import Manifest

Inode = tuple[int, int]


def freeable_bytes(layout: Layout, manifest: Manifest) -> int:
    """The bytes of the data files of ``manifest``'s entry that removing it and every entry
    no live process uses would free: each file's rows (``data_bytes``), unless an entry in
    use links it too. 0 when the entry is gone."""
    with layout.open_entry(manifest.key) as folder:
        if folder is None:
            return 0
        device = os.fstat(folder.fd).st_dev
        sizes: dict[Inode, int] = {}
        shared: set[Inode] = set()
        for record in manifest.data_files:
            try:
                st = folder.lstat(record.name)
            except OSError:
                continue  # gone with the entry, removed meanwhile
            sizes[device, st.st_ino] = record.data_bytes
            if st.st_nlink > 1:
                shared.add((device, st.st_ino))
    kept: set[Inode] = set()
    if shared:
        linkers = _linkers(layout, shared, other_than=manifest.key)
        used = holds.in_use(layout, {key for keys in linkers.values() for key in keys})
        kept = {inode for inode, keys in linkers.items() if keys & used}
    return sum(size for inode, size in sizes.items() if inode not in kept)


def _linkers(layout: Layout, inodes: Iterable[Inode], other_than: str
             ) -> dict[Inode, set[str]]:
    """The entries other than ``other_than`` that link each of ``inodes``."""
    found: dict[Inode, set[str]] = {inode: set() for inode in inodes}
    entries = layout.open_folder_if_any("entries")
    if entries is None:
        return found
    with entries:
        for key in entries.names():
            if key == other_than or not is_key(key):
                continue
            try:
                with entries.child(key) as folder, os.scandir(folder.fd) as listing:
                    device = os.fstat(folder.fd).st_dev
                    for item in listing:
                        keys = found.get((device, item.inode()))
                        if keys is not None:
                            keys.add(key)
            except OSError:
                continue  # removed meanwhile, not a directory, or not ours to read
    return found
