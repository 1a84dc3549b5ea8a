"""The files under a directory of a cache root and their sizes, as a listing counts them.

A derived entry links the data files of the entries whose rows it shares, so a root of a
sweep's folds holds each part file under many names. A listing (``ls``, ``prune``, a
budget's eviction) needs each name's file and size to count a shared file once. It stats
each file once however many entries link it: a directory's listing names each file's inode
without a stat, and an inode already met takes what its first stat said.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from .. import _fs

FileId = tuple[int, int, int]
"""(device, inode, size) of a file: what a root's total counts once."""


class FileSizes:
    """The files of the directories one listing looks at, each file stat'ed once."""

    def __init__(self, met: Iterable[FileId] = ()) -> None:
        """``met``: files already stat'ed (such as the row index's, whose file is a
        derived entry's row map)."""
        self._met: dict[tuple[int, int], FileId] = {(dev, ino): (dev, ino, size)
                                                    for dev, ino, size in met}

    def saw(self, st: os.stat_result) -> None:
        """Take ``st``, the ``lstat`` of a file the listing is about to meet, as its stat."""
        self._met[st.st_dev, st.st_ino] = (st.st_dev, st.st_ino, st.st_size)

    def files_at(self, directory: _fs.DirHandle, device: int) -> tuple[FileId, ...]:
        """Each file under the open ``directory`` (on ``device``), by name from its handle:
        a symlink is counted as itself, never followed."""
        found = []
        with os.scandir(directory.fd) as listing:
            for item in listing:
                try:
                    if item.is_dir(follow_symlinks=False):
                        with directory.child(item.name) as sub:
                            found.extend(self.files_at(sub, os.fstat(sub.fd).st_dev))
                        continue
                    met = (device, item.inode())
                    file = self._met.get(met)
                    if file is None:
                        st = item.stat(follow_symlinks=False)
                        file = self._met[met] = (st.st_dev, st.st_ino, st.st_size)
                except OSError:
                    continue  # removed, or replaced by another kind, while we looked
                found.append(file)
        return tuple(found)


def tree_bytes(path: Path) -> int:
    """Total size of the files under the directory ``path`` (the size of ``path`` itself
    when it is not one); FileNotFoundError when it is gone."""
    if not path.is_dir():
        return path.lstat().st_size
    try:
        with _fs.DirHandle.open(path) as directory:
            return sum(size for _, _, size in FileSizes().files_at(
                directory, os.fstat(directory.fd).st_dev))
    except OSError:  # removed or replaced while we looked
        return 0
