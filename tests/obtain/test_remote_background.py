"""The upload after a build runs in the background (cachekit.obtain.background): the call
returns its local entry at once, the process waits for the upload before it exits, other
hosts wait for it rather than build, and a failed upload is loud and publishes nothing.
Real processes against a real S3 server (SeaweedFS on loopback).

The upload is made observable as pending, not timed: the children reach the server
through a proxy (tests/s3.py) that can hold the manifest's create-only PUT until the test
releases it. The proxy takes one request per connection and the children name it by host
name (``localhost``), so every request an upload makes at exit resolves a host name: what
fails once ``concurrent.futures`` has shut its pools down, the shutdown trap the exit wait
must avoid. Each decoded row appends a line to a counter file per host, so builds are
counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import cachekit
import hosts
import s3
from helpers import IN_THE_BACKGROUND, lines_in, one_valid_entry
from cachekit import processes
from cachekit.admin.remote_verify import verify as verify_remote
from cachekit.obtain import background
from cachekit.store import LocalStore
from cachekit.store.remote import RemoteStore

ROWS = 48

AGENT = textwrap.dedent('''
    import hashlib, json, os, signal, sys, warnings
    from pathlib import Path
    import numpy as np
    import cachekit
    import hosts
    from cachekit.errors import RemoteWarning
    from cachekit.obtain import background
    from cachekit.store import lease as leases
    from cachekit.store.remote import RemoteStore

    work, me, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    # As in a terminal, whatever the test runner's own SIGINT (a shell's background job
    # inherits it ignored, and Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def row(v):
        with open(work / f"decoded.{me}", "a") as f:
            f.write("x\\n")
        return np.full((3, 8, 8), v % 251, dtype=np.uint8)

    def say(name, text):  # whole, or not at all, for the test that polls for it
        (work / f".{name}").write_text(text)
        (work / f".{name}").rename(work / name)

    if "watch" in mode:  # say whom we wait for when we first find a live lease
        take = leases.Watch.take_or_wait
        def watching(self, *args, **kwargs):
            got = take(self, *args, **kwargs)
            if got is None and not (work / f"waiting.{me}").exists():
                say(f"waiting.{me}", self.describe())
            return got
        leases.Watch.take_or_wait = watching

    cache = cachekit.Cache(workers=2, progress=False)
    entry = cache.map(row, list(range(ROWS)))
    returned = {"source": entry.source, "key": entry.key,
                "sha": hashlib.sha256(entry.array.tobytes()).hexdigest(),
                "manifest_after_call":
                    RemoteStore(os.environ["CACHEKIT_REMOTE"]).lookup(entry.key) is not None}
    say(f"returned.{me}", json.dumps(returned))
    if "again" in mode:  # once the upload is over, another call with that remote
        background.wait_all()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned["again"] = cache.map(row, list(range(ROWS))).source
        returned["warnings"] = [str(w.message) for w in caught
                                if issubclass(w.category, RemoteWarning)]
    hosts.report(**returned)
''').replace("ROWS", str(ROWS))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def proxy(s3_server: s3.Seaweed) -> Iterator[s3.Proxy]:
    """A forwarding proxy in front of the session's server; a test that sets its mode to
    ``late-request`` holds every manifest create until it sets ``released``."""
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), "forward", delay=600.0)
    try:
        yield proxy
    finally:
        proxy.stop()


def through(proxy: s3.Proxy, env: dict[str, str], **extra: str) -> dict[str, str]:
    """``env`` with the remote reached through ``proxy``, named by host name, which
    aiohttp then resolves for every request (no DNS cache, whose entries would otherwise
    last 10 s)."""
    return {**env, "AWS_ENDPOINT_URL": f"http://localhost:{proxy.port}",
            "CACHEKIT_REMOTE_TIMEOUT": "120", "FSSPEC_S3": json.dumps(
                {"config_kwargs": {"connector_args": {"use_dns_cache": False}}}), **extra}


def agent(work: Path, root: Path, env: dict[str, str], me: str, mode: str = "run"
          ) -> hosts.HostProcess:
    """Start the agent script with cache root ``root`` (one root is one host); ``mode``:
    flags joined by commas, ``watch`` (say whom it waits for) and ``again`` (call again
    once the upload is over)."""
    script = work / "agent.py"
    if not script.exists():
        script.write_text(AGENT)
    return hosts.HostProcess(me, [str(script), me, mode],
                             [sys.executable, str(script), str(work), me, mode],
                             hosts.child_env({**env, "CACHEKIT_DIR": str(root)}))


def returned(work: Path, me: str) -> dict:
    return json.loads((work / f"returned.{me}").read_text())


def held_after_its_call(work: Path, proxy: s3.Proxy, process: hosts.HostProcess) -> None:
    """Wait until ``process``'s call has returned and its manifest create is held."""
    hosts.wait_for(lambda: proxy.delayed and (work / f"returned.{process.host}").exists(),
                   timeout=120, what=f"{process.host}'s call to return and its upload to "
                   "reach the manifest", watch=[process])


