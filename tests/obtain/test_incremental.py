"""Incremental builds: a column that shares rows with committed entries of its recipe decodes
only its new rows, and its bytes are a fresh build's (cachekit/obtain/donors.py,
cachekit/obtain/parts.py, cachekit/obtain/staleness.py).

Decodes are counted in this process by patching ``cachekit.engine.decoding.images.load_image``
(the builds run on threads here), and compared byte for byte with a build of the same
column in an empty root. Sources are damaged as real files, on disk.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.cli.main import main as cli_main
from cachekit.engine.decoding import images
from cachekit.obtain import donors, staleness
from cachekit.errors import StaleEntryWarning
from cachekit.store import manifest as manifests
from helpers import write_pictures

N = 600


def _write_picture(path: Path, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(path)


@pytest.fixture
def pictures(tmp_path: Path) -> list[str]:
    """N small PNGs, each of its own random pixels."""
    return write_pictures(tmp_path / "pictures", N)


class Decodes:
    """The paths ``load_image`` decoded in this process since the last :meth:`take`
    (fresh builds of :func:`fresh` aside)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.counting = True

    def take(self) -> list[str]:
        taken, self.paths = self.paths, []
        return taken


_decodes = Decodes()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Decodes:
    counter = _decodes
    counter.paths, counter.counting = [], True
    real = images.load_image

    def counting(path, *args, **kwargs):
        if counter.counting:
            counter.paths.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(images, "load_image", counting)
    return counter


class Opens:
    """The image files (``.png`` under ``folder``) opened with ``os.open`` or ``open`` in
    this process since the last :meth:`take`: what decoding cost, counted below cachekit's
    own functions."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.paths = str(folder), []

    def seen(self, path: object) -> None:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(self.folder) \
                and os.fspath(path).endswith(".png"):
            self.paths.append(os.fspath(path))

    def take(self) -> list[str]:
        taken, self.paths = self.paths, []
        return taken


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Opens:
    import builtins

    counter = Opens(tmp_path)
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *args, **kwargs):
        counter.seen(path)
        return real_os_open(path, *args, **kwargs)

    def plain_open(path, *args, **kwargs):
        counter.seen(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", plain_open)
    return counter


def column(paths: list[str], rows) -> pd.Series:
    return pd.Series([paths[i] for i in rows], name="img_path")


def fresh(tmp_path: Path, col: pd.Series, **options) -> np.ndarray:
    """The bytes of a build of ``col`` in an empty root (its decodes are not counted)."""
    root = tmp_path / f"fresh-{len(list(tmp_path.glob('fresh-*')))}"
    _decodes.counting = False
    try:
        entry = cachekit.Cache(root, workers=1, progress=False).images(col, 8, **options)
    finally:
        _decodes.counting = True
    assert entry.source == "built" and entry.rows_reused == 0
    return np.array(entry.array)


def counts(entry: cachekit.Entry) -> tuple[int, int, int]:
    return entry.rows_decoded, entry.rows_joined, entry.rows_reused


# --- the cases of the issue ---------------------------------------------------------------


def test_an_overlapping_column_decodes_only_its_new_rows(cache, pictures, decodes, tmp_path):
    a = cache.images(column(pictures, range(0, 500)), 8)
    assert counts(a) == (500, 0, 0) and len(decodes.take()) == 500
    b = cache.images(column(pictures, range(100, 600)), 8)
    assert sorted(decodes.take()) == pictures[500:600]
    assert b.source == "built" and counts(b) == (100, 0, 400)
    assert b.manifest["origin"] == {"reused": [[a.key, 400]], "decoded": 100, "joined": 0}
    np.testing.assert_array_equal(b.array, fresh(tmp_path, column(pictures, range(100, 600))))
    again = cache.images(column(pictures, range(100, 600)), 8)
    assert again.hit and counts(again) == (0, 0, 0) and decodes.take() == []


def test_five_fold_training_columns_decode_each_image_once(cache, pictures, decodes, tmp_path):
    n = 250
    folds = np.array_split(np.random.default_rng(3).permutation(n), 5)
    decoded = 0
    for k in range(5):
        train = np.sort(np.concatenate([f for i, f in enumerate(folds) if i != k]))
        entry = cache.images(column(pictures, train), 8)
        got = decodes.take()
        decoded += len(got)
        assert entry.rows_decoded == len(got)
        assert sum(counts(entry)) == len(entry) == len(train)
        np.testing.assert_array_equal(entry.array, fresh(tmp_path, column(pictures, train)))
    assert decoded == n


def test_appended_rows_are_the_only_ones_decoded(cache, pictures, decodes, tmp_path):
    cache.images(column(pictures, range(300)), 8)
    decodes.take()
    grown = cache.images(column(pictures, range(310)), 8)
    assert sorted(decodes.take()) == pictures[300:310]
    assert counts(grown) == (10, 0, 300)
    np.testing.assert_array_equal(grown.array, fresh(tmp_path, column(pictures, range(310))))


def test_with_validate_stat_a_rewritten_file_costs_one_decode(cache, pictures, decodes,
                                                              tmp_path):
    col = column(pictures, range(200))
    before = cache.images(col, 8, validate="stat")
    old = np.array(before.array)
    decodes.take()
    _write_picture(Path(pictures[17]), 10_000)
    os.utime(pictures[17], ns=(1, 1))  # and a stat of its own, whatever the clock
    after = cache.images(col, 8, validate="stat")
    assert decodes.take() == [pictures[17]]
    assert after.key != before.key and counts(after) == (1, 0, 199)
    expected = fresh(tmp_path, col, validate="stat")
    np.testing.assert_array_equal(after.array, expected)
    assert not np.array_equal(expected[17], old[17])


@pytest.fixture
def sample_every_file(monkeypatch):
    """A build's sample of the files it shares takes them all: what it finds is certain."""
    monkeypatch.setattr(donors, "SAMPLE_ROWS", 10**6)


