"""A row is stored once per recipe on a root: an entry whose rows committed entries hold
links their data files and maps its rows (cachekit/obtain/parts.py), reads them through a
row view (cachekit/store/row_view.py), and clearing, pruning or a budget never breaks
another entry. File counts and inode link counts say what is stored, never timings.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from filelock import FileLock
from hypothesis import given, strategies as st

import cachekit
from cachekit import _fs, arrays, source_stats, units
from cachekit.admin.local_removal import removal_for_clear
from cachekit.cli.main import main as cli_main
from cachekit.store import LocalStore
from cachekit.store import manifest as manifests
from cachekit.store.remote import RemoteStore
from cachekit.store.row_index import RowIndex
from cachekit.store.row_view import RowView
from helpers import flip_a_byte, remote_object, write_pictures

N = 120


@pytest.fixture
def pictures(tmp_path: Path) -> list[str]:
    return write_pictures(tmp_path / "pictures", N)


def column(paths: list[str], rows) -> pd.Series:
    return pd.Series([paths[i] for i in rows], name="img_path")


def fresh(tmp_path: Path, col: pd.Series) -> np.ndarray:
    root = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}"
    entry = cachekit.Cache(root, workers=1, progress=False).images(col, 8)
    assert entry.contiguous and entry.rows_reused == 0
    return np.array(entry.array)


def data_files(entry: cachekit.Entry) -> dict[str, os.stat_result]:
    """The entry's data files (its own data.npy and its parts), by name, with their stat."""
    return {p.name: p.stat() for p in entry.path.iterdir()
            if p.name == manifests.DATA_FILE or manifests.is_part_name(p.name)}


def own_rows(entry: cachekit.Entry) -> int:
    """Rows of the entry's own data file; 0 when it has none (it decoded no row)."""
    own = entry.path / manifests.DATA_FILE
    return int(np.load(own, mmap_mode="r").shape[0]) if own.exists() else 0


# --- what a fold, an append and a retry store -----------------------------------------------


def test_folds_and_an_append_store_only_their_new_rows_and_link_the_full_entry(
        cache, pictures, tmp_path):
    full = cache.images(column(pictures, range(N)), 8)
    assert full.contiguous and isinstance(full.array, np.memmap)
    inode = (full.path / manifests.DATA_FILE).stat().st_ino
    inodes = {p.stat().st_ino for p in full.path.iterdir()}
    folds = [cache.images(column(pictures, [i for i in range(N) if i % 5 != k]), 8)
             for k in range(5)]
    for fold in folds:
        assert not fold.contiguous and isinstance(fold.array, RowView)
        assert (fold.rows_decoded, fold.rows_reused) == (0, len(fold))
        (part,) = data_files(fold).items()  # no data file of its own: it decoded no row
        assert {p.name for p in fold.path.iterdir() if p.stat().st_ino not in inodes} == {
            manifests.MANIFEST_FILE, manifests.ROW_MAP_FILE}  # its parts' copies say all
        assert {p.name for p in fold.path.iterdir() if p.stat().st_ino in inodes} == {
            part[0], *(manifests.sidecar_name(part[0], r) for r in manifests.SIDECARS)}
        assert part[1].st_ino == inode  # the full entry's data, ids and stats, linked
    assert (full.path / manifests.DATA_FILE).stat().st_nlink == 6  # the full entry + 5 folds
    extra = tmp_path / "extra.png"
    from PIL import Image
    Image.fromarray(np.full((10, 12, 3), 7, np.uint8)).save(extra)
    appended = cache.images(pd.Series([*pictures, str(extra)]), 8)
    assert (appended.rows_decoded, appended.rows_reused) == (1, N) and own_rows(appended) == 1
    np.testing.assert_array_equal(np.asarray(appended.array),
                                  fresh(tmp_path, pd.Series([*pictures, str(extra)])))
    np.testing.assert_array_equal(np.asarray(folds[2].array),
                                  np.asarray(full.array)[[i for i in range(N) if i % 5 != 2]])


def test_a_retry_after_one_bad_file_stores_only_that_row(cache_root, pictures, tmp_path,
                                                         capsys):
    cache = cachekit.Cache(cache_root, workers=2, executor="threads", progress=None)  # lines
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a picture")
    col = pd.Series([*pictures[:40], str(bad)])
    with pytest.raises(cachekit.ImageDecodeError):
        cache.images(col, 8)
    (kept,) = [e for e in cache.entries() if e.failed_build is not None]
    assert (f"kept the 40 rows that decoded (as {kept.key[:12]}); a later build of these rows "
            "reuses them and decodes only the rest") in " ".join(capsys.readouterr().err.split())
    kept_inode = (kept.path / manifests.DATA_FILE).stat().st_ino
    from PIL import Image
    Image.fromarray(np.full((10, 12, 3), 9, np.uint8)).save(bad)
    retry = cache.images(col, 8)
    assert (retry.rows_decoded, retry.rows_reused) == (1, 40) and own_rows(retry) == 1
    said = capsys.readouterr().err
    assert "cachekit images: filling 1 row\n" in said and "cachekit images: 1 row filled in" in said
    parts = [st for name, st in data_files(retry).items() if name != manifests.DATA_FILE]
    assert [st.st_ino for st in parts] == [kept_inode]
    assert parts[0].st_nlink == 1  # the kept rows' entry is gone; the retry holds its file
    np.testing.assert_array_equal(np.asarray(retry.array), fresh(tmp_path, col))


def test_a_derived_entry_of_a_derived_entry_links_the_same_files(cache, pictures, tmp_path):
    cache.images(column(pictures, range(0, 80)), 8)
    middle = cache.images(column(pictures, range(40, 120)), 8)  # 40 linked, 40 decoded
    assert (middle.rows_decoded, middle.rows_reused) == (40, 40)
    odd = cache.images(column(pictures, range(1, 120, 2)), 8)  # rows of both files
    assert odd.rows_decoded == 0 and own_rows(odd) == 0
    assert {st.st_ino for st in data_files(odd).values()} >= {
        st.st_ino for name, st in data_files(middle).items()}  # middle's own and its part
    np.testing.assert_array_equal(np.asarray(odd.array),
                                  fresh(tmp_path, column(pictures, range(1, 120, 2))))


def test_appends_past_the_bound_link_the_largest_parts_and_copy_the_others_rows(
        cache, pictures, tmp_path, monkeypatch):
    from cachekit.obtain import parts

    monkeypatch.setattr(parts, "LINKED_PARTS", 3)
    base = cache.images(column(pictures, range(100)), 8)
    base_inode = (base.path / manifests.DATA_FILE).stat().st_ino
    entries = []
    for end in range(101, 109):  # each append decodes its one new row
        entry = cache.images(column(pictures, range(end)), 8)
        assert (entry.rows_decoded, entry.rows_reused) == (1, end - 1)
        files = data_files(entry)
        parts_linked = [name for name in files if name != manifests.DATA_FILE]
        assert 1 <= len(parts_linked) <= 3  # never more than the bound
        assert base_inode in {files[name].st_ino for name in parts_linked}  # the largest
        # what it holds itself: its new row, and the rows of the parts it did not link
        assert own_rows(entry) == end - sum(
            np.load(entry.path / name, mmap_mode="r").shape[0] for name in parts_linked)
        entries.append(entry)
    assert max(own_rows(entry) for entry in entries) > 1  # (some compacted)
    for entry in entries:  # every entry reads its rows, its dropped parts' included
        np.testing.assert_array_equal(np.asarray(entry.array),
                                      fresh(tmp_path, column(pictures, range(len(entry)))))
    assert cache.verify() == []
    assert cache.images(column(pictures, range(108)), 8).outcome == "hit"


def test_a_fold_that_decoded_nothing_lends_its_rows_once_the_full_entry_is_gone(
        cache, pictures, tmp_path):
    """It lists no row files of its own: its parts' copies name its rows to later builds.
    Nor does it make an index file: it is indexed by a link to its row map."""
    full = cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, N, 2)), 8)
    assert own_rows(fold) == 0 and not (fold.path / manifests.ROW_IDS_FILE).exists()
    [indexed] = (cache.root / "index").glob(f"*/{fold.key}.npy")
    assert os.path.samefile(indexed, fold.path / manifests.ROW_MAP_FILE)
    assert len(cache.clear(full.key).removed) == 1
    again = cache.images(column(pictures, range(0, N, 4)), 8)
    assert (again.rows_decoded, again.rows_reused) == (0, len(again))
    np.testing.assert_array_equal(np.asarray(again.array),
                                  fresh(tmp_path, column(pictures, range(0, N, 4))))


