"""The key encoding is written down and pinned: these values must never change silently."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from cachekit import key_names, keys


def test_encoding_is_pinned():
    value = [None, True, 1, -5, 1.5, "é", b"x", (1,), {"b": 1, "a": 2}]
    assert keys.encode(value) == (
        b"l9:NTi1;i-5;f?\xf8\x00\x00\x00\x00\x00\x00s2:\xc3\xa9b1:xt1:i1;d2:s1:ai2;s1:bi1;"
    )
    assert keys.digest({"a": 1}) == "9d0bf3503148cbee6bd0f8c66a1a180d"


def test_row_hashes_are_pinned_and_equal_for_object_and_str_dtype():
    expected = [6264635911023503278, 15027369714335858087, 18025777469597584942]
    values = ["a.jpg", "b.jpg", "c.jpg"]
    assert keys.pandas_row_hashes(pd.Series(values, dtype=object)).tolist() == expected
    assert keys.pandas_row_hashes(pd.Series(values, dtype="str")).tolist() == expected
    assert keys.pandas_row_hashes(pd.Series(values, dtype="string")).tolist() == expected


ARROW_STRINGS = (*(["str"] if pd.Series([], dtype="str").dtype != object else []),  # pandas 3
                 "string[pyarrow]", pd.ArrowDtype(pa.string()), pd.ArrowDtype(pa.large_string()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(st.characters(exclude_categories=["Cs"]), max_size=8), max_size=20),
       st.sampled_from(ARROW_STRINGS), st.booleans())
def test_arrow_string_columns_hash_as_pandas_hashes_them(values, dtype, missing):
    """A column of Arrow strings is hashed from its UTF-8 bytes, without a str a value (twice
    as fast on paths): the hashes are still ``hash_pandas_object``'s, with a missing value
    too (which pandas hashes itself), and the rows' identities (under the other hash key
    too) are the object column's."""
    column = pd.Series(values + [None] * missing, dtype=dtype)
    expected = pd.util.hash_pandas_object(column, index=False, categorize=False)
    assert keys.pandas_row_hashes(column).tolist() == expected.tolist()
    if not missing:
        with mock.patch.object(pd.util, "hash_pandas_object",
                               side_effect=AssertionError("made a str of each value")):
            assert keys.pandas_row_hashes(column).tolist() == expected.tolist()
        ids, kind = keys.row_identities(column)
        assert ids.tolist() == keys.row_identities(pd.Series(values, dtype=object))[0].tolist()
        assert kind == "string"


def test_row_order_is_part_of_the_key():
    forward = keys.digest(keys.pandas_row_hashes(pd.Series(["a", "b"])))
    backward = keys.digest(keys.pandas_row_hashes(pd.Series(["b", "a"])))
    assert forward != backward


def test_dict_order_does_not_matter_but_types_do():
    assert keys.encode({"a": 1, "b": 2}) == keys.encode({"b": 2, "a": 1})
    assert keys.encode([1, 2]) != keys.encode((1, 2))
    assert keys.encode(1) != keys.encode(1.0) != keys.encode(True)
    assert keys.encode("1") != keys.encode(b"1")


def test_arrays_key_on_dtype_shape_and_bytes():
    a = np.arange(6, dtype=np.int32)
    assert keys.digest(a) == keys.digest(a.copy())
    assert keys.digest(a) != keys.digest(a.astype(np.int64))
    assert keys.digest(a) != keys.digest(a.reshape(2, 3))
    assert keys.digest(a[::2]) == keys.digest(np.ascontiguousarray(a[::2]))


def test_unencodable_values_raise_type_error():
    with pytest.raises(TypeError, match="object"):
        keys.encode(object())
    with pytest.raises(TypeError, match="Python objects"):
        keys.encode(np.array([object()]))


def test_two_interpreters_agree_on_a_key():
    code = (
        "import pandas as pd; from cachekit import keys; "
        "print(keys.digest({'rows': keys.pandas_row_hashes(pd.Series(['x', 'y'])), 'n': 2}))"
    )
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout for _ in range(2)}
    assert outputs == {keys.digest({"rows": keys.pandas_row_hashes(pd.Series(["x", "y"])),
                                    "n": 2}) + "\n"}


