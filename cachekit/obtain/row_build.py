"""The build of a per-row entry (``Cache.images``, ``Cache.map``): steps 5 and 6 of
docs/design.md for entries made row by row.

What the call asked for is its :class:`~cachekit.obtain.row_call.RowCall`. On a miss, its
:class:`~cachekit.obtain.row_request.RowRequest` starts a :class:`RowBuild`, the
:class:`~cachekit.obtain.build.Build` that :func:`cachekit.obtain.obtain` drives:
:meth:`RowBuild.build` (link the rows that committed entries of the same recipe hold,
fill the rest with the engine, write the row files), :meth:`~RowBuild.join` (fill chunks
of another process's build of the key) and :meth:`~RowBuild.committed` (index the entry's
rows). The donors, the entries that hold its rows, are found by
:mod:`cachekit.obtain.donors` and linked in by :mod:`cachekit.obtain.parts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, Optional

import numpy as np

from .. import _fs, keys, source_stats
from ..engine.filling.builder import DeadBuilds, Filled, fill as fill_build
from ..engine.filling.claimed import ChunkCallback, Report, RowSpec
from ..engine.filling.cores import Spare, runs_at_once
from ..engine.filling.joiner import Joined, join as join_build
from ..errors import ImageDecodeError
from ..store import BuildDir, LocalStore, Published
from ..store import manifest as manifests
from ..messages import say, speaking
from ..store.shared_rows import SharedRows, open_shared_rows
from ..units import count
from . import donors, parts, repeats, staleness
from .built import Built
from .donors import Rows
from .row_call import BuildSettings, RowCall, Template
from .row_files import write_row_files

class SetAside:
    """The entry of a key set aside to be built again: its rows, opened before (the build's
    donor), and its name under ``tmp/`` until the build has linked what it shares of it;
    ``stale``: its manifest, when it is built again because files of its rows changed."""

    def __init__(self, store: LocalStore, key: str, source: Optional[SharedRows],
                 name: str, stale: Optional[manifests.Manifest] = None) -> None:
        self.store, self.key, self.source, self.name = store, key, source, name
        self.stale = stale

    def drop(self) -> None:
        """Remove the entry set aside (its files live on where linked); best effort."""
        name, self.name = self.name, ""
        if name:
            try:
                self.store.remove_temp(name, self.key)
            except OSError:
                pass  # an interrupted removal: `cachekit clear` finishes it

    def close(self) -> None:
        """Close its rows and remove it (another process built the key meanwhile)."""
        if self.source is not None:
            self.source.close()
            self.source = None
        self.drop()


class RowBuild:
    """The build of the entry of one per-row call in ``store`` (a :class:`~.build.Build`),
    made on a miss; ``aside``: the key's entry set aside to be built again, if any (its rows
    are shared first)."""

    joinable = True

    def __init__(self, store: LocalStore, call: RowCall, settings: BuildSettings,
                 aside: Optional[SetAside] = None) -> None:
        self.store, self.call, self.settings, self.aside = store, call, settings, aside
        self.replaces = aside is not None
        self.heals = None if aside is None else aside.stale
        self.key = call.key
        self.record = call.kind == "images" or call.on_error == "zero"
        """Whether a row that raises is recorded as a failure (images always: they say
        which files failed) rather than propagated."""
        self._values: Optional[np.ndarray] = None
        self._rows_of_build: Optional[Rows] = None
        self.shared_on_record: Optional[staleness.Recorded] = None
        """Its entry's rows, when the build shared rows on their donors' records
        (:meth:`_donors`): their files are then checked in the background, as a hit's
        are."""
        self._identities: Optional[Rows] = None
        self._checked: Optional[Rows] = None
        """The rows :meth:`computes_nothing` found all held, with their stats."""
        self._found: Optional[donors.Donors] = None
        """Their donors, which :meth:`build` then uses."""

    def values(self) -> np.ndarray:
        """The column's values: only a build or a join needs them, made once."""
        if self._values is None:
            self._values = self.call.column.to_numpy(dtype=object)
        return self._values

    def computes_nothing(self) -> bool:
        """Whether committed entries of the recipe hold every row of the call (found now,
        and kept for :meth:`build`), in files it may all link (:data:`.parts.LINKED_PARTS`),
        and the call asks for no contiguous copy: the build then only links their files and
        writes a row map. No file is stat'ed unless they hold every row: a call that goes on
        to wait for the lock does nothing its builder does again. Rows in more files are
        copied, which may take as long as a build: False, and the donors are kept for this
        call's build, should it make one after the lock."""
        self._drop_found()
        if self.call.contiguous or self.aside is not None:
            return False
        rows = self._row_identities()
        found = donors.find(self.store, self.key, rows, self.call.template)
        if not _holds_all(found, len(rows.ids)):
            found.close()
            return False
        stated = self._stat(rows, on_record=True)
        if stated is not rows:  # (URLs: their stats now, and the donors found again by them)
            found.close()
        rows, found = self._donors(stated, None, found if stated is rows else None)
        if _holds_all(found, len(rows.ids)):
            self._checked, self._found = rows, found
            return found.files <= parts.LINKED_PARTS
        found.close()
        return False

    def release(self) -> None:
        """Let go of what :meth:`build` would have used, had it run: the donors
        :meth:`computes_nothing` found, and the entry set aside (removed)."""
        self._drop_found()
        if self.aside is not None:
            self.aside.close()
            self.aside = None

    def _drop_found(self) -> None:
        if self._found is not None:
            self._found.close()
            self._found = None

    def build(self, current: BuildDir, on_chunk: ChunkCallback) -> Built:
        """Fill ``current`` (step 5): reference the rows that committed entries of the
        recipe hold (:mod:`.parts`), compute the others, then write the row files (and a
        derived entry's row map). Rows that fail under ``on_error="raise"`` make it a
        failed build, whose good rows the commit keeps (:attr:`Built.failure`)."""
        call, settings, values = self.call, self.settings, self.values()
        builder = _decoders() if call.kind == "images" else None
        aside, self.aside = self.aside, None
        healed = None if aside is None else aside.source
        try:
            if self._found is not None and self._checked is not None:
                rows, found, self._found = self._checked, self._found, None
            else:
                rows, found = self._donors(self._stat(self._row_identities(),
                                                      on_record=healed is None), healed)
            with found:
                row_files = (manifests.ROW_IDS_FILE,) + (
                    (manifests.ROW_STATS_FILE,) if rows.stats is not None else ())
                first = repeats.first_rows(rows)
                held = parts.reference(current.dir, found, len(values), row_files,
                                       link=not call.contiguous,
                                       before_writing=lambda rows: self._make_room(found, rows),
                                       first=first,
                                       report=Report(progress=settings.progress,
                                                     description="cachekit copying shared rows"))
                copied = _copied_rows(held, found)
                donors.say_shared(self.key, found, len(values), held.shared, copied)
                if held.copied_files and held.linked:
                    _say_copies(self.key, held)
                repeated = held.repeated
                if len(repeated):
                    repeats.say_repeats(self.key, len(repeated), held)
        finally:
            if aside is not None:
                aside.drop()
        with contextlib.closing(held):
            if held.derived and not len(held.todo):  # nothing to decode: no fill at all
                assert found.template is not None  # (known to the donors of every row)
                shape, dtype = found.template
                filled = Filled(shape=(0, *shape), dtype=np.dtype(dtype))
            else:  # (the cores it runs on, said before its plan lets anyone join it)
                current.record_cpus(runs_at_once(settings.executor, settings.workers))
                report = Report(on_chunk, settings.progress, f"cachekit {call.kind}",
                                lines=speaking() and not settings.progress)
                filled = fill_build(current.dir, manifests.DATA_FILE, values, call.row_fn,
                                    rows=self._row_run(call.template or found.template),
                                    resuming=DeadBuilds(current.resume_from,
                                                        current.drop_resumed),
                                    report=report, todo=held.todo if held.derived else None)
            held.own()
            if held.derived and not held.linked:
                if not call.contiguous:
                    say(f"entry {self.key[:12]}: the files of the rows it shares cannot be "
                        "linked here (another filesystem, another user's files, or a file "
                        "removed meanwhile); copied its rows into one file instead")
                held.materialize(current.dir)
            else:  # (the rows it copied join those it decoded; repeats, unless it links)
                held.compact(current.dir, keep=len(held.names), whole=not held.keeps_repeats)
        failures = repeats.with_repeats(filled.failures, repeated, first)
        failure = None
        if failures and call.on_error == "raise":
            failure = ImageDecodeError(failures, len(values), os.getcwd())
            if len(failures) == len(values):
                raise failure  # nothing decoded: nothing to keep
        extra = write_row_files(current.dir, rows, filled, held, copied, len(repeated))
        return Built(
            kind=call.kind, rows=len(values), files=extra.files,
            failed_rows=tuple(failures), params=call.params,
            column=call.column.name if isinstance(call.column.name, str) else None,
            builder={**(builder or {}), **_joiners(filled.joined)},
            decode_seconds=filled.decode_seconds, digests=extra.digests,
            durable=extra.linked,
            reuse=extra.reuse, origin=extra.origin,
            failure=failure)

    def _make_room(self, found: donors.Donors, written: int) -> None:
        """Under a cache budget, have room made for the ``written`` rows this build writes
        into files of its own (those no donor lends, the rows it copies, or all of them for
        a copy) before it writes them, keeping its donors: the root then stays within the
        budget during the build too, as a disk sized to the budget needs."""
        make_room, template = self.settings.make_room, self.call.template or found.template
        if make_room is not None and template is not None and written > 0:
            shape, dtype = template
            make_room(written * math.prod(shape) * np.dtype(dtype).itemsize,
                      [self.key, *(donor.source.manifest.key for donor in found.donors)])

    def committed(self, published: Published) -> None:
        """Put the entry this build published into the row index (step 6)."""
        rows = self._rows_of_build
        index_entry(self.store, published, None if rows is None else rows.ids)

    def join(self, directory: _fs.DirHandle, spare: Optional[Spare]
             ) -> Optional[Joined]:
        """Fill free chunks of another process's live build of the key (step 3)."""
        return join_build(directory, manifests.DATA_FILE, self.values(), self.call.row_fn,
                          rows=self._row_run(), spare=spare)

    def _row_run(self, template: Template = None) -> RowSpec:
        return RowSpec(self.settings.workers, self.record, template or self.call.template,
                      self.key, self.settings.executor)

    def _donors(self, rows: Rows, healed: Optional[SharedRows],
                found: Optional[donors.Donors] = None) -> tuple[Rows, donors.Donors]:
        """The build's rows, each with its file's stat, and the donors that hold them
        (``found``: found already by ``rows``). Rows without stats yet share on their
        donors' records, checked as a hit checks (:func:`.donors.stats_on_record`): a sample
        now, which when a file changed has every file stat'ed and the donors found again;
        the others in the background after the commit (:attr:`shared_on_record`)."""
        if found is None:
            found = donors.find(self.store, self.key, rows, self.call.template, healed)
        if rows.stats is None and rows.same_stat:
            try:
                stats = donors.stats_on_record(found, self.values())
            except BaseException:
                found.close()
                raise
            if stats is None:
                found.close()
                stats = source_stats.stat_signature(self.values())
                rows = dataclasses.replace(rows, stats=stats)
                found = donors.find(self.store, self.key, rows, self.call.template, healed)
            else:
                rows = dataclasses.replace(rows, stats=stats)
                if found.rows:
                    self.shared_on_record = staleness.Recorded(rows.ids[:, 0], stats)
        self._rows_of_build = rows
        return rows, found

    def _row_identities(self) -> Rows:
        """The build's recipe and each row's identity under it (made once), with the files'
        stats only where the key took them already (``validate="stat"``).

        The recipe (:func:`cachekit.keys.reuse_recipe`) leaves out ``on_error`` and
        ``validate``, so entries built with others lend their good rows; what ``validate``
        asks of a file is checked row by row instead (:class:`Rows`)."""
        if self._identities is not None:
            return self._identities
        call = self.call
        builder = _decoders() if call.kind == "images" else None
        ids, dtype = keys.row_identities(call.column, material=call.material.get("column"))
        recipe = keys.reuse_recipe(call.kind, call.params, dtype, builder)
        if call.kind != "images":
            self._identities = Rows(recipe, ids)
            return self._identities
        if "content" in call.material:  # what proves a row's file unchanged: its digest
            proof, _ = keys.row_identities(call.column, [call.material["content"]])
            ids = np.concatenate([ids, proof], axis=1)
        self._identities = Rows(recipe, ids, call.material.get("stat"),
                                same_stat="content" not in call.material)
        return self._identities

    def _stat(self, rows: Rows, on_record: bool) -> Rows:
        """``rows`` with each image file's stat now, unless taken already, or (with
        ``on_record``, for a column of local paths under ``validate="path"``) left to
        :meth:`_donors`. URL rows' stats come from the store's listings
        (:mod:`cachekit.source_stats`)."""
        call = self.call
        if call.kind != "images" or rows.stats is not None:
            return rows
        if rows.same_stat and on_record and source_stats.plain_paths(self.values()):
            return rows
        stats = source_stats.stat_signature(
            self.values(), getattr(call.row_fn, "storage_options", None),
            getattr(call.row_fn, "fetch", None))
        return dataclasses.replace(rows, stats=stats)


