"""The manifest: what a published entry holds, typed, and its one JSON form.

A manifest is the last file written into an entry, so an entry with a valid manifest is
complete. It lists every file the entry publishes with its size and checksum: what opening
an entry validates, what ``cachekit verify`` checks byte for byte, and what a remote tier
uploads and checks after a download. ``shape`` and ``dtype`` in the JSON repeat the data
files' (a derived entry's rows, and its files' row shape), for people and tools that read
``entry.manifest``; reading checks that they agree.

A manifest is untrusted input (another process, user or host may have written it): every
field is type-checked, file names come from a fixed set (never a path), and numbers that
size an allocation are checked against the data file before use (see :mod:`cachekit.arrays`).

With ``CACHEKIT_SIGNING_KEY`` set, :func:`dumps` (and so :func:`write_at`) adds a
``"signature"`` field, and :func:`loads` (and so :func:`read`: every hit, ``ls``, ``info``
and ``verify``) checks it before any other field, raising
:class:`~cachekit.errors.UnsignedEntryError` when it is missing or wrong; see
:mod:`cachekit.store.signing` for what is signed. Without the key a signature is not checked.
The signature belongs to the file, not to the :class:`Manifest`: it is not a dataclass field
(it is computed from the other fields), so equality and the JSON round trip do not depend on
whether, or with which key, a manifest was signed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from .. import _fs
from . import signing
from ..errors import (CacheCorruptError, CachekitError, Failure, OtherFormatError,
                      UnsignedEntryError)
from ..key_names import FORMAT_VERSION, is_key
from ..small_json import is_number
from .records import (DATA_FILE, FAILURE_DETAILS, KINDS, LEAF_KINDS, MAX_PARTS, MEMOIZE_KIND,
                      ROW_BLOCKS_FILE, ROW_FILES, ROW_IDS_FILE, ROW_MAP_FILE, ROW_STATS_FILE,
                      FileRecord, Origin, RowReuse, allowed_file_name, check_rows_files,
                      count_field, failed_mask_text, file_name, get_field, is_part_file,
                      is_part_name, parse_failed_mask, parse_failure, parse_file_record,
                      parse_origin, parse_reuse, part_name, sidecar_name, SIDECARS)

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DATA_FILE", "KINDS", "LEAF_KINDS", "MANIFEST_FILE", "MANIFEST_LIMIT", "MEMOIZE_KIND",
           "ROW_BLOCKS_FILE", "ROW_FILES", "ROW_FILES_LIMIT", "FAILURE_DETAILS", "ROW_IDS_FILE",
           "ROW_MAP_FILE", "ROW_STATS_FILE", "SIDECARS", "is_part_file", "is_part_name",
           "part_name", "sidecar_name", "FileRecord", "Manifest", "Origin", "RowReuse",
           "allowed_file_name", "dumps", "failed_fields", "file_name", "loads", "read",
           "read_at", "write_at"]

MANIFEST_FILE = "manifest.json"
MANIFEST_LIMIT = 64 << 20  # a tampered manifest must not exhaust memory
WRITE_LIMIT = MANIFEST_LIMIT - (1 << 10)
"""The largest manifest written: what a reader accepts, with room for the signature."""
ROW_FILES_LIMIT = 1 << 30
"""The largest row file read into memory (a billion bytes: 67 million rows)."""


@dataclass(frozen=True)
class Manifest:
    """A published entry's description. ``files[0]`` is the entry's main array
    (``data.npy``), except in a derived entry that decoded none of its rows, which has
    none: its row map comes first, and its parts hold every row."""

    key: str
    kind: str
    rows: int
    files: tuple[FileRecord, ...]
    created: float
    failed_rows: tuple[Failure, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    column: Optional[str] = None
    structure: Optional[dict[str, Any]] = None
    builder: dict[str, Any] = field(default_factory=dict)
    build_seconds: float = 0.0
    cachekit_version: str = ""
    format: int = FORMAT_VERSION
    reuse: Optional[RowReuse] = None
    origin: Optional[Origin] = None
    failed_build: Optional[str] = None
    """For the rows a failed build kept (:func:`cachekit.keys.kept_key`): the key whose
    build failed. Such an entry lends its good rows to later builds; it is never a hit."""
    failed_mask: Optional[str] = None
    """Every failed row, as :func:`~cachekit.store.records.failed_mask_text` encodes it;
    ``failed_rows`` details only the first :data:`FAILURE_DETAILS`. None: the details are
    all (no row failed, or a manifest of an older cachekit)."""

    @property
    def failed_count(self) -> int:
        """How many rows failed (stored as zeros, or not kept)."""
        return int(self.failed().sum()) if self.failed_mask is not None \
            else len(self.failed_rows)

    def failed(self) -> np.ndarray:
        """A read-only (rows,) bool mask of the rows that failed (decoded once)."""
        return self._failed

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without what its fields give (:data:`_DERIVED`; the mask, a byte a row):
        an Entry goes to every DataLoader worker, which derives them if it needs them."""
        return {k: v for k, v in self.__dict__.items() if k not in _DERIVED}

    @cached_property
    def _failed(self) -> np.ndarray:
        import numpy as np

        if self.failed_mask is not None:
            mask = parse_failed_mask(self.failed_mask, self.rows,
                                     lambda reason: CacheCorruptError(self.key, reason))
        else:
            mask = np.zeros(self.rows, dtype=bool)
            mask[[row for row, _, _ in self.failed_rows]] = True
        mask.flags.writeable = False
        return mask

    @property
    def shape(self) -> tuple[int, ...]:
        """The entry's array: (rows, row shape...), whichever files hold the rows."""
        first = self.data_files[0].shape
        return first if self.contiguous else (self.rows, *first[1:])

    @property
    def contiguous(self) -> bool:
        """Whether the rows are the one data file's, in order (no row map: not derived)."""
        return self.row_file(ROW_MAP_FILE) is None

    @property
    def own(self) -> Optional[FileRecord]:
        """The entry's own data file, ``data.npy``; None for a derived entry that decoded
        none of its rows."""
        first = self.files[0]
        return first if first.name == DATA_FILE else None

    @cached_property
    def parts(self) -> tuple[FileRecord, ...]:
        """The data files of other entries that this derived entry links, in name order."""
        return tuple(f for f in self.files if is_part_name(f.name))

    @cached_property
    def data_files(self) -> tuple[FileRecord, ...]:
        """The files that hold rows, as a row map numbers them: ``data.npy`` (if the entry
        has one), then the parts."""
        own = self.own
        return self.parts if own is None else (own, *self.parts)

    @property
    def dtype(self) -> np.dtype:
        return self.data_files[0].np_dtype

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def array_bytes(self) -> int:  # its rows, each once: what a contiguous copy holds
        return math.prod(self.shape) * self.dtype.itemsize

    def row_file(self, name: str) -> Optional[FileRecord]:
        """The record of the row file ``name`` (:data:`ROW_FILES`, or a part's copy), or
        None when the entry has none (made by an older cachekit, or a memoize entry)."""
        return self._row_files.get(name)

    @cached_property
    def _row_files(self) -> dict[str, FileRecord]:
        """Its files by name, found at once: a derived entry looks up a copy of each row
        file for each of its parts, which may be thousands."""
        return {} if self.kind == MEMOIZE_KIND else {f.name: f for f in self.files}

    @property
    def parts_only(self) -> bool:
        """Whether this is a derived entry whose every row is a part's: it lists no data file
        and no row files of its own (the parts' copies of :data:`SIDECARS` describe its
        rows). Its parts are other entries' files, or (its rows repeat others) a part of
        its own that holds the rows it decoded."""
        return self.own is None

    def has_row_records(self, name: str) -> bool:
        """Whether every row has a record in the row file ``name`` (:data:`SIDECARS`): in
        the entry's own file, or for an entry that :attr:`parts_only`, in every part's
        copy."""
        if self.row_file(name) is not None:
            return True
        return self.parts_only and all(
            self.row_file(sidecar_name(part.name, name)) is not None
            for part in self.parts)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``manifest.json`` (also ``entry.manifest``), without
        the ``"signature"`` field that :func:`dumps` adds when a signing key is set."""
        out: dict[str, Any] = {
            "format": self.format, "key": self.key, "kind": self.kind, "rows": self.rows,
            "shape": list(self.shape), "dtype": self.data_files[0].dtype,
            "files": [f.to_json() for f in self.files], "created": self.created,
            "failed_rows": [list(f) for f in self.failed_rows], "params": self.params,
            "column": self.column, "builder": self.builder,
            "build_seconds": self.build_seconds, "cachekit_version": self.cachekit_version,
        }
        if self.structure is not None:
            out["structure"] = self.structure
        if self.reuse is not None:
            out["reuse"] = self.reuse.to_json()
        if self.origin is not None:
            out["origin"] = self.origin.to_json()
        if self.failed_build is not None:
            out["failed_build"] = self.failed_build
        if self.failed_mask is not None:
            out["failed_mask"] = self.failed_mask
        return out

    @classmethod
    def from_json(cls, raw: Any, path: Union[str, Path], key: Optional[str] = None) -> "Manifest":
        """Check ``raw`` (parsed from ``path``) field by field; CacheCorruptError naming the
        field when anything is missing, of the wrong type or inconsistent. ``key``: the key
        the entry is stored under, which the manifest must name."""
        return _parse(raw, path, key)


_DERIVED = frozenset(n for n, v in vars(Manifest).items() if isinstance(v, cached_property))
"""The cached properties of a :class:`Manifest` (found, not listed: none is missed)."""


def failed_fields(rows: int, failures: Any) -> dict[str, Any]:
    """The manifest fields of a build's ``failures`` (every failed row, in row order):
    the first :data:`FAILURE_DETAILS` with their value and reason, and the mask of all."""
    failures = sorted(failures)
    return {"failed_rows": tuple(failures[:FAILURE_DETAILS]),
            "failed_mask": failed_mask_text(rows, [row for row, _, _ in failures])}


def read(entry_dir: Path, key: Optional[str] = None) -> Manifest:
    """Parse and check ``entry_dir/manifest.json``; ``key``: the key it must name (default:
    the directory's name).

    FileNotFoundError when there is no entry or no manifest; CacheCorruptError when the
    entry is a symlink, or the manifest unreadable, malformed, a symlink or not a file;
    other OSErrors (EIO, EACCES) propagate as they are.
    """
    try:
        directory = _fs.DirHandle.open(entry_dir)
    except OSError as e:
        if e.errno not in _fs.NOT_A_FILE_ERRNOS:
            raise
        raise CacheCorruptError(entry_dir, "an entry is never a symlink or a file") from None
    with directory:
        return read_at(directory, entry_dir.name if key is None else key)


def read_at(entry: _fs.DirHandle, key: str) -> Manifest:
    """Parse and check the manifest of the open entry directory ``entry`` of ``key``."""
    path = f"{entry.path}/{MANIFEST_FILE}"  # for messages: a str costs less than a Path
    try:
        raw = entry.read_file(MANIFEST_FILE, MANIFEST_LIMIT)  # no symlink, no FIFO
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno not in _fs.NOT_A_FILE_ERRNOS:
            raise  # an I/O error is not evidence of a corrupt entry
        raise CacheCorruptError(path, f"unreadable manifest ({e})") from None
    return loads(raw, path, key)


def loads(raw: bytes, path: Union[str, Path], key: Optional[str] = None) -> Manifest:
    """Parse manifest bytes read from ``path`` (a local file, or a remote object's URL).

    With ``CACHEKIT_SIGNING_KEY`` set, UnsignedEntryError (a CacheCorruptError) unless the
    parsed object carries a valid signature; checked before any other field.
    """
    return Manifest.from_json(signed_fields(raw, path), path, key)


def signed_fields(raw: bytes, path: Union[str, Path]) -> dict[str, Any]:
    """The JSON object of manifest bytes read from ``path``, its size and (with
    ``CACHEKIT_SIGNING_KEY`` set) its signature checked; its fields are not."""
    if len(raw) > MANIFEST_LIMIT:
        raise CacheCorruptError(path, f"manifest is larger than {MANIFEST_LIMIT} bytes")
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CacheCorruptError(path, f"unreadable manifest ({e})") from None
    secret = signing.key()
    if secret is not None:
        reason = signing.problem(parsed, secret)
        if reason is not None:
            raise UnsignedEntryError(path, reason)
    return parsed


def dumps(manifest: Manifest, extra: Optional[dict[str, Any]] = None) -> bytes:
    """The bytes of ``manifest.json`` for ``manifest``, signed when CACHEKIT_SIGNING_KEY is
    set. ``extra``: fields added to the JSON object (and so signed with it), such as the
    upload a remote manifest names; reading ignores fields it does not know."""
    # No indent: json's C encoder, several times faster than its indenting one.
    text = json.dumps({**manifest.to_json(), **(extra or {})}, sort_keys=True)
    if len(text) > WRITE_LIMIT:  # what a reader refuses is never written
        raise CachekitError(f"the manifest of entry {manifest.key} would be {len(text)} "
                            f"bytes, more than the {WRITE_LIMIT} a reader accepts; "
                            "its params or structure are too large to record")
    secret = signing.key()
    if secret is not None:
        # Sign the object as a reader will parse it back (JSON has string keys only, and
        # lists for tuples), so writer and reader canonicalize the same object.
        parsed = json.loads(text)
        parsed[signing.FIELD] = signing.sign(signing.canonical(parsed), secret)
        text = json.dumps(parsed, sort_keys=True)
    return (text + "\n").encode()


def write_at(build: _fs.DirHandle, manifest: Manifest) -> None:
    """Write ``manifest.json`` into the open build directory ``build``, fresh: the one place
    a manifest is written, as the last file of a build. Not flushed: the commit fsyncs it
    with the build's other files and the directory."""
    build.write_new(MANIFEST_FILE, dumps(manifest), durable=False)


# Parsing ---------------------------------------------------------------------------------


def _parse(raw: Any, path: Union[str, Path], key: Optional[str]) -> Manifest:
    def fail(reason: str) -> CacheCorruptError:
        return CacheCorruptError(path, reason)

    if not isinstance(raw, dict):
        raise fail("manifest is not a JSON object")
    if raw.get("format") != FORMAT_VERSION:
        raise OtherFormatError(path, f"format {raw.get('format')!r} is not {FORMAT_VERSION} "
                                     "(made by another cachekit version)")
    entry_key = get_field(raw, "key", str, fail)
    if not is_key(entry_key) or (key is not None and entry_key != key):
        raise fail(f"manifest key {entry_key!r} does not name this entry")
    kind = get_field(raw, "kind", str, fail)
    if kind not in KINDS:
        raise fail(f"unknown kind {kind!r}")
    rows = count_field(raw.get("rows"), "rows", fail)
    files_raw = get_field(raw, "files", list, fail)
    if not files_raw or (kind != MEMOIZE_KIND
                         and len(files_raw) > 1 + len(ROW_FILES) + 3 * MAX_PARTS):
        raise fail(f"a {kind} entry has {len(files_raw)} files")
    files = tuple(parse_file_record(i, item, fail) for i, item in enumerate(files_raw))
    names = [f.name for f in files]
    part_files = [n for n in names if is_part_file(n)] if kind != MEMOIZE_KIND else []
    parts = [n for n in part_files if is_part_name(n)]
    expected = ([file_name(i) for i in range(len(files))] if kind == MEMOIZE_KIND else
                [DATA_FILE] * (DATA_FILE in names) + [n for n in ROW_FILES if n in names]
                + sorted(set(part_files)))
    if names != expected:
        raise fail(f"a {kind} entry's files must be {expected[:8]}, not {names[:8]}")
    check_rows_files(files, rows, kind, bool(parts), fail)
    first = next(f for f in files if f.name == DATA_FILE or is_part_name(f.name))
    shape = list(first.shape) if not parts else [rows, *first.shape[1:]]
    if raw.get("shape") != shape or raw.get("dtype") != first.dtype:
        raise fail("shape and dtype disagree with the data files'")
    created = raw.get("created")
    if not is_number(created) or not math.isfinite(created):
        raise fail(f"bad created time {created!r}")
    failed = tuple(parse_failure(item, rows, fail)
                   for item in get_field(raw, "failed_rows", list, fail))
    failed_mask = raw.get("failed_mask")
    params = raw.get("params", {})
    column = raw.get("column")
    builder = raw.get("builder", {})
    build_seconds = raw.get("build_seconds", 0.0)
    version = raw.get("cachekit_version", "")
    if not isinstance(params, dict) or not isinstance(builder, dict):
        raise fail("params and builder must be JSON objects")
    if column is not None and not isinstance(column, str):
        raise fail(f"bad column {column!r}")
    if not is_number(build_seconds) or not isinstance(version, str):
        raise fail("bad build_seconds or cachekit_version")
    structure = raw.get("structure")
    if kind == MEMOIZE_KIND:
        if not isinstance(structure, dict):
            raise fail("a memoize manifest needs a 'structure' object")
    elif structure is not None or any(f.kind != "numpy" for f in files):
        raise fail(f"a {kind} entry has no structure and numpy files only")
    reuse = parse_reuse(raw.get("reuse"), kind, fail)
    origin = parse_origin(raw.get("origin"), kind, rows, fail)
    failed_build = raw.get("failed_build")
    if failed_build is not None and (reuse is None or not isinstance(failed_build, str)
                                     or not is_key(failed_build)):
        raise fail(f"bad failed_build field {failed_build!r}"[:200])
    manifest = Manifest(key=entry_key, kind=kind, rows=rows, files=files, created=float(created),
                        failed_rows=failed, params=params, column=column, structure=structure,
                        builder=builder, build_seconds=float(build_seconds),
                        cachekit_version=version, reuse=reuse, origin=origin,
                        failed_build=failed_build, failed_mask=failed_mask)
    if failed_mask is not None:  # checked here, decoded once for every later use
        mask = parse_failed_mask(failed_mask, rows, fail)
        if not all(mask[row] for row, _, _ in failed):
            raise fail("failed_rows names a row that failed_mask does not")
        mask.flags.writeable = False
        manifest.__dict__["_failed"] = mask
    return manifest


