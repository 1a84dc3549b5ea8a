"""Uploading a local entry to the remote store, and telling whose upload a remote manifest
names.

Every upload writes its data objects under an upload id of its own (32 hex digits, fresh
per upload), then tries to create the manifest naming it (``"upload": UPLOAD``),
create-only; the store lets exactly one succeed, and the loser removes its objects. No
uploader removes objects that a manifest may name: a create that fails without saying
"exists" may have landed, so the manifest is read back first. An uploader paused between
its data and its manifest may find, once its manifest wins, that a sweep removed its data:
it checks after every win and withdraws its manifest then.

The functions take the :class:`~cachekit.store.remote.RemoteStore` they work for; its
methods of the same names (``upload``, ``named``, ``withdraw``) are the public way in.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from typing import TYPE_CHECKING, Any, Callable

from .. import _fs
from . import manifest as manifests
from ..errors import CacheCorruptError, RemoteUnavailableError
from .layout import Published
from .manifest import FileRecord
from .remote_fs import progress_bar

if TYPE_CHECKING:
    from .remote import RemoteStore

UPLOAD_FIELD = "upload"
"""The manifest field that names the upload holding the entry's data objects."""
PUBLISH_ATTEMPTS = 2
OURS, OTHERS, NONE, UNKNOWN = "ours", "others", "none", "unknown"
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


def is_upload_id(text: Any) -> bool:
    return isinstance(text, str) and _UPLOAD_ID.fullmatch(text) is not None


def upload(remote: RemoteStore, published: Published, *, progress: bool = False) -> bool:
    """See :meth:`RemoteStore.upload`."""
    manifest = published.manifest
    key = manifest.key
    if remote.lookup(key) is not None:
        return False
    for attempt in range(1, PUBLISH_ATTEMPTS + 1):
        upload_id = uuid.uuid4().hex
        won = _publish(remote, published, upload_id, progress)
        if not won:
            return False
        objects = [remote.upload_path(key, upload_id, f.name) for f in manifest.files]
        try:
            remote.check_sizes(manifest.files, objects)
            return True
        except CacheCorruptError as e:
            if not withdraw(remote, key, upload_id) and remote.lookup(key) is not None:
                return False  # another upload is the entry now
            if attempt == PUBLISH_ATTEMPTS:
                raise CacheCorruptError(e.path, f"{e.reason} after its manifest was "
                                        "published; the manifest was withdrawn",
                                        "upload it again (`cachekit push`)") from None
    raise AssertionError("unreachable")


def _publish(remote: RemoteStore, published: Published, upload_id: str,
             progress: bool) -> bool:
    """Data objects under ``upload_id``, then the manifest naming them, create-only: True
    when ours is the key's manifest now, False when another one is (ours removed)."""
    manifest = published.manifest
    key = manifest.key
    bar = progress_bar(progress, manifest.bytes, f"cachekit push {key[:12]}")
    try:
        objects = [remote.upload_path(key, upload_id, f.name) for f in manifest.files]
        try:
            for record, path in zip(manifest.files, objects):
                _put(remote, published, record, path, bar)
            remote.check_sizes(manifest.files, objects)  # all there before the commit
        except BaseException:
            remote.remove_upload(key, upload_id, quiet=True)  # no manifest can name it yet
            raise
        body = manifests.dumps(manifest, {UPLOAD_FIELD: upload_id})
        path = remote.manifest_path(key)

        def settle() -> None:
            # The create we gave up on has ended, maybe long after: if it made our
            # manifest after a sweep took our data, withdraw it.
            try:
                if named(remote, key, upload_id) == OURS:
                    remote.check_sizes(manifest.files, objects)
            except CacheCorruptError:
                withdraw(remote, key, upload_id)

        try:
            won = remote.create(path, body, f"publishing {remote.object_url(path)}",
                                after_abandoned=_quietly(settle))
        except Exception:
            # The create may have landed while its answer was lost or came late.
            whose = named(remote, key, upload_id)
            if whose == OURS:
                return True
            if whose == OTHERS:  # create-only: ours can never land now
                remote.remove_upload(key, upload_id, quiet=True)
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
    whose = named(remote, key, upload_id)
    if whose in (OTHERS, NONE):
        remote.remove_upload(key, upload_id, quiet=True)
    return whose == OURS


def named(remote: RemoteStore, key: str, upload_id: str) -> str:
    """See :meth:`RemoteStore.named`."""
    try:
        found = remote.lookup(key)
    except (RemoteUnavailableError, CacheCorruptError):
        return UNKNOWN
    if found is None:
        return NONE
    return OURS if found.upload == upload_id else OTHERS


def withdraw(remote: RemoteStore, key: str, upload_id: str) -> bool:
    """See :meth:`RemoteStore.withdraw`."""
    if named(remote, key, upload_id) != OURS:
        return False
    path = remote.manifest_path(key)
    remote.remove([path], f"withdrawing {remote.object_url(path)}")
    remote.remove_upload(key, upload_id, quiet=True)
    return True


def _put(remote: RemoteStore, published: Published, record: FileRecord, path: str,
         bar: Any) -> None:
    """Copy one local entry file to ``path`` in parts (one call, one timeout, each),
    checking its checksum on the bytes as they are read: a local file damaged since it was
    built (CacheCorruptError) is not uploaded, and its manifest is never published."""
    url = remote.object_url(path)
    part = remote.part_bytes
    local = published.path / record.name
    hasher = hashlib.blake2b(digest_size=16)
    with _fs.open_regular(local) as f:
        size = os.fstat(f.fileno()).st_size
        if size != record.bytes:
            raise CacheCorruptError(local, f"file is {size} bytes, "
                                    f"the manifest says {record.bytes}")
        if size <= part:
            data = f.read()
            hasher.update(data)
            _check_checksum(local, record, hasher)
            remote.call(f"writing {url}", remote.fs.pipe_file, path, data)
            if bar is not None:
                bar.update(size)
            return
        out = remote.call(f"writing {url}", remote.fs.open, path, "wb", block_size=part)
        try:
            for block in iter(lambda: f.read(part), b""):
                hasher.update(block)
                remote.call(f"writing {url}", out.write, block)
                if bar is not None:
                    bar.update(len(block))
            _check_checksum(local, record, hasher)  # before close: a bad object never lands
            remote.call(f"writing {url}", out.close)
        except BaseException:
            _discard(out)
            raise


def _check_checksum(local: Any, record: FileRecord, hasher: Any) -> None:
    got = "blake2b-128:" + hasher.hexdigest()
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


def _discard(f: Any) -> None:
    """Abandon a partly written remote file without completing it (best effort)."""
    for name in ("discard", "_abort_mpu"):
        method = getattr(f, name, None)
        if callable(method):
            try:
                method()
                return
            except Exception:  # already failing; the orphaned parts are the store's to expire
                return
