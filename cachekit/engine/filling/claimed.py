"""What the builder and its joiners both run: claiming free chunks of a build's plan and
computing them (:func:`run_claimed`), into the builder's data file or a joiner's own rows
file (:class:`RowsFile`)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from ...errors import Failure
from .journal import ROWS_PREFIX, Claim, Journal, digest
from .plan import Chunk, Plan

RowFunction = Callable[[Any], Any]
ChunkCallback = Callable[[int, int], None]
"""Called with (rows done, rows in all) each time another chunk is written and flushed."""


@dataclass(frozen=True)
class RowSpec:
    """How a fill's rows run and what they make: ``workers`` rows at once on ``executor``
    (None: cachekit's rule); ``record`` makes a row whose function raises (anything but
    NotAnArrayError) a failure whose row stays zeros, where False re-raises it unchanged;
    ``template`` gives the per-row shape and dtype, else the first row that succeeds fixes
    them (rows before it are failures) and a later row of another shape or dtype raises
    ValueError naming both; ``key`` names the build in its plan, so that resumers and
    joiners check they fill the same build."""

    workers: int
    record: bool
    template: Optional[tuple[tuple[int, ...], Any]] = None
    key: str = ""
    executor: Any = None


@dataclass(frozen=True)
class Report:
    """What a fill tells as it goes: ``on_chunk(done, total)`` each time another chunk is
    written and flushed, with the rows done by every process, and a progress bar
    (``progress``) or, where there is no terminal for one, progress lines (``lines``)."""

    on_chunk: Optional[ChunkCallback] = None
    progress: bool = False
    description: str = "cachekit build"
    lines: bool = False


QUIET = Report()


class RowsFile:
    """A joiner's own rows file: a sparse .npy of the plan's layout in the journal folder,
    whose blocks are reserved chunk by chunk as the joiner claims them (a full disk then
    fails the claim with ENOSPC, never a page write with SIGBUS)."""

    def __init__(self, name: str, fd: int, array: np.ndarray) -> None:
        self.name, self.fd, self.array = name, fd, array

    @classmethod
    def create(cls, journal: Journal, planned: Plan) -> "RowsFile":
        if arrays.data_offset(planned.shape, planned.dtype, align=planned.page) \
                != planned.offset:
            raise ValueError("a plan whose layout this host does not make")
        name = f"{ROWS_PREFIX}{_fs.unique_suffix()}"
        array = arrays.create_array(journal.dir, name, planned.shape, planned.dtype,
                                    align=planned.page, reserve=False)
        try:
            with journal.dir.open_file(name, writable=True) as f:
                fd = os.dup(f.fileno())
        except BaseException:
            del array
            journal.dir.unlink(name)
            raise
        return cls(name, fd, array)

    def reserve(self, first: int, end: int) -> None:
        _fs.preallocate_fd(self.fd, first, end - first)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def run_claimed(journal: Journal, array: np.ndarray, values: Sequence[Any],
                runner: Callable[[], Any], head: Any = None,
                rows_file: Optional[RowsFile] = None) -> Iterator[Chunk]:
    """Claim free chunks as the runner asks for them, compute them into ``array``, flush
    each and record it done with its checksum; yield each chunk this process finished.
    Claims not finished are released. ``runner()`` gives the chunk runner, asked for only
    once a chunk is claimed. ``rows_file``: a joiner's, which ``array`` maps."""
    planned = journal.plan
    claims: dict[int, tuple[Claim, list[Failure]]] = {}

    def chunks() -> Iterator[Chunk]:
        if head is not None:
            claim, rest, failures = head
            claims[claim.chunk.index] = (claim, failures)
            yield rest
        for claim in journal.claimable(planned.chunks):
            claims[claim.chunk.index] = (claim, [])
            if rows_file is not None:
                rows_file.reserve(*planned.byte_range(claim.chunk))
            yield claim.chunk

    source = chunks()
    file = None if rows_file is None else rows_file.name
    try:
        first = next(source, None)
        if first is None:
            return
        for chunk, failures in runner().run(itertools.chain([first], source), values, array):
            claim, earlier = claims.pop(chunk.index)
            done = claim.chunk
            arrays.flush_bytes(array, *planned.byte_range(done))
            if claim.finish(earlier + failures, digest(array[done.start:done.stop]), file):
                yield done
    finally:
        for claim, _ in claims.values():
            claim.release()
