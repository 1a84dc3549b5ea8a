"""The local entry store (cachekit/store/local.py, commit.py): begin, seal, commit, claim,
remove."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

import cachekit
from cachekit import CacheCorruptError, arrays, file_modes, liveness, processes
from cachekit.store import manifest as manifests
from cachekit.store import LocalStore
from cachekit.store.build_dirs import HEARTBEAT_FILE, STATE_FILE
from helpers import FunctionRequest

KEY = "ab" * 16


def started(store: LocalStore):
    store.ensure_writable(KEY)
    build = store.begin(KEY)
    out = arrays.create_array(build.dir, manifests.DATA_FILE, (3, 2), np.dtype(np.int16))
    out[:] = np.arange(6).reshape(3, 2)
    out.flush()
    return build


def manifest_for(build, files) -> manifests.Manifest:
    return manifests.Manifest(key=KEY, kind="map", rows=3, files=files, created=time.time())


def test_a_build_beats_while_it_lives_and_commits_only_its_listed_files(cache_root,
                                                                       monkeypatch):
    monkeypatch.delenv("CACHEKIT_LOCK_LEASE", raising=False)  # 60 s: the first beat at 15 s
    store = LocalStore(cache_root)
    build = started(store)
    (state,) = store.builds(KEY)
    assert state.alive and state.path == build.path and state.owner["pid"] == os.getpid()
    assert os.stat(build.path).st_mode & 0o022 == 0  # private: no group or other write
    assert not {HEARTBEAT_FILE, STATE_FILE} & set(os.listdir(build.path))  # nothing said yet
    build.progress(3, 3)
    (state,) = store.builds(KEY)
    assert state.alive and state.same_version and state.record["done"] == 3
    assert {HEARTBEAT_FILE, STATE_FILE} <= set(os.listdir(build.path))
    files = store.seal(build, [(manifests.DATA_FILE, "numpy")])
    assert files[0].shape == (3, 2) and files[0].dtype == "<i2"
    published, won = store.commit(build, manifest_for(build, files))
    assert won and sorted(os.listdir(published.path)) == [manifests.DATA_FILE,
                                                          manifests.MANIFEST_FILE]
    assert store.lookup(KEY).manifest == published.manifest
    assert store.builds(KEY) == [] and str(build.path) not in liveness._BEATING_HERE
    assert oct(os.stat(published.path).st_mode & 0o777) == oct(0o777 & ~file_modes.umask())


def test_a_build_that_says_nothing_writes_its_record_at_its_first_beat(cache_root,
                                                                       monkeypatch):
    """A build that runs longer than a quarter lease without a word (a memoize build) still
    gets its full owner record and a heartbeat file of its own."""
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.4")
    store = LocalStore(cache_root)
    build = started(store)
    deadline = time.monotonic() + 30
    while (state := store.builds(KEY)[0]).record is None:
        assert time.monotonic() < deadline, "the first beat wrote no record"
        time.sleep(0.02)
    assert state.alive and state.same_version and state.owner == {
        **processes.owner(), "key": KEY, "format": manifests.FORMAT_VERSION,
        "cachekit_version": cachekit.__version__, "started": state.owner["started"]}
    beat = os.stat(build.path / HEARTBEAT_FILE).st_mtime_ns
    while os.stat(build.path / HEARTBEAT_FILE).st_mtime_ns == beat:
        assert time.monotonic() < deadline, "the heartbeat file never beat"
        time.sleep(0.02)
    build.discard()
    assert store.builds(KEY) == []


def test_a_stray_file_in_a_build_directory_stops_the_commit(cache_root):
    store = LocalStore(cache_root)
    build = started(store)
    files = store.seal(build, [(manifests.DATA_FILE, "numpy")])
    (build.path / "planted.npy").write_bytes(b"x")
    with pytest.raises(CacheCorruptError, match="unexpected files"):
        store.commit(build, manifest_for(build, files))
    assert store.lookup(KEY) is None
    build.discard()


def test_a_second_commit_of_the_key_loses_and_gets_the_first(cache_root):
    store = LocalStore(cache_root)
    first, second = started(store), started(store)
    for build in (first, second):
        files = store.seal(build, [(manifests.DATA_FILE, "numpy")])
        published, won = store.commit(build, manifest_for(build, files))
        assert won is (build is first)
    assert published.path == store.layout.entry_dir(KEY)
    assert os.listdir(store.layout.tmp) == []


def test_a_dead_build_is_claimed_by_exactly_one_new_build(cache_root):
    store = LocalStore(cache_root)
    dead = started(store)
    dead.abandon()
    (state,) = store.builds(KEY)
    assert not state.alive and state.abandoned
    one, other = store.begin(KEY), store.begin(KEY)
    claimed = store.claim_dead(one, state)
    assert claimed is not None and store.claim_dead(other, state) is None
    assert one.resume_from == [claimed]
    assert manifests.DATA_FILE in claimed.names()  # read from there, never moved or written
    assert not state.path.exists()
    one.drop_resumed()
    assert not any(n.startswith("resumed.") for n in os.listdir(one.path))
    one.discard()
    other.discard()


def test_another_users_dead_build_is_never_claimed(cache_root):
    store = LocalStore(cache_root)
    dead = started(store)
    dead.abandon()
    (state,) = store.builds(KEY)
    foreign = dataclasses.replace(state, uid=os.geteuid() + 1)
    current = store.begin(KEY)
    assert store.claim_dead(current, foreign) is None
    assert state.path.exists() and current.resume_from == []
    current.discard()


def test_remove_never_follows_a_symlink(cache_root, tmp_path):
    store = LocalStore(cache_root)
    store.ensure_writable(KEY)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("mine")
    os.symlink(precious, store.layout.entry_dir(KEY))
    assert store.remove_entry(KEY) is True  # the planted link is unlinked
    assert (precious / "keep").read_text() == "mine"
    assert not os.path.lexists(store.layout.entry_dir(KEY))


def test_an_older_versions_build_directory_is_never_resumed_and_is_listed_and_cleared(
        cache_root):
    from cachekit.admin import inspect, local_removal as removal

    store = LocalStore(cache_root)
    store.ensure_writable(KEY)
    old = store.layout.tmp / f"{KEY}.elsewhere.4242.0123456789ab"
    old.mkdir()  # as an older cachekit left it: journal.json, no state.json
    (old / "journal.json").write_text('{"key": "%s", "host": "elsewhere", "pid": 4242}' % KEY)
    (old / HEARTBEAT_FILE).write_bytes(b"")
    (old / manifests.DATA_FILE).write_bytes(b"\x93NUMPY")
    beat = time.time() - 3600
    os.utime(old / HEARTBEAT_FILE, (beat, beat))
    (state,) = store.builds(KEY)
    assert state.record is None and not state.same_version  # so never resumed
    assert not state.alive and state.owner == {"host": "elsewhere", "pid": 4242}
    (temp,) = inspect.scan(store).temp_dirs
    assert temp.state == inspect.ORPHANED and temp.owner == "pid 4242 on elsewhere (starting)"
    report = removal.removal_for_clear(store).execute()
    assert [t.path for t in report.removed_temp_dirs] == [old] and not old.exists()


def test_a_builder_taken_over_mid_build_returns_the_entry_its_successor_published(
        cache_root):
    """What a builder paused past its lease meets when it wakes: another build claimed its
    directory (renamed it into its own), published the entry and removed what it claimed.
    Whichever file of its directory the woken build then fails on, the call returns the
    published entry (source "local"), it does not raise FileNotFoundError."""
    from cachekit.obtain import obtain

    store = LocalStore(cache_root)
    calls = []

    def build_fn(current, progress):
        calls.append(current.path)
        if len(calls) == 1:  # the successor: claims our directory, publishes, drops it
            successor = started(store)
            assert store.claim_dead(successor, next(
                s for s in store.builds(KEY) if s.path == current.path)) is not None
            files = store.seal(successor, [(manifests.DATA_FILE, "numpy")])
            store.commit(successor, manifest_for(successor, files))
            with current.dir.open_file("data.npy.rest"):  # gone with the claimed directory
                pass
        raise AssertionError("a woken builder built again")

    outcome = obtain(store, FunctionRequest(KEY, build_fn), lock_timeout=5)
    assert outcome.source == "local" and len(calls) == 1
    assert np.load(outcome.entry.path / manifests.DATA_FILE).tolist() == [[0, 1], [2, 3],
                                                                         [4, 5]]


def test_remove_tree_takes_a_tree_and_never_what_its_symlinks_lead_to(tmp_path, monkeypatch):
    """Nested folders, a FIFO and symlinks go; what a symlink leads to stays, also when a
    folder is swapped for one after its parent was listed (any group member can)."""
    from cachekit._fs import DirHandle

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("mine")
    root = tmp_path / "root"
    (root / "tree" / "a" / "b").mkdir(parents=True)
    (root / "tree" / "a" / "b" / "rows.npy").write_bytes(b"x" * 10)
    (root / "tree" / "swapped").mkdir()
    (root / "tree" / "swapped" / "f").write_text("")
    os.mkfifo(root / "tree" / "fifo")
    os.symlink(precious, root / "tree" / "link")
    os.symlink(precious, root / "top")
    (root / "plain").write_text("")
    listed = DirHandle.names

    def swap_after_listing(folder: DirHandle) -> list[str]:
        names = listed(folder)
        if folder.path.name == "tree":
            os.rename(root / "tree" / "swapped", tmp_path / "moved")
            os.symlink(precious, root / "tree" / "swapped")
        return names

    monkeypatch.setattr(DirHandle, "names", swap_after_listing)
    with DirHandle.open(root) as folder:
        for name in ("tree", "top", "plain", "never-there"):
            folder.remove_tree(name)
    assert os.listdir(root) == []
    assert os.listdir(precious) == ["keep"] and (precious / "keep").read_text() == "mine"
