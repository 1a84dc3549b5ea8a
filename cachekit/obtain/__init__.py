"""Getting an entry: look it up, wait for or join another process's build, or build it.

The coordinator between the public face (:class:`cachekit.Cache`, memoize) and the engine
and the store: :func:`obtain` returns the published entry of a key, building it with the
caller's build function on a miss; :func:`obtain_and_open` also checks it against what the
call expects and opens it. Modules: ``flow`` (obtain), ``wait`` (the one wait loop, bounded
by ``lock_timeout``), ``local_wait`` (the build lock, live builders, joining), ``commit``
(building in a private directory and the atomic commit), ``accounting`` (the seconds a
call spent on its own work, not waiting), ``row_build`` (the per-row build: its rows'
identities, the entry's row files), ``donors`` (the committed entries that hold a build's
rows) and ``parts`` (linking their files in, the row map), ``staleness`` (did a hit's files
change), ``remote`` (the remote tier), ``background`` (its uploads after the call returns)
and ``expected`` (what a call knows of its entry).
"""

from __future__ import annotations

from .commit import BuildFunction, Built, ChunkCallback
from .expected import Expected
from .flow import Outcome, obtain, obtain_and_open
from .local_wait import JoinFunction
from .row_build import BuildSettings, RowBuild, RowCall
from .wait import check_lock_timeout

__all__ = ["BuildFunction", "BuildSettings", "Built", "ChunkCallback", "Expected", "JoinFunction",
           "Outcome", "RowBuild", "RowCall", "check_lock_timeout", "obtain", "obtain_and_open"]
