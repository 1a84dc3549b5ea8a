"""The remote entry store: entries shared through an object store (S3, GCS, Azure, a shared
folder), through fsspec. It only needs reads, plain writes, deletes, listings and one
conditional operation, the create-only write (``If-None-Match: *``, fsspec
``mode="create"``), which s3fs, gcsfs and adlfs all expose.

::

    PREFIX/entries/KEY/manifest.json        the commit point: written create-only, last;
                                            names its upload ("upload": UPLOAD)
    PREFIX/entries/KEY/UPLOAD/row_map.npy   the data objects of one upload (UPLOAD: 32 hex
                                            digits, fresh per upload)
    PREFIX/entries/KEY/UPLOAD/pool.json     the pool objects the upload relies on
    PREFIX/parts/HEX                        a row data file, named by its checksum: stored
                                            once, whatever entries name it
    PREFIX/leases/KEY/GEN.json, GEN.beat    build leases (see :mod:`.lease`)
    PREFIX/clock/PROBE                      for a moment: the store's time (:meth:`clock`)

Every upload writes its data objects under an upload id of its own, so two hosts uploading
one key at once never write the same object; then each tries to create the manifest, and
the store lets exactly one succeed (:mod:`.remote_upload`). The loser removes its objects.
An uploader killed at any moment leaves objects that no manifest names (or nothing at all):
never a manifest naming missing or partial data. ``cachekit clear --remote`` lists them
(:mod:`.remote_listing`) and removes them, with the pool objects that no manifest names. Without working conditional writes (a store
that lets both creates succeed), the last manifest written wins and names a complete
upload of its own: still one valid entry.

Remote data are untrusted: a manifest is read with a size cap and checked field by field
(:func:`cachekit.store.manifest.loads`: file names from the fixed set only, the signature with
``$CACHEKIT_SIGNING_KEY``), each object's size is checked before it is read, and every
checksum after, before anything is published locally (:mod:`.remote_download`); a mismatch
is CacheCorruptError naming the remote object, and the build directory it was downloaded
into is discarded.

The store is built in layers, each importing only those below it: :mod:`.bucket` (one URL's
objects: paths, calls, create-only writes, ranged reads, sizes, removal) under
:mod:`.remote_entry` (where an entry's objects lie, its manifest read and checked), under
:mod:`.remote_upload`, :mod:`.remote_download` and :mod:`.remote_listing`, under this face.

Every remote call is bounded by ``$CACHEKIT_REMOTE_TIMEOUT`` seconds (default 30), retries
included; a call that fails or runs out of time raises RemoteUnavailableError.
"""

from __future__ import annotations

from . import remote_download, remote_entry, remote_listing, remote_upload
from ..errors import CacheCorruptError
from .bucket import Bucket
from .remote_entry import RemoteEntry
from .remote_fs import (CHECK, EXISTS, OTHER, REMOTE_ENV, TIMEOUT_ENV, classify_failed_create,
                        redact, timeout_from_env, url_from_env)
from .remote_listing import RemoteKey, RemoteObject
from .remote_upload import NONE, OTHERS, OURS, UNKNOWN, sent_note

__all__ = ["CHECK", "EXISTS", "NONE", "OTHER", "OTHERS", "OURS", "REMOTE_ENV", "TIMEOUT_ENV",
           "UNKNOWN", "RemoteEntry", "RemoteKey", "RemoteObject", "RemoteStore",
           "classify_failed_create", "redact", "sent_note", "timeout_from_env", "url_from_env"]


class RemoteStore(Bucket):
    """Entries under one fsspec URL: the :class:`~cachekit.store.bucket.Bucket` (paths,
    calls, create-only writes, ranged reads, removal) with the entry operations of the
    modules below on it.

    The entry operations are those modules' functions themselves, taken on as methods
    (each takes the bucket first, and a RemoteStore is one): the modules never see this
    class, and nothing here only passes a call on. What is written here combines them."""

    manifest_path = remote_entry.manifest_path
    upload_path = remote_entry.upload_path
    object_paths = remote_entry.object_paths
    lookup = remote_entry.lookup
    parse_manifest = staticmethod(remote_entry.parse_manifest)
    check_sizes = remote_entry.check_sizes
    remove_upload = remote_entry.remove_upload
    pinned = remote_entry.pinned
    download = remote_download.download
    upload = remote_upload.upload
    named = remote_upload.named
    withdraw = remote_upload.withdraw
    scan = remote_listing.scan
    clock = remote_listing.clock

    def keys(self) -> list[str]:
        """The keys that have a manifest under the prefix, sorted (one listing)."""
        return [item.key for item in self.scan().keys if item.manifest is not None]

    def remove_entry(self, key: str) -> bool:
        """Remove the entry of ``key``: its manifest first (readers stop finding it at
        once, and never find it without its data), then the upload it named. False when
        there was no manifest. A manifest too broken to name its upload leaves that upload
        to ``cachekit clear --remote``, which also removes the pool objects no manifest
        names."""
        try:
            found = self.lookup(key)
        except CacheCorruptError:
            found = None
        path = self.manifest_path(key)
        if found is None and not self.exists(path):
            return False
        self.remove([path], f"removing {self.object_url(path)}")
        if found is not None:
            self.remove_upload(key, found.upload)
        return True
