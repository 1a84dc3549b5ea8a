"""Fill a .npy memmap from a per-row function, chunk by chunk, with any number of processes.

A fill follows a :class:`~cachekit.plan.Plan` (rows, row shape and dtype, page-aligned
chunks) and keeps a chunk journal next to the data file (:mod:`cachekit.journal`). Chunks
are computed through a chunk runner (``make_runner(...).run(chunks, values, out)``), which
writes each chunk's rows into the memmap; once a chunk's rows are flushed to disk (msync of
its byte range) a create-only done record names it, with its failed rows. So the journal
holds the set of done chunks, in any order, and a later fill of the same rows into the same
file (a resume after a crash) computes exactly the chunks that are not done.

Every chunk is claimed before it is computed (a create-only claim record with a
heartbeat), so other processes can fill chunks of the same build at the same time: the
builder (:func:`fill`) and any number of joiners (:func:`join`), on this host or on other
hosts of a shared root. The builder waits for the chunks that joiners hold, takes over
those of joiners that die, and returns once every chunk is done, with every participant's
failures. publish.py decides whether a dead builder's file may be reused at all, and who
joins what.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from . import _fs, arrays, plan as plans
from .executors import RowTask, make_runner
from .errors import Failure, NotAnArrayError, failure_reason
from .journal import BuildGone, Claim, Journal, journal_name
from .plan import Chunk, Plan
from .rows import as_row

RowFunction = Callable[[Any], Any]
ChunkCallback = Callable[[int, int], None]
POLL_SECONDS = 0.05
"""How often a builder looks at chunks that other processes hold."""


@dataclass
class Filled:
    """What a fill produced: the array's shape and dtype, and the rows that failed."""

    shape: tuple[int, ...]
    dtype: np.dtype
    failures: list[Failure] = field(default_factory=list)


@dataclass(frozen=True)
class Joined:
    """What a joiner did for another process's build: chunks and rows it filled."""

    chunks: int
    rows: int
    total_chunks: int


@dataclass(frozen=True)
class Progress:
    """A partly filled data file: its plan and which of its chunks are done."""

    plan: Plan
    done: tuple[int, ...]

    @property
    def rows_done(self) -> int:
        chunks = self.plan.chunks
        return sum(chunks[i].rows for i in self.done)


def read_progress(directory: _fs.DirHandle, name: str) -> Optional[Progress]:
    """The journal of the partly filled file ``name`` of ``directory``, or None when there is
    no usable one (no plan, or a data file whose header and size disagree with it)."""
    try:
        with Journal.open(directory, name) as journal:
            with directory.open_file(name) as f:
                offset = arrays.check_header(f, directory.path / name, journal.plan.shape,
                                             journal.plan.dtype)
            if offset != journal.plan.offset:
                return None
            return Progress(journal.plan, tuple(journal.done(drop_bad=False)))
    except (OSError, ValueError, TypeError):
        return None


def fill(
    directory: _fs.DirHandle,
    name: str,
    values: Sequence[Any],
    row_fn: RowFunction,
    *,
    workers: int,
    record: bool,
    template: tuple[tuple[int, ...], np.dtype] | None = None,
    on_chunk: ChunkCallback | None = None,
    progress: bool = False,
    description: str = "cachekit build",
    resume: bool = True,
    key: str = "",
    executor: Any = None,
) -> Filled:
    """Write ``row_fn(values[i])`` into row ``i`` of a new .npy file ``name`` of ``directory``.

    ``template`` gives the per-row shape and dtype; without it the first row that succeeds
    fixes them (rows before it are failures), and a later row of another shape or dtype
    raises ValueError naming both. ``record``: True makes a row whose function raises
    (anything but NotAnArrayError) a failure whose row stays zeros; False re-raises the
    exception unchanged. ``on_chunk(done, total)`` is called each time another chunk is
    written and flushed, with the rows done by every process.

    With ``resume`` and a usable journal for ``name`` of the same row count, key (and
    ``template``, if given), the done chunks are kept and not recomputed. The caller vouches
    that they came from the same values and row function (publish.py checks the key and
    cachekit version).
    """
    n = len(values)
    task = RowTask(row_fn, record)
    runner = make_runner(executor, workers, task, rows=n)  # first: it refuses what cannot run
    try:
        started = _resumed(directory, name, n, template, key) if resume else None
        head: Optional[tuple[Claim, Chunk, list[Failure]]] = None
        if started is None:
            directory.remove_tree(journal_name(name))
            directory.unlink(name)
            journal, array, head = _start(directory, name, values, task, template, key,
                                          workers)
        else:
            journal, array = started
        bar = _progress_bar(n, progress, description)
        try:
            with journal:
                done = _fill_all(journal, array, values, lambda: runner, head, on_chunk, bar)
                failures = sorted(f for chunk in done.values() for f in chunk)
        finally:
            bar.close()
    finally:
        runner.close()
    return Filled(shape=array.shape, dtype=array.dtype, failures=failures)


