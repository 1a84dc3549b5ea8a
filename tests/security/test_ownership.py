"""Only the owner of a build ever writes its data: attacks on a shared root and on a builder
that pauses.

- Two plain uids of one group sharing a root the README way (tests/users.py):
  an attacker's abandoned build, rows rewritten, is never resumed by the victim (signed
  poison); a planted dead build declaring a 4 GiB data file is never copied (disk fill);
  a build lock held by a process that never builds does not block the victim forever, while
  a teammate's live build is still waited for.
- Two simulated hosts with soft locks (tests/hosts.py): a builder stopped for longer than
  the lease, whose build the other host took over and published, never writes into the
  published entry when it wakes, and returns that entry.

Every child is a real interpreter; every wait is bounded by a subprocess timeout. Images are
decoded with Pillow (``backend="pil"``): no attack depends on the backend, and then no child
imports torch, which costs seconds of CPU each.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

import cachekit
import ownership_rows
import users
from cachekit import arrays
from hosts import Finished, finish, wait_for

TIMEOUT = 60.0
"""Seconds any one child may run (none needs more than about 10 here)."""
POISON = 0xAB
"""The attacker's bytes."""
SIGNED = {"CACHEKIT_SIGNING_KEY": "the victim's own secret, 32 bytes"}
HUGE = 4 << 30
"""The data file a planted build declares: 4 GiB, sparse."""
WRITE_LIMIT = 64 << 20
"""At most this many bytes may a victim write in a call that builds a few KiB."""
FILE_SIZE_CAP = 256 << 20
"""RLIMIT_FSIZE of a victim: a runaway copy then fails with EFBIG here instead of filling
the test machine's disk (a correct victim never comes near it)."""


# --- the children ------------------------------------------------------------------------


VICTIM = textwrap.dedent(r'''
    """Victim: the team's normal ``Cache(root).images(paths, size)`` call (Pillow backend, as
    every images call here); reports what it got against the right pixels, and how much it
    wrote.

    argv: ROOT CONFIG. config: paths, size, expected (an .npy of the right pixels),
    lock_timeout, fsize_cap (RLIMIT_FSIZE in bytes, SIGXFSZ ignored: growing a file past
    it fails with EFBIG instead of filling the disk).
    """
    import json, resource, signal, sys, time, traceback
    from pathlib import Path

    import numpy as np

    import cachekit
    from hosts import report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    if config.get("fsize_cap"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (config["fsize_cap"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    expected = np.load(config["expected"])

    def io():
        """This process's I/O counters (wchar: bytes passed to write calls; write_bytes:
        bytes sent to storage)."""
        with open("/proc/self/io") as f:
            return {name: int(value) for name, value in (line.split(":") for line in f)}

    before, started = io(), time.monotonic()
    out = {}
    try:
        entry = cachekit.Cache(root, lock_timeout=config.get("lock_timeout")).images(
            config["paths"], config["size"], backend="pil")
        got = np.asarray(entry.array)
    except Exception as e:
        out.update(outcome="error", type=type(e).__name__, message=str(e)[:800],
                   traceback=traceback.format_exc()[-2000:])
    else:
        if got.shape != expected.shape or got.dtype != expected.dtype:
            wrong = list(range(len(got)))
        else:
            wrong = [i for i in range(len(got)) if not np.array_equal(got[i], expected[i])]
        poisoned = [i for i in range(len(got)) if (got[i] == config["poison"]).all()]
        out.update(outcome="ok", key=entry.key, source=entry.source, shape=list(got.shape),
                   dtype=str(got.dtype), wrong=len(wrong), wrong_rows=wrong[:3] + wrong[-1:],
                   poisoned=len(poisoned), poisoned_rows=poisoned[:3] + poisoned[-1:])
    after = io()
    out.update(seconds=round(time.monotonic() - started, 3),
               wchar=after["wchar"] - before["wchar"],
               write_bytes=after["write_bytes"] - before["write_bytes"])
    report(**out)
''')

