"""Cache.entries/clear/prune/verify and the scans under them, on real entries and real files;
dead and live builders are real processes."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import _fs, arrays, units
from cachekit.admin import inspect as maintenance, local_removal as removal
from cachekit.store import manifest as manifests
from cachekit.store import LocalStore
from helpers import GATED_ROWS, entry_disk_bytes, flip_a_byte, start_gated_builder
from cachekit.admin.integrity import verify
from cachekit.cli.main import main as cli_main
from cachekit.key_names import FORMAT_VERSION

DAY = 86400.0


def block(value: int) -> np.ndarray:
    """One 4x8 uint8 row per value: 32 bytes, so entry sizes are easy to reason about."""
    return np.full((4, 8), value % 256, dtype=np.uint8)


def block_entry(cache: cachekit.Cache, start: int, rows: int = 8) -> cachekit.Entry:
    return cache.map(block, pd.Series(range(start, start + rows)))


def let_go(cache: cachekit.Cache, start: int) -> tuple[str, Path]:
    """The key and directory of a new entry whose ``Entry`` this process let go: while
    one lives, its entry is in use, and ``prune`` and ``clear --older-than`` pass over it."""
    entry = block_entry(cache, start)
    return entry.key, entry.path


def set_last_used(entry_path: Path, when: float) -> None:
    os.utime(entry_path, (when, when))


# -- units ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("512", 512), ("512B", 512), ("10K", 10_000), ("10k", 10_000), ("10KiB", 10 * 1024),
    ("10KB", 10_000), ("1.5G", 1_500_000_000), ("1.2 GB", 1_200_000_000),
    ("2T", 2 * 10**12), ("512KiB", 512 * 1024), ("3 M", 3_000_000), (" 7mb ", 7_000_000),
    ("300M", 300_000_000), ("300MiB", 300 * 1024**2),
])
def test_parse_size(text, expected):
    assert units.parse_size(text) == expected


def test_a_negative_size_is_refused_in_words_of_its_own():
    with pytest.raises(ValueError, match="must not be negative: '-5G'"):
        units.parse_size("-5G")


@pytest.mark.parametrize("text", ["", "G", "10X", "10 GiBs", "1e3", "ten"])
def test_parse_size_rejects_garbage_with_an_example(text):
    with pytest.raises(ValueError, match="10G"):
        units.parse_size(text)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (999, "999 B"), (1000, "1.0 KB"), (1_234_567, "1.2 MB"),
    (45_600_000, "45.6 MB"), (345_000_000, "345 MB"), (1_200_000_000, "1.2 GB"),
    (999_999, "1.0 MB"), (5 * 10**15, "5.0 PB"),
])
def test_format_size(n, text):
    assert units.format_size(n) == text


def test_a_displayed_size_parses_back_to_about_the_same_bytes():
    for n in (1_234, 987_654_321, 12 * 10**12):
        assert abs(units.parse_size(units.format_size(n)) - n) <= n * 0.05


@pytest.mark.parametrize("text, seconds", [
    ("30", 30), ("30s", 30), ("5m", 300), ("2h", 7200), ("7d", 7 * DAY), ("1w", 7 * DAY),
    ("1.5h", 5400), ("1d12h", 1.5 * DAY), ("3 d", 3 * DAY), ("2W", 14 * DAY),
])
def test_parse_duration(text, seconds):
    assert units.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "7x", "7 days", "-1d", "1d-2h"])
def test_parse_duration_rejects_garbage(text):
    with pytest.raises(ValueError, match="7d"):
        units.parse_duration(text)


@pytest.mark.parametrize("age, text", [
    (0.2, "just now"), (42, "42 s ago"), (300, "5 min ago"), (3 * 3600 + 5, "3 h ago"),
    (3 * DAY + 100, "3 d ago"), (10 * DAY, "10 d ago"), (15 * DAY, "2 w ago"),
])
def test_format_age(age, text):
    assert units.format_age(age) == text


def test_durations_and_sizes_in_the_api_forms():
    assert units.seconds(datetime.timedelta(days=2)) == 2 * DAY
    assert units.seconds("2d") == units.seconds(2 * DAY) == 2 * DAY
    assert units.byte_count("1K") == units.byte_count(1000) == 1000
    assert units.byte_count("1KiB") == units.byte_count(1024) == 1024
    for bad in (True, None, [1]):
        with pytest.raises(TypeError):
            units.seconds(bad)
        with pytest.raises(TypeError):
            units.byte_count(bad)
    with pytest.raises(ValueError):
        units.seconds(-1)
    with pytest.raises(ValueError):
        units.byte_count(-1)


# -- entries -------------------------------------------------------------------------------

def test_entries_describe_images_and_map_entries(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root, progress=False)
    images = cache.images(pd.Series(cover_paths[:3], name="img_path"), (8, 6))
    mapped = block_entry(cache, 0, rows=5)
    found = {e.key: e for e in cache.entries()}
    assert set(found) == {images.key, mapped.key}
    info = found[images.key]
    assert isinstance(info, maintenance.EntryInfo)
    assert (info.kind, info.rows, info.shape, info.dtype) == ("images", 3, (3, 3, 8, 6), "uint8")
    assert info.column == "img_path" and info.params["size"] == [8, 6]
    assert info.path == images.path and info.problem is None and info.failed_rows == 0
    assert info.bytes == entry_disk_bytes(images.path)
    assert info.created == images.manifest["created"] and info.last_used >= info.created - 1
    assert found[mapped.key].shape == (5, 4, 8) and found[mapped.key].kind == "map"
    with pytest.raises(Exception):
        info.rows = 4  # frozen
    as_json = info.to_json()
    assert {"key", "kind", "rows", "shape", "dtype", "bytes", "created", "last_used",
            "path"} <= set(as_json) and as_json["shape"] == [3, 3, 8, 6]


def test_a_hit_records_its_use_without_a_lock(cache_root):
    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 0)
    set_last_used(entry.path, time.time() - 30 * DAY)
    assert time.time() - cache.entries()[0].last_used > 29 * DAY
    with mock.patch("cachekit.store.locks.make_lock", side_effect=AssertionError("locked")):
        assert block_entry(cache, 0).hit
    assert time.time() - cache.entries()[0].last_used < DAY


def test_a_hit_on_a_root_that_refuses_utime_still_serves(cache_root):
    cache = cachekit.Cache(cache_root)
    built = block_entry(cache, 0)
    with mock.patch("cachekit.store.local.os.utime", side_effect=PermissionError(13, "read-only")):
        again = block_entry(cache, 0)
    assert again.hit and np.array_equal(again.array, built.array)


def test_scan_lists_broken_entries_and_strays_instead_of_aborting(cache_root):
    cache = cachekit.Cache(cache_root)
    good, broken, empty = (block_entry(cache, i * 10) for i in range(3))
    (broken.path / manifests.MANIFEST_FILE).write_text("{not json")
    (empty.path / manifests.MANIFEST_FILE).unlink()
    (cache_root / "entries" / "notes.txt").write_text("hello")
    (cache_root / "tmp").mkdir(exist_ok=True)
    (cache_root / "tmp" / "random-dir").mkdir()
    found = maintenance.scan(LocalStore(cache_root))
    by_key = {e.key: e for e in found.entries}
    assert set(by_key) == {good.key, broken.key, empty.key}
    assert by_key[good.key].problem is None
    assert "unreadable manifest" in by_key[broken.key].problem and by_key[broken.key].rows is None
    assert "manifest.json is missing" in by_key[empty.key].problem
    stray = {p.path.name for p in found.problems if p.key is None}
    assert stray == {"notes.txt", "random-dir"}
    assert len(cache.entries()) == 3


def test_an_entry_that_is_a_symlink_is_a_problem_and_nothing_behind_it_is_counted(
        cache_root, tmp_path):
    cache = cachekit.Cache(cache_root)
    good = block_entry(cache, 0)
    outside = tmp_path / "outside"
    outside.mkdir()
    for item in good.path.iterdir():
        (outside / item.name).write_bytes(item.read_bytes())
    link = cache_root / "entries" / ("f" * 32)
    os.symlink(outside, link)
    found = maintenance.scan(LocalStore(cache_root))
    linked = next(e for e in found.entries if e.key == link.name)
    assert "never a symlink" in linked.problem and linked.rows is None
    assert linked.bytes == link.lstat().st_size < entry_disk_bytes(good.path)
    assert found.bytes == entry_disk_bytes(good.path) + link.lstat().st_size


def test_resolve_keys_by_unique_prefix():
    known = ["ab" + "0" * 30, "ab" + "1" * 30, "cd" + "2" * 30]
    assert maintenance.resolve_keys(["cd", "AB0"], known) == [known[2], known[0]]
    with pytest.raises(ValueError, match="ambiguous.*" + known[0] + ".*" + known[1]):
        maintenance.resolve_keys(["ab"], known)
    for bad in ("", "../ab", "ab/cd", "xyz", "a" * 33, ".."):
        with pytest.raises(ValueError, match="not a cache key"):
            maintenance.resolve_keys([bad], known)
    with pytest.raises(KeyError):
        maintenance.resolve_keys(["ef"], known)


# -- clear and prune -----------------------------------------------------------------------

def test_clear_by_prefix_then_all(cache_root):
    cache = cachekit.Cache(cache_root)
    a, b, c = (block_entry(cache, i * 10) for i in range(3))
    report = cache.clear([a.key[:6]])
    assert [e.key for e in report.removed_entries] == [a.key]
    assert report.freed_bytes == report.removed_entries[0].bytes > 0
    assert {e.key for e in cache.entries()} == {b.key, c.key}
    assert not a.path.exists()
    report = cache.clear()
    assert {e.key for e in report.removed_entries} == {b.key, c.key}
    assert cache.entries() == [] and list((cache_root / "tmp").iterdir()) == []
    with pytest.raises(cachekit.EntryNotFoundError) as gone:
        cache.clear([a.key])
    assert isinstance(gone.value, KeyError) and str(gone.value).startswith("no cache entry")
    for bad in ("zz", "xyz"):  # not hex: an argument error, as every one is
        with pytest.raises(cachekit.InvalidArgument, match="not a cache key"):
            cache.clear([bad])
        with pytest.raises(cachekit.InvalidArgument, match="not a cache key"):
            cache.verify([bad])


def test_clear_older_than_uses_last_use(cache_root):
    cache = cachekit.Cache(cache_root)
    (old, old_path), (fresh, _) = let_go(cache, 0), let_go(cache, 10)
    set_last_used(old_path, time.time() - 8 * DAY)
    assert cache.clear(older_than="9d").removed_entries == ()
    report = cache.clear(older_than=datetime.timedelta(days=7))
    assert [e.key for e in report.removed_entries] == [old]
    assert [e.key for e in cache.entries()] == [fresh]
    held = block_entry(cache, 10)  # a live Entry: in use, however old its last use
    set_last_used(held.path, time.time() - 8 * DAY)
    report = cache.clear(older_than="7d")
    assert report.removed_entries == () and [fresh] == [e.key for e in cache.entries()]
    assert [(s.key, s.reason) for s in report.skipped] == [(fresh, "in use by a live process")]


def test_a_plan_removes_nothing_until_executed(cache_root):
    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 0)
    store = LocalStore(cache_root)
    plan = removal.removal_for_clear(store)
    assert [e.key for e in plan.entries] == [entry.key] and plan.bytes > 0
    assert entry.path.exists()
    assert len(plan.execute().removed_entries) == 1 and not entry.path.exists()
    assert plan.execute().skipped[0].reason == "already removed by another process"


def test_an_entry_used_after_an_age_based_plan_is_spared(cache_root):
    cache = cachekit.Cache(cache_root)
    _, path = let_go(cache, 0)
    set_last_used(path, time.time() - 10 * DAY)
    plan = removal.removal_for_clear(LocalStore(cache_root), older_than=7 * DAY)
    assert len(plan.entries) == 1
    assert block_entry(cache, 0).hit  # a sweep agent uses it while the user reads the prompt
    report = plan.execute()
    assert report.removed_entries == () and "used since" in report.skipped[0].reason
    assert path.exists()


def test_an_entry_opened_after_a_prune_was_planned_is_spared_while_held(cache_root):
    """A prune plans while no process holds the entry; a call opens it (a live ``Entry``
    holds it) before the plan runs: the plan passes over it as in use, even though its
    last use is as old as planned. Once that Entry is let go, it goes."""
    cache = cachekit.Cache(cache_root)
    key, path = let_go(cache, 0)
    used = path.stat().st_mtime
    plan = removal.removal_for_prune(LocalStore(cache_root), 0)
    assert [e.key for e in plan.entries] == [key]
    entry = block_entry(cache, 0)
    assert entry.hit
    os.utime(path, (used, used))  # as if unused since: only the hold spares it
    report = plan.execute()
    assert report.removed_entries == ()
    assert [s.reason for s in report.skipped] == ["in use by a live process"]
    del entry
    assert [e.key for e in plan.execute().removed_entries] == [key]


def test_prune_removes_least_recently_used_first(cache_root):
    cache = cachekit.Cache(cache_root)
    (first, first_path), (second, second_path), (third, third_path) = (
        let_go(cache, i * 10) for i in range(3))
    now = time.time()
    set_last_used(first_path, now - 10)  # the oldest entry is the most recently used
    set_last_used(second_path, now - 300)
    set_last_used(third_path, now - 200)
    size = {e.key: e.bytes for e in cache.entries()}
    total = sum(size.values())
    assert cache.prune(total).removed_entries == ()
    report = cache.prune(total - 1)
    assert [e.key for e in report.removed_entries] == [second]
    report = cache.prune(str(size[first] + size[third] - 1))
    assert [e.key for e in report.removed_entries] == [third]
    assert [e.key for e in cache.entries()] == [first]
    assert [e.key for e in cache.prune(0).removed_entries] == [first]


def test_lock_files_left_behind_are_counted_and_removed_unless_held(cache_root, capsys):
    """An older cachekit kept one ``locks/KEY.lock`` per key ever built (a killed builder
    leaves one too). ``clear`` and ``prune`` count those of keys with nothing else left and
    remove them (a dry run does not), leaving one that a process holds."""
    import filelock

    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 0)
    layout = LocalStore(cache_root).layout
    left = ["%032x" % i for i in range(1, 4)]
    for key in [*left, entry.key]:  # the entry's own goes with it, uncounted
        layout.lock_path(key).touch()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead_owner = json.dumps({"host": _fs.host(), "pid": int(dead)})
    soft = layout.lock_path("%032x" % 4).with_suffix(".lock.soft")  # CACHEKIT_LOCK=soft's
    soft.write_text(dead_owner)
    holder = layout.lock_path("%032x" % 5).with_suffix(".lock.holder")  # an OS lock holder's
    holder.write_text(dead_owner)
    root = ["--root", str(cache_root)]
    assert cli_main([*root, "clear", "--all", "--dry-run"]) == 0
    assert "would remove 1 entry and 5 lock files" in capsys.readouterr().out
    assert all(layout.lock_path(k).exists() for k in [*left, entry.key]) and soft.exists()
    with filelock.FileLock(str(layout.lock_path(left[0]))):  # a process holds this one
        assert cli_main([*root, "clear", "--all", "--yes"]) == 0
    said = capsys.readouterr().out
    assert "removed 1 entry and 4 lock files" in said, said
    assert f"skipped the lock file of {left[0][:12]}: a build holds it" in said, said
    assert [p.name for p in layout.locks.glob("*.lock*")] == [f"{left[0]}.lock"]
    assert cli_main([*root, "prune", "--max-size", "1G", "--yes"]) == 0
    assert "removed 0 entries and 1 lock file" in capsys.readouterr().out
    assert list(layout.locks.glob("*.lock*")) == []


def test_a_mapped_reader_keeps_its_bytes_after_clear(cache_root):
    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 3, rows=50)
    expected = np.stack([block(v) for v in range(3, 53)])
    view = entry.array
    cache.clear()
    assert not entry.path.exists()
    np.testing.assert_array_equal(view, expected)


# -- builders: dead ones leave orphans, live ones are never touched --------------------------

def test_a_dead_builders_directory_is_reported_and_cleared(tmp_path, cache_root):
    proc, _ = start_gated_builder(tmp_path, cache_root, crash=True)
    proc.communicate(timeout=120)
    assert proc.returncode == 3
    store = LocalStore(cache_root)
    (temp,) = maintenance.scan(store).temp_dirs
    assert temp.state == maintenance.ORPHANED and temp.removable
    assert f"pid {proc.pid}" in temp.owner
    report = cachekit.Cache(cache_root).clear()
    assert [t.path for t in report.removed_temp_dirs] == [temp.path]
    assert list(store.layout.tmp.iterdir()) == []


def test_an_interrupted_removal_is_finished_by_clear(cache_root):
    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 0)
    dead_pid = 2**22 + 12345  # above Linux's pid_max limit: no such process
    leftover = cache_root / "tmp" / f"deleting.{entry.key}.{cachekit._fs.host()}.{dead_pid}.abc"
    (cache_root / "tmp").mkdir(exist_ok=True)
    os.rename(entry.path, leftover)
    (temp,) = maintenance.scan(LocalStore(cache_root)).temp_dirs
    assert temp.state == maintenance.LEFTOVER
    assert [t.path for t in cache.clear().removed_temp_dirs] == [leftover]
    assert not leftover.exists()


def test_clear_and_prune_skip_a_live_build_which_then_publishes(tmp_path, cache_root):
    cache = cachekit.Cache(cache_root)
    other, _ = let_go(cache, 100)
    proc, go = start_gated_builder(tmp_path, cache_root)
    try:
        store = LocalStore(cache_root)
        (temp,) = maintenance.scan(store).temp_dirs
        assert temp.state == maintenance.BUILDING and not temp.removable
        report = cache.prune(0)
        assert [e.key for e in report.removed_entries] == [other]
        assert [s.path for s in report.skipped] == [temp.path]
        report = cache.clear()
        assert report.removed_temp_dirs == () and "being built by pid" in report.skipped[0].reason
        assert temp.path.exists()
    finally:
        go.touch()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    key = out.strip()
    (info,) = cache.entries()
    assert info.key == key and info.rows == GATED_ROWS
    assert cache.verify() == []
    opened = manifests.read(info.path).files[0].open(info.path)
    np.testing.assert_array_equal(opened[:, 0], np.arange(GATED_ROWS))


# -- verify --------------------------------------------------------------------------------

def test_verify_passes_a_healthy_cache_and_finds_each_kind_of_damage(cache_root):
    cache = cachekit.Cache(cache_root)
    healthy, flipped, truncated, garbled, headed = (block_entry(cache, i * 10)
                                                    for i in range(5))
    assert cache.verify() == []
    flip_a_byte(flipped.path / manifests.DATA_FILE)
    with open(truncated.path / manifests.DATA_FILE, "r+b") as f:
        f.truncate(100)
    (garbled.path / manifests.MANIFEST_FILE).write_text(f'{{"format": {FORMAT_VERSION}}}')
    with open(headed.path / manifests.DATA_FILE, "r+b") as f:  # in the header's padding
        f.seek(120)
        f.write(b"\xff" * 8)
    problems = {p.key: p for p in cache.verify()}
    assert set(problems) == {flipped.key, truncated.key, garbled.key, headed.key}
    assert "checksum mismatch in data.npy" in problems[flipped.key].message
    assert problems[truncated.key].message.startswith("data.npy: ")
    assert "unreadable .npy header" in problems[truncated.key].message or \
        "expected" in problems[truncated.key].message
    header_problem = problems[headed.key].message  # one line that names the file, not 4 KiB
    assert header_problem.startswith("data.npy: unreadable .npy header (Cannot parse header")
    assert "\n" not in header_problem and len(header_problem) < 250, header_problem
    assert "'key' is missing" in problems[garbled.key].message
    assert problems[flipped.key].path == flipped.path
    assert cache.verify([healthy.key[:8]]) == []
    assert [p.key for p in cache.verify(flipped.key)] == [flipped.key]


def test_verify_counts_no_entry_of_another_cachekit_version_as_a_problem(cache_root, capsys):
    """It is not damaged, and this version never uses it: after an upgrade, verify passes
    on a root of healthy entries of the old format and says how many it left unchecked."""
    cache = cachekit.Cache(cache_root)
    flipped, older = block_entry(cache, 0), block_entry(cache, 10)
    path = older.path / manifests.MANIFEST_FILE
    raw = json.loads(path.read_text())
    os.chmod(path, 0o644)
    path.write_text(json.dumps({**raw, "format": FORMAT_VERSION - 1}))
    assert cache.verify() == []
    flip_a_byte(flipped.path / manifests.DATA_FILE)  # a problem all the same
    others: list = []
    assert [p.key for p in verify(LocalStore(cache_root), on_other=others.extend)] == [
        flipped.key]
    assert [e.key for e in others] == [older.key] and others[0].other_format
    capsys.readouterr()
    assert cli_main(["--root", str(cache_root), "verify", older.key[:12]]) == 0
    assert "1 entry of another cachekit version not checked" in capsys.readouterr().out
    assert cli_main(["--root", str(cache_root), "verify"]) == 1
    assert cli_main(["--root", str(cache_root), "ls"]) == 0
    assert (f"not used: format {FORMAT_VERSION - 1} is not {FORMAT_VERSION} (made by another "
            "cachekit version)") in capsys.readouterr().out


def test_verify_reports_progress_per_entry(cache_root):
    cache = cachekit.Cache(cache_root)
    entries = [block_entry(cache, i * 10) for i in range(2)]
    seen: list[int] = []
    assert verify(LocalStore(cache_root), on_bytes=seen.append) == []
    assert sorted(seen) == sorted(e.bytes for e in cache.entries()) and len(entries) == 2


def two_arrays(n: int):
    return np.arange(n, dtype=np.int32), np.ones((n, 3), dtype=np.float32)


def test_verify_checks_every_file_of_a_memoize_entry(cache_root):
    cache = cachekit.Cache(cache_root)
    first, second = cache.memoize(two_arrays)(50)
    (info,) = cache.entries()
    assert info.kind == "memoize" and cache.verify() == []
    leaf = info.path / manifests.file_name(1)
    flip_a_byte(leaf)
    (problem,) = cache.verify()
    assert problem.key == info.key and f"checksum mismatch in {leaf.name}" in problem.message


@pytest.mark.parametrize("reader", ["read_at", "read"])  # the listing's, the check's
def test_verify_reports_no_problem_for_an_entry_removed_and_built_again_as_it_reads(
        cache_root, monkeypatch, reader):
    """Another process clears the entry just as verify reads its manifest and builds it
    again before verify looks at what went wrong: the directory verify read is gone, the
    key's new one is whole, and neither is a problem (verify said "manifest.json is
    missing" for it, where only the existence of the key's directory was checked)."""
    cache = cachekit.Cache(cache_root)
    entry = block_entry(cache, 0)
    read, raced = getattr(manifests, reader), []

    def racing_read(*args, **kwargs):
        if raced:  # (the clear's and the build's own reads too)
            return read(*args, **kwargs)
        raced.append(None)
        raced[0] = cache.clear([entry.key]).removed_entries  # "another process"
        try:
            return read(*args, **kwargs)
        finally:
            block_entry(cache, 0)  # ... builds it again, before verify looks

    monkeypatch.setattr(manifests, reader, racing_read)
    assert verify(LocalStore(cache_root)) == []
    assert raced and [e.key for e in raced[0]] == [entry.key]
    monkeypatch.undo()
    assert [e.key for e in cache.entries()] == [entry.key] and cache.verify() == []
