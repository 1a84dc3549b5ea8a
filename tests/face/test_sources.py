"""Columns of fsspec URLs as image sources (issue 34), against the suite's real S3 server
(SeaweedFS on 127.0.0.1, tests/s3.py): a bucket of covers builds to the bytes of a build of
the local copies, mixed with local paths and ``file://`` URLs; a missing object and one over
the read cap are failed rows; a stalling server ends in failed rows, not a hang; an object
rewritten in place under ``validate="path"`` and ``"stat"``; incremental reuse across URL
columns; two agents sharing one build; the Dask executor. Every test leaves nothing in the
bucket (the fixture checks) and only its own temporary root.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
import warnings
from pathlib import Path
from typing import Iterator

import filelock
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cachekit
import hosts
import s3
from cachekit import urls
from cachekit.engine.decoding import fetch

COVERS = 24
SIZE = (32, 24)


class Bucket:
    """Covers uploaded under a fresh prefix: their URLs, their local copies, the s3fs
    filesystem that wrote them (made from the test's environment, as cachekit's is)."""

    def __init__(self, fs, bucket: str, prefix: str, local: list[str]) -> None:
        self.fs, self.bucket, self.prefix, self.local = fs, bucket, prefix, local
        self.urls = [f"s3://{bucket}/{prefix}/covers/{Path(p).name}" for p in local]

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{name}"

    def put(self, name: str, data: bytes) -> str:
        self.fs.pipe_file(self.url(name), data)
        return self.url(name)


@pytest.fixture
def covers(s3_env, s3_server: s3.Seaweed, tmp_path: Path, monkeypatch) -> Iterator[Bucket]:
    """COVERS covers in s3://BUCKET/PREFIX/covers/ and on disk; the prefix is removed
    afterwards and checked empty. The remote tier is off (the sources are the subject)."""
    import s3fs

    from cachekit.samples import write_sample_images

    monkeypatch.delenv("CACHEKIT_REMOTE")
    monkeypatch.setenv(urls.TIMEOUT_ENV, "5")
    local = write_sample_images(tmp_path / "covers", COVERS, seed=3)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    prefix = f"src-{uuid.uuid4().hex[:10]}"
    bucket = Bucket(fs, s3_server.bucket, prefix, local)
    fs.pipe({u: Path(p).read_bytes() for u, p in zip(bucket.urls, local)})
    try:
        yield bucket
    finally:
        fs.rm(f"{s3_server.bucket}/{prefix}", recursive=True)
        fs.invalidate_cache()
        assert not [name for name in fs.find(f"{s3_server.bucket}/{prefix}")
                    if name.startswith(f"{s3_server.bucket}/{prefix}/")]


def new_cache(root: Path, **options) -> cachekit.Cache:
    return cachekit.Cache(root, remote="", workers=2, progress=False, **options)


def test_a_url_column_builds_the_bytes_of_its_local_copies(covers, tmp_path):
    from_bucket = new_cache(tmp_path / "a").images(covers.urls, SIZE)
    from_disk = new_cache(tmp_path / "b").images(covers.local, SIZE)
    assert from_bucket.source == "built" and from_bucket.valid.all()
    assert np.array_equal(from_bucket.array, from_disk.array)
    again = new_cache(tmp_path / "a").images(pd.Series(covers.urls), SIZE)
    assert again.source == "local" and again.key == from_bucket.key


def test_s3fs_own_reads_give_the_same_rows(covers, tmp_path, monkeypatch):
    monkeypatch.setenv(urls.PRESIGNED_ENV, "0")  # _cat_file, not presigned GETs
    column = covers.urls[:6] + [covers.url("covers/gone.jpg")]
    entry = new_cache(tmp_path / "a").images(column, SIZE, on_error="zero")
    local = new_cache(tmp_path / "b").images(covers.local[:6], SIZE)
    assert entry.valid.tolist() == [True] * 6 + [False]
    assert np.array_equal(entry.array[:6], local.array)


def test_a_column_mixes_local_paths_file_urls_and_s3_urls(covers, tmp_path):
    mixed = [covers.local[i] if i % 3 == 0 else
             (Path(covers.local[i]).as_uri() if i % 3 == 1 else covers.urls[i])
             for i in range(COVERS)]
    entry = new_cache(tmp_path / "a").images(mixed, SIZE, backend="pil")
    local = new_cache(tmp_path / "b").images(covers.local, SIZE, backend="pil")
    assert entry.valid.all()
    assert np.array_equal(entry.array, local.array)


def test_a_missing_object_and_one_over_the_cap_are_failed_rows(covers, tmp_path, monkeypatch):
    big = covers.put("big.jpg", Path(covers.local[0]).read_bytes() + bytes(200_000))
    column = covers.urls[:4] + [covers.url("covers/gone.jpg"), big]
    monkeypatch.setenv("CACHEKIT_MAX_READ_BYTES", "150000")
    with pytest.raises(cachekit.ImageDecodeError) as raised:
        new_cache(tmp_path / "a").images(column, SIZE)
    (row4, url4, why4), (row5, url5, why5) = raised.value.failures
    assert (row4, row5) == (4, 5) and url4 == column[4] and url5 == big
    assert "no such object" in why4
    assert "larger than the read cap of 150000 bytes" in why5
    entry = new_cache(tmp_path / "a").images(column, SIZE, on_error="zero")
    assert entry.valid.tolist() == [True] * 4 + [False, False]
    assert not entry.array[4].any() and not entry.array[5].any() and entry.array[0].any()


def test_no_credential_reaches_a_failure_or_a_repr(covers, tmp_path, s3_env):
    column = [covers.url("covers/gone.jpg")]
    with pytest.raises(cachekit.ImageDecodeError) as raised:
        new_cache(tmp_path / "a").images(column, SIZE,
                                          storage_options={"anon": False})
    text = str(raised.value) + repr(raised.value.failures)
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in text
    assert s3_env["AWS_ACCESS_KEY_ID"] not in text
    row = cachekit.engine.running.rows.ImageRow(SIZE, storage_options={"secret": "hunter2"})
    assert "hunter2" not in repr(row)
    assert urls.shown("https://u:pw@host/a.jpg?X-Amz-Signature=abc") == "https://host/a.jpg"


def test_a_stalling_server_ends_in_failed_rows_without_a_hang(covers, tmp_path, s3_server,
                                                              monkeypatch):
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), mode="stall")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv(urls.TIMEOUT_ENV, "0.3")
    monkeypatch.setenv(urls.ATTEMPTS_ENV, "2")
    try:
        with pytest.raises(cachekit.ImageDecodeError) as raised:
            new_cache(tmp_path / "a").images(covers.urls[:6], SIZE)
    finally:
        proxy.stop()
    assert len(raised.value.failures) == 6
    assert all("not read within its deadline of 0.3 s" in why  # one for all attempts
               for _, _, why in raised.value.failures)
    root = tmp_path / "a"  # no build left behind, no lock held
    assert list((root / "tmp").glob("*")) == []
    for lock_path in (root / "locks").glob("*.lock"):
        lock = filelock.FileLock(str(lock_path))
        lock.acquire(timeout=0)  # filelock.Timeout if a build still held it
        lock.release()


def test_many_requests_are_in_flight_and_the_window_bounds_what_is_held(covers, monkeypatch):
    # A deadline a loaded machine keeps: a clean-clone run of the suite once missed 5 s
    # against the loopback server. The test is about what is in flight, not how fast.
    settings = urls.FetchSettings(timeout=30, attempts=2, concurrency=64, window=1 << 30)
    column = covers.urls * 4  # 96 objects in one run
    batch = fetch.Batch(column, 1 << 20, None, settings)
    got = list(batch)
    assert all(isinstance(g, fetch.Fetched) for g in got)
    pool = fetch.pool_for("s3", None, settings)
    assert pool.most_in_flight >= 64
    assert pool.held == 0 or _settled(pool)
    small = urls.FetchSettings(timeout=30, attempts=2, concurrency=64, window=1)
    batch = fetch.Batch(covers.urls, 1 << 20, None, small)
    rows = iter(batch)
    first = next(rows)  # one object held (being decoded): nothing else may start
    pool = fetch.pool_for("s3", None, small)
    assert isinstance(first, fetch.Fetched) and pool.in_flight == 0 and pool.held > 0
    assert isinstance(next(rows), fetch.Fetched)  # the first released: the next one came
    rows.close()
    batch.close()
    assert _settled(pool)


def _settled(pool) -> bool:
    """Whether the pool's window empties (its releases run on fsspec's loop)."""
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if pool.held == 0 and pool.in_flight == 0:
            return True
        time.sleep(0.01)
    return False


# Retries -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["slowdown", "reset"])
def test_throttling_and_resets_are_retried_then_the_row_fails_naming_why(
        covers, tmp_path, s3_server, monkeypatch, mode):
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), mode=mode, fail_each=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        monkeypatch.setenv(urls.ATTEMPTS_ENV, "3")
        entry = new_cache(tmp_path / "a").images(covers.urls[:6], SIZE)
        assert entry.valid.all()  # each object refused twice (its listing too), then read
        assert sum(n for path, n in proxy.refused.items() if path.endswith(b".jpg")) == 12
        proxy.fail_each = 1000  # (aiohttp itself may resend a GET once on a reset)
        monkeypatch.setenv(urls.ATTEMPTS_ENV, "2")
        with pytest.raises(cachekit.ImageDecodeError) as raised:
            new_cache(tmp_path / "b").images(covers.urls[6:9], SIZE)
    finally:
        proxy.stop()
    why = raised.value.failures[0][2]
    assert "after 2 attempts" in why and covers.urls[6] == raised.value.failures[0][1]
    assert ("SlowDown" in why) if mode == "slowdown" else ("Error" in why)


def test_without_fsspec_or_s3fs_a_url_column_names_the_extra(tmp_path, monkeypatch):
    cache = new_cache(tmp_path / "a")
    real = urls.importlib.util.find_spec
    monkeypatch.setattr(urls.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(urls.MissingRemoteSupport, match=r"gcsfs.*cachekit\[remote\]"):
        cache.images(["gs://bucket/a.jpg"], SIZE)  # (gcsfs: "not installed")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec: ImportError
    with pytest.raises(cachekit.CachekitError, match=r"pip install \"cachekit\[remote\]\""):
        cache.images(["/data/a.jpg", "s3://bucket/a.jpg"], SIZE)
    with pytest.raises(cachekit.CachekitError, match="storage_options must be a dict"):
        cache.images(["s3://bucket/a.jpg"], SIZE, storage_options="key=secret")


def test_failed_requests_are_classified():
    assert urls.classify(FileNotFoundError("x")) == urls.MISSING
    assert urls.classify(ConnectionResetError()) == urls.RETRY
    assert urls.classify(TimeoutError()) == urls.RETRY
    assert urls.classify(PermissionError()) == urls.FINAL
    assert urls.classify(ValueError("bad")) == urls.FINAL
    assert urls.is_remote("s3://b/k") and not urls.is_remote("file:///a") \
        and urls.protocol("C:\\data\\a.jpg") is None
    assert urls.local_path("file:///data/a%20b.jpg") == "/data/a b.jpg"


# Validate, rewrites, reuse -----------------------------------------------------------------

def test_stat_signatures_come_from_one_listing_per_prefix(covers, s3_server):
    from cachekit import source_stats

    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]))
    options = {"endpoint_url": proxy.endpoint}
    try:
        stats = source_stats.stat_signature(covers.urls + [covers.url("covers/gone.jpg")],
                                             options)
    finally:
        proxy.stop()
    sizes = [Path(p).stat().st_size for p in covers.local]
    assert stats[:-1, 0].tolist() == sizes and stats[-1].tolist() == [-1, -1]
    assert len(set(stats[:-1, 1].tolist())) == COVERS  # each ETag its own
    assert [method for method, _ in proxy.log] == [b"GET"]  # one LIST, no HEAD


def test_an_object_rewritten_in_place(covers, tmp_path):
    column = covers.urls[:8]
    cache = new_cache(tmp_path / "a")
    by_path = cache.images(column, SIZE)
    by_stat = cache.images(column, SIZE, validate="stat")
    by_content = cache.images(column, SIZE, validate="content")
    covers.fs.pipe_file(column[2], Path(covers.local[20]).read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit makes no request, so it warns of nothing
        hit = cache.images(column, SIZE)
    assert hit.source == "local" and np.array_equal(hit.array, by_path.array)
    again = cache.images(column, SIZE, validate="stat")
    assert again.key != by_stat.key and again.rows_decoded == 1 and again.rows_reused == 7
    content = cache.images(column, SIZE, validate="content")
    assert content.key != by_content.key and content.rows_decoded == 1
    fresh = new_cache(tmp_path / "b").images(covers.local[:2] + covers.local[20:21]
                                             + covers.local[3:8], SIZE)
    assert np.array_equal(again.array, fresh.array)
    assert np.array_equal(content.array, fresh.array)
    # validate="path": another column holding the object copies it from an entry whose
    # recorded stat still holds (the "stat" build after the rewrite), never the stale row
    longer = cache.images(column + covers.urls[8:10], SIZE)
    assert longer.rows_decoded == 2 and longer.rows_reused == 8
    assert np.array_equal(longer.array[:8], fresh.array)


def test_rows_are_reused_across_url_columns(covers, tmp_path):
    cache = new_cache(tmp_path / "a")
    first = cache.images(covers.urls[:16], SIZE, validate="stat")
    second = cache.images(covers.urls[8:], SIZE, validate="stat")
    assert second.rows_reused == 8 and second.rows_decoded == 8
    assert np.array_equal(second.array[:8], first.array[8:])


# Joining agents, and a cluster -------------------------------------------------------------

AGENT = textwrap.dedent('''
    import hashlib, json, os, sys, time
    from pathlib import Path
    import cachekit, hosts
    from cachekit.engine.decoding import images

    work, me = Path(sys.argv[1]), sys.argv[2]
    load = images.load_image
    def counted(source, *args):
        with open(work / f"decoded.{me}", "a") as f:
            f.write("x\\n")
        time.sleep(0.02)
        return load(source, *args)
    images.load_image = counted

    column = json.loads((work / "column.json").read_text())
    hosts.StartBarrier(work).wait(me)
    entry = cachekit.Cache(workers=2, progress=False, remote="").images(column, (32, 24))
    hosts.report(source=entry.source, key=entry.key, joined=entry.rows_joined,
                 sha=hashlib.sha256(entry.array.tobytes()).hexdigest())
''')


def test_two_agents_share_one_build_of_a_url_column(covers, tmp_path, s3_env):
    import hashlib
    import json

    work = tmp_path / "work"
    work.mkdir()
    column = covers.urls + [covers.put(f"copies/{copy}/{Path(local).name}",
                                       Path(local).read_bytes())
                            for copy in (1, 2) for local in covers.local]
    # 72 distinct objects (a row that repeats another is decoded once): long enough for
    # the second agent to join
    (work / "column.json").write_text(json.dumps(column))
    (work / "agent.py").write_text(AGENT)
    env = hosts.child_env({**s3_env, "CACHEKIT_DIR": str(tmp_path / "root"),
                           "CACHEKIT_REMOTE": ""})
    agents = [hosts.HostProcess(me, ["agent.py", me],
                                [sys.executable, str(work / "agent.py"), str(work), me], env)
              for me in ("a", "b")]
    try:
        hosts.StartBarrier(work).release(agents)
        reports = [hosts.finish(a, timeout=120).report() for a in agents]
    finally:
        for a in agents:
            a.reap()
    decoded = sum(len(p.read_text().splitlines()) for p in work.glob("decoded.*"))
    assert decoded == len(column)  # one build, shared: no row decoded twice
    assert len({r["key"] for r in reports}) == 1 and len({r["sha"] for r in reports}) == 1
    assert sorted(r["source"] for r in reports)[0] == "built"
    local = new_cache(tmp_path / "local").images(covers.local * 3, SIZE)
    assert reports[0]["sha"] == hashlib.sha256(np.asarray(local.array).tobytes()).hexdigest()


def test_cachekits_worker_processes_fetch_url_rows(covers, tmp_path):
    entry = new_cache(tmp_path / "a", executor="processes").images(
        covers.urls[:12] + covers.local[12:], SIZE, backend="pil")
    local = new_cache(tmp_path / "b").images(covers.local, SIZE, backend="pil")
    assert entry.valid.all() and np.array_equal(entry.array, local.array)


def test_dask_workers_fetch_their_own_rows(covers, tmp_path, monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setenv(urls.TIMEOUT_ENV, "7.5")  # settings of this test's own: its pools
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       host="127.0.0.1", dashboard_address="127.0.0.1:0")
    client = distributed.Client(cluster)
    try:
        entry = new_cache(tmp_path / "a", executor=client.get_executor()).images(
            covers.urls, SIZE, backend="pil")
        pids = client.run(_pools_of_this_settings)
    finally:
        client.close()
        cluster.close()
    local = new_cache(tmp_path / "b").images(covers.local, SIZE, backend="pil")
    assert np.array_equal(entry.array, local.array)
    assert sum(pids.values()) >= 1  # the workers fetched...
    assert _pools_of_this_settings() == 0  # ...and no object came through the builder


def _pools_of_this_settings() -> int:
    """How many fetch pools this process has for settings with a 7.5 s timeout."""
    import os

    from cachekit.engine.decoding import fetch

    return sum(1 for (pid, _, _), pool in fetch._POOLS.items() if pid == os.getpid()
               and pool.settings.timeout == 7.5)


def test_a_hit_of_a_url_column_makes_no_request_and_imports_no_store(covers, tmp_path, s3_env):
    import subprocess

    new_cache(tmp_path / "a").images(covers.urls, SIZE)
    code = ("import sys, cachekit; e = cachekit.Cache(sys.argv[1], remote='', progress=False)"
            ".images(sys.argv[2:], (32, 24)); print(e.source, 's3fs' in sys.modules, "
            "'aiobotocore' in sys.modules)")
    env = hosts.child_env({**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})  # no server
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), *covers.urls],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["local", "False", "False"], out.stderr[-2000:]


@settings(max_examples=200)
@given(st.lists(st.one_of(st.none(), st.text(alphabet="s3:/ab.\u00e9", max_size=12),
                          st.sampled_from(["s3://b/k.jpg", "gs://b/x", "file:///a.jpg",
                                           "/data/a.jpg", "c:/x"])), max_size=8),
       st.sampled_from(["str", "object", "string[python]", "string[pyarrow]"]),
       st.integers(0, 3))
def test_a_column_finds_the_protocols_of_its_urls_whatever_its_storage(values, dtype, start):
    """The pyarrow fast path (no ``:`` in the column's bytes: no URL) answers as the plain
    look at every value does, for any column, sliced or not."""
    column = pd.Series(values, dtype=dtype)[start:]
    expected = urls.remote_protocols([v for v in column.to_numpy(dtype=object)
                                      if isinstance(v, str)])
    assert urls.column_protocols(column) == expected