INTERRUPTED_ATTACKER = textwrap.dedent(r'''
    """Attacker: run the team's images call and Ctrl-C it mid-build (its finished chunks stay,
    as documented), then overwrite every row of the abandoned build's data file with
    POISON, and delete the entry if one was published.

    argv: ROOT CONFIG. config: paths, size, poison, gate ([row, file]: the decode of that
    row makes the file and waits there for the test's SIGINT).
    """
    import json, os, shutil, signal, sys
    from pathlib import Path

    import numpy as np

    import cachekit
    from hosts import report, stop_decoding_at

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    stop_decoding_at(*config["gate"])
    try:
        cachekit.Cache(root, workers=1, progress=False).images(config["paths"], config["size"],
                                                                backend="pil")
    except KeyboardInterrupt:
        pass
    else:
        raise SystemExit("the build was not interrupted")

    (build,) = [d for d in (root / "tmp").iterdir()
                if d.stat().st_uid == os.getuid() and (d / "data.npy").is_file()]
    record = json.loads((build / "state.json").read_text())
    done = sorted(int(p.name[5:]) for p in (build / "data.npy.chunks").glob("done.*"))
    with open(build / "data.npy", "r+b") as f:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, _, dtype = read(f)
        offset = f.tell()
        f.write(bytes([config["poison"]]) * (os.fstat(f.fileno()).st_size - offset))
    shutil.rmtree(root / "entries" / record["key"], ignore_errors=True)
    report(build=build.name, key=record["key"], abandoned=record.get("abandoned"), done=done,
           shape=list(shape))
''')

PLANT = textwrap.dedent(r'''
    """Plant a dead build of KEY (an old heartbeat, a builder on another host) whose chunk
    journal declares a plan of a huge data file, made sparse with truncate after a valid,
    page-aligned .npy header.

    argv: ROOT CONFIG. config: key (of the directory's name and state.json), plan_key, rows,
    row_shape (uint8), done (how many chunks to record done).
    """
    import json, math, os, sys, time, uuid
    from pathlib import Path

    import numpy as np

    import cachekit
    from cachekit.store import manifest
    from cachekit.engine.filling import plan as plans
    from hosts import report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    key, rows, row_shape = config["key"], config["rows"], tuple(config["row_shape"])
    dtype, page = np.dtype(np.uint8), plans.PAGE_BYTES

    def header(shape):
        """A .npy 1.0 header for (shape, uint8), padded to a whole page."""
        text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
            np.lib.format.dtype_to_descr(dtype), tuple(shape))
        total = -(-(10 + len(text) + 1) // page) * page
        return (b"\x93NUMPY\x01\x00" + (total - 10).to_bytes(2, "little")
                + (text + " " * (total - 11 - len(text)) + "\n").encode())

    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    build = tmp / f"{key}.elsewhere.4242.{uuid.uuid4().hex[:12]}"
    build.mkdir()
    owner = {"host": "elsewhere", "pid": 4242}
    (build / "state.json").write_text(json.dumps({
        "key": key, "format": manifest.FORMAT_VERSION, "cachekit_version": cachekit.__version__,
        **owner, "started": time.time() - 3600, "done": 0, "total": rows}))
    head = header((rows, *row_shape))
    with open(build / "data.npy", "wb") as f:
        f.write(head)
    os.truncate(build / "data.npy", len(head) + rows * math.prod(row_shape))
    plan = plans.make_plan(config["plan_key"], rows, row_shape, dtype, 1, offset=len(head))
    chunks = build / "data.npy.chunks"
    chunks.mkdir()
    (chunks / "plan.json").write_text(json.dumps(plan.to_json()))
    for chunk in plan.chunks[:config["done"]]:
        (chunks / f"done.{chunk.index}").write_text(json.dumps({
            "chunk": chunk.index, "start": chunk.start, "stop": chunk.stop, "failures": [],
            "by": owner}))
    (build / "heartbeat").touch()
    old = time.time() - 3600
    os.utime(build / "heartbeat", (old, old))
    report(build=build.name, bytes=os.stat(build / "data.npy").st_size,
           blocks=os.stat(build / "data.npy").st_blocks, chunks=len(plan.chunks))
''')

LOCK_HOLDER = textwrap.dedent(r'''
    """Hold flock on ROOT/locks/KEY.lock and never build. argv: ROOT KEY READY."""
    import fcntl, sys, time
    from pathlib import Path

    root, key, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    (root / "locks").mkdir(exist_ok=True)
    held = open(root / "locks" / f"{key}.lock", "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    ready.touch()
    time.sleep(600)  # the test kills us
''')

