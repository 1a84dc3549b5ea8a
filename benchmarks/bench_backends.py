"""The decoding backends side by side in one run: CPU per image and throughput of the bare
Pillow loop, of cachekit's "pil" and "tensor" backends on 1 and 2 workers (threads and
processes), of draft decoding and its OpenCV proxy; the GIL share of an image on each
backend; what a worker interpreter pays to start for each.

    python benchmarks/bench_backends.py                # 1,000 covers, 3 rounds
    python benchmarks/bench_backends.py --images 4000 --rounds 5
    python benchmarks/bench_backends.py --quick        # 60 covers, 1 round: checks the script

Pixels are 3x32x32 RGB bilinear (the seed's target) unless ``--size`` says otherwise.
Contestants take turns round by round (load from elsewhere falls on all alike); a rate is
the median of the rounds, a ratio the median of each round's own ratio, with every round's
value beside it. CPU is this process's and its reaped children's (cachekit's worker
processes are reaped at the end of each build; OpenCV's pool is not: "builder only").
torch is imported before the rounds, as a training script has it; a build on processes
still pays it in its worker, and the start-cost table says how much. The GIL share is
measured as in bench_engine.py, torch's ops counted as releasing the GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import bench_engine  # noqa: E402
from bench_engine import make_covers, spread  # noqa: E402

BARE = "bare Pillow loop"
OPENCV = "OpenCV reduced decode, 2 processes"

BUILDS: dict[str, dict[str, Any]] = {  # contestant -> Cache and images() options
    "cachekit pil, 1 worker": {"workers": 1, "backend": "pil"},
    "cachekit tensor, 1 worker (the default per core)": {"workers": 1},
    "cachekit pil, 2 workers, threads": {"workers": 2, "executor": "threads",
                                         "backend": "pil"},
    "cachekit pil, 2 workers, processes": {"workers": 2, "executor": "processes",
                                           "backend": "pil"},
    "cachekit tensor, 2 workers, threads": {"workers": 2, "executor": "threads"},
    "cachekit tensor, 2 workers, threads, torch on 1 thread": {
        "workers": 2, "executor": "threads", "torch_threads": 1},
    "cachekit tensor, 2 workers, processes": {"workers": 2, "executor": "processes"},
    "cachekit default, 2 workers": {"workers": 2},
    "cachekit draft, 1 worker": {"workers": 1, "draft": True},
    "cachekit draft, 2 workers (default)": {"workers": 2, "draft": True},
    "cachekit draft pil, 2 workers": {"workers": 2, "draft": True, "backend": "pil"},
}

RATIOS = [  # (figure, numerator, denominator, target: ">= x", "<= x" or None, on CPU)
    ("default build per core / bare Pillow loop", "cachekit tensor, 1 worker", BARE,
     ">= 1.8", False),
    ("CPU per image, default build per core / bare loop", "cachekit tensor, 1 worker", BARE,
     "<= 0.55", True),
    ("tensor / pil, 1 worker", "cachekit tensor, 1 worker", "cachekit pil, 1 worker", None,
     False),
    ("default build, 2 workers / bare Pillow loop", "cachekit default, 2 workers", BARE,
     None, False),
    ("tensor, 2 threads / 1 worker", "cachekit tensor, 2 workers, threads",
     "cachekit tensor, 1 worker", None, False),
    ("pil, 2 threads / 1 worker", "cachekit pil, 2 workers, threads",
     "cachekit pil, 1 worker", None, False),
    ("tensor, processes / threads, 2 workers", "cachekit tensor, 2 workers, processes",
     "cachekit tensor, 2 workers, threads", None, False),
    ("pil, processes / threads, 2 workers", "cachekit pil, 2 workers, processes",
     "cachekit pil, 2 workers, threads", None, False),
    ("CPU per image, 2 threads: torch on 1 thread / torch's default",
     "cachekit tensor, 2 workers, threads, torch", "cachekit tensor, 2 workers, threads",
     None, True),
    ("draft, 2 workers / OpenCV reduced decode", "cachekit draft, 2 workers", OPENCV,
     ">= 1.0", False),
    ("draft tensor / draft pil, 2 workers", "cachekit draft, 2 workers",
     "cachekit draft pil, 2 workers", None, False),
]

START_COSTS = {  # what a fresh worker interpreter imports to compute a row
    "pil worker (numpy, Pillow)": "import numpy, PIL.Image; from cachekit.engine.decoding "
                                  "import decode_pil",
    "tensor worker (torch, torchvision's image library)": "from cachekit.engine.decoding "
                                                          "import decode_tensor",
    "through torchvision.io instead": "import torch, torchvision.io",
}


def say(text: str) -> None:
    print(f"[bench_backends] {text}", file=sys.stderr, flush=True)


def build(work: Path, paths: list[str], size: tuple[int, int], options: dict[str, Any]
          ) -> Callable[[], None]:
    """A cold build of ``paths`` into a fresh root, with ``options``."""
    import pandas as pd
    import torch

    import cachekit

    column = pd.Series(paths, name="img_path")
    cache_options = {k: options[k] for k in ("workers", "executor") if k in options}
    image_options = {k: options[k] for k in ("draft", "backend") if k in options}
    threads = options.get("torch_threads")
    count = [0]

    def run() -> None:
        count[0] += 1
        root = work / f"root{count[0]}"
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            entry = cachekit.Cache(root, progress=False, **cache_options).images(
                column, size, **image_options)
            assert entry.source == "built" and len(entry) == len(paths)
        finally:
            torch.set_num_threads(before)
            shutil.rmtree(root, ignore_errors=True)

    return run


def contestants(work: Path, paths: list[str], size: tuple[int, int], stack: ExitStack
                ) -> dict[str, Callable[[], Any]]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    bench_engine.SIZE = size  # its bare loop and OpenCV proxy read it
    runs: dict[str, Callable[[], Any]] = {BARE: lambda: bench_engine.bare_loop(paths)}
    for name, options in BUILDS.items():
        runs[name] = build(work, paths, size, options)
    pool = stack.enter_context(ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context("spawn")))
    list(pool.map(opencv_chunk, [(paths[:2], size)] * 2))  # started and warm
    pieces = [(paths[i:i + 64], size) for i in range(0, len(paths), 64)]
    runs[OPENCV] = lambda: sum(pool.map(opencv_chunk, pieces))
    return runs


def opencv_chunk(piece: tuple[list[str], tuple[int, int]]) -> int:
    """bench_engine's OpenCV proxy on ``piece`` (paths, size), in a pool worker."""
    paths, size = piece
    bench_engine.SIZE = tuple(size)
    return bench_engine.opencv_chunk(paths)


