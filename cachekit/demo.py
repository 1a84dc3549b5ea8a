"""``cachekit demo``: sweep agents racing on one image column, end to end, in under a minute.

It generates cover-like sample JPEGs in a temporary folder, then starts fresh Python
processes that each call ``cache.images`` on the same column at the same moment, as W&B
sweep agents would: one builds; the others join its build where they bring cores it does
not use (each fills chunks nobody holds, and says so; the builder names them once it
commits), or else only wait, and say why, and then map its file. A second wave of agents
then starts on the warm cache and only hits. The race runs in a temporary cache, so that
every run of the demo shows it; the sample images and the temporary cache are removed
afterwards, and nothing is written under the user's cache root.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import _fs
from .samples import write_sample_images
from .store import default_root

SIZE = (32, 32)


def run(root: Optional[Path], *, images: int = 2000, agents: int = 4) -> int:
    """Run the demo; return the process exit code."""
    if images < 1 or agents < 1:
        print("cachekit demo: --images and --agents must be at least 1", file=sys.stderr)
        return 2
    root = Path(root) if root is not None else default_root()
    with tempfile.TemporaryDirectory(prefix="cachekit-demo-") as scratch:
        sample_dir = Path(scratch) / "images"
        print(f"cachekit demo: {images} cover-like JPEGs (200-500 x 300-700 px) in "
              f"{sample_dir}")
        started = time.perf_counter()
        paths = write_sample_images(sample_dir, images, seed=0)
        print(f"  ready in {time.perf_counter() - started:.1f} s\n")
        race_cache = cache_dir = Path(scratch) / "cache"
        paths_file = Path(scratch) / "paths.txt"
        paths_file.write_text("\n".join(paths), encoding="utf-8")
        print(f"{agents} sweep agents start at once on an empty cache "
              f"(cache.images(df['img_path'], size={SIZE})):")
        cold = _race(cache_dir, paths_file, agents)
        _print_wave(cold)
        print(f"\n{agents} more agents start on the warm cache:")
        warm = _race(cache_dir, paths_file, agents)
        _print_wave(warm)

    builders = [r for r in cold if r["source"] == "built"]
    if len(builders) != 1 or any(not r["hit"] for r in warm):
        print("\nunexpected: the cache did not build exactly once", file=sys.stderr)
        return 1
    build = builders[0]["seconds"]
    hit = statistics.median(r["seconds"] for r in warm)
    joiners = [r for r in cold if r["source"] == "joined"]
    joined_rows = sum(r["rows"] for r in joiners)
    print(f"\nbuilt once: {build:.2f} s for {images} images ({images / build:.0f} images/s); "
          f"a hit took {hit * 1000:.1f} ms (median), {build / hit:.0f}x faster than decoding.")
    if joiners:
        print(f"{len(joiners)} waiting agents joined the build and decoded {joined_rows} of the "
              f"{images} images; the builder decoded the other {images - joined_rows}.")
    reasons = {line.split(_NO_JOIN, 1)[1] for r in cold for line in r["said"] if _NO_JOIN in line}
    if reasons:
        waited = sum(any(_NO_JOIN in line for line in r["said"]) for r in cold)
        print(f"{waited} waiting agents did not join the build: {'; '.join(sorted(reasons))}.")
    print(f"{agents * 2 - 1 - len(joiners)} of {agents * 2} agents decoded nothing.")
    _print_next_steps(race_cache, root)
    return 0


RACE_IMAGES = 2000
"""Sample images of the demo's race."""
CSV_IMAGES = 24
"""Sample images ``--csv`` writes: the data of the README's examples."""


