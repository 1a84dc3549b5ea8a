"""The remote tier's part of getting an entry, after a local miss (docs/object-stores.md).

:func:`cachekit.obtain.flow.obtain` calls :func:`download_or_lease` holding the key's local
build lock, once no live local builder is left, so the agents of one host share one
download or one build. It looks the key up remotely, and downloads it when it is there
(source ``"remote"``); otherwise it takes the key's remote lease (:mod:`cachekit.store.lease`)
or waits while another host holds it, saying whom we wait for, until its entry is published
(download) or its lease dies (take over), within what is left of the call's
``lock_timeout`` (:mod:`cachekit.obtain.wait`). Holding the lease, the caller builds and
commits locally (source ``"built"``) and hands what it built to :func:`share`: the call
returns the local entry then, while the upload (data first, manifest last, create-only)
runs in a background thread that keeps the lease until it is done, and that the process
waits for before it exits (:mod:`cachekit.obtain.background`).

A remote that fails or does not answer within ``$CACHEKIT_REMOTE_TIMEOUT`` warns once per
process (:class:`cachekit.errors.RemoteWarning`) and cachekit carries on locally, building
if it must: a remote is a shared convenience, never a reason for a call to fail. For
:data:`RETRY_AFTER` seconds after it failed, the process's later misses build without
trying it again, each saying so in one line (each try of a remote that is down costs up
to the timeout, retries included). A remote
entry that fails its checks (a manifest that is malformed or not validly signed, a data
object missing, short or with another checksum) is a miss, as in Nix's and Bazel's caches:
nothing of it is published, it warns once, and the host that takes the lease repairs it:
it removes the broken manifest, builds, and uploads create-only; it never raises to the
caller. A manifest that passes its own checks but disagrees with the call (another dtype,
shape or row count: ``Expected.check`` of :mod:`cachekit.obtain.expected`) is broken the
same way, found before anything is downloaded.

A heal (the local entry whose files changed, built again under its key: see
:mod:`.row_request`) meets the remote's copy of that stale entry the same way: it is not
downloaded, and under the lease its manifest is removed, so the healed entry is uploaded in
its place and hosts that miss later download the healed entry (those that miss meanwhile
wait for the lease). A remote entry that is another one (a host healed it first) is
downloaded as on any miss.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from ..errors import CacheCorruptError, RemoteUnavailableError, RemoteWarning
from ..messages import prefix, say
from ..store import LocalStore, Published, locks
from ..store.manifest import Manifest
from ..store.remote import OURS, RemoteEntry, RemoteStore
from ..store.lease import Lease, Watch, lease_path
from ..units import format_size
from . import background
from .lookup import find_entry
from ..store.local import MakeRoom
from .wait import WAITING, Awaited, Wait

_warned: set[str] = set()
RETRY_AFTER = 60.0
"""Seconds after a remote failed during which this process's misses do not try it."""
_failed_at: dict[str, float] = {}
"""When (time.monotonic()) each remote last failed in this process."""
Expect = Callable[[Manifest], Optional[str]]
"""What disagrees with the call in a manifest, or None: ``Expected.check`` of
:mod:`cachekit.obtain.expected`."""
_warned_broken: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Tier:
    """A remote store, whether transfers show a byte progress bar, and what makes room
    for a download within a cache budget."""

    store: RemoteStore
    progress: bool = False
    make_room: Optional[MakeRoom] = None


