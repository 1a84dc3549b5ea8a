"""The per-recipe row index (cachekit/store/row_index.py) and opening an entry as a row
source (cachekit/store/shared_rows.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachekit
from cachekit import key_names, keys
from cachekit.store import LocalStore
from cachekit.store import manifest as manifests
from cachekit.store.index_format import Needles
from cachekit.store.row_index import RowIndex
from cachekit.store.shared_rows import open_shared_rows

RECIPE = "ab" * 16


def _published(root: Path, key: str) -> None:
    (root / "entries" / key).mkdir(parents=True)


def _unread(key: str) -> None:
    """``read_rows`` of a lookup that meets no entry indexed by its row map."""
    raise AssertionError(f"{key} was read")


def _matches(index: RowIndex, hashes: np.ndarray, take: bool = True,
             read_rows=_unread) -> list:
    remaining = np.ones(len(hashes), dtype=bool)
    found = []
    for match in index.matches(RECIPE, Needles(hashes), remaining, read_rows=read_rows):
        found.append(match)
        if take:
            remaining[match.dst] = False
    return found


def test_a_lookup_finds_each_row_in_the_largest_entry_that_holds_it(tmp_path):
    store = LocalStore(tmp_path)
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64 - 1, size=1000, dtype=np.uint64)
    small, large = "1" * 32, "2" * 32
    for key in (small, large):
        _published(tmp_path, key)
    index = RowIndex(store)
    index.add(RECIPE, small, hashes[:300])
    skip = np.zeros(700, dtype=bool)
    skip[5] = True  # a failed row is never offered
    index.add(RECIPE, large, hashes[200:900], skip=skip)
    found = _matches(index, hashes)
    assert [m.key for m in found] == [large, small]
    first, second = found
    assert first.dst.tolist() == [r for r in range(200, 900) if r != 205]
    assert (hashes[200:900][first.src] == hashes[first.dst]).all()
    assert second.dst.tolist() == list(range(0, 200)) + [205]
    assert (second.src == second.dst).all()
    assert [m.key for m in _matches(index, hashes[900:])] == []  # nobody holds these


def test_an_index_file_is_a_hint_that_never_breaks_a_lookup(tmp_path):
    store = LocalStore(tmp_path)
    hashes = np.arange(1, 101, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    keys_ = [f"{i:032x}" for i in range(1, 5)]
    index = RowIndex(store)
    for key in keys_:
        _published(tmp_path, key)
        index.add(RECIPE, key, hashes)
    folder = tmp_path / "index" / RECIPE
    (folder / f"{keys_[0]}.npy").write_bytes(b"not an index")
    np.save(folder / f"{keys_[1]}.npy", np.zeros(7, dtype="<u8"))  # wrong lengths
    os.unlink(folder / f"{keys_[2]}.npy")
    os.symlink("/etc/passwd", folder / f"{keys_[2]}.npy")
    (folder / "stray.npy").write_bytes(b"")
    assert [m.key for m in _matches(index, hashes)] == [keys_[3]]


def test_the_file_of_a_removed_entry_goes_at_the_next_lookup(tmp_path):
    store = LocalStore(tmp_path)
    hashes = np.arange(10, dtype=np.uint64)
    gone, kept = "3" * 32, "4" * 32
    index = RowIndex(store)
    _published(tmp_path, kept)
    for key in (gone, kept):
        index.add(RECIPE, key, hashes)
    assert [m.key for m in _matches(index, hashes, take=False)] == [kept]
    assert sorted(p.stem for p in (tmp_path / "index" / RECIPE).iterdir()) == [kept]


def test_shared_rows_are_refused_when_any_row_file_disagrees_with_the_manifest(tmp_path):
    cache = cachekit.Cache(tmp_path / "cache", workers=1, progress=False)
    entry = cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(20)), version="1")
    store = LocalStore(tmp_path / "cache")
    recipe = manifests.read(entry.path).reuse.recipe
    with open_shared_rows(store, entry.key, recipe) as source:
        assert source.ids.shape == (20, 2) and source.where is None  # contiguous
        assert source.stats is None and not source.failed.any()
        data, offset = source.open_data(0)
        with data:
            assert offset == os.path.getsize(entry.path / "data.npy") - 20 * 6
    assert open_shared_rows(store, entry.key, "0" * 32) is None  # another recipe
    ids = entry.path / manifests.ROW_IDS_FILE
    raw = bytearray(ids.read_bytes())
    raw[-1] ^= 1
    ids.write_bytes(bytes(raw))
    assert open_shared_rows(store, entry.key, recipe) is None
    assert open_shared_rows(store, "5" * 32, recipe) is None  # no such entry


def test_an_entry_let_go_of_is_opened_again_only_if_it_is_the_entry_read(tmp_path):
    """A build lets go of each entry it shares rows with once their rows are read: a file
    opened later comes from that very entry, never from one built since under its key."""
    cache = cachekit.Cache(tmp_path / "cache", workers=1, progress=False)

    def build() -> cachekit.Entry:
        return cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(20)), version="1")

    entry = build()
    store = LocalStore(tmp_path / "cache")
    recipe = manifests.read(entry.path).reuse.recipe
    with open_shared_rows(store, entry.key, recipe) as source:
        source.release()
        assert source.directory is None
        data, _ = source.open_data(0)  # the same entry: opened again
        data.close()
        source.release()
        cache.clear(entry.key)
        assert build().key == entry.key  # built again: another entry under the key
        with pytest.raises(FileNotFoundError, match="changed since its rows were read"):
            source.open_data(0)
        with pytest.raises(FileNotFoundError):
            source.open_file(manifests.ROW_IDS_FILE)


def test_an_entry_opened_again_is_read_again_only_when_its_files_or_the_signing_key_changed(
        tmp_path, monkeypatch):
    """Ten folds of one column open the same entry ten times: its checked row files are
    read once per process, and read again (and checked) once one of them is rewritten, or
    under another signing key."""
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "k" * 32)
    cache = cachekit.Cache(tmp_path / "cache", workers=1, progress=False)
    entry = cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(20)), version="1")
    store = LocalStore(tmp_path / "cache")
    recipe = manifests.read(entry.path).reuse.recipe
    reads = []
    monkeypatch.setattr(cachekit.arrays, "read_small",
                        _counting(cachekit.arrays.read_small, reads))
    for _ in range(3):
        with open_shared_rows(store, entry.key, recipe) as source:
            assert source.ids.shape == (20, 2) and not source.ids.flags.writeable
        assert cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(20)),
                         version="1").hit  # (a hit sets its directory's mtime: its last use)
    assert len(reads) == 1  # the row identities, once
    os.utime(entry.path / manifests.ROW_BLOCKS_FILE, ns=(0, 0))  # any row file written
    assert open_shared_rows(store, entry.key, recipe) is not None and len(reads) == 2
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "other" * 8)  # its signature is now wrong
    assert open_shared_rows(store, entry.key, recipe) is None


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[1])
        return fn(*args, **kwargs)
    return counted


def test_shared_rows_that_are_refused_cost_nothing_but_its_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "k" * 32)
    cache = cachekit.Cache(tmp_path / "cache", workers=1, progress=False)
    first = cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(20)), version="1")
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "other" * 8)  # its signature is now wrong
    grown = cache.map(lambda v: np.full(3, v, np.int16), pd.Series(range(25)), version="1")
    assert (grown.rows_decoded, grown.rows_reused) == (25, 0)
    assert (np.asarray(grown.array)[:, 0] == np.arange(25)).all()
    assert first.key != grown.key and key_names.is_key(grown.key)


def test_a_writer_that_died_before_its_rename_leaves_nothing_for_long(tmp_path):
    store = LocalStore(tmp_path)
    index = RowIndex(store)
    _published(tmp_path, "6" * 32)
    index.add(RECIPE, "6" * 32, np.arange(5, dtype=np.uint64))
    folder = tmp_path / "index" / RECIPE
    old, new = folder / f".{'7' * 32}.npy.h.1.x.tmp", folder / f".{'8' * 32}.npy.h.2.y.tmp"
    old.write_bytes(b"half")
    new.write_bytes(b"half")
    os.utime(old, (1, 1))
    assert [m.key for m in _matches(index, np.arange(5, dtype=np.uint64))] == ["6" * 32]
    assert not old.exists() and new.exists()  # a writer may still be renaming that one


def test_an_entry_holding_no_row_of_its_own_is_indexed_by_a_link_to_its_row_map(tmp_path):
    """No new file: a lookup reads that entry's rows (read_rows) once the larger entries
    before it no longer hold them."""
    store = LocalStore(tmp_path)
    index = RowIndex(store)
    hashes = np.arange(1, 41, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    full, fold = "a" * 32, "b" * 32
    _published(tmp_path, full)
    index.add(RECIPE, full, hashes[:30])
    _published(tmp_path, fold)
    row_map = tmp_path / "entries" / fold / manifests.ROW_MAP_FILE
    np.save(row_map, np.zeros((20, 2), dtype="<u4"))
    assert index.link(RECIPE, fold)
    linked = tmp_path / "index" / RECIPE / f"{fold}.npy"
    assert os.path.samefile(linked, row_map) and row_map.stat().st_nlink == 2
    assert sorted(os.listdir(linked.parent)) == sorted([f"{full}.npy", f"{fold}.npy"])
    offered = np.arange(20, 40)  # the fold's rows 0..19 are the column's rows 20..39
    read = []

    def read_rows(key):
        read.append(key)
        return hashes[offered], np.arange(20)

    first, second = _matches(index, hashes, read_rows=read_rows)
    assert (first.key, first.dst.tolist()) == (full, list(range(30)))
    assert (second.key, second.dst.tolist(), second.src.tolist()) == \
        (fold, list(range(30, 40)), list(range(10, 20)))
    assert read == [fold]
    assert [m.key for m in _matches(index, hashes[:30], read_rows=read_rows)] == [full]
    assert read == [fold]  # the full entry held every row: the fold was not read
    assert _matches(index, hashes, read_rows=lambda key: None)[1:] == []  # unreadable
    assert not index.link(RECIPE, "c" * 32)  # no such entry: add() it instead
    assert index.forget(fold) and row_map.stat().st_nlink == 1


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1),
       sizes=st.lists(st.integers(0, 300), min_size=1, max_size=3, unique=True),
       wanted_rows=st.integers(1, 400))
def test_a_lookup_finds_what_a_plain_search_finds(tmp_path_factory, seed, sizes, wanted_rows):
    """Against a plain model: each row goes to the largest entry that holds its hash, with
    that entry's row, ascending; lookups of few and of many rows of a column alike."""
    root = tmp_path_factory.mktemp("index")
    index = RowIndex(LocalStore(root))
    rng = np.random.default_rng(seed)
    pool = np.unique(rng.integers(0, 2**64 - 1, size=400, dtype=np.uint64))
    held = {}
    for i, size in enumerate(sizes):  # (of distinct sizes: the larger file comes first)
        key = f"{i + 1:032x}"
        held[key] = rng.choice(pool, size, replace=False)
        _published(root, key)
        index.add(RECIPE, key, held[key])
    wanted = rng.choice(pool, min(wanted_rows, len(pool)), replace=False)
    expected, remaining = {}, np.ones(len(wanted), dtype=bool)
    for key in sorted(held, key=lambda k: -len(held[k])):
        where = {int(h): row for row, h in enumerate(held[key])}
        dst = [r for r in range(len(wanted)) if remaining[r] and int(wanted[r]) in where]
        remaining[dst] = False
        if dst:
            expected[key] = (dst, [where[int(wanted[r])] for r in dst])
    found = _matches(index, wanted)
    assert {m.key: (m.dst.tolist(), m.src.tolist()) for m in found} == expected
    assert [m.key for m in found] == list(expected)
