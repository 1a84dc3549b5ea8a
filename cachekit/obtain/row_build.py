"""A per-row entry (``Cache.images``, ``Cache.map``) as the coordinator builds, joins and
opens it: steps 5, 6 and 8 of docs/design.md for entries made row by row.

:class:`RowBuild` holds what the call asked for (the kind, the column, the row function,
the params and key material, the row template) and gives :func:`cachekit.obtain.obtain`
the three things it needs: :meth:`RowBuild.build` (copy the rows that committed entries of
the same recipe hold, fill the rest with the engine, write the row files), :meth:`join`
(fill chunks of another process's build of the key) and :meth:`open` (index a downloaded
entry's rows, check a hit's files for staleness, then open the entry). The donors, the rows
copied from other entries, are found by :mod:`cachekit.obtain.donors`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import _fs, arrays, keys, source_stats
from ..engine.filling.builder import DeadBuilds, Filled, fill as fill_build
from ..engine.filling.claimed import Report, RowRun
from ..engine.filling.cores import Spare, runs_at_once
from ..engine.filling.joiner import Joined, join as join_build
from ..errors import ImageDecodeError
from ..store import STALE, BuildDir, LocalStore, Published
from ..store import manifest as manifests
from ..store.manifest import Origin, RowReuse
from ..store.row_index import RowIndex
from ..messages import say
from ..store.row_source import RowSource, open_row_source
from . import donors, parts, staleness
from .commit import Built, ChunkCallback
from .donors import Rows
from .expected import Expected
from .flow import Outcome

BLOCK_BYTES = 1 << 20
"""Bytes of rows per block digest of ``row_blocks.npy``. Rows are shared by link now, so
no build reads them; the file stays in the format (``verify`` checks it like any other)."""

Template = Optional[tuple[tuple[int, ...], Any]]
"""The row shape and dtype a build makes (None: the first row's)."""


@dataclass(frozen=True)
class BuildSettings:
    """Where and how a build's rows run, as the :class:`cachekit.Cache` was configured."""

    workers: int
    executor: Any
    progress: bool
    """Progress bars."""
    announce: bool
    """One-line notes on stderr (reuse, refused donors)."""


@dataclass(frozen=True)
class RowCall:
    """What a per-row call asked for: the entry's ``kind``, its ``column`` (a pandas
    Series), the ``row_fn`` computing one row, the ``params`` and column ``material`` of
    its key (:func:`cachekit.keys.rows_key`), the row ``template``, ``on_error``, and
    whether the entry must be ``contiguous``."""

    kind: str
    column: Any
    row_fn: Callable[[Any], Any]
    params: dict[str, Any]
    material: dict[str, Any]
    template: Template
    on_error: str
    contiguous: bool = False
    """Store every row in one data file of its own, even rows other entries hold."""

    @property
    def key(self) -> str:
        return keys.rows_key(self.kind, self.params, self.material, len(self.column))


class RowBuild:
    """The build, join and opening of the entry of one per-row call in ``store``.

    ``opener`` makes the caller's value (an :class:`cachekit.Entry`) from an outcome.
    """

    def __init__(self, store: LocalStore, call: RowCall, settings: BuildSettings,
                 opener: Callable[[Outcome], Any]) -> None:
        self.store, self.call, self.settings, self.opener = store, call, settings, opener
        self.key = call.key
        self.record = call.kind == "images" or call.on_error == "zero"
        """Whether a row that raises is recorded as a failure (images always: they say
        which files failed) rather than propagated."""
        self._values: Optional[np.ndarray] = None
        self._healed: Optional[RowSource] = None
        """The entry of the key, opened before it was set aside to be built again."""
        self._aside: Optional[str] = None
        """Its name under ``tmp/`` until the build has linked what it shares of it."""

    @property
    def expected(self) -> Expected:
        shape, dtype = self.call.template or (None, None)
        return Expected(self.call.kind, rows=len(self.call.column), row_shape=shape,
                        dtype=None if dtype is None else np.dtype(dtype).str)

    def values(self) -> np.ndarray:
        """The column's values: only a build or a join needs them, made once."""
        if self._values is None:
            self._values = self.call.column.to_numpy(dtype=object)
        return self._values

    def build(self, current: BuildDir, on_chunk: ChunkCallback) -> Built:
        """Fill ``current`` (step 5): reference the rows that committed entries of the
        recipe hold (:mod:`.parts`), compute the others, then write the row files (and a
        derived entry's row map). Rows that fail under ``on_error="raise"`` make it a
        failed build, whose good rows the commit keeps (:attr:`Built.failure`)."""
        call, settings, values = self.call, self.settings, self.values()
        current.record_cpus(runs_at_once(settings.executor, settings.workers))
        builder = _decoders() if call.kind == "images" else None
        rows = self._rows(builder)
        healed, self._healed = self._healed, None
        try:
            with donors.find(self.store, self.key, rows, call.template, healed) as found:
                if settings.announce:
                    donors.announce(self.key, found, len(values))
                row_files = (manifests.ROW_IDS_FILE,) + (
                    (manifests.ROW_STATS_FILE,) if rows.stats is not None else ())
                held = parts.reference(current.dir, found, len(values), row_files,
                                       link=not call.contiguous)
        finally:
            self._drop_aside()
        with contextlib.closing(held):
            if held.derived and not len(held.todo):  # nothing to decode: no fill at all
                filled = _no_rows(current.dir, found.template)
            else:
                report = Report(on_chunk, settings.progress, f"cachekit {call.kind}",
                                lines=settings.announce and not settings.progress)
                filled = fill_build(current.dir, manifests.DATA_FILE, values, call.row_fn,
                                    rows=self._row_run(call.template or found.template),
                                    resuming=DeadBuilds(current.resume_from,
                                                        current.drop_resumed),
                                    report=report, todo=held.todo if held.derived else None)
            held.own()
            if held.derived and not held.linked:
                if settings.announce and not call.contiguous:
                    say(f"entry {self.key[:12]}: the files of the rows it shares cannot be "
                        "linked here (another filesystem or another user's files); copied "
                        "its rows into one file instead")
                held.materialize(current.dir)
        failure = None
        if filled.failures and call.on_error == "raise":
            failure = ImageDecodeError(filled.failures, len(values), os.getcwd())
            if len(filled.failures) == len(values):
                raise failure  # nothing decoded: nothing to keep
        extra = _row_files(current.dir, rows, filled, held)
        return Built(
            kind=call.kind, rows=len(values), files=((manifests.DATA_FILE, "numpy"), *extra.files),
            failed_rows=tuple(filled.failures), params=call.params,
            column=call.column.name if isinstance(call.column.name, str) else None,
            builder={**(builder or {}), **_joiners(filled.joined)},
            decode_seconds=filled.decode_seconds, digests=extra.digests,
            durable=extra.linked,
            reuse=extra.reuse, origin=extra.origin,
            committed=lambda published: index_entry(self.store, published, rows.ids),
            failure=failure)

    def join(self, directory: _fs.DirHandle, spare: Optional[Spare]
             ) -> Optional[Joined]:
        """Fill free chunks of another process's live build of the key (step 3)."""
        return join_build(directory, manifests.DATA_FILE, self.values(), self.call.row_fn,
                          rows=self._row_run(), spare=spare)

    def _row_run(self, template: Template = None) -> RowRun:
        return RowRun(self.settings.workers, self.record, template or self.call.template,
                      self.key, self.settings.executor)

    def open(self, outcome: Outcome) -> Any:
        """Open the entry (step 8). A downloaded one is indexed first, so that its rows may
        serve later builds; a hit of images keyed by paths alone samples its files' stats
        (:mod:`cachekit.obtain.staleness`); a derived entry where a contiguous one was asked
        for is built again as one file."""
        if self._healed is not None:  # another process built the key meanwhile
            self._healed.close()
            self._healed = None
            self._drop_aside()
        if outcome.source == "remote":
            index_entry(self.store, outcome.entry)
        call = self.call
        if call.contiguous and not outcome.entry.manifest.contiguous:
            self._build_again(outcome.entry, "its rows are shared with other entries and a "
                              "contiguous entry was asked for; copying them into one file")
            if self.settings.announce:  # (it returns only when it could not set it aside)
                say(f"entry {self.key[:12]}: a contiguous entry was asked for, but this one "
                    "shares its rows and cannot be removed here (another user's, or a "
                    "read-only root); returned as it is")
        checked = (outcome.source == "local" and call.kind == "images"
                   and call.params.get("validate") == "path")
        if checked:
            self._heal_if_stale(outcome.entry)
        opened = self.opener(outcome)
        if checked:
            staleness.check(outcome.entry.path, outcome.entry.manifest, call.column,
                            self._record_stale)
        return opened

    def _record_stale(self, key: str, created: float, rows: list[int]) -> None:
        """Keep what a check found beside the entry (``locks/KEY.stale.json``), so that
        the next call of the column, in any process of this user, heals it."""
        try:
            self.store.write_record(STALE, key, {"created": created, "changed": len(rows)})
        except OSError:
            pass  # a read-only root: said as a warning all the same

    def _heal_if_stale(self, entry: Published) -> None:
        """When a check recorded that files of ``entry`` changed since it was built, build
        it again, decoding only the rows whose files changed (:meth:`_build_again`)."""
        manifest = entry.manifest
        record = self.store.read_record(STALE, self.key)[0]
        if record is None or record.get("created") != manifest.created:
            return
        self._build_again(entry, f"{record.get('changed', 'some')} of its files changed since "
                          "it was built (found by an earlier check); building it again, "
                          "decoding only their rows", forget=STALE)

    def _build_again(self, entry: Published, why: str, forget: Optional[str] = None) -> None:
        """Open the rows of ``entry`` to build from, set it aside, and raise
        FileNotFoundError, so that the call obtains the key again and builds it, sharing
        every row it can with the entry set aside (:func:`.donors.find`'s ``healed``),
        which is removed once the build has linked its files. Returns when another process
        did so first, or this one may not remove it. ``forget``: the record to drop."""
        if entry.manifest.reuse is None:
            return
        source = open_row_source(self.store, self.key, entry.manifest.reuse.recipe)
        try:
            aside = self.store.set_aside(self.key) if self.store.still_published(entry) \
                else None
        except OSError:
            aside = None
        if not aside:
            if source is not None:
                source.close()
            return
        if forget is not None:
            self.store.forget_record(forget, self.key)
        self._healed, self._aside = source, aside
        if self.settings.announce:
            say(f"entry {self.key[:12]}: {why}")
        raise FileNotFoundError(errno.ENOENT, "removed to be built again", str(entry.path))

    def _drop_aside(self) -> None:
        """Remove the entry set aside to be built again (its files live on where linked)."""
        if self._aside is not None:
            aside, self._aside = self._aside, None
            try:
                self.store.remove_temp(aside, self.key)
            except OSError:
                pass  # an interrupted removal: `cachekit clear` finishes it

    def _rows(self, builder: Optional[dict[str, Any]]) -> Rows:
        """The build's recipe and each row's identity under it, plus for images each file's
        stat now (unless the key already took it).

        The recipe (:func:`cachekit.keys.reuse_recipe`) leaves out ``on_error`` and
        ``validate``, so entries built with others lend their good rows; what ``validate``
        asks of a file is checked row by row instead (:class:`Rows`)."""
        call = self.call
        ids, dtype = keys.row_identities(call.column, material=call.material.get("column"))
        recipe = keys.reuse_recipe(call.kind, call.params, dtype, builder)
        if call.kind != "images":
            return Rows(recipe, ids)
        if "content" in call.material:  # what proves a row's file unchanged: its digest
            proof, _ = keys.row_identities(call.column, [call.material["content"]])
            ids = np.concatenate([ids, proof], axis=1)
        stats = call.material.get("stat")
        if stats is None:  # (URL rows: from the store's listings, cachekit.source_stats)
            stats = source_stats.stat_signature(
                self.values(), getattr(call.row_fn, "storage_options", None),
                getattr(call.row_fn, "fetch", None))
        return Rows(recipe, ids, stats, same_stat="content" not in call.material)


@dataclass(frozen=True)
class _RowFiles:
    """What a per-row build adds to its manifest: the row files and parts (name, leaf
    kind), the checksums known without reading the files again (the data file's, computed
    with its block digests; each part's, its donor's), how its rows may be reused, and
    where they came from."""

    files: tuple[tuple[str, str], ...]
    digests: dict[str, str]
    reuse: RowReuse
    origin: Origin
    linked: frozenset[str] = frozenset()
    """The parts: links to files of committed entries."""


def _row_files(directory: _fs.DirHandle, rows: Rows, filled: Filled,
               held: parts.Parts) -> _RowFiles:
    """Write the row identities, the data's block digests, (images) the file stats and (a
    derived entry) the row map into the build directory next to its data file."""
    shape, dtype = filled.shape, np.dtype(filled.dtype)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    block_rows = max(1, BLOCK_BYTES // max(1, row_bytes))
    whole, blocks = arrays.block_checksums(directory, manifests.DATA_FILE, block_rows)
    own = held.own_rows if held.derived else slice(None)  # they describe data.npy's rows
    arrays.write_small(directory, manifests.ROW_IDS_FILE, np.ascontiguousarray(rows.ids[own]))
    arrays.write_small(directory, manifests.ROW_BLOCKS_FILE, blocks)
    files = [(manifests.ROW_IDS_FILE, "numpy"), (manifests.ROW_BLOCKS_FILE, "numpy")]
    digests = {manifests.DATA_FILE: whole}
    linked: frozenset[str] = frozenset()
    if rows.stats is not None:
        arrays.write_small(directory, manifests.ROW_STATS_FILE,
                           np.ascontiguousarray(rows.stats[own], dtype="<i8"))
        files.append((manifests.ROW_STATS_FILE, "numpy"))
    if held.derived:
        arrays.write_small(directory, manifests.ROW_MAP_FILE, held.row_map())
        files.append((manifests.ROW_MAP_FILE, "numpy"))
        shared = {**dict(zip(held.names, held.records)), **held.sidecars}
        files += [(name, "numpy") for name in sorted(shared)]
        digests.update((name, record.checksum) for name, record in shared.items())
        linked = frozenset(shared)
    reused = sorted(((k, n) for k, n in held.shared.items() if n), key=lambda kn: -kn[1])
    origin = Origin(tuple(reused), filled.decoded, filled.resumed + filled.rows_joined)
    return _RowFiles(tuple(files), digests, RowReuse(rows.recipe, block_rows), origin, linked)


def _no_rows(directory: _fs.DirHandle, template: Any) -> Filled:
    """An empty own data file: every row of the build is another entry's."""
    shape, dtype = (0, *template[0]), np.dtype(template[1])
    arrays.write_small(directory, manifests.DATA_FILE, np.zeros(shape, dtype))
    return Filled(shape=shape, dtype=dtype)


def index_entry(store: LocalStore, published: Published, ids: Optional[np.ndarray] = None
                ) -> None:
    """Put the committed entry ``published`` into the row index (step 6, best effort), with
    its row identities ``ids`` (None: read from the entry, checked)."""
    manifest = published.manifest
    if manifest.reuse is None:
        return
    if ids is None:
        source = open_row_source(store, manifest.key, manifest.reuse.recipe)
        if source is None:
            return
        with source:
            ids = source.ids
            failed = source.failed
    else:
        failed = manifest.failed()
    RowIndex(store).add(manifest.reuse.recipe, manifest.key, ids[:, 0], skip=failed)


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