def test_a_fold_whose_row_map_cannot_be_linked_into_the_index_writes_an_index_file(
        cache, pictures, tmp_path, monkeypatch):
    """A filesystem without links (or an index folder elsewhere): the fold still lends."""
    full = cache.images(column(pictures, range(N)), 8)
    monkeypatch.setattr(RowIndex, "link", lambda self, recipe, key: False)
    fold = cache.images(column(pictures, range(0, N, 2)), 8)
    [indexed] = (cache.root / "index").glob(f"*/{fold.key}.npy")
    assert not os.path.samefile(indexed, fold.path / manifests.ROW_MAP_FILE)
    assert len(cache.clear(full.key).removed) == 1
    again = cache.images(column(pictures, range(0, N, 4)), 8)
    assert (again.rows_decoded, again.rows_reused) == (0, len(again))


def test_a_fold_of_committed_rows_neither_takes_nor_waits_for_its_keys_build_lock(
        cache_root, pictures, tmp_path):
    """Linking committed rows takes milliseconds, so that build goes without the key's lock
    (a race is settled by the first commit) and leaves no lock file; a fold with one row to
    decode still waits for the lock's holder."""
    cache = cachekit.Cache(cache_root, workers=1, progress=False, lock_timeout=0.5)
    layout = LocalStore(cache_root).layout
    cache.images(column(pictures, range(N - 1)), 8)
    even, odd = column(pictures, range(0, N - 1, 2)), column(pictures, range(1, N, 2))
    fold = cache.images(even, 8)
    assert fold.rows_decoded == 0 and not layout.lock_path(fold.key).exists()
    cache.clear(fold.key)
    odd_key = cachekit.Cache(tmp_path / "elsewhere", workers=1, progress=False).images(
        odd, 8).key
    with FileLock(str(layout.lock_path(fold.key))), FileLock(str(layout.lock_path(odd_key))):
        again = cache.images(even, 8)
        assert (again.key, again.outcome, again.rows_decoded) == (fold.key, "built", 0)
        with pytest.raises(cachekit.LockTimeout):
            cache.images(odd, 8)  # its last row is in no entry
    np.testing.assert_array_equal(np.asarray(again.array), fresh(tmp_path, even))


def test_a_union_of_more_entries_than_it_links_waits_for_its_keys_build_lock(
        cache_root, pictures, tmp_path, monkeypatch):
    """Every row is committed, but in 40 files: the rows of those it does not link are
    copied, which may take as long as a build, so it is built under the key's lock, from
    the donors found before it (the entries are looked up once)."""
    from cachekit.obtain import donors

    cache = cachekit.Cache(cache_root, workers=1, progress=False, lock_timeout=0.5)
    for start in range(0, 80, 2):
        cache.images(column(pictures, range(start, start + 2)), 8)
    union = column(pictures, range(80))
    key = cachekit.Cache(tmp_path / "elsewhere", workers=1, progress=False).images(
        union, 8).key
    with FileLock(str(LocalStore(cache_root).layout.lock_path(key))):
        with pytest.raises(cachekit.LockTimeout):
            cache.images(union, 8)
    finds = []
    find = donors.find
    monkeypatch.setattr(donors, "find", lambda *a, **k: (finds.append(1), find(*a, **k))[1])
    built = cache.images(union, 8)
    assert (built.key, built.rows_decoded, built.rows_reused) == (key, 0, 80)
    assert len(finds) == 1


def test_a_call_whose_build_cannot_start_keeps_nothing_open(cache_root, pictures,
                                                             monkeypatch):
    """A fold whose rows are all committed opens their entries before it builds, and a
    contiguous copy asked of a derived entry sets that entry aside (open) first; when the
    build cannot even start (a full disk, say), the call raises and lets go of both: a
    sweep agent that retries such calls runs out of no file descriptor."""
    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    cache.images(column(pictures, range(N)), 8)
    fold = column(pictures, range(0, N, 3))
    assert not cache.images(fold, 8).contiguous
    cache.clear(cache.images(fold, 8).key)
    import cachekit.obtain.miss as miss

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    for contiguous, setup in ((False, lambda: None), (True, lambda: cache.images(fold, 8))):
        setup()
        monkeypatch.setattr(miss, "build_and_commit", no_space)
        before = open_fds()
        for _ in range(2):
            with pytest.raises(OSError, match="No space"):
                cache.images(fold, 8, contiguous=contiguous)
        assert open_fds() <= before, contiguous
        monkeypatch.undo()


