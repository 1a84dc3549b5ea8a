"""The row index's file format, and how a lookup searches one file
(:mod:`cachekit.store.row_index` keeps the files).

An index file is one flat ``<u8`` array: a format number, the row count M, the bit count of
a bitmap as its base-2 logarithm, then the entry's row hashes sorted, the entry's row of
each, and a bitmap of the hashes' top bits. An entry that holds no row of its own is
indexed by its row map instead, a (rows, 2) ``<u4`` array, whose hashes the caller reads
from the entry (:func:`search_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

INDEX_FORMAT = 1
_HEAD = 3
_MIN_LOG2_BITS, _MAX_LOG2_BITS = 6, 32
_BITS_PER_ROW = 8
"""Bitmap bits per row: about one hash in nine that is not there passes the bitmap."""


@dataclass(frozen=True)
class Match:
    """Rows of a lookup found in one entry: ``dst`` of the column looked up (ascending) are
    said to be the entry's rows ``src``. A hint: the caller checks them."""

    key: str
    dst: np.ndarray
    src: np.ndarray


class Needles:
    """The hashes looked up, sorted once (sorted needles make the binary searches walk
    nearby paths), with their rows, and their top bits for each bitmap size met."""

    def __init__(self, hashes: np.ndarray) -> None:
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = np.ascontiguousarray(hashes[self.order], dtype="<u8")
        self._tops: dict[int, np.ndarray] = {}

    def top(self, log2_bits: int) -> np.ndarray:
        if log2_bits not in self._tops:
            self._tops[log2_bits] = (self.sorted >> np.uint64(64 - log2_bits)).astype(np.intp)
        return self._tops[log2_bits]


def search_index(key: str, flat: np.ndarray, needles: Needles, live: np.ndarray
                 ) -> Optional[Match]:
    """The rows still ``live`` of ``needles`` that the index file ``flat`` (of the entry
    ``key``, mapped) holds; None when it is not an index of its row count. Its bitmap's
    bits are tested in place and its hashes binary-searched, never read whole."""
    parsed = _parse(flat)
    if parsed is None:
        return None
    sorted_hashes, positions, bitmap, log2_bits = parsed
    tops = needles.top(log2_bits)
    words = np.asarray(bitmap[tops >> 6])  # only the needles' words are read
    passed = ((words >> (tops & 63).astype(np.uint64)) & np.uint64(1)).astype(bool) & live
    return _search(key, sorted_hashes, positions, needles.order[passed],
                   needles.sorted[passed], len(needles.order))


def search_rows(key: str, rows: Optional[tuple[np.ndarray, np.ndarray]],
                needles: Needles, live: np.ndarray) -> Optional[Match]:
    """The rows still ``live`` of ``needles`` held by an entry indexed by its row map,
    whose (hashes, rows) ``rows`` were read from the entry (None: it could not be)."""
    if rows is None:
        return None
    hashes, positions = rows
    order = np.argsort(hashes, kind="stable")
    return _search(key, np.ascontiguousarray(hashes[order], dtype="<u8"), positions[order],
                   needles.order[live], needles.sorted[live], len(needles.order))


def _search(key: str, sorted_hashes: np.ndarray, positions: np.ndarray, dst: np.ndarray,
            wanted: np.ndarray, rows: int) -> Match:
    """The rows ``dst`` of the column (of ``rows`` rows), whose hashes are ``wanted``
    (ascending), found among an entry's ``sorted_hashes``, with the entry's row of each
    (``positions``)."""
    at = np.searchsorted(sorted_hashes, wanted)
    at[at == len(sorted_hashes)] = 0
    hit = sorted_hashes[at] == wanted if len(sorted_hashes) else np.zeros(len(dst), bool)
    dst, src = _ascending(dst[hit], np.asarray(positions[at[hit]], dtype=np.int64), rows)
    return Match(key, dst, src)


def _ascending(dst: np.ndarray, src: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``dst`` (distinct rows of a column of ``rows`` rows) in ascending order, each with
    its ``src``. When they are many, placed by row: linear, where a sort of 130,000 rows
    takes 10 ms."""
    if len(dst) < rows // 16:
        ascending = np.argsort(dst, kind="stable")
        return dst[ascending], src[ascending]
    held = np.zeros(rows, dtype=bool)
    held[dst] = True
    by_row = np.empty(rows, dtype=np.int64)
    by_row[dst] = src
    dst = np.flatnonzero(held)
    return dst, by_row[dst]


def index_array(hashes: np.ndarray, skip: Optional[np.ndarray]) -> np.ndarray:
    """The index file of an entry whose rows' lookup hashes are ``hashes`` (in row order),
    but the rows ``skip`` masks."""
    hashes = np.asarray(hashes, dtype="<u8")
    rows = np.arange(len(hashes), dtype="<u8")
    if skip is not None:
        keep = ~np.asarray(skip, dtype=bool)
        hashes, rows = hashes[keep], rows[keep]
    order = np.argsort(hashes, kind="stable")
    count = len(hashes)
    log2_bits = _log2_bits(count)
    bitmap = np.zeros((1 << log2_bits) // 64, dtype="<u8")
    top = (hashes >> np.uint64(64 - log2_bits)).astype(np.intp)
    np.bitwise_or.at(bitmap, top >> 6, np.uint64(1) << (top & 63).astype(np.uint64))
    head = np.array([INDEX_FORMAT, count, log2_bits], dtype="<u8")
    return np.concatenate([head, hashes[order], rows[order], bitmap])


def _log2_bits(count: int) -> int:
    """The bitmap size (log2 of its bits) of an index of ``count`` rows: the only one a
    reader accepts, so a file's bitmap is never larger than its rows call for."""
    return min(_MAX_LOG2_BITS, max(_MIN_LOG2_BITS,
                                   math.ceil(math.log2(max(1, _BITS_PER_ROW * count)))))


def _parse(flat: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """(sorted hashes, rows, bitmap words, log2 of the bitmap's bits) of an index file's
    array, or None when it is not one of this format."""
    if flat.ndim != 1 or flat.dtype != np.dtype("<u8") or len(flat) < _HEAD:
        return None
    version, count, log2_bits = (int(v) for v in flat[:_HEAD])
    if version != INDEX_FORMAT or log2_bits != _log2_bits(count):
        return None
    words = (1 << log2_bits) // 64
    if len(flat) != _HEAD + 2 * count + words:
        return None
    hashes = flat[_HEAD:_HEAD + count]
    return hashes, flat[_HEAD + count:_HEAD + 2 * count], flat[_HEAD + 2 * count:], log2_bits


def is_row_map(flat: np.ndarray) -> bool:
    """Whether an index file is an entry's row map (``RowIndex.link``)."""
    return flat.ndim == 2 and flat.shape[1] == 2 and flat.dtype == np.dtype("<u4")
