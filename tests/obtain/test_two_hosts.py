"""Two hosts share one cache root on a filesystem whose locks work only within a host.

Each test runs real interpreters on simulated hosts (see tests/hosts.py): own hostname, own
lock directory over ROOT/locks, shared ROOT/entries and ROOT/tmp. The build lock then keeps
out only the builders of the same host; whatever the other host does, every caller must get
the right data and exactly one entry must be published. Every wait is bounded by a
subprocess timeout; nothing asserts on speed.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import hosts
from helpers import leftovers
from hosts import StartBarrier, finish, wait_for

TIMEOUT = 180.0
"""Seconds any one child may run (none needs more than about 20 here)."""


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "entries").iterdir())


def _build_dirs(root: Path) -> list[Path]:
    """Build directories under ROOT/tmp (not removals in progress)."""
    if not (root / "tmp").exists():
        return []
    return [p for p in (root / "tmp").iterdir()
            if p.is_dir() and not p.name.startswith("deleting.")]


# --- the fixture itself -----------------------------------------------------------------------


PROBE = textwrap.dedent("""
    import fcntl, os, socket, sys
    from pathlib import Path
    import cachekit, hosts

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    lock = open(root / "locks" / "same.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the other host's lock met ours
    (root / "locks" / f"{me}.mine").touch()
    (root / "tmp").mkdir(exist_ok=True)
    (root / "tmp" / f"{me}.shared").touch()
    hosts.StartBarrier(work).wait(me)  # both hold the flock from here on
    hosts.report(me=me, hostname=socket.gethostname(), cachekit=cachekit.__file__,
                 locks=sorted(os.listdir(root / "locks")),
                 tmp=sorted(os.listdir(root / "tmp")))
""")


def test_hosts_have_their_own_names_and_locks_and_share_the_rest(two_hosts):
    a, b = two_hosts
    children = [a.python(PROBE, a.root, a.work, "A"), b.python(PROBE, b.root, b.work, "B")]
    StartBarrier(a.work).release(children)
    reports = [finish(child, TIMEOUT).report() for child in children]

    assert [r["hostname"] for r in reports] == ["host-a", "host-b"]
    assert reports[0]["locks"] == ["A.mine", "same.lock"]
    assert reports[1]["locks"] == ["B.mine", "same.lock"]
    assert reports[0]["tmp"] == reports[1]["tmp"] == ["A.shared", "B.shared"]
    for r in reports:  # the checkout under test, not whatever is installed
        assert Path(r["cachekit"]).is_relative_to(hosts.CHECKOUT / "cachekit"), r
    assert sorted(p.name for p in a.private_locks.iterdir()) == ["A.mine", "same.lock"]
    assert sorted(p.name for p in b.private_locks.iterdir()) == ["B.mine", "same.lock"]
    assert list((a.root / "locks").iterdir()) == []  # no bind mount leaked out to us


# --- (a) a memoized function slower than the lease, on both hosts --------------------------


MEMOIZE_AGENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    import cachekit, hosts

    root, work, me, barrier = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    cache = cachekit.Cache(root, progress=False)

    @cache.memoize
    def slow(n):
        with open(work / "runs.txt", "a") as f:  # one line per execution, from any host
            f.write(me + "\\n")
        time.sleep(5)  # longer than the 2 s lease, with no progress to report meanwhile
        return np.arange(10, dtype=np.int64) * n

    hosts.StartBarrier(work, barrier).wait(me)
    result = slow(3)
    hosts.report(me=me, key=slow.cache_key(3), result=np.asarray(result).tolist())
""")


