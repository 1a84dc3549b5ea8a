"""On-disk layout of a cache root, and reading entries back safely.

::

    ROOT/
      entries/KEY/manifest.json   published, immutable entries (manifest is written last)
      entries/KEY/data.npy        the array, a standard .npy file
      tmp/KEY.HOST.PID.UUID/      private build directories, renamed into entries/ when done
      locks/KEY.lock              per-key build locks (they only save duplicate work)

Opening an entry checks the manifest's schema, the .npy header against the manifest, and
the file size against header + prod(shape) x itemsize, so misread bytes are never returned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from . import _fs
from .errors import CacheCorruptError
from .keys import is_key

FORMAT_VERSION = 1
DATA_FILE = "data.npy"
MANIFEST_FILE = "manifest.json"
MEMOIZE_KIND = "memoize"
_CHECKSUM_BLOCK = 16 << 20
_MANIFEST_LIMIT = 256 << 20  # a tampered manifest must not exhaust memory
# Errors of opening a path that is a symlink, a directory or another non-file: tampering.
_NOT_A_FILE = (errno.ELOOP, errno.EINVAL, errno.ENOTDIR, errno.EISDIR)

# Manifest fields every reader relies on, with their JSON types.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "key": str,
    "kind": str,
    "rows": int,
    "shape": list,
    "dtype": str,
    "created": (int, float),
    "checksum": str,
    "failed_rows": list,
}


def default_root() -> Path:
    """$CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else ~/.cache/cachekit."""
    explicit = os.environ.get("CACHEKIT_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cachekit"


@dataclass(frozen=True)
class Layout:
    """Where each kind of file of one cache root lives."""

    root: Path

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def entry_dir(self, key: str) -> Path:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key

    def lock_path(self, key: str) -> Path:
        return self.locks / f"{self.entry_dir(key).name}.lock"

    def build_dirs(self, key: str) -> list[Path]:
        """Temporary build directories for ``key`` (live or left by a dead builder)."""
        try:
            return sorted(p for p in self.tmp.iterdir() if p.name.startswith(f"{key}."))
        except FileNotFoundError:
            return []

    def new_build_dir(self, key: str) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        path = self.tmp / f"{self.entry_dir(key).name}.{_fs.unique_suffix()}"
        path.mkdir()
        return path


def parse_build_dir_name(name: str) -> tuple[Optional[str], str, Optional[int]]:
    """(key, host, pid) from a ``KEY.HOST.PID.UUID`` name made by :meth:`Layout.new_build_dir`
    (the host may hold dots); key is None when the name is not one of those."""
    key, _, rest = name.partition(".")
    parts = rest.rsplit(".", 2)
    if not is_key(key) or len(parts) != 3:
        return None, "", None
    host, pid, _ = parts
    return key, host, int(pid) if pid.isdigit() else None


def read_manifest(entry_dir: Path) -> dict[str, Any]:
    """Parse and schema-check ``entry_dir/manifest.json``.

    Raises FileNotFoundError when the entry does not exist and CacheCorruptError when the
    manifest is unreadable or malformed.
    """
    path = entry_dir / MANIFEST_FILE
    try:
        if os.path.islink(entry_dir):
            raise CacheCorruptError(entry_dir, "an entry is never a symlink")
        with _fs.open_regular(path) as f:  # no symlink, no FIFO: never read outside the root
            raw = f.read(_MANIFEST_LIMIT + 1)
        if len(raw) > _MANIFEST_LIMIT:
            raise ValueError(f"larger than {_MANIFEST_LIMIT} bytes")
        manifest = json.loads(raw)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        if isinstance(e, CacheCorruptError) or (isinstance(e, OSError)
                                                and e.errno not in _NOT_A_FILE):
            raise  # an I/O error (EIO, EACCES, ...) is not evidence of a corrupt entry
        raise CacheCorruptError(path, f"unreadable manifest ({e})") from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: Any, path: Path) -> None:
    """Raise CacheCorruptError unless ``manifest`` has every field with the right type."""
    if not isinstance(manifest, dict):
        raise CacheCorruptError(path, "manifest is not a JSON object")
    for field, kind in _REQUIRED.items():
        value = manifest.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CacheCorruptError(path, f"manifest field {field!r} is missing or not {kind}")
    if manifest["format"] != FORMAT_VERSION:
        raise CacheCorruptError(path, f"format {manifest['format']} is not {FORMAT_VERSION}")
    if manifest["key"] != path.parent.name:
        raise CacheCorruptError(path, f"manifest key {manifest['key']} != directory name")
    shape = manifest["shape"]
    _check_shape_dtype(shape, manifest["dtype"], path)
    # A memoized function may return a 0-d array first; it counts as one row.
    scalar_ok = manifest["kind"] == MEMOIZE_KIND and shape == [] and manifest["rows"] == 1
    if not scalar_ok and (not shape or shape[0] != manifest["rows"]):
        raise CacheCorruptError(path, f"shape {shape} does not start with rows {manifest['rows']}")
    if manifest["kind"] == MEMOIZE_KIND:
        _check_leaves(manifest, path)
    for failure in manifest["failed_rows"]:
        if not (isinstance(failure, list) and len(failure) == 3 and isinstance(failure[0], int)
                and 0 <= failure[0] < manifest["rows"]):
            raise CacheCorruptError(path, f"bad failed_rows item {failure!r}")


def _check_shape_dtype(shape: Any, dtype: Any, path: Path) -> None:
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise CacheCorruptError(path, f"bad shape {shape!r}")
    try:
        parsed = np.dtype(dtype)
    except Exception:  # numpy raises TypeError, ValueError, even SyntaxError (",,")
        raise CacheCorruptError(path, f"bad dtype {dtype!r}") from None
    if parsed.hasobject:
        raise CacheCorruptError(path, "object dtype is never stored")


def _check_leaves(manifest: dict[str, Any], path: Path) -> None:
    """A memoize entry: one .npy file per returned array, ``data.npy`` first, each named in
    ``leaves`` (and checksummed in ``checksums``), arranged by ``structure``."""
    leaves, checksums = manifest.get("leaves"), manifest.get("checksums")
    if not isinstance(leaves, list) or not leaves or not isinstance(checksums, dict):
        raise CacheCorruptError(path, "memoize manifest needs a non-empty 'leaves' list and "
                                      "a 'checksums' object")
    if "structure" not in manifest:
        raise CacheCorruptError(path, "memoize manifest has no 'structure'")
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, dict) or leaf.get("file") != leaf_file(i):
            raise CacheCorruptError(path, f"leaf {i} must be stored in {leaf_file(i)}")
        if leaf.get("kind") not in ("numpy", "torch"):
            raise CacheCorruptError(path, f"leaf {i} has unknown kind {leaf.get('kind')!r}")
        _check_shape_dtype(leaf.get("shape"), leaf.get("dtype"), path)
        if i and not isinstance(checksums.get(leaf["file"]), str):
            raise CacheCorruptError(path, f"leaf {i} has no checksum")
    if leaves[0]["shape"] != manifest["shape"] or leaves[0]["dtype"] != manifest["dtype"]:
        raise CacheCorruptError(path, "leaf 0 disagrees with the manifest's shape and dtype")


def leaf_file(index: int) -> str:
    """File name of a memoize entry's ``index``-th array; the first is the usual data file."""
    return DATA_FILE if index == 0 else f"leaf_{index}.npy"


