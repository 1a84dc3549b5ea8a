"""Any sequence of columns over one set of pictures (subsets, re-orderings, repeats, unions
of earlier columns, contiguous copies, entries cleared in between) reads the pictures' own
pixels, decodes only the rows no remaining entry holds, and leaves a root that verifies.

The bound on linked files is drawn small, so that a union of a few earlier entries already
copies the rows of the files it does not link (cachekit/obtain/parts.py).

With files rewritten in between (new content, or the old content back, always a new
mtime), a call reads the files' pixels now and decodes only rows no remaining entry holds
as they are now; only a hit under ``validate="path"`` may serve the pixels decoded before,
and then it warns (cachekit/obtain/staleness.py; the background check is off, so the
hit's sample, every row of an entry of 16 rows or fewer, is what finds them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
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
@example(1, [("call", [0], False), ("call", [2], False), ("call", [0, 1, 1, 2], False)],
         None)  # links one file, copies the other: the repeated new row is decoded once
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
                # (a row that repeats another of the column is decoded once)
                assert entry.rows_decoded == len(set(wanted) - held), (wanted, held)
                assert entry.rows_decoded + entry.rows_reused == len(wanted)
            called.append((wanted, entry.key))
        assert cache.verify() == []
        for wanted, key in called:  # every entry left still reads its rows
            if (entries / key).exists():
                entry = cache.images(pd.Series([paths[i] for i in wanted]), 8)
                assert entry.hit
                np.testing.assert_array_equal(np.asarray(entry.array), pixels[wanted])


VERSIONS = POOL // 2
"""Pictures of the rewrite test: picture ``i``'s content is the pool's ``i`` or
``i + VERSIONS``."""

rewrites = st.one_of(
    st.tuples(st.just("call"), st.lists(st.integers(0, VERSIONS - 1), min_size=1,
                                        max_size=16), st.booleans()),
    st.tuples(st.just("union"), st.lists(st.integers(0, 20), min_size=2, max_size=6),
              st.booleans()),
    st.tuples(st.just("clear"), st.integers(0, 20)),
    st.tuples(st.just("rewrite"), st.lists(st.integers(0, VERSIONS - 1), min_size=1,
                                           max_size=3), st.booleans()),  # (which, by rename)
)


class _Pictures:
    """``VERSIONS`` pictures in ``folder`` whose content flips between two of the pool's,
    each write with a new mtime; ``identity(i)``: what a row of picture ``i`` is under
    ``validate`` now (its content for "content", its write for "stat" and "path")."""

    def __init__(self, folder: Path, pool: list[str], validate: str) -> None:
        folder.mkdir()
        self.folder, self.pool, self.validate = folder, pool, validate
        self.paths = [str(folder / f"q{i}.png") for i in range(VERSIONS)]
        self.version, self.writes = [0] * VERSIONS, [0] * VERSIONS
        self.clock = 1_700_000_000 * 10**9
        for i in range(VERSIONS):
            self.write(i, by_rename=False)

    def write(self, i: int, by_rename: bool) -> None:
        source = self.pool[self.source(i)]
        if by_rename:
            shutil.copyfile(source, self.folder / ".new")
            os.replace(self.folder / ".new", self.paths[i])
        else:  # in place: the same inode, its bytes rewritten
            with open(source, "rb") as f, open(self.paths[i], "ab") as out:
                out.truncate(0)
                out.write(f.read())
        self.clock += 10**9
        os.utime(self.paths[i], ns=(self.clock, self.clock))
        self.writes[i] += 1

    def source(self, i: int) -> int:
        return i + VERSIONS * self.version[i]

    def identity(self, i: int) -> tuple[int, int]:
        return (i, self.version[i] if self.validate == "content" else self.writes[i])


@settings(max_examples=20)
@given(st.integers(1, 3), st.lists(rewrites, min_size=2, max_size=12),
       st.sampled_from([None, 24_000]), st.sampled_from(["path", "stat", "content"]))
@example(2, [("call", [0, 1, 2], False), ("rewrite", [1], False), ("call", [1, 2], False)],
         None, "path")  # a changed file's row is never shared
@example(2, [("call", [0, 1], False), ("rewrite", [0], True), ("call", [0, 1], False),
             ("call", [0, 1], False)], None, "path")  # a stale hit warns, the next call heals
@example(1, [("call", [1, 0, 0], False), ("rewrite", [0], False), ("union", [0, 0], False),
             ("rewrite", [0], False), ("call", [1, 0, 0], True), ("call", [0, 1], False)],
         None, "stat")  # the last call's two donor files are alike byte for byte
def test_files_rewritten_between_calls_are_read_anew_or_served_stale_only_with_a_warning(
        pool, linked_parts, sequence, budget, validate):
    paths, pixels = pool
    called: list[tuple[list[int], list[tuple[int, int]], str]] = []  # rows, identities, key
    built: dict[str, list[tuple[int, int]]] = {}  # the identities each key's entry holds
    with tempfile.TemporaryDirectory() as scratch, \
            mock.patch.dict(os.environ, {"CACHEKIT_STALE_CHECK": "sample"}), \
            mock.patch.object(parts, "LINKED_PARTS", linked_parts):
        pictures = _Pictures(Path(scratch) / "pictures", paths, validate)
        cache = cachekit.Cache(Path(scratch) / "cache", workers=1, progress=False,
                               max_size=budget)
        entries = cache.root / "entries"
        for step in sequence:
            if step[0] == "clear":
                kept = [key for _, _, key in called if (entries / key).exists()]
                if kept:
                    cache.clear([kept[step[1] % len(kept)]])
                continue
            if step[0] == "rewrite":
                for i in step[1]:
                    pictures.version[i] ^= 1
                    pictures.write(i, by_rename=step[2])
                continue
            if step[0] == "union":
                if not called:
                    continue
                wanted = [i for k in step[1] for i in called[k % len(called)][0]][:16]
            else:
                wanted = step[1]
            held = {row for _, ids, key in called if (entries / key).exists() for row in ids}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                entry = cache.images(pd.Series([pictures.paths[i] for i in wanted]), 8,
                                     contiguous=step[2], validate=validate)
            warned = any(w.category is cachekit.StaleEntryWarning for w in caught)
            now = pixels[[pictures.source(i) for i in wanted]]
            if np.array_equal(np.asarray(entry.array), now):
                assert not warned or validate == "path"
            else:
                assert validate == "path" and entry.hit and warned
            if not entry.hit:
                assert entry.rows_decoded == len({pictures.identity(i) for i in wanted}
                                                 - set(held))
                built[entry.key] = [pictures.identity(i) for i in wanted]
            called.append((wanted, built[entry.key], entry.key))
        assert cache.verify() == []