@pytest.fixture
def sample_no_file(monkeypatch):
    """A build's sample of the files it shares takes none: only the background check of
    its entry can find a changed file."""
    monkeypatch.setattr(donors, "SAMPLE_ROWS", 0)


def test_with_validate_path_a_build_never_shares_a_row_whose_changed_file_its_sample_saw(
        cache, pictures, decodes, tmp_path, sample_every_file):
    cache.images(column(pictures, range(100)), 8)
    decodes.take()
    _write_picture(Path(pictures[5]), 20_000)
    os.utime(pictures[5], ns=(2, 2))
    grown = cache.images(column(pictures, range(110)), 8)  # a miss: rows 0..99 may be shared
    assert sorted(decodes.take()) == sorted([pictures[5], *pictures[100:110]])
    assert counts(grown) == (11, 0, 99)
    np.testing.assert_array_equal(grown.array, fresh(tmp_path, column(pictures, range(110))))


def test_a_changed_file_the_sample_missed_is_said_by_the_background_check_and_healed_next(
        cache, pictures, decodes, tmp_path, sample_no_file):
    """A build shares rows as a hit serves them: on their recorded stat, checked in the
    background; the changed file is said, and the next call decodes that row alone."""
    cache.images(column(pictures, range(N)), 8)
    decodes.take()
    _write_picture(Path(pictures[N - 3]), 20_000)
    os.utime(pictures[N - 3], ns=(2, 2))
    fold = column(pictures, range(10, N))
    with pytest.warns(StaleEntryWarning, match="the entry this call built holds") as caught:
        built = cache.images(fold, 8)
        staleness.wait_for_checks(timeout=60)
    assert counts(built) == (0, 0, N - 10) and pictures[N - 3] in str(caught[0].message)
    assert decodes.take() == []
    healed = cache.images(fold, 8)
    assert decodes.take() == [pictures[N - 3]] and counts(healed) == (1, 0, N - 11)
    np.testing.assert_array_equal(healed.array, fresh(tmp_path, fold))


def test_a_bulk_change_is_found_by_the_sample_and_nothing_changed_is_shared(
        cache, pictures, decodes):
    cache.images(column(pictures, range(N)), 8)
    decodes.take()
    for path in pictures[:N]:  # a data set regenerated: every file touched
        os.utime(path, ns=(4, 4))
    fold = cache.images(column(pictures, range(10, N)), 8)
    assert counts(fold) == (N - 10, 0, 0) and len(decodes.take()) == N - 10


