"""A joiner helps only with the cores it brings: the builder and its same-host joiners share
one budget of CPUs (cachekit.engine.filling.cores), and a joiner with no core left only waits.

The rules and the seats are checked in this process; the decisions of real joiners with
real interpreters (pinned with sched_setaffinity where the test needs it), whose decodes
are counted by the rows they compute and the journal's records, never by time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hosts
from cachekit import _fs, keys, processes
from cachekit.engine.filling.cores import Seats, Spare, spare_cores
from cachekit.obtain.local_wait import JOIN_POLL_SECONDS, LocalWait
from cachekit.obtain.wait import POLL_SECONDS, Wait
from cachekit.store import LocalStore, locks
from helpers import build_journal, rows_by
from hosts import HostProcess, finish, wait_for

TIMEOUT = 180.0
USABLE = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(USABLE) < 2, reason="needs two usable CPUs")

AGENT = textwrap.dedent("""
    import hashlib, os, sys, time
    from pathlib import Path

    root, work, me, role, workers, cpus = sys.argv[1:7]
    root, work = Path(root), Path(work)
    if cpus != "any":
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    sys.stderr = open(work / f"{me}.stderr", "a", buffering=1)  # read while we run

    import numpy as np, pandas as pd
    import cachekit, hosts

    SEEN = []

    def row(v):
        with open(work / "rows.txt", "a") as f:
            f.write(f"{me} {v}\\n")
        if role == "builder" and v > 0:  # row 0 fixes the plan; the rest wait for the go
            (work / "builder-mid").touch()
            while not (work / "go").exists():
                time.sleep(0.01)
        if role == "holder" and not SEEN:  # the first row it computes waits for its go
            SEEN.append(v)
            (work / f"{me}-mid").touch()
            while not (work / f"{me}-go").exists():
                time.sleep(0.01)
        return np.full(2048, v, dtype=np.int16)

    cache = cachekit.Cache(root, workers=None if workers == "all" else int(workers),
                           progress=None)
    entry = cache.map(row, pd.Series(range(64)))
    hosts.report(me=me, pid=os.getpid(), source=entry.source, key=entry.key,
                 ok=bool((np.asarray(entry.array) == np.arange(64)[:, None]).all()))
