"""Tests for @cache.memoize: keys, stored structures, failures, and several interpreters."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from helpers import assert_cache_as_it_was, load_module
from cachekit import arrays, memoize
from cachekit.store import manifest as manifests
from cachekit.errors import CacheCorruptError

FRAME = pd.DataFrame({"img_path": ["a.jpg", "b.jpg", "c.jpg"], "label": [0, 1, 0]})


# --- keys -------------------------------------------------------------------------------------


def test_defaults_are_applied_before_keying(cache):
    @cache.memoize
    def prep(df, size=32, mode="RGB"):
        return np.zeros(size)

    key = prep.cache_key(FRAME)
    assert prep.cache_key(FRAME, size=32) == key
    assert prep.cache_key(FRAME, 32) == key
    assert prep.cache_key(df=FRAME, mode="RGB", size=32) == key
    assert prep.cache_key(FRAME, size=64) != key
    with pytest.raises(TypeError):
        prep.cache_key(FRAME, bogus=1)  # binding errors are the usual TypeError


def test_ignored_arguments_are_left_out_of_the_key(cache):
    @cache.memoize(ignore=("verbose", "log"))
    def prep(df, size=32, verbose=False, log=None):
        return np.zeros(size)

    key = prep.cache_key(FRAME)
    assert prep.cache_key(FRAME, verbose=True, log=print) == key  # print is not encodable
    assert prep.cache_key(FRAME, size=16) != key
    with pytest.raises(ValueError, match="not parameters"):
        cache.memoize(ignore=("verbos",))(lambda df, verbose=False: np.zeros(1))


def test_version_changes_the_key(cache):
    def prep(x):
        return np.asarray(x)

    keys_ = {cache.memoize(prep).cache_key(1), cache.memoize(version="2")(prep).cache_key(1),
             cache.memoize(version="3")(prep).cache_key(1)}
    assert len(keys_) == 3


def test_editing_the_source_changes_the_key(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "userfeatures.py"
    body = "import numpy as np\n\ndef features(x):\n    return np.asarray(x) * {}\n"
    double = cache.memoize(load_module(path, "userfeatures", body.format(2)).features)
    assert double(np.arange(3)).tolist() == [0, 2, 4]
    triple = cache.memoize(load_module(path, "userfeatures", body.format(3)).features)
    assert triple.cache_key(np.arange(3)) != double.cache_key(np.arange(3))
    assert triple(np.arange(3)).tolist() == [0, 3, 6]


def test_dict_order_does_not_matter(cache):
    @cache.memoize
    def prep(options, **extra):
        return np.zeros(1)

    assert (prep.cache_key({"size": 32, "mode": "L"}, a=1, b=2)
            == prep.cache_key({"mode": "L", "size": 32}, b=2, a=1))
    assert prep.cache_key({"size": 32}) != prep.cache_key({"size": 33})
    assert prep.cache_key([1, 2]) != prep.cache_key((1, 2))


def test_dataframe_keys_follow_values_columns_and_dtypes_not_the_index(cache):
    @cache.memoize
    def prep(df):
        return np.zeros(len(df))

    key = prep.cache_key(FRAME)
    assert prep.cache_key(FRAME.copy()) == key
    assert prep.cache_key(FRAME.set_axis([10, 11, 12])) == key
    assert prep.cache_key(FRAME.rename(columns={"img_path": "path"})) != key
    assert prep.cache_key(FRAME.astype({"label": "float64"})) != key
    assert prep.cache_key(FRAME.iloc[::-1].reset_index(drop=True)) != key
    assert prep.cache_key(FRAME[["label", "img_path"]]) != key
    assert prep.cache_key(FRAME["img_path"]) != key  # a Series is not the frame


def test_arrays_and_tensors_are_keyed_by_dtype_shape_and_bytes(cache):
    import torch

    @cache.memoize
    def prep(x):
        return np.zeros(1)

    base = np.arange(6, dtype=np.int64)
    key = prep.cache_key(base)
    assert prep.cache_key(base.copy()) == key
    assert prep.cache_key(base.astype(np.int32)) != key
    assert prep.cache_key(base.reshape(2, 3)) != key
    assert prep.cache_key(base + 1) != key
    assert prep.cache_key(torch.arange(6)) != key  # a tensor is not an array
    assert prep.cache_key(torch.arange(6)) == prep.cache_key(torch.arange(6))


@pytest.mark.parametrize("bad", [object(), {1, 2}, [1, object()], pd.Index([1, 2])],
                         ids=["object", "set", "list-of-object", "index"])
def test_unsupported_arguments_name_the_argument_and_suggest_ignore(cache, cache_root, bad):
    calls = []

    @cache.memoize
    def prep(df, helper=None):
        calls.append(1)
        return np.zeros(1)

    with pytest.raises(TypeError, match=r"argument 'helper' of .*prep.*ignore=\('helper',\)"):
        prep(FRAME, helper=bad)
    assert calls == [] and not cache_root.exists()
    assert cache.memoize(ignore=("helper",))(prep.__wrapped__)(FRAME, helper=bad).shape == (1,)


def test_cache_key_does_not_call_the_function_and_names_the_entry(cache, cache_root):
    calls = []

    @cache.memoize
    def prep(x):
        calls.append(x)
        return np.full(2, x)

    key = prep.cache_key(5)
    assert calls == [] and not cache_root.exists()
    prep(5)
    assert [p.name for p in (cache_root / "entries").iterdir()] == [key]


# --- stored structures ------------------------------------------------------------------------


def _structures():
    import torch

    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {
        "array": array,
        "fortran-array": np.asfortranarray(array.astype(np.int16)),
        "strided-view": np.arange(20)[::3],
        "0-d": np.array(2.5),
        "empty": np.zeros((0, 3), np.uint8),
        "bool": np.array([True, False]),
        "tensor": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "tensor-t": torch.arange(6.0).reshape(2, 3).t(),
        "tuple": (array, torch.ones(2, dtype=torch.bool)),
        "list": [array[0], array[1], np.zeros(0)],
        "dict": {"x": array, "y": torch.zeros(1, 2), "labels": np.array([1, 0, 1])},
        "nested": {"pair": (array, [np.array(1)]), "empty": [], "t": torch.tensor(7)},
    }


def _same(stored, original) -> None:
    import torch

    if type(original) in (tuple, list, dict):
        assert type(stored) is type(original)
    if isinstance(original, (tuple, list)):
        assert len(stored) == len(original)
        for s, o in zip(stored, original):
            _same(s, o)
    elif isinstance(original, dict):
        assert list(stored) == list(original)
        for k in original:
            _same(stored[k], original[k])
    elif isinstance(original, torch.Tensor):
        assert isinstance(stored, torch.Tensor) and stored.dtype == original.dtype
        assert torch.equal(stored, original)
    else:
        assert isinstance(stored, np.ndarray) and not stored.flags.writeable
        assert stored.dtype == original.dtype and stored.shape == original.shape
        assert np.array_equal(stored, original)


@pytest.mark.parametrize("name", list(_structures()))
def test_every_supported_structure_round_trips(cache, name):
    original = _structures()[name]
    calls = []

    @cache.memoize(version=name)
    def produce():
        calls.append(1)
        return _structures()[name]

    built, hit = produce(), produce()
    assert len(calls) == 1
    _same(built, original)
    _same(hit, original)


def test_arrays_come_back_read_only_and_tensors_writable_without_touching_the_file(cache):
    import torch

    @cache.memoize
    def produce():
        return np.arange(4), torch.arange(4)

    array, tensor = produce()
    assert isinstance(array, np.memmap)
    with pytest.raises(ValueError):
        array[0] = 9
    tensor[0] = 9  # copy-on-write: no warning (warnings are errors here), no change on disk
    assert tensor[0] == 9
    assert produce()[1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [
    1.5, "text", None, np.float64(2.0), np.array([object()]), {1: np.zeros(1)},
    collections.namedtuple("Pair", "a b")(np.zeros(1), np.zeros(1)), (), {"a": []},
    np.ma.masked_array([1, 2], mask=[0, 1]), (np.zeros(1), 3),
], ids=["float", "str", "none", "numpy-scalar", "object-array", "int-key", "namedtuple",
        "empty-tuple", "no-arrays", "masked", "tuple-with-int"])
def test_unsupported_returns_raise_type_error_and_write_nothing(cache, cache_root, bad):
    calls = []

    @cache.memoize(version="1")  # `bad` cannot be keyed as a captured value
    def produce():
        calls.append(1)
        return bad

    with pytest.raises(TypeError, match="returned|Python objects|str keys"):
        produce()
    assert calls == [1]
    assert_cache_as_it_was(cache_root)


def test_a_tensor_without_a_numpy_dtype_is_rejected(cache, cache_root):
    import torch

    @cache.memoize
    def produce():
        return torch.zeros(2, dtype=torch.bfloat16)

    with pytest.raises(TypeError, match=r"result.*\.float\(\)"):
        produce()
    assert_cache_as_it_was(cache_root)


# --- failures ---------------------------------------------------------------------------------


class LabelError(Exception):
    pass


def test_an_exception_in_the_function_propagates_unchanged_and_leaves_nothing(cache,
                                                                               cache_root):
    raised = []

    @cache.memoize
    def prep(df):
        raised.append(LabelError(f"bad label in {len(df)} rows"))
        raise raised[-1]

    with pytest.raises(LabelError) as info:
        prep(FRAME)
    assert info.value is raised[0]
    assert_cache_as_it_was(cache_root)
    with pytest.raises(LabelError):
        prep(FRAME)  # nothing was cached: the function runs again
    assert len(raised) == 2


def test_a_running_call_is_described_by_its_full_owner_record(cache, cache_root):
    """While the function runs, its build directory holds the builder's record (pid
    namespace and start time too) and a heartbeat file, as other processes judge it by."""
    from cachekit import processes
    from cachekit.store import build_dirs

    seen = []

    @cache.memoize(version="1")  # (its closure holds a path, which no key encodes)
    def prep(n):
        (build,) = (cache_root / "tmp").iterdir()
        seen.append(json.loads((build / build_dirs.STATE_FILE).read_text()))
        assert (build / build_dirs.HEARTBEAT_FILE).is_file()
        return np.arange(n)

    prep(3)
    assert seen and {k: seen[0][k] for k in processes.owner()} == processes.owner()


def test_a_truncated_leaf_is_reported_as_corrupt(cache, cache_root):
    @cache.memoize
    def produce():
        return np.arange(10), np.arange(100)

    produce()
    leaf = cache_root / "entries" / produce.cache_key() / "leaf_1.npy"
    with open(leaf, "r+b") as f:
        f.truncate(leaf.stat().st_size - 8)
    with pytest.raises(CacheCorruptError, match="leaf_1.npy"):
        produce()


def test_every_leaf_file_is_checksummed_in_the_manifest(cache, cache_root):
    @cache.memoize
    def produce():
        return {"a": np.arange(3), "b": np.ones((2, 2)), "c": np.array(1)}

    produce()
    entry_dir = cache_root / "entries" / produce.cache_key()
    manifest = manifests.read(entry_dir)
    assert [f.name for f in manifest.files] == ["data.npy", "leaf_1.npy", "leaf_2.npy"]
    for record in manifest.files:
        assert arrays.checksum(entry_dir / record.name) == (record.bytes, record.checksum)
        assert record.open(entry_dir).shape == record.shape
    assert manifest.params["function"]["qualname"].endswith("produce")


def test_manifest_checks_stay_strict_for_other_kinds(cache, cache_root):
    @cache.memoize
    def scalar_first():
        return np.array(3.0), np.arange(2)

    assert scalar_first()[0] == 3.0  # a 0-d first leaf: one row, shape []
    entry_dir = cache_root / "entries" / scalar_first.cache_key()
    raw = manifests.read(entry_dir).to_json()
    assert (raw["rows"], raw["shape"]) == (1, [])
    path = entry_dir / manifests.MANIFEST_FILE
    check = manifests.Manifest.from_json
    with pytest.raises(CacheCorruptError, match="does not start with rows"):
        check({**raw, "kind": "map", "files": raw["files"][:1], "structure": None}, path)
    first, second = raw["files"]
    for bad_files in ([], [{**first, "name": "../x.npy"}], [first, {**second, "kind": "pickle"}],
                      [first, {**second, "name": "leaf_2.npy"}]):
        with pytest.raises(CacheCorruptError):
            check({**raw, "files": bad_files}, path)
    with pytest.raises(CacheCorruptError, match="checksum"):
        check({**raw, "files": [first, {**second, "checksum": None}]}, path)
    with pytest.raises(CacheCorruptError, match="structure"):
        memoize.load(entry_dir, check({**raw, "structure": {"array": 5}}, path))


# --- the decorated function -------------------------------------------------------------------


_NEVER_WRITTEN = cachekit.Cache("/nonexistent/cachekit-test-root", progress=False)


@_NEVER_WRITTEN.memoize(version="1")
def decorated_prep(df, size=8):
    """Docstring kept."""
    return np.zeros(size)


def test_wraps_keeps_name_doc_and_wrapped_and_pickles():
    assert decorated_prep.__name__ == "decorated_prep"
    assert decorated_prep.__doc__ == "Docstring kept."
    assert decorated_prep.__wrapped__(FRAME, 3).shape == (3,)
    assert pickle.loads(pickle.dumps(decorated_prep)) is decorated_prep  # DataLoader workers
    assert len(decorated_prep.cache_key(FRAME)) == 32


def test_methods_can_ignore_self(cache):
    class Features:
        calls = 0

        @cache.memoize(ignore="self")
        def compute(self, x):
            Features.calls += 1
            return np.full(3, x)

    assert Features().compute(4).tolist() == [4, 4, 4]
    assert Features().compute(4).tolist() == [4, 4, 4]
    assert Features.calls == 1


# --- several interpreters ---------------------------------------------------------------------

USER_MODULE = textwrap.dedent("""
    import os, time
    import numpy as np
    import cachekit

    cache = cachekit.Cache(os.environ["CACHE_ROOT"], workers=2, progress=False)

    def _count(what):
        with open(os.environ["COUNT_FILE"], "a") as f:  # one line per execution, any process
            f.write(f"{what} {os.getpid()}\\n")

    @cache.memoize
    def features(df, size=4):
        _count("memoize")
        time.sleep(0.3)  # keep the build open so the other interpreters miss too
        return {"x": np.outer(df["n"].to_numpy(), np.arange(size)), "n": np.asarray(len(df))}

    def row(n):
        _count("map")
        time.sleep(0.01)
        return np.array([n, n * n], dtype=np.int64)
