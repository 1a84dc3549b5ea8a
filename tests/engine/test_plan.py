"""The build plan: page-aligned chunks in one .npy file that numpy still reads."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cachekit import _fs, arrays
from cachekit.engine.filling import plan as plans
from cachekit.engine.filling.plan import Chunk, Plan, make_plan

DTYPES = ["u1", "i2", "<u2", ">i4", "<f4", "<f8", "c16", "?", "<U3", "S5", "V7"]
"""Plain dtypes, as entries store them (by ``dtype.str``; structured ones are not stored)."""

row_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(0, 20_000), row_shape=row_shapes, dtype=st.sampled_from(DTYPES),
       workers=st.integers(1, 64), page=st.sampled_from([4096, 16384, 65536]))
def test_chunks_cover_every_row_once_and_start_on_a_page(rows, row_shape, dtype, workers, page):
    dtype = np.dtype(dtype)
    planned = make_plan("k" * 32, rows, row_shape, dtype, workers, offset=page, page=page)
    chunks = planned.chunks
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert sum(c.rows for c in chunks) == rows
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
    assert not chunks or (chunks[0].start == 0 and chunks[-1].stop == rows)
    row_bytes = math.prod(row_shape) * dtype.itemsize
    unit = page // math.gcd(row_bytes, page) if row_bytes else 1
    assert planned.chunk_rows % unit == 0
    for chunk in chunks:
        first, end = planned.byte_range(chunk)
        assert first % page == 0  # every chunk starts on a page of its own
        assert chunk is chunks[-1] or end % page == 0
        assert planned.chunk_of(chunk.start) == chunk == planned.chunk_of(chunk.stop - 1)
    if unit <= plans.MAX_CHUNK_ROWS and row_bytes * unit <= plans.MAX_CHUNK_BYTES:
        assert planned.chunk_rows <= max(plans.MAX_CHUNK_ROWS, unit)
        assert planned.chunk_rows * row_bytes <= max(plans.MAX_CHUNK_BYTES, unit * row_bytes)
    if rows >= unit * plans.CHUNKS_PER_WORKER * workers and planned.chunk_rows > unit:
        assert len(chunks) >= plans.CHUNKS_PER_WORKER * workers  # several per worker
    assert Plan.from_json(planned.to_json()) == planned


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(0, 300), row_shape=row_shapes, dtype=st.sampled_from(DTYPES),
       align=st.sampled_from([64, 4096, 16384]))
def test_a_page_padded_header_is_a_valid_npy_header(rows, row_shape, dtype, align):
    dtype = np.dtype(dtype)
    shape = (rows, *row_shape)
    with tempfile.TemporaryDirectory() as tmp, _fs.DirHandle.open(tmp) as directory:
        array = arrays.create_array(directory, "x.npy", shape, dtype, align=align)
        if array.size:
            array[...] = np.frombuffer(np.random.default_rng(0).bytes(array.nbytes),
                                       dtype).reshape(shape)
            arrays.flush(array)
        expected = np.array(array)
        del array
        path = Path(tmp) / "x.npy"
        with open(path, "rb") as f:
            offset = arrays.check_header(f, path, shape, dtype)
        assert offset % align == 0 and offset >= 64
        loaded = np.load(path, allow_pickle=False, max_header_size=1 << 20)
        assert loaded.shape == shape and loaded.dtype == dtype
        assert loaded.tobytes() == expected.tobytes()
        if align <= 4096:  # within numpy's default header limit: a plain np.load reads it
            assert np.load(path, allow_pickle=False).tobytes() == loaded.tobytes()


def test_the_build_data_file_starts_on_a_page(tmp_path):
    import pandas as pd

    import cachekit

    entry = cachekit.Cache(tmp_path, progress=False).map(_row, pd.Series(range(3000)))
    with open(entry.path / "data.npy", "rb") as f:
        offset = arrays.check_header(f, entry.path / "data.npy", (3000, 3), np.dtype(np.int32))
    assert offset == plans.PAGE_BYTES
    np.testing.assert_array_equal(np.load(entry.path / "data.npy"), np.asarray(entry.array))


def _row(v):
    return np.array([v, 2 * v, 3 * v], dtype=np.int32)


@pytest.mark.parametrize("raw", [
    None, [], {"format": 99}, {"format": 1, "key": "k", "rows": 1, "row_shape": [2],
                               "dtype": "<i4", "chunk_rows": 0, "offset": 4096, "page": 4096},
    {"format": 1, "key": "k", "rows": 1, "row_shape": [2], "dtype": "|O", "chunk_rows": 1,
     "offset": 4096, "page": 4096},
    {"format": 1, "key": "k", "rows": 1, "row_shape": [2], "dtype": "<i4", "chunk_rows": 1,
     "offset": 100, "page": 4096},
    {"format": 1, "key": "k", "rows": True, "row_shape": [2], "dtype": "<i4", "chunk_rows": 1,
     "offset": 4096, "page": 4096},
])
def test_a_malformed_plan_is_refused(raw):
    with pytest.raises((ValueError, TypeError)):
        Plan.from_json(raw)


def test_a_chunk_knows_its_rows():
    assert Chunk(3, 10, 25).rows == 15
