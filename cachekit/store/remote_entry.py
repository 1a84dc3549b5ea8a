"""Where a remote entry's objects lie in a :class:`~cachekit.store.bucket.Bucket`, and how
its manifest is read: the layer that upload, download and listing share.

::

    PREFIX/entries/KEY/manifest.json        the commit point: names its upload
                                            ("upload": UPLOAD, "pool": true)
    PREFIX/entries/KEY/UPLOAD/row_map.npy   the data objects of one upload (UPLOAD: 32 hex
                                            digits, fresh per upload)
    PREFIX/entries/KEY/UPLOAD/pool.json     the pool objects the upload relies on, written
                                            before it looks into the pool
    PREFIX/parts/HEX                        a row data file, named by its checksum's HEX
                                            digits: stored once, whatever entries name it

The row data files of an images or map entry (its ``data.npy`` with its row identities and
stats, and the parts of a derived entry) lie in the pool, ``PREFIX/parts/``: a file that
several entries hold, a fold and the full entry it shares rows with, is uploaded once.
Their other files (the row map, the manifest) are their own.

Remote data are untrusted: a manifest is read with a size cap and checked field by field
(:func:`cachekit.store.manifest.loads`), and each object's size is checked before a byte
of it is read (:func:`check_sizes`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import manifest as manifests
from ..errors import CacheCorruptError, UnsignedEntryError
from ..key_names import is_key
from .bucket import Bucket
from .manifest import (DATA_FILE, MANIFEST_FILE, ROW_IDS_FILE, ROW_STATS_FILE, FileRecord,
                       Manifest, is_part_file)

UPLOAD_FIELD = "upload"
"""The manifest field that names the upload holding the entry's data objects."""
POOL_FIELD = "pool"
"""The manifest field that says the entry's row data files lie in the pool (true). An
entry uploaded before the pool existed has none: all of its objects are its upload's."""
POOL_FOLDER = "parts"
"""The folder of the row data files that entries share, each named by its checksum."""
PINS_FILE = "pool.json"
"""An upload's object listing the pool objects it relies on (:func:`pin`): ``cachekit clear
--remote`` spares them while the upload is recent, before a manifest names them."""
PINS_LIMIT = 1 << 20
"""The bytes of a ``pool.json`` read at most (a list of paths: a few KB)."""
MANIFEST_RETRY_SECONDS = 0.2
_HEX32 = re.compile(r"[0-9a-f]{32}")
_ROW_DATA = (DATA_FILE, ROW_IDS_FILE, ROW_STATS_FILE)


@dataclass(frozen=True)
class RemoteEntry:
    """A published remote entry: its checked manifest and the upload holding its data."""

    manifest: Manifest
    upload: str
    url: str
    """The manifest object's URL, for messages."""
    pool: bool = True
    """Whether its row data files lie in the pool (:data:`POOL_FIELD`)."""

    def objects(self, bucket: Bucket) -> list[str]:
        """Where each of its files lies (:func:`object_paths`)."""
        return object_paths(bucket, self.manifest, self.upload, self.pool)

    def pooled(self, record: FileRecord) -> bool:
        """Whether its file ``record`` lies in the pool."""
        return self.pool and pooled(self.manifest, record)

    @property
    def key(self) -> str:
        return self.manifest.key


def is_upload_id(text: Any) -> bool:
    return isinstance(text, str) and _HEX32.fullmatch(text) is not None


def manifest_path(bucket: Bucket, key: str) -> str:
    """The path of ``key``'s manifest object (ValueError for a non-key: no path is built
    from untrusted text)."""
    if not is_key(key):
        raise ValueError(f"not a cache key: {key!r}")
    return bucket.path("entries", key, MANIFEST_FILE)


def upload_path(bucket: Bucket, key: str, upload: str, name: str = "") -> str:
    """The folder of one upload of ``key``, or its object ``name``."""
    if not is_key(key) or not is_upload_id(upload):
        raise ValueError(f"not a cache key and upload id: {key!r} {upload!r}")
    return bucket.path("entries", key, upload, *([name] if name else []))


def pooled(manifest: Manifest, record: FileRecord) -> bool:
    """Whether ``manifest``'s file ``record`` lies in the pool: a row data file (its own or a
    part) of an entry whose rows other entries may share."""
    return manifest.reuse is not None and (record.name in _ROW_DATA
                                           or is_part_file(record.name))


def pool_path(bucket: Bucket, checksum: str) -> str:
    """The pool object of the file whose checksum is ``checksum`` (checked by the manifest:
    ``blake2b-128:`` and 32 hex digits)."""
    digits = checksum.partition(":")[2]
    if _HEX32.fullmatch(digits) is None:
        raise ValueError(f"not a checksum: {checksum!r}")
    return bucket.path(POOL_FOLDER, digits)


