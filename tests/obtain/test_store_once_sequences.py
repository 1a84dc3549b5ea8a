"""Any sequence of columns over one set of pictures (subsets, re-orderings, repeats, unions
of earlier columns, contiguous copies, entries cleared in between) reads the pictures' own
pixels, decodes only the rows no remaining entry holds, and leaves a root that verifies.

The bound on linked files is drawn small, so that a union of a few earlier entries already
copies the rows of the files it does not link (cachekit/obtain/parts.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings, strategies as st

import cachekit
from cachekit.obtain import parts
from helpers import write_pictures

POOL = 16
"""Pictures the columns are drawn from: few, so that columns share many rows."""


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> tuple[list[str], np.ndarray]:
    """The pictures and each one's pixels, from a fresh contiguous build of them all."""
    paths = write_pictures(tmp_path_factory.mktemp("sequences") / "pictures", POOL)
    fresh = cachekit.Cache(tmp_path_factory.mktemp("fresh"), workers=1, progress=False)
    entry = fresh.images(pd.Series(paths), 8)
    assert entry.contiguous and entry.rows_decoded == POOL
    return paths, np.array(entry.array)


rows = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=2 * POOL)
"""A column: any pictures of the pool, in any order, repeats allowed."""

steps = st.one_of(
    st.tuples(st.just("call"), rows, st.booleans()),  # (rows, contiguous)
    st.tuples(st.just("union"), st.lists(st.integers(0, 20), min_size=2, max_size=8),
              st.booleans()),  # the concatenated columns of earlier calls, by index
    st.tuples(st.just("clear"), st.integers(0, 20)),  # an earlier call's entry, by index
)


@settings(max_examples=30)
@given(st.integers(1, 3), st.lists(steps, min_size=2, max_size=10),
       st.sampled_from([None, 24_000, 60_000]))
@example(1, [("call", [0, 1], False), ("call", [2], False), ("call", [3, 3, 4], False),
             ("union", [0, 1, 2], False), ("clear", 0), ("call", [5, 1, 0], True),
             ("union", [3, 2, 0, 1], False)], None)  # copies rows twice: before and after a clear
def test_any_sequence_of_columns_reads_the_pictures_and_decodes_only_rows_no_entry_holds(
        pool, linked_parts, sequence, budget):
    paths, pixels = pool
    called: list[tuple[list[int], str]] = []  # each call's rows and its entry's key
    with tempfile.TemporaryDirectory() as scratch, \
            mock.patch.object(parts, "LINKED_PARTS", linked_parts):
        cache = cachekit.Cache(Path(scratch) / "cache", workers=1, progress=False,
                               max_size=budget)
        entries = cache.root / "entries"
        for step in sequence:
            if step[0] == "clear":
                kept = [key for _, key in called if (entries / key).exists()]
                if kept:
                    cache.clear([kept[step[1] % len(kept)]])
                continue
            if step[0] == "union":
                if not called:
                    continue
                wanted = [i for k in step[1] for i in called[k % len(called)][0]]
            else:
                wanted = step[1]
            held = {i for i in range(POOL)
                    if any(i in rows for rows, key in called
                           if (entries / key).exists())}
            entry = cache.images(pd.Series([paths[i] for i in wanted]), 8,
                                 contiguous=step[2])
            np.testing.assert_array_equal(np.asarray(entry.array), pixels[wanted])
            assert entry.contiguous or not step[2]
            if not entry.hit:
                assert entry.rows_decoded == sum(i not in held for i in wanted), (wanted, held)
                assert entry.rows_decoded + entry.rows_reused == len(wanted)
            called.append((wanted, entry.key))
        assert cache.verify() == []
        for wanted, key in called:  # every entry left still reads its rows
            if (entries / key).exists():
                entry = cache.images(pd.Series([paths[i] for i in wanted]), 8)
                assert entry.hit
                np.testing.assert_array_equal(np.asarray(entry.array), pixels[wanted])