""")


# --- the rule -----------------------------------------------------------------------------

def test_a_builder_with_a_worker_per_cpu_leaves_a_joiner_on_its_cpus_nothing():
    assert spare_cores({0, 1}, 2, own={0, 1}) == Spare((), 0, 0)
    assert spare_cores({0, 1}, 4, own={0, 1}).count == 0  # more workers than CPUs
    assert spare_cores({0}, 1, own={0}).count == 0


def test_a_joiner_brings_its_cpus_outside_the_builders_and_the_idle_ones_of_the_builders():
    assert spare_cores({0}, 1, own={1}) == Spare((1,), 0, 0)
    assert spare_cores({0, 1}, 1, own={0, 1}) == Spare((), 1, 1)
    assert spare_cores({0, 1, 2, 3}, 1, own={2, 3, 4}) == Spare((4,), 2, 3)
    assert spare_cores({0, 1}, 1, own={2, 3}).count == 2
    assert spare_cores({0, 1, 2, 3}, 2, own={0, 1, 2, 3}).count == 2


def test_seats_count_the_joiners_before_us_and_free_a_dead_joiners(tmp_path):
    with _fs.DirHandle.open(tmp_path) as folder:
        free = Spare((5,), 1, 2)  # our CPU 5, and one of the builder's two idle cores
        first = Seats.take(folder, free, most=8)
        assert first.names == ["seat.cpu.5", "seat.idle.0"]
        second = Seats.take(folder, free, most=8)
        assert second.names == ["seat.idle.1"]  # CPU 5 is taken; the other idle core is not
        assert Seats.take(folder, free, most=8).names == []
        assert Seats.take(folder, Spare((6, 7), 0, 0), most=1).names == ["seat.cpu.6"]
        second.release()
        first.release()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["seat.cpu.6"]

        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (tmp_path / "seat.cpu.5").write_text(json.dumps(
            {"host": _fs.host(), "pid": dead.pid, "pidns": None, "start": None}))
        (tmp_path / "seat.idle.0").write_text(json.dumps(processes.owner()))  # alive: ours
        taken = Seats.take(folder, free, most=8)
        assert taken.names == ["seat.cpu.5", "seat.idle.1"]
        assert json.loads((tmp_path / "seat.cpu.5").read_text())["pid"] == os.getpid()


def test_a_waiter_that_can_add_no_core_does_not_call_join_and_looks_at_a_waiters_pace(
        tmp_path, capsys):
    store, key = LocalStore(tmp_path), keys.digest({"test": "cores"})
    calls = []
    build = store.begin(key)
    try:
        lock = locks.make_lock(store.layout.lock_path(key))
        local = LocalWait(store, key, Wait(key, None), lock,
                          join=lambda directory, spare: calls.append(spare))
        local._join_live_builds(store.builds(key))
        assert calls == [] and local.poll == JOIN_POLL_SECONDS  # its CPUs are not said yet

        build.record_cpus(len(USABLE))
        local._join_live_builds(store.builds(key))
        assert calls == [] and local.poll == POLL_SECONDS
        local._join_live_builds(store.builds(key))
        said = capsys.readouterr().err
        assert said.count("without joining it: the build already uses every core here") == 1

        if len(USABLE) >= 2:
            build.record_cpus(1)
            local._join_live_builds(store.builds(key))
            idle = len(USABLE) - 1
            assert calls == [Spare((), idle, idle)] and local.poll == JOIN_POLL_SECONDS
    finally:
        build.discard()


# --- real joiners -------------------------------------------------------------------------

def start(work: Path, root: Path, me: str, role: str, workers: object = 1,
          cpus: str = "any") -> HostProcess:
    path = work / "agent.py"
    if not path.exists():
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(AGENT)
    argv = [sys.executable, str(path), str(root), str(work), me, role, str(workers), cpus]
    return HostProcess("local", argv, argv, hosts.child_env())


def said(work: Path, me: str) -> str:
    path = work / f"{me}.stderr"
    return path.read_text() if path.exists() else ""


def test_a_joiner_on_the_cpus_the_builder_fills_computes_nothing_and_gets_the_entry(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    builder = start(work, root, "builder", "builder", "all")  # a worker per usable CPU
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-build",
             watch=[builder])
    joiner = start(work, root, "joiner", "plain", "all")
    wait_for(lambda: "without joining it" in said(work, "joiner"), timeout=TIMEOUT,
             what="the joiner deciding", watch=[joiner, builder])
    names = [p.name for p in build_journal(root).iterdir()]
    (work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, joiner)]

    assert "the build already uses every core here" in said(work, "joiner")
    assert not [n for n in names if n.startswith(("rows.", "seat."))], names
    assert "joiner" not in rows_by(work)
    assert [r["source"] for r in reports] == ["built", "local"]
    assert all(r["ok"] for r in reports) and reports[0]["key"] == reports[1]["key"]


@two_cpus
def test_a_joiner_on_a_cpu_outside_the_builders_joins_with_it(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    mine, theirs = map(str, USABLE[:2])
    builder = start(work, root, "builder", "builder", 1, cpus=mine)
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-build",
             watch=[builder])
    joiner = start(work, root, "joiner", "holder", "all", cpus=theirs)
    wait_for((work / "joiner-mid").exists, timeout=TIMEOUT, what="the joiner in a chunk",
             watch=[joiner, builder])
    folder = build_journal(root)
    seat = json.loads((folder / f"seat.cpu.{theirs}").read_text())
    assert seat["pid"] == joiner.pid
    assert not list(folder.glob("seat.idle.*"))  # one worker on its one CPU: none idle
    (work / "joiner-go").touch()
    wait_for(lambda: not list(folder.glob("seat.*")), timeout=TIMEOUT,
             what="the joiner done with the free chunks", watch=[joiner, builder])
    (work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, joiner)]

    assert [r["source"] for r in reports] == ["built", "joined"]
    assert all(r["ok"] for r in reports)
    assert len(rows_by(work)["joiner"]) > 1


@two_cpus
def test_joiners_count_the_seats_of_those_before_them_and_take_a_dead_ones(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    builder = start(work, root, "builder", "builder", len(USABLE) - 1)  # one core idle
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-build",
             watch=[builder])
    first = start(work, root, "first", "holder", "all")
    wait_for((work / "first-mid").exists, timeout=TIMEOUT, what="the first joiner in a chunk",
             watch=[first, builder])
    second = start(work, root, "second", "plain", "all")
    wait_for(lambda: "without joining it" in said(work, "second"), timeout=TIMEOUT,
             what="the second joiner deciding", watch=[second, builder])
    assert "the build and the processes joining it already use every core here" in \
        said(work, "second")
    assert "second" not in rows_by(work)
    first.kill_group()  # its seat's owner is gone: the second joiner takes the seat
    finish(first)
    wait_for(lambda: "second" in rows_by(work), timeout=TIMEOUT,
             what="the second joiner filling chunks", watch=[second, builder])
    (work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, second)]

    assert [r["source"] for r in reports] == ["built", "joined"]
    assert all(r["ok"] for r in reports)
    assert "]: joined the build of entry" in said(work, "second")


def test_a_joiner_on_another_host_joins_a_builder_that_uses_every_core(two_hosts):
    a, b = two_hosts
    builder = a.python(AGENT, a.root, a.work, "host-a", "builder", "all", "any")
    wait_for((a.work / "builder-mid").exists, timeout=TIMEOUT, what="host-a mid-build",
             watch=[builder])
    joiner = b.python(AGENT, b.root, b.work, "host-b", "plain", "all", "any")
    wait_for(lambda: "host-b" in rows_by(a.work), timeout=TIMEOUT,
             what="host-b filling chunks", watch=[builder, joiner])
    assert not list(build_journal(a.root).glob("seat.*"))  # another host's cores: no seat
    (a.work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, joiner)]

    assert [r["source"] for r in reports] == ["built", "joined"]
    assert all(r["ok"] for r in reports)
    assert "without joining it" not in said(a.work, "host-b")
