"""The build engine's figures, side by side in one run: per-core speed, executors, the GIL.

    python benchmarks/bench_engine.py            # 2,000 covers, 5 rounds
    python benchmarks/bench_engine.py --quick    # 120 covers, 2 rounds: checks the script

What it measures (exact pixels are 3x32x32 RGB bilinear, the seed's target):

- per-phase profile of one image on cachekit's exact path (open, EXIF, decode, orientation,
  convert, resize, array, memmap write) and the build's own overhead (key, entry, fill),
  against the seed's loop (PIL open, torchvision Resize, ToTensor) and a bare Pillow loop;
- cold builds: cachekit 1 and 2 workers on threads and on processes, the default build,
  ``draft=True``; the seed's loop; the bare loop; ``datasets`` ``map`` with ``num_proc`` =
  cores; an OpenCV DCT-reduced decode in a pool of one process per core (draft's proxy);
  a Dask LocalCluster with 2 single-threaded workers against 1;
- CPU seconds per image of the default build against the bare loop;
- the GIL fraction of one image's work, and the thread scaling Amdahl's law gives for it.

GIL method (CPU time of the measuring thread, so that time lost to other processes on a
busy machine is not counted): the Pillow C calls that release the GIL (``ImagingDecoder.decode``,
``ImagingCore.resize``/``convert``/``transpose``: each wraps its work in
``ImagingSectionEnter``) are timed by a ``sys.setprofile`` hook on c_call/c_return events;
everything else an image costs (the JPEG header parsed in Python, file reads, numpy copies,
cachekit's own code) holds the GIL. The fraction is 1 - (time in those calls) / (time of the
same images unprofiled). The hook slows only the Python parts, which are not read from the
profiled run. Small reads and numpy copies are counted as holding the GIL even where they
release it, so the fraction errs high, never low.

Contestants take turns round by round, so load from elsewhere falls on all alike. A rate is the
median of the rounds; a ratio is the median of each round's own ratio (its two contestants ran
minutes apart at most, where the machine's speed drifts over a run; see docs/build-engine.md), with
every round's value shown beside it. Runs in one process (the processes executors, datasets, OpenCV
and Dask start their own workers, and their start-up is timed except OpenCV's pool, started once
before the rounds, and each Dask cluster, started afresh for each of its rounds and warmed with
cachekit's imports, as a long-lived cluster's workers would be).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

SIZE = (32, 32)
SMALL = (48, 64)  # (height, width) of the small-image set: per-image Python work dominates

RELEASING = {("ImagingDecoder", "decode"), ("ImagingCore", "resize"),
             ("ImagingCore", "convert"), ("ImagingCore", "transpose")}
"""Pillow C calls that release the GIL around their work (ImagingSectionEnter)."""
TORCH_RELEASING = {"decode_jpeg", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"}
"""torch ops of the tensor backend, by name (torchvision's JPEG decoder through torch.ops,
torch's uint8 antialiased resize): their Python bindings release the GIL while they run."""


def cpu_now() -> float:
    """CPU seconds of this process and of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def say(text: str) -> None:
    print(f"[bench_engine] {text}", file=sys.stderr, flush=True)


# --- the data ------------------------------------------------------------------------------

def make_covers(work: Path, count: int) -> list[str]:
    from cachekit.samples import write_sample_images

    paths = write_sample_images(work / "covers", count, seed=7)
    random.Random(7).shuffle(paths)  # a real train.csv is not sorted by file name
    return paths


def make_small(work: Path, count: int) -> list[str]:
    """64x48 JPEGs: the cover pictures shrunk, where per-image Python work dominates."""
    import numpy as np
    from PIL import Image

    from cachekit.samples import cover

    folder = work / "small"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"small_{i:06d}.jpg"
        picture = Image.fromarray(cover(np.random.default_rng([11, i])))
        picture.resize(SMALL[::-1], Image.Resampling.BILINEAR).save(path, quality=90)
        paths.append(str(path))
    return paths


# --- the loops a user would write ----------------------------------------------------------

def bare_loop(paths: list[str]) -> None:
    """Pillow open, decode, convert, resize, to an array: the per-core limit for exact pixels."""
    import numpy as np
    from PIL import Image

    for path in paths:
        with Image.open(path) as im:
            np.asarray(im.convert("RGB").resize(SIZE[::-1], Image.Resampling.BILINEAR))


def seed_loop(paths: list[str]) -> None:
    import bench_seeds

    bench_seeds.serial_loop(paths)


def opencv_row(path: str) -> Any:
    """The DCT-reduced decode proxy: the largest IMREAD_REDUCED_COLOR_s that still covers
    the target (size from the header), then INTER_AREA down to it."""
    import cv2
    from PIL import Image

    with Image.open(path) as im:  # header only, as cachekit's draft reads it
        width, height = im.size
    scale = max([s for s in (8, 4, 2) if width // s >= SIZE[1] and height // s >= SIZE[0]],
                default=1)
    flag = {8: cv2.IMREAD_REDUCED_COLOR_8, 4: cv2.IMREAD_REDUCED_COLOR_4,
            2: cv2.IMREAD_REDUCED_COLOR_2, 1: cv2.IMREAD_COLOR}[scale]
    image = cv2.imread(path, flag)
    small = cv2.resize(image, SIZE[::-1], interpolation=cv2.INTER_AREA)
    return cv2.cvtColor(small, cv2.COLOR_BGR2RGB).transpose(2, 0, 1).copy()


def opencv_chunk(paths: list[str]) -> int:
    for path in paths:
        opencv_row(path)
    return len(paths)


# --- cachekit builds -----------------------------------------------------------------------

class Builds:
    """Cold builds into fresh roots under ``work``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.count = 0

    def build(self, paths: list[str], **options: Any) -> Callable[[], None]:
        import pandas as pd

        import cachekit

        column = pd.Series(paths, name="img_path")
        draft = options.pop("draft", False)

        def run() -> None:
            self.count += 1
            root = self.work / f"root{self.count}"
            try:
                entry = cachekit.Cache(root, progress=False, **options).images(
                    column, SIZE, draft=draft)
                assert entry.source == "built" and len(entry) == len(paths)
            finally:
                shutil.rmtree(root, ignore_errors=True)

        return run


# --- the profile -----------------------------------------------------------------------------

def phase_steps() -> list[tuple[str, Callable[[str], Any]]]:
    """Cumulative steps of cachekit's exact path; each adds one phase to the one before."""
    import numpy as np
    from PIL import ExifTags, Image

    from cachekit import _fs
    from cachekit.engine.decoding import decode_pil, images

    bilinear = Image.Resampling.BILINEAR
    orientation = ExifTags.Base.Orientation

    def opened(path: str) -> None:
        with _fs.open_regular(path, follow_symlinks=True) as f, Image.open(f):
            pass

    def decoded(path: str) -> None:
        with _fs.open_regular(path, follow_symlinks=True) as f, Image.open(f) as im:
            im.load()

    def oriented(path: str) -> None:
        with _fs.open_regular(path, follow_symlinks=True) as f, Image.open(f) as im:
            im.load()
            decode_pil.TRANSPOSITIONS.get(im.getexif().get(orientation, 1))

    def converted(path: str) -> None:
        with _fs.open_regular(path, follow_symlinks=True) as f, Image.open(f) as im:
            im.load()
            decode_pil.TRANSPOSITIONS.get(im.getexif().get(orientation, 1))
            decode_pil.convert(im, "RGB")

    def resized(path: str) -> None:
        with _fs.open_regular(path, follow_symlinks=True) as f, Image.open(f) as im:
            im.load()
            decode_pil.TRANSPOSITIONS.get(im.getexif().get(orientation, 1))
            decode_pil.convert(im, "RGB").resize(SIZE[::-1], bilinear)

    def array(path: str) -> None:
        images.load_image(path, SIZE, backend="pil")

    row = np.zeros((3, *SIZE), np.uint8)

    def written(path: str) -> None:
        row[...] = images.load_image(path, SIZE, backend="pil")

    return [("open (file + Image.open header)", opened), ("decode (load)", decoded),
            ("EXIF orientation", oriented), ("convert to RGB", converted),
            ("resize", resized), ("array CHW (load_image)", array),
            ("write the row", written)]


def profile(paths: list[str], rounds: int, builds: Builds) -> list[tuple[str, float, float]]:
    """(phase, CPU us per image added, cumulative CPU us) for each phase, the build's
    overhead, and the two reference loops' totals; medians over rounds."""
    steps = phase_steps()
    loops = [(name, (lambda s: lambda: [s(p) for p in paths])(step)) for name, step in steps]
    loops.append(("build overhead (key, entry, fill, flush)", builds.build(paths, workers=1,
                                                                            executor="threads")))
    loops += [("seed loop (Resize + ToTensor)", lambda: seed_loop(paths)),
              ("bare Pillow loop", lambda: bare_loop(paths))]
    spent: dict[str, list[float]] = {name: [] for name, _ in loops}
    for _ in range(rounds):
        for name, loop in loops:
            started = time.process_time()  # CPU: one thread, and preemption not counted
            loop()
            spent[name].append((time.process_time() - started) / len(paths) * 1e6)
    out, before = [], None
    for name, _ in loops:
        total = statistics.median(spent[name])
        if name.startswith(("seed", "bare")):
            out.append((name, 0.0, total))
            continue
        # A phase's cost: the median over rounds of its step minus the step before it in
        # the same round (the two ran back to back, under the same load).
        added = total if before is None else statistics.median(
            a - b for a, b in zip(spent[name], spent[before]))
        out.append((name, added, total))
        before = name
    return out


# --- the GIL fraction ----------------------------------------------------------------------

def gil_fraction(paths: list[str], size: tuple[int, int], rounds: int,
                 backend: str = "pil", draft: bool = False) -> dict[str, float]:
    """Fraction of one image's time (load_image with ``backend``) that holds the GIL; see
    the module doc (for "tensor", torch's ops in TORCH_RELEASING count as releasing it)."""
    from cachekit.engine.decoding import images

    def work() -> None:
        for path in paths:
            images.load_image(path, size, draft=draft, backend=backend)

    released: list[float] = []
    stack: list[tuple[Any, float]] = []
    clock = time.thread_time  # CPU time of this thread: time preempted by others not counted

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            stack.append((arg, clock()))
        elif event in ("c_return", "c_exception") and stack:
            fn, began = stack.pop()
            owner = type(getattr(fn, "__self__", None)).__name__
            name = getattr(fn, "__name__", "")
            if (owner, name) in RELEASING or name in TORCH_RELEASING:
                released[-1] += clock() - began

    solo = []
    work()  # warm: imports, file cache
    for _ in range(rounds):
        started = clock()
        work()
        solo.append(clock() - started)
        released.append(0.0)
        sys.setprofile(hook)
        try:
            work()
        finally:
            sys.setprofile(None)
    # Each round's pair ran back to back, under the same load: the median of their ratios.
    ratios = sorted(max(0.0, 1.0 - r / t) for r, t in zip(released, solo))
    g = statistics.median(ratios)
    per_image = statistics.median(solo) / len(paths)
    free = statistics.median(released) / len(paths)
    return {"us_per_image": per_image * 1e6, "us_released": free * 1e6, "gil": g,
            "gil_low": ratios[0], "gil_high": ratios[-1],
            "amdahl_2": amdahl(g, 2), "amdahl_16": amdahl(g, 16), "amdahl_64": amdahl(g, 64),
            "ceiling": 1 / g if g else float("inf")}


def amdahl(g: float, n: int) -> float:
    """Speed-up of n threads when a fraction g of the work is serial (holds the GIL)."""
    return 1.0 / (g + (1.0 - g) / n)


# --- the rounds ----------------------------------------------------------------------------

def rounds_of(contestants: dict[str, Callable[[], Any]], rounds: int
              ) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) of each contestant in each round, contestants taking turns."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contestants}
    for index in range(rounds):
        for name, run in contestants.items():
            say(f"round {index + 1}/{rounds}: {name}")
            wall, cpu = time.perf_counter(), cpu_now()
            timed = run()  # a contestant with its own set-up times only its build
            if not isinstance(timed, tuple):
                timed = (time.perf_counter() - wall, cpu_now() - cpu)
            runs[name].append(timed)
    return runs


