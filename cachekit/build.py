"""Fill a .npy memmap from a per-row function, in parallel, in order, in fixed-size chunks.

Rows run on a thread pool: Pillow releases the GIL while it decodes and resizes, so threads
scale without pickling rows or results across processes. At most a few rows per worker are
in flight, and each result is written into the memmap as soon as it is ready, so peak memory
does not grow with the number of rows.

A fill is resumable: after each chunk the memmap is flushed (msync) and only then a
checkpoint next to the file records how many rows are done, so a checkpoint never claims
rows that are not on disk. A later fill of the same rows into the same file continues from
there. publish.py decides whether a dead builder's file may be reused at all.
"""

from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import _fs, arrays
from .errors import Failure

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


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    record: Callable[[Exception], bool],
    template: tuple[tuple[int, ...], np.dtype] | None = None,
    on_chunk: ChunkCallback | None = None,
    progress: bool = False,
    description: str = "cachekit build",
    resume: bool = True,
) -> Filled:
    """Write ``row_fn(values[i])`` into row ``i`` of a new .npy file ``name`` of ``directory``.

    ``template`` gives the per-row shape and dtype; without it the first row that succeeds
    fixes them, and a later row of another shape or dtype raises ValueError naming both.
    ``record(exc)`` decides for an exception from ``row_fn``: True records the row as a
    failure (its row stays zeros), False re-raises it unchanged. ``on_chunk(done, total)``
    is called each time another CHUNK_ROWS rows are written and flushed.

    With ``resume`` and a usable checkpoint for ``name`` of the same row count (and the
    same ``template``, if given), rows before the checkpoint are kept and not recomputed.
    The caller vouches that those rows came from the same values and row function
    (publish.py checks the key and cachekit version).
    """
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
            start, first_result = _first_success(values, row_fn, record, failures)
            template = (first_result.shape, first_result.dtype)
        array = arrays.create_array(directory, name, (n, *template[0]), np.dtype(template[1]))
    writer = _RowWriter(array, directory, name, values, record, failures, on_chunk,
                        done=start if checkpoint is not None else 0)
    bar = _progress_bar(n, progress, description)
    try:
        if first_result is not None:
            writer.advance(start)  # the rows before the first success all failed
            writer.put(start, first_result)
            start += 1
        bar.update(start)
        window = 4 * max(1, workers)
        pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cachekit")
        try:
            in_flight: deque[tuple[int, Future]] = deque()
            for row in range(start, n):
                in_flight.append((row, pool.submit(row_fn, values[row])))
                if len(in_flight) >= window:
                    writer.take(*in_flight.popleft())
                    bar.update(1)
            while in_flight:
                writer.take(*in_flight.popleft())
                bar.update(1)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        arrays.flush(array)
    finally:
        bar.close()
    return Filled(shape=array.shape, dtype=array.dtype, failures=failures)


def _fits(checkpoint: Checkpoint, n: int, template: Any) -> bool:
    if checkpoint.shape[0] != n:
        return False
    return template is None or (tuple(template[0]) == checkpoint.shape[1:]
                                and np.dtype(template[1]) == checkpoint.dtype)


class _RowWriter:
    """Checks each finished row and writes it into the memmap, in row order."""

    def __init__(self, array, directory, name, values, record, failures, on_chunk,
                 done) -> None:
        self.array = array
        self.directory = directory
        self.name = name
        self.values = values
        self.record = record
        self.failures = failures
        self.on_chunk = on_chunk
        self.done = done

    def take(self, row: int, future: Future) -> None:
        try:
            result = future.result()
        except Exception as exc:
            if not self.record(exc):
                raise
            self.failures.append((row, str(self.values[row]), _reason(exc)))
            self.advance(1)
        else:
            self.put(row, result)

    def put(self, row: int, result: Any) -> None:
        result = _as_array(result)
        expected = self.array.shape[1:], self.array.dtype
        if (result.shape, result.dtype) != expected:
            raise ValueError(
                f"row {row} gave shape {result.shape} dtype {result.dtype}, but earlier rows "
                f"gave shape {expected[0]} dtype {expected[1]}; every row must have one shape"
            )
        self.array[row] = result
        self.advance(1)

    def advance(self, rows: int) -> None:
        before, self.done = self.done, self.done + rows
        total = len(self.array)
        if rows and (before // CHUNK_ROWS != self.done // CHUNK_ROWS or self.done == total):
            arrays.flush(self.array)  # msync: the rows are on disk before a checkpoint names them
            self.checkpoint()
            if self.on_chunk is not None:
                self.on_chunk(self.done, total)

    def checkpoint(self) -> None:
        # Not fsynced: a checkpoint lost in a power cut only makes a resume redo rows.
        self.directory.replace_json(checkpoint_name(self.name), {
            "format": _CHECKPOINT_FORMAT, "done": self.done, "shape": list(self.array.shape),
            "dtype": self.array.dtype.str, "failures": [list(f) for f in self.failures],
        })


def _first_success(values, row_fn, record, failures) -> tuple[int, np.ndarray]:
    """Run rows in order until one succeeds; its shape and dtype fix the array's."""
    for row, value in enumerate(values):
        try:
            return row, _as_array(row_fn(value))
        except Exception as exc:
            if not record(exc):
                raise
            failures.append((row, str(value), _reason(exc)))
    raise ValueError(f"all {len(values)} rows failed; there is nothing to store")


def _as_array(result: Any) -> np.ndarray:
    """Accept numpy arrays and torch tensors (or anything numpy can view) as a row."""
    if isinstance(result, np.ndarray):
        return result
    if hasattr(result, "detach") and hasattr(result, "cpu"):
        return result.detach().cpu().numpy()
    return np.asarray(result)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc) or repr(exc)}"


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
