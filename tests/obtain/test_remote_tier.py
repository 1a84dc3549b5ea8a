"""The remote tier end to end, with real processes against a real S3 server (SeaweedFS on
loopback): two hosts (two local roots) sharing one bucket, SIGKILLs at the worst moments,
leases of dead hosts, and a remote that is down or stalls.

Children run the script below, keyed alike because every child runs the same file; each
decoded row appends one line to a counter file, so "one build" is counted, not timed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
import hosts
import s3
from helpers import lines_in, rewrite_entry
from cachekit import _wandb
from cachekit.cli.main import main as cli_main
from cachekit.obtain import Outcome, background, remote as remote_tier
from cachekit.errors import RemoteUnavailableError, RemoteWarning
from cachekit.store import LocalStore
from cachekit.store.bucket import Bucket
from cachekit.store.remote import RemoteStore
from cachekit.store.lease import generations, lease_path

ROWS = 64

AGENT = textwrap.dedent('''
    import hashlib, os, sys, time
    from pathlib import Path
    import numpy as np
    import cachekit
    import hosts
    from cachekit.store import bucket, remote as remote_store

    work, me, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    counter = work / os.environ.get("COUNTER", "decoded")

    def row(v):
        with open(counter, "a") as f:
            f.write("x\\n")
        time.sleep(0.01)
        return np.full((3, 8, 8), v % 251, dtype=np.uint8)

    def pause(marker):
        (work / marker).touch()
        time.sleep(3600)

    if mode == "stop-before-manifest":
        create = remote_store.RemoteStore.create
        def stopping(self, path, data, what, **options):
            if path.endswith("manifest.json"):
                pause("at-manifest")
            return create(self, path, data, what, **options)
        remote_store.RemoteStore.create = stopping
    elif mode == "stop-mid-download":
        read = remote_store.RemoteStore.read_ranges
        def stopping(self, path, size):
            for i, block in enumerate(read(self, path, size)):
                if i == 1:
                    pause("mid-download")
                yield block
        remote_store.RemoteStore.read_ranges = stopping
        bucket.RANGE_BYTES = 4096

    if mode == "barrier":
        hosts.StartBarrier(work).wait(me)
    entry = cachekit.Cache(workers=2, progress=False).map(row, list(range(ROWS)))
    hosts.report(source=entry.source, key=entry.key,
                 sha=hashlib.sha256(entry.array.tobytes()).hexdigest(),
                 fsspec="fsspec" in sys.modules)
''').replace("ROWS", str(ROWS))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def agent(work: Path, root: Path, env: dict[str, str], me: str, mode: str = "run",
          **extra: str) -> hosts.HostProcess:
    """Start the agent script with cache root ``root`` (one root is one host)."""
    script = work / "agent.py"
    if not script.exists():
        script.write_text(AGENT)
    environment = hosts.child_env({**env, "CACHEKIT_DIR": str(root), **extra})
    return hosts.HostProcess(me, [str(script), me, mode],
                             [sys.executable, str(script), str(work), me, mode], environment)


def reap(*processes: hosts.HostProcess) -> None:
    for p in processes:
        p.reap()


# Two hosts, one build --------------------------------------------------------------------


def test_two_agents_on_each_of_two_hosts_build_once_across_hosts(s3_env, work, tmp_path):
    roots = [tmp_path / "host-a", tmp_path / "host-b"]
    agents = [agent(work, roots[i // 2], s3_env, f"agent{i}", "barrier") for i in range(4)]
    try:
        hosts.StartBarrier(work).release(agents)
        reports = [hosts.finish(a).report() for a in agents]
    finally:
        reap(*agents)
    assert len(lines_in(work / "decoded")) == ROWS  # one build across both hosts
    assert len({r["sha"] for r in reports}) == 1 and len({r["key"] for r in reports}) == 1
    sources = sorted(r["source"] for r in reports)
    assert sources == ["built", "local", "local", "remote"]
    keys, unknown, _ = RemoteStore(s3_env["CACHEKIT_REMOTE"]).scan()
    assert unknown == [] and len(keys) == 1
    assert keys[0].manifest is not None and len(keys[0].uploads) == 1


def test_a_local_hit_makes_no_remote_call_and_never_imports_fsspec(s3_env, work, tmp_path):
    root = tmp_path / "host-a"
    first = agent(work, root, {**s3_env, "CACHEKIT_REMOTE": ""}, "local-only")
    assert hosts.finish(first).report()["source"] == "built"
    unreachable = {**s3_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                   "CACHEKIT_REMOTE_TIMEOUT": "1"}
    second = agent(work, root, unreachable, "hit")
    done = hosts.finish(second)
    report = done.report()
    assert report["source"] == "local" and report["fsspec"] is False
    assert "Warning" not in done.stderr


# Kills ------------------------------------------------------------------------------------


def test_an_uploader_killed_between_data_and_manifest_publishes_nothing_remotely(
        s3_env, work, tmp_path, monkeypatch):
    lease = {"CACHEKIT_LOCK_LEASE": "1"}
    uploader = agent(work, tmp_path / "host-a", {**s3_env, **lease}, "a",
                     "stop-before-manifest")
    try:
        hosts.wait_for(lambda: (work / "at-manifest").exists(), timeout=120,
                       what="the uploader to reach its manifest", watch=[uploader])
        remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
        keys, _, _ = remote.scan()
        assert len(keys) == 1 and keys[0].manifest is None and len(keys[0].uploads) == 1
        os.killpg(uploader.pid, signal.SIGKILL)
    finally:
        reap(uploader)
    key = keys[0].key
    assert remote.lookup(key) is None  # no reader sees a partial remote entry
    # The next caller on another host takes over the dead uploader's lease at once (its
    # holder is a gone process of this machine), builds, and publishes one entry.
    after = agent(work, tmp_path / "host-b", {**s3_env, **lease}, "b")
    assert hosts.finish(after).report()["source"] == "built"
    assert remote.lookup(key) is not None
    # What the killed uploader left is an orphaned upload, which clear --remote removes.
    from cachekit.admin import remote_clear as rm

    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.5")
    # Untouched for twice the lease by the store's whole-second clock, upload and leases.
    time.sleep(3.1)
    plan = rm.removal_for_clear(remote, [key[:12]], older_than=10 ** 9)
    assert plan.entries == () and [x.what.split()[0] for x in plan.leftovers] == \
        ["orphaned", "lease"]
    assert plan.execute().failed == ()
    keys, _, _ = remote.scan()
    assert len(keys[0].uploads) == 1
    # The newest lease generation stays, so that generation numbers only rise.
    assert sorted(o.path.rsplit("/", 1)[-1] for o in keys[0].leases) == ["2.beat", "2.json"]
    assert remote.lookup(key) is not None


def test_a_downloader_killed_mid_file_leaves_nothing_published(s3_env, work, tmp_path):
    built = agent(work, tmp_path / "host-a", s3_env, "a")
    key = hosts.finish(built).report()["key"]
    downloader = agent(work, tmp_path / "host-b", s3_env, "b", "stop-mid-download")
    try:
        hosts.wait_for(lambda: (work / "mid-download").exists(), timeout=120,
                       what="the download to start", watch=[downloader])
        os.killpg(downloader.pid, signal.SIGKILL)
    finally:
        reap(downloader)
    assert list((tmp_path / "host-b" / "entries").glob("*")) == []
    assert LocalStore(tmp_path / "host-b").lookup(key) is None
    again = agent(work, tmp_path / "host-b", s3_env, "b2")
    report = hosts.finish(again).report()
    assert report["source"] == "remote" and report["key"] == key
    assert len(lines_in(work / "decoded")) == ROWS


def test_a_lease_left_by_a_dead_host_is_taken_over_by_exactly_one_host(s3_env, work, tmp_path):
    scout = agent(work, tmp_path / "scout", {**s3_env, "CACHEKIT_REMOTE": ""}, "scout",
                  COUNTER="scout")
    key = hosts.finish(scout).report()["key"]
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    remote.fs.pipe_file(lease_path(remote, key, 1, "json"), json.dumps(
        {"generation": 1, "host": "a-host-that-died", "pid": 4242, "started": 0}).encode())
    remote.fs.pipe_file(lease_path(remote, key, 1, "beat"), json.dumps(
        {"seq": 7, "done": 10, "total": ROWS, "state": "building"}).encode())
    env = {**s3_env, "CACHEKIT_LOCK_LEASE": "2"}
    agents = [agent(work, tmp_path / f"host-{i % 2}", env, f"agent{i}", "barrier")
              for i in range(4)]
    try:
        hosts.StartBarrier(work).release(agents)
        done = [hosts.finish(a) for a in agents]
        reports = [d.report() for d in done]
    finally:
        reap(*agents)
    assert len(lines_in(work / "decoded")) == ROWS
    assert generations(remote, key) == [1, 2]  # one takeover, by one host
    assert sorted(r["source"] for r in reports) == ["built", "local", "local", "remote"]


# A remote that fails -----------------------------------------------------------------------


def row(v):
    return np.full((3, 8, 8), v % 251, dtype=np.uint8)


def _logged(log: list, fn):
    """``fn``, appending the arguments of each call to ``log`` first."""
    def logged(*args, **kwargs):
        log.append(args)
        return fn(*args, **kwargs)
    return logged


def test_a_stopped_server_warns_once_and_the_entry_is_built_locally(tmp_path, monkeypatch,
                                                                    capsys):
    """The first miss tries the remote, warns and builds; the misses of the next
    RETRY_AFTER seconds build without trying it (each try of a remote that is down costs
    up to its timeout), each saying so; after that, a miss tries it again."""
    from cachekit.store import bucket as bucket_module
    from cachekit.store.bucket import Bucket

    reason = s3.why_no_server()
    if reason:
        pytest.skip(reason)
    server = s3.Seaweed(tmp_path / "seaweed").start()
    env = server.env(f"down-{uuid.uuid4().hex[:8]}")
    server.stop()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", "5")
    tried: list[tuple] = []  # Bucket.call's arguments, once a call
    attempts: list[tuple] = []  # within's, once a try of a call
    monkeypatch.setattr(Bucket, "call", _logged(tried, Bucket.call))
    monkeypatch.setattr(bucket_module, "within", _logged(attempts, bucket_module.within))
    cache = cachekit.Cache(tmp_path / "root", workers=2, progress=None)
    with pytest.warns(RemoteWarning, match="carrying on with the local cache"):
        entry = cache.map(row, list(range(10)))
    assert entry.source == "built" and tried
    assert len(attempts) == len(tried)  # botocore retried the refused connects; no one again
    tried.clear()
    capsys.readouterr()
    again = cache.map(row, list(range(11)))  # no second try, no second warning
    assert again.source == "built" and tried == []
    assert re.search(r"remote s3://\S+ failed \d+ s ago in this process: entry [0-9a-f]{12} "
                     "is built here without it", " ".join(capsys.readouterr().err.split()))
    monkeypatch.setattr(remote_tier, "RETRY_AFTER", 0.0)
    assert cache.map(row, list(range(12))).source == "built" and tried  # tried again
    assert env["AWS_SECRET_ACCESS_KEY"] not in str(remote_tier._warned)


def test_a_bucket_that_does_not_exist_warns_once_and_the_entry_is_built_locally(
        s3_env, tmp_path, monkeypatch, capsys):
    """A typo in the bucket's name: the server answers NoSuchBucket (404) to every call,
    which is the remote not working, never a missing object (a miss, and then a
    FileNotFoundError out of the lease's write); ``cachekit push`` and ``ls --remote`` say
    it and exit 1."""
    remote = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p"
    monkeypatch.setenv("CACHEKIT_REMOTE", remote)
    cache = cachekit.Cache(tmp_path / "root", workers=2, progress=False)
    with pytest.warns(RemoteWarning, match="(?s)bucket does not exist.*carrying on with the "
                                           "local cache"):
        entry = cache.map(row, list(range(10)))
    assert entry.source == "built"
    with pytest.raises(RemoteUnavailableError, match="NoSuchBucket"):  # not "no entry"
        RemoteStore(remote).lookup(entry.key)
    capsys.readouterr()
    for command in (["push", entry.key], ["ls", "--remote"]):
        assert cli_main(["--root", str(tmp_path / "root"), *command]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"cachekit: error: remote {remote} did not work while "), err
        assert "The specified bucket does not exist (HTTP 404 NoSuchBucket)" in err


def test_a_stalled_remote_warns_once_and_no_call_hangs_past_the_timeout(s3_server, s3_env,
                                                                        tmp_path, monkeypatch):
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), mode="stall")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", "2")
        cache = cachekit.Cache(tmp_path / "root", workers=2, progress=False)
        started = time.monotonic()
        with pytest.warns(RemoteWarning, match="no answer within 2 s"):
            entry = cache.map(row, list(range(10)))
        # Only the lookup was tried; it gave up at its deadline (the stall never ends).
        assert entry.source == "built" and time.monotonic() - started < 60
    finally:
        proxy.stop()


def test_the_wandb_summary_says_the_entry_was_downloaded(s3_env, tmp_path):
    built = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(row, [1, 2, 3])
    assert built.source == "built"
    pulled = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(row, [1, 2, 3])
    assert pulled.source == "remote" and pulled.hit
    published = LocalStore(tmp_path / "b").lookup(pulled.key)
    fields = _wandb.summary_fields(Outcome(published, "remote"), run_id="r")
    assert fields["cachekit/source"] == "remote" and fields["cachekit/hit"] is True
    assert fields["cachekit/build_seconds"] == 0.0


def test_remote_none_reads_the_environment_and_empty_means_local_only(s3_env, tmp_path,
                                                                      monkeypatch):
    assert cachekit.Cache(tmp_path).remote == s3_env["CACHEKIT_REMOTE"]
    assert cachekit.Cache(tmp_path, remote="").remote is None
    monkeypatch.setenv("CACHEKIT_REMOTE", "")
    assert cachekit.Cache(tmp_path).remote is None
    with pytest.raises(TypeError):
        cachekit.Cache(tmp_path, remote=Path("/x"))
    with pytest.raises(cachekit.InvalidArgument, match="name a bucket or folder after s3://"):
        cachekit.Cache(tmp_path, remote="s3://")  # fsspec would write to a folder "s3:"
    unknown = cachekit.Cache(tmp_path / "unknown", remote="nosuch://bucket/p")
    with pytest.raises(cachekit.InvalidArgument, match="Protocol not known: nosuch"):
        unknown.map(row, [1, 2])  # on the first miss: a hit never opens the remote
    monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CACHEKIT_REMOTE_TIMEOUT"):
        cachekit.Cache(tmp_path, remote="s3://b/p")


def test_a_host_waiting_for_another_hosts_live_lease_names_it_and_honours_lock_timeout(
        s3_env, tmp_path):
    scout = cachekit.Cache(tmp_path / "scout", remote="", workers=2, progress=False)
    key = scout.map(row, list(range(12))).key
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    remote.fs.pipe_file(lease_path(remote, key, 1, "json"), json.dumps(
        {"generation": 1, "host": "node7", "pid": 4242, "started": 0}).encode())
    remote.fs.pipe_file(lease_path(remote, key, 1, "beat"), json.dumps(
        {"seq": 3, "done": 5, "total": 12, "state": "building"}).encode())
    waiting = cachekit.Cache(tmp_path / "b", lock_timeout=1.5, workers=2, progress=False)
    with pytest.raises(cachekit.LockTimeout, match=r"pid 4242 on node7 \(5/12 rows, 42%\)"):
        waiting.map(row, list(range(12)))
    assert list((tmp_path / "b" / "entries").glob("*")) == []
    assert generations(remote, key) == [1]  # a live lease is never taken over


def test_a_remote_entry_that_disagrees_with_the_call_is_refused_and_built_here(
        s3_env, tmp_path, cover_paths, capfd):
    """An unsigned remote entry of the call's key whose manifest says <u2, consistent with
    its data in every other respect: the caller refuses it before downloading a byte (a
    broken entry: it warns), builds its own uint8 (N, C, H, W) entry and puts it in the
    bucket in place of the refused one, and the next call is a local hit."""
    column = pd.Series(cover_paths)
    scout = cachekit.Cache(tmp_path / "scout", remote="", workers=2, progress=False)
    good = scout.images(column, 8)
    pixels = np.array(good.array)
    rewrite_entry(good.path, pixels.astype("<u2") * 257)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert remote.upload(LocalStore(tmp_path / "scout").lookup(good.key))
    assert remote.lookup(good.key).manifest.dtype == np.dtype("<u2")
    cache = cachekit.Cache(tmp_path / "b", workers=2, progress=False)
    with pytest.warns(RemoteWarning, match=f"remote entry {good.key[:12]} is broken: .*"
                      r"does not match the call \(its dtype is <u2"):
        entry = cache.images(column, 8)
    assert entry.source == "built" and entry.key == good.key
    assert entry.array.dtype == np.uint8 and entry.array.shape == pixels.shape
    np.testing.assert_array_equal(np.asarray(entry.array), pixels)
    background.wait_all()  # the upload runs after the call returns
    assert remote.lookup(good.key).manifest.dtype == np.uint8  # repaired
    assert cache.images(column, 8).source == "local"


def test_an_entry_removed_from_the_remote_while_it_downloads_is_built_here(
        s3_env, tmp_path, monkeypatch, capsys):
    """Another host's ``cachekit clear --remote`` removes the entry (its manifest first, then
    its objects) after this process found it and before it read its data. The call builds
    the entry here, where it raised FileNotFoundError out of the download (found by a soak
    of four agents with a clear every few seconds), and ``cachekit pull`` says the entry
    was removed, exit 1, where it failed the same way."""
    built = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(row, list(range(40)))
    background.wait_all()
    read_ranges, removed = Bucket.read_ranges, []

    def removed_first(self, path, size):
        if not removed:  # "another host" clears the entry: manifest, then its objects
            removed.append(RemoteStore(s3_env["CACHEKIT_REMOTE"]).remove_entry(built.key))
        return read_ranges(self, path, size)

    monkeypatch.setattr(Bucket, "read_ranges", removed_first)
    entry = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(row, list(range(40)))
    assert removed == [True] and entry.source == "built"
    np.testing.assert_array_equal(np.asarray(entry.array), np.asarray(built.array))
    assert list((tmp_path / "b" / "tmp").iterdir()) == []  # the download's directory went

    background.wait_all()  # (the call uploaded its entry)
    removed.clear()
    capsys.readouterr()
    assert cli_main(["--root", str(tmp_path / "c"), "pull", built.key]) == 1
    assert removed == [True]
    assert f"{built.key} was removed from" in capsys.readouterr().err


def test_an_object_that_goes_while_it_downloads_under_a_manifest_that_stays_is_repaired(
        s3_env, tmp_path, monkeypatch):
    """The data object goes while a call reads it, and the manifest naming it stays: the
    remote entry is broken, not removed. The call warns so, builds the entry, and uploads
    it in place of the broken one: the next host downloads it whole."""
    built = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(row, list(range(40)))
    background.wait_all()
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    torn = remote.lookup(built.key).upload
    read_ranges, removed = Bucket.read_ranges, []

    def object_removed_first(self, path, size):
        if not removed:
            self.remove([path], "removing it for the test")
            removed.append(path)
        return read_ranges(self, path, size)

    monkeypatch.setattr(Bucket, "read_ranges", object_removed_first)
    with pytest.warns(RemoteWarning, match=f"remote entry {built.key[:12]} is broken: .*"
                      "a data object it lists went missing while it was read"):
        entry = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(
            row, list(range(40)))
    assert removed and entry.source == "built"
    background.wait_all()
    monkeypatch.setattr(Bucket, "read_ranges", read_ranges)
    assert remote.lookup(built.key).upload != torn  # replaced
    again = cachekit.Cache(tmp_path / "c", workers=2, progress=False).map(row, list(range(40)))
    assert again.source == "remote"
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(built.array))
