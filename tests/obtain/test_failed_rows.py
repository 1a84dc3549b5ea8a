"""Failed rows are stored compactly and found in linear time (issue 41): however many rows
fail, a manifest and a failure record stay small (the first failures with their reasons,
every failed row as one bit), a reader never refuses what the writer wrote, a retry plans
in linear time, and a planted mask cannot inflate or point past the entry."""

from __future__ import annotations

import base64
import json
import os
import zlib

import numpy as np
import pandas as pd
import pytest
from PIL import Image

import cachekit
from cachekit import redaction
from cachekit.obtain import donors
from cachekit.store import manifest as manifests
from cachekit.store.records import failed_mask_text, parse_failed_mask

FAILED = 50_000
LONG = "d" * 240  # long paths: 13,000 of these made a 73 MB manifest before


@pytest.fixture(scope="module")
def column(tmp_path_factory) -> tuple[pd.Series, int]:
    """20 small images, then FAILED missing files at long paths."""
    folder = tmp_path_factory.mktemp("failed")
    good = []
    for i in range(20):
        path = folder / f"{i}.png"
        Image.fromarray(np.full((6, 5, 3), i, np.uint8)).save(path)
        good.append(str(path))
    bad = [f"{folder}/gone/{LONG}/{LONG}/{i}.png" for i in range(FAILED)]
    return pd.Series(good + bad), len(good)


def _json_sizes(root) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.rglob("*.json")}


def test_fifty_thousand_failed_rows_keep_the_manifest_small_and_the_next_call_works(
        tmp_path, column):
    paths, good = column
    cache = cachekit.Cache(tmp_path / "c", workers=2, progress=False)
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cache.images(paths, 4, backend="pil")
    assert len(caught.value.failures) == FAILED  # the error itself lists every row
    sizes = _json_sizes(tmp_path / "c")
    assert sizes and max(sizes.values()) < 256 << 10, sizes  # 73 MB of JSON before

    seen = []
    real_find = donors.find

    def counted(*args, **kwargs):
        found = real_find(*args, **kwargs)
        seen.append(found)
        return found

    donors.find = counted
    try:
        with pytest.raises(cachekit.ImageDecodeError):
            cache.images(paths, 4, backend="pil")  # the retry: the good rows are copied
    finally:
        donors.find = real_find
    assert seen[0].rows == good and seen[0].failed_before == FAILED

    entry = cache.images(paths, 4, backend="pil", on_error="zero")
    assert entry.valid.sum() == good and not entry.valid[good:].any()
    assert entry.rows_reused == good and entry.rows_decoded == FAILED
    listed = entry.manifest["failed_rows"]
    assert len(listed) == manifests.FAILURE_DETAILS
    assert listed[0][0] == good and listed[0][1] == redaction.value(paths[good])
    again = cache.images(paths, 4, backend="pil", on_error="zero")  # read back: a hit
    assert again.hit and again.valid.sum() == good
    [info] = [e for e in cache.entries() if e.key == entry.key]
    assert info.failed_rows == FAILED


def test_waiters_read_every_failed_row_from_a_bounded_record(tmp_path):
    """A failure record lists the first failures in detail and every one in its mask: a
    process that waited for the build raises an error naming all of them."""
    from cachekit.obtain import commit
    from cachekit.store import LocalStore

    rows = 5_000
    failures = [(r, f"/x/{r}.png", "FileNotFoundError: gone") for r in range(0, rows, 2)]
    store = LocalStore(tmp_path / "c")
    key = "ab" * 16
    commit._record_failure(store, key, cachekit.ImageDecodeError(failures, rows, "/"))
    [record] = (tmp_path / "c" / "locks").glob("*.failed.json")
    assert record.stat().st_size < 64 << 10
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        commit.raise_failure_seen_while_waiting(store, key, asked=0.0)
    got = caught.value.failures
    assert [r for r, _, _ in got] == [r for r, _, _ in failures]
    assert got[:manifests.FAILURE_DETAILS] == failures[:manifests.FAILURE_DETAILS]


def test_the_mask_round_trips_and_a_planted_one_is_refused():
    def fail(reason):
        return cachekit.CacheCorruptError("m", reason)

    rows = 1001
    failed = [0, 7, 8, 1000]
    mask = parse_failed_mask(failed_mask_text(rows, failed), rows, fail)
    assert np.flatnonzero(mask).tolist() == failed
    assert failed_mask_text(rows, []) is None

    def planted(raw: bytes) -> str:
        return "zlib-base64:" + base64.b64encode(zlib.compress(raw)).decode()

    bomb = planted(bytes(64 << 20))  # 64 MiB of zeros in about 64 KB
    for bad in [bomb, planted(b"\xff" * 127), planted(b"\x00" * 125 + b"\xff"), "zlib-base64:@@",
                "gzip:AAAA", 12]:
        with pytest.raises(cachekit.CacheCorruptError):
            parse_failed_mask(bad, rows, fail)


def test_a_manifest_whose_details_name_a_row_its_mask_does_not_is_corrupt(tmp_path, cover_paths):
    entry = cachekit.Cache(tmp_path / "c", progress=False).images(
        [cover_paths[0], str(tmp_path / "missing.png")], 4, on_error="zero", backend="pil")
    path = entry.path / manifests.MANIFEST_FILE
    raw = json.loads(path.read_text())
    assert raw["failed_mask"] and raw["failed_rows"][0][0] == 1
    raw["failed_rows"][0][0] = 0
    os.chmod(path, 0o644)
    path.write_text(json.dumps(raw))
    with pytest.raises(cachekit.CacheCorruptError, match="failed_mask"):
        manifests.read(entry.path)


def test_the_writer_refuses_a_manifest_a_reader_would_refuse(monkeypatch, tmp_path,
                                                               cover_paths):
    entry = cachekit.Cache(tmp_path / "c", progress=False).images(cover_paths[:2], 4,
                                                                  backend="pil")
    manifest = manifests.read(entry.path)
    monkeypatch.setattr(manifests, "WRITE_LIMIT", 1024)
    with pytest.raises(cachekit.CachekitError, match="more than the 1024 a reader accepts"):
        manifests.dumps(manifest)


def test_held_failed_ids_are_matched_on_both_words_at_scale():
    """donors._held on 200,000 rows all held as failed, and on rows that share only the
    first word: right both ways. (Its time is measured by benchmarks/bench_failures.py;
    the loop it replaced compared each row with every held id, hours at this size.)"""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**63, (200_000, 2), dtype=np.uint64)
    held = [ids[::-1].copy(), ids[:10] ^ np.uint64(1)]
    remaining = np.ones(len(ids), dtype=bool)
    remaining[:5] = False
    found = donors._held(ids, remaining, held)
    assert found.tolist() == remaining.tolist()
    other = ids.copy()
    other[:, 1] ^= np.uint64(1)  # same first word, another second: not held
    assert not donors._held(other, remaining, held).any()
