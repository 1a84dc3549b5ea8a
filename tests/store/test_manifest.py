"""The typed manifest (cachekit/manifest.py): its file list, JSON round trip and checks."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import CacheCorruptError, _fs, arrays
from cachekit.store import manifest as manifests


@pytest.fixture
def memoized(cache, cache_root):
    @cache.memoize
    def produce():
        return {"a": np.arange(6).reshape(2, 3), "b": (np.ones(4, np.float32),)}

    produce()
    return cache_root / "entries" / produce.cache_key()


def test_every_published_file_is_listed_with_its_size_and_checksum(cache, cache_root, memoized):
    mapped = cache.map(lambda v: np.full(2, v, np.int8), pd.Series([1, 2, 3]), version="1")
    for entry_dir in (mapped.path, memoized):
        manifest = manifests.read(entry_dir)
        on_disk = sorted(p.name for p in entry_dir.iterdir())
        assert on_disk == sorted([manifests.MANIFEST_FILE, *(f.name for f in manifest.files)])
        for record in manifest.files:
            assert arrays.checksum(entry_dir / record.name) == (record.bytes, record.checksum)
    assert [f.name for f in manifests.read(memoized).files] == ["data.npy", "leaf_1.npy"]


def test_the_json_form_reads_back_to_the_same_manifest(memoized):
    manifest = manifests.read(memoized)
    again = manifests.loads(manifests.dumps(manifest), memoized / manifests.MANIFEST_FILE,
                            memoized.name)
    assert again == manifest
    raw = manifest.to_json()
    assert raw["shape"] == list(manifest.files[0].shape) == [2, 3]
    assert raw["dtype"] == manifest.files[0].dtype


def test_an_entry_exposes_the_same_json_as_its_manifest(cache):
    entry = cache.map(lambda v: np.full(2, v, np.int8), pd.Series([1, 2]), version="1")
    assert entry.manifest == json.loads((entry.path / manifests.MANIFEST_FILE).read_text())
    assert isinstance(entry, cachekit.Entry) and entry.source == "built"


BAD_FILES = {
    "a path as a name": lambda f: {**f, "name": "../../etc/passwd"},
    "another name": lambda f: {**f, "name": "leaf_1.npy"},
    "negative size": lambda f: {**f, "bytes": -1},
    "size below the data": lambda f: {**f, "bytes": 3},
    "checksum of another kind": lambda f: {**f, "checksum": "md5:" + "0" * 32},
    "object dtype": lambda f: {**f, "dtype": "|O"},
    "a dtype numpy does not know": lambda f: {**f, "dtype": "<u3"},
    "a dtype that is not text": lambda f: {**f, "dtype": 1},
    "unknown leaf kind": lambda f: {**f, "kind": "pickle"},
    "not an object": lambda f: [f],
}


@pytest.mark.parametrize("how", sorted(BAD_FILES))
def test_a_bad_file_record_is_corrupt(cache, how):
    entry = cache.map(lambda v: np.full(2, v, np.int8), pd.Series([1, 2]), version="1")
    raw = dict(entry.manifest)
    raw["files"] = [BAD_FILES[how](raw["files"][0])]
    with pytest.raises(CacheCorruptError):
        manifests.Manifest.from_json(raw, entry.path / manifests.MANIFEST_FILE, entry.key)


def test_a_record_knows_its_dtype_as_numpy_does():
    """Plain numbers' dtypes are known without numpy (a listing does not import it), the
    others through it: every dtype text numpy reads gives numpy's item size and name."""
    texts = [f"{order}{code}{size}" for order in "<>|=" for code in "biufcmMUSV"
             for size in range(1, 17)] + ["<M8[ns]", ">m8[s]"]
    known = 0
    for text in texts:
        try:
            dtype = np.dtype(text)
        except TypeError:
            continue
        record = manifests.FileRecord("data.npy", (3,), text, 1024, "blake2b-128:" + "0" * 32)
        assert (record.data_bytes, record.dtype_name) == (3 * dtype.itemsize, dtype.name), text
        known += 1
    assert known > 40


def test_a_manifest_larger_than_the_limit_is_corrupt(memoized, monkeypatch):
    size = (memoized / manifests.MANIFEST_FILE).stat().st_size
    monkeypatch.setattr(manifests, "MANIFEST_LIMIT", size)
    assert manifests.read(memoized).key == memoized.name
    monkeypatch.setattr(manifests, "MANIFEST_LIMIT", size - 1)
    with pytest.raises(CacheCorruptError, match=f"larger than {size - 1} bytes"):
        manifests.read(memoized)


def test_a_manifest_is_never_written_over_an_existing_file(tmp_path, memoized):
    manifest = manifests.read(memoized)
    (tmp_path / manifests.MANIFEST_FILE).write_text("someone else's")
    with pytest.raises(FileExistsError), _fs.DirHandle.open(tmp_path) as directory:
        manifests.write_at(directory, manifest)
    assert (tmp_path / manifests.MANIFEST_FILE).read_text() == "someone else's"


def test_a_per_row_entry_lists_its_row_files_after_its_data(cache):
    entry = cache.map(lambda v: np.full(2, v, np.int8), pd.Series([1, 2, 3]), version="1")
    manifest = manifests.read(entry.path)
    assert [f.name for f in manifest.files] == ["data.npy", "row_ids.npy", "row_blocks.npy"]
    assert manifest.row_file(manifests.ROW_IDS_FILE).shape == (3, 2)
    assert manifest.row_file(manifests.ROW_STATS_FILE) is None  # a map has no files to stat
    assert manifest.reuse is not None and keys_like(manifest.reuse.recipe)
    assert manifest.origin == manifests.Origin((), 3, 0)
    again = manifests.loads(manifests.dumps(manifest), entry.path / manifests.MANIFEST_FILE,
                            entry.key)
    assert again == manifest