def _copied_rows(held: parts.Parts, found: donors.Donors) -> dict[str, int]:
    """The rows ``held`` copies from each of ``found``'s donors, by key: all it takes when
    its parts are not linked (a contiguous copy), else those it does not link."""
    if not held.linked:
        return dict(held.shared)
    return {donor.source.key: int(np.count_nonzero(held.where[donor.dst, 0] == parts.COPIED))
            for donor in found.donors}


def _say_copies(key: str, held: parts.Parts) -> None:
    """Say that a build copies the rows of some files of other entries into its own file,
    and why, when it links their other files or another user's files are the reason."""
    why = "another user's files are copied, never linked: their owner could change them"
    if not held.names and held.copies_theirs:  # ("copying N rows" was said)
        say(f"entry {key[:12]}: {why}")
        return
    say(f"entry {key[:12]}: its rows are in "
        f"{count(len(held.names) + held.copied_files, 'file')} of other entries; links "
        f"{len(held.names)} of them and copies the rows of the other {held.copied_files} "
        f"into its own file{'; ' + why if held.copies_theirs else ''}")


def _holds_all(found: donors.Donors, rows: int) -> bool:
    return bool(found.donors) and found.rows == rows


def index_entry(store: LocalStore, published: Published, ids: Optional[np.ndarray] = None
                ) -> None:
    """Put the committed entry ``published`` into the row index (step 6, best effort), with
    its row identities ``ids`` (None: read from the entry, checked). An entry that holds no
    row of its own is indexed by a link to its row map: no new file (a file create is the
    slowest step of such a call on a busy disk). One whose only file is a part of its own
    (its rows repeat others) gets an index file, as any entry that decoded rows: a lookup
    reads an index file's sorted hashes, an entry's rows only where no such file has them."""
    manifest = published.manifest
    if manifest.reuse is None:
        return
    origin = manifest.origin
    decoded = origin is not None and origin.decoded + origin.joined > 0
    if manifest.parts_only and not decoded and manifest.failed_count == 0 and \
            store.row_index.link(manifest.reuse.recipe, manifest.key):
        return
    if ids is None:
        source = open_shared_rows(store, manifest.key, manifest.reuse.recipe)
        if source is None:
            return
        with source:
            ids = source.ids
            failed = source.failed
    else:
        failed = manifest.failed()
    store.row_index.add(manifest.reuse.recipe, manifest.key, ids[:, 0], skip=failed)


def _decoders() -> dict[str, Any]:
    from ..engine.decoding.images import decoder_versions

    return {"decoders": decoder_versions()}


def _joiners(rows: dict[tuple[str, int], int]) -> dict[str, Any]:
    """The manifest's record of the processes that joined a build, and the rows each
    computed: ``{"joined": [{"host", "pid", "rows"}, ...]}``; {} when none joined."""
    if not rows:
        return {}
    return {"joined": [{"host": host, "pid": pid, "rows": n}
                       for (host, pid), n in sorted(rows.items())]}
