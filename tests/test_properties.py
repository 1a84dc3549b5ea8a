"""Property-based tests (hypothesis): the key encoding, the manifest round trip, and resuming
a fill from any row.

Injectivity of ``keys.encode`` is shown constructively: a decoder written here from the
encoding's documentation parses every encoding back to a value identical to the original
(same types, floats bit for bit), so two different values can never share an encoding.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachekit import _fs, keys
from cachekit.engine.filling.builder import DeadBuilds, fill as fill_build
from cachekit.engine.filling.claimed import RowSpec
from cachekit.engine.filling import plan
from cachekit.store import manifest as manifests

# --- the key encoding ------------------------------------------------------------------------

any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=12)  # surrogates too
hashable = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=5)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text | st.binary(max_size=12),
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(hashable, inner, max_size=4)),
    max_leaves=16)


def decode(data: bytes):
    value, end = _decode(data, 0)
    assert end == len(data), "trailing bytes"
    return value


def _length(data: bytes, at: int) -> tuple[int, int]:
    colon = data.index(b":", at)
    return int(data[at:colon]), colon + 1


def _decode(data: bytes, at: int):
    tag, at = data[at:at + 1], at + 1
    if tag == b"N":
        return None, at
    if tag in (b"T", b"F"):
        return tag == b"T", at
    if tag == b"i":
        end = data.index(b";", at)
        return int(data[at:end]), end + 1
    if tag == b"f":
        return struct.unpack(">d", data[at:at + 8])[0], at + 8
    if tag in (b"s", b"b"):
        size, at = _length(data, at)
        raw = data[at:at + size]
        assert len(raw) == size
        return (raw.decode("utf-8", "surrogatepass") if tag == b"s" else raw), at + size
    if tag in (b"l", b"t", b"d"):
        count, at = _length(data, at)
        items = []
        for _ in range(count * (2 if tag == b"d" else 1)):
            item, at = _decode(data, at)
            items.append(item)
        if tag == b"d":
            return dict(zip(items[::2], items[1::2])), at
        return (items if tag == b"l" else tuple(items)), at
    raise AssertionError(f"unknown tag {tag!r} at {at - 1}")


def same(a, b) -> bool:
    """Identical as key material: same types throughout, floats bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(same(ka, kb) and same(va, vb) for kb, vb in b.items()) for ka, va in a.items())
    return a == b


@settings(max_examples=150)
@given(values)
def test_every_encoding_decodes_back_to_its_value_so_encode_is_injective(value):
    assert same(decode(keys.encode(value)), value)


@settings(max_examples=100)
@given(values, values)
def test_different_values_have_different_encodings_and_digests(a, b):
    if not same(a, b):
        assert keys.encode(a) != keys.encode(b)
        assert keys.digest(a) != keys.digest(b)


@settings(max_examples=60)
@given(st.dictionaries(hashable, values, max_size=6).flatmap(
    lambda d: st.tuples(st.just(d), st.permutations(list(d.items())))))
def test_dict_order_is_irrelevant(case):
    original, shuffled = case
    assert keys.encode(dict(shuffled)) == keys.encode(original)
    assert keys.digest(dict(shuffled)) == keys.digest(original)


@settings(max_examples=60)
@given(values)
def test_encoding_is_deterministic(value):
    import copy

    assert keys.encode(value) == keys.encode(copy.deepcopy(value))
    assert keys.digest(value) == keys.digest(value)


GENERATOR = textwrap.dedent("""
    import random

    def generate(rng, depth=0):
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0: return None
        if kind == 1: return rng.random() < 0.5
        if kind == 2: return rng.randrange(-2**70, 2**70)
        if kind == 3: return rng.choice([0.0, -0.0, 1.5, float("inf"), float("nan"), 1e-300])
        if kind == 4: return "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(5))
        if kind == 5: return bytes(rng.randrange(256) for _ in range(rng.randrange(6)))
        if kind == 6: return [generate(rng, depth + 1) for _ in range(rng.randrange(4))]
        if kind == 7: return tuple(generate(rng, depth + 1) for _ in range(rng.randrange(4)))
        return {f"k{rng.randrange(50)}": generate(rng, depth + 1) for _ in range(rng.randrange(4))}

    VALUES = [generate(random.Random(seed)) for seed in range(60)]
""")


def test_two_interpreters_with_different_hash_seeds_agree_on_every_digest():
    namespace: dict = {}
    exec(GENERATOR, namespace)  # the same generator, run here and in the child
    here = [keys.digest(v) for v in namespace["VALUES"]]
    child = GENERATOR + "\nfrom cachekit import keys\nprint([keys.digest(v) for v in VALUES])"
    for seed in ("1", "4242"):
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.replace("'", '"')) == here


# --- the manifest round trip ------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers()
                | st.floats(allow_nan=False, allow_infinity=False) | any_text)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(any_text, inner, max_size=3), max_leaves=10)


hex_text = st.text("0123456789abcdef", min_size=32, max_size=32)