SLOW_MAP = textwrap.dedent(r'''
    """A map whose every row outlasts the lease; reports how it got the entry and how many
    rows this process computed. argv: ROOT."""
    import sys, time
    from pathlib import Path

    import numpy as np
    import pandas as pd

    import cachekit
    from hosts import report

    CALLS = [0]

    def row(v):
        CALLS[0] += 1
        time.sleep(1.5)
        return np.full(4, v, dtype=np.int64)

    entry = cachekit.Cache(Path(sys.argv[1]), workers=1, lock_timeout=None).map(
        row, pd.Series(range(4)))
    report(source=entry.source, calls=CALLS[0], rows=np.asarray(entry.array).tolist())
''')


# --- helpers -----------------------------------------------------------------------------


def tiny_images(directory: Path, count: int) -> list[str]:
    """``count`` random 16x12 RGB PNGs (readable by every user)."""
    from PIL import Image

    directory.mkdir(mode=0o755)
    rng = np.random.default_rng(20)
    paths = []
    for i in range(count):
        path = directory / f"img_{i:04d}.png"
        Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(path)
        path.chmod(0o644)
        paths.append(str(path))
    return paths


def reference(shared: users.SharedRoot, paths: list[str], size: int) -> tuple[str, Path]:
    """(key, .npy file of the right pixels) of ``images(paths, size)``, from a fresh build in
    an empty root of this process's own."""
    entry = cachekit.Cache(shared.base / "reference", progress=False).images(paths, size,
                                                                             backend="pil")
    expected = shared.work / "expected.npy"
    np.save(expected, np.asarray(entry.array))
    expected.chmod(0o644)
    return entry.key, expected


def victim_run(shared: users.SharedRoot, config: dict[str, Any], name: str,
               env: Optional[dict[str, str]] = None) -> Finished:
    """Run :data:`VICTIM` as the victim with ``config`` (a 2 s lease), to its end."""
    path = shared.write_json(name, {"poison": POISON, "lock_timeout": 30, **config})
    return finish(shared.victim.python(shared.script(VICTIM), shared.root, path,
                                       env={"CACHEKIT_LOCK_LEASE": "2", **(env or {})}),
                  TIMEOUT)


def build_dirs(root: Path) -> list[Path]:
    """The build directories (``KEY.HOST.PID.UUID``) under ROOT/tmp."""
    tmp = root / "tmp"
    return [p for p in tmp.iterdir() if p.name.count(".") >= 3] if tmp.exists() else []


def outcome(done: Finished) -> str:
    """A victim's report without its traceback (shown apart), and its stderr."""
    got = done.report()
    shown = {k: v for k, v in got.items() if k != "traceback"}
    return (f"victim: {json.dumps(shown)}\n--- stderr ---\n{done.stderr}"
            + (f"--- traceback ---\n{got['traceback']}" if "traceback" in got else ""))


# --- 1. signed poison --------------------------------------------------------------------


def test_a_signing_victim_never_resumes_an_attackers_abandoned_build(shared_root):
    """The attacker (no signing key) runs the team's call, Ctrl-Cs it after three chunks,
    overwrites its abandoned build's rows with 0xAB and deletes any entry. The victim, with
    the key, makes the same call: it gets exactly the freshly decoded pixels, no row of the
    attacker's, and ``cachekit verify`` with the key finds nothing wrong."""
    shared = shared_root
    paths = tiny_images(shared.base / "images", 320)  # 5 chunks of 64 rows (8x8 RGB)
    key, expected = reference(shared, paths, 8)
    gate = shared.work / "gate"
    attacker_config = shared.write_json("attacker.json", {
        "paths": paths, "size": 8, "poison": POISON, "gate": [200, str(gate)]})
    attacker = shared.attacker.python(shared.script(INTERRUPTED_ATTACKER), shared.root,
                                      attacker_config)
    wait_for(gate.exists, timeout=TIMEOUT, what="the attacker's build to reach row 200",
             watch=[attacker])
    attacker.send_signal(signal.SIGINT)  # Ctrl-C
    planted = finish(attacker, TIMEOUT).report()
    assert planted["key"] == key and planted["abandoned"] is True, planted
    assert planted["done"] == [0, 1, 2], planted  # rows 0-191 finished, then rewritten

    done = victim_run(shared, {"paths": paths, "size": 8, "expected": str(expected)},
                      "victim.json", env=SIGNED)
    got = done.report()
    assert got["outcome"] == "ok", outcome(done)
    assert not got["poisoned"] and not got["wrong"], (
        f"the victim's signed entry holds {got['poisoned']} rows of the attacker's bytes "
        f"(rows {got['poisoned_rows']}) and {got['wrong']} wrong rows\n{outcome(done)}")
    checked = finish(shared.victim.cli(shared.root, "verify", env=SIGNED), TIMEOUT)
    assert checked.ok, checked.failure()