def one_entry_of(remote: RemoteStore, tmp_path: Path, sha: str) -> str:
    """:func:`helpers.one_valid_entry`, whose pixels hash to ``sha``; its key."""
    key = one_valid_entry(remote)
    published, _ = remote.download(remote.lookup(key), LocalStore(tmp_path / "check"))
    data = np.load(published.path / "data.npy", mmap_mode="r")
    assert hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest() == sha
    return key


@IN_THE_BACKGROUND
def test_the_call_returns_before_its_upload_ends_and_the_process_waits_for_it_to_exit(
        s3_env, work, tmp_path, proxy):
    proxy.mode = "late-request"
    uploader = agent(work, tmp_path / "a", through(proxy, s3_env), "a")
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    try:
        held_after_its_call(work, proxy, uploader)
        called = returned(work, "a")
        assert called["source"] == "built" and called["manifest_after_call"] is False
        assert remote.lookup(called["key"]) is None  # the upload still runs...
        assert uploader.poll() is None  # ...and the process, its script done, waits for it
        proxy.released.set()
        done = hosts.finish(uploader)
    finally:
        uploader.reap()
    report = done.report()
    key12 = report["key"][:12]
    assert re.search(f"]: uploading entry {key12} \\([0-9.]+ KB\\) to "
                     f"{re.escape(s3_env['CACHEKIT_REMOTE'])} in the background; the process "
                     "waits for it before exiting", done.stderr), done.stderr
    assert f"]: waiting for the upload of entry {key12}" in done.stderr
    assert f"]: uploaded entry {key12}" in done.stderr and "ERROR" not in done.stderr
    assert proxy.late_forwarded == 1
    assert one_entry_of(remote, tmp_path, report["sha"]) == report["key"]


@IN_THE_BACKGROUND
def test_a_process_that_exits_right_after_the_call_completes_its_upload(
        s3_env, work, tmp_path, proxy):
    done = hosts.finish(agent(work, tmp_path / "a", through(proxy, s3_env), "a"))
    report = done.report()
    assert report["source"] == "built" and "ERROR" not in done.stderr
    assert f"]: uploaded entry {report['key'][:12]}" in done.stderr, done.stderr
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert one_entry_of(remote, tmp_path, report["sha"]) == report["key"]


@IN_THE_BACKGROUND
def test_a_host_that_misses_during_the_upload_waits_for_it_and_downloads_never_builds(
        s3_env, work, tmp_path, proxy):
    proxy.mode = "late-request"
    uploader = agent(work, tmp_path / "a", through(proxy, s3_env), "a")
    other = None
    try:
        held_after_its_call(work, proxy, uploader)
        other = agent(work, tmp_path / "b", s3_env, "b", "watch")  # straight to the server
        hosts.wait_for(lambda: (work / "waiting.b").exists(), timeout=120,
                       what="the other host to wait for the uploader's lease", watch=[other])
        assert (work / "waiting.b").read_text() == \
            f"pid {uploader.pid} on {processes.owner()['host']} (built, uploading)"
        proxy.released.set()
        first, second = hosts.finish(uploader).report(), hosts.finish(other).report()
    finally:
        uploader.reap()
        if other is not None:
            other.reap()
    assert first["source"] == "built" and second["source"] == "remote"
    # one build:
    assert len(lines_in(work / "decoded.a")) == ROWS and not lines_in(work / "decoded.b")
    assert second["key"] == first["key"] and second["sha"] == first["sha"]
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert one_entry_of(remote, tmp_path, first["sha"]) == first["key"]


