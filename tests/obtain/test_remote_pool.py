"""The remote pool: a row data file that several entries hold (a fold and the full entry
it shares rows with) is uploaded once, under its checksum, and ``cachekit clear --remote``
removes the pool objects that no manifest names, never one that a manifest names."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import cachekit
from cachekit import units
from cachekit.admin.remote_clear import removal_for_clear
from cachekit.admin.remote_verify import verify as verify_remote
from cachekit.cli.main import main as cli_main
from cachekit.obtain import background
from cachekit.store import manifest as manifests
from cachekit.store.remote import RemoteStore
from cachekit.store import remote_entry
from cachekit.store.remote_entry import pool_path


def _int_row(v: int) -> np.ndarray:
    return np.full(16, v, dtype=np.int32)


def _pushed(root: Path, *columns: list[int]) -> list[cachekit.Entry]:
    cache = cachekit.Cache(root, workers=1, progress=False)
    entries = []
    for column in columns:
        entries.append(cache.map(_int_row, column, version="1"))
        background.wait_all()  # one upload after the other
    return entries


def _pooled_files(remote: RemoteStore, key: str) -> dict[str, int]:
    """The pool objects ``key``'s remote manifest names, with their sizes."""
    found = remote.lookup(key)
    return {path: f.bytes for f, path in zip(found.manifest.files, found.objects(remote))
            if found.pooled(f)}


def _full_pushed_and_fold_not(root: Path) -> tuple[cachekit.Entry, cachekit.Entry, RemoteStore]:
    """A full entry of 300 rows, uploaded, and a fold of every third row of it that is
    not (yet), both on ``root``; and the remote of ``$CACHEKIT_REMOTE``."""
    [full] = _pushed(root, list(range(300)))
    fold = cachekit.Cache(root, workers=1, progress=False, remote="").map(
        _int_row, list(range(0, 300, 3)), version="1")
    return full, fold, RemoteStore(os.environ["CACHEKIT_REMOTE"])


def test_push_sends_each_row_file_once_and_clear_remote_takes_what_no_entry_names(
        s3_env, tmp_path, capsys):
    full, *folds = _pushed(tmp_path / "a", list(range(300)),
                           *[list(range(k, 300, 3)) for k in range(3)])
    assert not any(f.contiguous for f in folds)
    said = capsys.readouterr().err
    assert said.count("sent, the rest was in the bucket already") == len(folds)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    named = {}
    for entry in (full, *folds):
        named.update(_pooled_files(remote, entry.key))
    pool = {o.path: o.size for o in remote.scan().pool}
    assert pool == named  # each distinct file once, and nothing else
    data = full._manifest.files[0]
    assert list(pool.values()).count(data.bytes) == 1  # the full entry's rows, sent once
    for fold in folds:
        parts = [f for f in fold._manifest.files if manifests.is_part_name(f.name)]
        assert [p.checksum for p in parts] == [data.checksum]
    capsys.readouterr()
    assert cli_main(["verify", "--remote"]) == 0

    there = str(tmp_path / "b")  # a host holding the full entry pulls a fold
    assert cli_main(["--root", there, "pull", full.key[:12]]) == 0
    capsys.readouterr()
    assert cli_main(["--root", there, "pull", folds[0].key[:12]]) == 0
    said = capsys.readouterr().out
    assert f"of it linked from entries here, not downloaded) into {there}" in said

    def cleared(*selection: str) -> None:  # and said what it freed, each object once
        before = remote.fs.du(remote.root)
        assert cli_main(["clear", "--remote", *selection, "--yes"]) == 0
        freed = units.format_size(before - remote.fs.du(remote.root))
        assert f"freed {freed}\n" in capsys.readouterr().out

    capsys.readouterr()
    cleared(folds[0].key[:12])
    assert {o.path for o in remote.scan().pool} == set(named)  # the others name them all
    assert verify_remote(remote) == (3, [])
    cleared(full.key[:12])
    assert pool_path(remote, data.checksum) in {o.path for o in remote.scan().pool}
    assert verify_remote(remote) == (2, [])  # the folds still name the full entry's rows

    cleared("--all")
    listing = remote.scan()
    assert listing.keys == [] or all(k.manifest is None for k in listing.keys)
    assert listing.pool == []