def start_cost(code: str) -> tuple[float, float]:
    """(CPU s, wall s) of a fresh interpreter that runs ``code``."""
    probe = ("import resource, time; t = time.perf_counter(); " + code + "; "
             "r = resource.getrusage(resource.RUSAGE_SELF); "
             "print(r.ru_utime + r.ru_stime, time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, cwd=str(HERE.parent),
                          env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    cpu, wall = done.stdout.split()
    return float(cpu), float(wall)


def exactness(paths: list[str], size: tuple[int, int]
              ) -> dict[str, tuple[float, int, float]]:
    """(mean |difference| /255, max, share of values more than 1 level off) from the "pil"
    pipeline's pixels for the same fit and filter (draft and OpenCV: from its exact ones)."""
    import numpy as np

    from cachekit.engine.decoding.images import load_image

    sample = paths[:200]

    def pil(**options: Any) -> np.ndarray:
        return np.stack([load_image(p, size, backend="pil", **options) for p in sample])

    exact = pil()
    variants = {  # name: (rows, the pil rows they are set against)
        "tensor": ([load_image(p, size) for p in sample], exact),
        "tensor, bicubic (the pil pipeline)": (
            [load_image(p, size, resample="bicubic") for p in sample], pil(resample="bicubic")),
        "tensor, crop (the pil pipeline)": ([load_image(p, size, fit="crop") for p in sample],
                                            pil(fit="crop")),
        "torch's kernel were it used: bicubic": (
            [v2_pixels(p, size, "bicubic", crop=False) for p in sample],
            pil(resample="bicubic")),
        "torch's kernel were it used: crop, box rounded to whole pixels": (
            [v2_pixels(p, size, "bilinear", crop=True) for p in sample], pil(fit="crop")),
        "tensor, pad": ([load_image(p, size, fit="pad") for p in sample], pil(fit="pad")),
        "draft (tensor)": ([load_image(p, size, draft=True) for p in sample], exact),
        "draft pil": (list(pil(draft=True)), exact),
        "OpenCV proxy": ([bench_engine.opencv_row(p) for p in sample], exact),
    }
    out = {}
    for name, (rows, reference) in variants.items():
        diff = np.abs(np.stack(rows).astype(np.int16) - reference.astype(np.int16))
        out[name] = (float(diff.mean()), int(diff.max()), float((diff > 1).mean()))
    return out


def v2_pixels(path: str, size: tuple[int, int], resample: str, crop: bool) -> Any:
    """torchvision v2's resize (or resized crop of ``ImageOps.fit``'s box rounded to whole
    pixels) on the decoded RGB image: what the tensor backend would give where it leaves
    the call to the pil pipeline."""
    import numpy as np
    import torch
    import torchvision.transforms.v2.functional as VF
    from PIL import Image
    from torchvision.transforms import InterpolationMode

    with Image.open(path) as im:
        t = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    interpolation = InterpolationMode[resample.upper()]
    if not crop:
        return VF.resize(t, list(size), interpolation, antialias=True).numpy()
    (src_h, src_w), (h, w) = t.shape[1:], size
    if src_w / src_h >= w / h:
        box_w, box_h = w / h * src_h, float(src_h)
    else:
        box_w, box_h = float(src_w), src_w / (w / h)
    top, left = round((src_h - box_h) / 2), round((src_w - box_w) / 2)
    return VF.resized_crop(t, top, left, max(1, round(box_h)), max(1, round(box_w)),
                           list(size), interpolation, antialias=True).numpy()


def decoders(paths: list[str], size: tuple[int, int], rounds: int) -> dict[str, float]:
    """CPU us per cover of each decoder alone (one thread, files in memory; median of
    ``rounds``): what the backends and the OpenCV proxy start from."""
    import io

    import cv2
    import numpy as np
    from PIL import Image

    from cachekit.engine.decoding import jpeg_header, resize_tensor

    datas = [Path(p).read_bytes() for p in paths]
    headers = [jpeg_header.read(data) for data in datas]

    def pillow(draft: bool) -> None:
        for data in datas:
            with Image.open(io.BytesIO(data)) as im:
                if draft:
                    im.draft(None, size[::-1])
                im.load()

    def torchvision() -> None:
        for data, header in zip(datas, headers):
            resize_tensor.decode_jpeg(data, header.channels, header.height, header.width)

    def opencv() -> None:
        for data in datas:
            cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_REDUCED_COLOR_8
                         if size[0] <= 64 else cv2.IMREAD_COLOR)

    steps = {"Pillow decode": lambda: pillow(False), "torchvision decode_jpeg": torchvision,
             "Pillow DCT-scaled decode (draft)": lambda: pillow(True),
             "OpenCV reduced decode (IMREAD_REDUCED_COLOR_8)": opencv}
    spent: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.process_time()
            step()
            spent[name].append((time.process_time() - started) / len(datas) * 1e6)
    return {name: statistics.median(values) for name, values in spent.items()}


