"""Joining another process's build: fill chunks that nobody holds, into a rows file of one's
own in the build's journal folder, never into the builder's data file; the builder copies
each such chunk in once its bytes match their checksum (see :mod:`.builder`). A joiner on
the builder's host joins only with the cores the build leaves free (see :mod:`.cores`). A
build that computes only some rows (a derived entry's new rows) is joined in those rows,
which its journal names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence


from ... import _fs
from ...errors import BuildGone
from ..running.executors import RowTask, make_runner
from .claimed import RowFunction, RowSpec, RowsFile, run_claimed
from .cores import Seats, Spare
from .journal import Journal
from .plan import Plan
from ...keys import rest_key
from .plan import read_todo, take
from .resume import plan_fits


@dataclass(frozen=True)
class Joined:
    """What a joiner did for another process's build: chunks and rows it filled."""

    chunks: int
    rows: int
    total_chunks: int
    no_core: bool = False
    """It did not join: the builder and the other joiners of its host use every core it
    could have added."""


def join(directory: _fs.DirHandle, name: str, values: Sequence[Any], row_fn: RowFunction, *,
         rows: RowSpec, spare: Optional[Spare] = None) -> Optional[Joined]:
    """Fill chunks that nobody holds of another process's build in ``directory`` (opened
    by handle, and of this user), until none is left; None when it cannot be joined (no plan yet, or
    a plan of other rows than ``rows`` makes: its template and key). Writes only claims, done
    records, seats and a rows file of its own in the build's journal folder: never the builder's
    data file.

    ``spare``: the cores this process may add to a build of its own host; it then runs at
    most that many of its ``rows.workers``, one per seat it takes (:class:`~.cores.Seats`), and
    joins not at all (``Joined.no_core``) when the other joiners hold every seat. None: a
    build of another host, joined with all its ``workers``.

    Returns as soon as no chunk is free: the builder waits for the claims it leaves, copies
    the rows in and commits. If the build is committed, discarded or taken over meanwhile,
    stops and says what it did.
    """
    try:
        own = os.fstat(directory.fd)
        if own.st_uid != os.geteuid() or own.st_mode & 0o022:
            return None  # not a private build directory of ours: never write there
    except OSError:
        return None
    try:
        journal = Journal.open(directory, name)
    except (OSError, ValueError):
        return None
    with journal:
        return _join(journal, values, row_fn, rows, spare)


def _join(journal: Journal, values: Sequence[Any], row_fn: RowFunction, rows: RowSpec,
          spare: Optional[Spare]) -> Optional[Joined]:
    """Join the fill whose journal is ``journal``: of every row of the build, or of the
    rows its journal names (``todo.npy``)."""
    planned, template, key, workers = journal.plan, rows.template, rows.key, rows.workers
    whole = planned.rows == len(values)
    if planned.rows == 0 or (whole and not plan_fits(planned, len(values), template, key)):
        return None
    if not journal.pending()[1]:
        return Joined(0, 0, len(planned.chunks))  # nothing free: make no rows file
    if not whole:  # read only when there is work: a joiner looks every few tens of ms
        todo = read_todo(journal.dir, len(values))
        if todo is None:
            return None
        values, key = take(values, todo), rest_key(key, todo)
        if not plan_fits(planned, len(values), template, key):
            return None
    try:
        seats = None if spare is None else Seats.take(journal.dir, spare, workers)
    except OSError:
        return None  # the journal is gone meanwhile: committed, or taken over
    if seats is not None and not seats.names:
        return Joined(0, 0, len(planned.chunks), no_core=True)
    try:
        return _fill(journal, planned, values, RowTask(row_fn, rows.record), rows.executor,
                     workers if seats is None else len(seats.names))
    finally:
        if seats is not None:
            seats.release()


def _fill(journal: Journal, planned: Plan, values: Sequence[Any], task: RowTask,
          executor: Any, workers: int) -> Optional[Joined]:
    """Fill free chunks with ``workers`` rows at once, into a rows file of our own."""
    try:
        rows_file = RowsFile.create(journal, planned)
    except (OSError, ValueError):
        return None
    runner = _RunnerOnFirstChunk(executor, workers, task, len(values))
    filled = rows = 0
    try:
        for chunk in run_claimed(journal, rows_file.array, values, runner,
                                 rows_file=rows_file):
            filled, rows = filled + 1, rows + chunk.rows
    except BuildGone:
        pass  # published, failed or taken over meanwhile: the caller looks again
    finally:
        runner.close()
        rows_file.close()
        if not filled:  # no done record names it
            journal.dir.unlink(rows_file.name)
    return Joined(filled, rows, len(planned.chunks))


class _RunnerOnFirstChunk:
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