def on_dask(paths: list[str], builds: Builds, workers: int) -> Callable[[], Any]:
    """A build on a fresh Dask LocalCluster of ``workers`` single-threaded worker processes,
    timed without the cluster's start and stop: a cluster's scheduler runs in this process,
    and one left running would slow every other contestant's rounds."""
    import distributed

    def run() -> tuple[float, float]:
        environ = dict(os.environ)
        try:
            return build_on_a_cluster()
        finally:
            # A LocalCluster sets MALLOC_TRIM_THRESHOLD_ (and OMP_NUM_THREADS, PYTHONHASHSEED,
            # ...) in this process's environment; every worker interpreter started later
            # would inherit it, and that malloc setting slows Pillow (docs/build-engine.md).
            os.environ.clear()
            os.environ.update(environ)

    def build_on_a_cluster() -> tuple[float, float]:
        with distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address="127.0.0.1:0") as cluster, \
                distributed.Client(cluster) as client:  # dashboard None binds 0.0.0.0:8787
            client.run(warm_worker)  # long-lived workers have their imports done
            build = builds.build(paths, executor=client.get_executor())
            wall, cpu = time.perf_counter(), cpu_now()
            build()
            return time.perf_counter() - wall, cpu_now() - cpu

    return run


def warm_worker() -> None:
    import cachekit.engine.running.executors  # noqa: F401
    import cachekit.engine.decoding.images  # noqa: F401
    import cachekit.engine.running.rows  # noqa: F401