@IN_THE_BACKGROUND
def test_a_failed_background_upload_is_loud_and_publishes_nothing(s3_env, work, tmp_path,
                                                                   proxy):
    proxy.mode = "late-request"
    uploader = agent(work, tmp_path / "a", through(proxy, s3_env,
                                                   CACHEKIT_REMOTE_TIMEOUT="10"), "a", "again")
    try:
        held_after_its_call(work, proxy, uploader)
        proxy.stop()  # the store goes away with the manifest's create in flight
        done = hosts.finish(uploader)
    finally:
        uploader.reap()
    report = done.report()  # exits 0: the run had its entry
    key12, url = report["key"][:12], re.escape(s3_env["CACHEKIT_REMOTE"])
    failure = (f"the background upload of entry {key12} \\([0-9.]+ KB\\) to {url} failed: "
               f"remote {url} did not work while publishing .*/manifest.json")
    assert re.search(f"]: ERROR: {failure}.*; the local entry is good; no reader sees "
                     "a partial remote entry .*push " + key12, done.stderr), done.stderr
    # The next call with that remote (a local hit) warns in the caller's thread.
    assert report["again"] == "local" and len(report["warnings"]) == 1
    assert re.match(rf"cachekit\[[^]]*\]: {failure}", report["warnings"][0]), report["warnings"]
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert remote.lookup(report["key"]) is None  # no manifest: nothing torn, a miss
    assert verify_remote(remote) == (0, [])
    # The lease was released: another host takes it at once, builds, and publishes.
    after = hosts.finish(agent(work, tmp_path / "b", s3_env, "b")).report()
    assert after["source"] == "built" and len(lines_in(work / "decoded.b")) == ROWS
    assert verify_remote(remote) == (1, [])


@IN_THE_BACKGROUND
def test_a_ctrl_c_while_the_process_waits_at_exit_cuts_the_upload_off_and_says_so(
        s3_env, work, tmp_path, proxy):
    proxy.mode = "late-request"  # never released: the stop at teardown drops the create
    uploader = agent(work, tmp_path / "a", through(proxy, s3_env), "a")
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(uploader.stderr), daemon=True)
    reader.start()
    try:
        held_after_its_call(work, proxy, uploader)
        hosts.wait_for(lambda: any("before exiting (Ctrl-C cuts it off)" in line
                                   for line in said), timeout=120,
                       what="the uploader to wait for its upload at exit", watch=[uploader])
        os.kill(uploader.pid, signal.SIGINT)
        assert uploader.wait(timeout=120) == 0  # the script itself had done its work
        reader.join(timeout=30)
    finally:
        uploader.reap()
    key12 = returned(work, "a")["key"][:12]
    assert any(re.match(rf"cachekit\[[^]]*\]: ERROR: cut off the upload of entry {key12} \(", line)
               and "no partial entry is published" in line for line in said), "".join(said)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert remote.lookup(returned(work, "a")["key"]) is None and verify_remote(remote) == (0, [])


def row(v):
    return np.full((3, 8, 8), v % 251, dtype=np.uint8)


@IN_THE_BACKGROUND
def test_a_second_call_for_the_key_while_its_upload_runs_starts_no_second_upload(
        s3_env, tmp_path, proxy, monkeypatch, capfd):
    proxy.mode, proxy.delay = "late-request", 2.0  # held 2 s, then passed on
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    first = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(row, list(range(ROWS)))
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert first.source == "built" and background.running(remote, first.key)
    np.testing.assert_array_equal(first.array[5], row(5))  # the entry is there at once
    again = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(row, list(range(ROWS)))
    assert again.source == "local" and background.running(remote, first.key)
    # Another root in this process (another host) waits for the lease, then downloads.
    other = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(row, list(range(ROWS)))
    assert other.source == "remote"
    background.wait_all()
    manifest = f"/{remote.manifest_path(first.key)}".encode()
    assert proxy.log.count((b"PUT", manifest)) == 1 and proxy.delayed == 1
    [listed], _, _ = remote.scan()
    assert len(listed.uploads) == 1
    assert capfd.readouterr().err.count(f"uploading entry {first.key[:12]}") == 1