@pytest.mark.parametrize("b_joins", ["at-once", "a-lease-later"])
def test_memoize_slower_than_the_lease_on_both_hosts_publishes_one_entry(two_hosts, b_joins):
    """At once: both hosts miss together. A lease later: host-b asks once host-a's call has
    run for longer than a lease without returning (and so without any progress to show)."""
    a, b = two_hosts
    env = {"CACHEKIT_LOCK_LEASE": "2"}
    together = b_joins == "at-once"
    barriers = ["go", "go"] if together else ["go-host-a", "go-host-b"]
    children = [a.python(MEMOIZE_AGENT, a.root, a.work, "host-a", barriers[0], env=env),
                b.python(MEMOIZE_AGENT, b.root, b.work, "host-b", barriers[1], env=env)]
    if together:
        StartBarrier(a.work, "go").release(children)
    else:
        StartBarrier(a.work, "go-host-a").release(children[:1])
        wait_for(lambda: _build_dirs(a.root), timeout=TIMEOUT,
                 what="host-a's build directory under ROOT/tmp", watch=children[:1])
        time.sleep(3.0)  # host-a's call has now run for longer than the lease
        StartBarrier(b.work, "go-host-b").release(children[1:])
    finished = [finish(child, TIMEOUT) for child in children]
    runs = (a.work / "runs.txt").read_text().split() if (a.work / "runs.txt").exists() else []
    context = f"the function ran {len(runs)} times: {runs}\n" + "\n".join(
        f.failure() for f in finished)

    assert [f.ok for f in finished] == [True, True], context
    reports = [f.report() for f in finished]
    expected = (np.arange(10) * 3).tolist()
    assert [r["result"] for r in reports] == [expected, expected], context
    key = reports[0]["key"]
    assert reports[1]["key"] == key
    assert _entries(a.root) == [key], context
    # At once, both hosts may miss before either has a heartbeat to see (once per host at
    # most: the locks do not meet). A lease later, host-b sees host-a's live heartbeat and
    # waits for it, though the call shows no progress at all.
    assert len(runs) == 1 or (together and len(runs) == 2), context
    assert leftovers(a.root) == [], context


# --- (b) `cachekit clear --all` on one host while the other host builds -----------------------


GATED_MAP_AGENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, hosts

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cache = cachekit.Cache(root, workers=1, progress=False)

    def row(v):
        if v == 0:  # hold the build open until the test has run `clear` on the other host
            deadline = time.monotonic() + 120
            while not (work / "cleared").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.5)
        return np.array([v, v * v], dtype=np.int64)

    entry = cache.map(row, pd.Series(range(8)))
    hosts.report(me=me, key=entry.key, hit=entry.hit, rows=np.asarray(entry.array).tolist(),
                 builder=entry.manifest["builder"]["host"])
""")


def test_clear_all_on_another_host_leaves_a_live_build_alone(two_hosts):
    a, b = two_hosts
    builder = b.python(GATED_MAP_AGENT, b.root, b.work, "host-b")
    build_dir = wait_for(lambda: next(iter(_build_dirs(b.root)), None), timeout=TIMEOUT,
                         what="host-b's build directory under ROOT/tmp", watch=[builder])

    cleared = finish(a.cli("clear", "--all", "--yes"), TIMEOUT)
    survived = build_dir.exists()
    (a.work / "cleared").touch()
    built = finish(builder, TIMEOUT)
    context = (f"build directory {build_dir.name} still there after clear: {survived}\n"
               f"{cleared.failure()}\n{built.failure()}")

    assert cleared.ok, context
    assert built.ok, context
    report = built.report()
    assert report["rows"] == [[v, v * v] for v in range(8)], context
    assert report["hit"] is False and report["builder"] == b.name, context
    assert survived, context
    assert _entries(a.root) == [report["key"]], context
    assert leftovers(a.root) == [], context


# --- (c) two agents on each host ask for the same images at once ------------------------------


IMAGES_AGENT = textwrap.dedent("""
    import hashlib, socket, sys
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, hosts

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    paths = pd.Series((work / "paths.txt").read_text().splitlines())
    cache = cachekit.Cache(root, progress=False)
    hosts.StartBarrier(work).wait(me)
    entry = cache.images(paths, 32, backend="pil")  # the hosts are the point: no torch import
    hosts.report(me=me, hostname=socket.gethostname(), key=entry.key, hit=entry.hit,
                 source=entry.source, builder=entry.manifest["builder"],
                 shape=list(entry.array.shape),
                 sha=hashlib.sha256(entry.array.tobytes()).hexdigest())