def test_a_call_that_waits_for_the_build_lock_stats_no_file_before(
        cache_root, pictures, monkeypatch):
    """Agents waiting for one build do not each stat its files first (130,000 of them on a
    shared filesystem): only the rows' identities are looked up before the lock."""
    cache = cachekit.Cache(cache_root, workers=1, progress=False, lock_timeout=0.5)
    cache.images(column(pictures, range(N // 2)), 8)
    stated, here = [], threading.get_ident()  # (not a check of an earlier call's, behind)
    for name in ("file_stats", "stat_signature"):
        real = getattr(source_stats, name)

        def counted(*a, real=real, **k):
            if threading.get_ident() == here:
                stated.append(a)
            return real(*a, **k)

        monkeypatch.setattr(source_stats, name, counted)
    wanted = column(pictures, range(N))
    key = cachekit.Cache(cache_root.parent / "elsewhere", workers=1, progress=False).images(
        wanted, 8).key
    stated.clear()
    with FileLock(str(LocalStore(cache_root).layout.lock_path(key))):
        with pytest.raises(cachekit.LockTimeout):
            cache.images(wanted, 8)
    assert stated == []


def test_a_healed_stale_entry_stores_only_its_changed_rows(cache, pictures, tmp_path):
    import warnings

    from cachekit.obtain import staleness

    col = column(pictures, range(N))
    first = cache.images(col, 8)
    inode = (first.path / manifests.DATA_FILE).stat().st_ino
    from PIL import Image
    Image.fromarray(np.full((10, 12, 3), 200, np.uint8)).save(pictures[7])  # rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.images(col, 8).hit  # its check finds the file changed
        staleness.wait_for_checks(timeout=60)
    healed = cache.images(col, 8)
    assert (healed.outcome, healed.rows_decoded, healed.rows_reused) == ("built", 1, N - 1)
    assert own_rows(healed) == 1 and not healed.contiguous
    parts = [st for name, st in data_files(healed).items() if name != manifests.DATA_FILE]
    assert [st.st_ino for st in parts] == [inode] and parts[0].st_nlink == 1
    assert not list((cache.root / "tmp").iterdir())  # the entry set aside is gone
    np.testing.assert_array_equal(np.asarray(healed.array), fresh(tmp_path, col))


@given(st.lists(st.integers(1, 10_000), max_size=80), st.integers(0, 40))
def test_a_build_keeps_at_most_the_bound_and_drops_the_parts_that_hold_fewest(held, keep):
    from cachekit.obtain.offers import parts_to_keep

    held = np.array(held, dtype=np.int64)
    kept = parts_to_keep(held, keep)
    assert list(kept) == sorted(set(kept.tolist())) and len(kept) <= max(keep, 0)
    if len(held) <= keep:
        assert len(kept) == len(held)
    elif keep:
        assert len(kept) >= 1 and held.max() in held[kept]
        dropped = np.setdiff1d(np.arange(len(held)), kept)
        assert held[dropped].max() <= held[kept].min()


def test_appends_without_end_copy_each_row_a_few_times_not_once_per_append():
    from cachekit.obtain.offers import parts_to_keep

    def copies(keep_parts) -> int:
        """Rows copied by 10,000 one-row appends to a column of 1,000 rows, each append
        linking the files of the one before."""
        parts, own, copied = [1000], 0, 0  # the rows each part holds; the last build's own
        for _ in range(10_000):
            held = np.array(parts + [own] if own else parts)
            kept = keep_parts(held, 32)
            dropped = np.setdiff1d(np.arange(len(held)), kept)
            copied += int(held[dropped].sum())
            parts, own = held[kept].tolist(), 1 + int(held[dropped].sum())
            assert len(parts) <= 32
        return copied

    assert copies(parts_to_keep) < 30_000  # the figures docs/incremental.md gives
    assert copies(lambda held, keep: np.sort(np.argsort(-held, kind="stable")[:keep])) > 1.5e6


UNION_UNDER_A_FILE_LIMIT = """
import json, os, resource, sys
import pandas as pd
import cachekit

root, paths, contiguous = sys.argv[1], json.loads(sys.argv[2]), sys.argv[4] == "1"
cache = cachekit.Cache(root, workers=1, executor="threads")  # (saying what it does)
spare = int(sys.argv[3])  # files it may open beyond those it has open now
limit = len(os.listdir("/proc/self/fd")) + spare
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
entry = cache.images(pd.Series(paths, name="img_path"), 8, contiguous=contiguous)
print(json.dumps([entry.key, entry.rows_decoded, entry.rows_reused]))
"""


@pytest.mark.parametrize("contiguous", [False, True], ids=["linked", "contiguous"])
def test_a_build_that_shares_rows_with_more_entries_than_it_may_open_files_copies_them(
        cache, cache_root, pictures, tmp_path, contiguous):
    """The union of 55 entries of two rows and 10 new rows, in a process that may open 40
    more files: it holds no entry open while it finds them, and opens their files one at
    a time beyond the few it links (or, for a contiguous entry, the few it copies from
    last), so it shares every row they hold and decodes only the new ones."""
    for start in range(0, N - 10, 2):
        cache.images(column(pictures, range(start, start + 2)), 8)
    run = subprocess.run([sys.executable, "-c", UNION_UNDER_A_FILE_LIMIT, str(cache_root),
                          json.dumps(pictures), "40", str(int(contiguous))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    key, decoded, reused = json.loads(run.stdout)
    assert (decoded, reused) == (10, N - 10), run.stderr
    said = " ".join(run.stderr.split())
    assert "could not open" not in said and ("copying 110 rows from 55 entries" in said
                                             if contiguous else
                                             "links 1 of them and copies the rows of the "
                                             "other 54" in said), said
    union = cache.images(column(pictures, range(N)), 8)
    assert union.key == key and union.outcome == "hit" and union.contiguous == contiguous
    parts_linked = [name for name in data_files(union) if name != manifests.DATA_FILE]
    assert len(parts_linked) == (0 if contiguous else 1)
    assert own_rows(union) == (N if contiguous else N - 2)
    assert not any(".npy." in p.name for p in union.path.iterdir())  # (nothing left over)
    np.testing.assert_array_equal(np.asarray(union.array),
                                  fresh(tmp_path, column(pictures, range(N))))
    assert cache.verify() == []


def test_the_rows_a_build_copies_are_written_once_beside_the_rows_it_decodes(
        cache, cache_root, pictures, tmp_path, monkeypatch, capsys):
    """The file it copies rows into has a slot for each row of its own data file, and
    becomes that file once the decoded rows are copied in: no second copy of the rows. A
    bar shows the copy, as it shows a fill."""
    from cachekit import arrays

    for start in range(0, 80, 2):  # 40 entries: more than it links
        cache.images(column(pictures, range(start, start + 2)), 8)
    made = []
    create_array = arrays.create_array
    monkeypatch.setattr(arrays, "create_array", lambda directory, name, shape, *a, **k: (
        made.append((name, shape[0])), create_array(directory, name, shape, *a, **k))[1])
    capsys.readouterr()
    union = cachekit.Cache(cache_root, workers=1, progress=True).images(
        column(pictures, range(90)), 8)
    assert (union.rows_decoded, union.rows_reused) == (10, 80)
    assert "cachekit copying shared rows: 100%" in capsys.readouterr().err
    # (one two-row part linked; the other 78 rows copied, the 10 decoded)
    assert sorted(made) == [(manifests.DATA_FILE, 10), ("data.npy.copies", 88)]
    assert own_rows(union) == 88 and len(data_files(union)) == 2
    np.testing.assert_array_equal(np.asarray(union.array),
                                  fresh(tmp_path, column(pictures, range(90))))


# --- the row view ---------------------------------------------------------------------------


@pytest.mark.parametrize("new", [0, 6], ids=["rows in one file", "rows in two files"])
def test_the_row_view_indexes_like_the_contiguous_array(cache, pictures, tmp_path, new):
    full = cache.images(column(pictures, range(N - new)), 8)
    rows = list(range(N - 1, -1, -3))  # reversed, every third
    view = cache.images(column(pictures, rows), 8)
    assert not view.contiguous and view.rows_decoded == len([r for r in rows if r >= N - new])
    a, b = view.array, fresh(tmp_path, column(pictures, rows))
    assert (len(a), a.shape, a.dtype, a.ndim) == (len(b), b.shape, b.dtype, b.ndim)
    mask = np.arange(len(b)) % 3 == 1
    for index in (0, -1, 7, slice(None), slice(3, None, 4), slice(-5, None), mask,
                  np.array([5, 0, 5, -2]), [1, 2], (3, 1), (slice(0, 4), 0, 2), (mask, 2)):
        np.testing.assert_array_equal(a[index], b[index], err_msg=repr(index))
    np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(np.stack(list(a)), b)
    for bad in (len(b), -len(b) - 1, [0, len(b)]):
        with pytest.raises(IndexError):
            a[bad]
    with pytest.raises(IndexError):
        a[np.ones(3, dtype=bool)]
    for read_only in (a, full.array):  # the same error for either kind of entry
        with pytest.raises(ValueError, match="assignment destination is read-only"):
            read_only[0] = 0
    np.testing.assert_array_equal(view.tensor().numpy(), b)
    loader = __import__("torch").utils.data.DataLoader(view.dataset(targets=np.arange(len(b))),
                                                       batch_size=7, shuffle=True)
    for batch, targets in loader:
        np.testing.assert_array_equal(batch.numpy(), b[targets.numpy()])


def test_contiguous_true_copies_a_derived_entry_into_one_file(cache, pictures, tmp_path):
    cache.images(column(pictures, range(N)), 8)
    col = column(pictures, range(0, N, 2))
    derived = cache.images(col, 8)
    assert not derived.contiguous
    again = cache.images(col, 8, contiguous=True)
    assert again.contiguous and isinstance(again.array, np.memmap) and again.rows_decoded == 0
    assert own_rows(again) == len(col) and len(data_files(again)) == 1
    np.testing.assert_array_equal(np.asarray(again.array), fresh(tmp_path, col))
    assert cache.images(col, 8).contiguous  # the key's entry is the contiguous one now
    fold = column(pictures, range(1, N, 2))
    assert cli_main(["--root", str(cache.root), "build", _csv(tmp_path, fold), "--column",
                     "img_path", "--size", "8", "--contiguous"]) == 0
    assert cache.images(fold, 8).contiguous


def test_cli_build_of_a_derived_entry_says_how_much_of_it_is_shared(cache, pictures,
                                                                    tmp_path, capsys):
    cache.images(column(pictures, range(N)), 8)
    assert cli_main(["--root", str(cache.root), "build", _csv(tmp_path, column(
        pictures, range(0, N, 2))), "--column", "img_path", "--size", "8"]) == 0
    [derived] = [e for e in cache.entries() if e.rows == N // 2]
    assert derived.shared_bytes > derived.own_bytes > 0
    assert (f"built: {N // 2} rows {N // 2}x3x8x8 uint8, {units.format_size(derived.bytes)} "
            f"({units.format_size(derived.shared_bytes)} of it shared with other entries)\n"
            ) in capsys.readouterr().err


def test_a_dataset_opened_before_its_key_was_made_contiguous_reads_the_new_files(
        cache, pictures, tmp_path):
    import pickle

    cache.images(column(pictures, range(N)), 8)
    col = column(pictures, range(0, N, 2))
    derived = cache.images(col, 8)
    shipped = pickle.dumps(derived.dataset())  # as a DataLoader ships it to its workers
    cache.images(col, 8, contiguous=True)  # the derived entry's files are gone now
    dataset = pickle.loads(shipped)
    expected = fresh(tmp_path, col)
    for i in (0, len(col) - 1):
        np.testing.assert_array_equal(dataset[i].numpy(), expected[i])


def _csv(tmp_path: Path, col: pd.Series) -> str:
    path = tmp_path / "fold.csv"
    col.to_frame().to_csv(path, index=False)
    return str(path)


def test_when_links_fail_the_rows_are_copied_and_the_call_succeeds(
        cache, pictures, tmp_path, monkeypatch):
    full = cache.images(column(pictures, range(N)), 8)
    monkeypatch.setattr(_fs.DirHandle, "link_open_file", lambda self, f, name: False)
    fold = cache.images(column(pictures, range(10, 60)), 8)
    assert fold.contiguous and fold.rows_decoded == 0 and own_rows(fold) == 50
    assert (full.path / manifests.DATA_FILE).stat().st_nlink == 1
    np.testing.assert_array_equal(np.asarray(fold.array),
                                  fresh(tmp_path, column(pictures, range(10, 60))))


# --- a map that lies ------------------------------------------------------------------------


def _replant_map(entry: cachekit.Entry, where: np.ndarray) -> None:
    """Write ``where`` as the entry's row map with a manifest that agrees with it (size,
    checksum): only the bounds check can tell it is wrong."""
    from cachekit import arrays

    path = entry.path / manifests.ROW_MAP_FILE
    os.chmod(path, 0o644)
    np.save(path, np.ascontiguousarray(where, dtype="<u4"))
    size, checksum = arrays.checksum(path)
    raw = json.loads((entry.path / manifests.MANIFEST_FILE).read_text())
    next(f for f in raw["files"] if f["name"] == manifests.ROW_MAP_FILE).update(
        bytes=size, checksum=checksum)
    manifest = manifests.Manifest.from_json(raw, entry.path)
    (entry.path / manifests.MANIFEST_FILE).write_bytes(manifests.dumps(manifest))


@pytest.mark.parametrize("lie", ["row past its file", "file past the parts"])
def test_a_map_pointing_outside_its_files_is_corrupt_never_wrong_pixels(cache, pictures, lie):
    cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, 30)), 8)
    where = np.array(np.load(fold.path / manifests.ROW_MAP_FILE))
    where[5] = (1, N) if lie == "row past its file" else (2, 0)
    _replant_map(fold, where)
    with pytest.raises(cachekit.CacheCorruptError, match="outside"):
        cachekit.Entry(fold.path, manifests.read(fold.path), source="local")
    with pytest.raises(cachekit.CacheCorruptError, match="clear"):  # the call says the fix
        cache.images(column(pictures, range(0, 30)), 8)


def test_a_derived_entry_whose_row_map_is_gone_is_corrupt_to_a_dataset_never_an_os_error(
        cache, pictures):
    """A dataset that opens its entry by path (unpickled as a Dask task gets it) finds a
    map deleted (or an entry removed) as a CacheCorruptError, as a removed contiguous entry
    is (a Dataset then says the entry was removed, when its folder is gone). The Entry
    that keeps the files open reads on."""
    cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, 30)), 8)
    dataset = fold.dataset()
    elsewhere = pickle.loads(pickle.dumps(dataset))
    (fold.path / manifests.ROW_MAP_FILE).unlink()
    with pytest.raises(cachekit.CacheCorruptError, match="row map is missing"):
        elsewhere[0]
    np.testing.assert_array_equal(dataset[0].numpy(), fold.array[0])


