"""A soak: processes racing on one cache for minutes, killed at random, every read checked.

    python benchmarks/soak.py                           # 4 workers on one root, 300 s
    python benchmarks/soak.py --remote --seconds 600    # two hosts' roots, one bucket
    python benchmarks/soak.py --quick                   # 30 s: checks the script
    python benchmarks/soak.py --team                    # two plain uids share the root (root)
    python benchmarks/soak.py --hosts                   # two hosts share the root (root)

The race tests in ``tests/`` aim at one race each; a soak runs them all at once, at length.
Each worker loops over random calls on the cache, under a budget (``--budget``) so that
evictions never stop: ``map`` over a column of 3,000 int rows of 1 KB (a subset, a fold, a
shuffle, the whole: derived entries share rows; now and then with some values on several
rows, each computed once), every row checked against its value; a
``clear`` of a random entry, a ``prune``, a ``verify``. Each worker holds its last three
entries and reads a row of each again after every call; now and then a child that
``forkserver`` starts reads them whole, through the files the entries keep open (as a
DataLoader worker does; other workers clear and prune meanwhile). A supervisor SIGKILLs a random
worker every 5-20 s and starts it again. With ``--remote`` (a loopback SeaweedFS, the tests'
``weed``), half the workers use a second root (another host), and a prober runs ``cachekit
clear --remote --all``, ``verify --remote`` and ``ls --remote`` over and over; at the end
``verify --remote`` must find no problem. With ``--team`` (as root), the workers take turns
between two plain uids of one group on a shared root (setgid, ``umask 002``), as a team
shares one (the tests' :mod:`users`): each evicts, clears and prunes the other's entries.
With ``--hosts`` (as root), they take turns between two simulated machines that share the
root, each with a lock folder of its own (the tests' :mod:`hosts`: a network filesystem
whose locks work within one machine, as ``localflock`` mounts; set ``CACHEKIT_LOCK=soft``
for the lock made for them): a build lock, a hold and a heartbeat of one are unseen by the
other's flock, and only their records tell.

It prints what each worker did and every failure: a call that raised, a wrong byte, a
problem ``verify`` found, a probe that failed; it exits 1 when there was any. A background
upload that failed is counted, not a failure: each says so, and the local entry is good.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's cachekit, whatever else is installed
sys.path.insert(0, str(HERE.parent / "tests"))  # s3.py: the server the tests use

ROWS = 3000


def row(value: int):
    import numpy as np

    return np.full(256, value, dtype=np.int32)


def columns() -> list[list[int]]:
    """The columns the workers draw from, the same in every worker: ranges, the 5 folds of
    the whole, and the whole."""
    rng = random.Random(7)
    out = []
    for _ in range(24):
        start = rng.randrange(0, ROWS - 1000)
        out.append(list(range(start, start + rng.randrange(50, 1000))))
    return out + [list(range(k, ROWS, 5)) for k in range(5)] + [list(range(ROWS))]


def worker(root: str, seconds: float, log: Path, budget: str) -> None:
    """One worker's loop (a child process); its counts go to ``log`` after every call."""
    import warnings

    import numpy as np

    import cachekit

    warnings.simplefilter("ignore")  # a failed background upload warns; it is counted apart
    rng = random.Random(os.getpid())
    cache = cachekit.Cache(root, max_size=budget, workers=1, progress=False)
    pool, held = columns(), []
    counts = {"uid": os.getuid(), "host": socket.gethostname()}  # (--team, --hosts)
    end = time.time() + seconds

    def count(what: str, failure: str = "") -> None:
        counts[what] = counts.get(what, 0) + 1
        if failure:
            counts.setdefault("failures", []).append(failure[:500])
        log.with_suffix(".new").write_text(json.dumps(counts))
        os.replace(log.with_suffix(".new"), log)  # whole, however the worker is killed

    while time.time() < end:
        pick = rng.random()
        try:
            if pick < 0.85:
                column = list(pool[rng.randrange(len(pool))])
                if rng.random() < 0.3:
                    rng.shuffle(column)
                if rng.random() < 0.15:  # values on several rows: each computed once
                    column += rng.choices(column, k=rng.randrange(1, 100))
                entry = cache.map(row, column, version="1")
                if not (np.asarray(entry.array) == np.asarray(column)[:, None]).all():
                    count("wrong", f"wrong bytes in {entry.key[:12]} ({entry.outcome})")
                held = (held + [(entry, column)])[-3:]
                for other, values in held:
                    i = rng.randrange(len(values))
                    if not (np.asarray(other.array[i]) == values[i]).all():
                        count("wrong", f"wrong bytes in held entry {other.key[:12]}")
                count(entry.outcome)
            elif pick < 0.87:
                if held:
                    count("read in a child", read_in_child(held))
            elif pick < 0.95:
                keys = [e.key for e in cache.entries()]
                if keys:
                    try:
                        cache.clear([rng.choice(keys)])
                    except cachekit.EntryNotFoundError:
                        pass  # another worker removed it first
                count("clear")
            elif pick < 0.97:
                cache.prune(rng.choice(["1M", "3M", "6M"]))
                count("prune")
            else:
                problems = cache.verify()
                count("verify", "; ".join(f"{p.key[:12]}: {p.problem}" for p in problems))
        except Exception as e:  # every other exception is a failure: counted and shown
            count("raised", f"{type(e).__name__}: {e}")