def resizers(paths: list[str], size: tuple[int, int], rounds: int) -> dict[str, float]:
    """CPU us per cover of Pillow's and torch's resize, each right after the decode (as in a
    build: caches are cold for the resize's code), of the full image and of the DCT-scaled
    one (``draft``), and the median pixels of each."""
    import io

    import numpy as np
    from PIL import Image

    from cachekit.engine.decoding import resize_tensor

    datas = [Path(p).read_bytes() for p in paths]
    out: dict[str, float] = {}
    for draft in (False, True):
        spent = {"Pillow": [], "torch": []}
        pixels = []
        for _ in range(rounds):
            totals = {"Pillow": 0.0, "torch": 0.0}
            for data in datas:
                with Image.open(io.BytesIO(data)) as im:
                    if draft:
                        im.draft(None, size[::-1])
                    im.load()
                    hwc = np.array(im)
                    started = time.thread_time()
                    resize_tensor.resize_fit(hwc, size, "stretch", "bilinear", 3)
                    totals["torch"] += time.thread_time() - started
                    started = time.thread_time()
                    np.asarray(im.resize(size[::-1], Image.Resampling.BILINEAR))
                    totals["Pillow"] += time.thread_time() - started
                    pixels.append(im.width * im.height)
            for name, total in totals.items():
                spent[name].append(total / len(datas) * 1e6)
        image = "DCT-scaled image" if draft else "full image"
        out[f"{image}, median pixels"] = statistics.median(pixels)
        for name, values in spent.items():
            out[f"{image}, {name}"] = statistics.median(values)
    return out


def find(names: list[str], prefix: str) -> Optional[str]:
    return next((n for n in names if n.startswith(prefix)), None)


