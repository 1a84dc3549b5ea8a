"""Fill a .npy memmap from a per-row function, in parallel, in fixed-size chunks.

The rows of each chunk run on an executor (cachekit.executors: threads writing in place,
processes, or a user's concurrent.futures.Executor whose rows come back here), with only a
few pieces per worker in flight, so peak memory does not grow with the number of rows.

A fill is resumable: once a chunk and every chunk before it are in the memmap, it is flushed
(msync) and only then a checkpoint next to the file records how many rows are done, so a
checkpoint never claims rows that are not on disk. A later fill of the same rows into the
same file continues from there. publish.py decides whether a dead builder's file may be
reused at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import _fs, arrays, executors
from .errors import Failure, NotAnArrayError

CHUNK_ROWS = 1024
"""Rows per chunk: the unit of progress reports, of flushing to disk and of resuming."""

CHECKPOINT_SUFFIX = ".progress.json"
_CHECKPOINT_FORMAT = 1
_CHECKPOINT_LIMIT = 256 << 20

RowFunction = Callable[[Any], Any]
ChunkCallback = Callable[[int, int], None]


@dataclass
class Filled:
    """What a fill produced: the array's shape and dtype, and the rows that failed."""

    shape: tuple[int, ...]
    dtype: np.dtype
    failures: list[Failure] = field(default_factory=list)


@dataclass(frozen=True)
class Checkpoint:
    """Rows [0, done) of a partly filled .npy are on disk; ``failures`` are those that failed."""

    done: int
    shape: tuple[int, ...]
    dtype: np.dtype
    failures: tuple[Failure, ...]


usable_cpus = executors.usable_cpus


def checkpoint_name(name: str) -> str:
    """The name of the checkpoint of a fill into ``name`` (removed before publishing)."""
    return name + CHECKPOINT_SUFFIX


def read_checkpoint(directory: _fs.DirHandle, name: str) -> Optional[Checkpoint]:
    """The checkpoint of the partly filled file ``name`` of ``directory``, or None when there
    is no usable one.

    Usable: well-formed, and the file's .npy header and size agree with its shape and dtype.
    """
    try:
        with directory.open_file(checkpoint_name(name)) as f:
            raw = json.loads(f.read(_CHECKPOINT_LIMIT))
        if not isinstance(raw, dict) or raw.get("format") != _CHECKPOINT_FORMAT:
            return None
        shape, done, failures = raw["shape"], raw["done"], raw["failures"]
        if not (isinstance(shape, list) and shape and all(_is_count(n) for n in shape)
                and _is_count(done) and done <= shape[0] and isinstance(failures, list)):
            return None
        dtype = np.dtype(raw["dtype"])
        if dtype.hasobject:
            return None
        rows = []
        for item in failures:
            if not (isinstance(item, list) and len(item) == 3 and _is_count(item[0])
                    and item[0] < done and isinstance(item[1], str) and isinstance(item[2], str)):
                return None
            rows.append((item[0], item[1], item[2]))
        with directory.open_file(name) as f:  # CacheCorruptError is an OSError
            arrays.check_header(f, directory.path / name, tuple(shape), dtype)
    except (OSError, ValueError, KeyError, TypeError, SyntaxError, RecursionError):
        return None
    return Checkpoint(done, tuple(shape), dtype, tuple(rows))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def fill(
    directory: _fs.DirHandle,
    name: str,
    values: Sequence[Any],
    row_fn: RowFunction,
    *,
    workers: int,
    record_failures: bool,
    executor: executors.ExecutorSpec = None,
    template: tuple[tuple[int, ...], np.dtype] | None = None,
    on_chunk: ChunkCallback | None = None,
    progress: bool = False,
    description: str = "cachekit build",
    resume: bool = True,
) -> Filled:
    """Write ``row_fn(values[i])`` into row ``i`` of a new .npy file ``name`` of ``directory``.

    ``template`` gives the per-row shape and dtype; without it the first row that succeeds
    fixes them, and a later row of another shape or dtype raises ValueError naming both.
    With ``record_failures`` an exception from ``row_fn`` (other than NotAnArrayError)
    records the row as a failure (its row stays zeros); without, it propagates unchanged.
    The rows run on ``executor`` (see cachekit.executors; a row function that cannot be
    pickled for processes or a cluster is a TypeError before any row runs).
    ``on_chunk(done, total)`` is called each time another CHUNK_ROWS rows are written and
    flushed.

    With ``resume`` and a usable checkpoint for ``name`` of the same row count (and the
    same ``template``, if given), rows before the checkpoint are kept and not recomputed.
    The caller vouches that those rows came from the same values and row function
    (publish.py checks the key and cachekit version).
    """
    n = len(values)
    task = executors.RowTask(row_fn, record_failures)
    runner = executors.make_runner(executor, max(1, workers), task, rows=n)
    try:
        return _fill(directory, name, values, task, runner, template, on_chunk, progress,
                     description, resume)
    finally:
        runner.close()


