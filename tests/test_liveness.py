"""The one liveness rule (cachekit/liveness.py): a heartbeat on a timer, whatever the progress."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from cachekit import _fs, liveness, processes

NOW = 1_000_000.0


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("owner, heartbeat, abandoned, alive", [
    ({"host": "other-node", "pid": 42}, NOW - 1, False, True),       # fresh: alive
    ({"host": "other-node", "pid": 42}, NOW - 61, False, False),     # a lease without a beat
    ({"host": "other-node", "pid": 42}, NOW - 1, True, False),       # it gave up
    (None, NOW - 59, False, True),                                   # unknown owner: the beat
    (None, NOW - 61, False, False),
])
def test_the_rule_for_another_hosts_builder(owner, heartbeat, abandoned, alive):
    assert liveness.is_alive(owner, heartbeat, abandoned=abandoned, lease=60, now=NOW) is alive


def test_a_gone_process_on_this_host_is_dead_however_fresh_its_heartbeat():
    owner = {"host": _fs.host(), "pid": gone_pid()}
    assert not liveness.is_alive(owner, time.time(), lease=60)


def test_this_process_is_alive_only_where_one_of_its_heartbeats_beats(tmp_path):
    me, where = processes.owner(), tmp_path / "build"
    assert not liveness.is_alive(me, time.time(), where=where, lease=60)
    fd = os.open(tmp_path / "beat", os.O_CREAT | os.O_WRONLY)
    beat = liveness.Heartbeat(liveness.touch(fd), lease=60, where=where).start()
    try:
        assert liveness.is_alive(me, time.time(), where=where, lease=60)
    finally:
        beat.stop()
        os.close(fd)
    assert not liveness.is_alive(me, time.time(), where=where, lease=60)


def test_a_heartbeat_refreshes_its_file_on_a_timer_and_stops_when_told(tmp_path):
    path = tmp_path / "beat"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    os.utime(path, (NOW, NOW))
    beat = liveness.Heartbeat(liveness.touch(fd), lease=0.4).start()  # beats every 0.1 s
    try:
        first = os.stat(path).st_mtime
        assert first > NOW  # the first beat comes at once
        deadline = time.monotonic() + 10
        while os.stat(path).st_mtime == first:
            assert time.monotonic() < deadline, "the heartbeat never beat again"
            time.sleep(0.02)
    finally:
        beat.stop()
    os.utime(path, (NOW, NOW))
    time.sleep(0.3)
    assert os.stat(path).st_mtime == NOW  # stopped: nothing touches the file any more
    os.close(fd)


def test_a_heartbeat_runs_any_beat_on_its_timer_and_none_after_stop():
    beats = []
    beat = liveness.Heartbeat(lambda: beats.append(time.monotonic()), lease=0.2).start()
    try:
        assert len(beats) == 1  # the first beat, before start returns
        deadline = time.monotonic() + 10
        while len(beats) < 3:
            assert time.monotonic() < deadline, "the heartbeat stopped beating"
            time.sleep(0.02)
    finally:
        beat.stop()
    stopped = len(beats)
    time.sleep(0.2)
    assert len(beats) == stopped  # stop() waits for the thread: nothing beats after it
    beat.stop()  # idempotent


def test_a_heartbeat_due_sooner_than_the_timer_wakes_beats_on_time(monkeypatch):
    """Adding a heartbeat wakes the timer only when it is due before the timer's next
    wake (each hold adds one, most due after it): one due sooner still beats on time, and
    one due later does not hold it up."""
    timer = liveness._Timer()
    monkeypatch.setattr(liveness, "_timer", timer)
    slow = liveness.Heartbeat(lambda: None, lease=400).start(at_once=False)  # every 100 s
    time.sleep(0.1)  # the timer waits for it now
    beats: list[float] = []
    fast = liveness.Heartbeat(lambda: beats.append(time.monotonic()),
                              lease=0.4).start(at_once=False)  # every 0.1 s
    later = liveness.Heartbeat(lambda: None, lease=800).start(at_once=False)
    try:
        deadline = time.monotonic() + 10
        while len(beats) < 3:
            assert time.monotonic() < deadline, "the sooner heartbeat did not beat"
            time.sleep(0.02)
    finally:
        for heartbeat in (slow, fast, later):
            heartbeat.stop()


def test_a_heartbeat_stopped_by_another_beat_of_its_round_beats_no_more(monkeypatch):
    """A beat may stop another heartbeat on the timer's own thread: a collection during a
    beat finalizes an Entry, whose hold record stops beating. The round that has both due
    must neither beat it nor schedule it again (it would beat for good)."""
    timer = liveness._Timer()  # driven by hand: no thread
    monkeypatch.setattr(liveness, "_timer", timer)
    beaten = []
    first = liveness.Heartbeat(lambda: (beaten.append("first"), second.stop()), lease=4)
    second = liveness.Heartbeat(lambda: beaten.append("second"), lease=4)
    timer._due.update({first: 0.0, second: 0.0})  # both due, the first one first
    assert timer._beat_due(1.0) == 2.0  # the first's next beat: a lease / 4 on
    assert beaten == ["first"] and list(timer._due) == [first]


@pytest.mark.parametrize("may_block", [False, True])
def test_a_retargeted_heartbeat_beats_only_its_new_beat(may_block):
    old: list[float] = []
    new: list[float] = []
    beat = liveness.Heartbeat(lambda: old.append(1), lease=0.08, may_block=may_block).start()
    try:
        time.sleep(0.05)
        beat.retarget(lambda: new.append(1))
        before = len(old)
        assert new  # at once, before retarget returned
        deadline = time.monotonic() + 10
        while len(new) < 4:
            assert time.monotonic() < deadline, "the new beat never came on the timer"
            time.sleep(0.01)
        assert len(old) == before  # the old beat never ran after retarget returned
    finally:
        beat.stop()
    beat.retarget(lambda: new.append(2))
    time.sleep(0.05)
    assert 2 not in new  # a stopped heartbeat stays stopped


def test_heartbeats_share_one_thread_and_a_blocking_beat_holds_none_up():
    fast: list[int] = []
    stuck: list[int] = []
    release = threading.Event()

    def hung() -> None:  # from its second beat on, a request that does not come back
        stuck.append(1)
        if len(stuck) > 1:
            release.wait(30)

    threads = threading.active_count()
    blocking = liveness.Heartbeat(hung, lease=0.2, may_block=True).start()
    beats = [liveness.Heartbeat(lambda: fast.append(1), lease=0.2).start() for _ in range(6)]
    try:
        assert threading.active_count() <= threads + 2  # the shared timer and the hung one's
        deadline = time.monotonic() + 10
        while len(fast) < 6 * 4:  # each beats again and again, the hung beat whatever
            assert time.monotonic() < deadline, "a blocked beat held the others up"
            time.sleep(0.02)
        assert len(stuck) == 2
    finally:
        release.set()
        for beat in beats:
            beat.stop()
        blocking.stop()
    stopped = len(fast)
    time.sleep(0.2)
    assert len(fast) == stopped


def test_a_forked_child_beats_on_a_timer_of_its_own():
    liveness.Heartbeat(lambda: None, lease=60).start().stop()  # the parent's timer exists
    pid = os.fork()
    if pid == 0:  # the child: the parent's timer thread is not here
        try:
            beats: list[int] = []
            beat = liveness.Heartbeat(lambda: beats.append(1), lease=0.2).start()
            deadline = time.monotonic() + 10
            while len(beats) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            beat.stop()
            os._exit(0 if len(beats) >= 3 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_lease_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(liveness.LEASE_ENV, raising=False)
    assert liveness.lease_from_env() == liveness.DEFAULT_LEASE_SECONDS
    monkeypatch.setenv(liveness.LEASE_ENV, "2.5")
    assert liveness.lease_from_env() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(liveness.LEASE_ENV, bad)
        with pytest.raises(ValueError, match=liveness.LEASE_ENV):
            liveness.lease_from_env()


SLOW_AGENT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def row(v):
        with open(work / "rows.txt", "a") as f:
            f.write(f"{me} {v}\\n")
        time.sleep(1.5)  # every row outlasts the 1 s lease
        return np.array([v, 7 * v], dtype=np.int64)

    entry = cachekit.Cache(root, workers=1, progress=False).map(row, pd.Series(range(3)))
    print(entry.hit, np.asarray(entry.array).tolist())
""")


