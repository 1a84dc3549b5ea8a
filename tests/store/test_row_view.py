"""A derived entry's rows (cachekit.store.row_view.RowView) index as numpy indexes the
array of the same rows: whatever the index, the same values, shape and dtype, or the same
kind of error. The view is made here over in-memory "files", as the entry's data files
and row map would make it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cachekit.store.row_view import RowView

ROW_SHAPE = (2, 3)


@st.composite
def views(draw) -> tuple[RowView, np.ndarray]:
    """A view over 1 to 3 files of random rows, through a random row map; and the array
    of its rows in order."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    files = [np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(
        0, 256, (size, *ROW_SHAPE), dtype=np.uint8) for size in sizes]
    where = draw(st.lists(st.integers(0, len(files) - 1).flatmap(
        lambda f: st.tuples(st.just(f), st.integers(0, sizes[f] - 1))), min_size=1, max_size=9))
    table = np.array(where, dtype="<u4")
    return RowView(files, table), np.stack([files[f][r] for f, r in where])


def parts(size: int) -> st.SearchStrategy:
    """One part of an index along an axis of ``size``, out of range at times."""
    return st.one_of(
        st.integers(-size - 2, size + 1),
        st.slices(size + 2),
        st.lists(st.integers(-size - 1, size), max_size=5).map(np.array),
        st.lists(st.lists(st.integers(-size, size - 1), min_size=2, max_size=2),
                 min_size=1, max_size=3).map(np.array),  # a 2-D integer array
        st.lists(st.booleans(), min_size=size, max_size=size).map(np.array),
        st.lists(st.booleans(), min_size=1, max_size=size + 1).map(np.array),
        st.sampled_from([None, Ellipsis, True, False, 1.5]))


def indexes(rows: int) -> st.SearchStrategy:
    sizes = (rows, *ROW_SHAPE)
    return st.one_of(parts(rows), st.lists(st.integers(0, 2), max_size=4).flatmap(
        lambda axes: st.tuples(*(parts(sizes[a]) for a in axes))))


def _outcome(rows, index):
    try:
        return np.asarray(rows[index]), None
    except (IndexError, ValueError, TypeError) as e:
        return None, type(e)


def _indexes_alike(view: RowView, array: np.ndarray, index) -> bool:
    """Assert that ``view[index]`` is ``array[index]`` (or raises the same kind of error);
    whether it gave an array."""
    want, want_error = _outcome(array, index)
    got, got_error = _outcome(view, index)
    assert got_error is want_error
    if want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    return want is not None


@settings(max_examples=400)
@given(data=st.data())
def test_a_row_view_indexes_as_numpy_indexes_its_rows(data):
    view, array = data.draw(views())
    _indexes_alike(view, array, data.draw(indexes(len(array)), label="index"))


@pytest.mark.parametrize("index", [([0, 2], [0, 1]), (0, slice(None), [1, 2]),
                                   ([1, 0], slice(None), [0, 1])],
                         ids=["two integer arrays", "integer, slice, array", "array, slice, array"])
def test_mixed_integer_arrays_pair_up_as_numpy_pairs_them(index):
    """Before, the rows were taken first and the rest indexed each row alone: ``view[[0, 2],
    [0, 1]]`` gave both halves of rows 0 and 2, not one half of each."""
    files = [np.arange(3 * 2 * 3, dtype=np.uint8).reshape(3, *ROW_SHAPE)]
    view = RowView(files, np.array([[0, 2], [0, 1], [0, 0]], dtype="<u4"))
    np.testing.assert_array_equal(view[index], np.asarray(view)[index])
    assert view[index].shape == np.asarray(view)[index].shape


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0",
                    reason="numpy 1 passes no copy= to __array__")
def test_asarray_without_a_copy_is_refused_as_numpy_refuses_it():
    """Gathering rows always copies: ``copy=False`` raises numpy's ValueError, as for any
    array that cannot be had without a copy; ``copy=None`` and ``copy=True`` gather."""
    view = RowView([np.arange(6, dtype=np.uint8).reshape(3, 2)],
                   np.array([[0, 2], [0, 0]], dtype="<u4"))
    with pytest.raises(ValueError, match="cannot avoid a copy"):
        np.asarray(view, copy=False)
    np.testing.assert_array_equal(np.asarray(view), [[4, 5], [0, 1]])
    np.testing.assert_array_equal(np.array(view, copy=True), [[4, 5], [0, 1]])


def test_torch_takes_a_row_view_as_one_array():
    """``torch.as_tensor`` and ``torch.tensor`` read a view through DLPack, in one gather:
    without it torch walked the view as a sequence of rows, and warned that this is
    "extremely slow" (a warning is an error here)."""
    import torch
    files = [np.arange(4 * 6, dtype=np.uint8).reshape(4, *ROW_SHAPE)]
    view = RowView(files, np.array([[0, 3], [0, 1], [0, 1]], dtype="<u4"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for made in (torch.as_tensor(view), torch.tensor(view)):
            assert made.dtype == torch.uint8
            assert torch.equal(made, torch.from_numpy(np.asarray(view)))


@pytest.mark.parametrize("index", [(Ellipsis, 0), (Ellipsis, slice(1, 3)), (Ellipsis, 1, -1),
                                   (Ellipsis, None, 2), (Ellipsis,), (Ellipsis, 5)],
                         ids=["last axis", "a slice", "two axes", "a new axis", "all", "out"])
def test_an_ellipsis_first_reads_every_row_a_step_at_a_time(index, monkeypatch):
    """``view[..., 0]`` takes every row: it reads a step of rows at a time (a copy of
    every row whole would be the entry's size), and gives what numpy gives."""
    from cachekit.store import row_view

    rng = np.random.default_rng(3)
    files = [rng.integers(0, 256, (5, *ROW_SHAPE), dtype=np.uint8) for _ in range(2)]
    where = np.array([[i % 2, i % 5] for i in range(9)], dtype="<u4")
    view, array = RowView(files, where), np.stack([files[f][r] for f, r in where])
    monkeypatch.setattr(row_view, "COPY_BYTES", 2 * 6)  # two rows of 6 bytes a step
    taken = []
    real = RowView.take
    monkeypatch.setattr(RowView, "take", lambda self, rows: (taken.append(len(rows)),
                                                              real(self, rows))[1])
    if _indexes_alike(view, array, index):
        assert max(taken) <= 2 and sum(taken) == len(array)
