"""The chunk journal of one build: its plan, who holds which chunk, and which chunks are done.

It lives in the folder ``NAME.chunks/`` next to the data file ``NAME`` in the build
directory, and every record in it is created once and never rewritten (``O_EXCL``), so it
needs no lock and means the same on every host of a shared root::

    plan.json       the plan (rows, row shape, dtype, chunk rows, data offset); written
                    by the builder last, once the data file exists: from then on the build
                    can be joined
    claim.C.G       chunk C is being filled by the owner (host, pid) inside; G counts the
                    claims of C (the highest is the current one). Its mtime is the owner's
                    heartbeat (cachekit.liveness): when it is older than the lease, or the
                    owner is a gone process of this host, anyone may claim C again as G+1.
                    The owner removes it once C is done, or when it gives C up
    done.C          chunk C's rows are on disk (flushed before this was written), their
                    checksum, the file that holds them, and which rows of it failed:
                    written once, by whoever finished C first
    rows.HOST.PID.UUID
                    a joiner's own rows file (a sparse .npy of the plan's layout): a joiner
                    computes into it, never into the builder's data file
    seat.cpu.C, seat.idle.I
                    a core a joiner of the builder's host uses, held while it joins
                    (cachekit.engine.filling.cores)

A build can be joined while its journal is in its build directory. The commit first moves
the journal out (to the trash), then deletes it record by record; so a process that claimed
a chunk checks that the chunk is not done and then, in that order, that the journal is still
in place: a done record the commit deleted is never taken for a chunk left to fill.

Only the builder writes its data file. A chunk a joiner finished is in the joiner's rows
file until the builder copies it in, checking its checksum; a resumed build copies the
verified done chunks of a dead one into a file of its own. So no file that is published is
ever writable by a process that may still be alive (a joiner or builder paused past its
lease). A process only ever writes the records it creates, through a handle on this
folder, and never by a path that another process could swap.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from ... import _fs, arrays, checksums, file_modes, liveness, processes, small_json
from ...errors import BuildGone, Failure
from .plan import Chunk, Plan

SUFFIX = ".chunks"
PLAN_FILE = "plan.json"
ROWS_PREFIX = "rows."
_RECORD_LIMIT = 64 << 20
_GONE = (errno.ENOENT, errno.ESTALE)


def journal_name(name: str) -> str:
    """The journal folder of the data file ``name``."""
    return name + SUFFIX


def is_journal_name(name: str) -> bool:
    """Whether ``name`` in a build directory is the engine's working state, never
    published: a chunk journal folder."""
    return name.endswith(SUFFIX)


def digest(data: Any) -> str:
    """The checksum of a chunk's bytes (any C-contiguous buffer) in its done record."""
    return arrays.checksum_of_bytes(data)


@dataclass(frozen=True)
class Done:
    """A done record: the chunk's failed rows, the checksum of its bytes, and the rows file
    of the joiner that holds them (None: the build's own data file)."""

    failures: list[Failure]
    digest: str
    file: Optional[str] = None


class Claim:
    """A chunk this process holds: the open claim file, its heartbeat beating."""

    def __init__(self, journal: "Journal", chunk: Chunk, name: str, fd: int) -> None:
        self.journal, self.chunk, self.name, self._fd = journal, chunk, name, fd
        self._heartbeat = liveness.Heartbeat(liveness.touch(fd)).start()

    def finish(self, failures: list[Failure], checksum: str,
               file: Optional[str] = None) -> bool:
        """Record the chunk done (its rows must already be flushed, ``checksum`` theirs, in
        ``file``: None for the build's data file), then drop the claim; False when another
        process recorded it first. BuildGone when the build was committed, discarded or
        taken over meanwhile (its journal folder is gone)."""
        try:
            return self.journal.mark_done(self.chunk, failures, checksum, file)
        finally:
            self.release()

    def release(self) -> None:
        """Give the chunk up unfinished, so that another process claims it at once."""
        self.stop()
        try:
            self.journal.dir.unlink(self.name)
        except OSError:
            pass  # it then looks dead once the lease runs out

    def stop(self) -> None:
        if self._fd >= 0:
            self._heartbeat.stop()
            os.close(self._fd)
            self._fd = -1


