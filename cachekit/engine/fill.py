"""Fill a .npy memmap from a per-row function, chunk by chunk, with any number of processes.

A fill follows a :class:`~cachekit.engine.plan.Plan` (rows, row shape and dtype, page-aligned
chunks) and keeps a chunk journal next to the data file (:mod:`cachekit.engine.journal`). Chunks
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
failures.

Only the builder writes its data file. A joiner computes into a rows file of its own in the
journal folder; the builder copies each chunk a joiner finished into its data file once the
bytes match the checksum in the chunk's done record, and fills the chunk again when they do
not. A resumed build copies the verified done chunks of dead builds (``resume_from``, build
directories the caller claimed) into a file of its own, after checking their plan against
its own key, rows and row template; it never writes into another build's files. So a builder
or joiner that wakes after a pause longer than its lease writes only into files nobody
publishes, and stops (:class:`~cachekit.engine.journal.BuildGone`) once its build is gone.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from .. import _fs, arrays
from . import plan as plans
from .executors import RowTask, make_runner
from ..errors import Failure, NotAnArrayError, failure_reason
from ..errors import BuildGone
from .journal import ROWS_PREFIX, Claim, Done, Journal, digest, journal_name
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
    resumed: int = 0
    """Rows copied from the verified done chunks of dead builds."""


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
    resume_from: Sequence[_fs.DirHandle] = (),
    done_with_sources: Callable[[], None] | None = None,
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

    ``resume_from``: build directories of dead builds of this user that the caller claimed.
    Those whose plan has this ``key``, this row count and ``template`` (if given) give
    their done chunks, copied only where the bytes match the chunk's checksum; the other
    chunks are computed. The caller vouches that the directories are its own (publish.py
    checks their owner and cachekit version). ``done_with_sources()`` is called once
    nothing more is read from them (the caller may then delete them).
    """
    n = len(values)
    task = RowTask(row_fn, record)
    runner = make_runner(executor, workers, task, rows=n)  # first: it refuses what cannot run
    try:
        directory.remove_tree(journal_name(name))
        directory.unlink(name)
        resumed = _resume(directory, name, n, resume_from, template, key)
        if done_with_sources is not None:
            done_with_sources()
        head: Optional[tuple[Claim, Chunk, list[Failure]]] = None
        if resumed is None:
            journal, array, head = _start(directory, name, values, task, template, key,
                                          workers)
            copied = 0
        else:
            journal, array, copied = resumed
        bar = _progress_bar(n, progress, description)
        try:
            with journal:
                done = _fill_all(journal, array, values, lambda: runner, head, on_chunk, bar)
                failures = sorted(f for chunk in done.values() for f in chunk.failures)
        finally:
            bar.close()
    finally:
        runner.close()
    return Filled(shape=array.shape, dtype=array.dtype, failures=failures, resumed=copied)


def join(directory: _fs.DirHandle, name: str, values: Sequence[Any], row_fn: RowFunction, *,
         workers: int, record: bool, template: tuple[tuple[int, ...], np.dtype] | None,
         key: str, executor: Any = None) -> Optional[Joined]:
    """Fill chunks that nobody holds of another process's build in ``directory`` (opened
    by handle, and of this user), until none is left; None when it cannot be joined (no
    plan yet, or a plan of other rows). Writes only claims, done records and a rows file
    of its own in the build's journal folder: never the builder's data file.

    Returns as soon as no chunk is free: the builder waits for the claims it leaves, copies
    the rows in and commits. If the build is committed, discarded or taken over meanwhile,
    stops and says what it did.
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
        if not _plan_fits(planned, len(values), template, key) or planned.rows == 0:
            return None
        try:
            rows_file = _RowsFile.create(journal, planned)
        except (OSError, ValueError):
            return None
        runner = _LazyRunner(executor, workers, RowTask(row_fn, record), len(values))
        filled = rows = 0
        try:
            for chunk in _run_claimed(journal, rows_file.array, values, runner,
                                      rows_file=rows_file):
                filled, rows = filled + 1, rows + chunk.rows
        except BuildGone:
            pass  # published, failed or taken over meanwhile: the caller looks again
        finally:
            runner.close()
            rows_file.close()
        return Joined(filled, rows, len(planned.chunks))


class _RowsFile:
    """A joiner's own rows file: a sparse .npy of the plan's layout in the journal folder,
    whose blocks are reserved chunk by chunk as the joiner claims them (a full disk then
    fails the claim with ENOSPC, never a page write with SIGBUS)."""

    def __init__(self, name: str, fd: int, array: np.ndarray) -> None:
        self.name, self.fd, self.array = name, fd, array

    @classmethod
    def create(cls, journal: Journal, planned: Plan) -> "_RowsFile":
        name = f"{ROWS_PREFIX}{_fs.unique_suffix()}"
        array = arrays.create_array(journal.dir, name, planned.shape, planned.dtype,
                                    align=planned.page, reserve=False)
        try:
            if _data_offset(array, journal.dir, name) != planned.offset:
                raise ValueError("a rows file whose layout differs from the plan's")
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
                journal.mark_done(chunk, [f for f in failures if chunk.start <= f[0] < chunk.stop],
                                  digest(array[chunk.start:chunk.stop]))
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
              bar: Any) -> dict[int, Done]:
    """Fill chunks until every chunk is done and its rows are in ``array``, computed here
    or copied in from the rows files of joiners; return every chunk's done record (read
    once at the end)."""
    total = len(array)
    shown = journal.rows_done()
    bar.update(shown)
    held_here = journal.marked  # done by us: computed here, or put here by _start or a resume
    joined = _JoinedRows(journal, array)

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
            for _ in _run_claimed(journal, array, values, runner, head):
                report()
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

    def __init__(self, journal: Journal, array: np.ndarray) -> None:
        self.journal, self.array = journal, array
        self.files: dict[str, Optional[Any]] = {}

    def copy_in(self, held_here: set[int]) -> None:
        """Copy in every done chunk not yet in ``held_here``, adding it there."""
        if len(held_here) == len(self.journal.plan.chunks):
            return
        planned = self.journal.plan
        waiting = [c.index for c in planned.chunks if c.index not in held_here]
        for index, record in self.journal.done(only=waiting).items():
            chunk = planned.chunks[index]
            source = self._open(record.file)
            if source is not None and copy_chunk(source, planned, chunk, record, self.array):
                held_here.add(index)
            else:
                self.journal.drop_done(chunk)

    def _open(self, name: Optional[str]) -> Optional[Any]:
        if name is None:
            return None  # "in the builder's data file", yet not put there by this builder
        if name not in self.files:
            self.files[name] = _open_rows_file(self.journal.dir, name, self.journal.plan)
        return self.files[name]

    def close(self) -> None:
        for f in self.files.values():
            if f is not None:
                f.close()
        self.files.clear()


def _open_rows_file(directory: _fs.DirHandle, name: str, planned: Plan) -> Optional[Any]:
    """Open a rows file (a joiner's, or a dead build's data file) of ``directory`` to copy
    from: a regular file of this user whose header and size are the plan's; else None."""
    try:
        f = directory.open_file(name)
    except OSError:
        return None
    try:
        if os.fstat(f.fileno()).st_uid != os.geteuid():
            raise ValueError("another user's file")
        if arrays.check_header(f, directory.path / name, planned.shape,
                               planned.dtype) != planned.offset:
            raise ValueError("a file whose layout differs from the plan's")
    except (OSError, ValueError):
        f.close()
        return None
    return f


