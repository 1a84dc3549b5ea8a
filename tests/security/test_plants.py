"""What a group member plants under a shared root, then leaves, stops no victim: future-dated
heartbeats, holder records and soft locks; a build of another user that beats for ever;
forged failure records; row-index bombs; terminal escapes in a planted host name.

The victim and the attacker are plain uids of one group (tests/users.py). The victim runs
``Cache.map`` over a small column in a child interpreter (no torch import), with a short
lease, and reports how its call ended.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from hosts import finish, wait_for

TIMEOUT = 90.0
LEASE = "1"
FAR_FUTURE = 4102444800.0  # 2100-01-01

VICTIM = '''
import os, resource, sys, time
import pandas as pd
import cachekit
from hosts import report


def row(value):
    import numpy as np
    return np.full((4,), value * value, dtype=np.int64)


root, rows, on_error, memory = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if memory:  # bytes of address space on top of what the interpreter holds now
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (held + memory, held + memory))
if os.environ.get("PLANTS_CALLING"):  # tell the attacker that the call starts now
    open(os.environ["PLANTS_CALLING"], "w").close()
started = time.monotonic()
try:
    entry = cachekit.Cache(root, workers=1, executor="threads").map(
        row, pd.Series(range(rows)), on_error=on_error)
except BaseException as e:
    report(outcome="error", type=type(e).__name__, message=str(e)[:800])
else:
    report(outcome="ok", key=entry.key, source=entry.source, reused=entry.rows_reused,
           seconds=time.monotonic() - started,
           recipe=entry.manifest.get("reuse", {}).get("recipe"),
           right=entry.array[:, 0].tolist() == [v * v for v in range(rows)])
'''

PLANT = '''
import fcntl, json, os, sys, time
from pathlib import Path
from hosts import report

root, kind, key, ready = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
FAR_FUTURE = 4102444800.0
owner = {"host": "elsewhere\\x1b]0;cachekit-owned\\x07\\x1b[2J", "pid": 4242, "start": None}
locks = root / "locks"
locks.mkdir(exist_ok=True)


def hold_lock():
    fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o664)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def build_dir(beat):
    from cachekit.store.temp_names import build_dir_name
    from cachekit.store.manifest import FORMAT_VERSION
    from cachekit._version import __version__
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    build = tmp / build_dir_name(key)
    build.mkdir()
    (build / "state.json").write_text(json.dumps(
        {"key": key, "format": FORMAT_VERSION, "cachekit_version": __version__, **owner,
         "started": time.time(), "done": 1, "total": 8}))
    (build / "heartbeat").write_bytes(b"")
    beat(build / "heartbeat")
    return build


if kind == "future-build":
    build_dir(lambda path: os.utime(path, (FAR_FUTURE, FAR_FUTURE)))
elif kind == "beating-build":
    build = build_dir(lambda path: None)
    ready.write_text("planted")
    while True:  # a live member's build that never ends: its heartbeat beats
        os.utime(build / "heartbeat")
        time.sleep(0.2)
elif kind == "future-holder":
    fd = hold_lock()
    holder = locks / f"{key}.lock.holder"
    holder.write_text(json.dumps(owner))
    os.utime(holder, (FAR_FUTURE, FAR_FUTURE))
    ready.write_text("planted")
    time.sleep(600)
elif kind == "future-soft":
    soft = locks / f"{key}.lock.soft"
    soft.write_text(json.dumps(owner))
    os.utime(soft, (FAR_FUTURE, FAR_FUTURE))
elif kind == "failure":
    fd = hold_lock()
    ready.write_text("planted")
    while not Path(str(ready) + ".calling").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # the victim's call waits for our lock meanwhile
    (locks / f"{key}.failed.json").write_text(json.dumps(
        {"time": time.time(), **owner, "rows": 8, "key": key,
         "failures": [[0, "cover.jpg", "the attacker says this file is broken"]]}))
    os.close(fd)
elif kind == "index-bomb":
    recipe = sys.argv[5]
    import numpy as np
    from numpy.lib import format as npy
    entry = "f" * 32
    (root / "entries" / entry).mkdir()
    folder = root / "index" / recipe
    words = (1 << 32) // 64  # a 2**32-bit bitmap: 512 MiB, sparse
    with open(folder / f"{entry}.npy", "wb") as f:
        npy.write_array_header_1_0(f, {"descr": "<u8", "fortran_order": False,
                                       "shape": (3 + words,)})
        f.write(np.array([1, 0, 32], dtype="<u8").tobytes())
        f.truncate(f.tell() + 8 * words)
report(planted=kind)
'''


def victim(shared, rows: int = 8, on_error: str = "raise", memory: int = 0,
           env: dict[str, str] | None = None):
    return shared.victim.python(shared.script(VICTIM), shared.root, rows, on_error, memory,
                                env={"CACHEKIT_LOCK_LEASE": LEASE, **(env or {})})


def plant(shared, kind: str, key: str, *extra: str):
    """Start the attacker's plant of ``kind``; ``(process, ready file)``."""
    ready = shared.work / f"ready-{kind}"
    return shared.attacker.python(shared.script(PLANT), shared.root, kind, key, ready,
                                  *extra), ready


def learn_key(shared, rows: int = 8) -> str:
    """The victim's key, from a build in a scratch root of its own."""
    scratch = shared.base / "scratch"
    scratch.mkdir()
    os.chown(scratch, shared.victim.uid, -1)
    got = finish(shared.victim.python(shared.script(VICTIM), scratch, rows, "raise", 0),
                 TIMEOUT).report()
    assert got["outcome"] == "ok", got
    return got["key"]