""")

AGENT = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd

    work, me = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(work))
    import userprep

    def barrier(name):
        (work / f"{name}.ready.{me}").touch()
        while not (work / name).exists():
            time.sleep(0.002)

    df = pd.DataFrame({"n": range(24)})
    barrier("go-memoize")
    out = userprep.features(df)
    barrier("go-map")
    entry = userprep.cache.map(userprep.row, df["n"])
    sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    print(json.dumps({"pid": os.getpid(), "memoize": sha(out["x"]), "map": sha(entry.array),
                      "map_hit": entry.hit, "map_key": entry.key}))
""")


def _release(work: Path, name: str, agents: list[subprocess.Popen]) -> None:
    """Open the start barrier ``name`` once every agent is waiting at it."""
    while len(list(work.glob(f"{name}.ready.*"))) < len(agents):
        for agent in agents:
            if agent.poll() is not None:
                pytest.fail(f"agent exited early: {agent.communicate()[1]}")
        time.sleep(0.01)
    (work / name).touch()


def test_four_interpreters_share_one_execution_of_memoize_and_of_map(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "userprep.py").write_text(USER_MODULE)
    (work / "agent.py").write_text(AGENT)
    count = tmp_path / "executions.txt"
    env = {**os.environ, "CACHE_ROOT": str(tmp_path / "cache"), "COUNT_FILE": str(count),
           "PYTHONDONTWRITEBYTECODE": "1"}
    agents = [subprocess.Popen([sys.executable, str(work / "agent.py"), str(work), str(i)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
              for i in range(4)]
    try:
        _release(work, "go-memoize", agents)
        _release(work, "go-map", agents)
        reports = []
        for agent in agents:
            out, err = agent.communicate(timeout=120)
            assert agent.returncode == 0, err
            reports.append(json.loads(out))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()

    executions = collections.Counter(line.split()[0] for line in count.read_text().splitlines())
    assert executions == {"memoize": 1, "map": 24}  # one build each, whoever ran it
    map_builders = {line.split()[1] for line in count.read_text().splitlines()
                    if line.startswith("map")}
    assert len(map_builders) == 1
    assert [r["map_hit"] for r in reports].count(False) == 1
    assert len({r["memoize"] for r in reports}) == 1
    assert len({(r["map"], r["map_key"]) for r in reports}) == 1
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
