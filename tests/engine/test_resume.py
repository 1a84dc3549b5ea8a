"""Resuming a dead builder's work: only when its record (state.json) and chunk journal match, never into
data that disagrees with them, never a directory a live builder may still write, and then
exactly the chunks that are not done, wherever they are.

Partial builds are made in this process by interrupting a build (KeyboardInterrupt keeps the
finished chunks, as a killed process does; see test_kill.py for real SIGKILLs),
then tampered with on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import LockTimeout
from cachekit import _fs, arrays
from cachekit.store import manifest as manifests
from cachekit.store import build_dirs

from helpers import chunk_journal, done_chunks, rows_not_done, small_chunks

ROWS, CHUNK = 40, 4
CONTROL: dict = {"stop_at": None, "computed": [], "fail": ()}


def row_fn(value):
    """Three times the value; stops the build at one row and fails at others on request."""
    if value == CONTROL["stop_at"]:
        raise KeyboardInterrupt
    if value in CONTROL["fail"]:
        raise ValueError(f"row {value} is bad")
    CONTROL["computed"].append(value)
    return np.full((2,), value * 3, dtype=np.int16)


EXPECTED = np.repeat(np.arange(ROWS, dtype=np.int16)[:, None] * 3, 2, axis=1)


@pytest.fixture(autouse=True)
def chunks_of_four(monkeypatch):
    small_chunks(monkeypatch, CHUNK)
    monkeypatch.setenv("CACHEKIT_LOCK", "os")
    CONTROL.update(stop_at=None, computed=[], fail=())


def run(root: Path, on_error: str = "raise") -> cachekit.Entry:
    CONTROL["computed"] = []
    return cachekit.Cache(root, workers=2, progress=False).map(
        row_fn, pd.Series(range(ROWS)), on_error=on_error)


def interrupted(root: Path, stop_at: int, on_error: str = "raise") -> Path:
    """Interrupt a build at row ``stop_at``; return the build directory it leaves."""
    CONTROL["stop_at"] = stop_at
    with pytest.raises(KeyboardInterrupt):
        run(root, on_error)
    CONTROL["stop_at"] = None
    (build_dir,) = (root / "tmp").iterdir()
    return build_dir


def record(build_dir: Path) -> dict:
    return json.loads((build_dir / build_dirs.STATE_FILE).read_text())


def rewrite(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    for name, value in changes.items():
        if value is None:
            del data[name]
    path.write_text(json.dumps(data))


def plan_file(build_dir: Path) -> Path:
    return chunk_journal(build_dir) / "plan.json"


def done_file(build_dir: Path, index: int = 0) -> Path:
    return chunk_journal(build_dir) / f"done.{index}"


def rewrite_done(build_dir: Path, **changes) -> None:
    """Rewrite done record 0 (a fresh file: the record itself is never written twice)."""
    path = done_file(build_dir)
    data = json.loads(path.read_text())
    data.update(changes)
    path.unlink()
    path.write_text(json.dumps(data))


def assert_correct(entry: cachekit.Entry) -> None:
    np.testing.assert_array_equal(np.asarray(entry.array), EXPECTED)
    assert arrays.checksum(entry.path / manifests.DATA_FILE)[1] == entry.manifest["files"][0]["checksum"]
    assert list((entry.path.parent.parent / "tmp").iterdir()) == []


def test_an_interrupted_build_resumes_its_chunks_that_are_not_done(cache_root, capfd):
    build_dir = interrupted(cache_root, 17)
    assert record(build_dir)["abandoned"] is True
    assert {0, 1, 2, 3} <= done_chunks(build_dir) and 4 not in done_chunks(build_dir)
    todo = rows_not_done(build_dir)
    CONTROL["computed"] = []
    entry = cachekit.Cache(cache_root, workers=2).map(row_fn, pd.Series(range(ROWS)))
    assert sorted(CONTROL["computed"]) == todo
    assert "resuming the build" in capfd.readouterr().err
    assert_correct(entry)


def test_resume_skips_done_chunks_that_are_not_a_prefix(cache_root):
    build_dir = interrupted(cache_root, 17)
    for index in (1, 3):  # as if two other processes had not finished theirs
        done_file(build_dir, index).unlink()
    done = done_chunks(build_dir)
    assert 0 in done and 2 in done and 1 not in done
    todo = rows_not_done(build_dir)
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == todo
    assert set(range(4, 8)) <= set(todo) and not set(range(8, 12)) & set(todo)
    assert_correct(entry)


def test_failed_rows_of_done_chunks_stay_failed_after_resuming(cache_root):
    CONTROL["fail"] = (2, 9)
    build_dir = interrupted(cache_root, 30, on_error="zero")
    todo = rows_not_done(build_dir)
    assert 2 not in todo and 9 not in todo
    entry = run(cache_root, on_error="zero")
    assert sorted(CONTROL["computed"]) == todo  # the done chunks were kept, failures included
    assert np.flatnonzero(~entry.valid).tolist() == [2, 9]
    assert [row for row, _, _ in entry.manifest["failed_rows"]] == [2, 9]
    assert "row 9 is bad" in entry.manifest["failed_rows"][1][2]
    assert not np.asarray(entry.array[[2, 9]]).any()


TAMPERING = {
    "record of another key": lambda d: rewrite(d / build_dirs.STATE_FILE, key="0" * 32),
    "record of another version": lambda d: rewrite(d / build_dirs.STATE_FILE,
                                                    cachekit_version="0.0.0"),
    "record of another format": lambda d: rewrite(d / build_dirs.STATE_FILE, format=99),
    "record missing": lambda d: (d / build_dirs.STATE_FILE).unlink(),
    "record not JSON": lambda d: (d / build_dirs.STATE_FILE).write_text("{not json"),
    "record a list": lambda d: (d / build_dirs.STATE_FILE).write_text("[1, 2]"),
    "chunk journal missing": lambda d: shutil.rmtree(chunk_journal(d)),
    "chunk journal a symlink": lambda d: _symlink_journal(d),
    "plan missing": lambda d: plan_file(d).unlink(),
    "plan not JSON": lambda d: plan_file(d).write_text("\x00\x01"),
    "plan of more rows": lambda d: rewrite(plan_file(d), rows=ROWS + 1),
    "plan of negative rows": lambda d: rewrite(plan_file(d), rows=-4),
    "plan rows as text": lambda d: rewrite(plan_file(d), rows="40"),
    "plan of another row shape": lambda d: rewrite(plan_file(d), row_shape=[1, 2]),
    "plan of another dtype": lambda d: rewrite(plan_file(d), dtype="<u2"),
    "plan of object dtype": lambda d: rewrite(plan_file(d), dtype="|O"),
    "plan of another format": lambda d: rewrite(plan_file(d), format=2),
    "plan of another key": lambda d: rewrite(plan_file(d), key="0" * 32),
    "plan with another data offset": lambda d: rewrite(plan_file(d), offset=4096),
    "data truncated": lambda d: os.truncate(d / manifests.DATA_FILE, 100),
    "data missing": lambda d: (d / manifests.DATA_FILE).unlink(),
    "data header rewritten": lambda d: np.save(d / manifests.DATA_FILE,
                                               np.zeros((ROWS, 2), np.int32)),
    "data is a symlink": lambda d: _symlink_data(d),
}


def _symlink_journal(build_dir: Path) -> None:
    outside = build_dir.parent.parent.parent / "outside.chunks"
    os.replace(chunk_journal(build_dir), outside)
    os.symlink(outside, chunk_journal(build_dir))


def _symlink_data(build_dir: Path) -> None:
    outside = build_dir.parent.parent.parent / "outside.npy"
    os.replace(build_dir / manifests.DATA_FILE, outside)  # the very bytes, only moved outside
    os.symlink(outside, build_dir / manifests.DATA_FILE)


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_a_record_or_checkpoint_that_does_not_match_is_never_resumed(cache_root, how):
    build_dir = interrupted(cache_root, 21)
    TAMPERING[how](build_dir)
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == list(range(ROWS))  # everything recomputed
    assert_correct(entry)
    outside = cache_root.parent / "outside.npy"
    if how == "data is a symlink":  # the dead directory went, the file it pointed at stayed
        assert np.load(outside, allow_pickle=False).shape == (ROWS, 2)
    if how == "chunk journal a symlink":
        assert (cache_root.parent / "outside.chunks" / "plan.json").exists()


DONE_TAMPERING = {
    "not JSON": lambda d: rewrite_done(d) or done_file(d).write_text("{not json"),
    "of another chunk": lambda d: rewrite_done(d, chunk=1),
    "of other rows": lambda d: rewrite_done(d, start=1),
    "failure beyond its chunk": lambda d: rewrite_done(d, failures=[[30, "x", "y"]]),
    "failure malformed": lambda d: rewrite_done(d, failures=[[1, 2]]),
    "failure row as text": lambda d: rewrite_done(d, failures=[["1", "x", "y"]]),
    "a symlink": lambda d: _symlink_done(d),
}


def _symlink_done(build_dir: Path) -> None:
    outside = build_dir.parent.parent.parent / "outside-done.json"
    os.replace(done_file(build_dir), outside)
    os.symlink(outside, done_file(build_dir))


@pytest.mark.parametrize("how", sorted(DONE_TAMPERING))
def test_a_done_record_that_does_not_match_makes_only_its_chunk_run_again(cache_root, how):
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    DONE_TAMPERING[how](build_dir)
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == sorted([0, 1, 2, 3, *todo])
    assert_correct(entry)


@contextlib.contextmanager
def live_process() -> Iterator[subprocess.Popen]:
    """A process that stays alive for the test (a build's owner that is not dead)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield holder
    finally:
        holder.kill()
        holder.wait()


def as_owner(build_dir: Path, heartbeat_age: float = 0.0, **owner) -> None:
    """Make the build's record say ``owner`` is building (not abandoned), with its last heartbeat
    ``heartbeat_age`` seconds ago."""
    rewrite(build_dir / build_dirs.STATE_FILE, abandoned=None, pidns=None, start=None, **owner)
    beat = time.time() - heartbeat_age
    os.utime(build_dir / build_dirs.HEARTBEAT_FILE, (beat, beat))


LEASE = 60.0  # the default lease (CACHEKIT_LOCK_LEASE unset)


@pytest.mark.parametrize("lock", ["os", "soft", "none"])
def test_a_live_local_builder_is_waited_for_and_its_directory_left_alone(cache_root,
                                                                        monkeypatch, lock):
    build_dir = interrupted(cache_root, 21)
    with live_process() as holder:
        as_owner(build_dir, host=_fs.host(), pid=holder.pid)
        monkeypatch.setenv("CACHEKIT_LOCK", lock)
        CONTROL["computed"] = []
        with pytest.raises(LockTimeout, match=f"pid {holder.pid} on {_fs.host()}"):
            cachekit.Cache(cache_root, progress=False, lock_timeout=1, join=False).map(
                row_fn, pd.Series(range(ROWS)))
        assert CONTROL["computed"] == []
        assert [p.name for p in (cache_root / "tmp").iterdir()] == [build_dir.name]


def test_a_joiner_of_a_live_builder_fills_its_free_chunks_and_never_commits(cache_root):
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    # a builder pinned to CPUs other than ours: we bring cores, so we join
    with live_process() as holder:
        as_owner(build_dir, host=_fs.host(), pid=holder.pid,
                 cpus=[max(os.sched_getaffinity(0)) + 1], workers=1)
        CONTROL["computed"] = []
        with pytest.raises(LockTimeout, match=f"pid {holder.pid} on {_fs.host()}"):
            cachekit.Cache(cache_root, progress=False, lock_timeout=1).map(
                row_fn, pd.Series(range(ROWS)))
        assert sorted(CONTROL["computed"]) == todo  # the builder's work, left for it to commit
        assert rows_not_done(build_dir) == []
        assert not (cache_root / "entries").exists() or not any((cache_root / "entries").iterdir())
        assert [p.name for p in (cache_root / "tmp").iterdir()] == [build_dir.name]


def test_a_live_local_builder_whose_heartbeat_stopped_a_lease_ago_is_resumed(cache_root):
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    with live_process() as holder:  # alive, but hung: its heartbeat thread no longer runs
        as_owner(build_dir, heartbeat_age=LEASE + 5, host=_fs.host(), pid=holder.pid)
        entry = run(cache_root)
        assert sorted(CONTROL["computed"]) == todo
        assert_correct(entry)


@pytest.mark.parametrize("lock", ["os", "soft", "none"])
@pytest.mark.parametrize("heartbeat_age, resumed", [(LEASE + 5, True), (0, False)])
def test_another_hosts_build_is_resumed_only_once_its_heartbeat_is_a_lease_old(
        cache_root, monkeypatch, lock, heartbeat_age, resumed):
    """Whatever the lock (it may fail silently across hosts), a fresh heartbeat keeps the
    other host's build alive: we wait for it; a lease without one means it is dead."""
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    as_owner(build_dir, heartbeat_age=heartbeat_age, host="another-node.cluster", pid=4242)
    monkeypatch.setenv("CACHEKIT_LOCK", lock)
    cache = cachekit.Cache(cache_root, workers=2, progress=False, lock_timeout=1, join=False)
    CONTROL["computed"] = []
    if not resumed:
        with pytest.raises(LockTimeout, match="pid 4242 on another-node.cluster"):
            cache.map(row_fn, pd.Series(range(ROWS)))
        assert CONTROL["computed"] == []
        assert [p.name for p in (cache_root / "tmp").iterdir()] == [build_dir.name]
        return
    entry = cache.map(row_fn, pd.Series(range(ROWS)))
    assert sorted(CONTROL["computed"]) == todo
    assert_correct(entry)


def test_a_waiter_resumes_once_the_other_hosts_heartbeat_goes_stale(cache_root, monkeypatch):
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "1.5")
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    as_owner(build_dir, host="another-node.cluster", pid=4242)  # fresh now, never again
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == todo
    assert entry.wait_seconds >= 1.0
    assert_correct(entry)


