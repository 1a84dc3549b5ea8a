"""Canonical byte encoding of key material, and the hex content address made from it.

A key is ``blake2b(KEY_DOMAIN + encode(material), digest_size=16)``. The encoding is written
down here and pinned by known-value tests, so that two processes, two machines and two
pandas versions agree: it never uses ``hash()`` or pickle. Every value is a one-byte tag
followed by a length-prefixed body, so no two different values share an encoding.

========  =========================================================================
tag       body
========  =========================================================================
``N``     None
``T/F``   True / False
``i``     int as signed decimal, then ``;``
``f``     float as 8 bytes IEEE-754 big-endian
``s``     str as ``<len>:`` then UTF-8
``b``     bytes as ``<len>:`` then the bytes
``l/t``   list / tuple as ``<count>:`` then each item
``d``     dict as ``<count>:`` then (key, value) pairs sorted by the key's encoding
``a``     numpy array: dtype string, shape tuple, then ``<nbytes>:`` C-order bytes
``P``     pandas Series: name, then its :func:`column_material`: dtype, then the row hashes as ``a``
``D``     pandas DataFrame: column names, column dtypes, then the row hashes as ``a``
``X``     torch tensor: as ``a`` of its CPU numpy view
========  =========================================================================

A str in a pandas object that UTF-8 cannot encode (a file name that is not UTF-8, as
``os.fsdecode`` gives it) is hashed by the bytes it names; see :func:`_row_hashes`.

pandas and torch are only touched when the caller already imported them, so importing
this module stays cheap.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .errors import InvalidArgument, InvalidArgumentType
from .key_names import FORMAT_VERSION, KEY_HEX_LENGTH

KEY_DOMAIN = b"cachekit-key\x00v1\x00"

Write = Callable[[bytes], Any]


def encode(value: Any) -> bytes:
    """Return the canonical encoding of ``value`` (see the module docstring)."""
    parts: list[bytes] = []
    _feed(parts.append, value)
    return b"".join(parts)


def digest(value: Any) -> str:
    """Return the hex content address of ``value``."""
    hasher = hashlib.blake2b(KEY_DOMAIN, digest_size=KEY_HEX_LENGTH // 2)
    _feed(hasher.update, value)
    return hasher.hexdigest()


def _feed(write: Write, value: Any) -> None:
    if value is None:
        write(b"N")
    elif value is True or value is False:
        write(b"T" if value else b"F")
    elif isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        write(b"i%d;" % int(value))
    elif isinstance(value, (float, np.floating)):
        write(b"f" + struct.pack(">d", float(value)))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        write(b"s%d:" % len(raw) + raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        write(b"b%d:" % len(raw) + raw)
    elif isinstance(value, (list, tuple)):
        write((b"l" if isinstance(value, list) else b"t") + b"%d:" % len(value))
        for item in value:
            _feed(write, item)
    elif isinstance(value, dict):
        pairs = sorted((encode(k), v) for k, v in value.items())
        write(b"d%d:" % len(pairs))
        for encoded_key, item in pairs:
            write(encoded_key)
            _feed(write, item)
    elif isinstance(value, np.bool_):
        write(b"T" if value else b"F")
    elif isinstance(value, np.ndarray):
        _feed_array(write, value)
    elif _is_pandas(value, "Series"):
        material = column_material(value)
        write(b"P")
        _feed(write, value.name)
        _feed(write, material["dtype"])
        _feed_array(write, material["rows"])
    elif _is_pandas(value, "DataFrame"):
        hashes, passed = _row_hashes(value)
        dtypes: Any = [column_dtype(value.iloc[:, i]) for i in range(value.shape[1])]
        write(b"D")
        _feed(write, [c for c in value.columns])
        _feed(write, [dtypes, SURROGATEPASS] if passed else dtypes)
        _feed_array(write, hashes)
    elif "torch" in sys.modules and isinstance(value, sys.modules["torch"].Tensor):
        write(b"X")
        _feed_array(write, value.detach().cpu().contiguous().numpy())
    else:
        raise InvalidArgumentType(f"cannot encode a {type(value).__qualname__} into a cache key")


def _feed_array(write: Write, array: np.ndarray) -> None:
    if array.dtype.hasobject:
        raise InvalidArgumentType("cannot encode a numpy array of Python objects into a cache key")
    array = np.ascontiguousarray(array)
    write(b"a")
    _feed(write, array.dtype.str)
    _feed(write, tuple(int(n) for n in array.shape))
    write(b"%d:" % array.nbytes)
    write(memoryview(array.reshape(-1)).cast("B"))


def _is_pandas(value: Any, name: str) -> bool:
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(value, getattr(pandas, name))


def column_material(column: Any) -> dict[str, Any]:
    """The key material of a column of values: its dtype (:func:`column_dtype`) and its
    per-row hashes in row order. The one place a column becomes key material, for
    ``images``, ``map`` and ``memoize`` alike.

    A memoize argument that is a Series also keys its name (the ``P`` encoding), because the
    function receives the Series itself and may read the name; ``images`` and ``map`` hand
    only the values to the row function, so renaming a column keeps their entries.
    """
    rows, passed = _row_hashes(column)
    dtype = column_dtype(column)
    return {"dtype": [dtype, SURROGATEPASS] if passed else dtype, "rows": rows}


def pandas_row_hashes(obj: Any) -> np.ndarray:
    """Per-row uint64 hashes of a Series or DataFrame, in row order, little-endian.

    ``hash_pandas_object(index=False, categorize=False)`` gives the same hashes for the
    same strings whether the column is ``object`` or ``str`` dtype; ``categorize=False``
    is equal and faster on unique paths. A str that UTF-8 cannot encode is hashed as bytes
    (see :func:`_row_hashes`).
    """
    return _row_hashes(obj)[0]


PANDAS_HASH_KEY = "0123456789123456"
"""pandas' default hash key: the one every key is made with."""
ROW_HASH_KEYS = (PANDAS_HASH_KEY, "cachekit:row:v1.")
"""The hash keys of the two halves of a row's identity (:func:`row_identities`)."""