class Journal:
    """The journal folder of one build, open as ``dir``; ``home``, the build directory
    where it is named ``name`` (the caller keeps it open while it uses the journal)."""

    def __init__(self, directory: _fs.DirHandle, home: _fs.DirHandle, name: str) -> None:
        self.dir = directory
        self.home, self.name = home, name
        self.plan: Optional[Plan] = None
        self.marked: set[int] = set()
        """The chunks this process recorded done through this handle."""

    @classmethod
    def create(cls, build_dir: _fs.DirHandle, name: str) -> "Journal":
        build_dir.mkdir(journal_name(name), file_modes.private_dir_mode())
        return cls(build_dir.child(journal_name(name)), build_dir, journal_name(name))

    @classmethod
    def open(cls, build_dir: _fs.DirHandle, name: str) -> "Journal":
        """Open the journal of ``name`` and read its plan. OSError when there is none (or it
        is a symlink or not a folder); ValueError when the plan is unreadable."""
        journal = cls(build_dir.child(journal_name(name)), build_dir, journal_name(name))
        try:
            journal.plan = journal.read_plan()
        except BaseException:
            journal.close()
            raise
        return journal

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # The plan ---------------------------------------------------------------------------

    def write_plan(self, plan: Plan) -> None:
        if not self.dir.publish_new(PLAN_FILE, _dumps(plan.to_json())):
            raise FileExistsError(errno.EEXIST, "a build has one plan", str(self.dir.path))
        self.plan = plan

    def read_plan(self) -> Plan:
        return Plan.from_json(self._read(PLAN_FILE))

    # Claims -----------------------------------------------------------------------------

    def claim(self, chunk: Chunk, generation: int = 0) -> Optional[Claim]:
        """Create ``claim.C.G``; None when another process made it first. BuildGone when
        the journal folder is gone (committed, discarded or taken over meanwhile)."""
        name = f"claim.{chunk.index}.{generation}"
        try:
            fd = self.dir.create(name)
        except FileExistsError:
            return None
        except OSError as e:
            if e.errno in _GONE:
                raise BuildGone(str(self.dir.path)) from e
            raise
        try:
            data = _dumps(processes.owner())
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            self.dir.unlink(name)
            raise
        return Claim(self, chunk, name, fd)

    def claimable(self, chunks: Iterable[Chunk]) -> Iterator[Claim]:
        """Claim each chunk of ``chunks`` that is neither done nor held by a live claim, in
        order, as the caller pulls them (so a slow caller leaves chunks to others).
        BuildGone once the journal is no longer in its build directory (committed)."""
        names = self.dir.names()
        done = {n for n in names if n.startswith("done.")}
        newest = _newest_claims(names)
        for chunk in chunks:
            if f"done.{chunk.index}" in done:
                continue
            generation = newest.get(chunk.index)
            if generation is None:
                claim = self.claim(chunk)
            elif self._claim_alive(chunk.index, generation) is False:
                claim = self.claim(chunk, generation + 1)
            else:
                continue
            if claim is None:
                continue  # another process claimed it first
            if self.is_done(chunk):  # finished since we listed the folder
                claim.release()
                continue
            if not self.in_place():  # after is_done: see the module's docstring
                claim.release()
                raise BuildGone(str(self.dir.path))
            yield claim

    def in_place(self) -> bool:
        """Whether this journal is still in its build directory: the commit moves it out
        before it deletes its records, so one that is not belongs to a build that is over."""
        try:
            return _fs.same_file(self.home.lstat(self.name), os.fstat(self.dir.fd))
        except FileNotFoundError:
            return False

    def _claim_alive(self, index: int, generation: int) -> Optional[bool]:
        """Whether claim ``generation`` of chunk ``index`` is alive; None when it is gone."""
        name = f"claim.{index}.{generation}"
        try:
            beat = self.dir.lstat(name).st_mtime
            owner = self._read(name)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            owner = None  # being written right now, or damaged: judged by its heartbeat
        return liveness.is_alive(owner if isinstance(owner, dict) else None, beat)

    def pending(self) -> tuple[list[int], list[int]]:
        """(chunks not done that a live claim holds, chunks not done that none holds)."""
        names = self.dir.names()
        newest = _newest_claims(names)
        held, free = [], []
        for chunk in self.plan.chunks:
            if f"done.{chunk.index}" in names:
                continue
            generation = newest.get(chunk.index)
            alive = generation is not None and self._claim_alive(chunk.index, generation)
            (held if alive else free).append(chunk.index)
        return held, free

    # Done records -----------------------------------------------------------------------

    def mark_done(self, chunk: Chunk, failures: list[Failure], checksum: str,
                  file: Optional[str] = None) -> bool:
        """Create ``done.C``; False when it exists. BuildGone when the folder is gone."""
        record = {"chunk": chunk.index, "start": chunk.start, "stop": chunk.stop,
                  "failures": [list(f) for f in failures], "digest": checksum,
                  "file": file, "by": processes.owner()}
        try:
            made = self.dir.publish_new(f"done.{chunk.index}", _dumps(record))
        except OSError as e:
            if e.errno in _GONE:
                raise BuildGone(str(self.dir.path)) from e
            raise
        if made:
            self.marked.add(chunk.index)
        return made

    def drop_done(self, chunk: Chunk) -> None:
        """Remove ``done.C`` (its bytes failed their check), so that C is filled again."""
        self.dir.unlink(f"done.{chunk.index}")

    def is_done(self, chunk: Chunk) -> bool:
        try:
            self.dir.lstat(f"done.{chunk.index}")
        except FileNotFoundError:
            return False
        return True

    def done_indices(self) -> list[int]:
        """The indices of the done chunks (by their names; see :meth:`done` for contents)."""
        count = len(self.plan.chunks)
        out = []
        for name in self.dir.names():
            if name.startswith("done.") and name[5:].isdigit() and int(name[5:]) < count:
                out.append(int(name[5:]))
        return sorted(out)

    def done(self, *, drop_bad: bool = True, only: Optional[Iterable[int]] = None
             ) -> dict[int, Done]:
        """chunk index -> the record of that done chunk (of the chunks ``only``, if given).
        A done record that cannot be read or does not match the plan counts as not done;
        with ``drop_bad`` (the builder, whose build this is) it is removed, so that the
        chunk is filled again."""
        chunks = self.plan.chunks
        wanted = None if only is None else set(only)
        out: dict[int, Done] = {}
        for index in self.done_indices():
            if wanted is not None and index not in wanted:
                continue
            try:
                out[index] = _done_record(self._read(f"done.{index}"), chunks[index])
            except (OSError, ValueError):
                if drop_bad:
                    self.dir.unlink(f"done.{index}")
        return out

    def rows_done(self) -> int:
        chunks = self.plan.chunks
        return sum(chunks[i].rows for i in self.done_indices())

    def _read(self, name: str) -> Any:
        return small_json.load(self.dir.read_file(name, _RECORD_LIMIT - 1))


