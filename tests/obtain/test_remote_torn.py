"""A bucket never holds a torn entry (a manifest naming data that is gone), and a broken
remote entry never stops a build: real processes against a real S3 server (SeaweedFS on
loopback), with leases of 0.5 s, or 1 s where a waiter must not take over a lease that
beats (a loaded machine may delay a beat).

Each case is one way a torn entry came about: a create-only manifest write whose answer
comes after the timeout, an uploader stopped (SIGSTOP) across a sweep, a sweep whose clock
is 30 s ahead, a sweep that let generation numbers start again, and a reader that meets a
torn entry. Each ends with one valid remote entry (``verify --remote`` finds no problem),
no caller raising, and no second build unless a lease truly expired: every decoded row
appends one line to a counter file, so builds are counted, not timed.
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
import time
from pathlib import Path

import numpy as np
import pytest

import cachekit
import hosts
import s3
from helpers import IN_THE_BACKGROUND, lines_in, one_valid_entry, remote_object
from cachekit.cli import main
from cachekit.admin import remote_clear as rm
from cachekit.admin.remote_verify import verify as verify_remote
from cachekit.errors import RemoteWarning
from cachekit.obtain import background
from cachekit.store.remote import RemoteStore
from cachekit.store.lease import generations, lease_path

ROWS = 48
LEASE = 0.5
BEATING = 1.0
"""The lease of tests where a waiter must not take over a lease that beats."""


def quiet(lease: float) -> float:
    """Seconds after which what a stopped uploader wrote is older than twice ``lease`` by
    the store's whole-second clock (see cachekit.admin.remote.STORE_TIME_SLACK): a sweep then
    judges it abandoned."""
    return 2 * lease + rm.STORE_TIME_SLACK + 1.1


AGENT = textwrap.dedent('''
    import hashlib, os, signal, sys, time
    from pathlib import Path
    import numpy as np
    import cachekit
    import hosts
    from cachekit.store import remote as remote_store

    work, me, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")

    def row(v):
        with open(work / "decoded", "a") as f:
            f.write(me + "\\n")
        return np.full((3, 8, 8), v % 251, dtype=np.uint8)

    def pause(marker):
        """Say where we are, then stop (SIGSTOP: every thread, the lease's too) or hold
        (the main thread waits for a file; the lease keeps beating)."""
        (work / f"{marker}.{me}").touch()
        if "stop" in mode:
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            while not (work / f"go.{me}").exists():
                time.sleep(0.02)

    if "before-manifest" in mode:
        create = remote_store.RemoteStore.create
        def pausing(self, path, data, what, **options):
            if path.endswith("manifest.json") and not (work / f"at-manifest.{me}").exists():
                pause("at-manifest")
            return create(self, path, data, what, **options)
        remote_store.RemoteStore.create = pausing
    elif "before-upload" in mode:
        upload = remote_store.RemoteStore.upload
        def pausing(self, published, **options):
            pause("at-upload")
            return upload(self, published, **options)
        remote_store.RemoteStore.upload = pausing

    if "barrier" in mode:  # started early: the interpreter is ready when it is let go
        hosts.StartBarrier(work).wait(me)
    entry = cachekit.Cache(workers=2, progress=False).map(row, list(range(ROWS)))
    hosts.report(source=entry.source, key=entry.key,
                 sha=hashlib.sha256(entry.array.tobytes()).hexdigest())
''').replace("ROWS", str(ROWS))

SWEEP_30_S_AHEAD = textwrap.dedent('''
    import os, sys, time
    real = time.time
    time.time = lambda: real() + 30.0  # this host's clock, 30 s ahead of the store's
    from cachekit.cli import main
    while not os.path.exists(sys.argv[1]):  # started early, to run when the test says
        time.sleep(0.02)
    raise SystemExit(main(["clear", "--remote", "--older-than", "7d", "--yes"]))
''')


@pytest.fixture
def work(tmp_path: Path):
    path = tmp_path / "work"
    path.mkdir()
    started: list[hosts.HostProcess] = []
    yield path, started
    for process in started:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        process.reap()


def agent(work, root: Path, env: dict[str, str], me: str, mode: str = "run", *,
          lease: float = LEASE) -> hosts.HostProcess:
    """Start the agent script with cache root ``root`` (one root is one host). ``mode``:
    flags joined by commas: ``barrier`` (wait for the start barrier), ``before-manifest``
    or ``before-upload`` (pause there), ``stop`` (pause by SIGSTOP, else by waiting for
    the file ``go.ME``)."""
    folder, started = work
    script = folder / "agent.py"
    if not script.exists():
        script.write_text(AGENT)
    process = hosts.HostProcess(me, [str(script), me, mode],
                                [sys.executable, str(script), str(folder), me, mode],
                                hosts.child_env({**env, "CACHEKIT_LOCK_LEASE": str(lease),
                                                 "CACHEKIT_DIR": str(root)}))
    started.append(process)
    return process


def stopped(process: hosts.HostProcess) -> bool:
    with open(f"/proc/{process.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def reached(work, marker: str, process: hosts.HostProcess, *, stop: bool) -> None:
    hosts.wait_for(lambda: (work[0] / f"{marker}.{process.host}").exists()
                   and (not stop or stopped(process)),
                   timeout=120, what=f"{process.host} to reach {marker}", watch=[process])


def expected_sha() -> str:
    return hashlib.sha256(np.stack([np.full((3, 8, 8), v % 251, dtype=np.uint8)
                                    for v in range(ROWS)]).tobytes()).hexdigest()


def one_entry_of(remote: RemoteStore, capsys) -> str:
    """:func:`helpers.one_valid_entry`, which ``cachekit verify --remote`` finds whole too;
    its key."""
    key = one_valid_entry(remote)
    assert main(["verify", "--remote"]) == 0
    assert "no problems" in capsys.readouterr().out
    return key


def read_json(remote: RemoteStore, path: str):
    remote.fs.invalidate_cache()
    return json.loads(remote.fs.cat_file(path))


def sweep(capsys, monkeypatch) -> str:
    """The routine sweep, run here with the agents' lease; what it printed."""
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", str(LEASE))
    assert main(["clear", "--remote", "--older-than", "7d", "--yes"]) == 0
    return capsys.readouterr().out


# 1. A late answer -------------------------------------------------------------------------

UPLOADER_TIMEOUT = "10"
"""CACHEKIT_REMOTE_TIMEOUT of the uploader whose manifest create is held: it waits this long
for it. Every other call of that upload must end within it on a loaded machine (4 s timed out
plain reads under four test workers); the held create never does, whatever the load."""


def abandoned_calls_end(before: set) -> None:
    """Until the remote-call threads started since ``before`` (abandoned calls) have ended."""
    hosts.wait_for(lambda: not [t for t in threading.enumerate() if t not in before
                                and t.name == "cachekit-remote-call"],
                   timeout=30, what="the abandoned create's thread to end")


def row(v):
    return np.full((3, 8, 8), v % 251, dtype=np.uint8)


def test_a_manifest_create_answered_after_the_timeout_keeps_the_data_it_names(
        s3_server, s3_env, tmp_path, monkeypatch, capsys):
    before = set(threading.enumerate())
    # The held answer is sent only once the uploader has given up on it (released below):
    # "too late" by order, not by racing a delay against the timeout.
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), "late-answer", delay=120.0)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", UPLOADER_TIMEOUT)
        # The create lands, its answer comes too late, and the uploader reads the manifest
        # before it removes anything: it finds its own and calls it a win (no warning).
        built = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(
            row, list(range(ROWS)))
        background.wait_all()  # the upload runs after the call returns
        monkeypatch.delenv("CACHEKIT_REMOTE_TIMEOUT")  # the default from here on
        assert built.source == "built" and proxy.delayed >= 1
        proxy.released.set()  # the late answer; the abandoned create's thread ends
        abandoned_calls_end(before)
    finally:
        proxy.stop()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert "ERROR" not in capsys.readouterr().err
    assert one_entry_of(remote, capsys) == built.key
    pulled = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(
        row, list(range(ROWS)))
    assert pulled.source == "remote" and np.array_equal(pulled.array, built.array)


