"""The typed parts of a manifest, and the checks that parse each from its untrusted JSON:
the files an entry publishes (:class:`FileRecord`, the names they may have, and how a
derived entry's row files and parts fit together: :func:`check_rows_files`), a failed row,
and a per-row entry's reuse record and origin (:class:`RowReuse`, :class:`Origin`).
:mod:`cachekit.store.manifest` puts them together."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..checksums import CHECKSUM_PREFIX
from ..errors import CacheCorruptError, Failure
from ..key_names import is_key
from ..small_json import is_count

if TYPE_CHECKING:
    import numpy as np

Fail = Callable[[str], CacheCorruptError]
"""Makes the error of a manifest field that fails its check, naming the manifest."""

DATA_FILE = "data.npy"
KINDS = ("images", "map", "memoize")
MEMOIZE_KIND = "memoize"
LEAF_KINDS = ("numpy", "torch")
_CHECKSUM = re.compile(re.escape(CHECKSUM_PREFIX) + "[0-9a-f]{32}")

ROW_IDS_FILE = "row_ids.npy"
"""A per-row entry's row identities: (rows, 2) ``<u8``, see :func:`cachekit.keys.row_identities`."""
ROW_BLOCKS_FILE = "row_blocks.npy"
"""The digest of each block of ``reuse.block_rows`` rows of the data: (blocks, 16) ``|u1``."""
ROW_STATS_FILE = "row_stats.npy"
"""An images entry's (size, mtime_ns) of each file when it was built: (rows, 2) ``<i8``."""
ROW_MAP_FILE = "row_map.npy"
"""A derived entry's row map: (rows, 2) ``<u4``, for each row the data file that holds it
(numbered as the manifest lists them: ``data.npy`` if the entry decoded any row, then its
parts) and its row in that file."""
ROW_FILES = (ROW_IDS_FILE, ROW_BLOCKS_FILE, ROW_STATS_FILE, ROW_MAP_FILE)
"""The files a per-row entry may list after its data, in this order: what lets a later
build reference its rows (:mod:`cachekit.store.row_index`), a hit check its files' stats,
and a derived entry find its rows in its parts."""
_PART = re.compile(r"part_[0-9a-f]{32}(\.ids|\.stats)?\.npy")
MAX_PARTS = 4096
"""Parts a derived entry may list at most: each is a file a reader opens and maps."""
SIDECARS = {ROW_IDS_FILE: "ids", ROW_STATS_FILE: "stats"}
"""The row files that describe the rows of one data file, and the suffix a part's copy of
each has: a derived entry links a part's row identities and stats with its data."""


def part_name(checksum: str) -> str:
    """The name of a part: a data file of another entry that a derived entry links, named
    by its content (its checksum), so that every entry names the same bytes alike."""
    return f"part_{checksum.partition(':')[2]}.npy"


def sidecar_name(part: str, row_file: str) -> str:
    """The name of part ``part``'s ``row_file`` (:data:`ROW_IDS_FILE` or
    :data:`ROW_STATS_FILE`): ``part_HEX.ids.npy``, ``part_HEX.stats.npy``."""
    return f"{part[:-len('.npy')]}.{SIDECARS[row_file]}.npy"


@functools.lru_cache(maxsize=4096)  # names repeat: every entry of a fold links the same parts
def is_part_name(name: str) -> bool:
    """Whether ``name`` is a part's data file (not one of its row files)."""
    return _PART.fullmatch(name) is not None and name.count(".") == 1


@functools.lru_cache(maxsize=4096)
def is_part_file(name: str) -> bool:
    """Whether ``name`` is a part's data file or one of its row files."""
    return _PART.fullmatch(name) is not None


def file_name(index: int) -> str:
    """Name of an entry's ``index``-th data file: ``data.npy``, then ``leaf_1.npy``, ..."""
    return DATA_FILE if index == 0 else f"leaf_{index}.npy"


def allowed_file_name(index: int, name: str) -> bool:
    """Whether an entry's ``index``-th file may be called ``name``: :func:`file_name`, or
    after the data of a per-row entry one of :data:`ROW_FILES` or a part; or first, the row
    map of a derived entry that decoded none of its rows (it has no data file)."""
    if index == 0 and name == ROW_MAP_FILE:
        return True
    return name == file_name(index) or (index > 0 and (name in ROW_FILES or is_part_file(name)))


