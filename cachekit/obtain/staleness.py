"""The check a hit of an images entry keyed by its paths alone makes: did its files change?

With ``validate="path"`` (the default) the key is made from the paths, so a file rewritten
under the same name is a hit and serves the pixels decoded before. An entry records each
file's (size, mtime_ns) when it was built (``row_stats.npy``); a hit compares a few rows,
picked at random, against the files now (:data:`SAMPLE_ROWS` stats, however many rows the
entry has), and warns once per process and entry when
one differs, naming it and ``validate="stat"``. A sample finds a column that changed in
bulk (a data set regenerated, a folder copied over), not one file among many: that is what
``validate="stat"`` is for, where a changed file is decoded again and costs one decode.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .. import arrays, urls
from ..errors import CacheCorruptError, StaleEntryWarning
from ..messages import prefix
from ..store.manifest import ROW_STATS_FILE, Manifest

SAMPLE_ROWS = 16
_warned: set[str] = set()


def check(entry_path: Path, manifest: Manifest, paths: Any) -> None:
    """Warn (:class:`StaleEntryWarning`, once per process and entry) when a sampled file of
    the column ``paths`` differs in size or mtime from when ``manifest``'s entry was built."""
    record = manifest.row_file(ROW_STATS_FILE)
    if record is None or manifest.key in _warned or not manifest.rows:
        return
    try:
        recorded = arrays.open_record(entry_path, record)
    except (OSError, CacheCorruptError):
        return  # a hit does not stop for an advisory record
    if recorded.shape != (manifest.rows, 2):
        return
    rows = np.random.default_rng().integers(0, manifest.rows, size=SAMPLE_ROWS)
    changed = _first_changed(np.unique(rows), recorded, paths)
    if changed is None:
        return
    row, path, then, now = changed
    _warned.add(manifest.key)
    warnings.warn(StaleEntryWarning(
        f"{prefix()}: the file of row {row} ({path}) changed since entry {manifest.key[:12]} "
        f"was built ({_describe(then)} then, {_describe(now)} now); this hit serves the "
        "pixels decoded then, because validate=\"path\" keys the paths only. Pass "
        "validate=\"stat\" to key each file's size and mtime as well: then only the files "
        "that changed are decoded again, the other rows are copied from this entry"),
        stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` of a warning issued by this module's caller that names the first
    frame outside cachekit: the user's call, however deep the library's path to here."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] \
            == "cachekit":
        frame, level = frame.f_back, level + 1
    return level


def _first_changed(rows: np.ndarray, recorded: np.ndarray, paths: Any
                   ) -> Optional[tuple[int, str, tuple[int, int], tuple[int, int]]]:
    values = paths.iloc[rows].to_numpy(dtype=object)
    for row, path in zip(rows, values):
        if urls.is_remote(path):
            continue  # not sampled: a hit makes no request (docs/object-stores.md)
        try:
            st = os.stat(urls.local_path(path))
            now = (st.st_size, st.st_mtime_ns)
        except (OSError, TypeError, ValueError):
            now = (-1, -1)
        then = (int(recorded[row, 0]), int(recorded[row, 1]))
        if now != then:
            return int(row), str(path), then, now
    return None


def _describe(stat: tuple[int, int]) -> str:
    if stat == (-1, -1):
        return "missing"
    when = datetime.datetime.fromtimestamp(stat[1] / 1e9, datetime.timezone.utc)
    return f"{stat[0]} bytes, modified {when.isoformat(sep=' ', timespec='milliseconds')}"
