"""The remote tier's part of getting an entry, after a local miss (DESIGN 3.2).

:func:`cachekit.obtain.flow.obtain` calls :func:`obtain` holding the key's local build lock, once
no live local builder is left, so the agents of one host share one download or one build.
Then: look the key up remotely, and download it when it is there (source ``"remote"``);
otherwise take the key's remote lease (:mod:`cachekit.store.lease`) or wait while
another host holds it, printing whom we wait for, until its entry is published (download)
or its lease dies (take over); holding the lease, build, commit locally, upload (data first,
manifest last, create-only) and release (source ``"built"``).

A remote that fails or does not answer within ``$CACHEKIT_REMOTE_TIMEOUT`` warns once per
process (:class:`cachekit.errors.RemoteWarning`) and cachekit carries on locally, building if
it must. A remote entry that fails its checks is CacheCorruptError: nothing is published.
One whose manifest disagrees with the call (:mod:`cachekit.obtain.expected`) is refused before its
download, as a miss: this host builds the entry itself.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import CacheCorruptError, LockTimeout, RemoteUnavailableError, RemoteWarning
from ..store.manifest import Manifest
from ..store import LocalStore, Published
from ..store.remote import RemoteEntry, RemoteStore
from ..store.lease import Watch, lease_path

WAIT_REPORT_SECONDS = 10.0
_warned: set[str] = set()
Expect = Callable[[Manifest], Optional[str]]
"""What disagrees with the call in a manifest, or None: ``Expected.check`` of
:mod:`cachekit.obtain.expected`."""


@dataclass(frozen=True)
class Tier:
    """A remote store, and whether transfers show a byte progress bar."""

    store: RemoteStore
    progress: bool = False


def obtain(tier: Tier, local: LocalStore, key: str, build_fn: Any,
           build: Callable[[Any], Published], *, remaining: Optional[float],
           announce: bool, expect: Optional[Expect] = None) -> tuple[Published, str]:
    """(entry, source) for ``key`` after a local miss, holding the local build lock.

    ``build(build_fn)`` builds and commits locally (resuming dead local builds);
    ``remaining``: seconds left of the caller's lock_timeout (None: wait for good);
    ``expect(manifest)``: what disagrees with the call in a remote entry's manifest, or
    None; one that disagrees is refused before it is downloaded, as a miss.
    """
    remote = tier.store
    lookup = _checked_lookup(remote, key, expect)
    try:
        found = lookup()
        if found is not None:
            return _download(tier, local, found), "remote"
        lease = _wait_for_lease(tier, local, key, remaining, announce, lookup)
        if isinstance(lease, Published):
            return lease, "remote"
    except RemoteUnavailableError as e:
        warn_once(remote, e)
        return build(build_fn), "built"
    try:
        found = lookup()  # published between our last look and the takeover?
        if found is not None:
            return _download(tier, local, found), "remote"
        published = build(_reporting(build_fn, lease))
        try:
            remote.upload(published, progress=tier.progress)
        except (RemoteUnavailableError, CacheCorruptError) as e:
            warn_once(remote, e)  # the local entry is good; only the sharing failed
        return published, "built"
    except RemoteUnavailableError as e:
        warn_once(remote, e)
        return build(build_fn), "built"
    finally:
        lease.release()


def _download(tier: Tier, local: LocalStore, found: RemoteEntry) -> Published:
    published, _ = tier.store.download(found, local, progress=tier.progress)
    return published


def _checked_lookup(remote: RemoteStore, key: str, expect: Optional[Expect]
                    ) -> Callable[[], Optional[RemoteEntry]]:
    """``remote.lookup(key)``, with an entry that disagrees with ``expect`` taken for a
    miss (said once on stderr, whatever ``progress``: someone wrote a wrong entry)."""
    refused: list[str] = []

    def lookup() -> Optional[RemoteEntry]:
        found = remote.lookup(key)
        problem = None if found is None or expect is None else expect(found.manifest)
        if problem is None:
            return found
        if not refused:
            print(f"cachekit: refused the remote entry {key[:12]} of {remote.display}: it "
                  f"does not match the call ({problem}); building it here", file=sys.stderr,
                  flush=True)
        refused.append(problem)
        return None

    return lookup


def _wait_for_lease(tier: Tier, local: LocalStore, key: str, remaining: Optional[float],
                    announce: bool, lookup: Callable[[], Optional[RemoteEntry]]) -> Any:
    """The key's lease (a started Lease), or the entry (Published) when its builder on
    another host publishes it while we wait. LockTimeout past ``remaining`` seconds."""
    remote = tier.store
    watch = Watch(remote, key)
    started = time.monotonic()
    next_report = started + min(2.0, WAIT_REPORT_SECONDS)
    poll = min(1.0, watch.lease / 8)
    while True:
        lease = watch.take_or_wait(lambda: lookup() is None)
        if lease is not None:
            return lease
        found = lookup()
        if found is not None:
            return _download(tier, local, found)
        waited = time.monotonic() - started
        if remaining is not None and waited + poll > remaining:
            raise LockTimeout(remote.object_url(lease_path(remote, key, 1, "json")).rsplit(
                "/", 1)[0], waited, watch.describe(), "a lease whose heartbeat stops is "
                "taken over after CACHEKIT_LOCK_LEASE seconds")
        if announce and time.monotonic() >= next_report:
            print(f"cachekit: waited {waited:.0f} s for {watch.describe()} to build entry "
                  f"{key[:12]} (remote {remote.display})", file=sys.stderr, flush=True)
            next_report = time.monotonic() + WAIT_REPORT_SECONDS
        time.sleep(poll)


def _reporting(build_fn: Any, lease: Any) -> Any:
    """``build_fn`` whose progress also goes into the lease's heartbeat."""
    def run(current: Any, on_chunk: Callable[[int, int], None]) -> Any:
        def both(done: int, total: int) -> None:
            on_chunk(done, total)
            lease.progress(done, total)

        return build_fn(current, both)

    return run


def warn_once(remote: RemoteStore, error: Exception) -> None:
    """Warn (once per process and remote) that the remote failed and we carry on locally."""
    if remote.display in _warned:
        return
    _warned.add(remote.display)
    warnings.warn(f"cachekit: {error}; carrying on with the local cache only",
                  RemoteWarning, stacklevel=5)

