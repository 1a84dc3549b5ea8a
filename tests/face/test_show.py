"""A user can look at the rows (issue 43): ``cachekit show KEY`` writes a contact sheet PNG
whose tiles are the entry's rows, pixel for pixel, each under its row number (and, with
``--csv``, its path); ``entry.show()`` draws the same tiles as a PIL image."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from PIL import Image

import cachekit
from cachekit import sheet


def _tiles_match(picture: Image.Image, array, rows: list[int]) -> None:
    pixels = np.asarray(picture.convert("RGB"))
    shape = array.shape
    scale = sheet.scale_of(shape)
    height, width = shape[2], shape[3]
    for index, row in enumerate(rows):
        x, y = sheet.tile_origin(index, len(rows), shape)
        tile = pixels[y:y + height * scale:scale, x:x + width * scale:scale]
        expected = np.asarray(array[row]).transpose(1, 2, 0)
        if shape[1] == 1:
            expected = np.repeat(expected, 3, axis=2)
        np.testing.assert_array_equal(tile, expected, err_msg=f"tile {index} (row {row})")
        block = pixels[y:y + height * scale, x:x + width * scale]  # every scaled pixel
        np.testing.assert_array_equal(block, expected.repeat(scale, 0).repeat(scale, 1))


def _show(root, *args):
    return subprocess.run([sys.executable, "-m", "cachekit", "--root", str(root), "show",
                           *map(str, args)], capture_output=True, text=True)


@pytest.fixture
def entry(tmp_path, cover_paths):
    paths = (cover_paths * 2)[:24]
    return cachekit.Cache(tmp_path / "cache", progress=False).images(
        paths, (20, 28), backend="pil"), paths


def test_cachekit_show_writes_a_png_whose_tiles_are_the_rows(tmp_path, entry):
    built, paths = entry
    out = tmp_path / "sheet.png"
    done = _show(tmp_path / "cache", built.key[:10], "--rows", "0:16", "-o", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out.resolve())
    _tiles_match(Image.open(out), built.array, list(range(16)))
    sampled = _show(tmp_path / "cache", built.key, "--sample", "5", "-o", tmp_path / "s.png")
    assert sampled.returncode == 0, sampled.stderr
    _tiles_match(Image.open(tmp_path / "s.png"), built.array, sheet.choose_rows(24, sample=5))


def test_entry_show_draws_the_same_tiles_and_names_each_path(tmp_path, entry):
    built, paths = entry
    picture = built.show(rows=[3, 0, 23])
    _tiles_match(picture, built.array, [3, 0, 23])
    csv = tmp_path / "train.csv"
    pd.DataFrame({"img_path": paths}).to_csv(csv, index=False)
    out = tmp_path / "labelled.png"
    done = _show(tmp_path / "cache", built.key, "--rows", "3", "--csv", csv, "-o", out)
    assert done.returncode == 0, done.stderr
    labelled = np.asarray(Image.open(out).convert("RGB"))
    np.testing.assert_array_equal(labelled, np.asarray(built.show(rows=[3]).convert("RGB")))
    unlabelled = tmp_path / "unlabelled.png"  # the same sheet with only the row number
    assert _show(tmp_path / "cache", built.key, "--rows", "3", "-o", unlabelled).returncode == 0
    assert not np.array_equal(labelled, np.asarray(Image.open(unlabelled).convert("RGB")))


def test_entry_show_names_rows_by_position_whatever_the_columns_index(tmp_path, entry):
    """A column cut from a DataFrame keeps its index labels (here 100-123): row 0 is the
    column's first path all the same."""
    built, paths = entry
    cut = pd.Series(paths, index=range(100, 124))
    again = cachekit.Cache(tmp_path / "cache", progress=False).images(cut, (20, 28),
                                                                      backend="pil")
    assert again.key == built.key
    np.testing.assert_array_equal(np.asarray(again.show(rows=[0, 23]).convert("RGB")),
                                  np.asarray(built.show(rows=[0, 23]).convert("RGB")))


def test_a_grayscale_entry_and_bad_requests(tmp_path, cover_paths):
    gray = cachekit.Cache(tmp_path / "cache", progress=False).images(
        cover_paths[:4], 16, mode="L", backend="pil")
    _tiles_match(gray.show(sample=4), gray.array, [0, 1, 2, 3])
    with pytest.raises(cachekit.InvalidArgument, match="between 0 and 3"):
        gray.show(rows=[4])
    assert _show(tmp_path / "cache", gray.key, "--rows", "2:1").returncode == 2
    assert _show(tmp_path / "cache", gray.key, "--rows", "9:12").returncode == 2
    assert _show(tmp_path / "cache", "0" * 8).returncode == 2
    memo = cachekit.Cache(tmp_path / "cache", progress=False).map(
        lambda v: np.full(3, v, np.int64), pd.Series(range(5)))
    refused = _show(tmp_path / "cache", memo.key)
    assert refused.returncode == 2 and "images entries" in refused.stderr