@IN_THE_BACKGROUND
def test_a_create_that_lands_after_a_sweep_took_its_data_withdraws_its_manifest(
        s3_server, s3_env, tmp_path, monkeypatch, capsys):
    before = set(threading.enumerate())
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), "late-request", delay=60.0)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    remote.lookup(32 * "0")  # connected now: straight to the server, not through the proxy
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", UPLOADER_TIMEOUT)
        # No answer, and no manifest yet when the uploader looks: it cannot tell, so it
        # leaves its data in place and says so; the call has its local entry.
        built = cachekit.Cache(tmp_path / "a", workers=2, progress=False).map(
            row, list(range(ROWS)))
        background.wait_all()
        monkeypatch.delenv("CACHEKIT_REMOTE_TIMEOUT")  # the sweep and the next call: default
        assert built.source == "built" and proxy.delayed >= 1
        assert re.search(f"ERROR: the background upload of entry {built.key[:12]} .* failed: "
                         ".*no answer within", capsys.readouterr().err)
        assert [len(k.uploads) for k in remote.scan()[0]] == [1]
        time.sleep(quiet(LEASE))
        assert "orphaned upload" in sweep(capsys, monkeypatch)  # its data goes
        # The create, sent again by fsspec's retries or late on the wire, lands now and
        # names data that went. When it ends, the uploader's thread finds that and
        # withdraws the manifest: a miss, never a torn entry.
        proxy.released.set()
        manifest = f"/{remote.manifest_path(built.key)}".encode()
        hosts.wait_for(lambda: proxy.late_forwarded and (b"DELETE", manifest) in proxy.log,
                       timeout=30, what="the abandoned create to withdraw its manifest")
        abandoned_calls_end(before)
    finally:
        proxy.stop()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert verify_remote(remote) == (0, [])
    with pytest.warns(RemoteWarning, match=f"background upload of entry {built.key[:12]} "
                      ".* failed: .*no answer within"):  # the next call with that remote
        again = cachekit.Cache(tmp_path / "b", workers=2, progress=False).map(
            row, list(range(ROWS)))
    background.wait_all()
    assert again.source == "built" and one_entry_of(remote, capsys) == built.key