def download_or_lease(tier: Tier, local: LocalStore, key: str, *, wait: Wait,
                      expect: Optional[Expect] = None, stale: Optional[Manifest] = None
                      ) -> Union[Published, Lease, None]:
    """After a local miss, holding the local build lock: the key's remote entry downloaded
    and published locally, else the key's remote lease for this process to build under,
    or None when the remote failed (warned once: build locally, sharing nothing).

    ``wait``: the call's wait, whose ``lock_timeout`` the local wait began to use;
    ``expect(manifest)``: what disagrees with the call in a remote entry's manifest, or
    None; one that disagrees is refused before it is downloaded, as a miss. ``stale``:
    the manifest of the entry of the key whose files changed here (a heal): a remote entry
    that is that very entry is a miss too, and its manifest is removed under the lease, so
    that the entry built here replaces it. The caller releases the lease, or hands it to
    :func:`share` with what it built.
    """
    failed = _failed_at.get(tier.store.display)
    if failed is not None and time.monotonic() - failed < RETRY_AFTER:
        say(f"remote {tier.store.display} failed {time.monotonic() - failed:.0f} s ago in "
            f"this process: entry {key[:12]} is built here without it, neither looked up "
            f"nor shared (the remote is tried again {RETRY_AFTER:g} s after it failed)")
        return None
    reader = _Reader(tier, local, key, expect, stale)
    try:
        got = reader.fetch()
        if got is not None:
            return got
        lease = _wait_for_lease(tier, reader, wait)
        if isinstance(lease, Published):
            return lease
    except RemoteUnavailableError as e:
        warn_once(tier.store, e)
        return None
    try:
        got = reader.fetch()  # published between our last look and the takeover?
        if got is None:
            reader.remove_broken()
            return lease
    except RemoteUnavailableError as e:
        warn_once(tier.store, e)
        got = None
    except BaseException:
        lease.release()
        raise
    lease.release()
    return got


def share(tier: Tier, local: LocalStore, published: Published, lease: Lease) -> None:
    """Upload ``published``, built under ``lease``: in a background thread that keeps the
    lease until it is done (in this thread only when this process is already shutting
    down). A failed upload warns once: the local entry is good; only the sharing failed."""
    handed_over = False
    try:
        handed_over = background.start(tier.store, published, lease, local.root)
        if not handed_over:
            background.upload_here(tier.store, published, progress=tier.progress)
    except (RemoteUnavailableError, CacheCorruptError) as e:
        warn_once(tier.store, e)
    finally:
        if not handed_over:
            lease.release()


class _Reader:
    """Finds and downloads the key's remote entry, taking a broken one, or the ``stale``
    entry a heal builds again, for a miss: it warns once (of a broken one), remembers the
    entry (so the wait does not download it again) and, under the lease, removes its
    manifest (:meth:`remove_broken`, which says so of the stale one)."""

    def __init__(self, tier: Tier, local: LocalStore, key: str,
                 expect: Optional[Expect] = None, stale: Optional[Manifest] = None) -> None:
        self.tier, self.local, self.key, self.expect = tier, local, key, expect
        self.stale = stale
        self.broken: list[Optional[RemoteEntry]] = []
        """The broken entries met (None: a manifest that could not be read at all), and
        the stale one."""

    def candidate(self) -> Optional[RemoteEntry]:
        """The key's remote entry unless it is missing, known to be broken, the stale one
        a heal replaces, or disagrees with the call (then it is broken: refused before
        anything is downloaded)."""
        remote = self.tier.store
        try:
            found = remote.lookup(self.key)
        except CacheCorruptError as e:
            self._met(None, e)
            return None
        if found is None or found in self.broken:
            return None
        if self._is_stale(found):
            self.broken.append(found)
            return None
        problem = None if self.expect is None else self.expect(found.manifest)
        if problem is not None:
            self._met(found, CacheCorruptError(remote.object_url(remote.manifest_path(
                self.key)), f"it does not match the call ({problem})"))
            return None
        return found

    def fetch(self) -> Optional[Published]:
        """The entry downloaded and published locally, or None: none, or a broken one. A
        heal that downloads another host's entry of the key says so (it set out to build)."""
        found = self.candidate()
        if found is None:
            return None
        linked: list[int] = []
        try:
            published = _download(self.tier, self.local, found, linked.append)
        except CacheCorruptError as e:
            self._met(found, e)
            return None
        if published is None:
            return None
        if self.stale is not None:
            size = found.manifest.bytes
            say(f"entry {self.key[:12]}: {self.tier.store.display} holds it built again "
                f"by another host; downloaded that instead of building it here "
                f"({format_size(sum(linked))} of its {format_size(size)} linked from the "
                "stale copy here)")
        return published

    def remove_broken(self) -> None:
        """Holding the lease: remove the key's manifest if it is one found broken."""
        if not self.broken:
            return
        remote = self.tier.store
        try:
            found = remote.lookup(self.key)
        except CacheCorruptError:
            found = None  # still unreadable
        else:
            if found is None or found not in self.broken:
                return  # gone, or replaced by one not yet tried (then the upload keeps it)
        path = remote.manifest_path(self.key)
        remote.remove([path], f"removing {remote.object_url(path)}, to be replaced")
        if found is not None and self._is_stale(found):
            say(f"remote entry {self.key[:12]} in {remote.display} was the entry whose files "
                "changed here: removed, the entry built now replaces it")

    def _is_stale(self, found: RemoteEntry) -> bool:
        """Whether ``found`` is the very entry a heal builds again (Manifest equality, as a
        local entry is told from another: :meth:`LocalStore.still_published`)."""
        return self.stale is not None and found.manifest == self.stale

    def _met(self, found: Optional[RemoteEntry], error: CacheCorruptError) -> None:
        if found not in self.broken:
            self.broken.append(found)
        remote = self.tier.store
        if (remote.display, self.key) in _warned_broken:
            return
        _warned_broken.add((remote.display, self.key))
        warnings.warn(f"{prefix()}: remote entry {self.key[:12]} is broken: {error.path}: "
                      f"{error.reason}; it counts as missing: cachekit builds it and uploads "
                      "it in place of the broken one", RemoteWarning, stacklevel=6)


