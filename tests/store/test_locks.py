"""The lock choice (CACHEKIT_LOCK=os|soft|none) and the soft lock's staleness rules.

Mutual exclusion is shown with real interpreters that increment a shared counter file with
an unprotected read-modify-write while holding the lock; staleness with real dead processes,
records of another host, and a live holder whose heartbeat keeps its lock fresh.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import filelock
import pandas as pd
import pytest

import cachekit
from cachekit import _fs, processes
from cachekit.store import locks
from cachekit.store import Layout

COUNTER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from cachekit.store import locks

    kind, lock_path, counter, start, rounds = sys.argv[1:6]
    while not os.path.exists(start):
        time.sleep(0.001)
    lock = locks.make_lock(Path(lock_path), kind)
    for _ in range(int(rounds)):
        assert lock.acquire(timeout=60)
        try:
            value = int(Path(counter).read_text())
            time.sleep(0.0005)  # widen the window a missing lock would lose updates in
            Path(counter).write_text(str(value + 1))
        finally:
            lock.release()
""")

HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from cachekit.store import locks

    lock = locks.SoftLock(Path(sys.argv[1]), lease=float(sys.argv[2]))
    assert lock.acquire(timeout=10)
    Path(sys.argv[3]).touch()
    time.sleep(3600)
""")


@pytest.mark.parametrize("kind", ["os", "soft"])
def test_four_interpreters_never_hold_the_lock_at_once(tmp_path, kind):
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    counter, start = tmp_path / "count", tmp_path / "start"
    counter.write_text("0")
    lock_path = tmp_path / "locks" / "k.lock"
    lock_path.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), kind, str(lock_path), str(counter),
                               str(start), "40"], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    start.touch()
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert int(counter.read_text()) == 160


def write_record(path: Path, **fields) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": _fs.host(), "pid": 1, "lease": 60.0, **fields}))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_soft_lock_of_a_dead_local_process_is_taken_over_at_once(tmp_path):
    path = tmp_path / "k.lock.soft"
    write_record(path, pid=dead_pid(), start=None)
    lock = locks.SoftLock(path, lease=3600)
    assert lock.acquire(timeout=0)
    assert lock.owner()["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_a_soft_lock_of_a_reused_pid_is_taken_over(tmp_path):
    """The pid is alive (it is ours) but started at another time: its owner is gone."""
    path = tmp_path / "k.lock.soft"
    me = processes.owner()
    if me["start"] is None:
        pytest.skip("no /proc start times on this platform")
    write_record(path, pid=os.getpid(), pidns=me["pidns"], start=me["start"] - 1)
    lock = locks.SoftLock(path, lease=3600)
    assert lock.acquire(timeout=0)
    lock.release()


def test_a_soft_lock_of_another_host_waits_for_its_lease(tmp_path):
    path = tmp_path / "k.lock.soft"
    write_record(path, host="another-node.cluster", pid=os.getpid())
    lock = locks.SoftLock(path, lease=0.3)
    assert not lock.acquire(timeout=0)  # fresh heartbeat, owner unknown: it is live
    assert lock.acquire(timeout=30)  # unchanged for a lease: stale, taken over
    lock.release()


def test_a_soft_lock_whose_heartbeat_is_older_than_the_lease_is_taken_at_once(tmp_path):
    path = tmp_path / "k.lock.soft"
    write_record(path, host="another-node.cluster", pid=12345)
    old = time.time() - 120
    os.utime(path, (old, old))
    lock = locks.SoftLock(path, lease=60)
    assert lock.acquire(timeout=0)
    lock.release()


def test_a_live_holders_heartbeat_keeps_its_soft_lock_until_it_is_killed(tmp_path):
    path, ready = tmp_path / "k.lock.soft", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.4", str(ready)])
    try:
        while not ready.exists():
            assert holder.poll() is None
            time.sleep(0.01)
        waiter = locks.SoftLock(path, lease=0.4)
        # Several leases long; without the heartbeat the lock would go stale in this time.
        assert not waiter.acquire(timeout=2.0)
        assert waiter.owner()["pid"] == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert waiter.acquire(timeout=0)  # a dead local pid: taken over at once
    waiter.release()


OS_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cachekit.store import locks

    lock = locks.OsLock(Path(sys.argv[1]))
    assert lock.acquire(timeout=10)
    Path(sys.argv[2]).touch()
    time.sleep(3600)
""")


def test_an_os_lock_held_briefly_writes_no_holder_record(tmp_path, monkeypatch):
    """A build that decodes nothing holds its lock for milliseconds: no record file is made
    (the first beat, which writes it, comes a lease / 4 after the lock is taken)."""
    monkeypatch.delenv("CACHEKIT_LOCK_LEASE", raising=False)  # 60 s: the first beat at 15 s
    lock = locks.OsLock(tmp_path / "k.lock")
    assert lock.acquire(timeout=0)
    assert not lock.holder_path.exists()
    lock.release()
    assert list(tmp_path.iterdir()) == []  # nor a lock file, once released