def entry_files(manifest: dict[str, Any]) -> list[tuple[str, tuple[int, ...], np.dtype, str]]:
    """Every data file of a checked manifest as (name, shape, dtype, expected checksum)."""
    if manifest["kind"] != MEMOIZE_KIND:
        return [(DATA_FILE, tuple(manifest["shape"]), np.dtype(manifest["dtype"]),
                 manifest["checksum"])]
    return [
        (leaf["file"], tuple(leaf["shape"]), np.dtype(leaf["dtype"]),
         manifest["checksum"] if i == 0 else manifest["checksums"][leaf["file"]])
        for i, leaf in enumerate(manifest["leaves"])
    ]


def create_array(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> np.memmap:
    """Create a zero-filled .npy file of ``shape`` and map it for writing."""
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


def data_offset(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Validate ``path``'s .npy header and size against shape/dtype; return the data offset."""
    with _open_data(path) as f:
        return _validated_offset(f, path, shape, dtype)


def _open_data(path: Path) -> BinaryIO:
    try:
        return _fs.open_regular(path)  # no symlink, no FIFO: never read outside the root
    except FileNotFoundError:
        raise CacheCorruptError(path, "data file is missing") from None
    except OSError as e:
        if e.errno not in _NOT_A_FILE:
            raise  # an I/O error (EIO, EACCES, ...) is not evidence of a corrupt entry
        raise CacheCorruptError(path, f"data file is not a regular file ({e})") from None


def _validated_offset(f: BinaryIO, path: Path, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Check an open .npy file's header and size against shape/dtype; return the offset."""
    try:
        f.seek(0)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, TypeError, SyntaxError) as e:
        raise CacheCorruptError(path, f"unreadable .npy header ({e})") from None
    file_shape, fortran_order, file_dtype = header
    if fortran_order or tuple(file_shape) != tuple(shape) or file_dtype != dtype:
        raise CacheCorruptError(
            path, f"header says {file_dtype} {tuple(file_shape)}, manifest says {dtype} {shape}"
        )
    expected = offset + math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if size != expected:
        raise CacheCorruptError(path, f"file is {size} bytes, expected {expected}")
    return offset


def open_array(entry_dir: Path, manifest: dict[str, Any], mode: str = "r") -> np.ndarray:
    """Map an entry's data read-only (``mode="r"``) or copy-on-write (``mode="c"``)."""
    return open_file(entry_dir / DATA_FILE, tuple(manifest["shape"]),
                     np.dtype(manifest["dtype"]), mode)


def open_file(path: Path, shape: tuple[int, ...], dtype: np.dtype, mode: str = "r") -> np.ndarray:
    """Map one validated .npy file read-only (``mode="r"``) or copy-on-write (``mode="c"``)."""
    # One descriptor is validated and mapped, so the file cannot be swapped in between.
    with _open_data(path) as f:
        offset = _validated_offset(f, path, shape, dtype)
        if 0 in shape:  # mmap cannot map zero bytes; there is nothing to read
            empty = np.zeros(shape, dtype)
            empty.flags.writeable = mode != "r"
            return empty
        return np.memmap(f, dtype=dtype, mode=mode, offset=offset, shape=shape)


def checksum(path: Path) -> str:
    """blake2b-128 of the whole data file (header included), read in large blocks."""
    hasher = hashlib.blake2b(digest_size=16)
    with _fs.open_regular(path) as f:
        for block in iter(lambda: f.read(_CHECKSUM_BLOCK), b""):
            hasher.update(block)
    return "blake2b-128:" + hasher.hexdigest()
