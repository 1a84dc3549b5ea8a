"""Downloading a remote entry from a bucket into the local store: every object's size is
checked before it is read and every checksum after, and the entry is published with the
local store's own atomic commit, so a download that fails anywhere publishes nothing.

:func:`download` works on a :class:`~cachekit.store.bucket.Bucket`;
:class:`~cachekit.store.remote.RemoteStore` has it as its method ``download``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

from .. import checksums
from ..errors import CacheCorruptError, RemoteUnavailableError
from .bucket import Bucket
from .layout import Published
from .local import LocalStore, MakeRoom
from .local_copies import link_local_copies
from .manifest import FileRecord
from .remote_entry import RemoteEntry, check_sizes, fix_for
from .remote_fs import progress_bar

WRITEBACK_BYTES = 64 << 20


def download(bucket: Bucket, entry: RemoteEntry, local: LocalStore, *,
             progress: bool = False, linked: Optional[Callable[[int], None]] = None,
             make_room: Optional[MakeRoom] = None
             ) -> tuple[Published, bool]:
    """Download ``entry`` into a fresh build directory of ``local``, check every size
    and checksum against its manifest, then publish it with the local store's atomic
    commit. Returns (published entry, whether this call's commit won). On any failure
    the build directory is discarded: nothing is published. The parts of a derived entry
    that local entries hold are linked, not downloaded (:mod:`.local_copies`): ``linked``
    hears how many of the entry's bytes that saved. ``make_room`` (a cache budget) is told
    the bytes it is about to download, once those parts are linked."""
    manifest = entry.manifest
    objects = entry.objects(bucket)
    build = local.begin(entry.key)
    bar = None
    try:
        here = link_local_copies(local, build.dir, manifest)  # a derived entry's parts
        fetched = [(f, o) for f, o in zip(manifest.files, objects) if f.name not in here]
        check_sizes(bucket, entry.key, [f for f, _ in fetched], [o for _, o in fetched])
        if make_room is not None and fetched:
            make_room(sum(f.bytes for f, _ in fetched), [entry.key])
        bar = progress_bar(progress, sum(f.bytes for f, _ in fetched),
                           f"cachekit pull {entry.key[:12]}")
        done = 0
        digests = {f.name: f.checksum for f in manifest.files if f.name in here}
        for record, path in fetched:
            fd = build.dir.create(record.name)
            hasher = checksums.hasher()  # as it arrives: no second read
            with os.fdopen(fd, "wb") as out, _Writeback(fd) as writeback:
                for block in bucket.read_ranges(path, record.bytes):
                    out.write(block)
                    hasher.update(block)
                    done += len(block)
                    writeback.written(out)
                    if bar is not None:
                        bar.update(len(block))
                    build.progress(manifest.rows * done // max(manifest.bytes, 1),
                                   manifest.rows)
            digests[record.name] = checksums.hex_checksum(hasher)
            if digests[record.name] != record.checksum and entry.pooled(record):
                # Named by its checksum, a pool object of other bytes is of use to nobody:
                # it goes, so that the upload that repairs the entry sends it again.
                try:
                    bucket.remove([path], f"removing {bucket.object_url(path)}")
                except RemoteUnavailableError:
                    pass  # the sweep of `cachekit verify --remote` reports it
        try:
            sealed = local.seal(build, [(f.name, f.kind) for f in manifest.files], digests,
                                durable=here)
        except CacheCorruptError as e:
            raise CacheCorruptError(bucket.object_url(objects[0]), e.reason,
                                    fix_for(entry.key)) from None
        for got, want, path in zip(sealed, manifest.files, objects):
            if got != want:
                raise CacheCorruptError(bucket.object_url(path), _mismatch(got, want),
                                        fix_for(entry.key))
        published, won = local.commit(build, manifest)
        if linked is not None:
            linked(sum(f.bytes for f in manifest.files if f.name in here))
    except BaseException:
        build.discard()
        raise
    finally:
        if bar is not None:
            bar.close()
    return published, won


class _Writeback:
    """Flush a download to disk while it arrives: every WRITEBACK_BYTES an fdatasync runs in
    a thread of its own, so the fsync before the local commit finds little left to write
    instead of a whole large file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0  # the position the last flush started from
        self.thread: Optional[threading.Thread] = None

    def __enter__(self) -> "_Writeback":
        return self

    def written(self, out: Any) -> None:
        position = out.tell()
        if position - self.pending < WRITEBACK_BYTES or (
                self.thread is not None and self.thread.is_alive()):
            return
        out.flush()
        self.pending = position
        self.thread = threading.Thread(target=self._sync, name="cachekit-writeback",
                                       daemon=True)
        self.thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError:
            pass  # the fsync before the commit reports any real error

    def __exit__(self, *exc: Any) -> None:
        if self.thread is not None:
            self.thread.join()


def _mismatch(got: FileRecord, want: FileRecord) -> str:
    if got.bytes != want.bytes:
        return f"downloaded {got.bytes} bytes, the manifest says {want.bytes}"
    if got.checksum != want.checksum:
        return (f"checksum mismatch: the manifest says {want.checksum}, the object has "
                f"{got.checksum}")
    return (f"header says {got.dtype} {list(got.shape)}, the manifest says {want.dtype} "
            f"{list(want.shape)}")