@IN_THE_BACKGROUND
def test_an_entry_removed_here_while_its_upload_runs_is_uploaded_whole(
        s3_env, tmp_path, monkeypatch, capfd):
    """The upload holds the entry's files from the call on: a clear here (or the budget's
    eviction after a later call) before it reads them does not cut it off."""
    from cachekit.store import remote_upload

    gate, lookup = threading.Event(), remote_upload.lookup
    monkeypatch.setattr(remote_upload, "lookup",
                        lambda bucket, key: gate.wait(60) and lookup(bucket, key))
    cache = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    entry = cache.map(row, list(range(ROWS)))
    assert entry.source == "built"
    assert [e.key for e in cache.clear([entry.key]).removed_entries] == [entry.key]
    gate.set()
    background.wait_all()
    err = capfd.readouterr().err
    assert "failed" not in err and f"uploaded entry {entry.key[:12]}" in err, err
    other = cachekit.Cache(tmp_path / "b", workers=1, progress=False).map(row, list(range(ROWS)))
    assert other.source == "remote"
    np.testing.assert_array_equal(np.asarray(other.array), np.stack([row(v) for v in range(ROWS)]))


def _pixels(v: int) -> np.ndarray:
    return np.full((2, 2), v, dtype=np.uint8)


def test_where_no_thread_may_start_at_exit_the_call_uploads_before_it_returns(
        s3_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(background, "THREADS_START_AT_EXIT", False)  # as on 3.12.0 to 3.12.2
    started, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda thread: started.append(thread.name) or start(thread))
    cache = cachekit.Cache(tmp_path / "a", remote=s3_env["CACHEKIT_REMOTE"], progress=False)
    capsys.readouterr()
    entry = cache.map(_pixels, [1, 2, 3])
    assert entry.source == "built"
    assert one_valid_entry(RemoteStore(s3_env["CACHEKIT_REMOTE"])) == entry.key  # already
    assert not [name for name in started if name.startswith("cachekit-upload")]
    said = capsys.readouterr().err  # as a background upload says it, though the call is quiet
    assert f"uploaded entry {entry.key[:12]} (" in said and " in the background" not in said


def test_an_entry_removed_here_before_its_upload_opens_it_is_said_not_failed(
        s3_env, tmp_path, monkeypatch, capfd):
    """Another process clears the entry between its commit and the moment its upload opens
    its files: there is nothing to send. The upload says so (it failed with "No such file
    or directory: data.npy ... the local entry is good", found by a soak); the call builds
    the entry again, which is uploaded."""
    from cachekit.store import remote_upload

    open_files, removed = remote_upload.open_files, []

    def removed_first(published):
        if not removed:  # "another process" clears it first
            removed.append(LocalStore(tmp_path / "a").remove_entry(published.manifest.key))
        return open_files(published)

    monkeypatch.setattr(remote_upload, "open_files", removed_first)
    entry = cachekit.Cache(tmp_path / "a", workers=1, progress=False).map(
        row, list(range(ROWS)))
    background.wait_all()
    assert removed == [True] and entry.source == "built"
    err = capfd.readouterr().err
    assert f"entry {entry.key[:12]} was removed from {tmp_path / 'a'} before its upload" in err
    assert "ERROR" not in err and f"uploaded entry {entry.key[:12]}" in err, err
    assert one_valid_entry(RemoteStore(s3_env["CACHEKIT_REMOTE"])) == entry.key
    np.testing.assert_array_equal(np.asarray(entry.array), np.stack([row(v) for v in range(ROWS)]))