def test_a_hit_of_a_derived_entry_reads_its_row_map_once_and_a_new_map_again(
        cache, pictures, monkeypatch):
    """The open and the stale-file check both need the map (8 bytes a row): it is read and
    checked once while the file and its record stay the same."""
    from cachekit.store import row_view

    monkeypatch.setenv("CACHEKIT_STALE_CHECK", "sample")
    cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, N, 2)), 8)
    reads = []
    real = arrays.read_small_at
    monkeypatch.setattr(arrays, "read_small_at", lambda fd, path, *rest: (
        reads.append(path.name), real(fd, path, *rest))[1])
    row_view._kept_maps.clear()
    for _ in range(2):
        hit = cache.images(column(pictures, range(0, N, 2)), 8)
        assert hit.outcome == "hit"
    assert reads.count(manifests.ROW_MAP_FILE) == 1
    time.sleep(0.01)
    _replant_map(fold, np.array(np.load(fold.path / manifests.ROW_MAP_FILE)))  # rewritten
    again = cache.images(column(pictures, range(0, N, 2)), 8)
    assert reads.count(manifests.ROW_MAP_FILE) == 2
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(hit.array))


def test_a_part_without_its_row_files_is_corrupt(cache, pictures):
    cache.images(column(pictures, range(N - 1)), 8)
    fold = cache.images(column(pictures, range(N - 30, N)), 8)  # one row of its own
    assert own_rows(fold) == 1
    raw = json.loads((fold.path / manifests.MANIFEST_FILE).read_text())
    raw["files"] = [f for f in raw["files"] if not f["name"].endswith(".stats.npy")]
    with pytest.raises(cachekit.CacheCorruptError, match="missing or extra"):
        manifests.Manifest.from_json(raw, fold.path)


def test_an_entry_that_decoded_none_of_its_rows_lists_no_row_file_of_its_own(cache, pictures):
    """Nor a data file: its row map comes first. Its parts' copies describe every row; a
    row file of its own would describe none."""
    full = cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, 30)), 8)
    assert own_rows(fold) == 0
    raw = json.loads((fold.path / manifests.MANIFEST_FILE).read_text())
    ids = next(f for f in full.manifest["files"] if f["name"] == manifests.ROW_IDS_FILE)
    listed = [dict(f) for f in raw["files"]]
    assert raw["files"][0]["name"] == manifests.ROW_MAP_FILE
    raw["files"].insert(0, {**ids, "shape": [0, 2]})  # (row files come before the map)
    with pytest.raises(cachekit.CacheCorruptError, match="file 0 must be named 'data.npy'"):
        manifests.Manifest.from_json(raw, fold.path)
    stats = next(f for f in listed if f["name"].endswith(".stats.npy"))
    stats["shape"] = [7, 2]  # the copies are checked all the same
    with pytest.raises(cachekit.CacheCorruptError, match="not of its rows"):
        manifests.Manifest.from_json({**raw, "files": listed}, fold.path)


def test_a_part_not_named_by_its_checksum_is_corrupt(cache, pictures):
    cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, 30)), 8)
    raw = json.loads((fold.path / manifests.MANIFEST_FILE).read_text())
    part = next(f for f in raw["files"] if manifests.is_part_name(f["name"]))
    part["checksum"] = "blake2b-128:" + "0" * 32
    with pytest.raises(cachekit.CacheCorruptError, match="named by its checksum"):
        manifests.Manifest.from_json(raw, fold.path)


# --- accounting: ls, verify, the budget -----------------------------------------------------


def root_file_bytes(root: Path) -> int:
    """Bytes of every file of the root but the lock files and hold records, each file once
    (as ``du``)."""
    unique = {}
    for path in root.rglob("*"):
        if path.is_file() and path.parent.name not in ("locks", "holds"):
            st = path.lstat()
            unique[(st.st_dev, st.st_ino)] = st.st_size
    return sum(unique.values())


def test_ls_shows_own_and_shared_bytes_and_its_total_is_the_disk_use(
        cache, pictures, capsys):
    full = cache.images(column(pictures, range(N)), 8)
    folds = [cache.images(column(pictures, range(k, N, 3)), 8) for k in range(3)]
    listed = {e.key: e for e in cache.entries()}
    data = sum((full.path / name).stat().st_size  # the data and the row files it describe
               for name in (manifests.DATA_FILE, manifests.ROW_IDS_FILE,
                            manifests.ROW_STATS_FILE))
    assert not any((fold.path / manifests.DATA_FILE).exists() for fold in folds)
    assert listed[full.key].shared_bytes == data
    for fold in folds:
        assert listed[fold.key].shared_bytes == data
        assert listed[fold.key].own_bytes < data / 4
    assert list((cache.root / "index").rglob("*.npy"))  # counted too: every file of the root
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "ls", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert sum(e["own_bytes"] for e in shown) + data == root_file_bytes(cache.root)
    assert cli_main(["--root", str(cache.root), "ls"]) == 0
    assert f"{units.format_size(root_file_bytes(cache.root))} on disk" in capsys.readouterr().out
    assert cli_main(["--root", str(cache.root), "verify"]) == 0