@st.composite
def manifest_objects(draw):
    rows = draw(st.integers(0, 5000))
    shape = (rows, *draw(st.lists(st.integers(0, 64), max_size=3)))
    dtype = draw(st.sampled_from(["|u1", "<f4", "<i8", "|b1", ">f8", "<c16", "<M8[ns]"]))
    data_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    failed = sorted(draw(st.sets(st.integers(0, rows - 1), max_size=5))) if rows else []
    record = manifests.FileRecord(manifests.DATA_FILE, shape, dtype,
                                  data_bytes + draw(st.integers(0, 4096)),
                                  "blake2b-128:" + draw(hex_text))
    return manifests.Manifest(
        key=draw(hex_text), kind=draw(st.sampled_from(["images", "map"])), rows=rows,
        files=(record,), created=draw(st.floats(0, 4e9)),
        failed_rows=tuple((row, draw(any_text), draw(any_text)) for row in failed),
        column=draw(st.none() | any_text),
        params=draw(st.dictionaries(any_text, json_values, max_size=4)),
        builder={"host": draw(any_text), "pid": draw(st.integers(1, 1 << 22))},
        build_seconds=draw(st.floats(0, 1e6)), cachekit_version=draw(any_text))


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(manifest_objects())
def test_a_written_manifest_reads_back_equal(manifest):
    with tempfile.TemporaryDirectory() as tmp:
        entry_dir = Path(tmp) / manifest.key
        entry_dir.mkdir()
        with _fs.DirHandle.open(entry_dir) as directory:
            manifests.write_at(directory, manifest)
        assert manifests.read(entry_dir) == manifest
        assert [p.name for p in entry_dir.iterdir()] == [manifests.MANIFEST_FILE]


# --- .npy headers -------------------------------------------------------------------------------

npy_dtypes = st.sampled_from(["|u1", "<u2", ">u4", "<i8", "<f4", ">f8", "|b1", "<c16", "<U3",
                              "|S2", "<m8[s]", [("a", "<i4"), ("b", "|u1")]])


@given(npy_dtypes, st.lists(st.integers(0, 3), max_size=4), st.booleans())
def test_every_header_reads_as_numpy_reads_it(dtype, shape, version_2):
    """The plain headers cachekit parses itself (a fast path) and all others, which numpy
    parses, give numpy's shape, dtype and data offset."""
    import io

    from cachekit import arrays

    array = np.zeros(shape, dtype)
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=(2, 0) if version_2 else (1, 0))
    buffer.seek(0)
    np.lib.format.read_magic(buffer)
    read = (np.lib.format.read_array_header_2_0 if version_2
            else np.lib.format.read_array_header_1_0)
    want_shape, _, want_dtype = read(buffer)
    assert arrays._header(buffer, Path("x.npy")) == (tuple(want_shape), want_dtype)
    assert buffer.tell() == len(buffer.getvalue()) - array.nbytes


# --- resuming a fill from any row --------------------------------------------------------------

class Stop(KeyboardInterrupt):
    """Ends a fill the way Ctrl-C does, leaving its checkpoint behind."""


def _progress(directory: _fs.DirHandle) -> Optional[tuple[Any, tuple[int, ...]]]:
    """(plan, done chunks) of the stopped fill of ``directory``'s ``data.npy``, as its
    journal says; None without one (stopped while looking for the row shape)."""
    from cachekit.engine.filling.journal import Journal

    try:
        with Journal.open(directory, "data.npy") as journal:
            return journal.plan, tuple(journal.done(drop_bad=False))
    except (OSError, ValueError):
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_fill_stopped_at_any_row_resumes_to_the_same_result(data):
    """Whatever chunks were done when a fill stopped (with several workers, not always a
    prefix), the resumed fill computes exactly the others and ends with the same bytes."""
    n = data.draw(st.integers(1, 30), label="rows")
    chunk = data.draw(st.integers(1, 7), label="chunk")
    stop = data.draw(st.integers(0, n - 1), label="stop at")
    workers = data.draw(st.integers(1, 3), label="workers")
    bad = data.draw(st.sets(st.integers(0, n - 1), max_size=4), label="failing rows")
    with_template = data.draw(st.booleans(), label="template")
    computed: list[int] = []

    def row(value, stop_at=None):
        if value == stop_at:
            raise Stop
        if value in bad:
            raise ValueError(f"bad {value}")
        computed.append(value)
        return np.array([value, -value], dtype=np.int32)

    template = ((2,), np.dtype(np.int32)) if with_template else None
    if not with_template and len(bad) == n:
        bad = set(list(bad)[:-1])
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(plan, "MAX_CHUNK_ROWS", chunk), \
            mock.patch.object(plan, "PAGE_BYTES", 1), \
            mock.patch.object(plan, "CHUNKS_PER_WORKER", 1), \
            _fs.DirHandle.open(tmp) as directory:
        rows = RowSpec(workers=workers, record=True, template=template, key="k")
        straight = fill_build(directory, "straight.npy", list(range(n)), row, rows=rows)
        for name in ("stopped", "resumed"):
            directory.mkdir(name, 0o700)
        with directory.child("stopped") as stopped, directory.child("resumed") as fresh:
            with pytest.raises(Stop):
                fill_build(stopped, "data.npy", list(range(n)), lambda v: row(v, stop), rows=rows)
            progress = _progress(stopped)
            source = Path(tmp) / "stopped" / "data.npy"
            before = source.read_bytes() if source.exists() else None
            computed.clear()
            resumed = fill_build(fresh, "data.npy", list(range(n)), row, rows=rows,
                                 resuming=DeadBuilds(dead=[stopped]))
            if before is not None:  # the dead fill is read, never written
                assert source.read_bytes() == before
        out = Path(tmp) / "resumed" / "data.npy"
        if progress is not None:  # None: stopped while looking for the row shape
            planned, done = progress
            assert planned.chunk_of(stop).index not in done
            assert sorted(computed) == [v for v in range(n) if v // planned.chunk_rows
                                        not in done and v not in bad]
        assert resumed.failures == straight.failures
        assert (resumed.shape, resumed.dtype) == (straight.shape, straight.dtype)
        np.testing.assert_array_equal(np.load(out, allow_pickle=False),
                                      np.load(Path(tmp) / "straight.npy", allow_pickle=False))