@dataclass(frozen=True)
class RowReuse:
    """How a per-row entry's rows may be reused by later builds: its recipe (the key but
    for the rows, :func:`cachekit.keys.recipe`) and the rows per block of ``row_blocks.npy``."""

    recipe: str
    block_rows: int

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "block_rows": self.block_rows}


@dataclass(frozen=True)
class Origin:
    """Where a per-row entry's rows came from when it was built: shared with other entries
    (key, rows), decoded by its builder, decoded by other processes for this build (its
    joiners, or the dead builds it resumed), or repeating an earlier row of the column.
    They add up to the entry's rows when its builder wrote them (:meth:`adds_up`); a
    manifest is read without that check, since nothing but reports depends on it."""

    reused: tuple[tuple[str, int], ...] = ()
    decoded: int = 0
    joined: int = 0
    copied: tuple[tuple[str, int], ...] = ()
    """Of ``reused``, the rows copied into the entry's own data file (key, rows): not
    linked, as another user's files, or every row of a contiguous copy."""
    repeated: int = 0
    """The rows that repeat an earlier row of the column: decoded once, for that row."""

    @property
    def rows_reused(self) -> int:
        """The rows shared with other entries or with an earlier row of the column."""
        return sum(rows for _, rows in self.reused) + self.repeated

    def adds_up(self, rows: int) -> bool:
        return self.rows_reused + self.decoded + self.joined == rows

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reused": [[key, rows] for key, rows in self.reused],
                               "decoded": self.decoded, "joined": self.joined}
        if self.copied:
            out["copied"] = [[key, rows] for key, rows in self.copied]
        if self.repeated:
            out["repeated"] = self.repeated
        return out


@dataclass(frozen=True)
class FileRecord:
    """One published .npy file: its array's shape and dtype, its size and checksum.

    ``kind`` says what a memoize leaf comes back as: a numpy array or a torch tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    checksum: str
    kind: str = "numpy"

    @property
    def np_dtype(self) -> np.dtype:
        import numpy as np

        return np.dtype(self.dtype)

    @property
    def dtype_name(self) -> str:
        """Its dtype's name, such as ``uint8``."""
        return dtype_facts(self.dtype)[1]

    @property
    def data_bytes(self) -> int:
        """Bytes of array data in the file (the rest is the .npy header)."""
        return math.prod(self.shape) * dtype_facts(self.dtype)[0]

    def open(self, entry_dir: Path, mode: str = "r") -> np.ndarray:
        """Map this file of the entry in ``entry_dir``, read-only (``"r"``) or copy-on-write
        (``"c"``), its .npy header and size checked against this record."""
        from ..arrays import open_file

        return open_file(entry_dir / self.name, self.shape, self.np_dtype, mode,
                         expected_bytes=self.bytes)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes, "checksum": self.checksum, "kind": self.kind}


def parse_reuse(raw: Any, kind: str, fail: Fail) -> Optional[RowReuse]:
    if raw is None:
        return None
    if kind == MEMOIZE_KIND or not isinstance(raw, dict):
        raise fail("bad reuse field")
    recipe, block_rows = raw.get("recipe"), raw.get("block_rows")
    if not (isinstance(recipe, str) and is_key(recipe) and is_count(block_rows)
            and block_rows >= 1):
        raise fail(f"bad reuse field {raw!r}"[:200])
    return RowReuse(recipe, block_rows)


def parse_origin(raw: Any, kind: str, rows: int, fail: Fail) -> Optional[Origin]:
    if raw is None:
        return None
    if kind == MEMOIZE_KIND or not isinstance(raw, dict) or not isinstance(
            raw.get("reused"), list):
        raise fail("bad origin field")
    if not isinstance(raw.get("copied", []), list):
        raise fail("bad origin field")
    pairs = []
    for field in ("reused", "copied"):  # ("copied", "repeated": not in older manifests)
        items = []
        for item in raw.get(field, []):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and is_key(item[0]) and is_count(item[1])):
                raise fail(f"bad origin item {item!r}"[:200])
            items.append((item[0], item[1]))
        pairs.append(tuple(items))
    decoded = count_field(raw.get("decoded"), "origin's decoded", fail)
    joined = count_field(raw.get("joined"), "origin's joined", fail)
    repeated = count_field(raw.get("repeated", 0), "origin's repeated", fail)
    return Origin(pairs[0], decoded, joined, pairs[1], repeated)  # (a report: sum unchecked)


