"""Uploading a local entry to a bucket, and telling whose upload a remote manifest names.

Every upload writes its data objects under an upload id of its own (32 hex digits, fresh per
upload), and its row data files into the pool (each once: one that is there, of its size, is
not sent again, and the uploads of one process look for and send a pool object one at a
time, so that uploads running at once do not each send it; before it looks, it lists the pool
objects it relies on in its upload's ``pool.json``, which ``cachekit clear --remote`` spares
while the upload is recent), then tries to create the
manifest naming it (``"upload": UPLOAD``), create-only; the store lets exactly one succeed,
and the loser removes its upload's objects (never pool objects, which other entries may
name: ``cachekit clear --remote`` removes those that none names). No uploader removes
objects that a manifest may name: a create that fails without saying "exists" may have
landed, so the manifest is read back first. An uploader paused between its data and its
manifest may find, once its manifest wins, that a sweep removed its data: it checks after
every win and withdraws its manifest then.

The functions work on a :class:`~cachekit.store.bucket.Bucket` and the entry layout of
:mod:`.remote_entry`; :class:`~cachekit.store.bucket.RemoteStore` has them as its methods
``upload``, ``named`` and ``withdraw``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from typing import Any, BinaryIO, Callable, Mapping, Optional

from .. import _fs, checksums
from . import manifest as manifests
from ..errors import CacheCorruptError, RemoteUnavailableError
from ..units import format_size
from .bucket import Bucket
from .layout import Published
from .manifest import FileRecord
from .remote_entry import (POOL_FIELD, UPLOAD_FIELD, check_sizes, lookup, manifest_path, object_paths,
                           pin, pooled, remove_upload)
from .remote_fs import progress_bar

PUBLISH_ATTEMPTS = 2
OURS, OTHERS, NONE, UNKNOWN = "ours", "others", "none", "unknown"


class PoolObjectWent(CacheCorruptError):
    """An object the upload found in the pool was gone (or changed) at its check before
    the commit: another host's ``cachekit clear --remote`` took it. The upload starts again
    once; a local file found damaged as it is read is not tried again."""


Opened = Mapping[str, BinaryIO]
"""An entry's files by name, opened before its upload (:func:`open_files`)."""


def open_files(published: Published) -> dict[str, BinaryIO]:
    """The files of the local entry ``published``, opened now: an upload that runs later
    (in the background) sends these bytes even if the entry is removed from the root
    meanwhile (``clear``, ``prune`` or the budget's eviction unlink its files; an open file
    keeps its bytes). The caller closes them."""
    opened: dict[str, BinaryIO] = {}
    try:
        with _fs.DirHandle.open(published.path) as folder:  # all of one directory
            for record in published.manifest.files:
                opened[record.name] = folder.open_file(record.name)
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    return opened


def upload(bucket: Bucket, published: Published, *, progress: bool = False,
           sent: Optional[Callable[[int], None]] = None,
           opened: Optional[Opened] = None) -> bool:
    """Upload a local entry: its data objects under a fresh upload id, then the manifest,
    create-only. True when this call published the remote entry; False when one was
    there already (its own objects are then removed).

    Data a manifest may name is never removed: when the create fails in a way that does
    not say "exists" (no answer in time, a lost connection), the manifest is looked up
    first, and an upload that may still be named is left for ``cachekit clear
    --remote``. After a win, the objects are checked once more: a sweep that judged a
    paused uploader dead may have removed them meanwhile. Then the manifest is withdrawn
    and the entry uploaded again under a fresh id (once). ``sent(n)`` is told the size of
    each file sent (not of those the pool held already). ``opened``: files of the entry
    opened before (:func:`open_files`), read instead of the entry's paths. A pool object
    found in the bucket may go before the commit (``cachekit clear --remote`` of the
    entry that named it): the check before the commit finds it missing, and the upload
    starts again under a fresh id, which sends it (once)."""
    manifest = published.manifest
    key = manifest.key
    if lookup(bucket, key) is not None:
        return False
    for attempt in range(1, PUBLISH_ATTEMPTS + 1):
        upload_id = uuid.uuid4().hex
        try:
            won = _publish(bucket, published, upload_id, progress, sent or (lambda n: None),
                           opened or {})
        except PoolObjectWent:
            if attempt == PUBLISH_ATTEMPTS:
                raise
            continue  # a pool object it found went before its commit (a clear): send it
        if not won:
            return False
        objects = object_paths(bucket, manifest, upload_id)
        try:
            check_sizes(bucket, key, manifest.files, objects)
            return True
        except CacheCorruptError as e:
            if not withdraw(bucket, key, upload_id) and lookup(bucket, key) is not None:
                return False  # another upload is the entry now
            if attempt == PUBLISH_ATTEMPTS:
                raise CacheCorruptError(e.path, f"{e.reason} after its manifest was "
                                        "published; the manifest was withdrawn",
                                        "upload it again (`cachekit push`)") from None
    raise AssertionError("unreachable")


