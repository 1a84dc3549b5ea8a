"""Run a build's chunks of rows on threads, on processes, or on any concurrent.futures.Executor.

The build engine decides the chunks (which rows, in what order, what is already done); a
:class:`ChunkRunner` only computes them into the output array and says when each chunk is
complete. Three kinds, one contract (:meth:`ChunkRunner.run`):

- ``"threads"``: the rows of a chunk run in a thread pool and are written in place into the
  output memmap; Pillow releases the GIL while it decodes and resizes. One worker runs the
  rows in the calling thread: a pool of one only adds hand-offs.
- ``"processes"``: the builder's own thread and ``workers - 1`` fresh worker interpreters
  this runner owns (:mod:`cachekit.engine._workers`): never ``fork`` (the builder has threads,
  whose locks a forked child would inherit mid-use), and, unlike spawn or forkserver pools,
  the workers never re-run the user's main script. Their rows come back as arrays and are
  copied into the output; the builder's own rows are computed in place.
- an Executor instance of the user (a process pool, loky, Dask's ``client.get_executor()``):
  pieces of chunks are submitted to it, their rows come back as arrays and are copied into
  the output here, so the executor's workers need no access to the cache's filesystem.

Work travels as pieces: runs of consecutive rows, each a share of the rows not handed out
yet (guided self-scheduling: large pieces first, small ones at the tail), cut within a chunk
for threads and across chunks for other processes (:class:`_Cutter`). At most a few pieces
per worker are in flight, so memory stays bounded whatever the number of rows.

The default (``executor=None``) is :func:`default_executor`'s rule; see
docs/build-engine.md for the measurements behind it.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence, Union

import numpy as np

from ..errors import Failure, NotAnArrayError, failure_reason
from .rows import as_row

__all__ = ["ChunkRunner", "Failure", "RowTask", "default_executor", "make_runner",
           "usable_cpus"]

ExecutorSpec = Union[None, str, Executor]
KINDS = ("threads", "processes")

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
PROCESSES_FROM_ROWS = 1024
"""The default rule's threshold: builds of at least this many rows, with 2 or more workers,
run on processes. See :func:`default_executor`."""
PIECES_PER_WORKER = 2
"""Pieces in flight per worker: one running and one queued, so no worker waits for the
builder between pieces."""


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


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --- computing rows (runs in the worker: a thread, a process or a cluster node) ------------

def compute_rows(task: RowTask, values: Sequence[Any], out: np.ndarray,
                 first_row: int) -> list[Failure]:
    """``out[i] = task.row_fn(values[i])`` for every i; rows ``first_row + i`` of the build.

    A failed row (when recorded) is written as zeros and listed as (row, value, reason). A
    result of another shape or dtype than ``out``'s rows raises ValueError naming the row.
    """
    row_fn, record = task.row_fn, task.record_failures
    shape, dtype = out.shape[1:], out.dtype
    failures: list[Failure] = []
    for i, value in enumerate(values):
        try:
            result = row_fn(value)
        except Exception as exc:
            if not record or isinstance(exc, NotAnArrayError):
                raise
            failures.append((first_row + i, str(value), failure_reason(exc)))
            out[i] = 0  # a redone chunk may hold bytes of an earlier attempt
            continue
        if type(result) is not np.ndarray:
            result = as_row(result)
        if result.shape != shape or result.dtype != dtype:
            raise ValueError(
                f"row {first_row + i} gave shape {result.shape} dtype {result.dtype}, but "
                f"the rows are shape {shape} dtype {dtype}; every row must have one shape")
        out[i] = result
    return failures


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
                     ranges: Sequence[tuple[int, int]]) -> list[Failure]:
    """Rows of ``ranges`` computed straight into ``out`` (threads and the builder itself)."""
    failures: list[Failure] = []
    for start, stop in ranges:
        failures += compute_rows(task, values[start:stop], out[start:stop], start)
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


class _InlineRunner(ChunkRunner):
    """One worker: the rows run in the caller's thread, in order, straight into ``out``."""

    def __init__(self, task: RowTask) -> None:
        self.task = task

    def run(self, chunks: Iterable[ChunkLike], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
        out = _plain(out)
        for chunk in chunks:
            yield chunk, compute_rows(self.task, values[chunk.start:chunk.stop],
                                      out[chunk.start:chunk.stop], chunk.start)


@dataclass
class _ChunkState:
    """A chunk being computed: complete once all its rows are handed out and came back."""

    chunk: ChunkLike
    outstanding: int = 0  # segments handed out and not back yet
    cut: bool = False  # every row handed out
    failures: list[Failure] = field(default_factory=list)


@dataclass(frozen=True)
class _Segment:
    state: _ChunkState
    start: int
    stop: int


class _Cutter:
    """Cuts the stream of chunks into pieces of a requested number of rows. A piece is a
    list of segments: the rest of one chunk, whole chunks, the start of another, so a piece
    can be larger than a chunk (a cluster task must be long against its overhead) or a small
    part of one (the tail of a build stays balanced)."""

    def __init__(self, chunks: Iterable[ChunkLike], rows: Optional[int]) -> None:
        self.chunks = iter(chunks)
        self.current: Optional[_ChunkState] = None
        self.position = 0
        self.left = rows  # rows not handed out yet, as far as the caller's hint knows
        self.empty: list[_ChunkState] = []  # chunks of no rows: complete at once

    def take(self, rows: int, span: bool = True) -> list[_Segment]:
        """Up to ``rows`` rows, from as many chunks as it takes (``span``) or from one."""
        segments: list[_Segment] = []
        while rows > 0 and (span or not segments):
            if self.current is None:
                chunk = next(self.chunks, None)
                if chunk is None:
                    break
                state = _ChunkState(chunk)
                if chunk.stop <= chunk.start:
                    state.cut = True
                    self.empty.append(state)
                    continue
                self.current, self.position = state, chunk.start
            state = self.current
            stop = min(state.chunk.stop, self.position + rows)
            segments.append(_Segment(state, self.position, stop))
            state.outstanding += 1
            rows -= stop - self.position
            if self.left is not None:
                self.left = max(0, self.left - (stop - self.position))
            self.position = stop
            if stop == state.chunk.stop:
                state.cut, self.current = True, None
        return segments


@dataclass(frozen=True)
class _Sizes:
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
THREAD_SIZES = _Sizes(smallest=4, largest=THREAD_PIECE_ROWS, span=False)
PROCESS_SIZES = _Sizes(smallest=8, largest=REMOTE_PIECE_ROWS, span=True)
CLUSTER_SIZES = _Sizes(smallest=32, largest=CLUSTER_PIECE_ROWS, span=True)


class _PieceRunner(ChunkRunner):
    """Chunks cut into pieces, submitted to an Executor, collected as they complete.

    With ``caller_runs`` (cachekit's processes) the builder's own thread is one of the
    workers: between looking after the pool's pieces it computes short pieces itself,
    straight into ``out``. So ``workers=N`` starts only N - 1 processes, and their start-up
    (a few tenths of a second each) runs while the builder already computes.
    """

    def __init__(self, executor: Executor, helpers: int, sizes: _Sizes, task: RowTask, *,
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

    def _submit(self, values: Sequence[Any], out: np.ndarray, piece: list[_Segment]) -> Future:
        ranges = [(s.start, s.stop) for s in piece]
        if self.in_place:
            return self.executor.submit(compute_in_place, self.task, values, out, ranges)
        rows = [v for s in piece for v in values[s.start:s.stop]]
        return self.executor.submit(compute_piece, self.task, rows, ranges, out.shape[1:],
                                    out.dtype.str)

    def run(self, chunks: Iterable[ChunkLike], values: Sequence[Any], out: np.ndarray
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
        out = _plain(out)
        row_bytes = out[:1].nbytes
        cutter = _Cutter(chunks, self.rows)
        pending: dict[Future, list[_Segment]] = {}
        limit = PIECES_PER_WORKER * self.helpers
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
                own: list[_Segment] = []
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

    def _land(self, future: Future, out: np.ndarray, piece: list[_Segment]) -> list[Failure]:
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


def _finish(piece: list[_Segment], failures: list[Failure]
            ) -> Iterator[tuple[ChunkLike, list[Failure]]]:
    """Give each segment of a landed piece its failures; yield the chunks now complete."""
    for segment in piece:
        state = segment.state
        state.failures += [f for f in failures if segment.start <= f[0] < segment.stop]
        state.outstanding -= 1
        if state.cut and state.outstanding == 0:
            yield state.chunk, sorted(state.failures)


def _cancel_queued(pending: dict[Future, Any]) -> None:
    """Cancel the pieces not started yet and forget them (an executor need not tell wait()
    about a cancelled future); the running ones stay in ``pending``."""
    for future in list(pending):
        if future.cancel():
            del pending[future]


def _plain(out: np.ndarray) -> np.ndarray:
    """The same memory without the np.memmap subclass, whose bookkeeping runs on every
    slice taken from it."""
    return out.view(np.ndarray) if isinstance(out, np.memmap) else out


# --- choosing a runner ---------------------------------------------------------------------

def default_executor(workers: int, task: RowTask, rows: Optional[int] = None) -> str:
    """The executor ``executor=None`` stands for: "threads" or "processes".

    Processes when all of: 2 or more workers; at least PROCESSES_FROM_ROWS rows to compute
    (``rows`` None: unknown, so no); and a row function that cachekit's worker processes can
    load (it pickles and needs nothing from the main script). Threads otherwise.

    Why (benchmarks/bench_engine.py; the measurements are in docs/build-engine.md): part of
    each image's decode holds the GIL (most of it for small images), so Amdahl's law caps
    threads well below the core count, where processes scale with the cores; but a worker
    process costs a fraction of a second of CPU to start (numpy, Pillow, cachekit's row
    functions), which a build of fewer than about a thousand rows does not earn back on 2
    cores (the two broke even near PROCESSES_FROM_ROWS): threads start at once.
    """
    if workers < 2 or rows is None or rows < PROCESSES_FROM_ROWS:
        return "threads"
    try:
        check_picklable(task, "processes")
    except TypeError:
        return "threads"  # a lambda or a function of the main script: threads can run it
    return "processes"


def make_runner(executor: ExecutorSpec, workers: int, task: RowTask, *,
                rows: Optional[int] = None) -> ChunkRunner:
    """A runner for ``executor``: None (the default rule), "threads", "processes", or a
    concurrent.futures.Executor instance. ``workers`` sizes threads and processes (an
    Executor instance has its own size). ``rows``: how many rows the build will compute,
    a hint for the default rule.

    Raises TypeError naming the row function when it cannot be pickled for a process or
    cluster executor, before any work starts.
    """
    check_executor(executor)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, not {workers!r}")
    if executor is None:
        executor = default_executor(workers, task, rows)
    if executor == "threads":
        if workers == 1:
            return _InlineRunner(task)
        # No caller_runs here: threads start at once, and the builder's thread stays free to
        # record each chunk done as soon as its rows are in.
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachekit")
        return _PieceRunner(pool, workers, THREAD_SIZES, task, owned=True, in_place=True,
                            rows=rows)
    if isinstance(executor, ThreadPoolExecutor):  # the user's threads: in process, no pickling
        return _PieceRunner(executor, _executor_size(executor), THREAD_SIZES, task,
                            owned=False, in_place=True, rows=rows)
    check_picklable(task, executor)
    if executor == "processes":
        if workers == 1:
            return _InlineRunner(task)
        from ._workers import WorkerPool

        return _PieceRunner(WorkerPool(workers - 1), workers - 1, PROCESS_SIZES, task,
                            owned=True, in_place=False, caller_runs=True, rows=rows)
    return _PieceRunner(executor, _executor_size(executor), CLUSTER_SIZES, task,
                        owned=False, in_place=False, rows=rows)


def check_executor(executor: Any) -> None:
    """ValueError for an unknown executor name, TypeError for anything else unusable."""
    if executor is None or isinstance(executor, Executor):
        return
    if isinstance(executor, str):
        if executor not in KINDS:
            raise ValueError(f"executor must be None, 'threads', 'processes' or a "
                             f"concurrent.futures.Executor; got {executor!r}")
        return
    raise TypeError(f"executor must be None, 'threads', 'processes' or a "
                    f"concurrent.futures.Executor (a ProcessPoolExecutor, loky, dask's "
                    f"client.get_executor()); got {type(executor).__qualname__}")


def check_picklable(task: RowTask, executor: Any) -> None:
    """TypeError naming the row function when ``task`` cannot be pickled for ``executor``,
    or, for "processes" (whose workers do not run the main script), when it refers to a
    function of the main script."""
    where = executor if isinstance(executor, str) else type(executor).__qualname__
    try:
        pickle.dumps(task)
    except Exception as exc:  # PicklingError, AttributeError ("local object"), TypeError
        raise TypeError(
            f"the row function {describe(task.row_fn)} cannot be pickled, so it cannot run "
            f"on the {where} executor ({type(exc).__name__}: {exc}); define it at the top "
            "level of a module (not a lambda, a local function or a closure), or use "
            "executor='threads'") from exc
    if executor == "processes":
        from ._workers import main_references

        names = main_references(task)
        if names:
            raise TypeError(
                f"the row function {describe(task.row_fn)} needs {', '.join(names)}, defined "
                "in the main script, which cachekit's worker processes do not run; move it "
                "into an importable module, or pass executor='threads' or your own "
                "concurrent.futures.ProcessPoolExecutor")


def describe(row_fn: Callable[..., Any]) -> str:
    """The name of the user's function behind ``row_fn`` (wrappers set ``__wrapped__``)."""
    fn = getattr(row_fn, "__wrapped__", row_fn)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None)
    if name is None:
        return repr(fn)
    return f"{module}.{name}" if module else name


def _executor_size(executor: Executor) -> int:
    """How many tasks ``executor`` runs at once, to size the pieces and the window."""
    client = getattr(executor, "_client", None)  # distributed.cfexecutor.ClientExecutor
    if client is not None and hasattr(client, "nthreads"):
        try:
            return max(1, sum(client.nthreads().values()))
        except Exception:  # a closed or unreachable client: fall back to this host's size
            return usable_cpus()
    size = getattr(executor, "_max_workers", None)  # ProcessPool/ThreadPool, loky
    return size if isinstance(size, int) and size > 0 else usable_cpus()
