"""Publishing a build directory: the correctness point of the local store.

Every listed file is checksummed (:func:`seal`), the manifest is written last, every file
and the directory are fsynced together, and the directory is renamed into ``entries/`` in
one atomic step that never replaces an existing entry (:func:`commit`), so a published
entry is complete by construction and of two racing builders the first rename wins.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable, Iterable, Optional

from .. import _fs, file_modes, flushing
from . import manifest as manifests
from ..errors import BuildGone, CacheCorruptError
from .build_dirs import BuildDir, is_build_state
from .layout import Published
from .manifest import FileRecord, Manifest
from .temp_names import trash_name

RENAME_ATTEMPTS = 3
"""Renames tried when something that is not an entry keeps appearing under the key."""


def seal(build: BuildDir, files: Iterable[tuple[str, str]],
         digests: Optional[dict[str, str]] = None,
         durable: Iterable[str] = ()) -> tuple[FileRecord, ...]:
    """Checksum the data files of ``build`` as (name, leaf kind) pairs, in order, for the
    commit to fsync them (:attr:`BuildDir.unsynced`); their shape and dtype come from (and
    are checked against) each .npy header.
    ``digests``: checksums the writer computed as it wrote (a download), by name.
    ``durable``: the names of links to files of committed entries (not fsynced again)."""
    from .. import arrays  # numpy: what a build needs, which removing an entry does not

    durable = frozenset(durable)
    records = []
    for index, (name, kind) in enumerate(files):
        if not manifests.allowed_file_name(index, name):
            raise ValueError(f"file {index} of a build must be {manifests.file_name(index)}")
        shape, dtype, size, digest = arrays.seal(build.dir, name, (digests or {}).get(name))
        records.append(FileRecord(name, shape, dtype.str, size, digest, kind))
    build.unsynced += [r.name for r in records if r.name not in durable]
    return tuple(records)


def commit(build: BuildDir, manifest: Manifest, entries: _fs.DirHandle,
           lookup: Callable[[str], Optional[Published]], *,
           scratch: Callable[[str], bool]) -> tuple[Published, bool]:
    """Publish ``build`` with ``manifest`` (its files sealed) as ``entries/KEY``, KEY being
    the manifest's (the build's own, or for the rows a failed build keeps, their key);
    (entry, True) when this build's rename won, (the entry another builder published first,
    as ``lookup(key)`` finds it, False) otherwise. See :meth:`LocalStore.commit`."""
    listed = {f.name for f in manifest.files}

    def unpublished(name: str) -> bool:
        return is_build_state(name) or scratch(name)

    stray = [n for n in build.dir.names() if n not in listed and not unpublished(n)]
    if stray:
        raise CacheCorruptError(build.path, f"unexpected files {sorted(stray)[:5]} in the "
                                            "build directory; nothing was published")
    if not build.still_ours():
        raise BuildGone(str(build.path))  # taken over while we were paused
    manifests.write_at(build.dir, manifest)  # the last file written
    build.beat_on_directory()
    for name in build.dir.names():  # from here to the rename a crash means rebuilding
        if unpublished(name):
            _remove_working(build, name)
    # Every file, the manifest and the directory's names on disk before the rename, in
    # one batch of fsyncs: a device flushes them together (cachekit.flushing).
    flushing.fsync_names(build.dir, [*build.unsynced, manifests.MANIFEST_FILE],
                         directory_too=True)
    # Any member of the group may now remove it; nobody writes in it. (A setgid bit
    # inherited from the root stays: fchmod would clear it.)
    build.dir.chmod(file_modes.shared_dir_mode() | (os.fstat(build.dir.fd).st_mode & stat.S_ISGID))
    mine = os.fstat(build.dir.fd)
    try:
        current = build.tmp.lstat(build.name)
    except FileNotFoundError:
        raise BuildGone(str(build.path)) from None
    if not _fs.same_file(current, mine):
        raise CacheCorruptError(build.path, "the build directory was replaced by another "
                                            "process; nothing was published")
    won, winner = _rename_into(build, manifest.key, entries, mine, lookup)
    if not won:
        build.discard()
        if winner is None:
            raise CacheCorruptError(entries.path / manifest.key, "another process keeps "
                                    "putting something that is not an entry under this key",
                                    "nothing was published; see who writes under the root")
        return winner, False
    build.close()
    return Published(entries.path / manifest.key, manifest), True


def _rename_into(build: BuildDir, key: str, entries: _fs.DirHandle, mine: os.stat_result,
                 lookup: Callable[[str], Optional[Published]]
                 ) -> tuple[bool, Optional[Published]]:
    """Rename the build directory to ``entries/KEY`` (``key``): (True, None) when ours is the entry
    now, (False, the winner's entry) when another builder's rename came first, (False,
    None) when something that is not an entry keeps appearing under the key."""
    won, winner = False, None
    for _ in range(RENAME_ATTEMPTS):
        try:
            build.tmp.rename(build.name, entries, key)
            won = True
        except FileNotFoundError:
            raise BuildGone(str(build.path)) from None  # claimed this very moment
        except NotADirectoryError:  # a symlink or file planted under the key
            if not stat.S_ISDIR(entries.lstat(key).st_mode):
                entries.unlink(key)
            continue
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            won = False
        # Another builder won the race: use its entry, unless it is refused (not signed
        # with our key), which ``lookup`` removes then; try again.
        winner = None if won else lookup(key)
        if won or winner is not None:
            break
    if won and not _fs.same_file(entries.lstat(key), mine):
        entries.remove_tree(key)  # swapped in between: never publish that
        raise CacheCorruptError(build.path, "the build directory was replaced by another "
                                            "process; nothing was published")
    if won:
        try:
            entries.fsync()  # makes the rename durable; it is already visible
        except OSError:
            pass  # the entry is complete either way; a power cut may cost a rebuild
    return won, winner


def _remove_working(build: BuildDir, name: str) -> None:
    """Remove a working file or folder of ``build`` before it is published.

    A folder is first renamed out of the build (a late joiner's record then lands in the
    trash, never in the entry), then deleted."""
    if not stat.S_ISDIR(build.dir.lstat(name).st_mode):
        build.dir.unlink(name)
        return
    trash = trash_name(build.key)
    build.dir.rename(name, build.tmp, trash)
    for attempt in range(3):
        try:
            build.tmp.remove_tree(trash)
            return
        except OSError:
            if attempt == 2:
                return  # left for `cachekit clear`: it removes leftovers of dead processes
