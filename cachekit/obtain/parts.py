"""A derived entry's parts: the rows a build shares with committed entries of its recipe,
referenced instead of copied.

For the rows that donors hold (:mod:`.donors`), the build hard-links each donor data file
that holds any of them into its own directory, named by its checksum
(:func:`~cachekit.store.manifest.part_name`, so every entry names the same bytes alike),
and records (file, row) in its row map; only the rows no donor holds are decoded, into the
build's own ``data.npy`` (a build that decodes none has none). A linked file is the very
inode the donor's manifest describes (opened through the donor's directory handle, its
size and header checked, linked from the open file), and data files never change once
written: the filesystem counts who uses each, so clearing or pruning any entry never
breaks another.

Only this user's files are linked: a group member's file stays writable by its owner alone,
and a link would let them change this user's entry. Where a file is another user's, or
cannot be linked (another filesystem, a file removed meanwhile), or the caller asks for a
contiguous entry, the rows are copied instead (:meth:`Parts.materialize`), from the files
opened: the entry is then one data file, as a fresh build makes. A build links at most
:data:`LINKED_PARTS` files, copying the rows of the others into its own
(:meth:`Parts.compact`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO, Sequence

import numpy as np

from .. import _fs, arrays
from ..engine.filling.plan import PAGE_BYTES
from ..store.manifest import DATA_FILE, SIDECARS, FileRecord, part_name, sidecar_name
from ..store.shared_rows import SharedRows
from ..store.row_view import RowView, copy_step
from .donors import Donors

LINKED_PARTS = 32
"""The most parts a build links. Each append to a column makes one more data file, and an
entry opens every file it links (with the stats of each, when a hit checks them): past
this, the rows of the parts that hold the fewest of its rows are copied into its own file
(:meth:`Parts.compact`), which the next append links as one part."""
OWN_FILE = "data.npy.own"
"""The build's decoded rows while :meth:`Parts.compact` copies rows into place."""