_PLAIN_DTYPES = {"|b1": (1, "bool"), "|i1": (1, "int8"), "|u1": (1, "uint8")} | {
    f"{order}{code}{size}": (size, f"{name}{8 * size}")
    for code, name, sizes in (("i", "int", (2, 4, 8)), ("u", "uint", (2, 4, 8)),
                              ("f", "float", (2, 4, 8)), ("c", "complex", (8, 16)))
    for size in sizes for order in "<>"
}
"""The dtypes of plain numbers, as ``dtype.str`` writes them, with their item size and name."""


@functools.lru_cache(maxsize=1024)  # (texts read from manifests: bounded)
def dtype_facts(dtype: str) -> tuple[int, str]:
    """The item size and name (``1, "uint8"``) of the array dtype a manifest records as
    ``dtype`` (its ``str``, such as ``|u1``); an error when numpy would not take it, or it
    holds Python objects. The plain numbers, which every image entry and most leaves hold,
    are known without numpy: a listing that reads manifests does not import it."""
    plain = _PLAIN_DTYPES.get(dtype)
    if plain is not None:
        return plain
    import numpy as np

    parsed = np.dtype(dtype)
    if parsed.hasobject:
        raise ValueError(f"dtype {dtype!r} holds Python objects")
    return parsed.itemsize, parsed.name


