"""Tests for Cache.map and the function identity its key (and memoize's) is made of."""

from __future__ import annotations

import functools
import sys

import numpy as np
import pandas as pd
import pytest

import cachekit
from helpers import assert_cache_as_it_was, load_module
from cachekit import code_identity, keys
from cachekit.errors import NotAnArrayError as NotAnArray

def square_row(value: int) -> np.ndarray:
    return np.array([value, value * value], dtype=np.int32)


# --- map: results --------------------------------------------------------------------------


def test_map_stacks_rows_in_order_and_hits_the_second_time(cache):
    values = pd.Series([3, 1, 2, 7], name="n")
    entry = cache.map(square_row, values)
    assert not entry.hit
    assert entry.array.shape == (4, 2) and entry.array.dtype == np.int32
    assert entry.array.tolist() == [[3, 9], [1, 1], [2, 4], [7, 49]]
    assert entry.manifest["kind"] == "map" and entry.valid.all()
    again = cache.map(square_row, values)
    assert again.hit and again.key == entry.key
    assert cache.map(square_row, values[::-1].reset_index(drop=True)).key != entry.key


def test_map_accepts_tensors_lists_and_numpy_scalars(cache):
    import torch

    tensor = cache.map(lambda v: torch.full((2, 3), float(v)), [1, 2, 3])
    assert tensor.array.shape == (3, 2, 3) and tensor.array.dtype == np.float32
    assert tensor.array[2].tolist() == [[3.0] * 3] * 2
    scalar = cache.map(lambda v: np.float64(v) / 2, pd.Series([1, 2]))
    assert scalar.array.shape == (2,) and scalar.array.tolist() == [0.5, 1.0]


def test_images_and_map_share_the_row_path(cache, cover_paths):
    """images() is a map with a built-in row function: same build, same manifest fields."""
    images = cache.images(pd.Series(cover_paths[:3]), 8)
    mapped = cache.map(lambda p: np.zeros((3, 8, 8), np.uint8), pd.Series(cover_paths[:3]))
    assert set(images.manifest) == set(mapped.manifest)


def test_on_error_zero_stores_zeros_and_marks_rows_invalid(cache):
    def row(value: int) -> np.ndarray:
        if value % 2:
            raise ValueError(f"odd {value}")
        return np.full(3, value, dtype=np.int64)

    entry = cache.map(row, pd.Series([0, 1, 2, 3]), on_error="zero")
    assert entry.valid.tolist() == [True, False, True, False]
    assert entry.array.tolist() == [[0] * 3, [0] * 3, [2] * 3, [0] * 3]
    assert [f[0] for f in entry.manifest["failed_rows"]] == [1, 3]
    assert "odd 3" in entry.manifest["failed_rows"][1][2]
    with pytest.raises(ValueError, match="odd 1"):  # on_error is in the key
        cache.map(row, pd.Series([0, 1, 2, 3]))


def test_on_error_zero_with_every_row_failing_raises_every_failure(cache, cache_root):
    """No row gives the shape of the zeros to store: an ImageDecodeError (a ValueError, as
    every error cachekit raises is a CachekitError) that lists each row and says so."""
    import pickle

    def row(value: int) -> np.ndarray:
        raise OSError(f"unreadable {value}")

    with pytest.raises(cachekit.ImageDecodeError, match="no row succeeded") as caught:
        cache.map(row, pd.Series([4, 5, 6]), on_error="zero")
    assert [(r, why) for r, _, why in caught.value.failures] == [
        (0, "OSError: unreadable 4"), (1, "OSError: unreadable 5"), (2, "OSError: unreadable 6")]
    assert "on_error='zero'" not in str(caught.value)  # it was given: not the fix
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)
    assert list((cache_root / "entries").glob("*")) == []


# --- map: failures leave the cache as it was --------------------------------------------------


def test_shape_mismatch_names_the_row_and_both_shapes(cache, cache_root):
    def row(value: int) -> np.ndarray:
        return np.zeros(3 if value == 5 else 2)

    with pytest.raises(cachekit.InvalidArgument,
                       match=r"row 5 gave shape \(3,\).*shape \(2,\)"):
        cache.map(row, pd.Series(range(8)))
    assert_cache_as_it_was(cache_root)


def test_dtype_mismatch_is_rejected_too(cache, cache_root):
    with pytest.raises(ValueError, match="row 1 .*int64.*float32"):
        cache.map(lambda v: np.zeros(2, np.float32 if v == 0 else np.int64), [0, 1, 2])
    assert_cache_as_it_was(cache_root)


@pytest.mark.parametrize("bad_row", [0, 5])
def test_exception_in_fn_propagates_unchanged(cache, cache_root, bad_row):
    boom = KeyError(f"no label for row {bad_row}")

    def row(value: int) -> np.ndarray:
        if value == bad_row:
            raise boom
        return np.zeros(2)

    with pytest.raises(KeyError) as info:
        cache.map(row, pd.Series(range(8)), version="1")  # `boom` cannot be keyed
    assert info.value is boom
    assert_cache_as_it_was(cache_root)


@pytest.mark.parametrize("result", [[1, 2], "text", None, np.array([object(), 1])],
                         ids=["list", "str", "none", "object-array"])
@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_row_that_is_not_an_array_is_a_type_error(cache, cache_root, result, on_error):
    with pytest.raises(NotAnArray, match="must return a numpy array"):
        cache.map(lambda v: result, pd.Series([1, 2]), version="1", on_error=on_error)
    assert issubclass(NotAnArray, TypeError)
    assert_cache_as_it_was(cache_root)