def test_is_key_accepts_only_full_hex_keys():
    assert key_names.is_key("0" * 32)
    for bad in ["", "0" * 31, "0" * 33, "../" + "0" * 29, "A" * 32, "0" * 31 + "/",
                "0" * 32 + "\n", "\n" + "0" * 32]:
        assert not key_names.is_key(bad)


def test_series_and_frames_key_alike_for_object_and_str_dtypes():
    values = ["a.jpg", "b.jpg"]
    assert keys.digest(pd.Series(values, dtype=object)) == keys.digest(pd.Series(values, dtype="str"))
    frame = pd.DataFrame({"img_path": values, "label": [1, 2]})
    assert keys.digest(frame) == keys.digest(frame.astype({"img_path": "str"}))
    assert keys.digest(frame) != keys.digest(frame.astype({"img_path": object, "label": "int32"}))


def test_mixed_object_columns_key_on_value_types():
    # pandas hashes 1 and "1" alike inside an object column; the key must not.
    assert keys.digest(pd.Series([1, "x"], dtype=object)) != \
        keys.digest(pd.Series(["1", "x"], dtype=object))


# --- file names that are not UTF-8 --------------------------------------------------------

def _hashes_of_bytes(names: list[bytes]) -> list[int]:
    return pd.util.hash_pandas_object(pd.Series(names, dtype=object), index=False,
                                      categorize=False).tolist()


def test_a_non_utf8_file_name_is_keyed_by_its_bytes():
    name = os.fsdecode(b"caf\xe9.jpg")  # "caf\udce9.jpg": surrogateescape
    material = keys.column_material(pd.Series(["a.jpg", name], dtype=object))
    assert material["dtype"] == "string"
    assert material["rows"].tolist() == [6264635911023503278, 12022989243103703311]
    assert material["rows"].tolist() == _hashes_of_bytes([b"a.jpg", b"caf\xe9.jpg"])
    assert keys.digest(pd.Series([name], dtype=object)) != keys.digest(pd.Series(["café.jpg"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), min_size=1, max_size=6))
def test_every_file_name_is_keyed_by_the_bytes_it_names(names):
    """os.fsdecode'd names, valid UTF-8 or not: the row hashes are those of the bytes, so
    the keys of valid UTF-8 names are the str keys they always were."""
    decoded = [os.fsdecode(n) for n in names]
    material = keys.column_material(pd.Series(decoded, dtype=object))
    assert material["dtype"] == "string"
    assert material["rows"].tolist() == _hashes_of_bytes(names)
    if all(not any(0xDC80 <= ord(c) <= 0xDCFF for c in d) for d in decoded):
        assert material["rows"].tolist() == keys.pandas_row_hashes(pd.Series(decoded)).tolist()


SURROGATE_TEXT = st.text(st.characters(categories=["Cs", "Ll", "Nd"]) | st.sampled_from(
    ["\udcc3", "\udca9", "é", "\ud800", "\udced", "\udca0", "\udc80"]), max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(SURROGATE_TEXT, min_size=1, max_size=3),
       st.lists(SURROGATE_TEXT, min_size=1, max_size=3))
def test_columns_of_different_strings_never_share_key_material(a, b):
    """Lone surrogates of any kind: two columns share material only if they are equal."""
    if a == b:
        return
    ka = keys.encode(keys.column_material(pd.Series(a, dtype=object)))
    kb = keys.encode(keys.column_material(pd.Series(b, dtype=object)))
    assert ka != kb