def test_a_builder_whose_rows_outlast_the_lease_is_never_taken_over(tmp_path):
    """No lock at all (as when a network filesystem ignores it): the second process sees
    the first one's heartbeat, which beats between rows too, and waits instead of taking
    over or building beside it."""
    script, root = tmp_path / "agent.py", tmp_path / "cache"
    script.write_text(SLOW_AGENT)
    env = {**os.environ, "CACHEKIT_LOCK": "none", "CACHEKIT_LOCK_LEASE": "1"}

    def agent(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(root), str(tmp_path), name],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    first = agent("first")
    deadline = time.monotonic() + 120
    while not (tmp_path / "rows.txt").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    time.sleep(1.2)  # longer than a lease since the first row began, and no row done yet
    second = agent("second")
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    expected = str([[v, 7 * v] for v in range(3)])
    assert [out.strip() for out, _ in outs] == [f"False {expected}", f"True {expected}"]
    rows = sorted((tmp_path / "rows.txt").read_text().splitlines())
    assert rows == ["first 0", "first 1", "first 2"]
    assert not list((root / "tmp").iterdir())
    (entry_dir,) = (root / "entries").iterdir()
    assert str(np.load(entry_dir / "data.npy").tolist()) == expected


SLOW_COMMIT_AGENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit
    from cachekit import flushing

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    flush = flushing.fsync_names

    def slow_flush(*args, **kwargs):  # a busy disk: the commit's flushes outlast the lease
        (work / "committing").touch()
        deadline = time.monotonic() + 60
        while not (work / "calling").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(2.5)  # two leases and more after the second process calls
        return flush(*args, **kwargs)

    def row(v):
        with open(work / "rows.txt", "a") as f:
            f.write(f"{me} {v}\\n")
        return np.array([v, 7 * v], dtype=np.int64)

    if me == "first":
        flushing.fsync_names = slow_flush
    else:
        while not (work / "committing").exists():
            time.sleep(0.01)
        (work / "calling").touch()
    entry = cachekit.Cache(root, workers=1, progress=False).map(row, pd.Series(range(3)))
    print(entry.outcome, np.asarray(entry.array).tolist())
""")


def test_a_builder_whose_commit_outlasts_the_lease_is_never_taken_over(tmp_path):
    """The commit removes the build's heartbeat file with its other working files, then
    flushes: the build keeps beating on its directory until the rename, so a process that
    comes meanwhile waits for it instead of claiming it as dead and building again."""
    script, root = tmp_path / "agent.py", tmp_path / "cache"
    script.write_text(SLOW_COMMIT_AGENT)
    env = {**os.environ, "CACHEKIT_LOCK": "none", "CACHEKIT_LOCK_LEASE": "1"}
    agents = [subprocess.Popen([sys.executable, str(script), str(root), str(tmp_path), name],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env) for name in ("first", "second")]
    outs = [p.communicate(timeout=120) for p in agents]
    assert [p.returncode for p in agents] == [0, 0], outs
    expected = str([[v, 7 * v] for v in range(3)])
    assert [out.strip() for out, _ in outs] == [f"built {expected}", f"waited {expected}"]
    assert sorted((tmp_path / "rows.txt").read_text().splitlines()) == \
        ["first 0", "first 1", "first 2"]
