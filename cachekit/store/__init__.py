"""Where entries live. The cache logic asks a store for what it needs (lookup, begin a
build, commit it, remove, scan) and never for filesystem operations, so that a second
store, an object store, can sit behind or beside the local one.
"""

from .builds import Build, BuildState
from .local import Layout, LocalStore, Published, default_root

__all__ = ["Build", "BuildState", "Layout", "LocalStore", "Published", "default_root"]