def write_csv(csv: Path, *, images: int = CSV_IMAGES) -> int:
    """``cachekit demo --csv PATH``: write the demo's sample images into ``covers/`` beside
    ``csv``, and ``csv`` with the columns ``img_path`` (absolute paths, so a training
    script finds them from any directory, as sweep agents started elsewhere must) and
    ``label`` (0, 1, 2 in turn); return the exit code. Image ``i`` is always the same
    picture, so the data is the same on every machine (the examples of the docs use 24)."""
    import csv as csv_module

    from .errors import UsageError

    if csv.exists():
        raise UsageError(f"{csv} exists already; remove it or name another file with --csv")
    started = time.perf_counter()
    paths = write_sample_images(csv.parent / "covers", images, seed=0)
    rows = [(os.path.abspath(path), index % 3) for index, path in enumerate(paths)]
    tmp = csv.with_name(f".{csv.name}.{_fs.unique_suffix()}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv_module.writer(f, lineterminator="\n")
        writer.writerow(["img_path", "label"])
        writer.writerows(rows)
    os.replace(tmp, csv)  # an interrupted run leaves no half-written CSV behind
    print(f"cachekit demo: wrote {images} cover-like JPEGs (200-500 x 300-700 px) into "
          f"{csv.parent / 'covers'} and {csv} (columns img_path, label) in "
          f"{time.perf_counter() - started:.1f} s. In a training script run from here:")
    print(f'  entry = cachekit.Cache().images(pd.read_csv("{csv}")["img_path"], size=224)')
    return 0


def _print_next_steps(race_cache: Path, root: Path) -> None:
    print(f"\nThe agents raced in a temporary cache, {race_cache}, now removed with the "
          f"sample images: nothing of your cache at {root} was made or touched. On your own "
          "data, with a CSV of image paths:")
    print("  cachekit build train.csv --column img_path --size 32x32")
    print('  entry = cachekit.Cache().images(pd.read_csv("train.csv")["img_path"], size=32)')


def _race(cache_dir: Path, paths_file: Path, agents: int) -> list[dict]:
    """Start ``agents`` fresh interpreters behind a start barrier; collect their reports."""
    start = cache_dir.parent / f"start-{_fs.unique_suffix()}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "cachekit.demo", str(cache_dir), str(paths_file),
                          str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(agents)
    ]
    ready = [cache_dir.parent / f"{start.name}.ready.{p.pid}" for p in procs]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    start.touch()
    reports = []
    for number, proc in enumerate(procs, 1):
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"demo agent {number} (pid {proc.pid}) failed:\n{err}")
        filled = [int(n) for n in _FILLED.findall(err)]  # what a joiner says it did
        reports.append({"agent": number, **json.loads(out), "rows": sum(filled),
                        "said": [line for line in err.splitlines()
                                 if _SAID.match(line) or _NO_JOIN in line]})
    return reports


_SAID = re.compile(r"cachekit\[[^]]*\]: (joined the build |built entry \w+ with \d+ joining)")
_NO_JOIN = " without joining it: "
"""What a waiting agent says when it does not join the build, before saying why."""
_FILLED = re.compile(r"^cachekit\[[^]]*\]: joined the build of entry .*\((\d+) rows\)$", re.M)


def _print_wave(reports: list[dict]) -> None:
    for r in reports:
        if r["source"] == "built":
            role = f"built the entry      {r['seconds']:7.2f} s"
        elif r["source"] == "joined":
            role = (f"joined the build     {r['seconds']:7.2f} s (decoded {r['rows']} images "
                    "of it, then mapped the entry)")
        elif r["waited"] > 0.05:
            role = f"waited, then mapped  {r['seconds']:7.2f} s (waited {r['waited']:.2f} s)"
        else:
            role = f"hit                  {r['seconds'] * 1000:7.1f} ms"
        print(f"  agent {r['agent']} (pid {r['pid']}): {role}")
        for line in r.get("said", []):
            print(f"      its stderr: {line}")


def _agent(cache_dir: str, paths_file: str, start: str) -> None:
    """One sweep agent: wait for the start barrier, then ask for the column's entry."""
    import pandas as pd

    import cachekit

    column = pd.Series(Path(paths_file).read_text(encoding="utf-8").splitlines(),
                       name="img_path")
    cache = cachekit.Cache(cache_dir, progress=None)  # no bars (stderr is a pipe), messages
    Path(f"{start}.ready.{os.getpid()}").touch()
    while not os.path.exists(start):
        time.sleep(0.002)
    began = time.perf_counter()
    entry = cache.images(column, SIZE)
    seconds = time.perf_counter() - began
    print(json.dumps({"pid": os.getpid(), "hit": entry.hit, "source": entry.source,
                      "seconds": seconds, "waited": entry.wait_seconds, "key": entry.key}))


if __name__ == "__main__":
    _agent(*sys.argv[1:4])