def read_in_child(held: list) -> str:
    """Have a child that ``forkserver`` starts read the ``held`` (entry, values) pairs
    whole, as a DataLoader worker would: what went wrong, or ""."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    answer, reply = context.Pipe(duplex=False)
    child = context.Process(target=_check_held, args=(held, reply))
    child.start()
    reply.close()
    try:
        found = answer.recv() if answer.poll(120) else "a child said nothing in 120 s"
    except EOFError:
        found = "a child ended without an answer"
    child.join(10)
    return found


def _check_held(held: list, reply) -> None:
    import numpy as np

    try:
        wrong = [entry.key[:12] for entry, values in held
                 if not (np.asarray(entry.array) == np.asarray(values)[:, None]).all()]
        reply.send(f"wrong bytes in a child's copy of {', '.join(wrong)}" if wrong else "")
    except Exception as e:
        reply.send(f"a child raised {type(e).__name__}: {e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--budget", default="6M", help="each worker's cache budget")
    parser.add_argument("--remote", action="store_true", help="two roots and a bucket")
    parser.add_argument("--quick", action="store_true", help="30 s")
    parser.add_argument("--team", action="store_true",
                        help="two plain uids share one root (needs root)")
    parser.add_argument("--hosts", action="store_true",
                        help="two simulated hosts share one root (needs root)")
    parser.add_argument("--worker", nargs=3, metavar=("ROOT", "SECONDS", "LOG"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if sum((args.team, args.remote, args.hosts)) > 1:
        parser.error("choose one of --team, --remote and --hosts")
    if args.worker:
        root, seconds, log = args.worker
        return worker(root, float(seconds), Path(log), args.budget)
    seconds = 30.0 if args.quick else args.seconds
    with tempfile.TemporaryDirectory(prefix="cachekit-soak-") as scratch:
        sys.exit(run(Path(scratch), seconds, args))


def run(base: Path, seconds: float, args: argparse.Namespace) -> int:
    server = None
    if args.remote:
        import s3

        server = s3.Seaweed(base / "seaweed").start()
        os.environ.update(server.env("soak"))
    try:
        return supervise(base, seconds, args)
    finally:
        if server is not None:
            server.stop()


def supervise(base: Path, seconds: float, args: argparse.Namespace) -> int:
    end = time.time() + seconds
    logs: list[Path] = []
    procs: dict[int, subprocess.Popen] = {}
    launch, shared_root, logs_in = team(base) if args.team else \
        machines(base) if args.hosts else (_as_is, None, base)

    def start(i: int) -> None:
        root = shared_root or base / ("b" if args.remote and i % 2 else "a")
        logs.append(logs_in / f"w{i}-{len(logs)}.json")
        argv, env = launch(i, [sys.executable, __file__, "--budget", args.budget, "--worker",
                               str(root), str(max(5.0, end - time.time())), str(logs[-1])])
        with open(logs[-1].with_suffix(".err"), "w") as err:
            procs[i] = subprocess.Popen(argv, env=env, stderr=err)

    probes = Probes()
    prober = threading.Thread(target=probes.run, args=(base / "p", end))
    for i in range(args.workers):
        start(i)
    if args.remote:
        prober.start()
    kills = 0
    while True:
        pause = random.uniform(5, 20)
        if time.time() + pause > end - 5:
            break
        time.sleep(pause)
        victim = random.randrange(args.workers)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        kills += 1
        start(victim)
    for proc in procs.values():
        proc.wait()
    if args.remote:
        prober.join()
        final = cachekit_cli(base / "p", "verify", "--remote")
        if final.returncode != 0:
            probes.failures.append(f"the last verify --remote: {final.stdout[-2000:]}")
    return report(logs, probes, kills, seconds)


Launch = Callable[[int, list[str]], tuple[list[str], Optional[dict[str, str]]]]
"""How worker ``i``'s command runs: the argv and environment that wrap it."""


