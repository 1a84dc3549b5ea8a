"""Several entries may lend rows of one data file (folds that link the file of a full entry
cleared since): a build opens the file once, from the first lender that can open it, and
takes the rows of every lender from it (cachekit/obtain/parts.py: ``_take``, ``_copy``),
so a lender cleared between the lookup and the build costs no decode; a file rows are
copied out of is checked whole once a process while it stays the same.
"""

from __future__ import annotations

import os

import numpy as np

import cachekit
from cachekit.obtain import parts
from cachekit.store import manifest as manifests
from cachekit.store.shared_rows import SharedRows


def _row(v: int) -> np.ndarray:
    return np.full(16, v, dtype=np.int32)


def _two_lenders(root) -> tuple[cachekit.Cache, list[cachekit.Entry]]:
    """Two folds that link one file, the file of the full entry, which is cleared."""
    cache = cachekit.Cache(root, workers=1, progress=False)
    full = cache.map(_row, list(range(100)), version="1")
    folds = [cache.map(_row, list(range(0, 50)), version="1"),
             cache.map(_row, list(range(50, 100)), version="1")]
    assert not any(fold.contiguous for fold in folds)
    cache.clear([full.key])
    return cache, folds


def _fail_first_open(monkeypatch) -> list[str]:
    """From now on, the first data file a build opens from a donor fails to open, as when
    the donor is cleared right after the lookup found it; the keys of the donors opened
    from."""
    real, opened = SharedRows.open_data, []

    def open_data(self, index):
        opened.append(self.key)
        if len(opened) == 1:
            raise FileNotFoundError("cleared meanwhile")
        return real(self, index)

    monkeypatch.setattr(SharedRows, "open_data", open_data)
    return opened


def test_a_lender_that_cannot_open_the_file_lends_its_rows_through_another(
        tmp_path, monkeypatch):
    cache, folds = _two_lenders(tmp_path)
    first_open_fails = _fail_first_open(monkeypatch)
    entry = cache.map(_row, list(range(100)), version="1")
    assert len(first_open_fails) == 2 and set(first_open_fails) == {f.key for f in folds}
    assert entry.rows_decoded == 0 and entry.rows_reused == 100 and not entry.contiguous
    assert np.asarray(entry.array)[:, 0].tolist() == list(range(100))
    [part] = [p for p in entry.path.iterdir() if manifests.is_part_name(p.name)
              and p.name.count(".") == 1]
    assert part.stat().st_ino == next(
        p for p in folds[0].path.iterdir() if p.name == part.name).stat().st_ino


def test_rows_copied_from_a_file_two_lenders_hold_come_through_the_one_that_opens_it(
        tmp_path, monkeypatch):
    """No part is linked (the bound set to 0): the rows are copied, from the file the
    second lender opens, the first lender's rows too."""
    cache, folds = _two_lenders(tmp_path)
    monkeypatch.setattr(parts, "LINKED_PARTS", 0)
    first_open_fails = _fail_first_open(monkeypatch)
    entry = cache.map(_row, list(range(100)), version="1")
    assert len(first_open_fails) == 2
    assert entry.rows_decoded == 0 and entry.rows_reused == 100 and entry.contiguous
    assert np.asarray(entry.array)[:, 0].tolist() == list(range(100))


def test_a_file_rows_are_copied_from_is_read_whole_once_a_process_while_it_stays_the_same(
        tmp_path, monkeypatch):
    """Two builds copy rows out of the full entry's file (no part linked: the bound set to
    0), as a member's folds copy a teammate's: the first reads it whole to check it, the
    second does not; once the file's mtime changes it is read whole again."""
    from cachekit import arrays

    cache = cachekit.Cache(tmp_path, workers=1, progress=False)
    full = cache.map(_row, list(range(100)), version="2")
    monkeypatch.setattr(parts, "LINKED_PARTS", 0)
    real, read = arrays.checksum_of, []

    def checksum_of(f):
        read.append(os.fstat(f.fileno()).st_ino)
        return real(f)

    monkeypatch.setattr(arrays, "checksum_of", checksum_of)
    data = full.path / manifests.DATA_FILE
    for rows in (range(0, 50), range(50, 90)):
        entry = cache.map(_row, list(rows), version="2")
        assert entry.contiguous and entry.rows_decoded == 0
        assert np.asarray(entry.array)[:, 0].tolist() == list(rows)
    assert read == [data.stat().st_ino]
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1))
    entry = cache.map(_row, list(range(90, 100)), version="2")
    assert entry.rows_decoded == 0 and read == [data.stat().st_ino] * 2
