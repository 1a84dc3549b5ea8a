"""The build engine: fill an entry's data file from a per-row function, chunk by chunk, on
threads, processes or a cluster, so that a crashed build resumes and other processes join.

Public surface: :func:`fill` (a builder), :func:`join` (a helper of another process's
build), :func:`read_progress` (how far a partly filled file is), and what they take and
return. Inside: ``plan`` (the chunks), ``journal`` (the chunk journal), ``builder``,
``joiner``, ``resume`` and ``copying`` (who fills and copies what), ``cores`` (the cores a
joiner brings), ``reuse``, ``prefill`` and ``rest`` (copying rows of committed entries, then
computing only the rest), ``executors``, ``pieces`` and ``compute`` (running rows on threads,
processes or a cluster), ``rows`` and ``images`` (the row functions). The engine knows
nothing of stores: it works in a directory handle it is given.
"""

from __future__ import annotations

import importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .builder import ChunkCallback, Filled, RowFunction, fill
    from .cores import Spare, runs_at_once, spare_cores
    from .joiner import Joined, join
    from .journal import is_journal_name
    from .resume import Progress, read_progress

_HOMES = {"ChunkCallback": "builder", "Filled": "builder", "RowFunction": "builder",
          "fill": "builder", "Joined": "joiner", "join": "joiner", "Spare": "cores",
          "runs_at_once": "cores", "spare_cores": "cores",
          "is_journal_name": "journal", "Progress": "resume", "read_progress": "resume"}
"""Where each public name lives: imported on first use (PEP 562), so that a worker
process, which imports only ``cachekit.engine._worker_main``, does not load the engine."""

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> _typing.Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
