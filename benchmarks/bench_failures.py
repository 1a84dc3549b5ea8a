"""Many failed rows: what they cost to store and to plan a retry around.

    python benchmarks/bench_failures.py                  # 50,000 failed rows, 3 rounds
    python benchmarks/bench_failures.py --failed 20000
    python benchmarks/bench_failures.py --quick          # 2,000 failed rows: checks the script

A column of ``--good`` small PNGs followed by ``--failed`` missing files at long paths
(two 240-character folders: long values are what made manifests large). In a fresh root:

- the first build (``on_error="raise"``): it fails, keeps the good rows; its time;
- the sizes of the kept rows' manifest and the failure record (``locks/KEY.failed.json``);
- the retry of the same column: its time, and of it the planning (``donors.find``: which
  rows are held by committed entries, which failed before);
- the ``on_error="zero"`` build and its manifest, and the next call (a hit) in a fresh
  interpreter: that a reader accepts what the writer wrote.

Every round builds in a root of its own; figures are medians over the rounds, with every
round's value shown. Nothing here asserts a time: the suite's tests assert the behaviour.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's cachekit, whatever else is installed
sys.path.insert(0, str(HERE))  # bench_report, next to this file
from bench_report import median_table  # noqa: E402

LONG = "d" * 240
HIT = """
import sys, time
started = time.perf_counter()
import cachekit
entry = cachekit.Cache(sys.argv[1], progress=False).images(
    [line.rstrip("\\n") for line in open(sys.argv[2])], 4, backend="pil", on_error="zero")
assert entry.hit, entry.source
print(time.perf_counter() - started)
"""


def column(folder: Path, good: int, failed: int) -> list[str]:
    import numpy as np
    from PIL import Image

    paths = []
    for i in range(good):
        path = folder / f"{i}.png"
        Image.fromarray(np.full((6, 5, 3), i % 255, np.uint8)).save(path)
        paths.append(str(path))
    return paths + [f"{folder}/gone/{LONG}/{LONG}/{i}.png" for i in range(failed)]


def one_round(work: Path, paths: list[str]) -> dict[str, float]:
    import cachekit
    from cachekit.obtain import donors

    root = work / "cache"
    cache = cachekit.Cache(root, workers=2, progress=False)
    started = time.perf_counter()
    try:
        cache.images(paths, 4, backend="pil")
    except cachekit.ImageDecodeError:
        pass
    first = time.perf_counter() - started
    sizes = {p.parent.name if p.name == "manifest.json" else "record": p.stat().st_size
             for p in root.rglob("*.json")}
    planning: list[float] = []
    real_find = donors.find

    def timed(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return real_find(*args, **kwargs)
        finally:
            planning.append(time.perf_counter() - begun)

    donors.find = timed
    started = time.perf_counter()
    try:
        cache.images(paths, 4, backend="pil")
    except cachekit.ImageDecodeError:
        pass
    finally:
        donors.find = real_find
    retry = time.perf_counter() - started
    entry = cache.images(paths, 4, backend="pil", on_error="zero")
    zero_manifest = (entry.path / "manifest.json").stat().st_size
    listing = work / "column.txt"
    listing.write_text("\n".join(paths) + "\n")
    hit = subprocess.run([sys.executable, "-c", HIT, str(root), str(listing)], check=True,
                         capture_output=True, text=True, cwd=str(HERE.parent))
    return {"first build s": first, "retry s": retry, "retry planning s": sum(planning),
            "kept rows' manifest KB": max(v for k, v in sizes.items() if k != "record") / 1e3,
            "failure record KB": sizes.get("record", 0) / 1e3,
            "on_error='zero' manifest KB": zero_manifest / 1e3,
            "next call (hit, fresh interpreter) s": float(hit.stdout.split()[-1])}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failed", type=int, help="default 50,000 (--quick: 2,000)")
    parser.add_argument("--good", type=int, help="default 200 (--quick: 20)")
    parser.add_argument("--rounds", type=int, help="default 3 (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.failed = args.failed or (2_000 if args.quick else 50_000)
    args.good = args.good or (20 if args.quick else 200)
    args.rounds = args.rounds or (1 if args.quick else 3)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="cachekit-bench-failures-") as scratch:
        images = Path(scratch) / "images"
        images.mkdir()
        paths = column(images, args.good, args.failed)
        for i in range(args.rounds):
            work = Path(scratch) / f"round-{i}"
            work.mkdir()
            rounds.append(one_round(work, paths))
            shutil.rmtree(work)
    table = median_table(f"{args.failed:,} failed rows among {args.failed + args.good:,} "
                         f"({args.rounds} round{'s' if args.rounds > 1 else ''}; medians, "
                         "every round in brackets)", rounds)
    print(table)
    result = {"table": table, "rounds": rounds, "failed": args.failed, "good": args.good}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
