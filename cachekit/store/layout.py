"""Where a cache root is, and where each kind of file of it lives.

::

    ROOT/
      entries/KEY/manifest.json        published, immutable; the manifest is written last
      entries/KEY/data.npy, leaf_N.npy the files the manifest lists (a per-row entry's
                                       row_ids.npy, row_blocks.npy, row_stats.npy too)
      index/RECIPE/KEY.npy             the row index of each recipe (a hint, see row_index)
      tmp/KEY.HOST.PID.UUID/           a private build directory: state.json (owner,
                                       progress), heartbeat (its mtime is the builder's
                                       heartbeat), data files and the builder's working
                                       files (a fill's chunk journal); resumed.N/, dead
                                       builds of this user it claimed to copy chunks from
      tmp/deleting.KEY.HOST.PID.UUID/  an entry or dead build being removed
      locks/KEY.lock                   build locks (they only save duplicate work)
      locks/KEY.lock.holder            who holds the OS lock, its mtime their heartbeat
      locks/KEY.failed.json            the rows of the last failed build, for its waiters
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheRootError
from ..keys import is_key
from .manifest import Manifest


def default_root() -> Path:
    """$CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else ~/.cache/cachekit."""
    explicit = os.environ.get("CACHEKIT_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cachekit"


def check_root(root: Path) -> None:
    """CacheRootError when ``root``, or the nearest of its parents that exists, is not a
    directory (a root that does not exist yet is made by the first build)."""
    for path in (root, *root.parents):
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there (yet), or a parent further up is the blocker
        except OSError:
            return  # e.g. no permission to look: the first real use says so, in its words
        if not stat.S_ISDIR(mode):
            raise CacheRootError(root, path)
        return


@dataclass(frozen=True)
class Layout:
    """Where each kind of file of one cache root lives."""

    root: Path

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def entry_dir(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.lock"

    def failure_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.failed.json"


@dataclass(frozen=True)
class Published:
    """A published entry: its directory and its checked manifest."""

    path: Path
    manifest: Manifest
