"""Fill a .npy memmap from a per-row function, chunk by chunk, with any number of processes.

A fill follows a :class:`~cachekit.engine.filling.plan.Plan` (rows, row shape and dtype,
page-aligned chunks) and keeps a chunk journal next to the data file
(:mod:`cachekit.engine.filling.journal`). Chunks are computed through a chunk runner
(``make_runner(...).run(chunks, values, out)``), which writes each chunk's rows into the memmap;
once a chunk's rows are flushed to disk (msync of its byte range) a create-only done record names
it, with its failed rows. So the journal holds the set of done chunks, in any order, and a later
fill of the same rows (a resume after a crash, :mod:`.resume`) computes exactly the chunks that are
not done.

Every chunk is claimed before it is computed (a create-only claim record with a
heartbeat), so other processes can fill chunks of the same build at the same time: the
builder (:func:`fill`) and any number of joiners (:mod:`.joiner`), on this host or on other
hosts of a shared root. The builder waits for the chunks that joiners hold, takes over
those of joiners that die, and returns once every chunk is done, with every participant's
failures.

Only the builder writes its data file. A joiner computes into a rows file of its own in the
journal folder; the builder copies each chunk a joiner finished into its data file once the
bytes match the checksum in the chunk's done record (:mod:`.copying`), and fills the chunk
again when they do not. A resumed build copies the verified done chunks of dead builds into
a file of its own; it never writes into another build's files. So a builder or joiner that
wakes after a pause longer than its lease writes only into files nobody publishes, and
stops (:class:`~cachekit.errors.BuildGone`) once its build is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from ...errors import Failure, ImageDecodeError, NotAnArrayError, failure
from ...keys import rest_key
from ..running.executors import RowTask, make_runner
from ..running.rows import as_row
from . import plan as plans
from .claimed import QUIET, ChunkCallback, Report, RowFunction, RowSpec, run_claimed
from .copying import copy_chunk, open_checked
from .journal import Claim, Done, Journal, digest, journal_name, rows_file_owner
from .plan import Chunk, take, write_todo
from .progress import progress
from .resume import resume

POLL_SECONDS = 0.05
"""How often a builder looks at chunks that other processes hold."""


@dataclass
class Filled:
    """What a fill produced: the array's shape and dtype, the rows that failed, and where
    its rows came from."""

    shape: tuple[int, ...]
    dtype: np.dtype
    failures: list[Failure] = field(default_factory=list)
    resumed: int = 0
    """Rows copied from the verified done chunks of dead builds."""
    joined: dict[tuple[str, int], int] = field(default_factory=dict)
    """Rows that joiners computed and this fill copied in, by joiner (host, pid)."""
    decode_seconds: float = 0.0
    """Seconds this process spent computing rows (not waiting for joiners, not copying)."""

    @property
    def rows_joined(self) -> int:
        """Rows that joiners computed, copied in from their rows files."""
        return sum(self.joined.values())

    @property
    def decoded(self) -> int:
        """Rows this process computed."""
        return self.shape[0] - self.resumed - self.rows_joined


@dataclass(frozen=True)
class DeadBuilds:
    """The dead builds a fill may resume: build directories of dead builds of this user
    that the caller claimed (the coordinator checks their owner and cachekit version).
    ``done()`` is called once nothing more is read from them (the caller may then delete
    them)."""

    dead: Sequence[_fs.DirHandle] = ()
    done: Optional[Callable[[], None]] = None

    def release(self) -> None:
        if self.done is not None:
            self.done()


NO_DEAD_BUILDS = DeadBuilds()


def fill(directory: _fs.DirHandle, name: str, values: Sequence[Any], row_fn: RowFunction, *,
         rows: RowSpec, resuming: DeadBuilds = NO_DEAD_BUILDS, report: Report = QUIET,
         todo: Optional[np.ndarray] = None) -> Filled:
    """Write ``row_fn(values[i])`` into row ``i`` of a new .npy file ``name`` of ``directory``.

    ``rows`` says how rows run and what they make (:class:`RowSpec`: the template, failures
    recorded or raised, the build's key, workers and executor). ``report`` is called after
    each chunk and shows the progress bar.

    ``todo`` (ascending rows of ``values``): compute only those, the others being held
    elsewhere (a derived entry's parts); row ``j`` of the file is then ``values[todo[j]]``.
    The journal names them (``todo.npy``) and the fill's key is made from the build's and
    theirs (:func:`cachekit.keys.rest_key`), so joiners fill only those rows and a resume
    takes only a dead fill of the same rows. Failures are reported in rows of ``values``.

    ``resuming``: the dead builds of this user that the caller claimed. Those whose plan
    has this key, this row count and the template (if given) give their done chunks,
    copied only where the bytes match the chunk's checksum.
    """
    if todo is not None:
        values = take(values, todo)
        rows = replace(rows, key=rest_key(rows.key, todo))
    job = _Job(directory, name, values, RowTask(row_fn, rows.record), rows)
    directory.remove_tree(journal_name(name))
    directory.unlink(name)
    n = len(values)
    named = None if todo is None else (lambda journal: write_todo(journal.dir, todo))
    runner = make_runner(rows.executor, rows.workers, job.task, rows=n)  # first: it refuses
    try:                                                                  # what cannot run
        resumed = resume(directory, name, n, resuming.dead, rows.template, rows.key,
                         before_plan=named)
        resuming.release()
        head: Optional[tuple[Claim, Chunk, list[Failure]]] = None
        work = _Work(progress(n, report), report.on_chunk)
        if resumed is None:
            started = time.monotonic()  # without a template, rows run here until one succeeds
            journal, array, head = _start(job, rows.template, before_plan=named)
            work.decode_seconds = time.monotonic() - started
            copied = 0
        else:
            journal, array, copied = resumed
        try:
            with journal:
                done = _fill_all(journal, array, values, lambda: runner, head, work)
                failures = sorted(f for chunk in done.values() for f in chunk.failures)
        finally:
            work.bar.close()
    finally:
        runner.close()
    if todo is not None:
        failures = [(int(todo[row]), path, reason) for row, path, reason in failures]
    return Filled(shape=array.shape, dtype=array.dtype, failures=failures, resumed=copied,
                  joined=work.joined, decode_seconds=round(work.decode_seconds, 3))


@dataclass(frozen=True)
class _Job:
    """One fill: the file it writes, its values and row task, and how its rows run."""

    directory: _fs.DirHandle
    name: str
    values: Sequence[Any]
    task: RowTask
    rows: RowSpec


@dataclass
class _Work:
    """What a fill did here, and what its joiners did for it, tallied as it goes, and where
    it tells so: its progress ``bar`` and ``on_chunk`` (rows done, rows in all)."""

    bar: Any
    on_chunk: Optional[ChunkCallback] = None
    decode_seconds: float = 0.0
    joined: dict[tuple[str, int], int] = field(default_factory=dict)


def _start(job: _Job, template: Any, before_plan: Optional[Callable[[Journal], None]] = None):
    """Create the data file, the journal and the plan of a fresh fill. Without a template,
    rows run in order until one succeeds (its shape and dtype fix the plan's); the chunk
    holding that row stays claimed by us, as (claim, the rest of its rows, its failures)."""
    failures: list[Failure] = []
    first: Optional[tuple[int, np.ndarray]] = None
    values = job.values
    if template is None:
        first = _first_success(values, job.task, failures)
        template = (first[1].shape, first[1].dtype)
    shape, dtype = (len(values), *tuple(template[0])), np.dtype(template[1])
    page = plans.PAGE_BYTES
    array = arrays.create_array(job.directory, job.name, shape, dtype, align=page)
    planned = plans.make_plan(job.rows.key, len(values), tuple(template[0]), dtype,
                              job.rows.workers,
                              offset=arrays.data_offset(shape, dtype, align=page), page=page)
    journal = Journal.create(job.directory, job.name)
    journal.plan = planned
    head = None
    try:
        if first is not None:
            row, result = first
            array[row] = result
            for chunk in planned.chunks[:planned.chunk_of(row).index]:
                journal.mark_done(chunk, [f for f in failures if chunk.start <= f[0] < chunk.stop],
                                  digest(array[chunk.start:chunk.stop]))
            chunk = planned.chunk_of(row)
            claim = journal.claim(chunk)
            head = (claim, Chunk(chunk.index, row + 1, chunk.stop),
                    [f for f in failures if f[0] >= chunk.start])
        if before_plan is not None:
            before_plan(journal)
        journal.write_plan(planned)  # last: from here on other processes may join
    except BaseException:
        if head is not None:
            head[0].stop()
        journal.close()
        raise
    return journal, array, head


def _fill_all(journal: Journal, array: np.ndarray, values: Sequence[Any],
              runner: Callable[[], Any], head: Any, work: _Work) -> dict[int, Done]:
    """Fill chunks until every chunk is done and its rows are in ``array``, computed here
    or copied in from the rows files of joiners; return every chunk's done record (read
    once at the end). ``work`` tallies the seconds spent computing here and the rows each
    joiner computed, and shows the progress."""
    total, bar, on_chunk = len(array), work.bar, work.on_chunk
    shown = journal.rows_done()
    bar.update(shown)
    held_here = journal.marked  # done by us: computed here, or put here by _start or a resume
    joined = _JoinedRows(journal, array, work.joined)

    def report() -> None:
        nonlocal shown
        done = journal.rows_done()
        if done != shown:
            bar.update(done - shown)
            shown = done
            if on_chunk is not None:
                on_chunk(done, total)

    try:
        while True:
            started = time.monotonic()
            for _ in run_claimed(journal, array, values, runner, head):
                report()
            work.decode_seconds += time.monotonic() - started
            head = None
            joined.copy_in(held_here)
            held, free = journal.pending()
            if not held and not free:
                done = journal.done()
                if len(done) == len(journal.plan.chunks) and held_here.issuperset(done):
                    break  # (done() drops unreadable records: those chunks run again)
            elif not free:
                time.sleep(POLL_SECONDS)  # others fill the rest; take over any that die
            report()
    finally:
        joined.close()
    if total == 0 and on_chunk is not None:
        on_chunk(0, 0)
    return done


class _JoinedRows:
    """The builder's side of joining: copy each chunk a joiner recorded done from the
    joiner's rows file into the builder's own data file, if its bytes match the record's
    checksum; otherwise drop the record, so that the chunk is filled again."""

    def __init__(self, journal: Journal, array: np.ndarray,
                 rows_by_joiner: dict[tuple[str, int], int]) -> None:
        self.journal, self.array, self.rows_by_joiner = journal, array, rows_by_joiner
        self.files: dict[str, Optional[Any]] = {}

    def copy_in(self, held_here: set[int]) -> None:
        """Copy in every done chunk not yet in ``held_here``, adding it there, and count its
        rows for the joiner that computed them."""
        if len(held_here) == len(self.journal.plan.chunks):
            return
        planned = self.journal.plan
        waiting = [c.index for c in planned.chunks if c.index not in held_here]
        for index, record in self.journal.done(only=waiting).items():
            chunk = planned.chunks[index]
            source = self._open(record.file)
            if source is not None and copy_chunk(source, planned, chunk, record, self.array):
                held_here.add(index)
                joiner = rows_file_owner(record.file or "")
                if joiner is not None:
                    self.rows_by_joiner[joiner] = self.rows_by_joiner.get(joiner, 0) + chunk.rows
            else:
                self.journal.drop_done(chunk)

    def _open(self, name: Optional[str]) -> Optional[Any]:
        if name is None:
            return None  # "in the builder's data file", yet not put there by this builder
        if name not in self.files:
            self.files[name] = open_checked(self.journal.dir, name, self.journal.plan)
        return self.files[name]

    def close(self) -> None:
        for f in self.files.values():
            if f is not None:
                f.close()
        self.files.clear()


def _first_success(values: Sequence[Any], task: RowTask,
                   failures: list[Failure]) -> tuple[int, np.ndarray]:
    """Run rows in order until one succeeds; its shape and dtype fix the array's."""
    for row, value in enumerate(values):
        try:
            return row, as_row(task.row_fn(value))
        except Exception as exc:
            if not task.record_failures or isinstance(exc, NotAnArrayError):
                raise
            failures.append(failure(row, value, exc))
    raise ImageDecodeError(failures, len(values), fix=(
        "no row succeeded, so no row gives the shape and dtype of the zeros to store: fix "
        "the function or the values"))
