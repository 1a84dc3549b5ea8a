"""A cache root a team shares: two plain uids of one group, a victim and an attacker.

The root is group-owned, setgid and used under ``umask 002`` (the README recipe), so the
attacker may write anywhere under it, but nowhere else the victim owns. Whatever the
attacker plants under the root (symlinks or FIFOs under every name cachekit uses, the
root's own folders swapped for symlinks, tampered manifests, failure records, entries
built without the signing key), every victim process must

- leave the victim's files outside the cache exactly as they were (content, listing,
  modes and mtimes: a symlink followed once is caught), and
- succeed with correct data or fail with a :class:`cachekit.CachekitError`, in bounded
  time, never with another exception.

Each test runs real interpreters as bare uids (tests/users.py). The victim's calls are
reported one by one by :data:`VICTIM`; the attacker's doings are counted by
:data:`ATTACKER` and shown when a test fails. Every wait is bounded by a subprocess timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

import users
from hosts import Finished, HostProcess, StartBarrier, finish, wait_for

TIMEOUT = 150.0
"""Seconds any one child may run (none needs more than about 30 here)."""
ATTACK_SECONDS = 90.0
"""The longest an attacker plants; it stops as soon as the victim is done."""
VICTIM_ENV = {"CACHEKIT_LOCK_LEASE": "2"}
"""A short lease, so that a soft lock or a build the victim judges stale is taken over soon."""
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
"""Raw control characters (newline aside): what a terminal would interpret."""

VICTIM = textwrap.dedent(r'''
    """Victim: build entries, then hit them, under a shared root; report every call.

    argv: ROOT CONFIG [MODE]. MODE "run" (default) calls each variant config["calls"]
    times; "keys" reports the keys of the variants (building in ROOT, a scratch root, with
    no delay); "crash" starts the first variant's build and stops in it at row GATE, for
    the test to kill. Globals are not part of a function's key, so DELAY, GATE and
    $VICTIM_POISON (nonzero: wrong rows under the same key, for an attacker) change no key.
    """
    import json, os, sys, time, traceback
    from pathlib import Path

    import numpy as np
    import pandas as pd

    import cachekit
    from hosts import StartBarrier, report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    mode = sys.argv[3] if len(sys.argv) > 3 else "run"
    OP, ROWS, VARIANTS = config["op"], config["rows"], config["variants"]
    LOCKS = config.get("locks", ["os"])
    DELAY = 0.0 if mode == "keys" else config.get("delay", 0.0)
    GATE = config.get("gate") if mode == "crash" else None
    POISON = int(os.environ.get("VICTIM_POISON", "0"))


    def peak_rss_kb():
        """This program's peak RSS (VmHWM, which starts afresh at exec; ru_maxrss would
        also count the pages of the large pytest process this child was forked from)."""
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    CALLS = [0]

    def row(v):
        CALLS[0] += 1
        if GATE is not None and v == GATE[0]:
            Path(GATE[1]).touch()
            time.sleep(600)  # the test kills us here
        time.sleep(DELAY)
        return np.full(8, v + POISON, dtype=np.int64)

    cache = cachekit.Cache(root, workers=1, lock_timeout=config.get("lock_timeout", 20))

    @cache.memoize
    def features(n, variant):
        CALLS[0] += 1
        time.sleep(DELAY)
        a = np.arange(n * 8, dtype=np.int64).reshape(n, 8) + variant + POISON
        return {"a": a, "b": (np.full(3, variant, dtype=np.float32), np.eye(2) * variant)}

    def call(variant):
        """(what the call returned, its key, whether it was a hit)"""
        if OP in ("map", "resume"):
            entry = cache.map(row, pd.Series(range(ROWS)), version=variant)
            return entry.array, entry.key, entry.hit
        if OP == "images":  # pil: no attack depends on the backend, and no torch to import
            entry = cache.images(pd.Series(config["images"]), 8 + variant, backend="pil")
            return entry.array, entry.key, entry.hit
        before = CALLS[0]
        got = features(ROWS, variant)
        return got, features.cache_key(ROWS, variant), CALLS[0] == before

    def expected(variant):
        if OP in ("map", "resume"):
            return np.repeat(np.arange(ROWS, dtype=np.int64)[:, None], 8, axis=1) + POISON
        if OP == "images":
            from cachekit.engine.decoding.images import load_image
            size = 8 + variant
            return np.stack([load_image(p, (size, size), backend="pil")
                             for p in config["images"]])
        a = np.arange(ROWS * 8, dtype=np.int64).reshape(ROWS, 8) + variant + POISON
        return {"a": a, "b": (np.full(3, variant, dtype=np.float32), np.eye(2) * variant)}

    def same(got, want):
        if isinstance(want, dict):
            return (isinstance(got, dict) and list(got) == list(want)
                    and all(same(got[k], want[k]) for k in want))
        if isinstance(want, tuple):
            return (isinstance(got, tuple) and len(got) == len(want)
                    and all(same(g, w) for g, w in zip(got, want)))
        got = np.asarray(got)
        return got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)

    def attempt(variant, what):
        os.environ["CACHEKIT_LOCK"] = LOCKS[variant % len(LOCKS)]
        out = {"variant": variant, "call": what, "lock": os.environ["CACHEKIT_LOCK"]}
        before, started = CALLS[0], time.monotonic()
        try:
            got, out["key"], out["hit"] = call(variant)
        except cachekit.CachekitError as e:
            out.update(outcome="cachekit-error", type=type(e).__name__, message=str(e)[:600])
        except BaseException as e:
            out.update(outcome="other-error", type=type(e).__name__,
                       traceback=traceback.format_exc()[-3000:])
        else:
            out.update(outcome="ok", correct=bool(same(got, expected(variant))))
        out.update(calls=CALLS[0] - before, seconds=round(time.monotonic() - started, 3))
        return out

    if mode == "keys":
        keys = [features.cache_key(ROWS, v) if OP == "memoize" else call(v)[1]
                for v in VARIANTS]
        report(keys=keys)
    elif mode == "crash":
        call(VARIANTS[0])
        report(error="the gated build finished")
    else:
        if "barrier" in config:
            StartBarrier(Path(config["barrier"][0]), config["barrier"][1]).wait("victim")
        results = [attempt(v, what) for v in VARIANTS for what in config.get("calls", ["build", "hit"])]
        report(results=results, maxrss_kb=peak_rss_kb())
''')

ATTACKER = textwrap.dedent(r'''
    """Attacker: for a bounded time, keep planting symlinks (or FIFOs) under a shared root.

    argv: ROOT CONFIG. config["scope"] says where:
    "inside": every file name cachekit uses, in every directory under tmp/ (build
        directories and their claimed/ part) and entries/: created where missing, swapped in
        by rename for a file someone else made, and so are the random .NAME.*.tmp files;
    "swap": build directories (and published entries) swapped, atomically, for symlinks
        to the victim's folders as soon as they appear;
    "entries": entries/KEY planted as a symlink to a victim folder as soon as a build of
        KEY starts after ours (its lookup has passed: the commit meets the link);
    "locks": KEY.lock, KEY.lock.soft, KEY.failed.json of every key known or seen.
    config["kind"]: "symlink" (to the victim's files and folders, in turn) or "fifo".
    """
    import collections, ctypes, errno, itertools, json, os, re, stat, sys, time
    from pathlib import Path

    from hosts import StartBarrier, report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    SCOPE, KIND = config["scope"], config.get("kind", "symlink")
    FILES, DIRS = itertools.cycle(config["file_targets"]), itertools.cycle(config["dir_targets"])
    KNOWN = set(config.get("keys", []))
    NAMES = ("manifest.json", "data.npy", "leaf_1.npy", "leaf_2.npy", "state.json",
             "heartbeat", "data.npy.chunks")
    TEMP = re.compile(r"^\..+\.tmp$")
    KEY = re.compile(r"^(?:deleting\.)?([0-9a-f]{32})(?:\.|$)")
    TMP, ENTRIES, LOCKS = root / "tmp", root / "entries", root / "locks"
    serial = itertools.count()
    done = collections.Counter()

    def label(directory, name):
        parts = os.path.relpath(os.path.join(directory, name), root).split(os.sep)
        if len(parts) > 1:
            parts[1] = KEY.sub("KEY.", parts[1]).rstrip(".") if parts[0] != "tmp" else "BUILD"
        return "/".join(parts)

    def make(path, target):
        if KIND == "fifo":
            os.mkfifo(path)
        else:
            os.symlink(target, path)

    def plant(directory, name, target):
        """Our link or FIFO at directory/name: made where nothing is, else swapped in by
        rename for a regular file someone else made (never for a directory)."""
        path = os.path.join(directory, name)
        try:
            make(path, target)
            done["planted " + label(directory, name)] += 1
            return
        except FileExistsError:
            pass
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return
        except OSError:
            return
        aside = os.path.join(directory, f".atk.{next(serial)}")
        try:
            make(aside, target)
            os.rename(aside, path)
            done["replaced " + label(directory, name)] += 1
        except OSError:
            try:
                os.unlink(aside)
            except OSError:
                pass

    LIBC = ctypes.CDLL(None, use_errno=True)
    RENAME_EXCHANGE = 2

    def exchange(a, b):
        """Swap two names atomically (renameat2 RENAME_EXCHANGE): no instant without either."""
        renameat2 = getattr(LIBC, "renameat2", None)
        if renameat2 is None or renameat2(-100, os.fsencode(a), -100, os.fsencode(b),
                                          RENAME_EXCHANGE) != 0:
            error = ctypes.get_errno() if renameat2 is not None else 38
            raise OSError(error, os.strerror(error), b)

    def swap(directory):
        """Put a link to a victim folder where a directory was, in one atomic exchange (the
        directory lives on as .atk-stash.N); rename, then symlink, where that is missing."""
        parent, name = os.path.split(directory)
        stash = os.path.join(parent, f".atk-stash.{next(serial)}")
        try:
            os.symlink(next(DIRS), stash)
            exchange(stash, directory)
            done["swapped " + label(parent, name)] += 1
            return
        except OSError as e:
            try:
                os.unlink(stash)
            except OSError:
                pass
            if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                return
        try:
            os.rename(directory, stash)
            os.symlink(next(DIRS), directory)
            done["swapped (not atomically) " + label(parent, name)] += 1
        except OSError:
            pass

    def directories(top, depth):
        """Real directories under top (symlinks not followed), down to depth levels."""
        found = []
        try:
            items = list(os.scandir(top))
        except OSError:
            return found
        for item in items:
            try:
                if item.is_dir(follow_symlinks=False) and not item.name.startswith(".atk"):
                    found.append(item.path)
                    if depth > 1:
                        found += directories(item.path, depth - 1)
            except OSError:
                pass
        return found

    def listing(top):
        try:
            return os.listdir(top)
        except OSError:
            return []

    BEFORE = set(listing(TMP))  # builds that were there before us (a dead one, say)

    def keys(known=True):
        """The keys given, and those of every build or entry seen so far (or, with
        known=False, only those of builds started since we began)."""
        if not known:
            return {m.group(1) for m in map(KEY.match, set(listing(TMP)) - BEFORE) if m}
        names = listing(TMP) + listing(ENTRIES)
        return set(KNOWN) | {m.group(1) for m in map(KEY.match, names) if m}

    def once():
        if SCOPE == "inside":
            for directory in directories(TMP, 2) + directories(ENTRIES, 1):
                for name in NAMES:
                    plant(directory, name, next(FILES))
                try:
                    names = os.listdir(directory)
                except OSError:
                    continue
                for name in names:
                    if TEMP.match(name):
                        plant(directory, name, next(FILES))
        elif SCOPE == "entries":
            for key in keys(known=False):
                try:
                    make(ENTRIES / key, next(DIRS))
                    done["planted entries/KEY"] += 1
                except OSError:
                    pass
        elif SCOPE == "swap":
            for directory in directories(TMP, 1) + directories(ENTRIES, 1):
                if not os.path.basename(directory).startswith("deleting."):
                    swap(directory)
        elif SCOPE == "locks":
            for key in keys():
                for suffix in (".lock", ".lock.soft", ".failed.json"):
                    plant(str(LOCKS), key + suffix, next(FILES))

    for folder in (ENTRIES, TMP, LOCKS):  # whoever comes first makes them; here, we do
        folder.mkdir(exist_ok=True)
    once()  # before the victim starts: what is already there (locks, a dead build) is ours
    StartBarrier(Path(config["barrier"][0]), config["barrier"][1]).wait("attacker")
    deadline, stop, rounds = time.monotonic() + config["seconds"], Path(config["stop"]), 0
    while time.monotonic() < deadline and not stop.exists():
        once()
        rounds += 1
        time.sleep(0.0005)
    report(rounds=rounds, done=dict(done))
''')

WRITE = textwrap.dedent(r'''
    """Attacker: put the bytes of SOURCE at TARGET by rename (parents made as needed), or
    make TARGET a directory holding one file when SOURCE is "mkdir", or replace the
    directory TARGET with a symlink to SOURCE when the third argument is "symlink"."""
    import os, sys
    from pathlib import Path
    from hosts import report

    source, target = sys.argv[1], Path(sys.argv[2])
    how = sys.argv[3] if len(sys.argv) > 3 else "write"
    target.parent.mkdir(parents=True, exist_ok=True)
    if how == "mkdir":
        target.mkdir()
        (target / "keep").write_text("a directory where a lock file goes\n")
    elif how == "symlink":
        if target.exists():
            os.rename(target, target.with_name(target.name + ".stash"))
        os.symlink(source, target)
    else:
        partial = target.with_name(f".{target.name}.attacker.tmp")
        partial.write_bytes(Path(source).read_bytes())
        os.replace(partial, target)
    report(done=how, target=str(target))
''')

IDS = textwrap.dedent(r'''
    """Who am I, and what may I do? argv: ROOT SECRET VICTIM_HOME."""
    import os, stat, sys
    from pathlib import Path
    import cachekit
    from hosts import report

    root, secret, home = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    def can(action):
        try:
            action()
            return True
        except PermissionError:
            return False
    me = Path(root / f"made-by-{os.getuid()}")
    me.write_text("x")
    st = me.stat()
    report(ids=[os.getresuid(), os.getresgid(), os.getgroups()], umask=os.umask(0o002),
           cachekit=cachekit.__file__, made=[oct(stat.S_IMODE(st.st_mode)), st.st_gid],
           read_secret=can(secret.read_bytes),
           write_victim_home=can(lambda: (home / f"by-{os.getuid()}").write_text("x")))
''')

OPS: dict[str, dict[str, Any]] = {
    "images": {"rows": 12, "variants": [0, 1], "locks": ["os", "soft"]},
    "map": {"rows": 64, "variants": [0, 1], "locks": ["os", "soft"], "delay": 0.005},
    "memoize": {"rows": 64, "variants": [0, 1], "locks": ["os", "soft"], "delay": 0.3},
    "resume": {"rows": 3000, "variants": [0], "delay": 0.0002},
}
"""What the victim does: rows per build, the variants (distinct keys) it builds and then
hits, the lock kind of each variant in turn, and how slow each row (map) or call is."""
GATE_ROW = 1500
"""Where a build to be resumed is killed: after its first done chunks (320 rows each)."""


# --- the victim's own files outside the cache --------------------------------------------


def make_victim_files(victim: users.User) -> dict[str, list[str]]:
    """The victim's precious things outside the cache: a text file, .npy files with the very
    headers cachekit's builds write (a memmap opened through a link to one of them would
    silently write into it), and an MLflow-like folder whose runs have 32-hex names, just
    like cache keys. Owned by the victim, 0644/0755: the attacker may read but not write.
    Returns the symlink targets an attacker points at, files and folders."""
    home = victim.home
    (home / "precious.txt").write_text("the only copy of my thesis\n" * 200)
    np.save(home / "exported.npy", np.zeros((OPS["resume"]["rows"], 8), np.int64))
    np.save(home / "small.npy", np.zeros((64, 8), np.int64))
    np.save(home / "thumbs.npy", np.zeros((12, 3, 8, 8), np.uint8))
    runs = home / "mlruns" / "0"
    runs.mkdir(parents=True)
    (runs / "meta.yaml").write_text("name: Default\n")
    run_dirs = []
    for i in range(3):
        run = runs / hashlib.md5(f"run {i}".encode()).hexdigest()
        (run / "metrics").mkdir(parents=True)
        (run / "artifacts").mkdir()
        (run / "meta.yaml").write_text(f"run_id: {run.name}\nstatus: FINISHED\n")
        (run / "metrics" / "loss").write_text("1700000000 0.25 0\n")
        (run / "artifacts" / "manifest.json").write_text('{"model": "resnet18"}\n')
        np.save(run / "artifacts" / "data.npy", np.zeros((64, 8), np.int64))
        run_dirs.append(run)
    for dirpath, dirnames, filenames in os.walk(home):
        os.chown(dirpath, victim.uid, victim.gid)
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chown(os.path.join(dirpath, name), victim.uid, victim.gid)
            os.chmod(os.path.join(dirpath, name), 0o644)
    files = [home / "precious.txt", home / "exported.npy", home / "small.npy",
             home / "thumbs.npy", run_dirs[0] / "metrics" / "loss",
             run_dirs[1] / "artifacts" / "data.npy"]
    folders = [runs, run_dirs[0], run_dirs[2] / "artifacts"]
    return {"file_targets": [str(p) for p in files], "dir_targets": [str(p) for p in folders]}


def _describe(path: Path) -> tuple:
    st = os.lstat(path)
    content: Optional[str] = None
    if stat.S_ISREG(st.st_mode):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            content = hashlib.sha256(f.read()).hexdigest()
    elif stat.S_ISLNK(st.st_mode):
        content = "-> " + os.readlink(path)
    return (stat.filemode(st.st_mode), st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
            content)


def snapshot(top: Path) -> dict[str, tuple]:
    """Everything under ``top`` (itself included), symlinks not followed: type and mode,
    owner, size, mtime, and the content's hash (or a link's target)."""
    found = {".": _describe(top)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            found[str(path.relative_to(top))] = _describe(path)
    return found


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs between two snapshots, one line per path."""
    fields = ("mode", "uid", "gid", "size", "mtime", "content")
    out = [f"+ {p} {after[p][0]}" for p in sorted(after.keys() - before.keys())]
    out += [f"- {p}" for p in sorted(before.keys() - after.keys())]
    for p in sorted(before.keys() & after.keys()):
        if before[p] != after[p]:
            diff = [f"{f} {b!r} -> {a!r}" for f, b, a in zip(fields, before[p], after[p])
                    if a != b]
            out.append(f"~ {p}: {', '.join(diff)}")
    return out