def object_paths(bucket: Bucket, manifest: Manifest, upload: str, pool: bool = True
                 ) -> list[str]:
    """Where each file of ``manifest`` lies when ``upload`` holds the entry: in the pool
    (``pool``: an entry uploaded since the pool exists), or under the upload."""
    return [pool_path(bucket, f.checksum) if pool and pooled(manifest, f)
            else upload_path(bucket, manifest.key, upload, f.name) for f in manifest.files]


def pin(bucket: Bucket, key: str, upload: str, paths: Sequence[str]) -> None:
    """Write the list of pool objects ``paths`` that ``upload`` of ``key`` relies on."""
    bucket.write(upload_path(bucket, key, upload, PINS_FILE), json.dumps(list(paths)).encode())


def pinned(bucket: Bucket, key: str, upload: str) -> set[str]:
    """The pool objects ``upload`` of ``key`` relies on (:func:`pin`): empty when it lists
    none, or its list cannot be read (gone, or not a list of pool paths: untrusted, it can
    only keep objects of the pool from a sweep). RemoteUnavailableError when the remote
    fails: the caller cannot tell what it relies on."""
    try:
        raw = bucket.read(upload_path(bucket, key, upload, PINS_FILE), 0, PINS_LIMIT)
    except FileNotFoundError:
        return set()
    try:
        paths = json.loads(raw)
    except ValueError:
        return set()
    pool = bucket.path(POOL_FOLDER) + "/"
    if not isinstance(paths, list):
        return set()
    return {p for p in paths if isinstance(p, str) and p.startswith(pool)
            and _HEX32.fullmatch(p[len(pool):])}


def fix_for(key: str) -> str:
    """What to do about a remote entry of ``key`` whose objects disagree with its manifest."""
    return (f"nothing was published locally; remove the remote entry with `cachekit "
            f"clear --remote {key[:12]}` and it is built and uploaded again on next use")


def lookup(bucket: Bucket, key: str) -> Optional[RemoteEntry]:
    """The published remote entry of ``key``, or None. CacheCorruptError (naming the
    manifest object) when its manifest is too large, malformed, of another key, or not
    validly signed while ``$CACHEKIT_SIGNING_KEY`` is set."""
    path = manifest_path(bucket, key)
    url = bucket.object_url(path)
    for attempt in (1, 2):
        try:
            raw = bucket.read(path, 0, manifests.MANIFEST_LIMIT + 1)
        except FileNotFoundError:
            return None
        try:
            return parse_manifest(raw, url, key)
        except UnsignedEntryError:
            raise
        except CacheCorruptError:
            # On a shared folder (file://) a create-only write is O_EXCL and then a
            # write, so a reader may catch a manifest half written: read it once more.
            if attempt == 2:
                raise
            time.sleep(MANIFEST_RETRY_SECONDS)
    raise AssertionError("unreachable")


def parse_manifest(raw: bytes, url: str, key: str) -> RemoteEntry:
    """A remote manifest's bytes checked (size cap, schema, signature) as ``key``'s entry,
    with the upload it names."""
    fields = manifests.signed_fields(raw, url)
    manifest = manifests.Manifest.from_json(fields, url, key)
    upload = fields.get(UPLOAD_FIELD)
    if not is_upload_id(upload):
        raise CacheCorruptError(url, f"the manifest names no valid upload ({upload!r})",
                                f"remove it with `cachekit clear --remote {key[:12]}`")
    return RemoteEntry(manifest, upload, url, fields.get(POOL_FIELD) is True)


def check_sizes(bucket: Bucket, key: str, records: Sequence[FileRecord],
                objects: Sequence[str]) -> None:
    """Each object of ``key``'s entry against its record, its size read before a byte of it
    is."""
    for record, path in zip(records, objects):
        url = bucket.object_url(path)
        try:
            size = bucket.size(path)
        except FileNotFoundError:
            raise CacheCorruptError(url, "a data object the manifest lists is missing",
                                    fix_for(key)) from None
        if size != record.bytes:
            raise CacheCorruptError(url, f"object is {size} bytes, the manifest says "
                                         f"{record.bytes}", fix_for(key))


def remove_upload(bucket: Bucket, key: str, upload: str, *, quiet: bool = False) -> None:
    """Delete the objects of one upload (best effort with ``quiet``)."""
    bucket.remove_tree(upload_path(bucket, key, upload), quiet=quiet)