def parse_file_record(index: int, item: Any, fail: Fail) -> FileRecord:
    if not isinstance(item, dict):
        raise fail(f"file {index} is not a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not allowed_file_name(index, name):
        raise fail(f"file {index} must be named {file_name(index)!r}, not {name!r}")
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(map(is_count, shape)):
        raise fail(f"bad shape {shape!r} of {name}")
    dtype = item.get("dtype")
    if not isinstance(dtype, str):
        raise fail(f"bad dtype {dtype!r} of {name}")
    try:
        dtype_facts(dtype)
    except Exception:  # numpy raises TypeError, ValueError, even SyntaxError (",,")
        raise fail(f"bad dtype {dtype!r} of {name}") from None
    size = count_field(item.get("bytes"), f"bytes of {name}", fail)
    checksum = item.get("checksum")
    if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
        raise fail(f"bad checksum {checksum!r} of {name}")
    kind = item.get("kind", "numpy")
    if kind not in LEAF_KINDS:
        raise fail(f"unknown kind {kind!r} of {name}")
    record = FileRecord(name, tuple(shape), dtype, size, checksum, kind)
    if size < record.data_bytes:  # Python ints: no overflow however large the shape
        raise fail(f"{name} holds {record.data_bytes} bytes of data but is said to be {size}")
    return record


FAILURE_DETAILS = 100
"""Failed rows a manifest or failure record lists with their value and reason; every
failed row is in the mask (:func:`failed_mask_text`), so a record's size does not grow with
the failures' text however many rows fail."""
_MASK_PREFIX = "zlib-base64:"


def failed_mask_text(rows: int, failed: Any) -> Optional[str]:
    """The mask of ``failed`` (row numbers) among ``rows`` rows as a manifest holds it: one
    bit a row, zlib-compressed, base64 (a few bytes for a few failures, at most about
    ``rows / 6`` characters for any number); None when no row failed."""
    import base64
    import zlib

    import numpy as np

    numbers = np.asarray(list(failed) if not isinstance(failed, np.ndarray) else failed,
                         dtype=np.int64)
    if not len(numbers):
        return None
    mask = np.zeros(rows, dtype=bool)
    mask[numbers] = True
    packed = np.packbits(mask, bitorder="little").tobytes()
    return _MASK_PREFIX + base64.b64encode(zlib.compress(packed, 6)).decode("ascii")


def parse_failed_mask(text: Any, rows: int, fail: Fail) -> np.ndarray:
    """The (rows,) bool mask of :func:`failed_mask_text`, checked: decompressed only up to
    its own size (a planted zlib bomb stops there), no bit past ``rows``."""
    import base64
    import binascii
    import zlib

    import numpy as np

    if not isinstance(text, str) or not text.startswith(_MASK_PREFIX) \
            or len(text) > 2 * rows + 1024:
        raise fail("bad failed_mask field")
    size = -(-rows // 8)
    try:
        packed_z = base64.b64decode(text[len(_MASK_PREFIX):], validate=True)
        inflater = zlib.decompressobj()
        packed = inflater.decompress(packed_z, size + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise fail("bad failed_mask field") from None
    if len(packed) != size or inflater.unconsumed_tail or not inflater.eof:
        raise fail(f"failed_mask does not hold {rows} rows")
    mask = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
    if mask[rows:].any():
        raise fail("failed_mask marks rows past the entry's")
    return mask[:rows].astype(bool)


def parse_failure(item: Any, rows: int, fail: Fail) -> Failure:
    if not (isinstance(item, list) and len(item) == 3 and is_count(item[0]) and item[0] < rows
            and isinstance(item[1], str) and isinstance(item[2], str)):
        raise fail(f"bad failed_rows item {item!r}")
    return (item[0], item[1], item[2])


def get_field(raw: dict[str, Any], name: str, kind: type, fail: Fail) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind):
        raise fail(f"manifest field {name!r} is missing or not {kind.__name__}")
    return value


def count_field(value: Any, name: str, fail: Fail) -> int:
    if not is_count(value):
        raise fail(f"{name} must be a whole number >= 0, not {value!r}")
    return value


def check_rows_files(files: tuple[FileRecord, ...], rows: int, kind: str, derived: bool,
                     fail: Fail) -> None:
    """A contiguous entry's data file holds its rows; a derived entry's row map has one
    (file, row) pair a row, and its parts rows of its data's shape and dtype, each named by
    its checksum and with a copy of each row file the entry has, of its rows. A derived
    entry that decoded none of its rows lists no data file (its row map comes first, so no
    row file of its own either: its parts' copies say which it has)."""
    own = files[0] if files[0].name == DATA_FILE else None
    row_map = next((f for f in files if f.name == ROW_MAP_FILE), None)
    if (row_map is not None) != derived:
        raise fail("a row map comes with parts, and parts with a row map")
    if not derived:
        assert own is not None  # (only a row map may come first instead)
        scalar = kind == MEMOIZE_KIND and own.shape == () and rows == 1
        if not scalar and (not own.shape or own.shape[0] != rows):
            raise fail(f"shape {list(own.shape)} does not start with rows {rows}")
        return
    assert row_map is not None
    if row_map.shape != (rows, 2) or row_map.dtype != "<u4":
        raise fail(f"the row map holds {row_map.dtype} {list(row_map.shape)}, not <u4 "
                   f"[{rows}, 2]")
    by_name = {f.name: f for f in files}
    data_parts = [f for f in files if is_part_name(f.name)]
    copies = {f.name for f in files if is_part_file(f.name) and not is_part_name(f.name)}
    if own is not None and (not own.shape or not own.shape[0]):
        raise fail("a derived entry lists a data file only of the rows it decoded")
    first = own if own is not None else data_parts[0]
    described = [n for n in SIDECARS if n in by_name
                 or (own is None and sidecar_name(data_parts[0].name, n) in copies)]
    wanted = {sidecar_name(p.name, n) for p in data_parts for n in described}
    if copies != wanted:
        raise fail(f"the parts' row files {sorted(copies ^ wanted)[:3]} are missing or extra")
    for part in data_parts:
        if (part.shape[1:] != first.shape[1:] or part.dtype != first.dtype or not part.shape
                or part.name != part_name(part.checksum)):
            raise fail(f"part {part.name} is not rows of the data's shape and dtype, or "
                       "not named by its checksum")
        for row_file in described:
            if not _describes(by_name[sidecar_name(part.name, row_file)], part.shape[0],
                              row_file):
                raise fail(f"the {row_file} of part {part.name} is not of its rows")


def _describes(record: FileRecord, rows: int, row_file: str) -> bool:
    """Whether ``record`` holds row identities (two or four words) or file stats of
    ``rows`` rows, as ``row_file`` (:data:`ROW_IDS_FILE`, :data:`ROW_STATS_FILE`) does."""
    if row_file == ROW_IDS_FILE:
        return record.dtype == "<u8" and record.shape in ((rows, 2), (rows, 4))
    return record.dtype == "<i8" and record.shape == (rows, 2)