SURROGATEPASS = "surrogatepass"
"""Added to a column's dtype material when one of its strings holds a surrogate that no
file name decodes to (see :func:`_row_hashes`)."""


def _row_hashes(obj: Any, hash_key: str = PANDAS_HASH_KEY) -> tuple[np.ndarray, bool]:
    """(:func:`pandas_row_hashes`, whether a string was hashed by its surrogatepass bytes).
    ``hash_key``: pandas' 16-character hash key (its default for every key).

    pandas hashes a str by its UTF-8 bytes, and a bytes value by itself, alike. A str that
    UTF-8 cannot encode holds surrogates: a file name that is not UTF-8, as ``os.fsdecode``
    gives it (``b"caf\\xe9.jpg"`` -> ``"caf\\udce9.jpg"``), is hashed by the bytes it names,
    ``os.fsencode``'s on a UTF-8 system (surrogateescape). Those never decode as UTF-8, so
    no valid str shares them. Any other surrogate (``"\\ud800"``) makes the column hash all
    its non-UTF-8 strs by their surrogatepass bytes instead, and say so (True), so that no
    two columns share a key. Columns of valid UTF-8 only never reach the fallback: their
    keys are the ones pinned by the tests.
    """
    import pandas as pd

    utf8 = _arrow_utf8(obj)
    if utf8 is not None:
        hashes = pd.util.hash_array(utf8, hash_key=hash_key, categorize=False)
        return np.ascontiguousarray(hashes).astype("<u8", copy=False), False
    try:
        hashes = pd.util.hash_pandas_object(obj, index=False, categorize=False,
                                            hash_key=hash_key)
        passed = False
    except UnicodeEncodeError:
        columns = [obj.iloc[:, i] for i in range(obj.shape[1])] if obj.ndim == 2 else [obj]
        passed = not all(_escapable(column) for column in columns)
        encoded = [_as_bytes(column, passed) for column in columns]
        hashes = pd.util.hash_pandas_object(
            encoded[0] if obj.ndim == 1 else pd.concat(encoded, axis=1, ignore_index=True),
            index=False, categorize=False, hash_key=hash_key)
    rows = np.ascontiguousarray(hashes.to_numpy(dtype=np.uint64)).astype("<u8", copy=False)
    return rows, passed


