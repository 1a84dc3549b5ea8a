"""A column that names a file on several rows (one row per label or box of an image, an
oversampled class) has it decoded once (cachekit/obtain/parts.py: ``Parts.repeat``) and
stored once: the build's row map points each repeat at it. A contiguous entry
(``contiguous=True``), or a build that copies rows of other entries' files, copies it into
each of its rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.cli.main import main as cli_main
from cachekit.store import manifest as manifests
from helpers import write_pictures

CALLS: list[int] = []


def _counted(v: int) -> np.ndarray:
    CALLS.append(v)
    return np.full(4, v, np.uint8)


@pytest.fixture
def pictures(tmp_path: Path) -> list[str]:
    return write_pictures(tmp_path / "pictures", 60)


def _cache(root: Path, progress: bool = False) -> cachekit.Cache:
    return cachekit.Cache(root, workers=1, progress=progress)


def _column(paths: list[str], rows) -> pd.Series:
    return pd.Series([paths[i] for i in rows], name="img_path")


def _pixels(tmp_path: Path, paths: list[str]) -> np.ndarray:
    """Every picture's pixels, from a cache of their own: row ``i`` is picture ``i``."""
    entry = _cache(tmp_path / "every").images(_column(paths, range(len(paths))), 8)
    assert entry.contiguous and entry.rows_decoded == len(paths)
    return np.array(entry.array)


def _origin(entry: cachekit.Entry) -> dict:
    return json.loads((entry.path / manifests.MANIFEST_FILE).read_text())["origin"]


def test_a_fresh_build_decodes_and_stores_a_repeated_file_once(tmp_path, pictures, capsys):
    """No entry holds the column's rows: its three files are decoded once and stored once,
    in one file of its own, which its row map points each of the six rows at. That file is
    a part as the format has it (named by its checksum, with its row files), so a later
    column of the same files links it; ``contiguous=True`` still writes every row."""
    rows = [0, 1, 0, 2, 1, 0]
    root = tmp_path / "root"
    entry = _cache(root, progress=True).images(_column(pictures, rows), 8)
    assert not entry.contiguous and (entry.rows_decoded, entry.rows_reused) == (3, 3)
    assert _origin(entry)["repeated"] == 3
    assert not (entry.path / manifests.DATA_FILE).exists()
    [part] = [p for p in entry.path.iterdir() if manifests.is_part_name(p.name)]
    assert np.load(part, mmap_mode="r").shape[0] == 3 and part.stat().st_nlink == 1
    assert np.load(entry.path / manifests.ROW_MAP_FILE).tolist() == [
        [0, 0], [0, 1], [0, 0], [0, 2], [0, 1], [0, 0]]
    [indexed] = (root / "index").glob(f"*/{entry.key}.npy")  # its own index file, as the
    assert indexed.stat().st_nlink == 1  # rows it decoded are no other entry's (no link)
    every = _pixels(tmp_path, pictures)
    want = every[rows]
    np.testing.assert_array_equal(np.asarray(entry.array), want)
    assert (f"entry {entry.key[:12]}: 3 of the rows left to decode repeat earlier rows of its "
            "column; each is decoded once and stored once\n") in capsys.readouterr().err
    again = _cache(root).images(_column(pictures, rows), 8)
    assert again.hit and np.array_equal(np.asarray(again.array), want)
    assert cli_main(["--root", str(root), "info", entry.key]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("rows from:")]
    assert line.split(":", 1)[1].strip() == ("3 decoded by its builder, 0 by other processes "
                                             "(joiners, resumed builds), 3 repeating earlier "
                                             "rows of its column")  # (not "0 shared with 0")
    distinct = _cache(root).images(_column(pictures, [2, 0, 1]), 8)  # links that one file
    assert (distinct.rows_decoded, distinct.rows_reused) == (0, 3)
    [linked] = [p for p in distinct.path.iterdir() if manifests.is_part_name(p.name)]
    assert linked.stat().st_ino == part.stat().st_ino and part.stat().st_nlink == 2
    np.testing.assert_array_equal(np.asarray(distinct.array), every[[2, 0, 1]])
    assert _cache(root).verify() == []
    copy = _cache(tmp_path / "asked", progress=True).images(_column(pictures, rows), 8,
                                                            contiguous=True)
    assert copy.contiguous and "each is decoded once and copied into each of its rows\n" \
        in capsys.readouterr().err
    assert np.load(copy.path / manifests.DATA_FILE, mmap_mode="r").shape[0] == 6
    np.testing.assert_array_equal(copy.array, want)


def test_a_memoized_function_runs_once_for_a_repeated_value(tmp_path, capsys):
    CALLS.clear()
    entry = _cache(tmp_path, progress=True).map(_counted, pd.Series([5, 7, 5, 5, 9, 7]))
    assert sorted(CALLS) == [5, 7, 9] and not entry.contiguous
    assert np.asarray(entry.array)[:, 0].tolist() == [5, 7, 5, 5, 9, 7]
    assert "each is decoded once and stored once" in capsys.readouterr().err