def copy_chunk(source: Any, planned: Plan, chunk: Chunk, record: Done,
               out: np.ndarray) -> bool:
    """Copy the bytes of ``chunk`` from the open file ``source`` (laid out as ``planned``)
    into ``out`` and flush them, if they match ``record``'s checksum; False otherwise.

    The bytes are read once into memory, checked there and written from there: a process
    that still writes into ``source`` cannot change what is copied after the check."""
    first, end = planned.byte_range(chunk)
    try:
        data = os.pread(source.fileno(), end - first, first)
    except OSError:
        return False
    if len(data) != end - first or digest(data) != record.digest:
        return False
    out[chunk.start:chunk.stop] = np.frombuffer(data, planned.dtype).reshape(
        (chunk.rows, *planned.row_shape))
    arrays.flush_bytes(out, first, end)
    return True


def _run_claimed(journal: Journal, array: np.ndarray, values: Sequence[Any],
                 runner: Callable[[], Any], head: Any = None,
                 rows_file: Optional[_RowsFile] = None) -> Iterator[Chunk]:
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


def _resume(directory: _fs.DirHandle, name: str, n: int, sources: Sequence[_fs.DirHandle],
            template: Any, key: str) -> Optional[tuple[Journal, np.ndarray, int]]:
    """Start a fill of ``name`` from the verified done chunks of the partial fills of
    ``name`` in ``sources``: (journal, writable array, rows copied), or None when no
    source has a usable plan. The first source whose plan fits (``_plan_fits``) gives the
    plan; sources of another plan are skipped. The plan is written last (from then on the
    build may be joined)."""
    journal: Optional[Journal] = None
    array: Any = None
    copied = 0
    try:
        for source in sources:
            try:
                dead = Journal.open(source, name)
            except (OSError, ValueError):
                continue
            with dead:
                planned = dead.plan
                if not _plan_fits(planned, n, template, key) or planned.rows == 0:
                    continue
                data = _open_rows_file(source, name, planned)
                if data is None:
                    continue  # its data file disagrees with its plan: trust neither
                data.close()
                if journal is None:
                    array = arrays.create_array(directory, name, planned.shape, planned.dtype,
                                                align=planned.page)
                    if _data_offset(array, directory, name) != planned.offset:
                        del array
                        directory.unlink(name)
                        continue
                    journal = Journal.create(directory, name)
                    journal.plan = planned
                elif planned != journal.plan:
                    continue
                copied += _copy_done(dead, source, name, journal, array)
        if journal is None:
            return None
        journal.write_plan(journal.plan)
    except BaseException:
        if journal is not None:
            journal.close()
        raise
    return journal, array, copied


def _copy_done(dead: Journal, source: _fs.DirHandle, name: str, journal: Journal,
               out: np.ndarray) -> int:
    """Copy the done chunks of the dead fill ``dead`` that ``journal`` lacks into ``out``,
    each from the dead build's data file or the joiner's rows file its record names, where
    the bytes match its checksum, and record them done; the rows copied."""
    planned = journal.plan
    files = {None: _open_rows_file(source, name, planned)}
    copied = 0
    try:
        have = set(journal.done_indices())
        for index, record in dead.done(drop_bad=False).items():
            if index in have:
                continue
            if record.file is not None and record.file not in files:
                files[record.file] = _open_rows_file(dead.dir, record.file, planned)
            chunk = planned.chunks[index]
            for f in (files[None], files.get(record.file)):
                if f is not None and copy_chunk(f, planned, chunk, record, out):
                    journal.mark_done(chunk, record.failures, record.digest)
                    copied += chunk.rows
                    break
    finally:
        for f in files.values():
            if f is not None:
                f.close()
    return copied


def _plan_fits(planned: Plan, n: int, template: Any, key: str) -> bool:
    """Whether a plan read from a build directory is one of this very fill: the caller's
    key, row count and (when known) row template, checked before anything it sizes is
    read or allocated."""
    return (planned.key == key and planned.rows == n
            and (template is None or _same_template(planned, template)))


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
