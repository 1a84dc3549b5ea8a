"""The files of a derived entry that this host holds already: what a download links
instead of reading from the bucket.

A derived entry's parts (another entry's data file, and its row identities and stats)
are named in its manifest with their size and checksum. An entry of the same recipe in
the local root that lists a file of the same size and checksum holds those very bytes
(each was checksummed when it was committed), so a pull of a fold whose full entry is
here moves its row map and manifest, not its rows. The entry of the key itself, set aside
to be built again (``tmp/deleting.KEY.*``: a heal that met another host's healed entry of
the key in the bucket), holds most of that entry's rows and is looked in too. Only this
user's files are linked, from the open file (see
:meth:`cachekit._fs.DirHandle.link_open_file`); anything that does not link is downloaded
as usual, and the download's seal compares every file with the manifest's record either
way.
"""

from __future__ import annotations

import os
from typing import Optional

from .. import _fs
from . import manifest as manifests
from .local import LocalStore
from .manifest import FileRecord, Manifest
from .temp_names import REMOVAL, parse_temp_name


def link_local_copies(local: LocalStore, build: _fs.DirHandle, manifest: Manifest) -> set[str]:
    """Link into ``build`` each part file of ``manifest`` that an entry of its recipe in
    ``local`` holds, or the key's entry set aside, with the same size and checksum; the
    names linked."""
    wanted: dict[tuple[str, int], list[FileRecord]] = {}
    for record in manifest.files:
        if manifests.is_part_file(record.name):
            wanted.setdefault((record.checksum, record.bytes), []).append(record)
    if not wanted or manifest.reuse is None:
        return set()
    linked: set[str] = set()
    recipe = manifest.reuse.recipe
    sources = (("entries", lambda: [(key, key) for key in local.keys()]),  # (name, key)
               ("tmp", lambda: [(name, manifest.key)
                                for name in _set_aside(local, manifest.key)]))
    for folder, candidates in sources:
        opened = local.layout.open_folder_if_any(folder) if wanted else None
        if opened is None:
            continue
        with opened:
            for name, key in candidates():
                if not wanted:
                    break
                found = _open_entry(opened, name, key, recipe)
                if found is None:
                    continue
                entry, theirs = found
                with entry:
                    for record in theirs.files:
                        for want in wanted.pop((record.checksum, record.bytes), []):
                            if _link(entry, record, build, want.name):
                                linked.add(want.name)
    return linked


def _set_aside(local: LocalStore, key: str) -> list[str]:
    """The names under ``tmp/`` of entries of ``key`` set aside (or being removed)."""
    found = [(p.name, parse_temp_name(p.name)) for p in local.temp_dirs()]
    return [name for name, what in found
            if what is not None and what.kind == REMOVAL and what.key == key]


def _open_entry(folder: _fs.DirHandle, name: str, key: str, recipe: str
                ) -> Optional[tuple[_fs.DirHandle, Manifest]]:
    """The entry of ``key`` at ``folder/name`` open, with its checked manifest, when it is
    of ``recipe``."""
    try:
        entry = folder.child(name)
    except OSError:
        return None
    try:
        theirs = manifests.read_at(entry, key)
    except (OSError, ValueError):
        entry.close()
        return None
    if theirs.reuse is None or theirs.reuse.recipe != recipe:
        entry.close()
        return None
    return entry, theirs


def _link(entry: _fs.DirHandle, record: FileRecord, build: _fs.DirHandle, name: str) -> bool:
    """Link ``entry``'s file of ``record`` into ``build`` as ``name``: a file of this user
    whose size is the record's."""
    try:
        with entry.open_file(record.name) as f:
            st = os.fstat(f.fileno())
            return (st.st_size == record.bytes and st.st_uid == os.geteuid()
                    and build.link_open_file(f, name))
    except OSError:
        return False
