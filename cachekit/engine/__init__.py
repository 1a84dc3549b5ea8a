"""The build engine: fill an entry's data file from a per-row function, chunk by chunk, on
threads, processes or a cluster, so that a crashed build resumes and other processes join.

Public surface: :func:`fill` (a builder), :func:`join` (a helper of another process's
build), :func:`read_progress` (how far a partly filled file is), and what they take and
return. Inside: ``plan`` (the chunks), ``journal`` (the chunk journal), ``fill``,
``join``, ``resume`` and ``copying`` (who fills and copies what), ``executors``,
``pieces`` and ``compute`` (running rows on threads, processes or a cluster), ``rows`` and
``images`` (the row functions). The engine knows nothing of stores: it works in a
directory handle it is given.
"""

from .fill import ChunkCallback, Filled, RowFunction, fill
from .join import Joined, join
from .journal import is_journal_name
from .resume import Progress, read_progress

__all__ = ["ChunkCallback", "Filled", "Joined", "Progress", "RowFunction", "fill",
           "is_journal_name", "join", "read_progress"]