def test_values_of_mixed_types_that_pandas_hashes_alike_get_different_keys(cache):
    a = pd.Series([1, "x"], dtype=object)
    b = pd.Series(["1", "x"], dtype=object)
    assert keys.pandas_row_hashes(a).tolist() == keys.pandas_row_hashes(b).tolist()
    row = lambda v: np.array([isinstance(v, str)])  # noqa: E731
    assert cache.map(row, a).array[:, 0].tolist() == [False, True]
    assert cache.map(row, b).array[:, 0].tolist() == [True, True]


# --- function identity ------------------------------------------------------------------------

V1 = "import numpy as np\n\ndef prep(v):\n    return np.array([v, 1])\n"
V2 = "import numpy as np\n\ndef prep(v):\n    return np.array([v, 2])\n"
V1_COMMENT = "import numpy as np\n\ndef prep(v):\n    # one\n    return np.array([v, 1])\n"
V1_TRAILING = "import numpy as np\n\ndef prep(v):\n    return np.array([v, 1])  # one\n"
"""Compiles to a code object equal to V1's (same lines and columns): only the source differs."""


def test_editing_the_function_body_changes_the_key(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "userprep_map.py"
    first = cache.map(load_module(path, "userprep_map", V1).prep, [5])
    edited = cache.map(load_module(path, "userprep_map", V2).prep, [5])
    assert edited.key != first.key and edited.array.tolist() == [[5, 2]]
    restored = cache.map(load_module(path, "userprep_map", V1).prep, [5])
    assert restored.key == first.key and restored.hit
    # Documented: any source change, even a comment, changes the key (a rebuild, never stale).
    commented = cache.map(load_module(path, "userprep_map", V1_COMMENT).prep, [5])
    assert commented.key != first.key
    trailing = cache.map(load_module(path, "userprep_map", V1_TRAILING).prep, [5])
    assert trailing.key not in (first.key, commented.key)


def test_identity_names_module_qualname_version_and_source():
    identity = code_identity.function_identity(square_row, version="2")
    assert identity["module"] == __name__ and identity["qualname"] == "square_row"
    assert identity["version"] == "2" and len(identity["source"]) == 32
    assert code_identity.function_identity(square_row, version="3") != identity
    with pytest.raises(TypeError, match="version must be"):
        code_identity.function_identity(square_row, version=1.5)


def test_two_lambdas_on_one_line_are_told_apart():
    first, second = lambda v: v, lambda v: v + 1  # noqa: E731
    assert code_identity.function_identity(first) != code_identity.function_identity(second)
    outer = lambda v: (lambda w: w * 3)(v)  # noqa: E731
    assert code_identity._source_text(outer) == "lambda v: (lambda w: w * 3)(v)"


def test_a_lambda_body_on_a_later_line_is_in_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "userlambda.py"
    body = "fn = (\n    lambda v:\n        v * {}\n)\n"
    two = load_module(path, "userlambda", body.format(2)).fn
    assert code_identity._source_text(two) == "lambda v:\n        v * 2"
    identity_two = code_identity.function_identity(two)
    three = load_module(path, "userlambda", body.format(3)).fn
    assert code_identity.function_identity(three) != identity_two


def test_a_file_edited_after_import_does_not_lend_its_text_to_the_old_code(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "userstale.py"
    old = load_module(path, "userstale", V1).prep
    new = load_module(path, "userstale", V2).prep  # the file now holds V2 for both
    assert code_identity._source_text(old) == code_identity._source_text(new)
    assert code_identity.function_identity(old) != code_identity.function_identity(new)  # the code differs


def test_closures_are_keyed_by_their_captured_values():
    def scaled(factor):
        return lambda v: v * factor

    assert code_identity.function_identity(scaled(2)) != code_identity.function_identity(scaled(3))
    assert code_identity.function_identity(scaled(2)) == code_identity.function_identity(scaled(2))


def test_unencodable_captures_and_unreadable_source_ask_for_version():
    handle = object()
    closure = lambda v: (handle, v)  # noqa: E731
    with pytest.raises(TypeError, match="pass version="):
        code_identity.function_identity(closure)
    assert code_identity.function_identity(closure, version="1")["version"] == "1"
    typed_at_a_prompt = eval("lambda v: v")  # no source file
    with pytest.raises(TypeError, match="pass version="):
        code_identity.function_identity(typed_at_a_prompt)
    with pytest.raises(TypeError, match="pass version="):
        code_identity.function_identity(np.sqrt)


def test_partials_and_bound_methods_key_their_bound_state():
    small, large = functools.partial(np.add, 2), functools.partial(np.add, 3)
    with pytest.raises(TypeError, match="pass version="):
        code_identity.function_identity(small)  # np.add has no Python source
    # With a version the partial's own arguments are still keyed.
    assert code_identity.function_identity(small, version="1") != code_identity.function_identity(large, "1")

    def resize(v, size):
        return np.full(size, v)

    assert (code_identity.function_identity(functools.partial(resize, size=2))
            != code_identity.function_identity(functools.partial(resize, size=3)))

    class Scaler:
        def apply(self, v):
            return v

    with pytest.raises(TypeError, match="cannot encode a .*Scaler"):
        code_identity.function_identity(Scaler().apply)  # its result may depend on the instance


def test_map_with_an_unkeyable_function_writes_nothing(cache, cache_root):
    handle = object()
    with pytest.raises(TypeError, match="pass version="):
        cache.map(lambda v: np.array([id(handle)]), [1])
    assert not cache_root.exists()


def test_a_dataframe_is_not_mistaken_for_a_column(cache):
    frame = pd.DataFrame({"a": [1, 2, 3], "b": [4, 5, 6]})
    with pytest.raises(TypeError, match="one value per row"):
        cache.map(np.atleast_1d, frame, version="1")
    with pytest.raises(TypeError, match="one value per row"):
        cache.map(np.atleast_1d, np.zeros((3, 2)), version="1")