def join(directory: _fs.DirHandle, name: str, values: Sequence[Any], row_fn: RowFunction, *,
         workers: int, record: bool, template: tuple[tuple[int, ...], np.dtype] | None,
         key: str, executor: Any = None) -> Optional[Joined]:
    """Fill chunks that nobody holds of another process's build in ``directory`` (opened
    by handle, and of this user), until none is left; None when it cannot be joined (no
    plan yet, or a plan of other rows). Writes only claims, done records and rows.

    Returns as soon as no chunk is free: the builder waits for the claims it leaves and
    commits. If the build is committed or discarded meanwhile, stops and says what it did.
    """
    try:
        own = os.fstat(directory.fd)
        if own.st_uid != os.geteuid() or own.st_mode & 0o022:
            return None  # not a private build directory of ours: never write there
        journal = Journal.open(directory, name)
    except (OSError, ValueError):
        return None
    with journal:
        planned = journal.plan
        if (planned.key != key or planned.rows != len(values)
                or (template is not None and not _same_template(planned, template))):
            return None
        try:
            array = _open_planned(directory, name, planned)
        except (OSError, ValueError):
            return None
        runner = _LazyRunner(executor, workers, RowTask(row_fn, record), len(values))
        filled = rows = 0
        try:
            for chunk in _run_claimed(journal, array, values, runner):
                filled, rows = filled + 1, rows + chunk.rows
        except BuildGone:
            pass  # published (or failed) meanwhile: the caller looks again
        finally:
            runner.close()
        return Joined(filled, rows, len(planned.chunks))


def _start(directory: _fs.DirHandle, name: str, values: Sequence[Any], task: RowTask,
           template: Any, key: str, workers: int):
    """Create the data file, the journal and the plan of a fresh fill. Without a template,
    rows run in order until one succeeds (its shape and dtype fix the plan's); the chunk
    holding that row stays claimed by us, as (claim, the rest of its rows, its failures)."""
    failures: list[Failure] = []
    first: Optional[tuple[int, np.ndarray]] = None
    if template is None:
        first = _first_success(values, task, failures)
        template = (first[1].shape, first[1].dtype)
    shape, dtype = (len(values), *tuple(template[0])), np.dtype(template[1])
    array = arrays.create_array(directory, name, shape, dtype, align=plans.PAGE_BYTES)
    planned = plans.make_plan(key, len(values), tuple(template[0]), dtype, workers,
                              offset=_data_offset(array, directory, name))
    journal = Journal.create(directory, name)
    journal.plan = planned
    head = None
    try:
        if first is not None:
            row, result = first
            array[row] = result
            for chunk in planned.chunks[:planned.chunk_of(row).index]:
                journal.mark_done(chunk, [f for f in failures if chunk.start <= f[0] < chunk.stop])
            chunk = planned.chunk_of(row)
            claim = journal.claim(chunk)
            head = (claim, Chunk(chunk.index, row + 1, chunk.stop),
                    [f for f in failures if f[0] >= chunk.start])
        journal.write_plan(planned)  # last: from here on other processes may join
    except BaseException:
        if head is not None:
            head[0].stop()
        journal.close()
        raise
    return journal, array, head