def keys_like(text: str) -> bool:
    from cachekit.key_names import is_key

    return is_key(text)


BAD_ROW_FIELDS = {
    "row files out of order": lambda m: {**m, "files": [m["files"][0], m["files"][2],
                                                        m["files"][1]]},
    "a row file twice": lambda m: {**m, "files": [m["files"][0], m["files"][1],
                                                  m["files"][1]]},
    "a row file first": lambda m: {**m, "files": [m["files"][1], m["files"][0]]},
    "a recipe that is not hex": lambda m: {**m, "reuse": {**m["reuse"], "recipe": "../x"}},
    "no block rows": lambda m: {**m, "reuse": {**m["reuse"], "block_rows": 0}},
    "an origin naming a path": lambda m: {**m, "origin": {**m["origin"], "decoded": 2,
                                                          "reused": [["../etc", 1]]}},
    "an origin of another kind": lambda m: {**m, "origin": [3, 0]},
    "an origin of negative rows": lambda m: {**m, "origin": {**m["origin"], "joined": -1,
                                                             "decoded": 4}},
}


@pytest.mark.parametrize("how", sorted(BAD_ROW_FIELDS))
def test_bad_row_fields_are_corrupt(cache, how):
    entry = cache.map(lambda v: np.full(2, v, np.int8), pd.Series([1, 2, 3]), version="1")
    raw = BAD_ROW_FIELDS[how](dict(entry.manifest))
    with pytest.raises(CacheCorruptError):
        manifests.Manifest.from_json(raw, entry.path / manifests.MANIFEST_FILE, entry.key)


def test_a_memoize_entry_has_no_row_files(memoized):
    raw = manifests.read(memoized).to_json()
    assert "reuse" not in raw and "origin" not in raw
    with pytest.raises(CacheCorruptError):
        manifests.Manifest.from_json({**raw, "reuse": {"recipe": "0" * 32, "block_rows": 1}},
                                     memoized / manifests.MANIFEST_FILE, memoized.name)


def _fold_of_a_map(cache) -> cachekit.Entry:
    def row(v):
        return np.full(2, v, np.int8)

    cache.map(row, pd.Series([1, 2, 3]), version="1")
    fold = cache.map(row, pd.Series([3, 1]), version="1")
    assert (fold.rows_decoded, fold.rows_reused) == (0, 2)
    return fold


def test_a_derived_entry_that_decoded_no_row_lists_its_row_map_first_and_no_data_file(cache):
    fold = _fold_of_a_map(cache)
    manifest = manifests.read(fold.path)
    (part,) = manifest.parts
    ids = manifests.sidecar_name(part.name, manifests.ROW_IDS_FILE)
    assert [f.name for f in manifest.files] == [manifests.ROW_MAP_FILE, *sorted([part.name, ids])]
    assert manifest.own is None and manifest.parts_only and manifest.data_files == (part,)
    assert (manifest.shape, manifest.dtype) == ((2, 2), np.dtype(np.int8))
    assert (fold.manifest["shape"], fold.manifest["dtype"]) == ([2, 2], "|i1")
    np.testing.assert_array_equal(np.asarray(fold.array), [[3, 3], [1, 1]])
    again = manifests.loads(manifests.dumps(manifest), fold.path / manifests.MANIFEST_FILE,
                            fold.key)
    assert again == manifest


def _empty_data(m):
    empty = {"name": "data.npy", "shape": [0, 2], "dtype": "|i1", "bytes": 128,
             "checksum": "blake2b-128:" + "0" * 32, "kind": "numpy"}
    return {**m, "files": [empty, *m["files"]]}


BAD_DERIVED = {
    "an empty data file": _empty_data,
    "a row map without parts": lambda m: {**m, "files": m["files"][:1]},
    "a part first": lambda m: {**m, "files": [*m["files"][1:2], m["files"][0],
                                              *m["files"][2:]]},
    "a dtype not its parts'": lambda m: {**m, "dtype": "|u1"},
}


@pytest.mark.parametrize("how", sorted(BAD_DERIVED))
def test_a_derived_entry_of_another_layout_is_corrupt(cache, how):
    fold = _fold_of_a_map(cache)
    raw = BAD_DERIVED[how](dict(fold.manifest))
    with pytest.raises(CacheCorruptError):
        manifests.Manifest.from_json(raw, fold.path / manifests.MANIFEST_FILE, fold.key)


def test_a_manifest_pickles_without_what_it_derives_and_derives_it_again(cache):
    import pickle

    fold = _fold_of_a_map(cache)
    manifest = manifests.read(fold.path)
    part = manifest.parts[0]
    ids = manifests.sidecar_name(part.name, manifests.ROW_IDS_FILE)
    assert manifest.row_file(ids) is not None and manifest.failed().shape == (2,)
    assert manifest.data_files == (part,)
    state = manifest.__getstate__()
    assert not set(state) & manifests._DERIVED and set(manifests._DERIVED) <= set(
        manifest.__dict__)  # each was made above, and none is pickled
    clone = pickle.loads(pickle.dumps(manifest))
    assert clone == manifest and clone.row_file(ids) == manifest.row_file(ids)
    assert clone.data_files == (part,) and clone.row_file(manifests.DATA_FILE) is None
