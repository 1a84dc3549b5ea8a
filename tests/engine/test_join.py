"""Cooperative builds: processes that find a live build of their key fill its free chunks.

Real interpreters released together by a start-file barrier, real SIGKILLs, a decode
counter (each decode appends a line to a file, from any process) and, for several hosts,
the simulated hosts of tests/hosts.py. Nothing asserts on speed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
import hosts
from cachekit.obtain.local_wait import LocalWait
from cachekit.obtain.wait import Wait
from cachekit.store import LocalStore, locks
from helpers import build_journal, leftovers, rows_by
from hosts import HostProcess, StartBarrier, finish, wait_for

TIMEOUT = 180.0

IMAGES_AGENT = textwrap.dedent("""
    import hashlib, os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, cachekit.engine.decoding.images, hosts

    root, work, me, on_error = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    decode = cachekit.engine.decoding.images.load_image

    def counted(path, *args, **kwargs):
        with open(work / "decoded.txt", "a") as f:  # one line per decode, from any process
            f.write(f"{os.getpid()} {path}\\n")
        time.sleep(0.01)  # keep the build open long enough for the others to join
        return decode(path, *args, **kwargs)

    cachekit.engine.decoding.images.load_image = counted
    paths = pd.Series((work / "paths.txt").read_text().splitlines())
    cache = cachekit.Cache(root, workers=1, progress=None)  # no bars (no terminal), messages
    hosts.StartBarrier(work).wait(me)
    try:
        entry = cache.images(paths, 16, on_error=on_error, backend="pil")  # (no torch import)
    except cachekit.ImageDecodeError as e:
        hosts.report(me=me, pid=os.getpid(), failed=[row for row, _, _ in e.failures])
    else:
        hosts.report(me=me, pid=os.getpid(), source=entry.source, key=entry.key,
                     sha=hashlib.sha256(np.asarray(entry.array).tobytes()).hexdigest())
""")

MAP_AGENT = textwrap.dedent("""
    import hashlib, os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, hosts

    root, work, me, ROLE, rows, width = (Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3],
                                         sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    SEEN = []

    def row(v):
        with open(work / "rows.txt", "a") as f:
            f.write(f"{me} {v}\\n")
        if ROLE in ("builder", "builder-dies") and v == 1:  # in its first chunk
            (work / "builder-mid").touch()
            while ROLE == "builder-dies" or not (work / "go").exists():
                time.sleep(0.01)
        if ROLE == "joiner-dies" and not SEEN:  # the first row of the first chunk it claims
            SEEN.append(v)
            (work / "joiner-mid.tmp").write_text(str(v))
            os.replace(work / "joiner-mid.tmp", work / "joiner-mid")  # seen whole or not at all
            time.sleep(3600)
        if ROLE == "slow-joiner":
            time.sleep(0.01)  # its build_seconds are at least 0.01 s a row
        return np.full(width, v, dtype=np.int16)

    cache = cachekit.Cache(root, workers=1, progress=None)
    began = time.monotonic()
    entry = cache.map(row, pd.Series(range(rows)))
    elapsed = time.monotonic() - began
    hosts.report(me=me, pid=os.getpid(), source=entry.source, key=entry.key,
                 ok=bool((np.asarray(entry.array) == np.arange(rows)[:, None]).all()),
                 sha=hashlib.sha256(np.asarray(entry.array).tobytes()).hexdigest(),
                 elapsed=elapsed, wait_seconds=entry.wait_seconds,
                 build_seconds=entry.build_seconds, decode_seconds=entry.decode_seconds)
