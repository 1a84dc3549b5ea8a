"""The build engine: fill an entry's data file from a per-row function, chunk by chunk, on
threads, processes or a cluster, so that a crashed build resumes and other processes join.

Public surface: :func:`fill` (a builder), :func:`join` (a helper of another process's
build), and what they take and return. Inside, a subpackage per job: ``filling`` (the plan,
the chunk journal, the builder and joiners, resuming dead builds from their verified
chunks), ``running`` (running rows on threads, cachekit's worker processes or any Executor)
and ``decoding`` (the image pipelines). The engine knows nothing of stores: it works in a
directory handle it is given.
"""

from __future__ import annotations

import importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .filling.builder import Filled, Sources, fill
    from .filling.claimed import ChunkCallback, Report, RowFunction, RowRun
    from .filling.cores import Spare, runs_at_once, spare_cores
    from .filling.joiner import Joined, join
    from .filling.journal import is_journal_name

_HOMES = {"ChunkCallback": "filling.claimed", "Filled": "filling.builder",
          "RowFunction": "filling.claimed", "RowRun": "filling.claimed",
          "Report": "filling.claimed", "Sources": "filling.builder", "fill": "filling.builder",
          "Joined": "filling.joiner", "join": "filling.joiner", "Spare": "filling.cores",
          "runs_at_once": "filling.cores", "spare_cores": "filling.cores",
          "is_journal_name": "filling.journal"}
"""Where each public name lives: imported on first use (PEP 562), so that a worker
process, which imports only ``cachekit.engine.running._worker_main``, does not load the engine."""

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> _typing.Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
