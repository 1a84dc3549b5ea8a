"""A derived entry's parts: the rows a build shares with committed entries of its recipe,
referenced instead of copied.

For the rows that donors hold (:mod:`.donors`), the build hard-links each donor data file
that holds any of them into its own directory, named by its checksum
(:func:`~cachekit.store.manifest.part_name`, so every entry names the same bytes alike), and
records (file, row) in its row map; only the rows no donor holds are decoded, into the
build's own ``data.npy`` (a build that decodes none has none). A linked file is the very
inode the donor's manifest describes (opened through the donor's directory handle, its size
and header checked, linked from the open file), and data files never change once written:
the filesystem counts who uses each, so clearing or pruning any entry never breaks another.
A row that repeats an earlier row left to decode is decoded and stored once
(:meth:`Parts.repeat`): the row map points it at that row, in the build's own file (a
build that links no part keeps that file as a part of its own, since the format has a row
map only with parts: :func:`.row_files.write_row_files`).

Only this user's files are linked: a group member's file stays writable by its owner alone,
and a link would let them change this user's entry. The rows of another user's files are
copied into the build's own data file, this user's files still linked (the row index offers
this user's entries first, so a member's next folds link that copy). Where a file cannot be
linked (another filesystem, a file removed meanwhile), or the caller asks for a contiguous
entry, every row is copied (:meth:`Parts.materialize`), from the files opened: the entry is
then one data file, as a fresh build makes.

A build links at most :data:`LINKED_PARTS` files, chosen before any is opened
(:func:`parts_to_keep`); the rows of the others are copied before it decodes, one file open
at a time, into the file that becomes its own data file once the rows it decodes are copied
in beside them (:meth:`Parts.compact`): each row is written there once, and a build that
shares rows with hundreds of entries holds a few dozen files open, not hundreds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Optional, Sequence

import numpy as np

from .. import _fs, arrays
from ..engine.filling import plan
from ..engine.filling.claimed import QUIET, Report
from ..engine.filling.progress import progress
from ..store.manifest import DATA_FILE, SIDECARS, FileRecord, sidecar_name
from ..store.shared_rows import SharedRows
from ..store.row_view import RowView, copy_step
from . import donor_files
from .donors import Donors
from .offers import Offer, find_offers, parts_to_keep

LINKED_PARTS = 32
"""The most parts a build links. Each append to a column makes one more data file, and an
entry opens every file it links (with the stats of each, when a hit checks them): past
this, the rows of the parts that hold the fewest of its rows are copied into its own file
(:meth:`Parts.compact`), which the next append links as one part."""
OWN_FILE = "data.npy.own"
"""The build's decoded rows while :meth:`Parts.compact` copies rows into place."""
COPIES_FILE = "data.npy.copies"
"""The build's own data file to be, while it holds only the rows copied from files it does
not link: :meth:`Parts.compact` copies the decoded rows in and renames it ``data.npy``."""
COPIED = -2
"""The file of a row copied into :data:`COPIES_FILE`, in :attr:`Parts.where`."""
REPEATED = -3
"""The file of a row that repeats an earlier row of the column the build decodes, in
:attr:`Parts.where` (its row: that row), until :meth:`Parts.own` points it at that row's."""