def test_a_dead_local_builders_directory_is_resumed_even_without_a_lock(cache_root,
                                                                        monkeypatch):
    build_dir = interrupted(cache_root, 21)
    todo = rows_not_done(build_dir)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    as_owner(build_dir, host=_fs.host(), pid=gone.pid)
    monkeypatch.setenv("CACHEKIT_LOCK", "none")
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == todo
    assert_correct(entry)


def test_the_most_advanced_of_several_dead_builds_is_resumed_and_the_rest_removed(cache_root):
    early = interrupted(cache_root, 9)
    parked = cache_root / "parked"
    os.rename(early, parked)  # out of sight while a second build gets further
    later = interrupted(cache_root, 26)
    os.rename(parked, early)
    assert sorted(p.name for p in (cache_root / "tmp").iterdir()) == sorted([early.name,
                                                                             later.name])
    todo = rows_not_done(later)
    assert len(todo) < len(rows_not_done(early))
    entry = run(cache_root)
    assert sorted(CONTROL["computed"]) == todo
    assert_correct(entry)


def test_build_directories_that_are_symlinks_are_never_followed(cache_root, tmp_path):
    entry = run(cache_root)  # learn the key
    key = entry.key
    for path in (cache_root / "entries" / key).iterdir():
        path.unlink()
    (cache_root / "entries" / key).rmdir()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (outside / build_dirs.STATE_FILE).write_text(json.dumps({"abandoned": True}))
    os.symlink(outside, cache_root / "tmp" / f"{key}.host.1.bbbb")
    again = run(cache_root)
    np.testing.assert_array_equal(np.asarray(again.array), EXPECTED)
    assert (outside / "keep.txt").read_text() == "mine"
    assert (cache_root / "tmp" / f"{key}.host.1.bbbb").is_symlink()
