"""Uploads that run after the local commit, in a thread of their own, while the caller trains.

A host that built an entry commits it locally and returns it at once; the upload
(:meth:`cachekit.store.remote.RemoteStore.upload`: data first, manifest last, create-only,
with every protection against a torn entry that it has) runs in a background thread. The
thread holds the key's remote lease, beating, until the manifest is written or the upload
has failed, so hosts that miss meanwhile wait for this host's entry and download it instead
of building it. A line on stderr says when the upload starts and when it ends.

The process waits for its uploads before it exits. The wait is a ``threading`` exit hook,
the first thing interpreter shutdown runs: before ``atexit`` functions, before non-daemon
threads are joined and, what matters, before ``concurrent.futures`` stops its thread pools.
asyncio resolves host names in such a pool, so an upload still running after that point
(a plain non-daemon thread, or one joined from ``atexit``) fails with "cannot schedule new
futures after interpreter shutdown". A Ctrl-C during that wait, ``os._exit`` or a kill cut
the upload off: nothing partial is published (the manifest comes last), and the lease
lapses after ``$CACHEKIT_LOCK_LEASE`` seconds, when another host builds the entry.

A failed upload is loud, never silent: stderr names the entry, the remote and the reason
when it fails; the process's next call with that remote warns
(:class:`cachekit.errors.RemoteWarning`, in the caller's thread, so a warnings filter that
makes it an error makes that call raise); and if no call came to warn, stderr says it
again at exit. It leaves the exit status alone: the local entry is good and the run that
used it did its work (a remote never makes a call fail), and an exit hook can set a status
only with ``os._exit``, which skips the exit hooks registered before it (a W&B run's
finish among them) and output not yet flushed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Optional

from .. import liveness
from ..errors import RemoteWarning
from ..messages import prefix, say
from ..units import format_size

if TYPE_CHECKING:
    from ..store import Published
    from ..store.lease import Lease
    from ..store.remote import RemoteStore


@dataclass(eq=False)
class _Upload:
    remote: "RemoteStore"
    published: "Published"
    lease: "Lease"
    root: Path
    pid: int
    opened: dict[str, BinaryIO]
    """The entry's files, opened when the upload was started (see :func:`start`)."""
    error: Optional[Exception] = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the upload has ended and released the lease (a thread's own liveness is no
    guide once a join was interrupted: Python 3.11 then marks the thread stopped)."""

    @property
    def key(self) -> str:
        return self.published.manifest.key

    def what(self) -> str:
        return _what(self.remote, self.published)

    def retry(self) -> str:
        return (f"`cachekit --root {self.root} --remote {self.remote.display} push "
                f"{self.key[:12]}` uploads it again")

    def running(self) -> bool:
        return not self.done.is_set()


_lock = threading.Lock()
_uploads: list[_Upload] = []
"""This process's background uploads under way."""
_unwarned: list[_Upload] = []
"""Failed ones that no call has warned about yet."""
_hooked_pid: Optional[int] = None
"""The process whose exit hook is in place (a forked child inherits its parent's)."""
THREADS_START_AT_EXIT = not (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)
"""Whether a thread can start while the exit hooks run. Not on Python 3.12.0 to 3.12.2
(CPython gh-117029, fixed in 3.12.3): an upload waited for at exit failed there with "can't
create new thread at interpreter shutdown" (s3fs resolves host names on a new thread), so
the call uploads before it returns instead."""


def start(remote: "RemoteStore", published: "Published", lease: "Lease", root: Path) -> bool:
    """Upload ``published`` (an entry of the local root ``root``) to ``remote`` in a
    background thread, which releases ``lease`` when done: True. False when this process
    could not wait for it at exit (it is shutting down already, no thread can start, or
    none could while it waits: :data:`THREADS_START_AT_EXIT`): the caller then uploads it
    itself and still holds the lease.

    The entry's files are opened here, before the call returns, so that removing the entry
    from the root meanwhile (``clear``, or the budget's eviction after a later call) does
    not cut the upload off: it sends the bytes it holds. An entry removed already, between
    its commit and now, has no bytes to send: that is said, the lease released, and True
    returned (nothing is left to upload; the call that committed it builds it again)."""
    from ..store.remote_upload import open_files

    if not THREADS_START_AT_EXIT:
        return False
    try:
        opened = open_files(published)
    except FileNotFoundError:
        say(f"entry {published.manifest.key[:12]} was removed from {root} before its upload "
            "began (a `cachekit clear`, or another process's budget); nothing uploaded",
            always=True)
        lease.release()
        return True
    except OSError:
        opened = {}  # the upload opens them itself, and says what it could not open
    upload = _Upload(remote, published, lease, root, os.getpid(), opened)
    thread = threading.Thread(target=_run, args=(upload,), daemon=True,
                              name=f"cachekit-upload-{upload.key[:12]}")
    with _lock:
        if not _hook_exit():
            _close(upload)
            return False
        _uploads.append(upload)
    try:
        thread.start()
    except RuntimeError:
        with _lock:
            _uploads.remove(upload)
        _close(upload)
        return False
    return True