def test_verify_of_one_entry_names_every_entry_that_links_its_damaged_file_and_clearing_them_heals(
        cache, pictures, capsys):
    """Following verify's word must mend the root: an entry left that links a damaged file
    would lend its rows to the rebuild of the entries cleared, damage and all."""
    full = cache.images(column(pictures, range(N)), 8)
    expected = np.asarray(full.array)[::2].copy()
    folds = [cache.images(column(pictures, range(k, N, 2)), 8) for k in range(2)]
    apart = cache.images(column(pictures, range(N)), 4)  # another recipe: no file in common
    flip_a_byte(full.path / manifests.DATA_FILE, 300)  # in row 118
    broken = {full.key, *(fold.key for fold in folds)}
    assert {p.key for p in cache.verify([folds[0].key])} == broken
    assert {p.key for p in cache.verify()} == broken
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "verify", folds[0].key[:12]]) == 1
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("3 problems in 3 entries; remove them all with `cachekit clear ")
    named = said.split("`")[1].split()[2:]
    assert sorted(named) == sorted(key[:12] for key in broken)
    assert cli_main(["--root", str(cache.root), "clear", "--yes", *named]) == 0
    assert [e.key for e in cache.entries()] == [apart.key]
    again = cachekit.Cache(cache.root, workers=1, progress=False).images(
        column(pictures, range(0, N, 2)), 8)
    assert again.rows_decoded == N // 2
    np.testing.assert_array_equal(np.asarray(again.array), expected)
    assert cache.verify() == []


DAMAGED = "differs from its checksum"


def test_a_contiguous_copy_never_copies_a_damaged_donors_rows(cache, pictures, tmp_path):
    """A copy's checksum would cover the damage, and verify would never see it again: the
    rows of a donor file that fails its checksum are decoded, and the call says why."""
    full = cache.images(column(pictures, range(N)), 8)
    flip_a_byte(full.path / manifests.DATA_FILE, 300)  # in row 118
    fold = column(pictures, range(0, N, 2))
    with pytest.warns(RuntimeWarning, match=DAMAGED) as said:
        copy = cache.images(fold, 8, contiguous=True)
    assert f"`cachekit verify {full.key[:12]}`" in str(said[0].message)
    assert copy.contiguous and (copy.rows_decoded, copy.rows_reused) == (N // 2, 0)
    np.testing.assert_array_equal(np.asarray(copy.array), fresh(tmp_path, fold))
    assert [p.key for p in cache.verify()] == [full.key]


def test_rows_copied_past_the_link_bound_never_come_from_a_damaged_file(
        cache, pictures, tmp_path, monkeypatch):
    from cachekit.obtain import parts

    monkeypatch.setattr(parts, "LINKED_PARTS", 1)
    big = cache.images(column(pictures, range(80)), 8)  # linked: it lends the most rows
    small = cache.images(column(pictures, range(80, N)), 8)  # copied
    flip_a_byte(small.path / manifests.DATA_FILE, 300)
    union = column(pictures, range(N))
    with pytest.warns(RuntimeWarning, match=DAMAGED):
        entry = cache.images(union, 8)
    assert (entry.rows_decoded, entry.rows_reused) == (N - 80, 80)
    assert [name for name in data_files(entry) if name != manifests.DATA_FILE] == [
        manifests.part_name(big.manifest["files"][0]["checksum"])]
    np.testing.assert_array_equal(np.asarray(entry.array), fresh(tmp_path, union))
    assert [p.key for p in cache.verify()] == [small.key]


def test_a_damaged_file_linked_before_a_link_failed_lends_no_rows_to_the_copy(
        cache, pictures, tmp_path, monkeypatch):
    """Linking stops at the first file that cannot be linked (another user's, say), and
    the rows of every part are then copied, those of the parts linked before too."""
    first = cache.images(column(pictures, range(70)), 8)  # taken first: it lends the most
    cache.images(column(pictures, range(70, N)), 8)
    flip_a_byte(first.path / manifests.DATA_FILE, 300)
    links = []

    def second_link_fails(self, f, name):
        links.append(name)
        return len(links) == 1 and real(self, f, name)

    real = _fs.DirHandle.link_open_file
    monkeypatch.setattr(_fs.DirHandle, "link_open_file", second_link_fails)
    union = column(pictures, range(N))
    with pytest.warns(RuntimeWarning, match=DAMAGED):
        entry = cache.images(union, 8)
    assert len(links) >= 2 and (entry.rows_decoded, entry.rows_reused) == (70, N - 70)
    assert entry.contiguous and not [name for name in os.listdir(entry.path)
                                     if manifests.is_part_name(name)]  # nothing left linked
    np.testing.assert_array_equal(np.asarray(entry.array), fresh(tmp_path, union))


def test_the_index_file_of_an_entry_removed_outside_cachekit_is_counted_and_pruned(
        cache, pictures, capsys):
    full = cache.images(column(pictures, range(N)), 8)
    fold = cache.images(column(pictures, range(0, N, 2)), 8)
    expected = np.asarray(full.array)[::2].copy()
    shutil.rmtree(full.path)  # as `rm -rf` does: its row index file names nothing now
    stray = list((cache.root / "index").rglob(f"{full.key}.npy"))
    assert len(stray) == 1
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "ls"]) == 0
    out, err = capsys.readouterr()
    assert f"{units.format_size(root_file_bytes(cache.root))} on disk" in out
    assert "1 row index file of entries removed outside cachekit" in err
    assert cli_main(["--root", str(cache.root), "prune", "--max-size", "1G", "--yes"]) == 0
    assert "removed 0 entries and 1 stray index file" in capsys.readouterr().out
    assert not stray[0].exists()
    assert [e.key for e in cache.entries()] == [fold.key]
    assert cli_main(["--root", str(cache.root), "ls"]) == 0
    out, err = capsys.readouterr()
    assert f"{units.format_size(root_file_bytes(cache.root))} on disk" in out
    assert "removed outside" not in err
    again = cachekit.Cache(cache.root, workers=1, progress=False).images(
        column(pictures, range(0, N, 2)), 8)
    assert again.hit
    np.testing.assert_array_equal(np.asarray(again.array), expected)


def test_clear_key_removes_the_stray_index_file_of_that_key_only(cache, pictures, capsys):
    first = cache.images(column(pictures, range(N)), 8)
    second = cache.images(column(pictures, range(N)), 4)
    shutil.rmtree(first.path)
    shutil.rmtree(second.path)
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "clear", first.key[:12], "--yes"]) == 0
    assert "removed 0 entries and 1 stray index file" in capsys.readouterr().out
    assert not list((cache.root / "index").rglob(f"{first.key}.npy"))
    assert list((cache.root / "index").rglob(f"{second.key}.npy"))  # another key's stays
    assert cli_main(["--root", str(cache.root), "clear", "--older-than", "0s", "--yes"]) == 0
    assert list((cache.root / "index").rglob(f"{second.key}.npy"))  # it has no last use


def test_a_stray_index_file_is_spared_when_its_entry_is_published_again(cache, pictures):
    col = column(pictures, range(N))
    entry = cache.images(col, 8)
    shutil.rmtree(entry.path)
    store = LocalStore(cache.root)
    planned = removal_for_clear(store)  # found the stray index file
    assert [item.noun for item in planned.items] == ["stray index file"]
    again = cache.images(col, 8)  # published again, with its index file, before it runs
    assert again.key == entry.key and not again.hit
    report = planned.execute()
    assert not report.removed and [s.reason for s in report.skipped] == ["its entry is back"]
    assert list((cache.root / "index").rglob(f"{entry.key}.npy"))


def test_a_stray_index_file_that_cannot_be_removed_is_reported_so_not_as_freed(
        cache, pictures, capsys, monkeypatch):
    entry = cache.images(column(pictures, range(N)), 8)
    shutil.rmtree(entry.path)
    unlink = _fs.DirHandle.unlink

    def forbidden(handle, name):  # as a folder that forbids removing another member's file
        if name == f"{entry.key}.npy":
            raise PermissionError(13, "Permission denied", name)
        unlink(handle, name)

    monkeypatch.setattr(_fs.DirHandle, "unlink", forbidden)
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "prune", "--max-size", "1G", "--yes"]) != 0
    out, err = capsys.readouterr()
    assert "removed 0 entries, freed 0 B" in out
    assert f"could not remove the row index file of {entry.key[:12]}" in err
    assert list((cache.root / "index").rglob(f"{entry.key}.npy"))