def contestants_for(paths: list[str], builds: Builds, cores: int, stack: Any
                    ) -> tuple[dict[str, Callable[[], Any]], list[str]]:
    """Everything that runs in the rounds, and the contestants skipped (not installed)."""
    runs: dict[str, Callable[[], Any]] = {
        "seed loop": lambda: seed_loop(paths),
        "bare Pillow loop": lambda: bare_loop(paths),
        "cachekit exact, 1 worker, threads": builds.build(paths, workers=1, executor="threads"),
        "cachekit exact, 2 workers, threads": builds.build(paths, workers=2,
                                                           executor="threads"),
        "cachekit exact, 1 worker, processes": builds.build(paths, workers=1,
                                                            executor="processes"),
        "cachekit exact, 2 workers, processes": builds.build(paths, workers=2,
                                                             executor="processes"),
        "cachekit exact, default": builds.build(paths),
        "cachekit draft, default": builds.build(paths, draft=True),
    }
    skipped = []
    try:
        import datasets  # noqa: F401

        import bench_peers
        import pandas as pd

        column = pd.Series(paths, name="img_path")

        def datasets_map() -> None:
            target = builds.work / f"datasets{builds.count}"
            builds.count += 1
            try:
                bench_peers.datasets_map(target / "pixels.arrow", bench_peers.decode_batch,
                                         column, num_proc=cores)
            finally:
                shutil.rmtree(target, ignore_errors=True)

        runs[f"datasets map, num_proc={cores}"] = datasets_map
    except ImportError:
        skipped.append("datasets (pip install datasets)")
    try:
        import cv2  # noqa: F401
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing

        pool = stack.enter_context(ProcessPoolExecutor(
            cores, mp_context=multiprocessing.get_context("spawn")))
        list(pool.map(opencv_chunk, [paths[:2]] * cores))  # workers started and warm
        pieces = [paths[i:i + 64] for i in range(0, len(paths), 64)]
        runs[f"OpenCV reduced decode, {cores} processes"] = lambda: sum(
            pool.map(opencv_chunk, pieces))
    except ImportError:
        skipped.append("OpenCV (pip install opencv-python-headless)")
    try:
        import distributed  # noqa: F401
    except ImportError:
        skipped.append("Dask (pip install distributed)")
    else:
        for workers in (1, 2):
            runs[f"cachekit exact, Dask {workers} worker(s)"] = on_dask(paths, builds, workers)
    return runs, skipped


