"""Where entries live. The cache logic asks a store for what it needs (lookup, begin a
build, commit it, remove, scan) and never for filesystem operations, so that a second
store, an object store, can sit behind or beside the local one.
"""

from .build_dirs import BuildDir, BuildState, parse_build_dir_name
from .local import DELETING_PREFIX, Layout, LocalStore, Published, default_root

__all__ = ["BuildDir", "BuildState", "DELETING_PREFIX", "Layout", "LocalStore", "Published",
           "default_root", "parse_build_dir_name"]
