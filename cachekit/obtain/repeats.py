"""Rows of a column that repeat earlier rows of it: a column in long format names a file
on several rows (one row per label or box of an image, or a class oversampled by repeating
its rows). The build decodes each such file once (:meth:`.parts.Parts.repeat`); the rows
that repeat it take its pixels, and fail with it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import Failure
from ..messages import say
from . import parts
from .donors import Rows


def first_rows(rows: Rows) -> Optional[np.ndarray]:
    """The first row of each row's identity (and file stat, where taken) in the column,
    or None when no row repeats another: a column that names a file on several rows (one
    row per label or box of an image) has it decoded and stored once."""
    if not (np.diff(rows.needles.sorted) == 0).any():  # (sorted once for the row index)
        return None
    words = rows.ids if rows.stats is None else np.concatenate(
        [rows.ids, np.ascontiguousarray(rows.stats).view("<u8").reshape(len(rows.ids), -1)],
        axis=1)
    words = np.ascontiguousarray(words, dtype="<u8")
    keys = words.view(np.dtype((np.void, words.dtype.itemsize * words.shape[1]))).ravel()
    _, index, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return None if len(index) == len(keys) else index[inverse.ravel()]


def say_repeats(key: str, repeated: int, held: parts.Parts) -> None:
    """Say that ``repeated`` rows repeat earlier rows of the column, and whether each is
    stored once (``held`` keeps them pointed at one row) or, in a contiguous file, in each
    of its rows."""
    how = "stored once" if held.keeps_repeats else "copied into each of its rows"
    say(f"entry {key[:12]}: {repeated} of the rows left to decode repeat earlier rows of "
        f"its column; each is decoded once and {how}")


def with_repeats(failures: list[Failure], repeated: np.ndarray,
                 first: Optional[np.ndarray]) -> list[Failure]:
    """``failures`` with each row that repeats a failed row (``repeated``, of ``first``),
    which fails with it, in row order."""
    if not failures or not len(repeated) or first is None:
        return failures
    failed = {row: (path, why) for row, path, why in failures}
    return sorted(failures + [(int(row), *failed[int(first[row])]) for row in repeated
                              if int(first[row]) in failed])
