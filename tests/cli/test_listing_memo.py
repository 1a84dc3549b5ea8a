"""The listing memo (``locks/listing.UID.json``): ``ls`` reads again only the manifests that
changed since this user's last listing, and what it shows is what reading them shows."""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import _fs
from cachekit.admin import inspect, listing_memo
from cachekit.store import LocalStore
from cachekit.store import manifest as manifests


def block(value: int) -> np.ndarray:
    return np.full((4, 8), value % 256, dtype=np.uint8)


def entries(root: Path, count: int) -> list[cachekit.Entry]:
    cache = cachekit.Cache(root, progress=False)
    return [cache.map(block, pd.Series(range(10 * i, 10 * i + 3 + i))) for i in range(count)]


def scan_counting_reads(root: Path) -> tuple[inspect.Scan, int]:
    """A scan of ``root``, and how many manifests it read."""
    with mock.patch.object(manifests, "read_at", wraps=manifests.read_at) as read:
        found = inspect.scan(LocalStore(root))
    return found, read.call_count


@pytest.fixture
def settled(monkeypatch):
    """Every manifest counts as settled: kept at once, not only 2 s after it changed."""
    monkeypatch.setattr(listing_memo, "SETTLE_NS", 0)


def test_a_second_listing_reads_no_manifest_and_lists_the_same(cache_root, settled):
    made = entries(cache_root, 3)
    first, read_first = scan_counting_reads(cache_root)
    second, read_second = scan_counting_reads(cache_root)
    assert (read_first, read_second) == (3, 0)
    assert [e.to_json() for e in second.entries] == [e.to_json() for e in first.entries]
    assert {e.key: e.rows for e in second.entries} == {e.key: len(e) for e in made}
    assert (cache_root / "locks" / listing_memo.file_name()).stat().st_uid == os.geteuid()


def test_cache_entries_keeps_and_uses_the_memo_as_ls_does(cache_root, settled):
    made = entries(cache_root, 3)
    cache = cachekit.Cache(cache_root, progress=False)
    with mock.patch.object(manifests, "read_at", wraps=manifests.read_at) as read:
        first = cache.entries()
        second = cache.entries()
    assert read.call_count == 3  # the first call read them; the second, none
    assert [e.to_json() for e in second] == [e.to_json() for e in first]
    assert sorted(e.key for e in second) == sorted(e.key for e in made)


def test_a_memo_written_on_another_host_of_a_network_root_serves_this_one(
        cache_root, settled, monkeypatch):
    """The hosts that mount one network root see its files under device numbers of their
    own: the memo one host wrote still spares the other every manifest read."""
    entries(cache_root, 3)
    scan_counting_reads(cache_root)  # the other host's listing writes the memo
    real = _fs.DirHandle.lstat

    def on_this_host(self, name):
        st = real(self, name)
        seen = {a: getattr(st, a) for a in dir(st) if a.startswith("st_")}
        return types.SimpleNamespace(**{**seen, "st_dev": st.st_dev + 1})

    monkeypatch.setattr(_fs.DirHandle, "lstat", on_this_host)
    found, reads = scan_counting_reads(cache_root)
    assert reads == 0 and len(found.entries) == 3 and not found.problems


def test_a_manifest_changed_in_place_is_read_again_though_its_size_and_mtime_are_kept(
        cache_root, settled):
    entry = entries(cache_root, 1)[0]
    scan_counting_reads(cache_root)
    path = entry.path / manifests.MANIFEST_FILE
    before = path.stat()
    time.sleep(0.05)  # past a tick of a coarse filesystem clock (what SETTLE_NS is for)
    raw = path.read_bytes()
    assert b'"rows": 3' in raw
    with open(path, "r+b") as f:  # the same inode and size; a user can set the mtime back
        f.write(raw.replace(b'"rows": 3', b'"rows": 4'))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    found, read = scan_counting_reads(cache_root)
    assert read == 1 and "rows 4" in found.entries[0].problem


def test_a_manifest_changed_less_than_two_seconds_ago_is_read_every_time(cache_root):
    entries(cache_root, 2)
    reads = [scan_counting_reads(cache_root)[1] for _ in range(2)]
    assert reads == [2, 2]


def test_a_removed_entry_leaves_the_memo(cache_root, settled):
    made = entries(cache_root, 2)
    scan_counting_reads(cache_root)
    cachekit.Cache(cache_root).clear(made[0].key)
    found, read = scan_counting_reads(cache_root)
    assert read == 0 and [e.key for e in found.entries] == [made[1].key]
    memo = json.loads((cache_root / "locks" / listing_memo.file_name()).read_text())
    assert set(memo["entries"]) == {made[1].key}


def test_a_memo_made_without_signing_is_not_used_with_it(cache_root, settled, monkeypatch):
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    entries(cache_root, 2)
    assert all(e.problem is None for e in scan_counting_reads(cache_root)[0].entries)
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "team key")
    found, read = scan_counting_reads(cache_root)
    assert read == 2 and all("not signed" in e.problem for e in found.entries)


def test_a_tampered_memo_is_refused_under_signing(cache_root, settled, monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "team key")
    made = entries(cache_root, 1)[0]
    scan_counting_reads(cache_root)
    path = cache_root / "locks" / listing_memo.file_name()
    memo = json.loads(path.read_text())
    memo["entries"][made.key][1]["rows"] = 999
    path.write_text(json.dumps(memo))
    found, read = scan_counting_reads(cache_root)
    assert read == 1 and found.entries[0].rows == 3


def test_a_root_this_user_cannot_write_is_listed_without_a_memo(cache_root, settled):
    entries(cache_root, 1)
    locks = cache_root / "locks"
    with mock.patch.object(listing_memo.failures, "write", side_effect=PermissionError(13, "no")):
        found, read = scan_counting_reads(cache_root)
    assert read == 1 and found.entries[0].problem is None
    assert not (locks / listing_memo.file_name()).exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_symlink_or_fifo_in_place_of_the_memo_is_neither_followed_nor_waited_on(
        cache_root, tmp_path, settled, kind):
    entries(cache_root, 1)
    outside = tmp_path / "outside.json"
    outside.write_text('{"precious": true}')
    path = cache_root / "locks" / listing_memo.file_name()
    if kind == "symlink":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)
    found, read = scan_counting_reads(cache_root)
    assert read == 1 and found.entries[0].problem is None
    assert outside.read_text() == '{"precious": true}'
    assert path.is_file() and not path.is_symlink()  # replaced by a memo of this user's
    assert scan_counting_reads(cache_root)[1] == 0