def _as_is(i: int, command: list[str]) -> tuple[list[str], Optional[dict[str, str]]]:
    return command, None


def team(base: Path) -> tuple[Launch, Path, Path]:
    """Lay out a team's shared root under ``base``; return how a worker runs as one of its
    two members (by turns), the root, and the folder both may write their logs into."""
    import users

    why_not = users.why_no_two_uids()
    if why_not is not None:
        raise SystemExit(f"soak: --team: {why_not}")
    shared = users.make_shared_root(base)
    members = (shared.victim, shared.attacker)

    def launch(i: int, command: list[str]) -> tuple[list[str], Optional[dict[str, str]]]:
        member = members[i % 2]
        return (users.launch_argv(member.uid, member.gid, member.home, command,
                                  [shared.base]),
                users.child_env({"HOME": str(member.home), "USER": member.name}))

    return launch, shared.root, shared.work


def machines(base: Path) -> tuple[Launch, Path, Path]:
    """Lay out two simulated hosts sharing a root under ``base``; return how a worker runs
    on one of them (by turns), the root, and the folder both may write their logs into."""
    import hosts

    why_not = hosts.why_no_hosts()
    if why_not is not None:
        raise SystemExit(f"soak: --hosts: {why_not}")
    pair = hosts.make_hosts(base, ("host-a", "host-b"))
    settings = {k: v for k, v in os.environ.items() if k.startswith("CACHEKIT_")}

    def launch(i: int, command: list[str]) -> tuple[list[str], Optional[dict[str, str]]]:
        host = pair[i % 2]
        return (hosts.namespace_argv(host.name, host.private_locks, host.root / "locks",
                                     command), hosts.child_env(settings))

    return launch, pair[0].root, pair[0].work


def cachekit_cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachekit", "--root", str(root), *args],
                          capture_output=True, text=True)


class Probes:
    """The prober of a remote soak: what it ran, and what failed."""

    def __init__(self) -> None:
        self.runs = 0
        self.failures: list[str] = []

    def run(self, root: Path, end: float) -> None:
        """Clear the whole remote, verify it and list it, over and over, until ``end``."""
        while time.time() < end - 5:
            for command in (["clear", "--remote", "--all", "--yes"], ["verify", "--remote"],
                            ["ls", "--remote"]):
                done = cachekit_cli(root, *command)
                self.runs += 1
                if done.returncode != 0:
                    said = (done.stdout + done.stderr)[-1000:]
                    self.failures.append(f"`cachekit {' '.join(command)}` exited "
                                         f"{done.returncode}: {said}")


def report(logs: list[Path], probes: Probes, kills: int, seconds: float) -> int:
    totals: dict[str, int] = {}
    failures = list(probes.failures)
    uids: set[int] = set()
    names: set[str] = set()
    for log in logs:
        if log.exists():
            counts = json.loads(log.read_text())
            failures += counts.pop("failures", [])
            uids.add(counts.pop("uid"))
            names.add(counts.pop("host"))
            for what, n in counts.items():
                totals[what] = totals.get(what, 0) + n
        said = log.with_suffix(".err").read_text(errors="replace")
        uploads = said.count("ERROR: the background upload of")
        if uploads:
            totals["failed background upload"] = totals.get("failed background upload", 0) + uploads
    print(f"soak: {seconds:.0f} s, {len(logs)} worker processes, {kills} SIGKILLed"
          + (f", {probes.runs} runs of the remote prober" if probes.runs else ""))
    print(f"worker uids: {', '.join(map(str, sorted(uids)))}; hosts: {', '.join(sorted(names))}")
    print("| what | count |\n|---|---:|")
    for what, n in sorted(totals.items()):
        print(f"| {what} | {n} |")
    for failure in failures:
        print(f"FAILURE: {failure}")
    print("no failures" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    main()