POISONED_FAILED_ATTACKER = textwrap.dedent(r'''
    """Attacker: run the team's images call with a file that is no image appended, its
    decoder rewritten to give POISON for every other file, so that the failed build keeps
    poisoned rows, internally consistent (checksums and block digests of the poison).

    argv: ROOT CONFIG. config: paths, size, poison, bad (the file that is no image).
    """
    import json, sys
    from pathlib import Path

    import numpy as np

    import cachekit
    import cachekit.engine.decoding.images
    from hosts import report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    decode = cachekit.engine.decoding.images.load_image

    def load_image(path, *args, **kwargs):
        row = decode(path, *args, **kwargs)  # raises for the bad file
        return np.full_like(row, config["poison"])

    cachekit.engine.decoding.images.load_image = load_image
    cache = cachekit.Cache(root, workers=1, progress=False)
    try:
        cache.images([*config["paths"], config["bad"]], config["size"], backend="pil")
    except cachekit.ImageDecodeError:
        pass
    report(kept=[e.key for e in cache.entries() if e.failed_build is not None])
''')


def test_a_signing_victim_never_copies_rows_an_attackers_failed_build_kept(shared_root):
    """The attacker (no signing key) makes a failed build keep poisoned rows of the team's
    column; the victim, with the key, builds the column: it gets exactly the freshly decoded
    pixels, since kept rows face the checks of any source of rows."""
    shared = shared_root
    paths = tiny_images(shared.base / "images", 40)
    bad = shared.base / "images" / "broken.png"
    bad.write_bytes(b"no image")
    bad.chmod(0o644)
    _, expected = reference(shared, paths, 8)
    config = shared.write_json("attacker.json", {"paths": paths, "size": 8, "poison": POISON,
                                                 "bad": str(bad)})
    planted = finish(shared.attacker.python(shared.script(POISONED_FAILED_ATTACKER),
                                            shared.root, config), TIMEOUT).report()
    assert len(planted["kept"]) == 1, planted
    done = victim_run(shared, {"paths": paths, "size": 8, "expected": str(expected)},
                      "victim.json", env=SIGNED)
    got = done.report()
    assert got["outcome"] == "ok" and got["source"] == "built", outcome(done)
    assert not got["poisoned"] and not got["wrong"], outcome(done)


# --- 2. disk fill ------------------------------------------------------------------------