def table(n: int, size: tuple[int, int], runs: dict[str, list[tuple[float, float]]],
          gil: dict[str, dict[str, float]], starts: dict[str, tuple[float, float]],
          diffs: dict[str, tuple[float, int, float]], decoded: dict[str, float],
          resized: dict[str, float]) -> str:
    rate = {name: n / statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r) / n for name, r in runs.items()}
    lines = [f"## Decoding backends, {n:,} covers, {size[0]}x{size[1]} RGB bilinear", "",
             "| contestant | images/s | CPU ms/image |", "|---|---:|---:|"]
    lines += [f"| {name} | {rate[name]:,.0f} | {cpu[name] * 1e3:.2f}"
              + (" (builder only) |" if name == OPENCV else " |") for name in runs]
    lines += ["", "| ratio (median of the rounds' own ratios) | measured | rounds | target |",
              "|---|---:|---|---:|"]
    names = list(runs)
    for figure, top, bottom, target, on_cpu in RATIOS:
        a, b = find(names, top), find(names, bottom)
        if a is None or b is None:
            continue
        if on_cpu:
            each = [ca / cb for (_, ca), (_, cb) in zip(runs[a], runs[b])]
        else:
            each = [wb / wa for (wa, _), (wb, _) in zip(runs[a], runs[b])]
        value = statistics.median(each)
        shown = ""
        if target:
            bound = float(target.split()[1])
            met = value >= bound if target.startswith(">=") else value <= bound
            shown = f"{target} ({'met' if met else 'not met'})"
        lines.append(f"| {figure} | {value:.2f}x | {spread(each)} | {shown} |")
    lines += ["", "| GIL | " + " | ".join(gil) + " |", "|---|" + "---:|" * len(gil)]
    for key, label in (("us_per_image", "us per image"),
                       ("us_released", "us in GIL-releasing C calls"),
                       ("gil", "GIL fraction"), ("gil_low", "GIL fraction, lowest round"),
                       ("gil_high", "GIL fraction, highest round"),
                       ("amdahl_2", "Amdahl speed-up, 2 threads"),
                       ("amdahl_16", "Amdahl speed-up, 16 threads"),
                       ("amdahl_64", "Amdahl speed-up, 64 threads")):
        fmt = "{:.3f}" if key.startswith("gil") else "{:,.1f}"
        lines.append(f"| {label} | " + " | ".join(fmt.format(g[key]) for g in gil.values())
                     + " |")
    lines += ["", "| a decoder alone, one thread | CPU us per cover |", "|---|---:|"]
    lines += [f"| {name} | {us:,.0f} |" for name, us in decoded.items()]
    lines += ["", "| a resize right after its decode, one thread | CPU us per cover |",
              "|---|---:|"]
    lines += [f"| {name} | {value:,.0f} |" for name, value in resized.items()]
    lines += ["", "| a fresh worker interpreter imports | CPU s | wall s |", "|---|---:|---:|"]
    lines += [f"| {name} | {c:.2f} | {w:.2f} |" for name, (c, w) in starts.items()]
    lines += ["", "| pixels against the pil pipeline's (200 covers) | mean /255 | max | "
              "share > 1 level |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {mean:.3f} | {top} | {share:.2%} |"
              for name, (mean, top, share) in diffs.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--images", type=int, help="covers in each build (default 1000)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3)")
    parser.add_argument("--size", type=int, default=32, help="square target side (32)")
    parser.add_argument("--only", action="append", metavar="PREFIX",
                        help="run the contestants whose name starts with PREFIX (repeat it "
                             "for more; default: all); the bare loop always runs")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    n = args.images or (60 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    size = (args.size, args.size)
    work = Path(tempfile.mkdtemp(prefix="cachekit-bench-backends-"))
    try:
        say(f"writing {n} covers under {work}")
        paths = make_covers(work, n)
        from cachekit.engine.decoding.images import load_image

        load_image(paths[0], size)  # torch imported, as in a training script
        say("GIL fractions")
        gil_paths, gil_rounds = paths[:min(n, 300)], 1 if args.quick else 2 * rounds + 1
        gil = {backend: bench_engine.gil_fraction(gil_paths, size, gil_rounds, backend, draft)
               for backend, draft in (("pil", False), ("tensor", False))}
        gil["tensor, draft"] = bench_engine.gil_fraction(gil_paths, size, gil_rounds,
                                                         "tensor", True)
        say("decoders alone")
        decoded = decoders(paths[:min(n, 300)], size, gil_rounds)
        resized = resizers(paths[:min(n, 300)], size, gil_rounds)
        say("start costs of worker interpreters")
        starts = {name: start_cost(code) for name, code in START_COSTS.items()}
        with ExitStack() as stack:
            everyone = contestants(work / "roots", paths, size, stack)
            if args.only:
                prefixes = tuple(args.only)
                everyone = {name: run for name, run in everyone.items()
                            if name == BARE or name.startswith(prefixes)}
            runs = bench_engine.rounds_of(everyone, rounds)
        diffs = exactness(paths, size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(n, size, runs, gil, starts, diffs, decoded, resized)
    text += (f"\n\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
             f"median of {rounds} rounds; command: "
             + shlex.join(["python", "benchmarks/bench_backends.py",
                           *(sys.argv[1:] if argv is None else argv)]))
    print(text)
    result = {"images": n, "rounds": rounds, "size": size, "runs": runs, "gil": gil,
              "starts": starts, "diffs": diffs, "decoders": decoded, "resizers": resized,
              "table": text}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
