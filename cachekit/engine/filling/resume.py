"""What a partly filled data file holds (:func:`read_progress`), and starting a fill from the
verified done chunks of dead builds (:func:`resume`), or taking their verified rows into a
build that copies rows (:func:`copy_dead_rows`).

A dead build's directory is claimed by the caller and read only: its plan must be one of
this very fill (:func:`plan_fits`: the caller's key, row count and row template) before
anything it sizes is read or allocated, its data file must match its plan, and each done
chunk is copied into a new file of the resuming build only where its bytes match the
checksum of its done record. Nothing in a dead build is ever written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from ...errors import Failure
from .copying import open_checked, read_chunk
from .journal import Journal
from .plan import Plan
from ...keys import rest_key
from .plan import read_todo, rest_name


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
            data = open_checked(directory, name, journal.plan)
            if data is None:
                return None
            data.close()
            return Progress(journal.plan, tuple(journal.done(drop_bad=False)))
    except (OSError, ValueError, TypeError):
        return None


def plan_fits(planned: Plan, n: int, template: Any, key: str) -> bool:
    """Whether a plan read from a build directory is one of this very fill: the caller's
    key, row count and (when known) row template, checked before anything it sizes is
    read or allocated."""
    return (planned.key == key and planned.rows == n
            and (template is None or (tuple(template[0]), np.dtype(template[1]))
                 == (planned.row_shape, planned.dtype)))


def resume(directory: _fs.DirHandle, name: str, n: int, sources: Sequence[_fs.DirHandle],
           template: Any, key: str) -> Optional[tuple[Journal, np.ndarray, int]]:
    """Start a fill of ``name`` from the verified done chunks of the partial fills of
    ``name`` in ``sources``: (journal, writable array, rows copied), or None when no
    source has a usable plan. The first source whose plan fits (:func:`plan_fits`) and
    whose layout this host makes alike gives the plan; sources of another plan are
    skipped. The plan is written last (from then on the build may be joined)."""
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
                if not plan_fits(planned, n, template, key) or planned.rows == 0:
                    continue
                if journal is not None and planned != journal.plan:
                    continue
                if journal is None and arrays.data_offset(
                        planned.shape, planned.dtype, align=planned.page) != planned.offset:
                    continue  # a layout this host would not make (another page size)
                data = open_checked(source, name, planned)
                if data is None:
                    continue  # its data file disagrees with its plan: trust neither
                with data:
                    if journal is None:
                        array = arrays.create_array(directory, name, planned.shape,
                                                    planned.dtype, align=planned.page)
                        journal = Journal.create(directory, name)
                        journal.plan = planned
                    copied += _copy_done(dead, data, journal, array)
        if journal is None:
            return None
        journal.write_plan(journal.plan)
    except BaseException:
        if journal is not None:
            journal.close()
        raise
    return journal, array, copied


def _copy_done(dead: Journal, data: Any, journal: Journal, out: np.ndarray) -> int:
    """Copy the done chunks of the dead fill ``dead`` that ``journal`` lacks into ``out``,
    each from the dead build's data file (``data``, open and checked) or the joiner's rows
    file its record names, where the bytes match its checksum, and record them done; the
    rows copied."""
    planned = journal.plan
    copied = 0
    with _DoneChunks(dead, data) as chunks:
        for index, record in dead.done(drop_bad=False).items():
            if index in journal.marked:  # copied from an earlier source already
                continue
            chunk = planned.chunks[index]
            rows = chunks.verified(chunk, record)
            if rows is not None:
                out[chunk.start:chunk.stop] = rows
                arrays.flush_bytes(out, *planned.byte_range(chunk))
                journal.mark_done(chunk, record.failures, record.digest)
                copied += chunk.rows
    return copied


class _DoneChunks:
    """The done chunks of a dead fill, read where its records say they are: its data file
    (open and checked) or a joiner's rows file, opened once each."""

    def __init__(self, dead: Journal, data: Any) -> None:
        self.dead, self.data = dead, data
        self.files: dict[str, Any] = {}

    def verified(self, chunk: Any, record: Any) -> Optional[np.ndarray]:
        """The chunk's rows from the first file whose bytes match the record's checksum."""
        candidates = [self.data]
        if record.file is not None:
            if record.file not in self.files:
                self.files[record.file] = open_checked(self.dead.dir, record.file,
                                                       self.dead.plan)
            candidates.append(self.files[record.file])
        for f in candidates:
            rows = None if f is None else read_chunk(f, self.dead.plan, chunk, record)
            if rows is not None:
                return rows
        return None

    def __enter__(self) -> "_DoneChunks":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self.files.values():
            if f is not None:
                f.close()