def exactness(paths: list[str], work: Path) -> dict[str, float]:
    """Mean |difference| from the exact pixels (the "pil" pipeline's), /255, of the default
    draft=True and of the OpenCV proxy."""
    import numpy as np

    from cachekit.engine.decoding import images

    sample = paths[:200]
    exact = np.stack([images.load_image(p, SIZE, backend="pil") for p in sample]
                     ).astype(np.int16)
    draft = np.stack([images.load_image(p, SIZE, draft=True) for p in sample]).astype(np.int16)
    out = {"draft": float(np.abs(draft - exact).mean())}
    try:
        proxy = np.stack([opencv_row(p) for p in sample]).astype(np.int16)
        out["opencv"] = float(np.abs(proxy - exact).mean())
    except ImportError:
        pass
    return out


# --- the table -----------------------------------------------------------------------------

RATIOS = [  # (figure, numerator, denominator, target, higher is better)
    ("exact 1 worker / seed loop", "cachekit exact, 1 worker, threads", "seed loop", 1.0),
    ("exact 1 worker / bare Pillow loop", "cachekit exact, 1 worker, threads",
     "bare Pillow loop", 0.9),
    ("exact 2 workers / 1 worker (threads)", "cachekit exact, 2 workers, threads",
     "cachekit exact, 1 worker, threads", 1.85),
    ("exact 2 workers / 1 worker (processes)", "cachekit exact, 2 workers, processes",
     "cachekit exact, 1 worker, processes", 1.85),
    ("processes / threads, 1 worker", "cachekit exact, 1 worker, processes",
     "cachekit exact, 1 worker, threads", None),
    ("processes / threads, 2 workers", "cachekit exact, 2 workers, processes",
     "cachekit exact, 2 workers, threads", None),
    ("default build / datasets map", "cachekit exact, default", "datasets map", 1.15),
    ("draft default / OpenCV reduced decode", "cachekit draft, default", "OpenCV", 0.7),
    ("Dask 2 workers / 1 worker", "cachekit exact, Dask 2 worker(s)",
     "cachekit exact, Dask 1 worker(s)", 1.6),
]