@dataclass(frozen=True)
class _Chunk:
    index: int
    start: int
    stop: int


def _fill(directory, name, values, task, runner, template, on_chunk, progress, description,
          resume) -> Filled:
    n = len(values)
    checkpoint = read_checkpoint(directory, name) if resume else None
    if checkpoint is not None and not _fits(checkpoint, n, template):
        checkpoint = None
    failures: list[Failure] = []
    start, first_result = 0, None
    if checkpoint is not None:
        array = arrays.open_writable(directory, name)
        failures.extend(checkpoint.failures)
        start = checkpoint.done
    else:
        directory.unlink(checkpoint_name(name))
        directory.unlink(name)
        if template is None:
            start, first_result = _first_success(values, task, failures)
            template = (first_result.shape, first_result.dtype)
        array = arrays.create_array(directory, name, (n, *template[0]), np.dtype(template[1]))
    if first_result is not None:
        array[start] = first_result  # the rows before the first success all failed
        start += 1
    progress_file = _Checkpointer(array, directory, name, on_chunk, done=start,
                                  earlier=failures)
    bar = _progress_bar(n, progress, description)
    try:
        bar.update(start)
        # Chunks end on multiples of CHUNK_ROWS, the only places a checkpoint may name.
        bounds = [start, *range((start // CHUNK_ROWS + 1) * CHUNK_ROWS, n, CHUNK_ROWS), n]
        chunks = [_Chunk(i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if a < b]
        for chunk, chunk_failures in runner.run(chunks, values, array):
            progress_file.done_chunk(chunk, chunk_failures)
            bar.update(chunk.stop - chunk.start)
        progress_file.finish()
    finally:
        bar.close()
    failures.extend(progress_file.failures)
    return Filled(shape=array.shape, dtype=array.dtype, failures=sorted(failures))


def _fits(checkpoint: Checkpoint, n: int, template: Any) -> bool:
    if checkpoint.shape[0] != n:
        return False
    return template is None or (tuple(template[0]) == checkpoint.shape[1:]
                                and np.dtype(template[1]) == checkpoint.dtype)


class _Checkpointer:
    """Turns chunks completed in any order into a checkpoint of the done prefix of rows."""

    def __init__(self, array, directory, name, on_chunk, done, earlier) -> None:
        self.array = array
        self.directory = directory
        self.name = name
        self.on_chunk = on_chunk
        self.done = done  # rows [0, done) are on disk and named by the checkpoint
        self.waiting: dict[int, tuple[int, list[Failure]]] = {}  # start -> (stop, failures)
        self.earlier: list[Failure] = earlier  # of rows before ``done`` at the start
        self.failures: list[Failure] = []  # of the rows this fill computed, in the prefix

    def done_chunk(self, chunk: _Chunk, failures: list[Failure]) -> None:
        self.waiting[chunk.start] = (chunk.stop, failures)
        before = self.done
        while self.done in self.waiting:
            self.done, chunk_failures = self.waiting.pop(self.done)
            self.failures.extend(chunk_failures)
        if self.done != before:
            arrays.flush(self.array)  # msync: the rows are on disk before a checkpoint names them
            self.checkpoint()
            if self.on_chunk is not None:
                self.on_chunk(self.done, len(self.array))

    def finish(self) -> None:
        arrays.flush(self.array)

    def checkpoint(self) -> None:
        # Not fsynced: a checkpoint lost in a power cut only makes a resume redo rows.
        failures = sorted(self.earlier + self.failures)
        self.directory.replace_json(checkpoint_name(self.name), {
            "format": _CHECKPOINT_FORMAT, "done": self.done, "shape": list(self.array.shape),
            "dtype": self.array.dtype.str, "failures": [list(f) for f in failures],
        })


def _first_success(values, task: executors.RowTask, failures) -> tuple[int, np.ndarray]:
    """Run rows in order until one succeeds; its shape and dtype fix the array's."""
    for row, value in enumerate(values):
        try:
            return row, executors.as_array(task.row_fn(value))
        except Exception as exc:
            if not task.record_failures or isinstance(exc, NotAnArrayError):
                raise
            failures.append((row, str(value), executors.reason(exc)))
    raise ValueError(f"all {len(values)} rows failed; there is nothing to store")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, show: bool, description: str):
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="img", dynamic_ncols=True, smoothing=0.1)
