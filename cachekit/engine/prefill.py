"""The first step of a build that copies rows: make its data file, and copy in every row
that dead builds of it or committed entries already hold, checked.

The rows that no source gave are then computed as the build's rest (:mod:`.rest`), by the
builder and its joiners (:func:`cachekit.engine.builder.fill`). Dead builds go first: their
rows were computed for this very build. Committed entries of the same recipe follow
(:mod:`.reuse`). Nothing here is journalled: a build that dies after it copies the rows
copies them again when it is resumed, which costs a read, not a decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from .. import _fs, arrays
from ..errors import Failure
from . import plan as plans
from .resume import copy_dead_rows, dead_template
from .reuse import Copied, Donor, copy_from_donors


@dataclass
class Prefilled:
    """The new data file, mapped writable, and what the copies put in it: ``covered`` marks
    the rows copied; ``failures`` are the failed rows the dead builds recorded."""

    array: np.ndarray
    covered: np.ndarray
    failures: list[Failure] = field(default_factory=list)
    resumed: int = 0
    """Rows copied from dead builds."""
    copied: Copied = field(default_factory=lambda: Copied({}, {}))
    """Rows copied from committed entries, by entry."""


def template_for(template: Any, donors: Sequence[Donor], sources: Sequence[_fs.DirHandle],
                 name: str, n: int, key: str) -> Optional[tuple[tuple[int, ...], np.dtype]]:
    """The row shape and dtype of the build: the caller's, else the donors' (which the
    caller made agree), else a dead build's; None when nothing says."""
    if template is not None:
        return tuple(template[0]), np.dtype(template[1])
    if donors:
        return tuple(donors[0].row_shape), np.dtype(donors[0].dtype)
    return dead_template(sources, name, n, key)


def prefill(directory: _fs.DirHandle, name: str, n: int,
            template: tuple[tuple[int, ...], np.dtype], key: str,
            sources: Sequence[_fs.DirHandle], donors: Sequence[Donor]) -> Prefilled:
    """Create the data file ``name`` of ``n`` rows in ``directory`` and copy in the checked
    rows of the dead builds ``sources`` of ``key``, then those of ``donors``."""
    row_shape, dtype = template
    array = arrays.create_array(directory, name, (n, *row_shape), dtype, align=plans.PAGE_BYTES)
    covered = np.zeros(n, dtype=bool)
    failures, resumed = copy_dead_rows(sources, name, n, template, key, array, covered)
    copied = copy_from_donors(donors, array, covered)
    return Prefilled(array, covered, failures, resumed, copied)


SCATTER_ROWS = 4096
"""Rows put into place per step once the rest is computed (memory stays flat)."""


def scatter(out: np.ndarray, rest: np.ndarray, todo: np.ndarray) -> None:
    """Put row ``i`` of ``rest`` into row ``todo[i]`` of ``out``."""
    for start in range(0, len(todo), SCATTER_ROWS):
        stop = min(len(todo), start + SCATTER_ROWS)
        out[todo[start:stop]] = rest[start:stop]