def _arrow_utf8(obj: Any) -> Optional[np.ndarray]:
    """The values of a Series of Arrow strings with none missing (what pandas 3 reads a
    CSV's text into), as an object array of their UTF-8 bytes: what pandas hashes each str
    by, so the hashes are ``hash_pandas_object``'s. It makes a str of each value and encodes
    it again, which takes twice as long on a column of paths. None for any other column."""
    import pandas as pd

    arrow_arrays = tuple(getattr(pd.arrays, name) for name in ("ArrowStringArray",
                                                                "ArrowExtensionArray")
                         if hasattr(pd.arrays, name))
    if getattr(obj, "ndim", None) != 1 or not isinstance(obj.array, arrow_arrays):
        return None
    import pyarrow as pa  # loaded already: pandas made the column with it

    values = obj.array.__arrow_array__()
    if values.null_count or not (pa.types.is_string(values.type)
                                 or pa.types.is_large_string(values.type)):
        return None
    binary = pa.large_binary() if pa.types.is_large_string(values.type) else pa.binary()
    return values.cast(binary).to_numpy(zero_copy_only=False)


def _unencodable(values: np.ndarray) -> list[int]:
    """Positions of the strs in ``values`` that UTF-8 cannot encode."""
    found = []
    for i, value in enumerate(values):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                found.append(i)
    return found


def _escapable(column: Any) -> bool:
    """Whether every str of ``column`` that UTF-8 cannot encode is a file name as
    ``os.fsdecode`` gives it: surrogateescape encodes it, and decodes it back the same."""
    values = column.to_numpy(dtype=object)
    for i in _unencodable(values):
        try:
            raw = values[i].encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return False
        if raw.decode("utf-8", "surrogateescape") != values[i]:
            return False
    return True


def _as_bytes(column: Any, passing: bool) -> Any:
    """``column``, or an object Series of its values in which each str that UTF-8 cannot
    encode is its surrogateescape bytes (its surrogatepass bytes when ``passing``)."""
    import pandas as pd

    values = column.to_numpy(dtype=object, copy=True)
    unencodable = _unencodable(values)
    if not unencodable:
        return column
    if not all(isinstance(v, str) or v is None or (isinstance(v, float) and v != v)
               for v in values):
        # pandas would hash such a column through str(): b"x" as "b'x'", like a str.
        raise InvalidArgumentType("cannot key a column that mixes other values with strings UTF-8 "
                                  "cannot encode (lone surrogates); convert it, e.g. .astype(str)")
    errors = "surrogatepass" if passing else "surrogateescape"
    for i in unencodable:
        values[i] = values[i].encode("utf-8", errors)
    return pd.Series(values, dtype=object)


def row_identities(column: Any, extra: Sequence[np.ndarray] = (),
                   material: Optional[dict[str, Any]] = None) -> tuple[np.ndarray, Any]:
    """Each row's identity under its recipe, and the column's dtype as recipe material.

    The identity is the row's part of the key: its value's hash (as :func:`column_material`
    hashes it), for an ``object`` column its value's type (which :func:`column_dtype` keys
    per row), and the row of each ``extra`` array (a file's stat or content signature).
    Two 64-bit halves, each ``hash_pandas_object`` of those parts under one of
    :data:`ROW_HASH_KEYS`, give an (N, 2) ``<u8`` array: the first half finds a row in an
    index, both together say it is the same row. The dtype material (``"string"``,
    ``"int64"``, ``"object"``, and whether strings were hashed by their surrogatepass bytes)
    goes into the recipe, so that rows are only ever matched within one kind of column.
    ``material``: the column's :func:`column_material`, when the key made it already (its
    hashes are the first half's value hashes).
    """
    import pandas as pd

    dtype = column_dtype(column)
    types = None
    if isinstance(dtype, list):  # ["object", [type names]]: the types are per row
        types = pd.Series(dtype[1], dtype=object)
        dtype = "object"
    words = []
    for part in extra:
        part = np.ascontiguousarray(part).reshape(len(column), -1)
        if part.dtype.hasobject or part.nbytes % (8 * max(1, len(column))):
            raise InvalidArgument("each row of an extra identity part must be whole 8-byte words")
        words.append(part.view("<u8").reshape(len(column), -1))
    halves, passed = [], False
    for hash_key in ROW_HASH_KEYS:
        if material is not None and hash_key == PANDAS_HASH_KEY:
            made = material["dtype"]
            hashes = material["rows"]
            passed_here = isinstance(made, list) and made[-1:] == [SURROGATEPASS]
        else:
            hashes, passed_here = _row_hashes(column, hash_key)
        passed = passed or passed_here
        parts = [hashes, *([] if types is None else [types.to_numpy()]),
                 *(block[:, j] for block in words for j in range(block.shape[1]))]
        halves.append(frame_hashes(parts, hash_key))
    ids = np.ascontiguousarray(np.stack(halves, axis=1)).astype("<u8", copy=False)
    return ids, [dtype, SURROGATEPASS] if passed else dtype


