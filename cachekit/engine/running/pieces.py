"""Running chunks as pieces on an Executor: cachekit's threads or processes, or the user's.

Work travels as pieces: runs of consecutive rows, each a share of the rows not handed out
yet (guided self-scheduling: large pieces first, small ones at the tail, :class:`Sizes`),
cut within a chunk for threads and across chunks for other processes (:class:`Cutter`). At
most a few pieces per worker are in flight, so memory stays bounded whatever the number of
rows. A chunk is complete, and yielded, once every piece that holds rows of it came back.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from ...errors import Failure
from .compute import (ChunkLike, ChunkRunner, RowTask, compute_in_place, compute_piece,
    plain, row_inputs)

THREAD_PIECE_ROWS = 32
"""Largest piece for a thread, and for the builder's own share: small enough to balance the
tail of a build, and for the builder to look after the other workers often; large enough
that a future's hand-off (tens of microseconds) is lost in the rows' decoding."""
OWN_PIECE_SECONDS = 0.05
"""How long the builder's own share of rows runs before it looks after the other workers
again (lands their rows, hands out pieces, lets finished chunks be recorded)."""
REMOTE_PIECE_ROWS = 256
"""Largest piece sent to one of cachekit's worker processes (pickling and transfer: about a
millisecond)."""
CLUSTER_PIECE_ROWS = 1024
"""Largest piece sent to a user's Executor, such as a Dask cluster, where a task costs
several milliseconds of scheduler and client time: small pieces cost the builder several
times the CPU per image (docs/build-engine.md)."""
REMOTE_PIECE_BYTES = 8 << 20
"""...and for both, its rows, pickled back, at most this many bytes (large rows, many
workers: the pieces in flight stay a few hundred MB at most)."""
PIECES_PER_WORKER = 2
"""Pieces in flight per worker: one running and one queued, so no worker waits for the
builder between pieces."""
FETCH_AHEAD_PIECES = 4
"""More pieces in flight on threads when the rows fetch their sources from a store (URL
rows, cachekit.engine.decoding.fetch): a piece's objects are requested when it is handed
out, so these are fetched ahead while the running pieces decode."""


@dataclass
class ChunkState:
    """A chunk being computed: complete once all its rows are handed out and came back."""

    chunk: ChunkLike
    outstanding: int = 0  # segments handed out and not back yet
    cut: bool = False  # every row handed out
    failures: list[Failure] = field(default_factory=list)


@dataclass(frozen=True)
class Segment:
    state: ChunkState
    start: int
    stop: int


class Cutter:
    """Cuts the stream of chunks into pieces of a requested number of rows. A piece is a
    list of segments: the rest of one chunk, whole chunks, the start of another, so a piece
    can be larger than a chunk (a cluster task must be long against its overhead) or a small
    part of one (the tail of a build stays balanced)."""

    def __init__(self, chunks: Iterable[ChunkLike], rows: Optional[int]) -> None:
        self.chunks = iter(chunks)
        self.current: Optional[ChunkState] = None
        self.position = 0
        self.left = rows  # rows not handed out yet, as far as the caller's hint knows
        self.empty: list[ChunkState] = []  # chunks of no rows: complete at once

    def take(self, rows: int, span: bool = True) -> list[Segment]:
        """Up to ``rows`` rows, from as many chunks as it takes (``span``) or from one."""
        segments: list[Segment] = []
        while rows > 0 and (span or not segments):
            if self.current is None:
                chunk = next(self.chunks, None)
                if chunk is None:
                    break
                state = ChunkState(chunk)
                if chunk.stop <= chunk.start:
                    state.cut = True
                    self.empty.append(state)
                    continue
                self.current, self.position = state, chunk.start
            state = self.current
            stop = min(state.chunk.stop, self.position + rows)
            segments.append(Segment(state, self.position, stop))
            state.outstanding += 1
            rows -= stop - self.position
            if self.left is not None:
                self.left = max(0, self.left - (stop - self.position))
            self.position = stop
            if stop == state.chunk.stop:
                state.cut, self.current = True, None
        return segments


@dataclass(frozen=True)
class Sizes:
    """How many rows a piece holds: a share of the rows left (guided self-scheduling: large
    pieces first, small ones at the tail, so every worker finishes at nearly the same time),
    between ``smallest`` and ``largest``."""

    smallest: int
    largest: int
    span: bool  # whether a piece may hold rows of several chunks

    def piece(self, left: Optional[int], parallelism: int, row_bytes: int,
              in_place: bool) -> int:
        largest = self.largest
        if not in_place:
            largest = min(largest, max(1, REMOTE_PIECE_BYTES // max(1, row_bytes)))
        if left is None:
            return max(1, min(self.smallest, largest))
        share = math.ceil(left / (2 * parallelism))
        return max(1, min(largest, max(self.smallest, share)))


# Threads hand off pieces for tens of microseconds: no piece of theirs spans chunks, so a
# chunk is complete as soon as its own rows are.
THREAD_SIZES = Sizes(smallest=4, largest=THREAD_PIECE_ROWS, span=False)
PROCESS_SIZES = Sizes(smallest=8, largest=REMOTE_PIECE_ROWS, span=True)
CLUSTER_SIZES = Sizes(smallest=32, largest=CLUSTER_PIECE_ROWS, span=True)


class PieceRunner(ChunkRunner):
    """Chunks cut into pieces, submitted to an Executor, collected as they complete.

    With ``caller_runs`` (cachekit's processes) the builder's own thread is one of the
    workers: between looking after the pool's pieces it computes short pieces itself,
    straight into ``out``. So ``workers=N`` starts only N - 1 processes, and their start-up
    (a few tenths of a second each) runs while the builder already computes.
    """

    def __init__(self, executor: Executor, helpers: int, sizes: Sizes, task: RowTask, *,
                 owned: bool, in_place: bool, caller_runs: bool = False,
                 rows: Optional[int] = None) -> None:
        self.executor = executor
        self.helpers = max(1, helpers)
        self.parallelism = self.helpers + (1 if caller_runs else 0)
        self.sizes = sizes
        self.task = task
        self.owned = owned
        self.in_place = in_place  # threads write into ``out``; others return their rows
        self.caller_runs = caller_runs
        self.rows = rows

    def close(self) -> None:
        if self.owned:
            self.executor.shutdown(wait=True, cancel_futures=True)

    def _submit(self, values: Sequence[Any], out: np.ndarray, piece: list[Segment]) -> Future:
        ranges = [(s.start, s.stop) for s in piece]
        if self.in_place:
            # This process runs the piece: its inputs (for URL rows, the objects' fetch) are
            # made now, so that they arrive while the pieces before it decode.
            inputs = [row_inputs(self.task, values[a:b]) for a, b in ranges]
            future = self.executor.submit(compute_in_place, self.task, values, out, ranges,
                                          inputs)
            future.add_done_callback(lambda _: _close_all(inputs))  # cancelled: given up
            return future
        rows = [v for s in piece for v in values[s.start:s.stop]]
        return self.executor.submit(compute_piece, self.task, rows, ranges, out.shape[1:],
                                    out.dtype.str)

    def run(self, chunks: Iterable[ChunkLike], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
        out = plain(out)
        row_bytes = out[:1].nbytes
        cutter = Cutter(chunks, self.rows)
        pending: dict[Future, list[Segment]] = {}
        limit = PIECES_PER_WORKER * self.helpers
        if self.in_place and getattr(self.task.row_fn, "fetches", False):
            limit += FETCH_AHEAD_PIECES  # their objects arrive while the others decode
        error: Optional[BaseException] = None
        more = True
        own_rows = 1  # the builder's own share: sized by its rows' time once it has one

        def size() -> int:
            return self.sizes.piece(cutter.left, self.parallelism, row_bytes, self.in_place)

        try:
            while True:
                while more and error is None and len(pending) < limit:
                    piece = cutter.take(size(), self.sizes.span)
                    if piece:
                        pending[self._submit(values, out, piece)] = piece
                    else:
                        more = False
                while cutter.empty:
                    yield cutter.empty.pop().chunk, []
                own: list[Segment] = []
                if self.caller_runs and more and error is None:
                    own = cutter.take(min(size(), own_rows), self.sizes.span)
                    if not own:
                        more = False
                        continue
                if own:
                    began = time.perf_counter()
                    try:
                        failures = compute_in_place(self.task, values, out,
                                                    [(s.start, s.stop) for s in own])
                    except BaseException as exc:  # noqa: B036 - re-raised below, unchanged
                        error, more = exc, False
                        _cancel_queued(pending)
                    else:
                        yield from _finish(own, failures)
                        own_rows = _own_rows(time.perf_counter() - began,
                                             sum(s.stop - s.start for s in own))
                    done = {f for f in pending if f.done()}
                elif pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                else:
                    break
                # A piece the executor cancelled (a broken pool) fails with CancelledError;
                # the real error of the others comes first.
                for future in sorted(done, key=lambda f: (f.cancelled(), pending[f][0].start)):
                    if future not in pending:  # cancelled by us after an earlier error
                        continue
                    piece = pending.pop(future)
                    try:
                        failures = self._land(future, out, piece)
                    except BaseException as exc:  # noqa: B036 - re-raised below, unchanged
                        if error is None:
                            error, more = exc, False
                            _cancel_queued(pending)
                        continue
                    yield from _finish(piece, failures)
            if error is not None:
                raise error
        finally:
            _cancel_queued(pending)
            if self.in_place and pending:
                # Threads write into ``out``: none may still run once the caller moves on.
                wait(pending)

    def _land(self, future: Future, out: np.ndarray, piece: list[Segment]) -> list[Failure]:
        if self.in_place:
            return future.result()
        rows, failures = future.result()
        count = sum(s.stop - s.start for s in piece)
        if rows.shape != (count, *out.shape[1:]) or rows.dtype != out.dtype:
            raise ValueError(f"{count} rows from {piece[0].start} came back as shape "
                             f"{rows.shape} dtype {rows.dtype}, expected rows of "
                             f"{out.shape[1:]} {out.dtype}")
        at = 0
        for s in piece:
            out[s.start:s.stop] = rows[at:at + s.stop - s.start]
            at += s.stop - s.start
        return failures


def _own_rows(seconds: float, rows: int) -> int:
    """Rows of the builder's next own piece: about OWN_PIECE_SECONDS of work. Chunks the
    other workers complete are recorded done only between the builder's pieces, so a piece
    of slow rows must stay short."""
    if seconds <= 0:
        return THREAD_PIECE_ROWS
    return max(1, min(THREAD_PIECE_ROWS, int(rows * OWN_PIECE_SECONDS / seconds)))


def _finish(piece: list[Segment], failures: list[Failure]
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
    """Give each segment of a landed piece its failures; yield the chunks now complete."""
    for segment in piece:
        state = segment.state
        state.failures += [f for f in failures if segment.start <= f[0] < segment.stop]
        state.outstanding -= 1
        if state.cut and state.outstanding == 0:
            yield state.chunk, sorted(state.failures)


def _close_all(inputs: list[Any]) -> None:
    """Give up the fetched bytes of a piece's inputs that were not decoded (a piece
    cancelled before it ran; after it ran there is nothing left)."""
    for item in inputs:
        close = getattr(item, "close", None)
        if close is not None:
            close()


def _cancel_queued(pending: dict[Future, Any]) -> None:
    """Cancel the pieces not started yet and forget them (an executor need not tell wait()
    about a cancelled future); the running ones stay in ``pending``."""
    for future in list(pending):
        if future.cancel():
            del pending[future]