def test_the_budget_counts_shared_bytes_once_and_keeps_what_folds_link(
        cache_root, pictures, tmp_path):
    full = cachekit.Cache(cache_root, workers=1, progress=False).images(
        column(pictures, range(N)), 8)
    budget = sum(e.bytes for e in cachekit.Cache(cache_root).entries()) + 64 * 4096
    tight = cachekit.Cache(cache_root, workers=1, progress=False, max_size=budget)
    folds = [tight.images(column(pictures, range(k, N, 4)), 8) for k in range(4)]
    assert {e.key for e in tight.entries()} == {full.key} | {f.key for f in folds}
    for fold in folds:  # each reads its rows whatever went
        np.testing.assert_array_equal(np.asarray(fold.array),
                                      np.asarray(full.array)[fold_rows(fold, pictures)])


def test_a_fold_sharing_files_larger_than_the_budget_is_copied_so_that_the_root_fits(
        cache_root, pictures, capsys, tmp_path):
    """The full entry's file is larger than the budget, and a fold of half its rows and one
    new row links it: evicting every other entry cannot bring the root within the budget,
    so the fold is built again as a copy of its rows, and then the full entry goes. The
    fold's counts are the call's: the row it decoded before the copy was made."""
    rows = [*range(0, N - 1, 2), N - 1]
    full = cachekit.Cache(cache_root, workers=1, progress=False).images(
        column(pictures, range(N - 1)), 8)
    want = np.array(full.array)[rows[:-1]]
    del full  # let go: an entry a live Entry holds is never evicted
    budget = root_file_bytes(cache_root) * 3 // 4
    capsys.readouterr()
    tight = cachekit.Cache(cache_root, workers=1, max_size=budget)
    fold = tight.images(column(pictures, rows), 8)
    assert "copying them into one file of its own" in capsys.readouterr().err
    assert fold.contiguous and fold.outcome == "built"
    assert (fold.rows_decoded, fold.rows_reused) == (1, len(rows) - 1)
    np.testing.assert_array_equal(np.asarray(fold.array)[:-1], want)
    np.testing.assert_array_equal(np.asarray(fold.array), fresh(tmp_path, column(pictures, rows)))
    assert [e.key for e in tight.entries()] == [fold.key]
    assert root_file_bytes(cache_root) <= budget
    again = tight.images(column(pictures, rows), 8)
    assert again.hit and again.contiguous


