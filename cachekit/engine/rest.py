"""The rest of a build whose other rows were copied: the rows still to compute, as a fill of
their own.

When a build copies some of its rows from committed entries (:mod:`.reuse`) or from dead
builds (:mod:`.resume`), the rows left are computed as a fill of just those rows, in a data
file ``NAME.rest`` next to the build's ``NAME`` with a chunk journal of its own. Its plan is
made only after the copies, and the journal names the rows it computes (``todo.npy``,
written before the plan), so joiners fill only rows that nobody copies. The builder then
puts each computed row into its place in ``NAME``. The rest's key is made from the build's
key and its rows, so a joiner or a resumer checks that the plan is the one of those rows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .. import _fs, arrays
from ..errors import CacheCorruptError

REST_SUFFIX = ".rest"
TODO_FILE = "todo.npy"


def rest_name(name: str) -> str:
    """The data file of the rest of the fill of ``name``."""
    return name + REST_SUFFIX


def is_rest_name(name: str) -> bool:
    return name.endswith(REST_SUFFIX)


def write_todo(journal_dir: _fs.DirHandle, todo: np.ndarray) -> None:
    arrays.write_small(journal_dir, TODO_FILE, np.ascontiguousarray(todo, dtype="<i8"))


def read_todo(journal_dir: _fs.DirHandle, rows: int) -> Optional[np.ndarray]:
    """The rows a rest computes, or None when its record is missing or not rows of a build
    of ``rows`` rows (ascending, each once)."""
    try:
        todo = np.array(arrays.open_readonly(journal_dir, TODO_FILE))
    except (OSError, CacheCorruptError):
        return None
    if todo.ndim != 1 or todo.dtype != np.dtype("<i8"):
        return None
    if len(todo) and (todo[0] < 0 or todo[-1] >= rows or (np.diff(todo) <= 0).any()):
        return None
    return todo


def take(values: Sequence[Any], todo: np.ndarray) -> Sequence[Any]:
    """The values of rows ``todo``."""
    if isinstance(values, np.ndarray):
        return values[todo]
    return [values[int(i)] for i in todo]