def test_an_os_lock_removes_the_file_it_locked_never_one_swapped_in_meanwhile(tmp_path):
    """A holder removes its lock file as it releases it, through the folder's handle and
    only while the name still leads to the file it locked: a file another member of the
    group renamed over it stays."""
    path = tmp_path / "k.lock"
    lock = locks.OsLock(path)
    assert lock.acquire(timeout=0)
    (tmp_path / "planted").write_text("")
    os.replace(tmp_path / "planted", path)
    planted = os.lstat(path)
    lock.release()
    assert _fs.same_file(os.lstat(path), planted)


def test_an_os_lock_that_locked_a_removed_file_takes_the_one_named_now(tmp_path,
                                                                       monkeypatch):
    """Between a taker's open of the lock file and its flock, the last holder may remove
    the file as it releases it, and a third process make and lock a new one. Injected
    here by removing the name right after filelock locked (older filelocks do not
    look): the taker must not hold a file no one else can see, but the one named now."""
    path = tmp_path / "k.lock"
    lock = locks.OsLock(path)
    real = lock._lock.acquire
    lost: list[os.stat_result] = []

    def acquire_then_lose_the_name(*args, **kwargs):
        got = real(*args, **kwargs)
        if not lost:
            lost.append(os.lstat(path))
            path.unlink()
            path.touch()
        return got

    monkeypatch.setattr(lock._lock, "acquire", acquire_then_lose_the_name)
    assert lock.acquire(timeout=5) and len(lost) == 1
    other = locks.OsLock(path)
    assert not other.acquire(timeout=0)  # the file named now is the one held
    lock.release()
    assert other.acquire(timeout=0)
    other.release()


def test_a_lock_file_is_forgotten_only_when_no_process_holds_it(tmp_path):
    """``lock_files.forget`` (what a removal does after it removed a key's entry, build
    directory or failure record, or for a lock file left alone) takes the lock at once or
    leaves it alone, and never makes a lock file."""
    from cachekit.admin import lock_files
    from cachekit.store import LocalStore

    store, key = LocalStore(tmp_path / "cache"), "ab" * 16
    path, ready = store.layout.lock_path(key), tmp_path / "ready"
    path.parent.mkdir(parents=True)
    assert not lock_files.forget(store, key) and list(path.parent.iterdir()) == []
    holder = subprocess.Popen([sys.executable, "-c", OS_HOLDER, str(path), str(ready)])
    try:
        while not ready.exists():
            assert holder.poll() is None
            time.sleep(0.01)
        assert not lock_files.forget(store, key)
        assert path.exists() and not locks.OsLock(path).acquire(timeout=0)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_files.forget(store, key)
    assert list(path.parent.iterdir()) == []


def test_an_os_lock_holder_shows_a_heartbeat_within_a_lease_until_it_is_killed(
        tmp_path, monkeypatch):
    """What a waiter asks a lock of: its holder's record appears within a quarter lease,
    keeps beating, is this user's, and stops beating once the holder is killed."""
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.8")
    path, ready = tmp_path / "k.lock", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", OS_HOLDER, str(path), str(ready)])
    waiter = locks.OsLock(path)
    try:
        while not ready.exists():
            assert holder.poll() is None
            time.sleep(0.01)
        deadline = time.monotonic() + 30
        while not waiter.holder_alive():
            assert time.monotonic() < deadline, "no holder record appeared"
            time.sleep(0.05)
        assert waiter.holder_is_ours()
        assert json.loads(waiter.holder_path.read_text())["pid"] == holder.pid
        first_beat = os.stat(waiter.holder_path).st_mtime_ns
        while os.stat(waiter.holder_path).st_mtime_ns == first_beat:
            assert time.monotonic() < deadline, "the holder record never beat again"
            time.sleep(0.05)
        assert not waiter.acquire(timeout=0)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not waiter.holder_alive()  # a dead local pid
    assert waiter.acquire(timeout=0)
    waiter.release()


def test_a_waiter_that_moved_a_live_lock_aside_puts_it_back(tmp_path):
    """Two waiters judged the same stale file; the second finds a new live lock in its place."""
    path = tmp_path / "k.lock.soft"
    write_record(path, pid=dead_pid())
    stale_view = os.lstat(path)
    first = locks.SoftLock(path, lease=60)
    assert first.acquire(timeout=0)  # took the stale lock over and holds a new one
    late = locks.SoftLock(path, lease=60)
    late._take_over(stale_view)  # acting on its outdated judgement
    assert first.owner()["pid"] == os.getpid()
    now = os.lstat(path)
    assert (now.st_dev, now.st_ino) == first._identity  # the same file, back in place
    assert not late.acquire(timeout=0)
    first.release()
    assert late.acquire(timeout=0)
    late.release()


