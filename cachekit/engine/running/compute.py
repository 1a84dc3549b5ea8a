"""Computing rows: what runs in a worker (a thread, one of cachekit's processes, a cluster
node), and the contract every chunk runner keeps (:class:`ChunkRunner`).

A worker runs :func:`compute_in_place` (threads and the builder itself write straight into
the output memmap) or :func:`compute_piece` (other processes return their rows as an array,
which the builder copies in). Both go through :func:`compute_rows`, which turns a failing
row into zeros and a recorded failure, and a row of the wrong shape into ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np

from ...errors import Failure, InvalidArgument, NotAnArrayError, failure
from .rows import as_row


class ChunkLike(Protocol):
    """A run of rows ``[start, stop)`` of the output, numbered ``index`` (plan.Chunk)."""

    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class RowTask:
    """Everything a worker needs to compute rows; it must pickle for processes and clusters.

    ``row_fn(value)`` returns one row (a numpy array or a torch tensor). With
    ``record_failures`` an exception from it (other than :class:`NotAnArrayError`, a bug in
    the function) makes the row a failure stored as zeros; without, it propagates unchanged.
    """

    row_fn: Callable[[Any], Any]
    record_failures: bool


def row_inputs(task: RowTask, values: Sequence[Any]) -> Any:
    """What the row function reads for each of ``values``: the values themselves, or, for
    a row function with a ``prefetch`` (images: the objects of URL rows, fetched many at
    once, :mod:`cachekit.engine.decoding.fetch`), what it made of them. Called where the
    rows run, so a cluster worker fetches its own rows' objects."""
    prefetch = getattr(task.row_fn, "prefetch", None)
    return values if prefetch is None else prefetch(values)


def compute_rows(task: RowTask, values: Sequence[Any], out: np.ndarray,
                 first_row: int, inputs: Any = None) -> list[Failure]:
    """``out[i] = task.row_fn(values[i])`` for every i; rows ``first_row + i`` of the build.

    ``inputs``: what :func:`row_inputs` made of ``values`` already (None: made here).
    A failed row (when recorded) is written as zeros and listed as (row, value, reason). A
    result of another shape or dtype than ``out``'s rows raises ValueError naming the row.
    """
    failures: list[Failure] = []
    if inputs is None:
        inputs = row_inputs(task, values)
    try:
        _compute(task.row_fn, task.record_failures, values, inputs, out, first_row, failures)
    finally:
        if inputs is not values and hasattr(inputs, "close"):
            inputs.close()  # what was fetched and not decoded leaves the window
    return failures


def _compute(row_fn: Callable[[Any], Any], record: bool, values: Sequence[Any], inputs: Any,
             out: np.ndarray, first_row: int, failures: list[Failure]) -> None:
    shape, dtype = out.shape[1:], out.dtype
    for i, (value, item) in enumerate(zip(values, inputs)):
        try:
            result = row_fn(item)
        except Exception as exc:
            if not record or isinstance(exc, NotAnArrayError):
                raise
            failures.append(failure(first_row + i, value, exc))
            out[i] = 0  # a redone chunk may hold bytes of an earlier attempt
            continue
        if type(result) is not np.ndarray:
            result = as_row(result)
        if result.shape != shape or result.dtype != dtype:
            raise InvalidArgument(
                f"row {first_row + i} gave shape {result.shape} dtype {result.dtype}, but "
                f"the rows are shape {shape} dtype {dtype}; every row must have one shape")
        out[i] = result


def compute_piece(task: RowTask, values: Sequence[Any], ranges: Sequence[tuple[int, int]],
                  shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, list[Failure]]:
    """A piece computed away from the output array: its rows as one new array, and failures.

    ``values`` are the rows of ``ranges`` (``[start, stop)`` runs of the build, in order)
    one after the other; failures name rows of the build.
    """
    out = np.zeros((len(values), *shape), dtype=np.dtype(dtype))
    failures: list[Failure] = []
    at = 0
    for start, stop in ranges:
        failures += compute_rows(task, values[at:at + stop - start], out[at:at + stop - start],
                                 start)
        at += stop - start
    return out, failures


def compute_in_place(task: RowTask, values: Sequence[Any], out: np.ndarray,
                     ranges: Sequence[tuple[int, int]], inputs: Optional[list[Any]] = None
                     ) -> list[Failure]:
    """Rows of ``ranges`` computed straight into ``out`` (threads and the builder itself).
    ``inputs``: :func:`row_inputs` of each range, made when the piece was handed out (so
    that a queued piece's objects are fetched while the piece before it decodes)."""
    failures: list[Failure] = []
    for n, (start, stop) in enumerate(ranges):
        failures += compute_rows(task, values[start:stop], out[start:stop], start,
                                 None if inputs is None else inputs[n])
    return failures


# --- runners -------------------------------------------------------------------------------

class ChunkRunner:
    """Computes chunks of rows into an output array; see :meth:`run`. Close it when done
    (or use it as a context manager): that stops the threads or processes it owns."""

    def run(self, chunks: Iterable[ChunkLike], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
        """Compute each chunk's rows into ``out[chunk.start:chunk.stop]`` and yield
        ``(chunk, failures)`` once all of them are in ``out``, in completion order.

        ``out`` is the writable array of the whole build (row shape and dtype fixed);
        ``values`` is indexed by row position. ``chunks`` is consumed only as work is
        handed out (the build claims each chunk as it is asked for it). At most a few pieces
        per worker are in flight. A row of the wrong shape or dtype raises ValueError naming
        the row; an exception that is not recorded propagates unchanged, after the queued
        pieces are cancelled and the running ones have finished (chunks they complete are
        still yielded first, so a resume keeps them).
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release the workers this runner owns (a user's Executor is left running)."""

    def __enter__(self) -> "ChunkRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class InlineRunner(ChunkRunner):
    """One worker: the rows run in the caller's thread, in order, straight into ``out``."""

    def __init__(self, task: RowTask) -> None:
        self.task = task

    def run(self, chunks: Iterable[ChunkLike], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
        out = plain(out)
        for chunk in chunks:
            yield chunk, compute_rows(self.task, values[chunk.start:chunk.stop],
                                      out[chunk.start:chunk.stop], chunk.start)


def plain(out: np.ndarray) -> np.ndarray:
    """The same memory without the np.memmap subclass, whose bookkeeping runs on every
    slice taken from it."""
    return out.view(np.ndarray) if isinstance(out, np.memmap) else out
