"""Every entry handed back is checked against the call: kind, rows, row shape, dtype, and a
memoize entry's leaves. An entry that disagrees is rebuilt (locally) or refused (remotely,
see tests/obtain/test_remote_tier.py), whoever wrote it, signed or not: entries here are crafted
to agree with themselves in every respect (sizes, checksums, signature), so that only the
call can tell them wrong."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.obtain import Expected, obtain
from cachekit.obtain.built import Built
from cachekit.store.manifest import FileRecord, Manifest
from cachekit.store import LocalStore
from helpers import FunctionRequest, rewrite_entry

SIGNING = {"unsigned": None, "signed": "a key every writer of this root holds"}


def manifest(kind="images", shape=(4, 3, 8, 8), dtype="|u1", files=1, structure=None):
    records = tuple(FileRecord(f"leaf_{i}.npy" if i else "data.npy", shape, dtype, 1 << 20,
                               "blake2b-128:" + "0" * 32) for i in range(files))
    return Manifest(key="0" * 32, kind=kind, rows=shape[0] if shape else 1, files=records,
                    created=0.0, structure=structure)


IMAGES = Expected("images", rows=4, row_shape=(3, 8, 8), dtype="|u1")


@pytest.mark.parametrize("expected, made, words", [
    (IMAGES, manifest(), None),
    (IMAGES, manifest(dtype="<u2"), "dtype is <u2, the call makes |u1"),
    (IMAGES, manifest(shape=(5, 3, 8, 8)), "5 rows, the call makes 4"),
    (IMAGES, manifest(shape=(4, 3, 4, 16)), "shape is [4, 3, 4, 16], the call makes [4, 3, 8, 8]"),
    (IMAGES, manifest(shape=(4, 1, 8, 8)), "the call makes [4, 3, 8, 8]"),
    (IMAGES, manifest(kind="map"), "'map' entry, the call makes 'images'"),
    (Expected("map", rows=4), manifest(kind="map", shape=(4, 7), dtype="<f8"), None),
    (Expected("map", rows=4), manifest(kind="map", shape=(3, 7)), "3 rows"),
    (Expected("map", rows=4), manifest(kind="map", dtype="|O"), "holds Python objects"),
    (Expected("memoize", leaves=True),
     manifest("memoize", files=2, structure={"tuple": [{"array": 0}, {"array": 1}]}), None),
    (Expected("memoize", leaves=True),
     manifest("memoize", files=3, structure={"dict": [["a", {"array": 2}], ["b", {"list": [
         {"array": 0}, {"array": 1}]}]]}), None),
    (Expected("memoize", leaves=True),
     manifest("memoize", files=2, structure={"array": 0}), "not each of its 2 files once"),
    (Expected("memoize", leaves=True),
     manifest("memoize", files=2, structure={"tuple": [{"array": 0}, {"array": 0}]}),
     "not each"),
    (Expected("memoize", leaves=True),
     manifest("memoize", files=2, structure={"tuple": [{"array": False}, {"array": True}]}),
     "not each"),
])
def test_check_says_what_disagrees(expected, made, words):
    problem = expected.check(made)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem, problem


def rows_of(v: int) -> np.ndarray:
    return np.full((2, 5), v, dtype=np.int16)


@pytest.fixture(params=list(SIGNING))
def signing(request, monkeypatch):
    if SIGNING[request.param] is None:
        monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    else:
        monkeypatch.setenv("CACHEKIT_SIGNING_KEY", SIGNING[request.param])
    return request.param


@pytest.mark.parametrize("wrong", ["uint16", "other rows", "other row shape"])
def test_images_rebuilds_an_entry_that_disagrees_with_the_call(cache_root, cover_paths,
                                                               signing, wrong, capfd):
    cache = cachekit.Cache(cache_root, workers=2, progress=False)
    column = pd.Series(cover_paths)
    built = cache.images(column, 8)
    pixels = np.array(built.array)
    crafted = {"uint16": pixels.astype("<u2") * 257, "other rows": pixels[:5],
               "other row shape": pixels.reshape(len(pixels), 3, 4, 16)}[wrong]
    rewrite_entry(built.path, crafted)
    assert LocalStore(cache_root).lookup(built.key).manifest.dtype == crafted.dtype  # valid
    entry = cache.images(column, 8)
    assert entry.source == "built" and entry.key == built.key
    assert entry.array.dtype == np.uint8 and entry.array.shape == (len(column), 3, 8, 8)
    np.testing.assert_array_equal(np.asarray(entry.array), pixels)
    err = capfd.readouterr().err
    assert f"removed entry {built.key[:12]}: it does not match the call" in err
    assert cache.images(column, 8).source == "local"


def test_map_rebuilds_an_entry_of_other_rows(cache_root, signing, capfd):
    cache = cachekit.Cache(cache_root, workers=2, progress=False)
    built = cache.map(rows_of, list(range(6)))
    rewrite_entry(built.path, np.zeros((9, 2, 5), dtype=np.int16))
    entry = cache.map(rows_of, list(range(6)))
    assert entry.source == "built" and len(entry) == 6 and entry.array.shape == (6, 2, 5)
    np.testing.assert_array_equal(np.asarray(entry.array)[:, 0, 0], np.arange(6))
    assert "9 rows, the call makes 6" in capfd.readouterr().err


def test_memoize_rebuilds_an_entry_whose_structure_hides_a_leaf(cache_root, signing, capfd):
    cache = cachekit.Cache(cache_root, workers=2, progress=False)
    calls = []

    @cache.memoize
    def pair(n):
        calls.append(n)
        return np.arange(n), np.ones((n, 2))

    first, _ = pair(4)
    rewrite_entry(cache_root / "entries" / pair.cache_key(4), None, structure={"array": 0})
    again = pair(4)
    assert isinstance(again, tuple) and len(again) == 2 and calls == [4, 4]
    np.testing.assert_array_equal(again[0], np.arange(4))
    assert "not each of its 2 files once" in capfd.readouterr().err


def test_an_entry_that_disagrees_again_after_its_removal_is_corrupt(cache_root, capfd):
    """A build that keeps making the wrong entry (here: this call's own build function):
    removed and built once more, then CacheCorruptError, not a loop."""
    from cachekit import arrays
    from cachekit.store.manifest import DATA_FILE

    store, builds = LocalStore(cache_root), []

    def build_wrong(current, on_chunk):
        builds.append(1)
        out = arrays.create_array(current.dir, DATA_FILE, (2, 3), np.dtype("<u2"))
        arrays.flush(out)
        del out
        return Built(kind="map", rows=2, files=((DATA_FILE, "numpy"),))

    with pytest.raises(cachekit.CacheCorruptError, match="again after it was removed"):
        obtain(store, FunctionRequest("1" * 32, build_wrong, Expected("map", rows=3)),
               lock_timeout=None)
    assert len(builds) == 2
    assert capfd.readouterr().err.count("does not match the call") == 1