def _fill_all(journal: Journal, array: np.ndarray, values: Sequence[Any],
              runner: Callable[[], Any], head: Any, on_chunk: Optional[ChunkCallback],
              bar: Any) -> dict[int, list[Failure]]:
    """Fill chunks until every chunk is done, by us or by others; return every chunk's
    failures (the done records, read once at the end)."""
    total = len(array)
    shown = journal.rows_done()
    bar.update(shown)

    def report() -> None:
        nonlocal shown
        done = journal.rows_done()
        if done != shown:
            bar.update(done - shown)
            shown = done
            if on_chunk is not None:
                on_chunk(done, total)

    while True:
        for _ in _run_claimed(journal, array, values, runner, head):
            report()
        head = None
        held, free = journal.pending()
        if not held and not free:
            done = journal.done()
            if len(done) == len(journal.plan.chunks):  # (done() drops unreadable records:
                break                                  # those chunks run again)
        elif not free:
            time.sleep(POLL_SECONDS)  # other processes fill the rest; take over any that die
        report()
    if total == 0 and on_chunk is not None:
        on_chunk(0, 0)
    return done


def _run_claimed(journal: Journal, array: np.ndarray, values: Sequence[Any],
                 runner: Callable[[], Any], head: Any = None) -> Iterator[Chunk]:
    """Claim free chunks as the runner asks for them, compute them, flush each and record it
    done; yield each chunk this process finished. Claims not finished are released.
    ``runner()`` gives the chunk runner, asked for only once a chunk is claimed."""
    planned = journal.plan
    claims: dict[int, tuple[Claim, list[Failure]]] = {}

    def chunks() -> Iterator[Chunk]:
        if head is not None:
            claim, rest, failures = head
            claims[claim.chunk.index] = (claim, failures)
            yield rest
        for claim in journal.claimable(planned.chunks):
            claims[claim.chunk.index] = (claim, [])
            yield claim.chunk

    source = chunks()
    try:
        first = next(source, None)
        if first is None:
            return
        for chunk, failures in runner().run(itertools.chain([first], source), values, array):
            claim, earlier = claims.pop(chunk.index)
            arrays.flush_bytes(array, *planned.byte_range(claim.chunk))
            if claim.finish(earlier + failures):
                yield claim.chunk
    finally:
        for claim, _ in claims.values():
            claim.release()


class _LazyRunner:
    """The chunk runner of a joiner, made only once it has claimed a chunk (a joiner looks
    for free chunks every few tens of milliseconds, and a process pool is costly to start)."""

    def __init__(self, executor: Any, workers: int, task: RowTask, rows: int) -> None:
        self.args = (executor, workers, task)
        self.rows = rows
        self.runner: Any = None

    def __call__(self) -> Any:
        if self.runner is None:
            self.runner = make_runner(*self.args, rows=self.rows)
        return self.runner

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _resumed(directory: _fs.DirHandle, name: str, n: int, template: Any, key: str):
    """(journal, writable array) of a usable partial fill of ``name``, or None."""
    try:
        journal = Journal.open(directory, name)
    except (OSError, ValueError):
        return None
    planned = journal.plan
    try:
        if planned.rows != n or (key and planned.key != key) or (
                template is not None and not _same_template(planned, template)):
            raise ValueError("a journal of another fill")
        return journal, _open_planned(directory, name, planned)
    except (OSError, ValueError, TypeError):
        journal.close()
        return None


def _open_planned(directory: _fs.DirHandle, name: str, planned: Plan) -> np.ndarray:
    """Map the data file of ``planned`` for writing (checked: its header, size and data
    offset), through ``directory``: never by a path that another process could swap."""
    array = arrays.open_writable(directory, name)
    if (array.shape != planned.shape or array.dtype != planned.dtype
            or _data_offset(array, directory, name) != planned.offset):
        raise ValueError("the data file does not match the plan")
    return array


def _data_offset(array: np.ndarray, directory: _fs.DirHandle, name: str) -> int:
    offset = getattr(array, "offset", None)
    if isinstance(array, np.memmap) and isinstance(offset, int):
        return offset
    with directory.open_file(name) as f:  # an empty array maps nothing
        return arrays.check_header(f, directory.path / name, array.shape, array.dtype)


def _same_template(planned: Plan, template: Any) -> bool:
    return (tuple(template[0]), np.dtype(template[1])) == (planned.row_shape, planned.dtype)


def _first_success(values: Sequence[Any], task: RowTask,
                   failures: list[Failure]) -> tuple[int, np.ndarray]:
    """Run rows in order until one succeeds; its shape and dtype fix the array's."""
    for row, value in enumerate(values):
        try:
            return row, as_row(task.row_fn(value))
        except Exception as exc:
            if not task.record_failures or isinstance(exc, NotAnArrayError):
                raise
            failures.append((row, str(value), failure_reason(exc)))
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