def _publish(bucket: Bucket, published: Published, upload_id: str,
             progress: bool, sent: Callable[[int], None], opened: Opened) -> bool:
    """Data objects under ``upload_id``, then the manifest naming them, create-only: True
    when ours is the key's manifest now, False when another one is (ours removed)."""
    manifest = published.manifest
    key = manifest.key
    bar = progress_bar(progress, manifest.bytes, f"cachekit push {key[:12]}")
    try:
        objects = object_paths(bucket, manifest, upload_id)
        try:
            relied_on = [path for record, path in zip(manifest.files, objects)
                         if pooled(manifest, record)]
            if relied_on:  # before it looks: a clear from now on spares them
                pin(bucket, key, upload_id, relied_on)
            for record, path in zip(manifest.files, objects):
                if _send(bucket, published, record, path, bar, opened):
                    sent(record.bytes)
                elif bar is not None:
                    bar.update(record.bytes)
            try:
                check_sizes(bucket, key, manifest.files, objects)  # all there before the commit
            except CacheCorruptError as e:  # a pool object it found went: a clear elsewhere
                raise PoolObjectWent(e.path, f"{e.reason} before the manifest naming it "
                                     "was published (a `cachekit clear --remote` elsewhere "
                                     "took it); nothing was published",
                                     "upload it again (`cachekit push`)") from None
        except BaseException:
            remove_upload(bucket, key, upload_id, quiet=True)  # no manifest can name it yet
            raise
        body = manifests.dumps(manifest, {UPLOAD_FIELD: upload_id, POOL_FIELD: True})
        path = manifest_path(bucket, key)

        def settle() -> None:
            # The create we gave up on has ended, maybe long after: if it made our
            # manifest after a sweep took our data, withdraw it.
            try:
                if named(bucket, key, upload_id) == OURS:
                    check_sizes(bucket, key, manifest.files, objects)
            except CacheCorruptError:
                withdraw(bucket, key, upload_id)

        try:
            won = bucket.create(path, body, f"publishing {bucket.object_url(path)}",
                                after_abandoned=_quietly(settle))
        except Exception:
            # The create may have landed while its answer was lost or came late.
            whose = named(bucket, key, upload_id)
            if whose == OURS:
                return True
            if whose == OTHERS:  # create-only: ours can never land now
                remove_upload(bucket, key, upload_id, quiet=True)
                return False
            raise  # no manifest yet, or cannot tell: leave the upload for the sweep
    finally:
        if bar is not None:
            bar.close()
    if won:
        return True
    # Refused as existing. A create retried after its answer was lost meets its own
    # manifest: a win. Otherwise ours never lands, so its data can go (unless the manifest
    # there cannot be read: it might be ours, half written on a shared folder).
    whose = named(bucket, key, upload_id)
    if whose in (OTHERS, NONE):
        remove_upload(bucket, key, upload_id, quiet=True)
    return whose == OURS


def sent_note(sent: int, total: int) -> str:
    """What a message about an upload of ``total`` bytes adds when it sent only ``sent``."""
    if sent >= total:
        return ""
    return f"; {format_size(sent)} sent, the rest was in the bucket already"


def named(bucket: Bucket, key: str, upload: str) -> str:
    """Whom the key's manifest names: OURS (``upload``), OTHERS (another upload), NONE
    (there is no manifest), or UNKNOWN (the remote fails, or the manifest is unreadable)."""
    try:
        found = lookup(bucket, key)
    except (RemoteUnavailableError, CacheCorruptError):
        return UNKNOWN
    if found is None:
        return NONE
    return OURS if found.upload == upload else OTHERS