""")


def test_four_agents_on_two_hosts_publish_one_entry_with_identical_bytes(two_hosts, tmp_path):
    from cachekit.samples import write_sample_images

    a, b = two_hosts
    paths = write_sample_images(tmp_path / "images", 200, seed=11)
    (a.work / "paths.txt").write_text("\n".join(paths))
    children = [host.python(IMAGES_AGENT, host.root, host.work, f"{host.name}-{i}")
                for host in (a, b) for i in (1, 2)]
    StartBarrier(a.work).release(children)
    reports = [finish(child, TIMEOUT).report() for child in children]

    assert [r["hostname"] for r in reports] == ["host-a", "host-a", "host-b", "host-b"]
    assert len({r["key"] for r in reports}) == 1
    assert _entries(a.root) == [reports[0]["key"]]
    assert {r["shape"] == [200, 3, 32, 32] for r in reports} == {True}
    assert len({r["sha"] for r in reports}) == 1, reports
    assert len({(r["builder"]["host"], r["builder"]["pid"]) for r in reports}) == 1
    assert reports[0]["builder"]["host"] in ("host-a", "host-b")
    builds = [r["me"] for r in reports if r["source"] == "built"]
    assert 1 <= len(builds) <= 2, reports  # within a host the lock works: one build at most
    assert {r["source"] for r in reports} <= {"built", "joined", "local"}, reports
    assert leftovers(a.root) == []


# --- (d) a build whose every row outlasts the lease must not be taken over --------------------


SLOW_ROWS_AGENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, hosts

    root, work, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cache = cachekit.Cache(root, workers=1, progress=False)

    def row(v):
        with open(work / "rows.txt", "a") as f:
            f.write(f"{me} {v}\\n")
        time.sleep(2.5)  # every row outlasts the 2 s lease
        return np.array([v, 10 * v], dtype=np.int64)

    hosts.StartBarrier(work, "go-" + me).wait(me)
    entry = cache.map(row, pd.Series(range(4)))
    hosts.report(me=me, key=entry.key, hit=entry.hit, rows=np.asarray(entry.array).tolist())
""")


def test_a_build_slower_than_the_lease_per_row_is_not_taken_over(two_hosts):
    a, b = two_hosts
    env = {"CACHEKIT_LOCK_LEASE": "2"}
    first = a.python(SLOW_ROWS_AGENT, a.root, a.work, "host-a", env=env)
    second = b.python(SLOW_ROWS_AGENT, b.root, b.work, "host-b", env=env)
    StartBarrier(a.work, "go-host-a").release([first])
    wait_for(lambda: _build_dirs(a.root), timeout=TIMEOUT,
             what="host-a's build directory under ROOT/tmp", watch=[first])
    time.sleep(3.0)  # host-a's build has now run longer than a lease without finishing a row
    StartBarrier(b.work, "go-host-b").release([second])
    finished = [finish(first, TIMEOUT), finish(second, TIMEOUT)]
    rows = (a.work / "rows.txt").read_text().splitlines()
    context = f"rows run: {rows}\n" + "\n".join(f.failure() for f in finished)

    assert [f.ok for f in finished] == [True, True], context
    reports = [f.report() for f in finished]
    expected = [[v, 10 * v] for v in range(4)]
    assert [r["rows"] for r in reports] == [expected, expected], context
    assert reports[0]["key"] == reports[1]["key"]
    assert sorted(rows) == [f"host-a {v}" for v in range(4)], context  # host-b only waited
    assert (reports[0]["hit"], reports[1]["hit"]) == (False, True), context
    assert _entries(a.root) == [reports[0]["key"]], context
    assert leftovers(a.root) == [], context