@pytest.mark.parametrize("kept", ["the full entry", "another fold"])
def test_a_fold_is_not_copied_for_the_budget_when_an_entry_in_use_keeps_its_files(
        cache_root, pictures, capsys, kept):
    """As above, but a live Entry keeps the full entry's file: the full entry itself (a
    sweep's agent holds it while it makes its folds), or another fold that links it. A
    copy of the fold's rows would free nothing and only add them, so the fold shares the
    file and the root grows by its row map alone."""
    full = cachekit.Cache(cache_root, workers=1, progress=False).images(
        column(pictures, range(N)), 8)
    budget = root_file_bytes(cache_root) * 3 // 4
    tight = cachekit.Cache(cache_root, workers=1, max_size=budget)
    held = [full] if kept == "the full entry" else [
        tight.images(column(pictures, range(0, N, 3)), 8)]
    del full
    before = root_file_bytes(cache_root)
    capsys.readouterr()
    fold = tight.images(column(pictures, range(1, N, 2)), 8)
    assert "copying" not in capsys.readouterr().err
    assert not fold.contiguous and (fold.rows_decoded, fold.rows_reused) == (0, N // 2)
    assert root_file_bytes(cache_root) - before < fold.array.nbytes // 4
    assert held[0].key in {e.key for e in tight.entries()}


def fold_rows(entry: cachekit.Entry, pictures: list[str]) -> list[int]:
    return [pictures.index(p) for p in entry._labels]


# --- racing processes -----------------------------------------------------------------------


RACER = textwrap.dedent('''
    import json, os, sys
    import numpy as np, pandas as pd
    import cachekit
    root, paths, me, stop = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    budget = int(sys.argv[5]) if len(sys.argv) > 5 else None
    cache = cachekit.Cache(root, workers=1, progress=False, max_size=budget)
    rng = np.random.default_rng(me)
    checked = 0
    while not os.path.exists(stop) or checked < 6:
        rows = np.sort(rng.choice(len(paths), size=40, replace=False))
        entry = cache.images(pd.Series([paths[i] for i in rows]), 8)
        want = np.load(os.path.join(os.path.dirname(stop), "truth.npy"))[rows]
        if not np.array_equal(np.asarray(entry.array), want):
            raise SystemExit(f"wrong bytes for rows {rows.tolist()}")
        checked += 1
    print(json.dumps({"checked": checked}))
''')

CLEARER = textwrap.dedent('''
    import os, sys, time, cachekit
    root, stop = sys.argv[1], sys.argv[2]
    cache = cachekit.Cache(root, progress=False)
    rounds = 0
    while not os.path.exists(stop):
        if rounds % 2:
            cache.clear()
        else:
            cache.prune(30000)  # about the full entry: the least recently used go
        rounds += 1
        time.sleep(0.05)
    print(rounds)
''')


SAME_FOLDS = textwrap.dedent('''
    import json, os, sys, time
    import pandas as pd
    import cachekit
    root, paths, go = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    cache = cachekit.Cache(root, workers=1, progress=False, lock_timeout=60)
    while not os.path.exists(go):
        time.sleep(0.001)
    got = []
    for start in range(4):
        entry = cache.images(pd.Series(paths[start::4]), 8)
        got.append([entry.key, entry.outcome, entry.rows_decoded])
    print(json.dumps(got))
''')


def test_processes_racing_on_the_same_folds_of_committed_rows_all_get_one_entry(
        cache_root, pictures, tmp_path):
    """Such folds take no lock, so three processes asking the same four at once may each
    build them: every one gets the entry the first commit published, and the losers leave
    no build directory and no link behind."""
    full = cachekit.Cache(cache_root, workers=1, progress=False).images(
        column(pictures, range(N)), 8)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    racers = [subprocess.Popen([sys.executable, "-c", SAME_FOLDS, str(cache_root),
                                json.dumps(pictures), str(go)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(3)]
    time.sleep(3)  # all three are waiting for the file
    go.touch()
    results = [p.communicate(timeout=120) for p in racers]
    for proc, (_, err) in zip(racers, results):
        assert proc.returncode == 0, err[-3000:]
    got = [json.loads(out.splitlines()[-1]) for out, _ in results]
    assert all(decoded == 0 for run in got for _, _, decoded in run)
    assert all(run[i][0] == got[0][i][0] for run in got for i in range(4))
    published = sorted(p.name for p in (cache_root / "entries").iterdir())
    assert published == sorted([full.key] + [key for key, _, _ in got[0]])
    assert not list((cache_root / "tmp").glob("*"))
    links = {st.st_nlink for st in data_files(full).values()}
    assert links == {5}  # the full entry's data file and the four folds' links of it
    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    for start in range(4):
        fold = column(pictures, range(start, N, 4))
        np.testing.assert_array_equal(np.asarray(cache.images(fold, 8).array),
                                      fresh(tmp_path, fold))


def test_clear_and_prune_racing_derived_builds_and_reads_never_break_them(
        cache_root, pictures, tmp_path):
    truth = fresh(tmp_path, column(pictures, range(N)))
    np.save(tmp_path / "truth.npy", truth)
    cachekit.Cache(cache_root, workers=1, progress=False).images(column(pictures, range(N)), 8)
    stop = tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(cache_root),
                                json.dumps(pictures), str(me), str(stop)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for me in range(2)]
    clearer = subprocess.Popen([sys.executable, "-c", CLEARER, str(cache_root), str(stop)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        time.sleep(8)
    finally:
        stop.touch()
        results = [p.communicate(timeout=180) for p in racers]
        rounds = clearer.communicate(timeout=60)
    for proc, (out, err) in zip(racers, results):
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["checked"] >= 6
    assert clearer.returncode == 0 and int(rounds[0]) > 5, rounds[1][-2000:]


def test_budget_eviction_racing_derived_builds_and_reads_never_breaks_them(
        cache_root, pictures, tmp_path):
    """Two processes keep building and reading folds of one full entry, each under a budget
    about the full entry's size: every commit evicts the least recently used entries, the
    full entry whose file the folds link among them. Every read has the right bytes."""
    truth = fresh(tmp_path, column(pictures, range(N)))
    np.save(tmp_path / "truth.npy", truth)
    full = cachekit.Cache(cache_root, workers=1, progress=False).images(
        column(pictures, range(N)), 8)
    full_key, full_rows = full.key, full.array
    del full  # its rows stay mapped, but no live Entry holds it: a budget may evict it
    budget = sum(e.bytes for e in cachekit.Cache(cache_root).entries())
    stop = tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(cache_root),
                                json.dumps(pictures), str(me), str(stop), str(budget)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
              for me in range(2)]
    try:
        time.sleep(4)
    finally:
        stop.touch()
        results = [p.communicate(timeout=180) for p in racers]
    for proc, (out, err) in zip(racers, results):
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["checked"] >= 6
    assert full_key not in {e.key for e in cachekit.Cache(cache_root).entries()}
    np.testing.assert_array_equal(np.asarray(full_rows), truth)  # its file lives on


# --- a derived build killed, resumed --------------------------------------------------------


DERIVED_BUILDER = textwrap.dedent('''
    import json, os, signal, sys
    import numpy as np, pandas as pd
    import cachekit
    root, die_at = sys.argv[1], int(sys.argv[2])

    def row(v):
        if v == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # as a killed sweep agent would
        with open(os.path.join(root, "..", "computed.txt"), "a") as f:
            f.write(f"{v}\\n")
        return np.full(8, v, dtype=np.int64)

    cache = cachekit.Cache(root, workers=1, progress=False)
    entry = cache.map(row, pd.Series(range(int(sys.argv[3]))), version="1")
    print(json.dumps({"counts": [entry.rows_decoded, entry.rows_joined, entry.rows_reused],
                      "contiguous": entry.contiguous,
                      "right": bool((np.asarray(entry.array)[:, 0] == np.arange(len(entry))).all())}))
''')


def test_a_derived_build_killed_mid_fill_resumes_its_new_rows_and_links_the_rest(
        cache_root, tmp_path):
    script = tmp_path / "derived_builder.py"
    script.write_text(DERIVED_BUILDER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(die_at: int, rows: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(cache_root), str(die_at),
                               str(rows)], env=env, capture_output=True, text=True,
                              timeout=180)

    first = run(-1, 64)
    assert first.returncode == 0, first.stderr
    computed = tmp_path / "computed.txt"
    computed.unlink()
    killed = run(150, 192)  # 128 new rows in two chunks of 64: dies in the second
    assert killed.returncode == -9, killed.stderr
    assert sorted(map(int, computed.read_text().split())) == list(range(64, 150))
    computed.unlink()
    resumed = run(-1, 192)
    assert resumed.returncode == 0, resumed.stderr
    got = json.loads(resumed.stdout.splitlines()[-1])
    assert got["right"] and not got["contiguous"]
    assert got["counts"] == [64, 64, 64]  # decoded, resumed from the dead build, shared
    assert sorted(map(int, computed.read_text().split())) == list(range(128, 192))


# --- a group root: another member's rows ----------------------------------------------------


MEMBER = textwrap.dedent('''
    import hashlib, json, os, sys
    import numpy as np, pandas as pd
    import cachekit
    root, action, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cache = cachekit.Cache(root, workers=1, progress=False)
    values = pd.Series(rows)
    fn = lambda v: np.full(16, v, dtype=np.int32)
    if action == "clear":
        cache.clear(rows)  # (keys)
        print(json.dumps({}))
        raise SystemExit
    entry = cache.map(fn, values, version="1")
    inodes = sorted(os.stat(os.path.join(entry.path, name)).st_ino for name in os.listdir(entry.path)
                    if name == "data.npy" or name.startswith("part_"))
    print(json.dumps({"key": entry.key, "contiguous": entry.contiguous, "inodes": inodes,
                      "decoded": entry.rows_decoded, "reused": entry.rows_reused,
                      "right": bool((np.asarray(entry.array)[:, 0] == np.asarray(rows)).all())}))
''')


@pytest.mark.parametrize("signing", [False, True])
def test_a_group_members_rows_are_copied_never_linked_and_their_clear_breaks_nothing(
        shared_root, signing):
    """Without signing the other member's rows are copied; with it, another uid's row index
    is not trusted (it is unsigned), so they are decoded: never linked either way."""
    from hosts import finish

    script = shared_root.script(MEMBER)
    env = {"CACHEKIT_SIGNING_KEY": "team-key-" + "k" * 24} if signing else {}

    def member(user, action: str, rows: list) -> dict:
        return finish(user.python(script, shared_root.root, action, json.dumps(rows),
                                  env=env)).report()

    full = member(shared_root.victim, "build", list(range(200)))
    own_fold = member(shared_root.victim, "build", list(range(0, 200, 2)))
    assert not own_fold["contiguous"] and set(full["inodes"]) < set(own_fold["inodes"])
    theirs = member(shared_root.attacker, "build", list(range(1, 200, 2)))
    assert theirs["contiguous"] and theirs["decoded"] == (100 if signing else 0)
    assert theirs["reused"] == 100 - theirs["decoded"]
    assert not set(theirs["inodes"]) & set(full["inodes"])  # copied, not linked
    assert theirs["right"] and own_fold["right"]
    entries = shared_root.root / "entries"
    victims_file = entries / full["key"] / manifests.DATA_FILE
    assert victims_file.stat().st_uid == shared_root.victim.uid
    assert victims_file.stat().st_mode & 0o022 == 0  # no file mode was loosened to share
    member(shared_root.victim, "clear", [full["key"], own_fold["key"]])
    again = member(shared_root.attacker, "build", list(range(1, 200, 2)))
    assert again["right"] and again["key"] == theirs["key"] and again["decoded"] == 0


# --- the remote tier ------------------------------------------------------------------------


def _int_row(v: int) -> np.ndarray:
    return np.full(16, v, dtype=np.int32)


def test_a_derived_entry_is_pushed_and_pulled_whole_and_verifies(s3_env, tmp_path, capsys):
    from cachekit.obtain import background

    here = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    here.map(_int_row, list(range(300)), version="1")
    fold = here.map(_int_row, list(range(0, 300, 3)), version="1")
    assert not fold.contiguous
    background.wait_all()
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    pulled = there.map(_int_row, list(range(0, 300, 3)), version="1")
    assert pulled.source == "remote" and not pulled.contiguous
    np.testing.assert_array_equal(np.asarray(pulled.array)[:, 0], np.arange(0, 300, 3))
    capsys.readouterr()
    assert cli_main(["--root", str(tmp_path / "b"), "verify"]) == 0
    assert cli_main(["--root", str(tmp_path / "b"), "verify", "--remote"]) == 0


def test_verify_remote_of_a_fold_names_the_entries_sharing_its_damaged_pool_object(
        s3_env, tmp_path, capsys):
    """A pool object goes with the last entry that names it, and a push finds it there
    and does not send it: the word of `verify --remote` must name every entry to clear."""
    from cachekit.admin.remote_verify import verify as verify_remote
    from cachekit.obtain import background

    here = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    full = here.map(_int_row, list(range(300)), version="1")
    fold = here.map(_int_row, list(range(0, 300, 3)), version="1")
    apart = here.map(_int_row, list(range(5)), version="2")
    background.wait_all()
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    part = next(f.name for f in remote.lookup(fold.key).manifest.files
                if manifests.is_part_name(f.name))  # the full entry's rows, in the pool
    pooled = remote_object(remote, fold.key, part)
    body = bytearray(remote.fs.cat_file(pooled))
    body[-1] ^= 0xFF
    remote.fs.pipe_file(pooled, bytes(body))
    started: list[tuple[int, int]] = []
    read: list[int] = []
    verify_remote(remote, [fold.key], on_start=lambda n, size: started.append((n, size)),
                  on_bytes=read.append)
    assert [n for n, _ in started] == [1, 1]  # the fold, then the full entry it shares with
    assert sum(read) <= sum(size for _, size in started) <= sum(read) + 2 * 8192  # manifests
    capsys.readouterr()
    assert cli_main(["verify", "--remote", fold.key[:8]]) == 1
    out = capsys.readouterr().out
    assert f"{full.key}: checksum mismatch" in out and f"{fold.key}: checksum mismatch" in out
    said = out.splitlines()[-1]
    assert said.startswith("2 problems in 2 entries on ") and apart.key[:12] not in said
    named = said.split("`")[1].split()[3:]
    assert sorted(named) == sorted([full.key[:12], fold.key[:12]])
    assert cli_main(["clear", "--remote", "--yes", *named]) == 0
    assert not remote.fs.exists(pooled)
    again = cachekit.Cache(tmp_path / "c", workers=1, progress=False)
    again.map(_int_row, list(range(300)), version="1")
    background.wait_all()
    assert cli_main(["verify", "--remote"]) == 0


def test_a_host_holding_the_full_entry_pulls_a_fold_without_its_rows(
        s3_env, tmp_path, monkeypatch):
    from cachekit.obtain import background
    from cachekit.store import bucket

    here = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    here.map(_int_row, list(range(300)), version="1")
    here.map(_int_row, list(range(0, 300, 3)), version="1")
    background.wait_all()
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    full = there.map(_int_row, list(range(300)), version="1")
    assert full.source == "remote"
    read: list[tuple[str, int]] = []
    real = bucket.Bucket.read_ranges

    def counted(self, path: str, size: int):
        read.append((path, size))
        return real(self, path, size)

    monkeypatch.setattr(bucket.Bucket, "read_ranges", counted)
    fold = there.map(_int_row, list(range(0, 300, 3)), version="1")
    assert fold.source == "remote" and not fold.contiguous
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    found = remote.lookup(fold.key)
    parts = {path for f, path in zip(found.manifest.files, found.objects(remote))
             if manifests.is_part_file(f.name)}
    assert read and parts and not parts & {path for path, _ in read}
    row_bytes = 16 * 4
    assert sum(size for _, size in read) < 0.5 * len(fold) * row_bytes + 8192
    np.testing.assert_array_equal(np.asarray(fold.array)[:, 0], np.arange(0, 300, 3))
    linked = [p for p in fold.path.iterdir() if manifests.is_part_name(p.name)]
    assert [p.stat().st_ino for p in linked] == [
        (full.path / manifests.DATA_FILE).stat().st_ino]


def test_a_host_asking_a_pulled_fold_to_be_contiguous_copies_its_rows_here(
        s3_env, tmp_path, pictures):
    """The bucket holds the fold derived: the second host copies its rows into one file
    of its own instead of pulling the derived entry again (five times, then failing)."""
    from cachekit.obtain import background

    here = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    full = np.array(here.images(column(pictures, range(N)), 8).array)
    assert not here.images(column(pictures, range(0, N, 2)), 8).contiguous
    background.wait_all()
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    fold = there.images(column(pictures, range(0, N, 2)), 8, contiguous=True)
    assert fold.contiguous and fold.outcome == "built" and fold.rows_decoded == 0
    np.testing.assert_array_equal(np.asarray(fold.array), full[::2])


def test_a_stale_entry_is_healed_here_never_pulled_back_from_the_bucket(
        s3_env, tmp_path, pictures):
    """The bucket holds the entry as first built; once a file changed, the next call
    builds the entry again here, with the file's new pixels, instead of downloading the
    bucket's copy of the key, which is the stale entry itself."""
    import warnings

    from PIL import Image

    from cachekit.obtain import background, staleness

    col = column(pictures, range(N))
    cache = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    cache.images(col, 8)
    background.wait_all()
    Image.fromarray(np.full((10, 12, 3), 200, np.uint8)).save(pictures[7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cache.images(col, 8).hit  # its check finds the file changed
        staleness.wait_for_checks(timeout=60)
    healed = cache.images(col, 8)
    assert (healed.outcome, healed.rows_decoded) == ("built", 1)
    truth = cachekit.Cache(tmp_path / "truth", remote="", workers=1, progress=False)
    np.testing.assert_array_equal(np.asarray(healed.array), truth.images(col, 8).array)


def test_an_entry_pulled_from_the_bucket_is_checked_for_changed_files_as_a_hit_is(
        s3_env, tmp_path, pictures):
    """A host that downloads an entry another host built checks its files on that call, as
    a local hit would: a file rewritten since the upload is said at once (not at the next
    call), and the call after heals the entry here."""
    import warnings

    from PIL import Image

    from cachekit.obtain import background, staleness

    col = column(pictures, range(N))
    cachekit.Cache(tmp_path / "a", workers=1, progress=False).images(col, 8)
    background.wait_all()
    Image.fromarray(np.full((10, 12, 3), 200, np.uint8)).save(pictures[7])
    there = cachekit.Cache(tmp_path / "b", workers=1, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pulled = there.images(col, 8)
        staleness.wait_for_checks(timeout=60)
    assert pulled.outcome == "pulled"
    said = [str(w.message) for w in caught if issubclass(w.category, cachekit.StaleEntryWarning)]
    assert len(said) == 1 and pictures[7] in said[0], said
    healed = there.images(col, 8)
    assert (healed.outcome, healed.rows_decoded) == ("built", 1)


def test_two_entries_with_the_same_bytes_for_other_rows_never_lend_each_other_identities(
        cache_root):
    """Two data files may be byte for byte alike while their rows are of other values
    (here every row is zeros): a part is named by its bytes, so the second entry's rows are
    not taken through the first one's row identities; they are decoded."""
    from cachekit import keys
    from cachekit.store.shared_rows import open_shared_rows

    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    zeros = lambda v: np.zeros(4, dtype=np.int64)  # noqa: E731
    cache.map(zeros, pd.Series([1, 2, 3]), version="1")
    cache.map(zeros, pd.Series([4, 5, 6]), version="1")
    both = cache.map(zeros, pd.Series([1, 2, 3, 4, 5, 6]), version="1")
    assert both.rows_reused + both.rows_decoded == 6 and both.rows_reused >= 3
    recipe = manifests.read(both.path).reuse.recipe
    with open_shared_rows(LocalStore(cache_root), both.key, recipe) as source:
        expected, _ = keys.row_identities(pd.Series([1, 2, 3, 4, 5, 6]))
        np.testing.assert_array_equal(source.ids[:, :2], expected[:, :2])


def test_rows_in_the_same_bytes_as_a_linked_file_but_of_other_stats_are_copied_not_decoded(
        cache, pictures, tmp_path, capsys):
    """A file touched (same content, new mtime) and decoded again under validate="stat"
    makes a data file byte for byte another entry's, with other stats: a part is one file
    under its name, so a column that needs rows of both links one and copies the other's
    rows; it decodes none."""
    first = cache.images(column(pictures, [1, 0]), 8, validate="stat")
    cache.images(column(pictures, [1, 0, 2, 3]), 8, validate="stat")  # links first's file
    os.utime(pictures[0], ns=(1, 1))
    again = cache.images(column(pictures, [1, 0]), 8, validate="stat", contiguous=True)
    assert again.rows_decoded == 1 and again.key != first.key
    assert (again.path / manifests.DATA_FILE).read_bytes() == \
        (first.path / manifests.DATA_FILE).read_bytes()
    capsys.readouterr()
    both = cache.images(column(pictures, [0, 1]), 8, validate="stat")
    assert (both.rows_decoded, both.rows_reused) == (0, 2), capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(both.array),
                                  fresh(tmp_path, column(pictures, [0, 1])))
    assert cache.verify() == []


def test_contiguous_true_says_so_when_the_derived_entry_cannot_be_replaced(
        cache_root, pictures, monkeypatch, capsys):
    loud = cachekit.Cache(cache_root, workers=1, progress=None)
    loud.images(column(pictures, range(N)), 8)
    loud.images(column(pictures, range(0, N, 2)), 8)
    monkeypatch.setattr(LocalStore, "set_aside", lambda self, key: None)  # another user's
    capsys.readouterr()
    kept = loud.images(column(pictures, range(0, N, 2)), 8, contiguous=True)
    assert kept.hit and not kept.contiguous
    assert "a contiguous entry was asked for, but this one shares its rows" in " ".join(
        capsys.readouterr().err.split())


def test_a_hit_of_a_derived_entry_finds_a_changed_file_among_its_shared_rows(
        cache, pictures):
    """The stale check of a derived entry maps its stats through its row map: a file that
    changed under a row the entry shares is found as under one it decoded."""
    import warnings

    from cachekit.errors import StaleEntryWarning
    from cachekit.obtain import staleness

    cache.images(column(pictures, range(N)), 8)
    col = column(pictures, range(10, 50))
    fold = cache.images(col, 8)
    assert not fold.contiguous and fold.rows_decoded == 0
    os.utime(pictures[30], ns=(7, 7))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.images(col, 8).hit
        staleness.wait_for_checks(timeout=60)
    assert [w.category for w in caught] == [StaleEntryWarning]
    assert pictures[30] in str(caught[0].message) and pictures[29] not in str(caught[0].message)