PLANTS = {
    # planted by: (the plan's key, rows, row shape); the directory is of the victim's key
    "attacker, plan of other rows": ("attacker", "victim", HUGE // 192, (3, 8, 8)),
    "victim's own, plan of other rows": ("victim", "victim", HUGE // 192, (3, 8, 8)),
    "victim's own, plan of another key": ("victim", "other", HUGE // 192, (3, 8, 8)),
    "victim's own, plan of another row template": ("victim", "victim", 64, (4, 4096, 4096)),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_dead_build_declaring_4_gib_is_never_copied(shared_root, plant):
    """A dead build of the victim's key whose plan declares a 4 GiB (sparse) data file,
    planted by the attacker, or the victim's own whose plan is not of this call (other rows,
    another key, another row template): the victim's call returns the right pixels and
    writes a tiny fraction of that (a copy would need a file past its RLIMIT_FSIZE)."""
    shared = shared_root
    by, plan_key, rows, row_shape = PLANTS[plant]
    paths = tiny_images(shared.base / "images", 64)
    key, expected = reference(shared, paths, 8)
    planter = shared.attacker if by == "attacker" else shared.victim
    config = shared.write_json("plant.json", {
        "key": key, "plan_key": key if plan_key == "victim" else "0" * 32, "rows": rows,
        "row_shape": list(row_shape), "done": 4})
    planted = finish(planter.python(shared.script(PLANT), shared.root, config),
                     TIMEOUT).report()
    assert planted["bytes"] >= HUGE - 4096 and planted["blocks"] < 1024, planted  # sparse

    done = victim_run(shared, {"paths": paths, "size": 8, "expected": str(expected),
                               "fsize_cap": FILE_SIZE_CAP}, "victim.json")
    got = done.report()
    print(f"{plant}: the victim wrote {got['wchar']} bytes (wchar), "
          f"{got['write_bytes']} to storage")
    assert got["wchar"] < WRITE_LIMIT and got["write_bytes"] < WRITE_LIMIT, (
        f"the victim wrote {got['wchar']} bytes (wchar), {got['write_bytes']} to storage, "
        f"for an entry of {len(paths) * 192} bytes\n{outcome(done)}")
    assert got["outcome"] == "ok" and not got["wrong"], (
        f"the victim's call did not return the right pixels\n{outcome(done)}")


# --- 3. a late writer --------------------------------------------------------------------


HOST_AGENT = textwrap.dedent(r'''
    """Map ownership_rows.host_row over ROWS values, one worker in threads; report the entry.
    argv: ROOT ROWS."""
    import sys, traceback
    from pathlib import Path

    import pandas as pd

    import cachekit
    import ownership_rows
    from cachekit import arrays
    from hosts import report

    root, rows = Path(sys.argv[1]), int(sys.argv[2])
    try:
        entry = cachekit.Cache(root, workers=1, executor="threads").map(
            ownership_rows.host_row, pd.Series(range(rows)))
    except Exception as e:
        report(outcome="error", type=type(e).__name__, message=str(e)[:800],
               traceback=traceback.format_exc()[-2000:])
    else:
        report(outcome="ok", key=entry.key, source=entry.source,
               checksum=arrays.checksum(entry.path / "data.npy")[1])
''')


def _chunk_journals(root: Path) -> list[Path]:
    tmp = root / "tmp"
    return list(tmp.glob("*/data.npy.chunks")) if tmp.exists() else []


def test_a_builder_paused_past_its_lease_never_writes_into_the_entry_published_meanwhile(
        two_hosts):
    """Soft locks, a 2 s lease. host-a builds slowly; after two chunks it is stopped
    (SIGSTOP). host-b asks for the same map, takes the build over once host-a's lease has
    run out, and publishes. Then host-a resumes (SIGCONT) and finishes: the published
    entry's checksum is unchanged, ``verify`` is clean, every row is host-b's or one that
    host-a had finished before the pause, and host-a's call returns the published entry."""
    a, b = two_hosts
    rows = 384  # 6 chunks of 64 rows
    env = {"CACHEKIT_LOCK": "soft", "CACHEKIT_LOCK_LEASE": "2"}
    slow = {**env, ownership_rows.SECONDS_ENV: "0.01"}
    late = a.python(HOST_AGENT, a.root, rows, env=slow)
    journal = wait_for(lambda: next((j for j in _chunk_journals(a.root)
                                     if (j / "done.1").exists()), None),
                       timeout=TIMEOUT, what="host-a's first two chunks", watch=[late])
    time.sleep(0.1)  # well inside chunk 2 (0.64 s of rows)
    os.killpg(late.pid, signal.SIGSTOP)
    try:
        paused_done = sorted(int(p.name[5:]) for p in journal.glob("done.*"))
        chunk_rows = json.loads((journal / "plan.json").read_text())["chunk_rows"]
        taker = finish(b.python(HOST_AGENT, b.root, rows, env=env), TIMEOUT)
        took = taker.report()
        assert took["outcome"] == "ok", taker.failure()
        entry_data = a.root / "entries" / took["key"] / "data.npy"
        published = arrays.checksum(entry_data)[1]
        checked = finish(b.cli("verify", env=env), TIMEOUT)
        assert checked.ok, checked.failure()
    finally:
        os.killpg(late.pid, signal.SIGCONT)
    woke = finish(late, TIMEOUT)
    after = arrays.checksum(entry_data)[1]
    rechecked = finish(b.cli("verify", env=env), TIMEOUT)
    written = np.load(entry_data, mmap_mode="r")
    mine, theirs = ownership_rows.HOST_BYTES["host-a"], ownership_rows.HOST_BYTES["host-b"]
    allowed_a = {r for c in paused_done for r in range(c * chunk_rows, (c + 1) * chunk_rows)}
    late_rows = [r for r in range(rows) if not (
        (written[r] == theirs).all() or ((written[r] == mine).all() and r in allowed_a))]
    context = (f"host-a had done chunks {paused_done} of {chunk_rows} rows when stopped\n"
               f"{taker.failure()}\n{woke.failure()}\n{rechecked.failure()}")

    problems = []
    if after != published:
        problems.append(f"the published entry's checksum changed after host-a woke "
                        f"({published} -> {after})")
    if late_rows:
        problems.append(f"{len(late_rows)} rows of the entry are neither host-b's nor done by "
                        f"host-a before the pause (rows {late_rows[0]}..{late_rows[-1]})")
    if not rechecked.ok:
        problems.append("cachekit verify finds a problem after host-a woke")
    woke_report = woke.report()
    if woke_report["outcome"] != "ok" or woke_report.get("source") != "local":
        problems.append(f"host-a's call ended {woke_report['outcome']} "
                        f"{woke_report.get('type', '')} {woke_report.get('source', '')}, not "
                        "with the published entry (source local)")
    elif woke_report["checksum"] != published:
        problems.append("host-a's call returned data other than the published entry's")
    assert not problems, "; ".join(problems) + "\n" + context


# --- 4. a held lock ----------------------------------------------------------------------


def test_a_lock_held_by_a_process_that_never_builds_does_not_block_forever(shared_root):
    """The attacker holds flock on locks/KEY.lock and never builds. The victim, with
    lock_timeout=None and a 2 s lease, builds anyway within a bounded time, in a directory
    of its own, gets the right pixels, and says on stderr that the holder shows no
    heartbeat. Once the holder is gone, the victim's ``clear`` takes the lock file it left."""
    shared = shared_root
    paths = tiny_images(shared.base / "images", 64)
    key, expected = reference(shared, paths, 8)
    ready = shared.work / "locked"
    holder = shared.attacker.python(shared.script(LOCK_HOLDER), shared.root, key, ready)
    wait_for(ready.exists, timeout=TIMEOUT, what="the attacker to hold the lock",
             watch=[holder])

    done = victim_run(shared, {"paths": paths, "size": 8, "expected": str(expected),
                               "lock_timeout": None}, "victim.json")
    got = done.report()
    assert holder.poll() is None, "the lock holder exited"
    assert got["outcome"] == "ok" and got["source"] == "built" and not got["wrong"], \
        outcome(done)
    assert "no heartbeat" in done.stderr, outcome(done)
    assert [p.name for p in (shared.root / "locks").glob("*.lock")] == [f"{key}.lock"]
    holder.send_signal(signal.SIGKILL)  # the lock file it leaves is the victim's to take
    holder.wait()
    cleared = finish(shared.victim.cli(shared.root, "clear", "--all", "--yes"), TIMEOUT)
    assert cleared.ok and "removed 1 entry" in cleared.stdout, cleared.failure()
    assert list((shared.root / "locks").glob("*.lock*")) == []


def test_a_live_teammates_build_is_waited_for_not_duplicated(shared_root):
    """A teammate (another uid) builds a map whose every row outlasts the 1 s lease, holding
    the lock, its heartbeat beating. The victim asks meanwhile, with lock_timeout=None: it
    waits several leases and takes the teammate's entry, computing no row itself. No lock
    file of either is left behind."""
    shared = shared_root
    script = shared.script(SLOW_MAP)
    env = {"CACHEKIT_LOCK_LEASE": "1"}
    builder = shared.attacker.python(script, shared.root, env=env)  # here an honest teammate
    wait_for(lambda: build_dirs(shared.root), timeout=TIMEOUT,
             what="the teammate's build directory", watch=[builder])
    waiter = shared.victim.python(script, shared.root, env=env)
    built, waited = finish(builder, TIMEOUT), finish(waiter, TIMEOUT)
    context = f"{built.failure()}\n{waited.failure()}"
    expected = [[v] * 4 for v in range(4)]
    assert built.report() == {"source": "built", "calls": 4, "rows": expected}, context
    assert waited.report() == {"source": "local", "calls": 0, "rows": expected}, context
    assert list((shared.root / "locks").glob("*.lock*")) == []  # each holder took its own
