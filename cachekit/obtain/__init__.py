"""Getting an entry: look it up, wait for or join another process's build, or build it.

The coordinator between the public face (:class:`cachekit.Cache`, memoize) and the engine
and the store. The face hands :func:`obtain` a request (``build``: the key and what its
entry must look like; on a miss only, the :class:`Build` that makes it) and gets back an
:class:`Outcome`: the published entry, checked, and how this call came by it; the face then
opens it. Modules, in the order a call meets them: ``build`` (the seam: request and build),
``flow`` (obtain), ``outcome`` (what it was asked and returns), ``lookup`` (a hit: the store
reads, the call records the use), ``miss`` (a miss, imported only then: wait, then build),
``built`` (what a build made, for the manifest),
``local_wait`` (the build lock, live builders, joining), ``wait`` (the one wait loop,
bounded by ``lock_timeout``), ``remote`` (the remote tier: download or lease, then share),
``commit`` (building in a private directory and the atomic commit), ``accounting`` (the
seconds a call spent on its own work, not waiting), ``background`` (uploads after the call
returns), ``expected`` (what a call knows of its entry). The per-row calls:
``row_call`` (what they ask for), ``row_request`` (their request, and settling an entry
before it is opened), ``row_build`` (their build, imported on a miss only), ``donors`` (the
committed entries that hold a build's rows), ``parts`` (linking their files in, the row
map) and ``staleness`` (did a hit's files change).
"""

from __future__ import annotations

from .build import Build, Request
from .expected import Expected
from .flow import obtain
from .outcome import Outcome
from .row_call import BuildSettings, RowCall
from .row_request import RowRequest

__all__ = ["Build", "BuildSettings", "Expected", "Outcome", "Request", "RowCall",
           "RowRequest", "obtain"]
