"""The key encoding is written down and pinned: these values must never change silently."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from cachekit import keys


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
    assert keys.is_key("0" * 32)
    for bad in ["", "0" * 31, "../" + "0" * 29, "A" * 32, "0" * 31 + "/"]:
        assert not keys.is_key(bad)


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