@dataclass
class Parts:
    """Where each row of a build is: ``where`` (rows, 2) holds (file, row), file 0 being
    the build's own data file and file ``i`` the ``i``-th of ``names`` (-1: decoded by the
    build, placed by :meth:`own`; :meth:`row_map` numbers the files as the manifest lists
    them). ``opened``: each part's donor file, open, and the byte its rows start at;
    ``linked``: whether every part is linked into the build directory; ``shared``: rows
    referenced, by donor key."""

    where: np.ndarray
    names: list[str] = field(default_factory=list)
    records: list[FileRecord] = field(default_factory=list)
    opened: list[tuple[BinaryIO, int]] = field(default_factory=list)
    linked: bool = True
    shared: dict[str, int] = field(default_factory=dict)
    sidecars: dict[str, FileRecord] = field(default_factory=dict)
    """Each part's row files (identities, stats) by their name here, with their record."""

    @property
    def todo(self) -> np.ndarray:
        """The rows the build decodes (no donor holds them), ascending."""
        return np.flatnonzero(self.where[:, 0] < 0)

    @property
    def own_rows(self) -> np.ndarray:
        """The rows of the build's own data file, in its order (after :meth:`own`)."""
        return np.flatnonzero(self.where[:, 0] == 0)

    @property
    def derived(self) -> bool:
        """Whether any row is another entry's."""
        return bool(self.names)

    def own(self) -> None:
        """Number the decoded rows (``todo``) as the rows of the build's own data file, and
        the parts in name order, the order the manifest lists them."""
        todo = self.todo
        self.where[todo, 0] = 0
        self.where[todo, 1] = np.arange(len(todo))
        order = np.argsort(self.names, kind="stable")
        renumber = np.zeros(len(order) + 1, dtype=np.int64)
        renumber[order + 1] = np.arange(1, len(order) + 1)
        self.where[:, 0] = renumber[self.where[:, 0]]
        self.names = [self.names[i] for i in order]
        self.records = [self.records[i] for i in order]
        self.opened = [self.opened[i] for i in order]

    @property
    def has_own(self) -> bool:
        """Whether the build decodes any row (-1 before :meth:`own`, 0 after): only then
        has it a data file of its own."""
        return bool((self.where[:, 0] <= 0).any())

    def row_map(self) -> np.ndarray:
        """The row map as the entry stores it (after :meth:`own`): files numbered as its
        data files are listed, its own first if it has one."""
        where = self.where if self.has_own else self.where - (1, 0)
        return np.ascontiguousarray(where, dtype="<u4")

    def materialize(self, directory: _fs.DirHandle) -> None:
        """Copy every row into a new ``data.npy`` of the build in row order, from its own
        decoded rows and the parts' open files, and unlink the parts it linked: a
        contiguous entry, as a fresh build makes (call after :meth:`own`)."""
        self.compact(directory, keep=0)
        self.linked = True

    def compact(self, directory: _fs.DirHandle, keep: int) -> None:
        """Keep at most ``keep`` parts, and copy the rows of the others, with the rows the
        build decoded, into a new ``data.npy`` of the build in row order; unlink the parts
        it drops and close their files (call after :meth:`own`). Nothing to do when it
        has ``keep`` parts or fewer.

        Which parts it keeps: :func:`parts_to_keep`."""
        if len(self.names) <= keep:
            return
        held = np.bincount(self.where[:, 0], minlength=len(self.names) + 1)[1:]
        kept = parts_to_keep(held, keep)
        renumber = np.zeros(len(self.names) + 1, dtype=np.int64)  # own and dropped: 0
        renumber[kept + 1] = np.arange(1, len(kept) + 1)
        ours = np.flatnonzero(renumber[self.where[:, 0]] == 0)
        files = [_mapped(f, offset, record) for (f, offset), record
                 in zip(self.opened, self.records)]
        own = self.has_own
        if own:
            directory.rename(DATA_FILE, directory, OWN_FILE)
            files.insert(0, arrays.open_readonly(directory, OWN_FILE))
        view = RowView(files, self.row_map())
        out = arrays.create_array(directory, DATA_FILE, (len(ours), *view.shape[1:]),
                                  view.dtype, align=PAGE_BYTES)
        step = copy_step(view.nbytes // max(1, len(view)))
        for start in range(0, len(ours), step):
            out[start:start + step] = view.take(ours[start:start + step])
        arrays.flush(out)
        del out, view, files
        if own:
            directory.unlink(OWN_FILE)
        self.where[:, 0] = renumber[self.where[:, 0]]
        self.where[ours, 1] = np.arange(len(ours))
        for i in sorted(set(range(len(self.names))) - set(kept.tolist())):  # the dropped
            self.opened[i][0].close()
            for name in [self.names[i], *(sidecar_name(self.names[i], row_file)
                                          for row_file in SIDECARS)]:
                directory.unlink(name)
                self.sidecars.pop(name, None)
        self.names, self.records, self.opened = ([items[i] for i in kept] for items
                                                 in (self.names, self.records, self.opened))

    def close(self) -> None:
        for f, _ in self.opened:
            f.close()
        self.opened.clear()


def parts_to_keep(held: np.ndarray, keep: int) -> np.ndarray:
    """Of parts that hold ``held`` rows of a build each, the ones it keeps linked, at most
    ``keep`` (ascending indices): it drops those that hold the fewest rows, then each next
    one that holds no more rows than the dropped ones together. So files are merged with
    files as large, and a row is copied a few times however many appends come (10,000
    one-row appends to a column of 1,000 rows copy about 26,000 rows in all, where
    dropping only the fewest would copy 1.6 million). With ``keep`` >= 1 the part that
    holds the most rows stays."""
    fewest = np.argsort(held, kind="stable")
    drop = max(0, len(fewest) - keep)
    merged = int(held[fewest[:drop]].sum())
    while 0 < drop < len(fewest) - 1 and held[fewest[drop]] <= merged:
        merged += int(held[fewest[drop]])
        drop += 1
    return np.sort(fewest[drop:])


def _mapped(f: BinaryIO, offset: int, record: FileRecord) -> np.ndarray:
    return np.memmap(f, dtype=record.np_dtype, mode="r", offset=offset, shape=record.shape)


def reference(directory: _fs.DirHandle, found: Donors, rows: int, row_files: Sequence[str],
              *, link: bool) -> Parts:
    """Where each of the build's ``rows`` rows is held by ``found``'s donors, each donor
    data file that holds any opened and (``link``) hard-linked into ``directory`` with its
    ``row_files`` (:data:`~cachekit.store.manifest.SIDECARS`): once a link fails, no more
    are tried (the caller materializes). A data file that cannot be opened, fails its
    checks or lacks one of those row files gives no rows: they are decoded."""
    parts = Parts(np.full((rows, 2), -1, dtype=np.int64), linked=link)
    index_of: dict[str, int] = {}
    try:
        for donor in found.donors:
            files, at = donor.source.locate(donor.src)
            for k in np.unique(files):
                record = donor.source.manifest.data_files[int(k)]
                name = part_name(record.checksum)
                if name not in index_of:
                    if not _add(parts, directory, donor.source, int(k), name, row_files):
                        continue
                    index_of[name] = len(parts.names) - 1
                elif not _same_row_files(parts, donor.source, int(k), name, row_files):
                    continue  # the same bytes, rows of other files: decoded instead
                here = files == k
                parts.where[donor.dst[here]] = np.stack(
                    [np.full(int(here.sum()), index_of[name] + 1), at[here]], axis=1)
                key = donor.source.key
                parts.shared[key] = parts.shared.get(key, 0) + int(here.sum())
    except BaseException:
        parts.close()
        raise
    return parts


def _row_file_names(source: SharedRows, index: int, row_files: Sequence[str]
                    ) -> dict[str, str]:
    """The names ``source`` gives the ``row_files`` of its data file ``index``."""
    part = source.manifest.data_files[index].name
    return {row_file: row_file if part == DATA_FILE else sidecar_name(part, row_file)
            for row_file in row_files}


def _same_row_files(parts: Parts, source: SharedRows, index: int, name: str,
                    row_files: Sequence[str]) -> bool:
    """Whether data file ``index`` of ``source``, whose bytes are the part ``name`` already
    taken from another entry, has the same row files too: two data files may hold the same
    pixels for rows of other files (other identities, other stats)."""
    theirs = _row_file_names(source, index, row_files)
    return all((record := source.manifest.row_file(theirs[row_file])) is not None
               and record.checksum == parts.sidecars[sidecar_name(name, row_file)].checksum
               for row_file in row_files)


def _add(parts: Parts, directory: _fs.DirHandle, source: SharedRows, index: int, name: str,
         row_files: Sequence[str]) -> bool:
    """Open data file ``index`` of ``source`` as the part ``name`` with its ``row_files``
    (linked while links work); False when it cannot be opened, fails its checks or lacks
    one of those row files."""
    manifest = source.manifest
    theirs = _row_file_names(source, index, row_files)
    records = {row_file: manifest.row_file(name_there) for row_file, name_there
               in theirs.items()}
    if any(record is None for record in records.values()):
        return False
    try:
        f, offset = source.open_data(index)
    except (OSError, ValueError):
        return False
    parts.names.append(name)
    parts.records.append(manifest.data_files[index])
    parts.opened.append((f, offset))
    mine = {sidecar_name(name, row_file): (theirs[row_file], records[row_file])
            for row_file in row_files}
    parts.sidecars.update((here, record) for here, (_, record) in mine.items())
    if parts.linked:  # only this user's files: no other member can change what we share
        parts.linked = _link(directory, f, name) and all(
            _link_row_file(directory, source, there, record, here)
            for here, (there, record) in mine.items())
    return True


def _link(directory: _fs.DirHandle, f: BinaryIO, name: str) -> bool:
    return os.fstat(f.fileno()).st_uid == os.geteuid() and directory.link_open_file(f, name)


def _link_row_file(directory: _fs.DirHandle, source: SharedRows, there: str,
                   record: FileRecord, here: str) -> bool:
    """Link the row file ``there`` of ``source`` as ``here``, if its size is its record's."""
    try:
        with source.directory.open_file(there) as f:
            return os.fstat(f.fileno()).st_size == record.bytes and _link(directory, f, here)
    except OSError:
        return False