def test_uploads_running_at_once_send_each_pool_object_once(s3_env, tmp_path, monkeypatch):
    """The full entry and three folds of it, each call's upload started in the background
    without waiting for the one before, send each row file they share once between them
    (the full entry's rows and row files: the folds decode none, and have no data file of
    their own): an upload that finds another upload of its process sending it waits, then
    finds it in the pool. Every write is slowed, so that the uploads look for an object
    while another is still sending it."""
    from cachekit.store.bucket import Bucket

    written: list[str] = []
    write_file = Bucket.write_file

    def slow_write(self, path, *args, **kwargs):
        time.sleep(0.5)
        written.append(path)
        return write_file(self, path, *args, **kwargs)

    monkeypatch.setattr(Bucket, "write_file", slow_write)
    cache = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    full = cache.map(_int_row, list(range(300)), version="1")
    for k in range(3):
        cache.map(_int_row, list(range(k, 300, 3)), version="1")
    background.wait_all()
    rows = pool_path(RemoteStore(s3_env["CACHEKIT_REMOTE"]), full._manifest.files[0].checksum)
    assert rows in written
    assert [path for path, times in Counter(written).items() if times > 1] == []


def test_a_pool_object_that_a_manifest_came_to_name_since_the_scan_is_spared(
        s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.5")  # untouched for 2 s: old
    [entry] = _pushed(tmp_path / "a", list(range(50)))
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    theirs = _pooled_files(remote, entry.key)
    assert theirs and remote.remove_entry(entry.key)  # its pool objects stay, unnamed
    stray = pool_path(remote, "blake2b-128:" + "ab" * 16)
    remote.write(stray, b"left by an upload killed before its manifest")
    time.sleep(3.5)
    plan = removal_for_clear(remote, older_than=10 ** 9)  # leftovers only
    planned = {o.path for x in plan.leftovers for o in x.objects}
    assert planned == {stray, *theirs}
    # An upload of the entry meets its row files in the pool, and names them again.
    local = cachekit.store.LocalStore(tmp_path / "a")
    assert remote.upload(local.lookup(entry.key))
    assert plan.execute().failed == ()
    assert {o.path for o in remote.scan().pool} == set(theirs)
    assert verify_remote(remote) == (1, [])


def test_an_entry_uploaded_before_the_pool_existed_is_still_pulled_and_verified(
        s3_env, tmp_path):
    import json

    [entry] = _pushed(tmp_path / "a", list(range(40)))
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    found = remote.lookup(entry.key)
    for record, path in zip(found.manifest.files, found.objects(remote)):  # the old layout
        if found.pooled(record):
            remote.fs.pipe_file(remote.upload_path(entry.key, found.upload, record.name),
                                remote.fs.cat_file(path))
            remote.fs.rm_file(path)
    manifest = remote.manifest_path(entry.key)
    fields = json.loads(remote.fs.cat_file(manifest))
    del fields["pool"]
    remote.fs.pipe_file(manifest, json.dumps(fields).encode())
    assert not remote.lookup(entry.key).pool and remote.scan().pool == []
    assert verify_remote(remote) == (1, [])
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    pulled = there.map(_int_row, list(range(40)), version="1")
    assert pulled.source == "remote"
    np.testing.assert_array_equal(np.asarray(pulled.array)[:, 0], np.arange(40))


def test_a_clear_spares_the_pool_objects_an_upload_in_progress_relies_on(
        s3_env, tmp_path, monkeypatch):
    """A fold's upload finds the full entry's rows in the pool and sends nothing for them;
    before it commits, another host's ``clear --remote`` of the full entry runs. The
    upload listed the rows in its ``pool.json`` before it looked: the clear leaves them,
    and the upload commits at its first attempt. (In a soak with a clear every few
    seconds, such uploads failed twice in a row: 8 in 300 s.)"""
    from cachekit.store import LocalStore, remote_upload

    full, fold, remote = _full_pushed_and_fold_not(tmp_path / "a")
    rows = pool_path(remote, full._manifest.files[0].checksum)
    check_sizes, cleared, sent = remote_upload.check_sizes, [], []

    def cleared_first(*args, **kwargs):
        if not cleared:  # "another host", between the look into the pool and the commit
            cleared.append(removal_for_clear(remote, [full.key]).execute().failed)
            assert remote.lookup(full.key) is None
            assert rows in {o.path for o in remote.scan().pool}
        return check_sizes(*args, **kwargs)

    monkeypatch.setattr(remote_upload, "check_sizes", cleared_first)
    assert remote.upload(LocalStore(tmp_path / "a").lookup(fold.key), sent=sent.append)
    assert cleared == [()] and full._manifest.files[0].bytes not in sent
    assert rows in _pooled_files(remote, fold.key)
    assert verify_remote(remote) == (1, [])


def test_a_pool_object_that_goes_before_an_upload_commits_is_sent_again(
        s3_env, tmp_path, monkeypatch):
    """A clear that read the upload's ``pool.json`` before it was written takes the rows
    the upload found in the pool. The check before the commit finds them missing, and the
    upload starts again and sends them: the fold's remote entry is whole."""
    from cachekit.store import LocalStore, remote_upload

    full, fold, remote = _full_pushed_and_fold_not(tmp_path / "a")
    rows = pool_path(remote, full._manifest.files[0].checksum)
    check_sizes, taken = remote_upload.check_sizes, []

    def taken_first(*args, **kwargs):
        if not taken:  # as that clear does, between the look into the pool and the commit
            taken.append(remote.remove_entry(full.key))
            remote.fs.rm_file(rows)
        return check_sizes(*args, **kwargs)

    monkeypatch.setattr(remote_upload, "check_sizes", taken_first)
    assert remote.upload(LocalStore(tmp_path / "a").lookup(fold.key))
    assert taken == [True]
    assert rows in _pooled_files(remote, fold.key)
    assert verify_remote(remote) == (1, [])


def test_the_pool_json_of_a_dead_upload_spares_nothing(s3_env, tmp_path, monkeypatch):
    """An uploader killed after it wrote its ``pool.json`` leaves an orphaned upload; once
    it and its key's lease are untouched for twice the lease, its list keeps nothing from
    a clear of the full entry, which removes the rows no manifest names; a clear of its
    key then removes the orphaned upload."""
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.5")  # untouched for 2 s: dead
    full, fold, remote = _full_pushed_and_fold_not(tmp_path / "a")
    rows = pool_path(remote, full._manifest.files[0].checksum)
    dead = "ab" * 16
    remote_entry.pin(remote, fold.key, dead, [rows])
    assert remote.pinned(fold.key, dead) == {rows}
    time.sleep(3.5)
    assert removal_for_clear(remote, [full.key]).execute().failed == ()
    assert remote.scan().pool == []
    assert removal_for_clear(remote, [fold.key]).execute().failed == ()
    assert [item.uploads for item in remote.scan().keys if item.key == fold.key] in ([], [{}])


@pytest.mark.parametrize("hooked, checked", [("check_sizes", 2), ("lookup", 1)])
def test_verify_remote_reports_no_problem_for_an_entry_cleared_as_it_reads(
        s3_env, tmp_path, monkeypatch, hooked, checked):
    """Another host's ``clear --remote`` takes an entry while ``verify --remote`` reads it:
    as it reads its objects (``check_sizes``), or after it listed the manifest and before
    it read it (``lookup``). The entry is gone, not broken, and verify reports nothing (it
    said "a data object the manifest lists is missing", or "the manifest went away while
    we looked", exit 1, in soaks with a clear every few seconds)."""
    first, second = _pushed(tmp_path / "a", list(range(50)), list(range(100, 150)))
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    original, cleared = getattr(RemoteStore, hooked), []

    def cleared_first(self, key, *args, **kwargs):
        if not cleared:  # "another host" clears the first entry read
            cleared.append(key)
            assert removal_for_clear(remote, [key]).execute().failed == ()
        return original(self, key, *args, **kwargs)

    monkeypatch.setattr(RemoteStore, hooked, cleared_first)
    assert verify_remote(remote) == (checked, [])
    assert cleared and cleared[0] in (first.key, second.key)


def test_an_upload_that_names_a_pool_object_as_clear_removes_it_is_withdrawn(
        s3_env, tmp_path, monkeypatch):
    """``clear --remote`` of the full entry reads every manifest, finds its rows named by
    none, and removes them; in between, a fold's upload (another host's) met them in the
    pool, published its manifest naming them and checked that they were there. The clear
    reads the manifests published since once more after its removal and withdraws the
    fold's: the key is a miss that the next call builds, never a manifest naming deleted
    rows. (A soak with a clear every few seconds left such a torn entry at rest.)"""
    from cachekit.store import LocalStore

    full, fold, remote = _full_pushed_and_fold_not(tmp_path / "a")
    rows = pool_path(remote, full._manifest.files[0].checksum)
    remove, uploaded = RemoteStore.remove, []

    def uploaded_first(self, paths, what):
        paths = list(paths)
        if rows in paths and not uploaded:  # just before the rows go
            uploaded.append(remote.upload(LocalStore(tmp_path / "a").lookup(fold.key)))
            assert rows in _pooled_files(remote, fold.key)  # relied on, not sent
        return remove(self, paths, what)

    monkeypatch.setattr(RemoteStore, "remove", uploaded_first)
    assert removal_for_clear(remote, [full.key]).execute().failed == ()
    monkeypatch.setattr(RemoteStore, "remove", remove)
    assert uploaded == [True]
    assert rows not in {o.path for o in remote.scan().pool}
    assert remote.lookup(fold.key) is None
    assert verify_remote(remote) == (0, [])
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    again = there.map(_int_row, list(range(0, 300, 3)), version="1")
    assert again.source == "built"
    np.testing.assert_array_equal(np.asarray(again.array)[:, 0], np.arange(0, 300, 3))


def test_an_upload_whose_pool_object_goes_before_each_commit_fails_saying_what_to_do(
        s3_env, tmp_path, monkeypatch):
    """A clear elsewhere takes the full entry's rows before the fold's upload commits, and
    again before its second attempt commits: the upload fails, publishes nothing, and says
    to push again (it advised removing a remote entry that was never published)."""
    from cachekit.store import LocalStore, remote_upload

    full, fold, remote = _full_pushed_and_fold_not(tmp_path / "a")
    rows = pool_path(remote, full._manifest.files[0].checksum)
    check_sizes, calls = remote_upload.check_sizes, []

    def taken_first(bucket, key, records, objects):
        calls.append(key)
        if rows in objects:
            remote.fs.rm_file(rows)  # as the clear of the full entry would, every time
        return check_sizes(bucket, key, records, objects)

    monkeypatch.setattr(remote_upload, "check_sizes", taken_first)
    with pytest.raises(cachekit.CacheCorruptError) as raised:
        remote.upload(LocalStore(tmp_path / "a").lookup(fold.key))
    said = str(raised.value)
    assert "before the manifest naming it was published" in said and "cachekit push" in said
    assert "remove the remote entry" not in said
    assert len(calls) == 2 and remote.lookup(fold.key) is None


def test_a_download_under_a_budget_has_room_made_before_it_writes(s3_env, tmp_path, capsys):
    """Host b holds an unused entry of 250 KB; its budget of 200 KB leaves no room for
    the 164 KB entry it downloads: the old entry goes before the download writes, as it
    does before a build."""
    [full] = _pushed(tmp_path / "a", list(range(2000)))
    b = cachekit.Cache(tmp_path / "b", workers=1, remote="", max_size="200K")
    old = b.map(_int_row, list(range(5000, 7500)), version="1").path
    capsys.readouterr()
    pulled = cachekit.Cache(tmp_path / "b", workers=1, max_size="200K").map(
        _int_row, list(range(2000)), version="1")
    said = capsys.readouterr().err
    assert pulled.outcome == "pulled" and not old.exists(), said
    assert f"to make room for the {units.format_size(full._manifest.bytes)} entry " \
        f"{full.key[:12]} is about to write" in said, said