def test_strings_no_file_name_decodes_to_do_not_collide_with_ones_that_do():
    # "\udcc3\udca9" surrogateescapes to b"\xc3\xa9", the UTF-8 of "é"; "\ud800" has no
    # surrogateescape bytes, and its surrogatepass bytes are what fsdecode reads as this:
    pairs = [("\udcc3\udca9", "é"),
             ("\ud800", os.fsdecode("\ud800".encode("utf-8", "surrogatepass")))]
    for crafted, named in pairs:
        assert keys.digest(pd.Series([crafted], dtype=object)) != \
            keys.digest(pd.Series([named], dtype=object))
        frame = {"p": pd.Series([crafted], dtype=object), "n": [1]}
        assert keys.digest(pd.DataFrame(frame)) != \
            keys.digest(pd.DataFrame({**frame, "p": pd.Series([named], dtype=object)}))


def test_frames_with_non_utf8_names_key_like_their_bytes_and_keep_other_columns():
    names = [os.fsdecode(b"caf\xe9.jpg"), "b.jpg"]
    frame = pd.DataFrame({"p": pd.Series(names, dtype=object), "n": [1, 2]})
    as_bytes = pd.DataFrame({"p": pd.Series([b"caf\xe9.jpg", b"b.jpg"], dtype=object),
                             "n": [1, 2]})
    assert keys.pandas_row_hashes(frame).tolist() == keys.pandas_row_hashes(as_bytes).tolist()
    assert keys.digest(frame) != keys.digest(frame.assign(n=[1, 3]))


def test_a_column_mixing_types_with_lone_surrogates_is_a_type_error():
    with pytest.raises(TypeError, match="lone surrogates"):
        keys.column_material(pd.Series([1, os.fsdecode(b"\xff")], dtype=object))


def test_row_identities_are_pinned_and_follow_each_row():
    # Entries store them (row_ids.npy) and later builds match them: they must never change.
    values = pd.Series(["a.jpg", "b.jpg"])
    ids, dtype = keys.row_identities(values)
    assert dtype == "string" and ids.dtype == np.dtype("<u8") and ids.shape == (2, 2)
    assert ids.tolist() == [[10172663211253542638, 489807376274706098],
                            [13307858920972088888, 5683098582681676939]]
    stat = np.array([[10, 20], [30, 40]], dtype="<i8")
    assert keys.row_identities(values, [stat])[0].tolist() == [
        [11661504444599131219, 9479988153022335623],
        [17098391601911408733, 5024570843749529062]]
    # A row's identity is its own: the same in any column, at any position.
    other, _ = keys.row_identities(pd.Series(["z.jpg", "b.jpg", "a.jpg"], dtype=object))
    assert other[1:].tolist() == ids[::-1].tolist()
    changed, _ = keys.row_identities(values, [stat + [[0, 0], [0, 1]]])
    assert (changed[0] == keys.row_identities(values, [stat])[0][0]).all()
    assert not (changed[1] == keys.row_identities(values, [stat])[0][1]).any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.text(max_size=6),
                          st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=30),
       st.integers(0, 2), st.sampled_from(keys.ROW_HASH_KEYS))
def test_frame_hashes_are_pandas_hashes_of_the_frame(rows, width, hash_key):
    words, texts, signed = map(list, zip(*rows))
    columns = [np.array(words, dtype=np.uint64), np.array(texts, dtype=object),
               np.array(signed, dtype="<i8").view("<u8")][:width + 1]
    frame = pd.DataFrame({str(i): c for i, c in enumerate(columns)})
    expected = pd.util.hash_pandas_object(frame, index=False, categorize=False,
                                          hash_key=hash_key).to_numpy(dtype=np.uint64)
    assert keys.frame_hashes(columns, hash_key).tolist() == expected.tolist()


def test_row_identities_tell_value_types_apart_where_the_key_does():
    mixed, dtype = keys.row_identities(pd.Series([1, "1"], dtype=object))
    assert dtype == "object" and not (mixed[0] == mixed[1]).any()
    assert keys.row_identities(pd.Series([1, 2]))[1] == "int64"


def test_a_recipe_is_never_a_key():
    material = {"kind": "images", "params": {"size": [8, 8]}}
    assert key_names.is_key(keys.recipe(material))
    assert keys.recipe(material) != keys.digest(material)
    assert keys.recipe(material) == "4b7a641bd51ef8ceb1cb571a0b003620"