def test_lock_kind_and_lease_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CACHEKIT_LOCK", raising=False)
    assert isinstance(locks.make_lock(tmp_path / "a.lock"), locks.OsLock)
    monkeypatch.setenv("CACHEKIT_LOCK", "Soft")
    lock = locks.make_lock(tmp_path / "a.lock")
    assert isinstance(lock, locks.SoftLock) and lock.path.name == "a.lock.soft"
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "2.5")
    assert locks.make_lock(tmp_path / "a.lock").lease == 2.5
    monkeypatch.setenv("CACHEKIT_LOCK", "none")
    assert not locks.make_lock(tmp_path / "a.lock").exclusive
    monkeypatch.setenv("CACHEKIT_LOCK", "flock")
    with pytest.raises(ValueError, match="os, soft, none"):
        locks.make_lock(tmp_path / "a.lock")
    monkeypatch.setenv("CACHEKIT_LOCK", "soft")
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv("CACHEKIT_LOCK_LEASE", bad)
        with pytest.raises(ValueError, match="CACHEKIT_LOCK_LEASE"):
            locks.make_lock(tmp_path / "a.lock")


@pytest.mark.parametrize("kind", locks.KINDS)
def test_builds_and_hits_under_each_lock_kind(cache_root, cover_paths, monkeypatch, kind):
    monkeypatch.setenv("CACHEKIT_LOCK", kind)
    cache = cachekit.Cache(cache_root, progress=False)
    built = cache.images(pd.Series(cover_paths[:4]), 8)
    assert not built.hit and cache.images(pd.Series(cover_paths[:4]), 8).hit
    lock_files = sorted(p.name for p in (cache_root / "locks").iterdir())
    assert not any(name.endswith(".soft") for name in lock_files)  # a soft lock is released


def test_a_live_soft_lock_makes_a_waiter_time_out_naming_the_lock(cache_root, cover_paths,
                                                                  monkeypatch):
    monkeypatch.setenv("CACHEKIT_LOCK", "soft")
    cache = cachekit.Cache(cache_root, lock_timeout=0.3, progress=False)
    column = pd.Series(cover_paths[:2])
    probe = cachekit.Cache(cache_root.parent / "probe", progress=False).images(column, 8)
    lock_path = Layout(cache_root).lock_path(probe.key)
    lock_path.parent.mkdir(parents=True)
    holder = locks.SoftLock(lock_path.with_name(lock_path.name + ".soft"), lease=60)
    assert holder.acquire(timeout=0)
    try:
        with pytest.raises(cachekit.LockTimeout, match=r"\.lock\.soft"):
            cache.images(column, 8)
    finally:
        holder.release()
    assert cache.images(column, 8).key == probe.key


# filelock's SoftFileLease against the contract (docs/design.md, "Locks: why not filelock's
# SoftFileLease") --------------------------------------------------------------------------

PLANTS = {
    "an empty file": "",
    "an exclusive marker of another host": (
        "filelock/2\npid=4242\nhost=another-node.cluster\nmode=exclusive\n"),
    "a marker of a mode filelock does not know": "filelock/2\npid=PID\nhost=HOST\nmode=strict\n",
}
SHORT_LEASE = 0.2


def soft_file_lease(path: Path, lease: float):
    """A filelock SoftFileLease on ``path``, as the soft lock would use one."""
    lease_class = getattr(filelock, "SoftFileLease", None)
    if lease_class is None:
        pytest.skip("filelock before 3.30 has no SoftFileLease")
    return lease_class(str(path), lease_duration=lease)


def plant(path: Path, body: str) -> None:
    """What a group member (or a dead holder) leaves: one file, never touched again."""
    path.write_text(body.replace("PID", str(dead_pid())).replace("HOST", _fs.host()))
    old = time.time() - 10 * SHORT_LEASE
    os.utime(path, (old, old))


def assert_the_soft_lock_takes_it_over_at_once(path) -> None:
    ours = locks.SoftLock(path, lease=SHORT_LEASE)
    assert ours.acquire(timeout=0)
    ours.release()


@pytest.mark.parametrize("what", sorted(PLANTS))
def test_a_soft_file_lease_is_blocked_for_good_by_a_marker_that_never_beats(tmp_path, what):
    """filelock never takes these over, whatever their age: an unknown mode and an empty
    file are kept (they may be another version's live lock), and an exclusive marker of
    another host can only be judged by its pid, which means nothing here. The soft lock
    takes the same file over at once: it shows no heartbeat for a lease."""
    path = tmp_path / "k.lock.soft"
    plant(path, PLANTS[what])
    contender = soft_file_lease(path, SHORT_LEASE)
    with pytest.raises(filelock.Timeout):
        contender.acquire(timeout=10 * SHORT_LEASE)
    assert_the_soft_lock_takes_it_over_at_once(path)


def test_a_soft_file_lease_refuses_to_wait_on_a_marker_of_another_lease(tmp_path):
    """Every contender must agree on the lease, so one planted marker with another duration
    (or a teammate with another $CACHEKIT_LOCK_LEASE) makes every build of the key fail;
    the soft lock judges any holder by its own lease."""
    path = tmp_path / "k.lock.soft"
    plant(path, "filelock/2\npid=4242\nhost=another-node.cluster\nmode=lease\n"
                f"token={'ab' * 16}\nduration=1000000000.0\n")
    contender = soft_file_lease(path, SHORT_LEASE)
    with pytest.raises(filelock.LeaseSettingsMismatch):
        contender.acquire(timeout=10 * SHORT_LEASE)
    assert_the_soft_lock_takes_it_over_at_once(path)