def ended(process) -> tuple[dict[str, Any], str]:
    done = finish(process, TIMEOUT)
    return done.report(), done.stderr


@pytest.mark.parametrize("kind,env", [("future-build", {}), ("future-holder", {}),
                                      ("future-soft", {"CACHEKIT_LOCK": "soft"})])
def test_a_plant_dated_in_the_future_is_not_alive(shared_root, kind, env):
    """A fake build of another host whose heartbeat is dated 2100, a KEY.lock.holder dated
    2100 with the flock held, or a KEY.lock.soft dated 2100: the victim (lease 1 s,
    lock_timeout=None) builds the right rows instead of waiting for ever (``finish`` gives
    it TIMEOUT), and the planted host name reaches its stderr escaped."""
    shared = shared_root
    key = learn_key(shared)
    planter, ready = plant(shared, kind, key)
    if kind == "future-holder":
        wait_for(ready.exists, timeout=TIMEOUT, what="the attacker's lock", watch=[planter])
    else:
        finish(planter, TIMEOUT).report()
    got, stderr = ended(victim(shared, env=env))
    assert got["outcome"] == "ok" and got["right"] and got["source"] == "built", (got, stderr)
    assert "\x1b" not in stderr and "\x07" not in stderr, stderr


def test_a_build_of_another_user_that_beats_for_ever_is_waited_for_a_bounded_time(
        shared_root):
    """A member keeps a fake build of the key beating and never publishes. The victim
    (lock_timeout=None, lease 1 s) waits FOREIGN_WAIT_LEASES leases, then builds in a
    directory of its own, says why, and gets the right rows."""
    from cachekit.obtain.local_wait import FOREIGN_WAIT_LEASES

    shared = shared_root
    key = learn_key(shared)
    planter, ready = plant(shared, "beating-build", key)
    wait_for(ready.exists, timeout=TIMEOUT, what="the attacker's build", watch=[planter])
    got, stderr = ended(victim(shared))
    assert planter.poll() is None, "the attacker's beating process exited"
    assert got["outcome"] == "ok" and got["right"] and got["source"] == "built", (got, stderr)
    assert FOREIGN_WAIT_LEASES * float(LEASE) <= got["seconds"], (got, stderr)
    assert "a build of another user" in stderr, stderr
    assert "\x1b" not in stderr and "elsewhere\\x1b]0;" in stderr, stderr


@pytest.mark.parametrize("on_error,env", [
    ("raise", {"CACHEKIT_SIGNING_KEY": "team-secret"}), ("raise", {}), ("zero", {})])
def test_a_forged_failure_record_fails_no_call(shared_root, on_error, env):
    """The member holds the key's flock, writes locks/KEY.failed.json while the victim
    waits, and lets go. The victim builds and gets the right rows: a record of another
    user is ignored, with one line on stderr (for on_error="zero" none is ever read)."""
    shared = shared_root
    key = learn_key(shared) if on_error == "raise" else _zero_key(shared)
    planter, ready = plant(shared, "failure", key)
    wait_for(ready.exists, timeout=TIMEOUT, what="the attacker's lock", watch=[planter])
    got, stderr = ended(victim(shared, on_error=on_error,
                               env={**env, "PLANTS_CALLING": f"{ready}.calling"}))
    finish(planter, TIMEOUT)
    assert got["outcome"] == "ok" and got["right"], (got, stderr)
    if on_error == "raise":
        assert stderr.count("ignored the failure record") == 1, stderr


def _zero_key(shared) -> str:
    scratch = shared.base / "scratch-zero"
    scratch.mkdir()
    os.chown(scratch, shared.victim.uid, -1)
    got = finish(shared.victim.python(shared.script(VICTIM), scratch, 8, "zero", 0),
                 TIMEOUT).report()
    return got["key"]


def test_a_row_index_bomb_costs_a_build_no_memory(shared_root):
    """The member plants index/RECIPE/K.npy with a valid header, 0 rows and a 2**32-bit
    bitmap (512 MiB sparse) next to an empty entries/K/. The victim's next build of that
    recipe, limited to 1 GiB of address space more than it holds, reuses its own rows and
    succeeds, and says once that it skipped the file."""
    shared = shared_root
    first, _ = ended(victim(shared, rows=8))
    assert first["outcome"] == "ok" and first["recipe"], first
    planter, _ = plant(shared, "index-bomb", first["key"], first["recipe"])
    finish(planter, TIMEOUT).report()
    got, stderr = ended(victim(shared, rows=16, memory=1 << 30))
    assert got["outcome"] == "ok" and got["right"], (got, stderr)
    assert got["reused"] == 8, (got, stderr)
    assert stderr.count("skipped 1 row index file") == 1, stderr


def test_messages_escape_control_characters(capsys):
    from cachekit.messages import say

    say("host elsewhere\x1b]0;owned\x07\x1b[2J \x9b done")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\x9b" not in err
    assert "elsewhere\\x1b]0;owned\\x07\\x1b[2J \\x9b done" in err


def test_a_future_heartbeat_is_dead_and_one_within_the_skew_alive():
    from cachekit import liveness

    now = time.time()
    assert not liveness.is_alive(None, FAR_FUTURE, lease=60, now=now)
    assert not liveness.is_alive(None, now + 16, lease=60, now=now)
    assert liveness.is_alive(None, now + 14, lease=60, now=now)
    assert liveness.is_alive(None, now - 59, lease=60, now=now)
    assert not liveness.is_alive(None, float("nan"), lease=60, now=now)