UNCOUNTED = ("OpenCV", "cachekit exact, Dask")


def spread(values: list[float]) -> str:
    """Each round's figure, lowest first: how far one run can be from the median."""
    return ", ".join(f"{v:.2f}" for v in sorted(values))


def find(names: list[str], prefix: str) -> Optional[str]:
    return next((n for n in names if n.startswith(prefix)), None)


def table(n: int, runs: dict[str, list[tuple[float, float]]], gil: dict[str, dict[str, float]],
          phases: list[tuple[str, float, float]], diffs: dict[str, float],
          skipped: list[str]) -> str:
    rate = {name: n / statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r) / n for name, r in runs.items()}
    lines = [f"## Build engine, {n:,} covers, exact pixels {SIZE[0]}x{SIZE[1]} RGB", "",
             "| contestant | images/s | CPU ms/image |", "|---|---:|---:|"]
    # Pool and cluster workers that outlive a build are not reaped children: not counted.
    lines += [f"| {name} | {rate[name]:,.0f} | "
              + (f"{cpu[name] * 1e3:.2f} (builder only) |" if name.startswith(UNCOUNTED)
                 else f"{cpu[name] * 1e3:.2f} |") for name in runs]
    lines += ["", "| ratio (median of the rounds' own ratios) | measured | rounds | target |",
              "|---|---:|---|---:|"]
    names = list(runs)
    for figure, top, bottom, target in RATIOS:
        a, b = find(names, top), find(names, bottom)
        if a is None or b is None:
            continue
        # The two ran back to back in each round, under the same load: speed ratio per round.
        each = [wb / wa for (wa, _), (wb, _) in zip(runs[a], runs[b])]
        value = statistics.median(each)
        shown = "" if target is None else (f">= {target:g} " +
                                           ("(met)" if value >= target else "(not met)"))
        lines.append(f"| {figure} | {value:.2f}x | {spread(each)} | {shown} |")
    bare, default = find(names, "bare Pillow loop"), find(names, "cachekit exact, default")
    if bare and default:
        each = [ca / cb for (_, ca), (_, cb) in zip(runs[default], runs[bare])]
        value = statistics.median(each)
        lines.append(f"| CPU per image, default build / bare loop | {value:.2f}x | "
                     f"{spread(each)} | <= 1.1 " + ("(met) |" if value <= 1.1 else "(not met) |"))
    lines += ["", "| GIL | covers | small 64x48 |", "|---|---:|---:|"]
    for key, label in (("us_per_image", "us per image"),
                       ("us_released", "us in GIL-releasing C calls"), ("gil", "GIL fraction"),
                       ("gil_low", "GIL fraction, lowest round"),
                       ("gil_high", "GIL fraction, highest round"),
                       ("amdahl_2", "Amdahl speed-up, 2 threads"),
                       ("amdahl_16", "Amdahl speed-up, 16 threads"),
                       ("amdahl_64", "Amdahl speed-up, 64 threads"),
                       ("ceiling", "ceiling 1/g")):
        fmt = "{:.3f}" if key.startswith("gil") else "{:,.1f}"
        lines.append(f"| {label} | {fmt.format(gil['covers'][key])} | "
                     f"{fmt.format(gil['small'][key])} |")
    lines += ["", "| phase of one cover (pil pipeline), CPU | adds us | cumulative us |",
              "|---|---:|---:|"]
    lines += [f"| {name} | {'' if name.startswith(('seed', 'bare')) else f'{add:,.0f}'} | "
              f"{total:,.0f} |" for name, add, total in phases]
    if diffs:
        lines += ["", "Mean |difference| from exact pixels (/255): " + ", ".join(
            f"{k} {v:.2f}" for k, v in diffs.items())]
    if skipped:
        lines += ["", "Not measured (not installed): " + "; ".join(skipped)]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from contextlib import ExitStack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--covers", type=int, help="covers in the build (default 2000)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    n = args.covers or (120 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 5)
    from cachekit.engine.running.executors import usable_cpus

    cores = usable_cpus()
    work = Path(tempfile.mkdtemp(prefix="cachekit-bench-engine-"))
    try:
        say(f"writing {n} covers and {min(n, 1000)} small images under {work}")
        paths = make_covers(work, n)
        small = make_small(work, min(n, 1000))
        builds = Builds(work / "roots")
        say("GIL fraction")
        gil = {"covers": gil_fraction(paths[:300], SIZE, 2 * rounds + 1),
               "small": gil_fraction(small, SIZE, 2 * rounds + 1)}
        say("per-phase profile")
        phases = profile(paths[:300], 2 * rounds + 1, builds)
        with ExitStack() as stack:
            contestants, skipped = contestants_for(paths, builds, cores, stack)
            runs = rounds_of(contestants, rounds)
        diffs = exactness(paths, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(n, runs, gil, phases, diffs, skipped)
    load = os.getloadavg()[0]
    text += (f"\n\n{cores} usable cores, load average {load:.2f} at the end; median of "
             f"{rounds} rounds; command: python benchmarks/bench_engine.py"
             + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv)))
    print(text)
    result = {"covers": n, "rounds": rounds, "cores": cores, "runs": runs, "gil": gil,
              "phases": phases, "diffs": diffs, "skipped": skipped, "table": text}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
