"""A minimal threads-only chunk runner with the signature of ``cachekit.executors``.

The build engine (:mod:`cachekit.build`) computes chunks through :func:`make_runner`; this
module stands in for the executors module until it is merged, and only knows threads. Each
chunk is one task on a thread pool that writes its rows into the caller's memmap in place
(Pillow releases the GIL while it decodes and resizes). At most ``workers`` chunks are in
flight, and the chunk iterable is pulled lazily, one chunk each time a worker is free, so
the caller may hand out chunks as it claims them (and leave the rest to other processes).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .arrays import as_row
from .errors import Failure, NotAnArrayError, failure_reason
from .plan import Chunk


@dataclass(frozen=True)
class RowTask:
    """Everything a worker needs to compute rows."""

    row_fn: Callable[[Any], Any]
    record_failures: bool
    """True: an exception (other than NotAnArrayError) makes the row a failure (zeros);
    False: it propagates unchanged."""


def make_runner(executor: Any, workers: int, task: RowTask) -> "ChunkRunner":
    """A runner of ``workers`` threads; ``executor`` must be None or "threads" here."""
    if executor not in (None, "threads"):
        raise ValueError(f"this build of cachekit runs chunks on threads only, not {executor!r}")
    return ChunkRunner(max(1, workers), task)


class ChunkRunner:
    """Runs chunks of rows on a thread pool."""

    def __init__(self, workers: int, task: RowTask) -> None:
        self.workers = workers
        self.task = task
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachekit")

    def run(self, chunks: Iterable[Chunk], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[Chunk, list[Failure]]]:
        """Compute each chunk's rows into ``out[chunk.start:chunk.stop]``; yield each chunk
        with its failures once all its rows are in ``out``, in completion order. A row of
        the wrong shape or dtype raises ValueError naming the row; an exception that is not
        recorded propagates once the chunks in flight have stopped."""
        pending = iter(chunks)
        in_flight: deque[tuple[Chunk, Future]] = deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < self.workers:
                    chunk = next(pending, None)
                    if chunk is None:
                        exhausted = True
                        break
                    in_flight.append((chunk, self._pool.submit(self._compute, chunk, values,
                                                               out)))
                if not in_flight:
                    return
                wait([f for _, f in in_flight], return_when=FIRST_COMPLETED)
                for item in [item for item in in_flight if item[1].done()]:
                    in_flight.remove(item)
                    yield item[0], item[1].result()
        finally:
            for _, future in in_flight:
                future.cancel()
            for _, future in in_flight:
                try:
                    future.exception()  # wait: no thread writes into ``out`` after we return
                except BaseException:
                    pass

    def _compute(self, chunk: Chunk, values: Sequence[Any], out: np.ndarray) -> list[Failure]:
        failures: list[Failure] = []
        expected = out.shape[1:], out.dtype
        for row in range(chunk.start, chunk.stop):
            try:
                result = as_row(self.task.row_fn(values[row]))
            except Exception as exc:
                if not self.task.record_failures or isinstance(exc, NotAnArrayError):
                    raise
                failures.append((row, str(values[row]), failure_reason(exc)))
                continue
            check_row(row, result, expected)
            out[row] = result
        return failures

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def check_row(row: int, result: np.ndarray, expected: tuple[tuple[int, ...], np.dtype]) -> None:
    """ValueError naming ``row`` when its result is not of the build's row shape and dtype."""
    if (result.shape, result.dtype) != expected:
        raise ValueError(
            f"row {row} gave shape {result.shape} dtype {result.dtype}, but earlier rows "
            f"gave shape {expected[0]} dtype {expected[1]}; every row must have one shape")