# --- running the victim and the attacker -------------------------------------------------


def victim_config(shared: users.SharedRoot, op: str, **extra: Any) -> dict[str, Any]:
    config = {"op": op, **OPS[op]}
    if op == "images":
        from cachekit.samples import write_sample_images

        config["images"] = [str(p) for p in write_sample_images(
            shared.base / "images", OPS["images"]["rows"], seed=7)]
    if op == "resume":
        config["gate"] = [GATE_ROW, str(shared.work / "gate")]
    config.update(extra)
    return config


def learn_keys(shared: users.SharedRoot, script: Path, config: Path) -> list[str]:
    """The keys of the victim's variants, from a run in a scratch root of the victim's."""
    scratch = shared.base / "scratch"
    if not scratch.exists():
        scratch.mkdir()
        os.chown(scratch, shared.victim.uid, users.GID)
    return finish(shared.victim.python(script, scratch, config, "keys"), TIMEOUT).report()["keys"]


def interrupt_a_build(shared: users.SharedRoot, script: Path, config: Path) -> list[Path]:
    """Start the victim's gated build, SIGKILL it after its first done chunks, and return the
    dead build directories it left."""
    gate = shared.work / "gate"
    process = shared.victim.python(script, shared.root, config, "crash", env=VICTIM_ENV)
    wait_for(gate.exists, timeout=TIMEOUT, what="the victim's build to reach its gate",
             watch=[process])
    process.kill_group()
    finish(process, 30)
    dead = [p for p in (shared.root / "tmp").iterdir()  # a whole fill, or the rest of one
            if any((p / journal / "done.0").exists()  # that copied rows of an entry
                   for journal in ("data.npy.chunks", "data.npy.rest.chunks"))]
    assert dead, f"no build directory with a done chunk under {shared.root / 'tmp'}"
    return dead