def frame_hashes(columns: Sequence[np.ndarray], hash_key: str) -> np.ndarray:
    """``hash_pandas_object(DataFrame(columns), index=False, categorize=False,
    hash_key=hash_key)`` as uint64, without making the frame (which costs more than the
    hashing on a fold's rows): each column's ``hash_array`` combined as pandas combines a
    frame's columns (tests/test_keys.py pins the two equal)."""
    import pandas as pd

    out = np.full(len(columns[0]), 0x345678, dtype=np.uint64)
    mult = np.uint64(1000003)
    for i, values in enumerate(columns):
        inverse = len(columns) - i
        out ^= pd.util.hash_array(np.asarray(values), hash_key=hash_key, categorize=False)
        out *= mult
        mult += np.uint64(82520 + inverse + inverse)
    return out + np.uint64(97531)


def entry_key(kind: str, fields: dict[str, Any]) -> str:
    """The key of an entry of ``kind``: the entry format and ``fields``, everything that
    changes the entry's bytes. Every key is made here (:func:`rows_key` for per-row entries,
    ``fields`` of function identity and arguments for memoize)."""
    return digest({"kind": kind, "format": FORMAT_VERSION, **fields})


def rows_key(kind: str, params: dict[str, Any], material: dict[str, Any], rows: int) -> str:
    """The key of a per-row entry: its ``params``, the column's ``material``
    (:func:`column_material`, plus ``"stat"`` or ``"content"`` signatures) and its rows."""
    return entry_key(kind, {"params": params, "n": rows, **material})


NOT_IN_RECIPE = ("on_error", "validate")
"""Params of a key that change no good row's bytes: ``on_error`` changes only failed rows,
which are never copied, and ``validate`` only what proves a file unchanged."""


def reuse_recipe(kind: str, params: dict[str, Any], dtype: Any, builder: Any) -> str:
    """The recipe of a per-row entry: its key's ``params`` but :data:`NOT_IN_RECIPE`, the
    column's ``dtype`` (as :func:`row_identities` gives it) and the ``builder`` (decoder
    versions), so that rows decoded by another decoder version are never mixed into an
    entry; not the rows."""
    kept = {name: value for name, value in params.items() if name not in NOT_IN_RECIPE}
    return recipe({"kind": kind, "format": FORMAT_VERSION, "params": kept, "dtype": dtype,
                   "builder": builder})


def recipe(material: dict[str, Any]) -> str:
    """The hex digest naming a recipe: everything of a key but its rows (see
    :func:`row_identities`). Its own namespace, so no recipe is ever a key."""
    return digest({"row recipe": 1, **material})


def kept_key(key: str) -> str:
    """The key under which a failed build of ``key`` keeps the rows that decoded: a source
    of rows for later builds of the recipe, never a hit (no call has this key)."""
    return digest(["kept rows", key])


def rest_key(key: str, todo: np.ndarray) -> str:
    """The key of the rest of the build of ``key`` that computes rows ``todo``: what a
    build leaves to compute after copying rows, which joiners join under this key."""
    return digest(["rest", key, np.ascontiguousarray(todo, dtype="<i8")])


def column_dtype(column: Any) -> Any:
    """A column's dtype as key material.

    ``str``/``string`` columns, ``object`` columns of str and categorical columns of str
    count as one ("string"), so the same values give the same key whichever dtype pandas
    picked (``hash_pandas_object`` hashes them alike). Other ``object`` columns
    add each value's type, because ``hash_pandas_object`` hashes ``1`` and ``"1"`` alike.
    """
    import pandas as pd

    values = column.cat.categories if isinstance(column.dtype, pd.CategoricalDtype) else column
    if pd.api.types.infer_dtype(values, skipna=True) == "string":
        return "string"
    if str(getattr(column.dtype, "pyarrow_dtype", "")) in ("string", "large_string"):
        return "string"  # an ArrowDtype of strings, which pandas 1.5 does not infer as such
    if column.dtype == object:
        return ["object", [type(v).__qualname__ for v in column]]
    return str(column.dtype)
