"""Remote build leases: one host builds a key while the others wait, with create-only writes
and plain overwrites of one's own object only (no ``If-Match``, which fsspec does not expose).

::

    PREFIX/leases/KEY/GEN.json   generation GEN (1, 2, ...) of the key's lease, created
                                 create-only by the host that takes it, never rewritten:
                                 {"generation", "host", "pid", "started"}
    PREFIX/leases/KEY/GEN.beat   its holder's heartbeat, rewritten only by the holder every
                                 lease / 4 seconds: {"seq", "done", "total", "state"}, the
                                 state "building", "uploading" (built and committed on its
                                 host, the upload running) or "released"

The key's current lease is its highest generation. It is dead when its heartbeat says
``released`` (the holder is done: published, or failed), when its holder is a process of
this host that is gone, or when this waiter has seen its heartbeat unchanged for
``$CACHEKIT_LOCK_LEASE`` seconds on its own monotonic clock. No two hosts' clocks are ever
compared, and the store's own times are not needed; the price is that a waiter that comes
upon a dead lease waits one lease time before it takes over. Taking over is the create-only
write of generation GEN + 1, so of all the hosts that judge GEN dead exactly one wins.
``cachekit clear --remote`` never removes a key's newest generation, so numbers only rise:
a holder that wakes from a pause writes its heartbeat and release into its own generation,
never into a later holder's.

The lease only saves duplicate work: correctness rests on the create-only manifest. A store
whose create-only writes do not work lets two hosts hold one generation: two builds, and
still one valid remote entry.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .. import liveness, processes, small_json
from ..messages import printable
from ..errors import RemoteUnavailableError
from ..key_names import is_key
from .bucket import Bucket

_RECORD_LIMIT = 1 << 16
BUILDING, UPLOADING, RELEASED = "building", "uploading", "released"


def lease_path(remote: Bucket, key: str, generation: int, suffix: str) -> str:
    if not is_key(key) or generation < 1:
        raise ValueError(f"not a cache key and lease generation: {key!r} {generation!r}")
    return remote.path("leases", key, f"{generation}.{suffix}")


def generations(remote: Bucket, key: str) -> list[int]:
    """The lease generations of ``key`` in the store, lowest first."""
    folder = remote.path("leases", key)
    try:
        names = remote.call(f"listing {remote.object_url(folder)}", remote.fs.ls, folder,
                            detail=False)
    except FileNotFoundError:
        return []
    found = set()
    for name in names:
        stem, _, suffix = str(name).rstrip("/").rsplit("/", 1)[-1].partition(".")
        if suffix == "json" and stem.isdigit() and stem == str(int(stem)) and int(stem) > 0:
            found.add(int(stem))
    return sorted(found)


class Lease:
    """A lease this process holds: its heartbeat (:class:`cachekit.liveness.Heartbeat`, the
    timer every builder beats with) rewrites ``GEN.beat`` from :meth:`start` until
    :meth:`release`, carrying the build's progress for the hosts that wait, then that the
    upload runs (:meth:`uploading`): the lease is held until the manifest is written, so
    waiters wait for it rather than build."""

    def __init__(self, remote: Bucket, key: str, generation: int) -> None:
        self.remote, self.key, self.generation = remote, key, generation
        self.lease = liveness.lease_from_env()
        self._seq = 0
        self._done: Optional[int] = None
        self._total: Optional[int] = None
        self._state = BUILDING
        self._heartbeat = liveness.Heartbeat(self.beat, self.lease, may_block=True)

    def start(self) -> "Lease":
        self._heartbeat.start()
        return self

    def progress(self, done: int, total: int) -> None:
        """Record rows done; the next beat carries them."""
        self._done, self._total = done, total

    def uploading(self) -> None:
        """Say at once that the build is committed and its upload runs (one beat, from the
        uploader's thread); every later beat says so too."""
        self._state = UPLOADING
        self.beat()

    def beat(self, state: Optional[str] = None) -> None:
        """Rewrite this generation's heartbeat object, in ``state`` (default: the lease's
        own); never raises: a missed beat is followed by the next well within the lease."""
        self._seq += 1
        body = json.dumps({"seq": self._seq, "done": self._done, "total": self._total,
                           "state": state or self._state}).encode()
        path = lease_path(self.remote, self.key, self.generation, "beat")
        try:
            self.remote.call(f"beating {self.remote.object_url(path)}",
                             self.remote.fs.pipe_file, path, body)
        except (RemoteUnavailableError, OSError):
            pass  # the next beat comes well within the lease; waiters judge by change

    def release(self) -> None:
        """Stop beating and say so: waiters look for the entry, or take over at once."""
        self._heartbeat.stop()
        self.beat(RELEASED)


@dataclass
class _Seen:
    generation: int
    holder: dict[str, Any]
    beat: Any
    since: float


class Watch:
    """One waiter's view of a key's lease over time: whether it is alive, and whom and how
    far it shows, judged by change on this process's monotonic clock."""

    def __init__(self, remote: Bucket, key: str) -> None:
        self.remote, self.key = remote, key
        self.lease = liveness.lease_from_env()
        self._seen: Optional[_Seen] = None

    def take_or_wait(self, still_wanted: Callable[[], bool] = lambda: True
                     ) -> Optional[Lease]:
        """Take the key's lease if no live one stands in the way: the started Lease, or
        None when another holder is alive (or won the takeover) and we should wait.
        ``still_wanted()`` is asked before taking over a dead or released lease (has its
        holder published the entry meanwhile?)."""
        gens = generations(self.remote, self.key)
        current = gens[-1] if gens else 0
        if current and (self._alive(current) or not still_wanted()):
            return None
        record = {"generation": current + 1, **processes.owner(), "started": time.time()}
        path = lease_path(self.remote, self.key, current + 1, "json")
        if self.remote.create(path, json.dumps(record).encode(),
                              f"taking {self.remote.object_url(path)}"):
            return Lease(self.remote, self.key, current + 1).start()
        return None

    def describe(self) -> str:
        """``pid 4242 on node7 (2048/10000 rows, 20%)``, ``... (built, uploading)``, or
        "another host"."""
        if self._seen is None:
            return "another host"
        holder, beat = self._seen.holder, self._seen.beat
        done = beat.get("done") if isinstance(beat, dict) else None
        total = beat.get("total") if isinstance(beat, dict) else None
        uploading = isinstance(beat, dict) and beat.get("state") == UPLOADING
        progress = "built, uploading" if uploading else small_json.progress(done, total)
        return printable(f"pid {holder.get('pid')} on {holder.get('host')} "
                         f"({progress})")  # from a bucket object

    def _alive(self, generation: int) -> bool:
        now = time.monotonic()
        beat = self._read(lease_path(self.remote, self.key, generation, "beat"))
        if self._seen is None or self._seen.generation != generation:
            holder = self._read(lease_path(self.remote, self.key, generation, "json"))
            self._seen = _Seen(generation, holder if isinstance(holder, dict) else {},
                               beat, now)
        elif beat != self._seen.beat:
            self._seen.beat, self._seen.since = beat, now
        if isinstance(beat, dict) and beat.get("state") == RELEASED:
            return False
        if processes.owner_state(self._seen.holder) == "dead":
            return False  # a process of this host that is gone
        return now - self._seen.since <= self.lease

    def _read(self, path: str) -> Any:
        """A small lease object's JSON; None when missing or not JSON."""
        try:
            raw = self.remote.call(f"reading {self.remote.object_url(path)}",
                                   self.remote.fs.cat_file, path, start=0, end=_RECORD_LIMIT)
            return small_json.load(raw)
        except (FileNotFoundError, ValueError):
            return None