def outcomes(finished: Finished) -> list[dict[str, Any]]:
    return finished.report()["results"]


def bad_outcomes(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls that neither succeeded with correct data nor failed with a CachekitError."""
    return [r for r in results if r["outcome"] == "other-error"
            or (r["outcome"] == "ok" and not r["correct"])]


def summary(results: list[dict[str, Any]]) -> str:
    """One line per call: variant, call, outcome, type, time, and the message's start."""
    lines = []
    for r in results:
        what = r["outcome"] + ("" if r["outcome"] != "ok" else
                               (" hit" if r["hit"] else " built")
                               + (" correct" if r["correct"] else " WRONG DATA"))
        detail = r.get("message") or (r.get("traceback") or "").strip().splitlines()[-1:]
        lines.append(f"  v{r['variant']} {r['call']:<5} {r['lock']:<4} {what:<16} "
                     f"{r.get('type', ''):<20} {r['seconds']:>7.2f}s {str(detail)[:160]}")
    return "\n".join(lines)


def attack(shared: users.SharedRoot, op: str, scope: str, kind: str = "symlink",
           **config_extra: Any) -> dict[str, Any]:
    """Run the victim's ``op`` while the attacker plants ``kind`` in ``scope`` (none for
    "none"); for "resume", kill a victim build first, then run it again under attack.
    Returns what happened; asserts nothing."""
    targets = make_victim_files(shared.victim)
    before = snapshot(shared.victim.home)
    script = shared.script(VICTIM)
    config = victim_config(shared, op, **{"lock_timeout": 8, **config_extra})
    config["barrier"] = [str(shared.work), "attack"]
    config_path = shared.write_json(f"victim-{op}.json", config)
    keys = learn_keys(shared, script, config_path) if scope != "none" else []
    dead = interrupt_a_build(shared, script, config_path) if op == "resume" else []
    stop = shared.work / "stop"
    attackers: list[HostProcess] = []
    if scope != "none":
        attacker_config = shared.write_json("attacker.json", {
            **targets, "scope": scope, "kind": kind, "keys": keys, "seconds": ATTACK_SECONDS,
            "stop": str(stop), "barrier": config["barrier"]})
        attackers.append(shared.attacker.python(shared.script(ATTACKER), shared.root,
                                                attacker_config))
    victim = shared.victim.python(script, shared.root, config_path, env=VICTIM_ENV)
    StartBarrier(shared.work, "attack").release([*attackers, victim])
    try:
        done = finish(victim, TIMEOUT)
    finally:
        stop.touch()
    planted = [finish(a, 60).report() for a in attackers]
    results = outcomes(done)
    print(f"{op} under {kind}s ({scope}):\n{summary(results)}\nattacker: {planted}")
    return {"victim": done, "results": results, "planted": planted, "dead": dead,
            "changed": changes(before, snapshot(shared.victim.home)), "keys": keys}


def verdict(happened: dict[str, Any]) -> str:
    """Why an attack test fails, first line first (empty when it passes)."""
    problems = []
    if happened["changed"]:
        problems.append(f"the victim's files changed outside the cache: "
                        f"{len(happened['changed'])} paths")
    bad = bad_outcomes(happened["results"])
    if bad:
        kinds = sorted({r.get("type", "wrong data") if r["outcome"] != "ok" else "WRONG DATA"
                        for r in bad})
        problems.append(f"{len(bad)} call(s) ended neither correctly nor with a "
                        f"CachekitError: {', '.join(kinds)}")
    if not problems:
        return ""
    text = "; ".join(problems)
    text += "\n--- victim's calls ---\n" + summary(happened["results"])
    text += "\n--- changed ---\n" + "\n".join(happened["changed"][:25])
    text += "\n--- attacker ---\n" + json.dumps(happened["planted"], indent=1)[:2000]
    tracebacks = [r["traceback"] for r in bad if "traceback" in r]
    if tracebacks:
        text += "\n--- first traceback ---\n" + tracebacks[0]
    return text


# --- the harness itself ------------------------------------------------------------------


def test_children_are_plain_uids_of_one_group(shared_root: users.SharedRoot) -> None:
    """Both children run as bare uids of group GID under umask 002, import cachekit from
    this checkout, get the shared group on what they make under the setgid root, and are
    held by ordinary permissions (no root left over)."""
    secret = shared_root.base / "root-only"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    script = shared_root.script(IDS)
    for user in (shared_root.victim, shared_root.attacker):
        got = finish(user.python(script, shared_root.root, secret, shared_root.victim.home),
                     TIMEOUT).report()
        assert got["ids"] == [[user.uid] * 3, [users.GID] * 3, [users.GID]]
        assert got["umask"] == 0o002
        assert got["cachekit"] == str(users.CHECKOUT / "cachekit" / "__init__.py")
        assert got["made"] == ["0o664", users.GID]
        assert got["read_secret"] is False
        assert got["write_victim_home"] is (user is shared_root.victim)


# --- symlinks and FIFOs planted everywhere -----------------------------------------------


@pytest.mark.parametrize("op", ["images", "map", "memoize", "resume"])
def test_without_an_attacker_every_victim_call_succeeds(shared_root, op):
    """The control: the same victim runs, unattacked, succeed with correct data (a resumed
    build does resume)."""
    happened = attack(shared_root, op, "none")
    results = happened["results"]
    assert not happened["changed"] and all(r["outcome"] == "ok" and r["correct"]
                                           for r in results), summary(results)
    assert [r["hit"] for r in results] == [r["call"] == "hit" for r in results], \
        summary(results)
    if op == "resume":
        assert "resuming the build" in happened["victim"].stderr
        assert 0 < results[0]["calls"] < OPS["resume"]["rows"], summary(results)


@pytest.mark.parametrize("scope", ["inside", "swap", "entries", "locks"])
@pytest.mark.parametrize("op", ["images", "map", "memoize", "resume"])
def test_symlinks_planted_under_the_root_are_never_followed(shared_root, op, scope):
    """Links to the victim's files and folders under every name cachekit uses (scope
    "inside": files in build directories and entries, the random .tmp names included;
    "swap": the build directory itself and a published entry; "entries": entries/KEY
    while it is being built; "locks": KEY.lock, KEY.lock.soft, KEY.failed.json), planted
    continually while the victim builds, hits, and resumes a build it was killed in: the
    victim's files are unchanged, and every call succeeds with correct data or fails with
    a CachekitError."""
    happened = attack(shared_root, op, scope)
    assert not verdict(happened), verdict(happened)


@pytest.mark.parametrize("scope", ["inside", "locks"])
@pytest.mark.parametrize("op", ["map", "memoize"])
def test_fifos_planted_under_the_root_never_block_the_victim(shared_root, op, scope):
    """FIFOs instead of links: the victim finishes (or fails with a CachekitError) within
    seconds; nothing opens a FIFO and waits for a writer."""
    happened = attack(shared_root, op, scope, kind="fifo", lock_timeout=10)
    slow = [r for r in happened["results"] if r["seconds"] > 30]
    assert not verdict(happened) and not slow, (
        f"{len(slow)} call(s) took over 30 s\n" if slow else "") + verdict(happened)


# --- the root's own folders as symlinks --------------------------------------------------


def run_cli(shared: users.SharedRoot, *args: object) -> Finished:
    return finish(shared.victim.cli(shared.root, *args, env=VICTIM_ENV), TIMEOUT)


def victim_report(shared: users.SharedRoot, config: dict[str, Any], name: str,
                  env: Optional[dict[str, str]] = None, user: Optional[users.User] = None
                  ) -> dict[str, Any]:
    """Run :data:`VICTIM` (as the victim unless ``user``) with ``config``; its report."""
    path = shared.write_json(name, config)
    runner = user or shared.victim
    return finish(runner.python(shared.script(VICTIM), shared.root, path,
                                env={**VICTIM_ENV, **(env or {})}), TIMEOUT).report()


def victim_calls(shared: users.SharedRoot, config: dict[str, Any], name: str,
                 env: Optional[dict[str, str]] = None, user: Optional[users.User] = None
                 ) -> list[dict[str, Any]]:
    """:func:`victim_report`'s calls."""
    return victim_report(shared, config, name, env, user)["results"]


def as_attacker(shared: users.SharedRoot, source: str, target: Path, how: str = "write") -> None:
    finish(shared.attacker.python(shared.script(WRITE), source, target, how), TIMEOUT).report()


@pytest.mark.parametrize("which", ["entries", "tmp", "locks"])
def test_a_symlinked_entries_tmp_or_locks_folder_leads_nowhere(shared_root, which):
    """The attacker replaces ROOT/entries, ROOT/tmp or ROOT/locks with a symlink to the
    victim's MLflow-like folder (32-hex run directories, like keys). ``cachekit ls``,
    ``verify``, ``clear KEY``, ``prune --max-size 0 --yes`` and ``clear --all --yes``, then
    a build, all as the victim, leave that folder untouched and print no traceback."""
    shared = shared_root
    targets = make_victim_files(shared.victim)
    folder = Path(targets["dir_targets"][0])
    # Something for each command to act on: an entry, a failure record, a dead build.
    built = victim_calls(shared, victim_config(shared, "map", variants=[0], calls=["build"]),
                         "published.json")
    assert built[0]["outcome"] == "ok", summary(built)
    images = victim_config(shared, "images", variants=[0], calls=["build"])
    images["images"] = images["images"][:3] + [str(shared.base / "missing.png")]
    failed = victim_calls(shared, images, "failing.json")
    assert failed[0]["type"] == "ImageDecodeError", summary(failed)
    assert list((shared.root / "locks").glob("*.failed.json"))
    script = shared.script(VICTIM)
    interrupt_a_build(shared, script, shared.write_json(
        "dead.json", victim_config(shared, "resume")))
    as_attacker(shared, str(folder), shared.root / which, "symlink")
    assert users.kind(shared.root / which) == "symlink"

    before = snapshot(shared.victim.home)
    steps: list[tuple[str, str, list[str]]] = []
    for args in (["ls"], ["verify"], ["clear", built[0]["key"], "--yes"],
                 ["prune", "--max-size", "0", "--yes"], ["clear", "--all", "--yes"]):
        done = run_cli(shared, *args)
        output = done.stdout + done.stderr
        steps.append((f"cachekit {' '.join(args)} (exit {done.returncode})",
                      "Traceback" in output, changes(before, snapshot(shared.victim.home))))
    results = victim_calls(shared, victim_config(shared, "map", variants=[1], calls=["build"]),
                           "after.json")
    steps.append((f"a map build: {results[0]['outcome']} {results[0].get('type', '')}",
                  bool(bad_outcomes(results)), changes(before, snapshot(shared.victim.home))))
    report = "\n".join(f"  {what}: {'TRACEBACK/BAD OUTCOME ' if broke else ''}"
                       f"{len(changed)} changed {changed[:4]}" for what, broke, changed in steps)
    first = next((what for what, broke, changed in steps if broke or changed), None)
    assert first is None, f"{which} as a symlink: first harm by {first}\n{report}"


# --- failure records ---------------------------------------------------------------------


def test_a_failure_record_dated_in_the_future_neither_stops_a_build_nor_outlives_clear(
        shared_root):
    """locks/KEY.failed.json planted with time = now + 3600: the victim's build still runs
    and succeeds, and ``cachekit clear KEY`` removes such a record, with the entry and
    also when it is all that is left of the key."""
    shared = shared_root
    config = victim_config(shared, "images", variants=[0], calls=["build"])
    keys = learn_keys(shared, shared.script(VICTIM), shared.write_json("keys.json", config))
    record = shared.root / "locks" / f"{keys[0]}.failed.json"

    def plant() -> None:
        future = {"time": time.time() + 3600, "host": "elsewhere", "pid": 1,
                  "failures": [[0, config["images"][0], "planted: says the attacker"]]}
        as_attacker(shared, str(shared.write_json("record.json", future)), record)
        assert record.exists()

    plant()
    results = victim_calls(shared, config, "victim.json")
    assert [(r["outcome"], r.get("correct"), r.get("hit")) for r in results] == [
        ("ok", True, False)], summary(results)
    plant()  # the victim's successful build removed the first one
    done = run_cli(shared, "clear", keys[0], "--yes")
    assert done.ok and not record.exists(), (
        f"clear KEY with an entry left the failure record: exit {done.returncode}, "
        f"record {'still there' if record.exists() else 'gone'}\n{done.stdout}{done.stderr}")
    plant()
    done = run_cli(shared, "clear", keys[0], "--yes")
    assert done.ok and not record.exists(), (
        f"clear KEY of a key with only a failure record: exit {done.returncode}, record "
        f"{'still there' if record.exists() else 'gone'}\n{done.stdout}{done.stderr}")


def test_a_listing_memo_planted_for_the_victim_is_refused(shared_root):
    """The attacker writes the victim's listing memo (locks/listing.UID.json, by rename),
    naming the victim's entry by its manifest file's very identity, with other rows: the
    victim's ``ls`` refuses the memo (not the victim's file), reads the manifest and shows
    its rows."""
    from cachekit.admin import listing_memo

    shared = shared_root
    built = victim_calls(shared, victim_config(shared, "map", variants=[0], calls=["build"],
                                               delay=0), "build.json")
    key = built[0]["key"]
    listed = {e["key"]: e for e in json.loads(run_cli(shared, "ls", "--json").stdout)}
    fields = {name: listed[key][name] for name in listing_memo.FIELDS}
    manifest = shared.root / "entries" / key / "manifest.json"
    memo = {"key": "ls", "made": listing_memo._MADE, "entries": {
        key: [listing_memo.identity(manifest.stat()), {**fields, "rows": fields["rows"] + 1000}]}}
    target = shared.root / "locks" / f"listing.{users.VICTIM_UID}.json"
    as_attacker(shared, str(shared.write_json("memo.json", memo)), target)
    assert target.stat().st_uid == users.ATTACKER_UID
    again = {e["key"]: e for e in json.loads(run_cli(shared, "ls", "--json").stdout)}
    assert again[key]["rows"] == fields["rows"] and again[key]["problem"] is None


# --- tampered manifests ------------------------------------------------------------------


def tamper_manifest(shared: users.SharedRoot, key: str, change) -> dict[str, Any]:
    """The attacker rewrites entries/KEY/manifest.json as ``change(manifest)`` (a dict,
    edited in place), by rename, as any member of the group can."""
    path = shared.root / "entries" / key / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    as_attacker(shared, str(shared.write_json("tampered.json", manifest)), path)
    return manifest


@pytest.mark.parametrize("rows", [10**9, 10**12])
@pytest.mark.parametrize("op", ["map", "memoize"])
def test_an_oversized_manifest_is_corrupt_before_anything_is_allocated(shared_root, op, rows):
    """rows, shape[0] and files[0].shape[0] raised to ``rows`` (and files[0].bytes to
    match, so the manifest is consistent in itself): a map call knows its rows, so it
    removes the entry and builds it again; a memoize call, which does not, raises
    CacheCorruptError. Either at once, with a small peak RSS; ``ls`` and ``verify``
    report what is left without a traceback."""
    shared = shared_root
    config = victim_config(shared, op, variants=[0], calls=["build"], delay=0)
    built = victim_calls(shared, config, "build.json")
    assert built[0]["outcome"] == "ok", summary(built)
    key = built[0]["key"]

    def oversize(manifest: dict[str, Any]) -> None:
        first = manifest["files"][0]  # its bytes: the .npy header, then rows x per_row
        per_row = np.dtype(first["dtype"]).itemsize * int(np.prod(first["shape"][1:]))
        header = first["bytes"] - first["shape"][0] * per_row
        first["shape"][0] = manifest["shape"][0] = manifest["rows"] = rows
        first["bytes"] = header + rows * per_row

    tamper_manifest(shared, key, oversize)
    got = victim_report(shared, {**config, "calls": ["hit"]}, "hit.json")
    hit, rss = got["results"], got["maxrss_kb"]
    report = summary(hit)
    if op == "map":
        assert hit[0]["outcome"] == "ok" and hit[0]["correct"] and not hit[0]["hit"], report
    else:
        assert hit[0].get("type") == "CacheCorruptError", report
    assert hit[0]["seconds"] < 10, report
    assert rss < 500 * 1024, f"peak RSS {rss / 1024:.0f} MB on a corrupt hit\n{report}"
    verified = 0 if op == "map" else 1  # the rebuilt entry is sound
    for args, status in ((["ls"], 0), (["verify"], verified), (["info", key], 0)):
        done = run_cli(shared, *args)
        assert done.returncode == status and "Traceback" not in done.stderr, done.failure()


def test_absurd_times_and_escape_sequences_in_manifests_print_clean(shared_root):
    """created = 1e300 and terminal escape sequences in every free-text field of a manifest
    (and in a planted build directory's journal): ``ls`` and ``info`` exit 0 and print no
    raw control character."""
    shared = shared_root
    built = victim_calls(shared, victim_config(shared, "map", variants=[0], calls=["build"],
                                               delay=0), "build.json")
    key = built[0]["key"]
    evil = "\x1b[31mred\x1b[0m\x1b]0;pwned\x07\x9b2J\r"

    def poison(manifest: dict[str, Any]) -> None:
        manifest.update(created=1e300, column=evil, cachekit_version=evil,
                        builder={"host": evil, "pid": evil},
                        failed_rows=[[0, evil, evil]])
        manifest["params"][evil] = evil

    tamper_manifest(shared, key, poison)
    journal = {"key": key, "format": 2, "cachekit_version": evil, "host": evil, "pid": 1,
               "started": 1e300, "done": 1, "total": 64}
    build_dir = shared.root / "tmp" / f"{key}.{evil.replace('/', '')}.1.0123456789ab"
    as_attacker(shared, str(shared.write_json("state.json", journal)),
                build_dir / "state.json")
    as_attacker(shared, str(shared.write_json("heartbeat", {})), build_dir / "heartbeat")
    for args in (["ls"], ["ls", "--sort", "created"], ["info", key], ["info", key[:8]]):
        done = run_cli(shared, *args)
        raw = sorted({hex(ord(c)) for c in CONTROL.findall(done.stdout + done.stderr)})
        assert done.ok and not raw, f"raw {raw}\n{done.failure()}"


# --- locks -------------------------------------------------------------------------------


@pytest.mark.parametrize("lock", ["os", "soft"])
def test_a_directory_where_the_lock_file_goes(shared_root, lock):
    """locks/KEY.lock and locks/KEY.lock.soft are directories (with a file in them): the
    victim's build succeeds or fails with a CachekitError, within seconds, never hangs."""
    shared = shared_root
    config = victim_config(shared, "map", variants=[0], locks=[lock], lock_timeout=10)
    keys = learn_keys(shared, shared.script(VICTIM), shared.write_json("keys.json", config))
    for suffix in (".lock", ".lock.soft"):
        as_attacker(shared, "mkdir", shared.root / "locks" / f"{keys[0]}{suffix}", "mkdir")
    started = time.monotonic()
    results = victim_calls(shared, config, "victim.json", env={"CACHEKIT_LOCK_LEASE": "1"})
    assert not bad_outcomes(results) and time.monotonic() - started < 60, summary(results)


# --- signatures --------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["map", "memoize"])
def test_a_signing_victim_refuses_an_entry_planted_without_its_key(shared_root, op):
    """The attacker, without $CACHEKIT_SIGNING_KEY, builds the victim's very call (same
    script, same key) with wrong rows under the same root. The victim, with the key,
    refuses that entry, builds its own and gets correct data (and a hit on it next)."""
    shared = shared_root
    config = victim_config(shared, op, variants=[0], calls=["build"], delay=0)
    planted = victim_calls(shared, config, "attacker-build.json", env={"VICTIM_POISON": "666"},
                           user=shared.attacker)
    assert planted[0]["outcome"] == "ok", summary(planted)
    assert (shared.root / "entries" / planted[0]["key"] / "manifest.json").exists()
    signed = {"CACHEKIT_SIGNING_KEY": "the victim's own secret, 32 bytes"}
    results = victim_calls(shared, {**config, "calls": ["build", "hit"]}, "victim.json",
                           env=signed)
    assert results[0].get("key") in (None, planted[0]["key"]), "the keys differ"
    assert not bad_outcomes(results) and results[0]["outcome"] == "ok", (
        "the victim did not get its own correct data\n" + summary(results))
    assert results[0]["hit"] is False, "the victim took the attacker's entry\n" + summary(results)