def running(remote: "RemoteStore", key: str) -> bool:
    """Whether this process uploads ``key`` to ``remote`` in the background now."""
    with _lock:
        return any(u.running() and u.key == key and u.remote.display == remote.display
                   for u in _uploads)


def warn_failed(remote: "RemoteStore") -> None:
    """Warn, once each, of this process's background uploads to ``remote`` that failed."""
    with _lock:
        failed = [u for u in _unwarned if u.remote.display == remote.display]
        for upload in failed:
            _unwarned.remove(upload)
    for upload in failed:
        warnings.warn(f"{prefix()}: the background upload of {upload.what()} failed: "
                      f"{upload.error}; the local entry is good; {upload.retry()}",
                      RemoteWarning, stacklevel=5)


def wait_all() -> None:
    """Wait for every background upload of this process to end (as exit does)."""
    with _lock:
        pending = [u for u in _uploads if u.pid == os.getpid() and u.running()]
    for upload in pending:
        upload.done.wait()


def upload_here(remote: "RemoteStore", published: "Published", *,
                progress: bool = False) -> None:
    """Upload ``published`` in this thread, where :func:`start` could not hand it over, and
    say what it did as a background upload says it; raises what the upload raises."""
    started = time.monotonic()
    sent: list[int] = []
    won = remote.upload(published, progress=progress, sent=sent.append)
    _say_done(remote, published, won, sent, started)


def _what(remote: "RemoteStore", published: "Published") -> str:
    size = format_size(published.manifest.bytes)
    return f"entry {published.manifest.key[:12]} ({size}) to {remote.display}"


def _say_done(remote: "RemoteStore", published: "Published", won: bool, sent: list[int],
              started: float) -> None:
    """Say what an upload begun at ``started`` did: sent (``won``) or found there."""
    from ..store.remote import sent_note  # loaded already: remote is a RemoteStore

    if won:
        say(f"uploaded {_what(remote, published)} in {time.monotonic() - started:.1f} s"
            f"{sent_note(sum(sent), published.manifest.bytes)}", always=True)
    else:
        say(f"entry {published.manifest.key[:12]} was on {remote.display} already; "
            "nothing uploaded", always=True)


def _run(upload: _Upload) -> None:
    say(f"uploading {upload.what()} in the background; the process waits for it "
         "before exiting", always=True)
    started = time.monotonic()
    try:
        upload.lease.uploading()
        sent: list[int] = []
        won = upload.remote.upload(upload.published, sent=sent.append, opened=upload.opened)
    except Exception as e:  # whatever it is, it is said, not lost with the thread
        upload.error = e
        with _lock:
            _unwarned.append(upload)
        say(f"ERROR: the background upload of {upload.what()} failed: {e}; the "
             "local entry is good; no reader sees a partial remote entry (its manifest is "
             f"written last, only once all of its data is there); {upload.retry()}", always=True)
    else:
        _say_done(upload.remote, upload.published, won, sent, started)
    finally:
        _close(upload)
        upload.lease.release()
        with _lock:
            if upload in _uploads:  # (not after a fork)
                _uploads.remove(upload)
        upload.done.set()


def _close(upload: _Upload) -> None:
    for f in upload.opened.values():
        f.close()


def _hook_exit() -> bool:
    """Put :func:`_at_exit` in place (once per process); False when too late for that."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return True
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    # Hooks run last registered first: concurrent.futures' hook, which stops its pools,
    # must be registered before ours so that it runs after the uploads end.
    import concurrent.futures.thread  # noqa: F401

    try:
        register(_at_exit)
    except RuntimeError:  # the interpreter is shutting down
        return False
    _hooked_pid = os.getpid()
    return True


def _at_exit() -> None:
    with _lock:
        pending = [u for u in _uploads if u.pid == os.getpid() and u.running()]
    if pending:
        try:  # (the line is inside: a Ctrl-C as it is written is the one it invites)
            say(f"waiting for the upload of {', '.join(u.what() for u in pending)} "
                "before exiting (Ctrl-C cuts it off)", always=True)
            wait_all()
        except KeyboardInterrupt:
            cut = [u for u in pending if u.running()]
            if not cut:
                return
            say(f"ERROR: cut off the upload of "
                 f"{', '.join(u.what() for u in cut)}: no partial entry is published (the "
                 "manifest comes last); another host builds it once the lease lapses "
                 f"({liveness.lease_from_env():g} s); {cut[0].retry()}", always=True)
            return
    with _lock:
        failed = [u for u in _unwarned if u.pid == os.getpid()]
    if failed:
        say(f"ERROR: {len(failed)} background upload{'s' * (len(failed) > 1)} of "
             "this process failed (see above): "
             + "; ".join(f"{u.what()}: {u.error}" for u in failed)
             + "; the local entries are good and nothing partial is published", always=True)


def _forget_after_fork() -> None:
    """In a forked child: the parent's uploads are not ours, its exit hook is."""
    global _lock, _hooked_pid
    _lock = threading.Lock()
    _uploads.clear()
    _unwarned.clear()
    if _hooked_pid is not None:
        _hooked_pid = os.getpid()


os.register_at_fork(after_in_child=_forget_after_fork)
