"""The donor data files that hold rows of a build, as :mod:`.parts` takes them: read from
the donors' manifests alone, nothing opened; and which of them a build links at most
(:func:`parts_to_keep`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..store.manifest import DATA_FILE, FileRecord, part_name, sidecar_name
from ..store.shared_rows import SharedRows
from .donors import Donors


@dataclass
class Offer:
    """A data file of donors (named by its checksum, as a part) that holds rows of the
    build, with the records of its row files (by their name in the build: name, the name
    in the donor and its record), and each donor that lends it: (the donor, the file's
    index in its manifest, the build's rows it holds, their rows in the file). Not
    ``linkable``: another offer's bytes with other row files; its rows are copied."""

    name: str
    row_files: dict[str, tuple[str, FileRecord]]
    linkable: bool = True
    lenders: list[tuple[SharedRows, int, np.ndarray, np.ndarray]] = field(
        default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(dst) for _, _, dst, _ in self.lenders)


def find_offers(found: Donors, row_files: Sequence[str]) -> list[Offer]:
    """The data files of ``found``'s donors that hold rows of the build, read from their
    manifests alone (nothing is opened). Two donors may hold the same bytes (a file one
    links of the other's) and lend them as one; with other row files (other identities or
    stats for the same pixels) they are another offer, not ``linkable``. A donor whose
    manifest lacks one of ``row_files`` offers nothing: those rows are decoded."""
    found_offers: dict[tuple[str, tuple[str, ...]], Offer] = {}
    names: set[str] = set()
    for donor in found.donors:
        files, at = donor.source.locate(donor.src)
        for k in np.unique(files):
            index = int(k)
            name = part_name(donor.source.manifest.data_files[index].checksum)
            theirs = row_files_of(donor.source, index, name, row_files)
            if theirs is None:
                continue
            same = (name, tuple(record.checksum for _, record in theirs.values()))
            offer = found_offers.get(same)
            if offer is None:
                offer = found_offers[same] = Offer(name, theirs, linkable=name not in names)
                names.add(name)
            here = files == k
            offer.lenders.append((donor.source, index, donor.dst[here], at[here]))
    return list(found_offers.values())


def row_files_of(source: SharedRows, index: int, name: str, row_files: Sequence[str]
                 ) -> Optional[dict[str, tuple[str, FileRecord]]]:
    """The ``row_files`` of data file ``index`` of ``source`` as the part ``name`` has them
    (by their names there: the donor's name and record); None when one is not listed."""
    part = source.manifest.data_files[index].name
    theirs = {}
    for row_file in row_files:
        there = row_file if part == DATA_FILE else sidecar_name(part, row_file)
        record = source.manifest.row_file(there)
        if record is None:
            return None
        theirs[sidecar_name(name, row_file)] = (there, record)
    return theirs


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