def withdraw(bucket: Bucket, key: str, upload: str) -> bool:
    """Remove the key's manifest if it names ``upload`` (whose data went missing), then
    what is left of that upload. True when a manifest was removed."""
    if named(bucket, key, upload) != OURS:
        return False
    path = manifest_path(bucket, key)
    bucket.remove([path], f"withdrawing {bucket.object_url(path)}")
    remove_upload(bucket, key, upload, quiet=True)
    return True


_POOL_PUTS: dict[str, threading.Lock] = {}
_POOL_PUTS_GUARD = threading.Lock()


def _pool_object(bucket: Bucket, path: str) -> threading.Lock:
    """The lock this process's uploads hold while they look for the pool object ``path``
    and send it if it is missing: uploads of entries that share a data file (a fold and
    its full entry, pushed in the background at once) then send it once, not each."""
    with _POOL_PUTS_GUARD:
        return _POOL_PUTS.setdefault(bucket.object_url(path), threading.Lock())


def _forget_after_fork() -> None:
    """A forked child has none of its parent's upload threads, so none of their locks."""
    global _POOL_PUTS, _POOL_PUTS_GUARD
    _POOL_PUTS, _POOL_PUTS_GUARD = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _send(bucket: Bucket, published: Published, record: FileRecord, path: str,
          bar: Any, opened: Opened) -> bool:
    """Send the entry's file ``record`` to ``path``; a pool object only if the pool lacks
    it, looked for and sent under the object's lock. Whether it was sent."""
    if not pooled(published.manifest, record):
        _put(bucket, published, record, path, bar, opened)
        return True
    with _pool_object(bucket, path):
        if _holds(bucket, path, record):
            return False
        _put(bucket, published, record, path, bar, opened)
        return True


def _holds(bucket: Bucket, path: str, record: FileRecord) -> bool:
    """Whether the pool object ``path`` is there with ``record``'s size: named by its
    checksum, it holds the record's bytes (a download checks them all the same)."""
    try:
        return bucket.size(path) == record.bytes
    except FileNotFoundError:
        return False


def _put(bucket: Bucket, published: Published, record: FileRecord, path: str,
         bar: Any, opened: Opened) -> None:
    """Copy one local entry file (the one ``opened`` holds, else opened now) to ``path``,
    checking its size against its record, and its checksum on the bytes as they are read: a
    local file damaged since it was built (CacheCorruptError) is not uploaded, and its
    manifest is never published."""
    local = published.path / record.name
    held = opened.get(record.name)
    with _fs.open_regular(local) if held is None else contextlib.nullcontext(held) as f:
        f.seek(0)  # (a held file is read again by a second attempt)
        size = os.fstat(f.fileno()).st_size
        if size != record.bytes:
            raise CacheCorruptError(local, f"file is {size} bytes, "
                                    f"the manifest says {record.bytes}")
        bucket.write_file(path, _Checked(f, local, record), size,
                          bar.update if bar is not None else lambda n: None)


class _Checked:
    """A local entry file read for its upload: hashed as it is read, and checked against
    its record once its last byte is read, before that byte is handed on (so a bad object
    never lands: a multipart write that fails is abandoned)."""

    def __init__(self, f: Any, local: Any, record: FileRecord) -> None:
        self.f, self.local, self.record = f, local, record
        self.hasher = checksums.hasher()
        self.seen = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hasher.update(data)
        self.seen += len(data)
        if data and self.seen >= self.record.bytes:
            _check_checksum(self.local, self.record, self.hasher)
        return data


def _check_checksum(local: Any, record: FileRecord, hasher: Any) -> None:
    got = checksums.hex_checksum(hasher)
    if got != record.checksum:
        raise CacheCorruptError(local, f"checksum mismatch: the manifest says "
                                f"{record.checksum}, the file has {got}; nothing was uploaded")


def _quietly(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` for a thread nobody waits for: what it raises has nowhere to go."""
    def run() -> None:
        try:
            fn()
        except Exception:  # the sweep and the readers deal with what is left
            pass

    return run
