"""What a per-row call (``Cache.images``, ``Cache.map``) asks for (:class:`RowCall`) and how
the cache runs its rows (:class:`BuildSettings`): all a hit needs of it. The build itself,
made on a miss only, is :mod:`.row_build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

from .. import keys
from ..store.local import MakeRoom

Template = Optional[tuple[tuple[int, ...], Any]]
"""The row shape and dtype a build makes (None: the first row's)."""


@dataclass(frozen=True)
class BuildSettings:
    """Where and how a build's rows run, as the :class:`cachekit.Cache` was configured."""

    workers: int
    executor: Any
    progress: bool
    """Progress bars."""
    make_room: Optional[MakeRoom] = None
    """With a cache budget, called before a build writes its rows."""


@dataclass(frozen=True)
class RowCall:
    """What a per-row call asked for: the entry's ``kind``, its ``column`` (a pandas
    Series), the ``row_fn`` computing one row, the ``params`` and column ``material`` of
    its key (:func:`cachekit.keys.rows_key`), the row ``template``, ``on_error``, and
    whether the entry must be ``contiguous``."""

    kind: str
    column: Any
    row_fn: Callable[[Any], Any]
    params: dict[str, Any]
    material: dict[str, Any]
    template: Template
    on_error: str
    contiguous: bool = False
    """Store every row in one data file of its own, even rows other entries hold."""

    @cached_property
    def key(self) -> str:
        """The entry's key, digested once (a hit and a build each ask for it)."""
        return keys.rows_key(self.kind, self.params, self.material, len(self.column))