def test_a_build_that_links_stores_each_repeated_new_row_once(tmp_path, pictures, capsys):
    """A fold of a full entry plus two new pictures, each on several rows: the build links
    the full entry's file, decodes the two once, and its own data file holds them once,
    which its row map points every repeat at. A second process reads the same pixels."""
    root = tmp_path / "root"
    full = _cache(root).images(_column(pictures, range(40)), 8)
    rows = [*range(20), 50, 51, 50, 3, 50, 51]
    fold = _cache(root, progress=True).images(_column(pictures, rows), 8)
    assert not fold.contiguous and (fold.rows_decoded, fold.rows_reused) == (2, 24)
    assert np.load(fold.path / manifests.DATA_FILE, mmap_mode="r").shape[0] == 2
    row_map = np.load(fold.path / manifests.ROW_MAP_FILE)
    assert (row_map[[22, 24]] == row_map[20]).all() and (row_map[25] == row_map[21]).all()
    [part] = [p for p in fold.path.iterdir() if manifests.is_part_name(p.name)
              and p.name.count(".") == 1]
    assert part.stat().st_ino == (full.path / manifests.DATA_FILE).stat().st_ino
    assert "3 of the rows left to decode repeat earlier rows of its column; each is decoded " \
           "once and stored once" in capsys.readouterr().err
    want = _pixels(tmp_path, pictures)[rows]
    np.testing.assert_array_equal(np.asarray(fold.array), want)
    again = _cache(root).images(_column(pictures, rows), 8)
    assert again.hit and np.array_equal(np.asarray(again.array), want)
    assert cli_main(["--root", str(root), "info", fold.key]) == 0
    said = capsys.readouterr().out
    assert ("2 decoded by its builder, 0 by other processes (joiners, resumed builds), 21 "
            "shared with 1 entry, 3 repeating earlier rows of its column") in said
    copy = _cache(root).images(_column(pictures, rows), 8, contiguous=True)
    assert copy.contiguous and np.array_equal(copy.array, want)
    assert _cache(root).verify() == []


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_repeated_file_that_fails_fails_on_each_of_its_rows(tmp_path, pictures, on_error):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    col = pd.Series([pictures[0], str(bad), pictures[1], str(bad), pictures[0]])
    cache = _cache(tmp_path / "root")
    if on_error == "raise":
        with pytest.raises(cachekit.ImageDecodeError) as raised:
            cache.images(col, 8)
        assert [row for row, _, _ in raised.value.failures] == [1, 3]
        return
    entry = cache.images(col, 8, on_error="zero")
    assert entry.valid.tolist() == [True, False, True, False, True]
    assert not np.asarray(entry.array)[[1, 3]].any()
    np.testing.assert_array_equal(np.asarray(entry.array)[[0, 2, 4]],
                                  _pixels(tmp_path, pictures)[[0, 1, 0]])


def test_a_pulled_entry_keeps_what_its_origin_says_of_repeats_and_copies(s3_env, tmp_path,
                                                                          pictures, capsys):
    """A host's fold with repeated new rows, a contiguous copy of another fold and a fresh
    build of files on several rows (its own part) are uploaded; a second host pulls each:
    the same pixels, and ``info`` says which rows repeat and which were copied, as on the
    host that built them."""
    from cachekit.obtain import background

    here = _cache(tmp_path / "a")
    here.images(_column(pictures, range(40)), 8)
    fold_rows, copy_rows = [*range(0, 40, 2), 50, 51, 50, 51], list(range(1, 40, 2))
    fresh_rows = [55, 56, 55, 57, 56, 55]
    fold = here.images(_column(pictures, fold_rows), 8)
    copy = here.images(_column(pictures, copy_rows), 8, contiguous=True)
    fresh = here.images(_column(pictures, fresh_rows), 8)
    assert not fold.contiguous and copy.contiguous and not fresh.contiguous
    assert fresh.rows_decoded == 3
    background.wait_all()
    there, want = _cache(tmp_path / "b"), _pixels(tmp_path, pictures)
    for entry, rows in ((fold, fold_rows), (copy, copy_rows), (fresh, fresh_rows)):
        pulled = there.images(_column(pictures, rows), 8, contiguous=entry.contiguous)
        assert pulled.source == "remote" and pulled.key == entry.key
        np.testing.assert_array_equal(np.asarray(pulled.array), want[rows])
        assert _origin(pulled) == _origin(entry)
    distinct = there.images(_column(pictures, [57, 55, 56]), 8)  # in the part pulled
    assert distinct.source == "built" and distinct.rows_decoded == 0  # (it was indexed)
    capsys.readouterr()
    for entry in (fold, copy):
        assert cli_main(["--root", str(tmp_path / "b"), "info", entry.key]) == 0
    said = capsys.readouterr().out
    assert ("2 decoded by its builder, 0 by other processes (joiners, resumed builds), 20 "
            "shared with 1 entry, 2 repeating earlier rows of its column") in said, said
    assert "20 copied from 1 entry" in said, said