def has_rest(sources: Sequence[_fs.DirHandle], name: str) -> bool:
    """Whether a dead build of ``sources`` computed the rest of a fill that copied rows."""
    for source in sources:
        try:
            source.lstat(rest_name(name))
            return True
        except OSError:
            continue
    return False


def dead_template(sources: Sequence[_fs.DirHandle], name: str, n: int, key: str
                  ) -> Optional[tuple[tuple[int, ...], np.dtype]]:
    """The row shape and dtype of the first dead fill of ``sources`` that is one of this
    build (its plan's), for a build that does not know them yet; None when there is none."""
    for source in sources:
        for planned, _ in _dead_parts(source, name, n, None, key):
            return planned.row_shape, planned.dtype
    return None


def copy_dead_rows(sources: Sequence[_fs.DirHandle], name: str, n: int, template: Any,
                   key: str, out: np.ndarray, covered: np.ndarray) -> tuple[list[Failure], int]:
    """Copy into ``out`` the rows of every verified done chunk of the dead fills of ``name``
    in ``sources`` (whole fills, and the rests of fills that copied rows), where ``covered``
    is not yet True, and set it True there: (the failures recorded for those rows, in rows
    of ``out``; the rows copied). As :func:`resume`, a fill is read only once its plan is
    one of this build, and a chunk only where its bytes match its checksum."""
    failures: dict[int, Failure] = {}
    copied = 0
    for source in sources:
        for planned, todo in _dead_parts(source, name, n, template, key):
            part = name if todo is None else rest_name(name)
            if planned.offset != arrays.data_offset(planned.shape, planned.dtype,
                                                    align=planned.page):
                continue  # a layout this host would not make (another page size)
            with Journal.open(source, part) as dead:
                copied += _copy_rows(source, part, dead, planned, todo, out, covered, failures)
    return [failures[row] for row in sorted(failures)], copied


def _dead_parts(source: _fs.DirHandle, name: str, n: int, template: Any, key: str):
    """(plan, rows it computes or None for all) of each fill of ``source`` that is one of
    this build: the whole fill of ``name``, or the rest of one that copied rows."""
    for part in (name, rest_name(name)):
        try:
            dead = Journal.open(source, part)
        except (OSError, ValueError):
            continue
        with dead:
            planned = dead.plan
            todo = None if part == name else read_todo(dead.dir, n)
            if part != name and todo is None:
                continue
            fits = (plan_fits(planned, n, template, key) if todo is None else
                    plan_fits(planned, len(todo), template, rest_key(key, todo)))
        if fits and planned.rows:
            yield planned, todo


def _copy_rows(source: _fs.DirHandle, part: str, dead: Journal, planned: Plan,
               todo: Optional[np.ndarray], out: np.ndarray, covered: np.ndarray,
               failures: dict[int, Failure]) -> int:
    data = open_checked(source, part, planned)
    if data is None:
        return 0  # its data file disagrees with its plan: trust neither
    copied = 0
    with data, _DoneChunks(dead, data) as chunks:
        for index, record in dead.done(drop_bad=False).items():
            chunk = planned.chunks[index]
            rows = (np.arange(chunk.start, chunk.stop) if todo is None
                    else todo[chunk.start:chunk.stop])
            if covered[rows].all():
                continue
            got = chunks.verified(chunk, record)
            if got is None:
                continue
            copied += int((~covered[rows]).sum())
            out[rows] = got
            covered[rows] = True
            for row, path, reason in record.failures:
                at = int(rows[row - chunk.start])
                failures[at] = (at, path, reason)
    return copied
