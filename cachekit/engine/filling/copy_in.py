"""Copying in the rows a build need not compute: from dead builds of it and from committed
entries of its recipe, each checked, into its new data file.

The rows that no source gave are then computed as the build's rest (see
:mod:`.plan`), by the builder and its joiners (:func:`.builder.fill`). Dead builds go
first: their rows were computed for this very build. Committed entries of the same recipe
follow. Nothing here is journalled: a build that dies after it copies the rows copies them
again when it is resumed, which costs a read, not a decode.

A :class:`Donor` is another entry's data file, opened once and checked by the caller (its
header, its size, the digests of its blocks), with the rows of it that the new entry wants.
Each block of the donor that holds a wanted row is read once into memory, and its rows are
used only if the block's bytes match its digest: a donor that is truncated, rewritten or
removed while it is read gives no row at all, and those rows are computed instead. The
bytes are checked and written from the one copy in memory, so no change of the file after
the check can reach the new entry.

A donor's blocks are read only when their size is in proportion to the rows they serve
(:func:`read_allowed`): a planted donor whose whole data file is one block costs no more
than a decode of the rows it offered.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from ...errors import Failure
from . import plan as plans
from .resume import copy_dead_rows, dead_template

READ_FLOOR_BYTES = 2 << 20
"""A block of at most this many bytes may always be read: twice the blocks cachekit
writes (1 MiB of rows), so a build that wants one row of a block reads it."""
READ_FACTOR = 4
"""A larger block is read only when it is at most this many times the bytes of the rows
it serves."""
MAX_BLOCK_BYTES = 64 << 20
"""No block larger than this is ever read, whatever it serves."""


def read_allowed(block_bytes: int, served_bytes: int) -> bool:
    """Whether a donor block of ``block_bytes`` may be read for rows of ``served_bytes``."""
    return block_bytes <= MAX_BLOCK_BYTES and (
        block_bytes <= READ_FLOOR_BYTES or block_bytes <= READ_FACTOR * served_bytes)


@dataclass(frozen=True)
class Donor:
    """Rows ``src`` of another entry (``name``, for reports) to copy into rows ``dst`` of the
    new one. ``file``: its data file, open, ``rows`` rows of ``row_shape`` and ``dtype``
    from byte ``offset``; ``blocks``: the (B, 16) digests of its blocks of ``block_rows``
    rows (:func:`cachekit.arrays.block_checksums`)."""

    name: str
    file: BinaryIO
    offset: int
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    block_rows: int
    blocks: np.ndarray
    src: np.ndarray
    dst: np.ndarray

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Copied:
    """What the donors gave: rows copied and rows refused (their block failed its check),
    by donor name, in the donors' order."""

    rows: dict[str, int]
    refused: dict[str, int]


def copy_from_donors(donors: Sequence[Donor], out: np.ndarray, covered: np.ndarray) -> Copied:
    """Copy each donor's rows into ``out`` where ``covered`` is still False, setting it
    True for every row copied; rows whose donor block fails its check stay False."""
    rows: dict[str, int] = {}
    refused: dict[str, int] = {}
    for donor in donors:
        if tuple(out.shape[1:]) != tuple(donor.row_shape) or out.dtype != donor.dtype:
            refused[donor.name] = refused.get(donor.name, 0) + len(donor.dst)
            continue
        wanted = ~covered[donor.dst]
        got, bad = _copy(donor, out, donor.src[wanted], donor.dst[wanted])
        covered[got] = True
        rows[donor.name] = rows.get(donor.name, 0) + len(got)
        if bad:
            refused[donor.name] = refused.get(donor.name, 0) + bad
    return Copied(rows, refused)


def _copy(donor: Donor, out: np.ndarray, src: np.ndarray, dst: np.ndarray
          ) -> tuple[np.ndarray, int]:
    """(the rows of ``out`` filled, the count refused) from the donor's rows ``src``."""
    if not len(src):
        return np.zeros(0, dtype=np.int64), 0
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    if src[0] < 0 or src[-1] >= donor.rows:
        return np.zeros(0, dtype=np.int64), len(src)
    block_of = src // donor.block_rows
    starts = np.flatnonzero(np.r_[True, block_of[1:] != block_of[:-1]])
    ends = np.r_[starts[1:], len(src)]
    row_bytes = donor.row_bytes
    filled, refused = [], 0
    for start, end in zip(starts, ends):
        block = int(block_of[start])
        first = block * donor.block_rows
        last = min(donor.rows, first + donor.block_rows)
        size = (last - first) * row_bytes
        if not read_allowed(size, (end - start) * row_bytes):
            refused += end - start  # decoded instead
            continue
        try:
            data = os.pread(donor.file.fileno(), size, donor.offset + first * row_bytes)
        except OSError:
            data = b""
        if len(data) != size or block >= len(donor.blocks) or \
                arrays.block_digest(data) != donor.blocks[block].tobytes():
            refused += end - start
            continue
        rows = np.frombuffer(data, dtype=donor.dtype).reshape((last - first, *donor.row_shape))
        out[dst[start:end]] = rows[src[start:end] - first]
        filled.append(dst[start:end])
    got = np.concatenate(filled) if filled else np.zeros(0, dtype=np.int64)
    return got, refused


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


@dataclass(frozen=True)
class Sources:
    """What a fill may copy instead of computing: ``dead``, build directories of dead
    builds of this user that the caller claimed (the coordinator checks their owner and
    cachekit version), and ``donors``, rows of committed entries. ``done()`` is called once
    nothing more is read from the dead builds (the caller may then delete them)."""

    dead: Sequence[_fs.DirHandle] = ()
    donors: Sequence["Donor"] = ()
    done: Optional[Callable[[], None]] = None

    def release(self) -> None:
        if self.done is not None:
            self.done()


NO_SOURCES = Sources()


def prefill(directory: _fs.DirHandle, name: str, n: int,
            template: tuple[tuple[int, ...], np.dtype], key: str,
            sources: Sources) -> Prefilled:
    """Create the data file ``name`` of ``n`` rows in ``directory`` and copy in the checked
    rows of the dead builds of ``key`` among ``sources``, then those of its donors."""
    row_shape, dtype = template
    array = arrays.create_array(directory, name, (n, *row_shape), dtype, align=plans.PAGE_BYTES)
    covered = np.zeros(n, dtype=bool)
    failures, resumed = copy_dead_rows(sources.dead, name, n, template, key, array, covered)
    copied = copy_from_donors(sources.donors, array, covered)
    return Prefilled(array, covered, failures, resumed, copied)


SCATTER_ROWS = 4096
"""Rows put into place per step once the rest is computed (memory stays flat)."""


def scatter(out: np.ndarray, rest: np.ndarray, todo: np.ndarray) -> None:
    """Put row ``i`` of ``rest`` into row ``todo[i]`` of ``out``."""
    for start in range(0, len(todo), SCATTER_ROWS):
        stop = min(len(todo), start + SCATTER_ROWS)
        out[todo[start:stop]] = rest[start:stop]