def test_the_background_checks_of_overlapping_builds_stat_each_file_once(
        cache, pictures, monkeypatch):
    cache.images(column(pictures, range(N)), 8)
    checked: list[int] = []
    real = staleness._changed

    def counted(rows, recorded, paths, stop_at=0):
        if not stop_at:  # the background check's, not a sample's
            checked.append(len(rows))
        return real(rows, recorded, paths, stop_at)

    monkeypatch.setattr(staleness, "_changed", counted)
    first = cache.images(column(pictures, range(0, 400)), 8)
    second = cache.images(column(pictures, range(200, N)), 8)
    staleness.wait_for_checks(timeout=60)
    assert first.rows_reused == second.rows_reused == 400
    assert sum(checked) == N  # not 800: the second skips the 200 files the first checked


def test_a_file_rewritten_after_a_check_found_it_unchanged_is_found_by_a_later_check(
        cache, pictures, monkeypatch):
    """A check's word that a file is unchanged holds for CONFIRMED_SECONDS: the next fold,
    hit after the last one trained for longer than that, stats its files again, and says
    the one rewritten meanwhile."""
    cache.images(column(pictures, range(N)), 8)
    first = cache.images(column(pictures, range(0, 400)), 8)  # its files checked: unchanged
    staleness.wait_for_checks(timeout=60)
    _write_picture(Path(pictures[7]), 20_000)
    os.utime(pictures[7], ns=(2, 2))
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 0)  # only the background check looks
    monkeypatch.setattr(staleness, "CONFIRMED_SECONDS", 0.0)  # "trained" longer than that
    with pytest.warns(StaleEntryWarning) as caught:
        cache.images(column(pictures, range(N)), 8)  # the full entry's first hit
        staleness.wait_for_checks(timeout=60)
    assert first.rows_reused == 400 and pictures[7] in str(caught[0].message)


def test_an_entry_built_again_by_healing_is_checked_anew_in_the_same_process(
        cache, pictures, decodes, monkeypatch):
    """A process that healed an entry still checks it: a file rewritten afterwards is said
    too (the healed entry is another entry, though its key is the same)."""
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 0)  # only the background check looks
    monkeypatch.setattr(staleness, "CONFIRMED_SECONDS", 0.0)  # each file is rewritten at once
    col = column(pictures, range(N))
    cache.images(col, 8)
    for changed, seed in ((3, 20_000), (9, 20_001)):
        _write_picture(Path(pictures[changed]), seed)
        os.utime(pictures[changed], ns=(2, 2))
        with pytest.warns(StaleEntryWarning) as caught:
            assert cache.images(col, 8).hit
            staleness.wait_for_checks(timeout=60)
        assert pictures[changed] in str(caught[0].message)
        decodes.take()
        healed = cache.images(col, 8)
        assert healed.source == "built" and decodes.take() == [pictures[changed]]


def test_a_hit_a_while_after_its_entrys_last_check_checks_it_again(
        cache, pictures, monkeypatch):
    """A sweep agent runs trial after trial in one process: a hit CONFIRMED_SECONDS after
    the last check of its entry checks every file again, and says the one rewritten."""
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 0)
    col = column(pictures, range(N))
    cache.images(col, 8)
    cache.images(col, 8)  # the first hit: every file checked, none changed
    staleness.wait_for_checks(timeout=60)
    _write_picture(Path(pictures[11]), 20_000)
    os.utime(pictures[11], ns=(2, 2))
    monkeypatch.setattr(staleness, "CONFIRMED_SECONDS", 0.0)  # the trial took longer
    with pytest.warns(StaleEntryWarning) as caught:
        cache.images(col, 8)
        staleness.wait_for_checks(timeout=60)
    assert pictures[11] in str(caught[0].message)


def test_a_fold_that_shares_rows_of_a_content_entry_checks_every_file_on_a_hit(
        cache, pictures, monkeypatch):
    """validate is not in the recipe: a fold (validate="path") links the parts of a
    "content" entry, whose row identities hold two more words (the digests). Its hits still
    check every file, and say the one rewritten."""
    cache.images(column(pictures, range(N)), 8, validate="content")
    fold = cache.images(column(pictures, range(0, 400)), 8)
    assert not fold.contiguous and fold.rows_reused == 400
    staleness.wait_for_checks(timeout=60)
    _write_picture(Path(pictures[7]), 20_000)
    os.utime(pictures[7], ns=(2, 2))
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 0)  # only the background check looks
    monkeypatch.setattr(staleness, "CONFIRMED_SECONDS", 0.0)
    with pytest.warns(StaleEntryWarning) as caught:
        assert cache.images(column(pictures, range(0, 400)), 8).hit
        staleness.wait_for_checks(timeout=60)
    assert pictures[7] in str(caught[0].message)