@dataclass
class Parts:
    """Where each row of a build is: ``where`` (rows, 2) holds (file, row), file 0 being the
    build's own data file and file ``i`` the ``i``-th of ``names`` (-1: decoded by the
    build, placed by :meth:`own`; :data:`COPIED`: the row of :data:`COPIES_FILE`;
    :data:`REPEATED`: the earlier row it repeats; :meth:`row_map` numbers the files as the
    manifest lists them). ``opened``: each part's donor file, open, and the byte its rows
    start at; ``linked``: whether every part is linked into the build directory; ``shared``:
    rows referenced or copied, by donor key."""

    where: np.ndarray
    names: list[str] = field(default_factory=list)
    records: list[FileRecord] = field(default_factory=list)
    opened: list[tuple[BinaryIO, int]] = field(default_factory=list)
    linked: bool = True
    shared: dict[str, int] = field(default_factory=dict)
    sidecars: dict[str, FileRecord] = field(default_factory=dict)
    """Each part's row files (identities, stats) by their name here, with their record."""
    copies: Optional[np.ndarray] = None
    """:data:`COPIES_FILE` mapped for writing (until :meth:`compact`): a slot for each row
    its own data file will hold, in row order (the rows :meth:`compact` copies in)."""
    copied_files: int = 0
    """The donor files rows were copied from."""
    copies_theirs: bool = False
    """Whether some of those are another user's files (never linked)."""
    repeated: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    """The rows that repeat an earlier row the build decodes (:meth:`repeat`), decoded
    once and stored once or in each of them (:attr:`keeps_repeats`)."""

    @property
    def todo(self) -> np.ndarray:
        """The rows the build decodes (no donor holds them), ascending."""
        return np.flatnonzero(self.where[:, 0] == -1)

    @property
    def own_rows(self) -> np.ndarray:
        """The row of the column each row of the build's own data file is, in its order
        (after :meth:`own`; the first of rows that repeat it)."""
        rows = np.flatnonzero(self.where[:, 0] == 0)
        if not len(self.repeated):  # (one row of the column a row of the file: no sort)
            return rows
        _, first = np.unique(self.where[rows, 1], return_index=True)
        return rows[first]

    @property
    def derived(self) -> bool:
        """Whether any row is another entry's (linked, or copied and not yet joined to the
        build's own rows), or repeats another (:meth:`repeat`): the entry has a row map."""
        return bool(self.names) or self.copies is not None or len(self.repeated) > 0

    @property
    def keeps_repeats(self) -> bool:
        """Whether the rows that repeat others stay pointed at one row of its own data file:
        it may link and copies no row; else :meth:`compact` copies that row into each of
        theirs. A build that links no part then stores its own file as a part
        (:func:`.row_files.write_row_files`): an entry has a row map only with parts."""
        return self.linked and self.copies is None

    def repeat(self, first: np.ndarray) -> None:
        """Point each row left to decode that repeats an earlier one at it (``first``: the
        first row of each row's identity), which alone is decoded and stored."""
        rows = np.flatnonzero((self.where[:, 0] == -1) & (first != np.arange(len(first))))
        rows = rows[self.where[first[rows], 0] == -1]
        self.where[rows, 0], self.where[rows, 1] = REPEATED, first[rows]
        self.repeated = rows

    def own(self) -> None:
        """Number the decoded rows (``todo``) as the rows of the build's own data file, and
        the parts in name order, the order the manifest lists them."""
        todo = self.todo
        self.where[todo, 0] = 0
        self.where[todo, 1] = np.arange(len(todo))
        self.where[self.repeated] = self.where[self.where[self.repeated, 1]]
        order = np.argsort(self.names, kind="stable")
        renumber = np.zeros(len(order) + 1, dtype=np.int64)
        renumber[order + 1] = np.arange(1, len(order) + 1)
        linked = self.where[:, 0] > 0
        self.where[linked, 0] = renumber[self.where[linked, 0]]
        self.names = [self.names[i] for i in order]
        self.records = [self.records[i] for i in order]
        self.opened = [self.opened[i] for i in order]

    @property
    def rows_written(self) -> int:
        """The rows the build writes into files of its own: all when it may not link
        (:meth:`materialize`), else those no part holds (decoded, or copied), but the rows
        that repeat others where it keeps them (:attr:`keeps_repeats`)."""
        if not self.linked:
            return len(self.where)
        return int(np.isin(self.where[:, 0], (-1, COPIED)).sum())

    @property
    def has_own(self) -> bool:
        """Whether the build decodes any row (-1 before :meth:`own`, 0 after): only then
        has it a data file of its own."""
        return bool(np.isin(self.where[:, 0], (-1, 0)).any())

    def row_map(self) -> np.ndarray:
        """The row map as the entry stores it (after :meth:`own`, and :meth:`compact` if
        rows were copied): files numbered as its data files are listed, its own first if it
        has one."""
        assert self.copies is None, "the copied rows are not in a data file of the entry yet"
        where = self.where if self.has_own else self.where - (1, 0)
        return np.ascontiguousarray(where, dtype="<u4")

    def materialize(self, directory: _fs.DirHandle) -> None:
        """Copy every row into a new ``data.npy`` of the build in row order, from its own
        decoded rows and the parts' open files, and unlink the parts it linked: a
        contiguous entry, as a fresh build makes (call after :meth:`own`)."""
        self.compact(directory, keep=0, whole=True)
        self.linked = True

    def compact(self, directory: _fs.DirHandle, keep: int, whole: bool = False) -> None:
        """Keep at most ``keep`` parts, and copy the rows of the others, with the rows the
        build decoded, into its own ``data.npy`` in row order: into :data:`COPIES_FILE`,
        beside the rows copied there before, which then becomes ``data.npy``; or into a new
        file. Unlink the parts it drops and close their files (call after :meth:`own`).
        Nothing to do when it has ``keep`` parts or fewer and copied no row, unless
        ``whole`` asks for each row in a row of the file, the rows that repeat others too.

        Which parts it keeps: :func:`parts_to_keep`."""
        n = len(self.names)
        if n <= keep and self.copies is None and not (whole and len(self.repeated)):
            return
        fileno = np.where(self.where[:, 0] == COPIED, n + 1, self.where[:, 0])
        held = np.bincount(fileno, minlength=n + 2)[1:n + 1]
        kept = parts_to_keep(held, keep) if n > keep else np.arange(n)
        renumber = np.zeros(n + 2, dtype=np.int64)  # own, dropped and copied: 0
        renumber[kept + 1] = np.arange(1, len(kept) + 1)
        ours = np.flatnonzero(renumber[fileno] == 0)
        dropped = np.setdiff1d(np.arange(n), kept)
        own, out = self.has_own, self.copies
        if out is None and own:
            directory.rename(DATA_FILE, directory, OWN_FILE)
        files: list[Optional[np.ndarray]] = [None] * (n + 2)  # only those it copies from
        if own:
            files[0] = arrays.open_readonly(directory, OWN_FILE if out is None else DATA_FILE)
        for i in dropped:
            files[i + 1] = donor_files.mapped(*self.opened[i], self.records[i])
        if out is not None:  # it has a slot for each of ours: fill the others'
            todo = ours[fileno[ours] != n + 1]
            slots = np.searchsorted(ours, todo)
        else:
            some = next(f for f in files if f is not None)
            out = arrays.create_array(directory, DATA_FILE, (len(ours), *some.shape[1:]),
                                      some.dtype, align=plan.PAGE_BYTES)
            todo, slots = ours, np.arange(len(ours))
        empty = np.empty((0, *out.shape[1:]), out.dtype)
        view = RowView([empty if f is None else f for f in files],
                       np.stack([fileno, self.where[:, 1]], axis=1))
        step = copy_step(out.nbytes // max(1, len(out)))
        for start in range(0, len(todo), step):
            out[slots[start:start + step]] = view.take(todo[start:start + step])
        arrays.flush(out)
        del out, view, files
        if self.copies is not None:
            self.copies = None
            directory.rename(COPIES_FILE, directory, DATA_FILE)  # (over the decoded rows)
        elif own:
            directory.unlink(OWN_FILE)
        self.where[:, 0] = renumber[fileno]
        self.where[ours, 1] = np.arange(len(ours))
        for i in dropped:
            self.opened[i][0].close()
            for name in [self.names[i], *(sidecar_name(self.names[i], row_file)
                                          for row_file in SIDECARS)]:
                directory.unlink(name)
                self.sidecars.pop(name, None)
        self.names, self.records, self.opened = ([items[i] for i in kept] for items
                                                 in (self.names, self.records, self.opened))
        self.repeated = self.repeated[:0]  # (each row now has a row of the file)

    def close(self) -> None:
        for f, _ in self.opened:
            f.close()
        self.opened.clear()
        self.copies = None


def reference(directory: _fs.DirHandle, found: Donors, rows: int, row_files: Sequence[str],
              *, link: bool, before_writing: Callable[[int], None],
              first: Optional[np.ndarray] = None, report: Report = QUIET) -> Parts:
    """Where each of the build's ``rows`` rows is held by ``found``'s donors: the donor data
    files that hold any, at most :data:`LINKED_PARTS` of them (:func:`parts_to_keep` of the
    rows each holds), are opened and (``link``) hard-linked into ``directory`` with their
    ``row_files`` (:data:`~cachekit.store.manifest.SIDECARS`): once a link fails, no more
    are tried (the caller materializes). ``before_writing`` is told the rows the build
    writes (:attr:`Parts.rows_written`), then the rows of the other files and of another
    user's are copied into :data:`COPIES_FILE`, one file open at a time (shown as ``report``
    asks). A file that cannot be opened, fails its checks (its checksum too, where its rows
    are copied: :func:`.donor_files.intact`) or lacks a row file gives no rows. The rows
    left to decode that repeat an earlier one (``first``: the first row of each row's
    identity, None when none repeats) are pointed at it (:meth:`Parts.repeat`), before room
    is made where no row is copied, else after the copies."""
    parts = Parts(np.full((rows, 2), -1, dtype=np.int64), linked=link)
    try:
        offers = find_offers(found, row_files)
        linkable = np.flatnonzero([offer.linkable for offer in offers])
        kept = linkable[parts_to_keep(np.array([offers[i].rows for i in linkable],
                                               dtype=np.int64), LINKED_PARTS)]
        theirs: list[Offer] = []
        taken = [offers[i] for i in kept if _take(parts, directory, offers[i], theirs)]
        verdicts: dict[tuple[int, int], bool] = {}
        if not parts.linked:  # every part's rows are copied (materialize)
            _drop_damaged(parts, directory, taken, verdicts)
        others = theirs + [offers[i] for i in sorted(set(range(len(offers)))
                                                     - set(kept.tolist()))]
        if first is not None and not others:
            parts.repeat(first)  # (before room is made: a repeat is not written)
        before_writing(parts.rows_written)
        if others:
            assert found.template is not None  # (every donor's)
            _copy(parts, directory, others, found.template, report, verdicts)
            parts.copies_theirs = bool(theirs)
            if first is not None:  # (each repeat has a row of the copies, compact fills it)
                parts.repeat(first)
    except BaseException:
        parts.close()
        raise
    return parts


def _place(parts: Parts, source: SharedRows, dst: np.ndarray, file: int,
           rows: np.ndarray) -> None:
    parts.where[dst, 0] = file
    parts.where[dst, 1] = rows
    parts.shared[source.key] = parts.shared.get(source.key, 0) + len(dst)


def _take(parts: Parts, directory: _fs.DirHandle, offer: Offer, theirs: list[Offer]) -> bool:
    """Open ``offer``'s file from its first lender that can open it, as a part (linked
    while links work), and place the rows of every lender there: those of a lender that
    could not open it too (a lender cleared meanwhile: the same bytes); False when none
    can (and into ``theirs``, to copy, when a lender's file was another user's, never
    linked)."""
    foreign = False
    for source, index, _, _ in offer.lenders:
        try:
            added = _add(parts, directory, source, index, offer)
        finally:
            source.release()
        if added:
            for lender, _, dst, at in offer.lenders:
                _place(parts, lender, dst, len(parts.names), at)
            return True
        foreign = foreign or added is None
    if foreign:
        theirs.append(offer)
    return False


def _add(parts: Parts, directory: _fs.DirHandle, source: SharedRows, index: int,
         offer: Offer) -> Optional[bool]:
    """Open data file ``index`` of ``source`` as the part ``offer.name`` with its row files
    (linked while links work); False when it cannot be opened or fails its checks, None
    when links work and it is another user's file (left to copy)."""
    try:
        f, offset = source.open_data(index)
    except (OSError, ValueError):
        return False
    if parts.linked and os.fstat(f.fileno()).st_uid != os.geteuid():
        f.close()
        return None
    parts.names.append(offer.name)
    parts.records.append(source.manifest.data_files[index])
    parts.opened.append((f, offset))
    parts.sidecars.update((here, record) for here, (_, record) in offer.row_files.items())
    if parts.linked:  # only this user's files: no other member can change what we share
        parts.linked = donor_files.link(directory, f, offer.name) and all(
            donor_files.link_row_file(directory, source, there, record, here)
            for here, (there, record) in offer.row_files.items())
    return True


def _drop_damaged(parts: Parts, directory: _fs.DirHandle, taken: list[Offer],
                  verdicts: dict[tuple[int, int], bool]) -> None:
    """Drop each part whose file is not :func:`.donor_files.intact` (``taken``: the offer of
    each part), with what it linked here: its rows are left to decode."""
    for i in reversed(range(len(parts.names))):
        f, record = parts.opened[i][0], parts.records[i]
        if donor_files.intact(f, record, verdicts):
            continue
        donor_files.warn_damaged(taken[i].lenders[0][0], record)
        file = i + 1
        for source, _, dst, _ in taken[i].lenders:
            lent = int(np.count_nonzero(parts.where[dst, 0] == file))
            if lent:
                parts.shared[source.key] -= lent
        parts.where[parts.where[:, 0] == file] = -1
        parts.where[parts.where[:, 0] > file, 0] -= 1
        f.close()
        for name in [parts.names[i], *(sidecar_name(parts.names[i], row_file)
                                       for row_file in SIDECARS)]:
            directory.unlink(name)  # (what it linked before a link failed)
            parts.sidecars.pop(name, None)
        del parts.names[i], parts.records[i], parts.opened[i], taken[i]


def _copy(parts: Parts, directory: _fs.DirHandle, offers: list[Offer],
          template: tuple[tuple[int, ...], np.dtype], report: Report,
          verdicts: dict[tuple[int, int], bool]) -> None:
    """Copy the rows of ``offers`` from each offer's file in turn (each closed before the
    next is opened; :func:`.donor_files.open_intact`: a file no lender opens intact lends no
    rows) into :data:`COPIES_FILE`, which has a slot for each row its own data file will
    hold, in row order: every row not in a part, or every row when the parts are not linked
    (the caller materializes)."""
    shape, dtype = template
    ours = (np.flatnonzero(parts.where[:, 0] < 0) if parts.linked
            else np.arange(len(parts.where)))
    out = arrays.create_array(directory, COPIES_FILE, (len(ours), *shape), dtype,
                              align=plan.PAGE_BYTES)
    step = copy_step(out.nbytes // max(1, len(out)))
    shown = progress(sum(offer.rows for offer in offers), report)
    for offer in offers:
        opened = donor_files.open_intact(offer.lenders, verdicts)
        if opened is None:
            continue
        f, rows = opened
        with f:
            for lender, _, dst, at in offer.lenders:
                slots = np.searchsorted(ours, dst)
                for start in range(0, len(at), step):
                    out[slots[start:start + step]] = rows[at[start:start + step]]
                    shown.update(len(at[start:start + step]))
                _place(parts, lender, dst, COPIED, slots)
            del rows
        parts.copied_files += 1
    shown.close()
    if parts.copied_files:
        parts.copies = out
    else:  # (no file could be opened: their rows are decoded)
        del out
        directory.unlink(COPIES_FILE)
