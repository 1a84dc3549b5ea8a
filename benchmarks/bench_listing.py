"""How long ``cachekit ls`` takes as a root fills with entries, in fresh interpreters.

    python benchmarks/bench_listing.py                      # 10, 100, 1,000 and 2,000 entries
    python benchmarks/bench_listing.py --entries 100,2000 --runs 9
    python benchmarks/bench_listing.py --quick              # 10 and 30 entries: checks it

The design asks that ``ls`` answer in well under half a second. Storing a row once makes an
entry cheap (a fold of a cached column is a manifest and a row map), so a root of a sweep
may hold hundreds of them, and ``ls`` reads and checks every manifest.

One root, filled in steps: a full entry of ``--covers`` generated covers (8x8), then
derived entries of random subsets of them (each a call that decodes nothing) until the
root holds each count of ``--entries``. At each count, ``--runs`` rounds of fresh
interpreters take turns: ``python -m cachekit --root ROOT ls`` with this user's listing
memo (what the last ``ls`` read of each manifest, so it reads only the manifests that
changed), the same without it (the memo removed first: every manifest read, as the first
``ls`` of a root does), and ``python -m cachekit --version``, which starts the interpreter
and imports what ``ls`` imports and lists nothing. Bytecode is cached, as users have it
(one untimed run of each first, which also writes the memo), and the entries are at least
2 s old (a manifest changed more recently is read every time). A figure is the median of
the runs; their range is shown. ``ls`` less ``--version`` over the entries is the cost of
one entry.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # this checkout's cachekit, whatever else is installed

LIMIT_S = 0.5
"""The design's bound: ``ls`` answers in well under half a second."""
SETTLED_S = 2.5
"""How old the newest manifest is when the runs start: the memo keeps manifests that last
changed 2 s or more before it is written."""


def say(text: str) -> None:
    print(f"[bench_listing] {text}", file=sys.stderr, flush=True)


def command_seconds(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one fresh ``python -m cachekit ARGV``, which must succeed."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cachekit", *argv], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def fill(cache: Any, paths: list[str], have: int, want: int, rng: random.Random) -> int:
    """Add derived entries (random subsets of ``paths``) until the root holds ``want``."""
    import pandas as pd

    while have < want:
        entry = cache.images(pd.Series(rng.sample(paths, rng.randint(2, len(paths) - 1))), 8)
        have += entry.source == "built"  # (a repeated subset is a hit)
    return have


def measure(root: Path, entries: int, runs: int, env: dict[str, str]) -> dict[str, Any]:
    """``runs`` rounds of the three commands on ``root`` of ``entries`` entries, each round
    starting with another of them (see the module docstring): every run and the medians."""
    memo = root / "locks" / f"listing.{os.geteuid()}.json"
    commands = [("ls", ["--root", str(root), "ls"]), ("start", ["--version"]),
                ("ls, no memo", ["--root", str(root), "ls"])]
    times: dict[str, list[float]] = {name: [] for name, _ in commands}
    time.sleep(max(0.0, SETTLED_S - (time.time() - newest_manifest(root))))
    for name, argv in commands:
        command_seconds(argv, env)
    for run in range(runs):
        for name, argv in commands[run % 3:] + commands[:run % 3]:
            if name == "ls, no memo":
                memo.unlink(missing_ok=True)
            times[name].append(command_seconds(argv, env))  # (which writes the memo anew)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"entries": entries, "runs": times, **{f"{n} s": m for n, m in medians.items()},
            "per entry ms": (medians["ls"] - medians["start"]) / entries * 1e3,
            "per entry, no memo ms": (medians["ls, no memo"] - medians["start"]) / entries * 1e3}


def newest_manifest(root: Path) -> float:
    """When the newest manifest of ``root`` last changed (its ctime)."""
    return max(p.stat().st_ctime for p in (root / "entries").glob("*/manifest.json"))


def table(results: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], name: str) -> str:
        runs = r["runs"][name]
        return f"{r[name + ' s']:.3f} s ({min(runs):.3f}-{max(runs):.3f})"

    lines = ["| entries | `cachekit ls` | without the memo | start-up and imports "
             "(`--version`) | per entry, per entry without the memo | "
             f"under {LIMIT_S} s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| {r['entries']:,} | {cell(r, 'ls')} | {cell(r, 'ls, no memo')} | "
            f"{cell(r, 'start')} | {r['per entry ms']:.3f} ms, "
            f"{r['per entry, no memo ms']:.3f} ms | "
            f"{'yes' if r['ls s'] < LIMIT_S else 'NO'}, "
            f"{'yes' if r['ls, no memo s'] < LIMIT_S else 'NO'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="10,100,1000,2000",
                        help="comma-separated entry counts to time ls at (ascending)")
    parser.add_argument("--runs", type=int, default=7, help="rounds of runs at each count")
    parser.add_argument("--covers", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="10 and 30 entries, 3 runs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    counts = [10, 30] if args.quick else sorted(int(n) for n in args.entries.split(","))
    runs = 3 if args.quick else args.runs
    if counts[0] < 2 or runs < 1:
        parser.error("at least 2 entries and 1 run")

    import pandas as pd

    import cachekit
    from cachekit.samples import write_sample_images

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    results = []
    with tempfile.TemporaryDirectory(prefix="cachekit-bench-listing-") as work:
        paths = write_sample_images(Path(work) / "covers", args.covers, seed=3)
        root = Path(work) / "cache"
        cache = cachekit.Cache(root, progress=False)
        cache.images(pd.Series(paths), 8)
        have, rng = 1, random.Random(5)
        for count in counts:
            started = time.perf_counter()
            have = fill(cache, paths, have, count, rng)
            say(f"{count} entries ({time.perf_counter() - started:.1f} s to add them); "
                f"timing {runs} rounds of runs")
            results.append(measure(root, count, runs, env))
    text = table(results)
    print(f"`cachekit ls` in fresh interpreters, bytecode cached (median of {runs} runs, "
          "their range in brackets)\n\n" + text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return {"results": results, "table": text}


if __name__ == "__main__":
    main()