def test_a_hit_warns_once_when_files_of_its_column_changed(cache, pictures, decodes):
    col = column(pictures, range(10))
    cache.images(col, 8)
    for i, path in enumerate(pictures[:10]):
        os.utime(path, ns=(10 + i, 10 + i))
    with pytest.warns(StaleEntryWarning, match=r'row \d+ .*validate="stat"') as caught:
        hit = cache.images(col, 8)
    assert hit.hit and len(caught) == 1
    assert str(caught[0].message).count(pictures[0][:-9]) == 1  # names the file's path
    assert "modified 1970-01-01 00:00:00.000" in str(caught[0].message)  # a date, not epoch ns
    assert Path(caught[0].filename).resolve() == Path(__file__).resolve()  # the user's call
    healed = cache.images(col, 8)  # the next call builds it again: every file changed
    assert (healed.outcome, healed.rows_decoded, healed.rows_reused) == ("built", 10, 0)
    assert cache.images(col, 8).hit  # and then no warning: filterwarnings=error


def test_the_sample_of_a_hit_checks_every_row_of_an_entry_of_16_rows_or_fewer(
        cache, pictures, monkeypatch):
    """Without the background check, a hit of a small entry still finds its one changed
    file: the sample is 16 rows drawn without repeats (16 draws with repeats miss a given
    row of 16 a third of the time; all ten columns here would pass so 1 time in 80)."""
    monkeypatch.setenv("CACHEKIT_STALE_CHECK", "sample")
    for start in range(0, 16 * 10, 16):
        col = column(pictures, range(start, start + 16))
        cache.images(col, 8)
        os.utime(pictures[start + 15], ns=(5, 5))
        with pytest.warns(StaleEntryWarning, match=re.escape(pictures[start + 15])):
            assert cache.images(col, 8).hit