# 2. A paused uploader ---------------------------------------------------------------------


def test_an_uploader_stopped_across_a_sweep_withdraws_its_torn_manifest_and_uploads_again(
        s3_env, work, tmp_path, monkeypatch, capsys):
    uploader = agent(work, tmp_path / "a", s3_env, "a", "stop,before-manifest")
    reached(work, "at-manifest", uploader, stop=True)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    [listed], _, _ = remote.scan()
    [stale] = listed.uploads
    time.sleep(quiet(LEASE))  # upload and lease untouched for two leases: abandoned
    out = sweep(capsys, monkeypatch)
    assert "orphaned upload" in out
    assert [k.uploads for k in remote.scan()[0]] in ([], [{}])  # the sweep removed it
    os.kill(uploader.pid, signal.SIGCONT)
    # It wakes, its manifest create wins and names data the sweep removed: it sees that,
    # withdraws the manifest and uploads again under a fresh id.
    report = hosts.finish(uploader).report()
    assert report["source"] == "built" and report["sha"] == expected_sha()
    assert one_entry_of(remote, capsys) == report["key"]
    assert remote.lookup(report["key"]).upload != stale
    assert len(lines_in(work[0] / "decoded")) == ROWS


def test_a_sweep_that_judged_an_upload_orphaned_spares_it_once_its_manifest_names_it(
        s3_env, work, tmp_path, monkeypatch, capsys):
    uploader = agent(work, tmp_path / "a", s3_env, "a", "stop,before-manifest")
    reached(work, "at-manifest", uploader, stop=True)
    time.sleep(quiet(LEASE))
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", str(LEASE))
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    plan = rm.removal_for_clear(remote, older_than=7 * 86400)  # the sweep has looked...
    assert any(x.what.startswith("orphaned") for x in plan.leftovers)
    os.kill(uploader.pid, signal.SIGCONT)  # ...and the uploader publishes before it acts
    report = hosts.finish(uploader).report()
    assert plan.execute().failed == ()
    assert one_entry_of(remote, capsys) == report["key"]
    assert report["source"] == "built" and len(lines_in(work[0] / "decoded")) == ROWS


# 3. A sweep whose clock is ahead ----------------------------------------------------------