def _newest_claims(names: list[str]) -> dict[int, int]:
    """chunk index -> the highest generation of its claims, from a listing."""
    newest: dict[int, int] = {}
    for name in names:
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "claim" and parts[1].isdigit() and parts[2].isdigit():
            index, generation = int(parts[1]), int(parts[2])
            newest[index] = max(generation, newest.get(index, -1))
    return newest


def is_rows_file(name: str) -> bool:
    """Whether ``name`` is a joiner's rows file (in a journal folder)."""
    return name.startswith(ROWS_PREFIX) and "/" not in name and name not in (".", "..")


def rows_file_owner(name: str) -> Optional[tuple[str, int]]:
    """(host, pid) of the joiner that made the rows file ``name`` (``rows.HOST.PID.UUID``,
    the host may hold dots); None for a name not made that way."""
    host, _, rest = name[len(ROWS_PREFIX):].rpartition(".")[0].rpartition(".")
    if not (is_rows_file(name) and host and rest.isdigit()):
        return None
    return host, int(rest)


def _done_record(raw: Any, chunk: Chunk) -> Done:
    if not (isinstance(raw, dict) and raw.get("chunk") == chunk.index
            and raw.get("start") == chunk.start and raw.get("stop") == chunk.stop
            and isinstance(raw.get("failures"), list)
            and isinstance(raw.get("digest"), str)
            and raw["digest"].startswith(checksums.CHECKSUM_PREFIX)):
        raise ValueError("a done record that does not match the plan")
    file = raw.get("file")
    if not (file is None or (isinstance(file, str) and is_rows_file(file))):
        raise ValueError("a done record naming a file that is not a rows file")
    return Done(_failures(raw, chunk), raw["digest"], file)


def _failures(raw: dict[str, Any], chunk: Chunk) -> list[Failure]:
    out = []
    for item in raw["failures"]:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int)
                and not isinstance(item[0], bool) and chunk.start <= item[0] < chunk.stop
                and isinstance(item[1], str) and isinstance(item[2], str)):
            raise ValueError("a malformed failure in a done record")
        out.append((item[0], item[1], item[2]))
    return out


def _dumps(value: Any) -> bytes:
    return (json.dumps(value, sort_keys=True) + "\n").encode()