def pull(tier: Tier, local: LocalStore, key: str,
         linked: Optional[Callable[[int], None]] = None) -> Optional[tuple[Published, str]]:
    """(entry, source) for ``key`` without building: ``"local"`` when it is already in
    ``local``, ``"remote"`` when downloaded; None when the remote has no entry of the key.
    Holds the key's local build lock, so the agents of one host share one download. A
    broken remote entry raises CacheCorruptError (an explicit pull is told, not warned)."""
    found = find_entry(local, key)
    if found is not None:
        return found, "local"
    local.ensure_writable(key)
    lock = locks.make_lock(local.layout.lock_path(key))
    lock.acquire(timeout=None)
    try:
        found = find_entry(local, key)
        if found is not None:
            return found, "local"
        entry = tier.store.lookup(key)
        published = None if entry is None else _download(tier, local, entry, linked)
        return None if published is None else (published, "remote")
    finally:
        lock.release()


def _download(tier: Tier, local: LocalStore, found: RemoteEntry,
              linked: Optional[Callable[[int], None]] = None) -> Optional[Published]:
    """``found`` downloaded and published here. When one of its objects went while it was
    read: None if its manifest went too (``clear --remote`` removes the manifest first: there
    is no entry to download), else CacheCorruptError (a broken entry, to be replaced)."""
    try:
        published, _ = tier.store.download(found, local, progress=tier.progress,
                                           linked=linked, make_room=tier.make_room)
    except FileNotFoundError:
        remote = tier.store
        if remote.named(found.key, found.upload) == OURS:
            raise CacheCorruptError(remote.object_url(remote.manifest_path(found.key)),
                                    "a data object it lists went missing while it was read"
                                    ) from None
        return None
    return published


def _wait_for_lease(tier: Tier, reader: _Reader, wait: Wait) -> Any:
    """The key's lease (a started Lease), or the entry (Published) when its builder on
    another host publishes it while we wait. LockTimeout at the call's deadline."""
    remote, key = tier.store, reader.key
    watch = Watch(remote, key)
    awaited = Awaited(
        remote.object_url(lease_path(remote, key, 1, "json")).rsplit("/", 1)[0],
        watch.describe, "a lease whose heartbeat stops is taken over after "
        "CACHEKIT_LOCK_LEASE seconds", note=f" (remote {remote.display})")

    def look(seconds: float) -> Any:
        lease = watch.take_or_wait(lambda: reader.candidate() is None)
        if lease is not None:
            return lease
        got = reader.fetch()
        if got is not None:
            return got
        time.sleep(seconds)
        return WAITING

    return wait.until(look, awaited, poll=min(1.0, watch.lease / 8))


def warn_once(remote: RemoteStore, error: Exception) -> None:
    """Warn (once per process and remote) that the remote failed and we carry on locally;
    when it did not work (not a local entry that failed its checks while uploading), its
    next :data:`RETRY_AFTER` seconds of misses do not try it."""
    if isinstance(error, RemoteUnavailableError):
        _failed_at[remote.display] = time.monotonic()
    if remote.display in _warned:
        return
    _warned.add(remote.display)
    warnings.warn(f"{prefix()}: {error}; carrying on with the local cache only",
                  RemoteWarning, stacklevel=5)