""")


def start(script: Path, *args: object) -> HostProcess:
    """A fresh interpreter on this host running ``script`` (cachekit from this checkout)."""
    argv = [sys.executable, str(script), *map(str, args)]
    return HostProcess("local", argv, argv, hosts.child_env())


def script(work: Path, name: str, source: str) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    path = work / name
    path.write_text(source)
    return path


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "entries").iterdir())




@pytest.mark.parametrize("agents", [2, 3])
def test_agents_released_together_decode_every_row_once_between_them(tmp_path, agents):
    from cachekit.samples import write_sample_images

    work, root = tmp_path / "work", tmp_path / "cache"
    paths = write_sample_images(tmp_path / "images", 256, seed=5)
    agent = script(work, "agent.py", IMAGES_AGENT)
    (work / "paths.txt").write_text("\n".join(paths))
    children = [start(agent, root, work, f"agent{i}", "raise") for i in range(agents)]
    StartBarrier(work).release(children)
    finished = [finish(child, TIMEOUT) for child in children]
    reports = [f.report() for f in finished]

    decoded = (work / "decoded.txt").read_text().splitlines()
    by_process = {line.split()[0] for line in decoded}
    assert sorted(line.split(maxsplit=1)[1] for line in decoded) == sorted(paths)  # once each
    assert len(by_process) > 1, reports  # the waiting agents did part of the work
    assert {str(r["pid"]) for r in reports if r["source"] in ("built", "joined")} == by_process
    assert [r["source"] for r in reports].count("built") == 1, reports
    assert len({r["sha"] for r in reports}) == 1 and len({r["key"] for r in reports}) == 1
    assert entries(root) == [reports[0]["key"]] and leftovers(root) == []
    for f, r in zip(finished, reports):  # joiners say so, and how much they filled
        if r["source"] == "joined":
            assert f"cachekit[pid {r['pid']}]: joined the build of entry" in f.stderr, f.stderr
            assert "this process filled" in f.stderr, f.stderr
    reference = cachekit.Cache(tmp_path / "alone", progress=False, join=False).images(
        __import__("pandas").Series(paths), 16, backend="pil")
    assert hashlib.sha256(np.asarray(reference.array).tobytes()).hexdigest() == reports[0]["sha"]


def test_decode_failures_of_every_participant_make_one_error(tmp_path):
    from cachekit.samples import write_sample_images

    work, root = tmp_path / "work", tmp_path / "cache"
    paths = write_sample_images(tmp_path / "images", 256, seed=6)
    bad = [5, 100, 140, 250]  # spread over the chunks, so over the participants
    for row in bad:
        paths[row] = str(tmp_path / "images" / f"missing-{row}.jpg")
    agent = script(work, "agent.py", IMAGES_AGENT)
    (work / "paths.txt").write_text("\n".join(paths))
    children = [start(agent, root, work, f"agent{i}", "raise") for i in range(2)]
    StartBarrier(work).release(children)
    reports = [finish(child, TIMEOUT).report() for child in children]

    decoded = (work / "decoded.txt").read_text().splitlines()
    assert len({line.split()[0] for line in decoded}) == 2
    assert [r["failed"] for r in reports] == [bad, bad], reports
    kept = cachekit.Cache(root).entries()  # no entry: the rows that decoded, kept
    assert [e.failed_build is not None and e.failed_rows == len(bad) for e in kept] == [True]
    assert leftovers(root) == []


def test_a_joiner_killed_mid_chunk_has_its_chunk_redone_by_the_builder(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    agent = script(work, "agent.py", MAP_AGENT)
    builder = start(agent, root, work, "builder", "builder", 64, 2048)  # 4 KiB rows
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-chunk",
             watch=[builder])
    joiner = start(agent, root, work, "joiner", "joiner-dies", 64, 2048)
    wait_for((work / "joiner-mid").exists, timeout=TIMEOUT, what="the joiner mid-chunk",
             watch=[joiner, builder])
    plan = json.loads((build_journal(root) / "plan.json").read_text())
    step, row = plan["chunk_rows"], int((work / "joiner-mid").read_text())
    assert step > 1 and row % step == 0 and row >= step  # a chunk of its own, not the first
    joiner.kill_group()
    finish(joiner)
    (work / "go").touch()
    report = finish(builder, TIMEOUT).report()

    computed = rows_by(work)
    assert computed["joiner"] == [row]
    assert sorted(computed["builder"]) == list(range(64))  # the joiner's chunk too, again
    assert report["ok"] and report["source"] == "built"
    assert entries(root) == [report["key"]] and leftovers(root) == []


@pytest.mark.parametrize("finisher", ["the joiner", "the next caller"])
def test_a_killed_committer_is_finished_by_another_process_and_published_once(tmp_path,
                                                                             finisher):
    work, root = tmp_path / "work", tmp_path / "cache"
    agent = script(work, "agent.py", MAP_AGENT)
    builder = start(agent, root, work, "builder", "builder-dies", 64, 2048)
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-chunk",
             watch=[builder])
    role = "joiner" if finisher == "the joiner" else "joiner-dies"
    joiner = start(agent, root, work, "joiner", role, 64, 2048)
    wait_for(lambda: len(rows_by(work).get("joiner", [])) >= 1, timeout=TIMEOUT,
             what="the joiner filling a chunk", watch=[joiner, builder])
    builder.kill_group()
    finish(builder)
    if finisher == "the next caller":
        wait_for((work / "joiner-mid").exists, timeout=TIMEOUT, what="the joiner mid-chunk",
                 watch=[joiner])
        joiner.kill_group()
        finish(joiner)
        joiner = start(agent, root, work, "next", "plain", 64, 2048)
    report = finish(joiner, TIMEOUT).report()

    computed = rows_by(work)
    me = "joiner" if finisher == "the joiner" else "next"
    assert report["ok"] and report["source"] == "built"  # it adopted the build and committed
    assert sorted(set(computed[me])) == sorted(computed[me])  # no row twice by one process
    assert set(computed[me]) | set(computed["builder"]) | set(computed.get("joiner", [])) \
        == set(range(64))
    assert entries(root) == [report["key"]] and leftovers(root) == []
    manifest = json.loads((root / "entries" / report["key"] / "manifest.json").read_text())
    assert manifest["builder"]["pid"] == report["pid"]


def test_the_builder_names_its_joiners_and_each_counts_only_its_own_seconds(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    agent = script(work, "agent.py", MAP_AGENT)
    builder = start(agent, root, work, "builder", "builder", 64, 2048)
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-chunk",
             watch=[builder])
    joiner = start(agent, root, work, "joiner", "slow-joiner", 64, 2048)
    plan = json.loads((wait_for(lambda: next(iter(root.glob("tmp/*/data.npy.chunks")), None),
                                timeout=TIMEOUT, what="the journal") / "plan.json").read_text())
    theirs = 64 - plan["chunk_rows"]  # every chunk but the builder's first
    wait_for(lambda: len(rows_by(work).get("joiner", [])) == theirs, timeout=TIMEOUT,
             what="the joiner filling every other chunk", watch=[builder, joiner])
    (work / "go").touch()
    built, joined = finish(builder, TIMEOUT), finish(joiner, TIMEOUT)
    b, j = built.report(), joined.report()

    assert (b["source"], j["source"]) == ("built", "joined") and b["ok"] and j["ok"]
    assert sorted(rows_by(work)["joiner"]) == list(range(plan["chunk_rows"], 64))
    manifest = json.loads((root / "entries" / b["key"] / "manifest.json").read_text())
    host = manifest["builder"]["host"]
    assert manifest["builder"]["joined"] == [{"host": host, "pid": j["pid"], "rows": theirs}]
    said = [line for line in built.stderr.splitlines() if "joining process" in line]
    assert said == [f"cachekit[pid {b['pid']}]: built entry {b['key'][:12]} with 1 joining "
                    f"process, which computed {theirs} of its 64 rows (pid {j['pid']} on "
                    f"{host} {theirs}); this process made the other {64 - theirs}"], \
        built.stderr
    # Each process's own seconds: the joiner's filling is building, not waiting, and
    # neither claims the other's work; the measured spans lie inside the call.
    slack = 0.002  # each figure is rounded to the millisecond
    assert j["build_seconds"] == j["decode_seconds"] >= 0.01 * theirs
    assert j["wait_seconds"] + j["build_seconds"] <= j["elapsed"] + slack
    assert 0 < b["decode_seconds"] <= b["build_seconds"]
    assert b["wait_seconds"] + b["build_seconds"] <= b["elapsed"] + slack
    assert b["build_seconds"] >= manifest["build_seconds"]


def test_join_false_only_waits(tmp_path):
    work, root = tmp_path / "work", tmp_path / "cache"
    agent = script(work, "agent.py", MAP_AGENT.replace(
        "progress=None)", "progress=None, join=ROLE != 'waiter')"))
    builder = start(agent, root, work, "builder", "builder", 64, 2048)
    wait_for((work / "builder-mid").exists, timeout=TIMEOUT, what="the builder mid-chunk",
             watch=[builder])
    waiter = start(agent, root, work, "waiter", "waiter", 64, 2048)
    time.sleep(2.0)  # long enough to have joined, had it been allowed to
    (work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, waiter)]
    assert "waiter" not in rows_by(work)
    assert [r["source"] for r in reports] == ["built", "local"]


def test_a_joiner_claims_nothing_of_a_journal_the_commit_moved_out(tmp_path):
    """The commit moves a build's journal out of its directory, then deletes its records
    one by one. A joiner that still holds the journal (paused, or slow to look again)
    claims no chunk of it, not even one whose done record is gone: it computes nothing of
    a build that is over. (Seen under load before: a chunk computed again after the
    commit, and counted by neither process.)"""
    from cachekit import _fs
    from cachekit.engine.filling.builder import fill
    from cachekit.engine.filling.claimed import RowSpec
    from cachekit.engine.filling.journal import Journal, journal_name
    from cachekit.errors import BuildGone

    (tmp_path / "build").mkdir()
    with _fs.DirHandle.open(tmp_path) as parent, parent.child("build") as build:
        fill(build, "data.npy", list(range(64)), lambda v: np.full(1024, v, np.int32),
             rows=RowSpec(workers=1, record=False))
        with Journal.open(build, "data.npy") as journal:
            chunks = journal.plan.chunks
            assert len(chunks) > 2 and journal.done_indices() == list(range(len(chunks)))
            assert next(journal.claimable(chunks), None) is None  # all done: nothing to claim
            build.rename(journal_name("data.npy"), parent, "trash")  # as the commit does
            for index in (0, len(chunks) - 1):
                (tmp_path / "trash" / f"done.{index}").unlink()
            with pytest.raises(BuildGone):
                next(journal.claimable(chunks))
    assert not list((tmp_path / "trash").glob("claim.*"))  # the claim it made, given up


def test_join_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="join must be True or False"):
        cachekit.Cache(tmp_path, join="yes")
    assert cachekit.Cache(tmp_path, join=False).join is False
    assert cachekit.Cache(tmp_path).join is True


def test_a_joiner_on_another_host_fills_chunks_and_no_page_is_written_by_two_hosts(two_hosts):
    a, b = two_hosts
    rows, width = 4096, 100  # 200-byte rows: a chunk must hold a multiple of 512 of them
    env = {"CACHEKIT_LOCK_LEASE": "5"}
    builder = a.python(MAP_AGENT, a.root, a.work, "host-a", "builder", rows, width, env=env)
    wait_for((a.work / "builder-mid").exists, timeout=TIMEOUT, what="host-a mid-chunk",
             watch=[builder])
    joiner = b.python(MAP_AGENT, b.root, b.work, "host-b", "plain", rows, width, env=env)
    journal = wait_for(lambda: next(iter(a.root.glob("tmp/*/data.npy.chunks")), None),
                       timeout=TIMEOUT, what="the chunk journal", watch=[builder])
    plan = json.loads((journal / "plan.json").read_text())
    chunks = -(-rows // plan["chunk_rows"])
    wait_for(lambda: len(list(journal.glob("done.*"))) == chunks - 1
             and len(list(journal.glob("claim.*"))) == 1, timeout=TIMEOUT,
             what="every chunk but the builder's done", watch=[builder, joiner])
    done = {int(p.name[5:]): json.loads(p.read_text()) for p in journal.glob("done.*")}
    claims = sorted(p.name for p in journal.glob("claim.*"))
    (a.work / "go").touch()
    reports = [finish(p, TIMEOUT).report() for p in (builder, joiner)]

    assert sorted(done) == list(range(1, chunks)) and chunks >= 4
    assert {d["by"]["host"] for d in done.values()} == {"host-b"}
    assert claims == ["claim.0.0"]  # the builder's, still filling chunk 0
    row_bytes = width * 2
    page = plan["page"]
    assert page >= 4096 and plan["offset"] % page == 0
    spans = {}  # page -> the hosts that wrote bytes in it
    host_of = {0: "host-a", **{i: d["by"]["host"] for i, d in done.items()}}
    for index in range(chunks):
        first = plan["offset"] + index * plan["chunk_rows"] * row_bytes
        end = plan["offset"] + min(rows, (index + 1) * plan["chunk_rows"]) * row_bytes
        assert first % page == 0
        for p in range(first // page, -(-end // page)):
            spans.setdefault(p, set()).add(host_of[index])
    assert all(len(h) == 1 for h in spans.values())
    assert [r["source"] for r in reports] == ["built", "joined"]
    assert all(r["ok"] for r in reports) and len({r["sha"] for r in reports}) == 1
    assert entries(a.root) == [reports[0]["key"]] and leftovers(a.root) == []
    manifest = json.loads((a.root / "entries" / reports[0]["key"] / "manifest.json").read_text())
    assert manifest["builder"]["joined"] == [  # the joiner on the other host, by its name
        {"host": "host-b", "pid": reports[1]["pid"], "rows": rows - plan["chunk_rows"]}]


def test_a_dead_joiner_on_another_host_loses_its_chunk_once_its_heartbeat_is_a_lease_old(
        two_hosts):
    a, b = two_hosts
    env = {"CACHEKIT_LOCK_LEASE": "2"}
    builder = a.python(MAP_AGENT, a.root, a.work, "host-a", "builder", 64, 2048, env=env)
    wait_for((a.work / "builder-mid").exists, timeout=TIMEOUT, what="host-a mid-chunk",
             watch=[builder])
    joiner = b.python(MAP_AGENT, b.root, b.work, "host-b", "joiner-dies", 64, 2048, env=env)
    wait_for((a.work / "joiner-mid").exists, timeout=TIMEOUT, what="host-b mid-chunk",
             watch=[builder, joiner])
    row = int((a.work / "joiner-mid").read_text())
    b.kill_all()  # host-a cannot see host-b's pids: only the claim's heartbeat tells
    (a.work / "go").touch()
    report = finish(builder, TIMEOUT).report()

    computed = rows_by(a.work)
    assert computed["host-b"] == [row]
    assert sorted(computed["host-a"]) == list(range(64))  # its chunk too, once it was stale
    assert report["ok"] and report["source"] == "built"
    assert entries(a.root) == [report["key"]] and leftovers(a.root) == []


def test_a_commit_that_lands_between_the_waiters_two_looks_is_used_not_rebuilt(tmp_path,
                                                                              monkeypatch):
    # A commit renames the build into entries/ at once: a waiter that looked for the entry
    # just before and at the builds just after sees neither, and must look again.
    root = tmp_path / "cache"
    entry = cachekit.Cache(root, progress=None).map(lambda v: np.full(4, v), pd.Series(range(8)))
    store = LocalStore(root)
    lookup, looks = store.lookup, []

    def committed_just_after_the_first_look(key):
        looks.append(key)
        return None if len(looks) == 1 else lookup(key)

    monkeypatch.setattr(store, "lookup", committed_just_after_the_first_look)
    wait = Wait(entry.key, None)
    local = LocalWait(store, entry.key, wait, locks.make_lock(store.layout.lock_path(entry.key)),
                      join=lambda directory, spare: None)

    found = local.for_live_builders()

    assert len(looks) == 2 and found is not None and found.path.name == entry.key
