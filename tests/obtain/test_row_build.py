"""RowBuild, the Build of a per-row call, driven directly through build_and_commit: what it
computes, what it references, what it hands the commit and what it indexes once committed."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachekit import keys
from cachekit.code_identity import function_identity
from cachekit.engine.running.rows import ArrayRow
from cachekit.entry import Entry
from cachekit.obtain.accounting import OwnWork
from cachekit.obtain.commit import build_and_commit
from cachekit.obtain.outcome import Outcome
from cachekit.obtain.row_build import BuildSettings, RowBuild, RowCall
from cachekit.store import LocalStore, Published
from cachekit.store import manifest as manifests
from cachekit.store.index_format import Needles

SETTINGS = BuildSettings(workers=1, executor=None, progress=False)


def pixel(value: int) -> np.ndarray:
    """A row function whose rows say which value made them."""
    return np.full(3, value, dtype=np.uint8)


def map_call(values: list[int], *, contiguous: bool = False) -> RowCall:
    """The RowCall that ``Cache.map(pixel, values)`` makes."""
    column = pd.Series(values)
    return RowCall("map", column, ArrayRow(pixel),
                   {"function": function_identity(pixel, None), "on_error": "raise"},
                   {"column": keys.column_material(column)}, None, "raise",
                   contiguous=contiguous)


def commit(store: LocalStore, call: RowCall) -> tuple[Published, list[int]]:
    """Build and commit ``call`` with a RowBuild: the entry, and the values whose rows the
    build computed."""
    computed: list[int] = []

    def counted(value):
        computed.append(int(value))
        return pixel(value)

    build = RowBuild(store, replace(call, row_fn=ArrayRow(counted)), SETTINGS)
    return build_and_commit(store, call.key, build, OwnWork()), computed


def rows_of(published: Published) -> np.ndarray:
    entry = Entry.from_outcome(Outcome(published, "built", "local"))
    return np.asarray(entry.array)


def test_a_fresh_column_is_one_data_file_and_its_rows_are_indexed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "c")
    call = map_call([5, 6, 7, 8])
    published, computed = commit(store, call)
    assert computed == [5, 6, 7, 8]
    manifest = published.manifest
    assert manifest.contiguous and [f.name for f in manifest.data_files] == [manifests.DATA_FILE]
    np.testing.assert_array_equal(rows_of(published), np.repeat([[5], [6], [7], [8]], 3, 1))
    # committed(): the rows are in the index, so a later build of the recipe finds them
    ids, _ = keys.row_identities(call.column, material=call.material["column"])
    [match] = store.row_index.matches(manifest.reuse.recipe, Needles(ids[:, 0]),
                                      np.ones(len(ids), dtype=bool),
                                      read_rows=lambda key: None)  # it has an index file
    assert match.key == call.key and sorted(match.dst.tolist()) == [0, 1, 2, 3]


def test_a_column_sharing_rows_links_the_file_that_holds_them_and_computes_the_rest(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "c")
    first, _ = commit(store, map_call([5, 6, 7, 8]))
    published, computed = commit(store, map_call([8, 6, 9]))
    assert computed == [9]  # 8 and 6 are the first entry's rows
    manifest = published.manifest
    assert not manifest.contiguous
    [part] = [f for f in manifest.data_files if f.name != manifests.DATA_FILE]
    [theirs] = first.manifest.data_files
    assert part.checksum == theirs.checksum  # the very bytes, named by their checksum
    here = os.stat(published.path / part.name)
    assert os.path.samefile(published.path / part.name, first.path / manifests.DATA_FILE)
    assert here.st_nlink == 2
    assert manifests.ROW_MAP_FILE in {f.name for f in manifest.files}
    np.testing.assert_array_equal(rows_of(published), np.repeat([[8], [6], [9]], 3, 1))
    assert dict(manifest.origin.reused) == {first.manifest.key: 2}


def test_a_contiguous_call_copies_shared_rows_into_one_file_without_computing_them(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "c")
    first, _ = commit(store, map_call([5, 6, 7, 8]))
    published, computed = commit(store, map_call([8, 6, 9], contiguous=True))
    assert computed == [9]
    manifest = published.manifest
    assert manifest.contiguous and [f.name for f in manifest.data_files] == [manifests.DATA_FILE]
    assert os.stat(first.path / manifests.DATA_FILE).st_nlink == 1  # nothing links to it
    np.testing.assert_array_equal(rows_of(published), np.repeat([[8], [6], [9]], 3, 1))


def test_a_row_that_raises_fails_the_build_and_publishes_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "c")

    def broken(value):
        raise ValueError(f"no row for {value}")

    call = replace(map_call([1, 2]), row_fn=ArrayRow(broken))
    with pytest.raises(ValueError, match="no row for 1"):
        build_and_commit(store, call.key, RowBuild(store, call, SETTINGS), OwnWork())
    assert store.lookup(call.key) is None
    assert list((tmp_path / "c" / "tmp").iterdir()) == []
