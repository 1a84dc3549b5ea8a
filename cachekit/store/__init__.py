"""Where entries live. The cache asks a store for what it needs (look a key up, remove its
entry, list the keys) and never for filesystem operations, so that a second store, an object
store, sits beside the local one.

The local store (:class:`LocalStore`) also builds: a build is a private directory under its
``tmp/`` (:class:`BuildDir`; any process sees one as a :class:`BuildState`), published by one
atomic rename. Names under ``tmp/`` tell what each directory is (:func:`parse_temp_name`).
The remote store is :class:`cachekit.store.remote.RemoteStore` (imported on its own, so a
local run never loads it), with its build leases in :mod:`cachekit.store.lease`.
"""

from .build_dirs import BuildDir, BuildState
from .layout import FAILED, STALE, Layout, Published, Refused, default_root
from .local import LocalStore
from .temp_names import BUILD, REMOVAL, TempName, parse_temp_name

__all__ = ["BUILD", "FAILED", "REMOVAL", "STALE", "BuildDir", "BuildState", "Layout",
           "LocalStore", "Published", "Refused", "TempName", "default_root", "parse_temp_name"]
