"""Starting a fill from the verified done chunks of dead builds (:func:`resume`).

A dead build's directory is claimed by the caller and read only: its plan must be one of
this very fill (:func:`plan_fits`: the caller's key, row count and row template) before
anything it sizes is read or allocated, its data file must match its plan, and each done
chunk is copied into a new file of the resuming build only where its bytes match the
checksum of its done record. Nothing in a dead build is ever written.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from ... import _fs, arrays
from .copying import open_checked, read_chunk
from .journal import Journal
from .plan import Plan


def plan_fits(planned: Plan, n: int, template: Any, key: str) -> bool:
    """Whether a plan read from a build directory is one of this very fill: the caller's
    key, row count and (when known) row template, checked before anything it sizes is
    read or allocated."""
    return (planned.key == key and planned.rows == n
            and (template is None or (tuple(template[0]), np.dtype(template[1]))
                 == (planned.row_shape, planned.dtype)))


def resume(directory: _fs.DirHandle, name: str, n: int, sources: Sequence[_fs.DirHandle],
           template: Any, key: str,
           before_plan: Optional[Callable[[Journal], None]] = None
           ) -> Optional[tuple[Journal, np.ndarray, int]]:
    """Start a fill of ``name`` from the verified done chunks of the partial fills of
    ``name`` in ``sources``: (journal, writable array, rows copied), or None when no
    source has a usable plan. The first source whose plan fits (:func:`plan_fits`) and
    whose layout this host makes alike gives the plan; sources of another plan are
    skipped. ``before_plan(journal)`` runs just before the plan is written, which is last
    (from then on the build may be joined)."""
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
        if before_plan is not None:
            before_plan(journal)
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