def test_a_sweep_with_its_clock_30_s_ahead_spares_a_beating_lease_and_its_upload(
        s3_env, work, tmp_path, capsys):
    builder = agent(work, tmp_path / "a", s3_env, "a", "before-manifest", lease=BEATING)
    waiter = agent(work, tmp_path / "b", s3_env, "b", "barrier", lease=BEATING)
    go_sweep = work[0] / "go.sweep"
    ahead = hosts.HostProcess("sweep", ["sweep"],
                              [sys.executable, "-c", SWEEP_30_S_AHEAD, str(go_sweep)],
                              hosts.child_env({**s3_env, "CACHEKIT_LOCK_LEASE": str(BEATING)}))
    work[1].append(ahead)
    reached(work, "at-manifest", builder, stop=False)
    hosts.StartBarrier(work[0]).release([waiter])  # it waits: the builder's lease beats
    time.sleep(quiet(BEATING))  # the upload is old by the store's clock; the lease beats
    go_sweep.touch()
    done = hosts.finish(ahead)
    assert done.ok, done.failure()
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    after_sweep = [(len(k.uploads), generations(remote, k.key)) for k in remote.scan()[0]]
    (work[0] / "go.a").touch()
    reports = [hosts.finish(p).report() for p in (builder, waiter)]
    assert [r["source"] for r in reports] == ["built", "remote"]
    assert len(lines_in(work[0] / "decoded")) == ROWS  # the waiter never took the live lease over
    assert one_entry_of(remote, capsys) == reports[0]["key"]
    assert after_sweep == [(1, [1])] and "skipping the orphaned upload" in done.stdout


# 4. Generation numbers --------------------------------------------------------------------


def test_a_holder_that_wakes_after_a_sweep_never_writes_into_another_holders_lease(
        s3_env, work, tmp_path, monkeypatch, capsys):
    first = agent(work, tmp_path / "a", s3_env, "a", "stop,before-upload")
    second = agent(work, tmp_path / "b", s3_env, "b", "barrier,before-upload")
    reached(work, "at-upload", first, stop=True)  # built, holding generation 1
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    [listed], _, _ = remote.scan()
    key = listed.key
    time.sleep(0.8)  # its lease is more than a lease old
    sweep(capsys, monkeypatch)
    assert generations(remote, key) == [1]  # the newest generation stays
    hosts.StartBarrier(work[0]).release([second])
    reached(work, "at-upload", second, stop=False)  # took over the stopped lease, built
    record = read_json(remote, lease_path(remote, key, 2, "json"))
    assert generations(remote, key) == [1, 2] and record["pid"] == second.pid
    os.kill(first.pid, signal.SIGCONT)
    # The first holder wakes, publishes and releases its own generation, 1: the second
    # holder's lease still says it is building or uploading.
    assert hosts.finish(first).report()["source"] == "built"
    assert read_json(remote, lease_path(remote, key, 2, "beat"))["state"] != "released"
    assert read_json(remote, lease_path(remote, key, 1, "beat"))["state"] == "released"
    (work[0] / "go.b").touch()
    assert hosts.finish(second).report()["source"] == "built"
    # two builds: the first lease expired
    assert sorted(set(lines_in(work[0] / "decoded"))) == ["a", "b"]
    assert len(lines_in(work[0] / "decoded")) == 2 * ROWS
    assert one_entry_of(remote, capsys) == key


# 5. A reader meets a torn entry -----------------------------------------------------------


def test_readers_on_two_hosts_that_meet_a_torn_entry_build_it_once_and_repair_it(
        s3_env, work, tmp_path, capsys):
    first = agent(work, tmp_path / "a", s3_env, "a")
    readers = [agent(work, tmp_path / name, s3_env, name, "barrier", lease=BEATING)
               for name in ("b", "c")]
    key = hosts.finish(first).report()["key"]
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    torn = remote.lookup(key).upload
    remote.fs.rm_file(remote_object(remote, key, "data.npy"))
    hosts.StartBarrier(work[0]).release(readers)
    done = [hosts.finish(r) for r in readers]
    reports = [d.report() for d in done]
    assert sorted(r["source"] for r in reports) == ["built", "remote"]
    assert {r["sha"] for r in reports} == {expected_sha()}
    assert all(d.stderr.count("RemoteWarning") == 1 and "is missing" in d.stderr
               for d in done if "built" in d.stdout)
    assert len(lines_in(work[0] / "decoded")) == 2 * ROWS  # the first build, and one repair
    assert remote.lookup(key).upload != torn
    # The rest of the torn upload (its row files) is left for `cachekit clear --remote`:
    # only its manifest is removed when it is found broken.
    remote.remove_upload(key, torn)
    assert one_entry_of(remote, capsys) == key