def test_a_hit_of_unchanged_files_checks_and_stays_silent(cache, pictures):
    col = column(pictures, range(40))
    cache.images(col, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.images(col, 8).hit
    assert cache.images(col, 8, validate="stat").source == "built"


# --- sources that fail their checks ---------------------------------------------------------


def _data_file(entry: cachekit.Entry) -> Path:
    return entry.path / manifests.DATA_FILE


def test_a_truncated_source_is_skipped(cache, pictures, decodes, tmp_path):
    a = cache.images(column(pictures, range(0, 500)), 8)
    os.truncate(_data_file(a), os.path.getsize(_data_file(a)) // 2)
    decodes.take()
    b = cache.images(column(pictures, range(100, 600)), 8)
    assert len(decodes.take()) == 500 and counts(b) == (500, 0, 0)
    np.testing.assert_array_equal(b.array, fresh(tmp_path, column(pictures, range(100, 600))))


def test_a_source_changed_in_place_after_its_commit_is_reported_in_every_entry_sharing_it(
        cache, pictures, capsys):
    """Data files never change once written; one that does (a disk fault, a group member
    writing into their own file) is shared as it is, and ``verify`` names every entry that
    holds it, not just the one that wrote it."""
    a = cache.images(column(pictures, range(0, 500)), 8)
    b = cache.images(column(pictures, range(100, 600)), 8)
    assert counts(b) == (100, 0, 400) and not b.contiguous
    offset = os.path.getsize(_data_file(a)) - 500 * 3 * 8 * 8
    with open(_data_file(a), "r+b") as f:  # row 300 of A (row 200 of B): same size, other bytes
        f.seek(offset + 300 * 3 * 8 * 8)
        f.write(bytes(3 * 8 * 8))
    capsys.readouterr()
    assert cli_main(["--root", str(cache.root), "verify"]) == 1
    out = capsys.readouterr().out
    assert a.key[:12] in out and b.key[:12] in out


@pytest.mark.parametrize("damage", ["clear", "truncate"])
def test_a_source_cleared_or_truncated_after_a_fold_shares_it_never_gives_wrong_bytes(
        cache, pictures, tmp_path, damage):
    a = cache.images(column(pictures, range(0, 500)), 8)
    b = cache.images(column(pictures, range(100, 600)), 8)
    assert counts(b) == (100, 0, 400)
    if damage == "clear":  # b's link keeps the bytes: clearing a never breaks b
        assert cache.clear([a.key]).removed_entries and not a.path.exists()
        again = cache.images(column(pictures, range(100, 600)), 8)
        assert again.hit
        np.testing.assert_array_equal(again.array,
                                      fresh(tmp_path, column(pictures, range(100, 600))))
        return
    os.truncate(_data_file(a), os.path.getsize(_data_file(a)) // 2)  # the one shared file
    with pytest.raises(cachekit.CacheCorruptError):
        cachekit.Entry(b.path, manifests.read(b.path), source="local")


def test_a_source_cleared_by_another_process_mid_build_never_gives_wrong_bytes(
        cache_root, pictures, tmp_path):
    import subprocess
    import sys
    import textwrap

    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    cache.images(column(pictures, range(0, 300)), 8)
    stop = tmp_path / "stop"
    clearer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time, cachekit
        cache = cachekit.Cache({str(cache_root)!r}, progress=False)
        while not os.path.exists({str(stop)!r}):
            cache.clear()
            time.sleep(0.05)
    """)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        for start in range(25, 300, 50):  # each a miss
            rows = range(start, start + 300)
            entry = cache.images(column(pictures, rows), 8)
            assert sum(counts(entry)) == 300
            np.testing.assert_array_equal(entry.array, fresh(tmp_path, column(pictures, rows)))
    finally:
        stop.touch()
        assert clearer.wait(timeout=120) == 0


def test_a_damaged_row_index_costs_reuse_never_correctness(cache, pictures, decodes, tmp_path):
    a = cache.images(column(pictures, range(0, 500)), 8)
    index_files = list((cache.root / "index").glob("*/*.npy"))
    assert [p.stem for p in index_files] == [a.key]
    flat = np.load(index_files[0])
    count = int(flat[1])
    flat[3 + count:3 + 2 * count] = np.roll(flat[3 + count:3 + 2 * count], 1)  # wrong rows
    np.save(index_files[0], flat)
    decodes.take()
    b = cache.images(column(pictures, range(100, 600)), 8)
    assert counts(b) == (500, 0, 0) and len(decodes.take()) == 500  # every row refused
    np.testing.assert_array_equal(b.array, fresh(tmp_path, column(pictures, range(100, 600))))
    index_files[0].write_bytes(b"\x93NUMPY garbage")
    c = cache.images(column(pictures, range(50, 550)), 8)
    assert sum(counts(c)) == 500
    np.testing.assert_array_equal(c.array, fresh(tmp_path, column(pictures, range(50, 550))))


def test_the_index_file_of_a_removed_entry_is_dropped(cache, pictures):
    a = cache.images(column(pictures, range(0, 100)), 8)
    b = cache.images(column(pictures, range(100, 200)), 8)
    [a_index] = (cache.root / "index").glob(f"*/{a.key}.npy")
    [b_index] = (cache.root / "index").glob(f"*/{b.key}.npy")
    cache.clear([a.key])
    assert not a_index.exists() and b_index.exists()  # cleared with its entry
    import shutil

    shutil.rmtree(b.path)  # removed behind cachekit's back: the next lookup drops its file
    c = cache.images(column(pictures, range(50, 150)), 8)
    assert counts(c) == (100, 0, 0) and not b_index.exists()


# --- reporting ------------------------------------------------------------------------------


def test_progress_says_how_many_rows_are_reused_and_info_where_they_came_from(
        cache_root, pictures, capsys):
    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    a = cache.images(column(pictures, range(0, 300)), 8)
    b_col = column(pictures, range(0, 200))
    c = cache.images(column(pictures, range(200, 400)), 8)
    shown = cachekit.Cache(cache_root, workers=1, progress=True)
    b = shown.images(pd.concat([b_col, column(pictures, range(300, 400)),
                                column(pictures, range(400, 420))], ignore_index=True), 8)
    err = capsys.readouterr().err
    assert f"entry {b.key[:12]}: sharing 300 rows with 2 entries" in err
    assert "decoding 20 new rows" in err
    assert counts(b) == (20, 0, 300)
    cache.clear([c.key])
    assert cli_main(["--root", str(cache_root), "info", b.key[:12]]) == 0
    out = " ".join(capsys.readouterr().out.split(" "))  # (columns align to the widest name)
    assert "rows from:" in out and "20 decoded by its builder" in out
    assert "300 shared with 2 entries" in out
    assert re.search(f"shared with {a.key[:12]}: +200 rows\n", out)
    assert re.search(f"shared with {c.key[:12]}: +100 rows \\(not in this root\\)", out)
    flat = cache.images(column(pictures, range(0, 100)), 8, contiguous=True)  # a's rows, copied
    assert flat.contiguous and cli_main(["--root", str(cache_root), "info", flat.key]) == 0
    out = capsys.readouterr().out
    assert "100 copied from 1 entry" in out and "shared with" not in out
    donor = re.search("copied from ([0-9a-f]{12}): +100 rows\n", out)
    assert donor is not None and donor[1] in (a.key[:12], b.key[:12])
    from cachekit.cli.local import _origin_pairs

    made_before = {"reused": [[a.key, 100]], "decoded": 0, "joined": 0}  # copies unrecorded
    for contiguous, how in ((True, "copied from"), (False, "shared with")):
        said = dict(_origin_pairs(made_before, {a.key}, contiguous))
        assert said["rows from"].endswith(f", 100 {how} 1 entry"), said
        assert said[f"  {how} {a.key[:12]}"] == "100 rows"


def test_memoize_stays_whole_call(cache):
    calls = []

    @cache.memoize
    def doubled(frame: pd.DataFrame) -> np.ndarray:
        calls.append(len(frame))
        return frame["x"].to_numpy() * 2

    doubled(pd.DataFrame({"x": range(10)}))
    doubled(pd.DataFrame({"x": range(11)}))
    assert calls == [10, 11]


# --- the three counts, over random columns ---------------------------------------------------

_computed: list[int] = []


def _square(value: int) -> np.ndarray:
    _computed.append(int(value))
    return np.full(4, value * value, dtype=np.int64)


def test_counts_add_up_and_only_unseen_values_are_computed_over_random_columns() -> None:
    import tempfile

    from hypothesis import given, settings
    from hypothesis import strategies as st

    columns = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30),
                       min_size=1, max_size=4)

    @settings(max_examples=40, deadline=None)
    @given(columns)
    def check(specs: list[list[int]]) -> None:
        with tempfile.TemporaryDirectory() as root:
            cache = cachekit.Cache(root, workers=2, executor="threads", progress=False)
            seen: set[int] = set()
            made: set[tuple[int, ...]] = set()
            for values in specs:
                _computed.clear()
                entry = cache.map(_square, pd.Series(values))
                np.testing.assert_array_equal(
                    entry.array, np.stack([_square(v) for v in values]))
                _computed[len(_computed) - len(values):] = []
                if tuple(values) in made:
                    assert entry.hit and counts(entry) == (0, 0, 0) and not _computed
                    continue
                assert entry.source == "built"
                assert sum(counts(entry)) == len(entry) == len(values)
                assert entry.rows_joined == 0
                # each unseen value once, however many rows repeat it
                assert entry.rows_decoded == len(_computed) == len(set(values) - seen)
                assert sorted(_computed) == sorted(set(values) - seen)
                seen.update(values)
                made.add(tuple(values))

    check()


def test_a_failed_row_is_never_copied(cache, pictures, decodes, tmp_path):
    missing = str(tmp_path / "missing.png")
    with_hole = pd.Series([*pictures[:20], missing])
    first = cache.images(with_hole, 8, on_error="zero")
    assert not first.valid[20]
    decodes.take()
    again = cache.images(pd.Series([missing, *pictures[:30]]), 8, on_error="zero")
    assert sorted(decodes.take()) == sorted([missing, *pictures[20:30]])
    assert counts(again) == (11, 0, 20) and not again.valid[0] and again.valid[1:].all()


def test_the_build_says_which_rows_it_decodes_new_failed_before_or_changed(
        cache_root, pictures, tmp_path, capsys, sample_every_file):
    missing = str(tmp_path / "missing.png")
    quiet = cachekit.Cache(cache_root, workers=1, progress=False)
    quiet.images(pd.Series([*pictures[:20], missing]), 8, on_error="zero")
    os.utime(pictures[5], ns=(10**9, 10**9))  # its recorded stat no longer holds
    shown = cachekit.Cache(cache_root, workers=1, progress=True)
    grown = shown.images(pd.Series([*pictures[:30], missing]), 8, on_error="zero")
    assert counts(grown) == (12, 0, 19)
    err = capsys.readouterr().err
    assert ("sharing 19 rows with 1 entry of the same recipe (stored once); decoding 10 "
            "new rows and 1 that failed before and 1 whose files changed") in " ".join(err.split())


def test_rows_in_a_file_that_fails_its_check_are_decoded_and_the_build_says_so(
        cache_root, pictures, tmp_path, capsys, decodes):
    quiet = cachekit.Cache(cache_root, workers=1, progress=False)
    full = quiet.images(column(pictures, range(30)), 8)
    with open(full.path / manifests.DATA_FILE, "ab") as f:
        f.write(b"x")  # its size is no longer the manifest's
    decodes.take()
    shown = cachekit.Cache(cache_root, workers=1, progress=True)
    fold = shown.images(column(pictures, range(0, 40, 2)), 8)
    assert counts(fold) == (20, 0, 0) and len(decodes.take()) == 20
    err = " ".join(capsys.readouterr().err.split())
    assert (f"entry {fold.key[:12]}: decoding 5 new rows and 15 in files it could not open "
            "or check") in err
    np.testing.assert_array_equal(np.asarray(fold.array), np.asarray(cachekit.Cache(
        tmp_path / "fresh", workers=1, progress=False).images(column(
            pictures, range(0, 40, 2)), 8).array))


def test_rows_of_an_entry_that_fails_its_checks_are_decoded_and_the_build_says_so(
        cache_root, pictures, capsys, decodes):
    """The row index still names the entry, so the build knows whose rows they were."""
    quiet = cachekit.Cache(cache_root, workers=1, progress=False)
    full = quiet.images(column(pictures, range(30)), 8)
    ids = full.path / manifests.ROW_IDS_FILE
    ids.write_bytes(ids.read_bytes()[:-1] + bytes([ids.read_bytes()[-1] ^ 1]))
    decodes.take()
    fold = cachekit.Cache(cache_root, workers=1, progress=True).images(
        column(pictures, range(0, 40, 2)), 8)
    assert counts(fold) == (20, 0, 0) and len(decodes.take()) == 20
    err = " ".join(capsys.readouterr().err.split())
    assert (f"entry {fold.key[:12]}: decoding 5 new rows and 15 in entries it could not "
            "open or check") in err
    assert f"entry {full.key[:12]} is gone or failed its checks" in err


def test_an_entry_downloaded_from_a_remote_tier_lends_its_rows(tmp_path, pictures, decodes):
    remote = (tmp_path / "bucket").as_uri()
    host_a = cachekit.Cache(tmp_path / "a", remote=remote, workers=1, progress=False)
    host_b = cachekit.Cache(tmp_path / "b", remote=remote, workers=1, progress=False)
    host_a.images(column(pictures, range(100)), 8)
    assert host_b.images(column(pictures, range(100)), 8).source == "remote"
    decodes.take()
    grown = host_b.images(column(pictures, range(120)), 8)
    assert counts(grown) == (20, 0, 100) and len(decodes.take()) == 20


# --- a failure or a change costs only the rows it touches ---------------------------------


def with_bad_rows(pictures: list[str], tmp_path: Path, rows: int) -> pd.Series:
    """``rows`` good pictures, then a file that is no image and a missing one."""
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    return pd.Series([*pictures[:rows], str(broken), str(tmp_path / "missing.png")])


def test_a_failed_build_keeps_its_good_rows_for_the_retry_and_the_column_without_them(
        cache, pictures, opens, tmp_path):
    col = with_bad_rows(pictures, tmp_path, 300)
    with pytest.raises(cachekit.ImageDecodeError, match="the rows that decoded are kept"):
        cache.images(col, 8)
    assert sorted(opens.take()) == sorted(col)  # each file opened once (or tried: missing)
    with pytest.raises(cachekit.ImageDecodeError):
        cache.images(col, 8)  # the retry decodes only the rows that failed: fixed or not
    assert sorted(opens.take()) == sorted(col[300:])
    dropped = cache.images(col[:300], 8)  # the user drops them: nothing left to decode
    assert opens.take() == [] and counts(dropped) == (0, 0, 300)
    np.testing.assert_array_equal(dropped.array, fresh(tmp_path, col[:300]))
    opens.take()  # (the fresh build's)
    zeros = cache.images(col, 8, on_error="zero")  # on_error is not in the recipe
    assert sorted(opens.take()) == sorted(col[300:]) and counts(zeros) == (2, 0, 300)
    assert zeros.valid.tolist() == [True] * 300 + [False, False]
    np.testing.assert_array_equal(zeros.array, fresh(tmp_path, col, on_error="zero"))
    kept = [e for e in cache.entries() if e.failed_build is not None]
    assert [e.failed_rows for e in kept] == [2] and kept[0].rows == 302


def test_a_failed_build_is_not_an_entry_and_ls_and_clear_show_and_remove_it(
        cache, cache_root, pictures, tmp_path, capsys):
    col = with_bad_rows(pictures, tmp_path, 20)
    with pytest.raises(cachekit.ImageDecodeError):
        cache.images(col, 8)
    [kept] = cache.entries()
    assert kept.failed_build is not None and kept.key != kept.failed_build
    with pytest.raises(cachekit.ImageDecodeError):  # never a hit, though its key is there
        cachekit.Cache(cache_root, workers=1, progress=False, lock_timeout=5).images(col, 8)
    capsys.readouterr()
    assert cli_main(["--root", str(cache_root), "ls"]) == 0
    out = capsys.readouterr().out
    assert "no entries in" in out
    assert (f"failed build of {kept.failed_build[:12]}: 2 rows failed; 20 rows kept as "
            f"{kept.key[:12]} (") in out and "), which the next build of them reuses" in out
    assert cli_main(["--root", str(cache_root), "info", kept.failed_build[:12]]) == 0
    assert "kept rows of" in capsys.readouterr().out
    assert cli_main(["--root", str(cache_root), "clear", "--all", "--yes"]) == 0
    assert cache.entries() == []
    assert [p for p in (cache_root / "index").iterdir()] == []  # no empty recipe folders


def test_switching_validate_copies_every_row_whose_file_proves_unchanged(
        cache, pictures, decodes, opens, tmp_path):
    col = column(pictures, range(200))
    cache.images(col, 8)
    decodes.take()
    os.utime(pictures[7], ns=(3, 3))  # its recorded stat no longer holds
    opens.take()
    stat = cache.images(col, 8, validate="stat")  # validate is not in the recipe either
    assert opens.take() == [pictures[7]] and counts(stat) == (1, 0, 199)
    np.testing.assert_array_equal(stat.array, fresh(tmp_path, col, validate="stat"))
    decodes.take()
    content = cache.images(col, 8, validate="content")  # no digest recorded: decoded
    assert len(decodes.take()) == 200 and counts(content) == (200, 0, 0)
    _write_picture(Path(pictures[9]), 77)
    again = cache.images(col[:150], 8, validate="content")  # digests recorded now
    assert decodes.take() == [pictures[9]] and counts(again) == (1, 0, 149)
    np.testing.assert_array_equal(again.array, fresh(tmp_path, col[:150]))


def test_a_hit_finds_one_changed_file_among_many_off_its_own_path(cache, pictures, capsys):
    col = column(pictures, range(N))
    cache.images(col, 8)
    os.utime(pictures[N - 3], ns=(5, 5))  # one file among 600: a sample of 16 may miss it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.images(col, 8).hit
        staleness.wait_for_checks(timeout=60)
    assert [w.category for w in caught] == [StaleEntryWarning]
    assert pictures[N - 3] in str(caught[0].message) and 'validate="stat"' in str(
        caught[0].message)
    assert pictures[N - 3] not in capsys.readouterr().err  # said once: the warning alone
    healed = cache.images(col, 8)  # the next call builds it again: one decode
    assert (healed.outcome, healed.rows_decoded, healed.rows_reused) == ("built", 1, N - 1)


def test_the_stale_check_of_a_hit_can_be_turned_off(cache, pictures, monkeypatch):
    col = column(pictures, range(40))
    cache.images(col, 8)
    for path in pictures[:40]:
        os.utime(path, ns=(5, 5))
    monkeypatch.setenv("CACHEKIT_STALE_CHECK", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.images(col, 8).hit
    monkeypatch.setenv("CACHEKIT_STALE_CHECK", "everything")
    with pytest.raises(cachekit.InvalidArgument, match="CACHEKIT_STALE_CHECK"):
        cache.images(col, 8)
