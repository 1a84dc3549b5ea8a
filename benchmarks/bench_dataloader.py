"""Reading for training: DataLoader throughput over a cache entry, and memory of K readers.

    python benchmarks/bench_dataloader.py            # 50k rows of 3x32x32 (about 1-2 minutes)
    python benchmarks/bench_dataloader.py --quick    # 10k rows

Throughput: one epoch of ``DataLoader(batch_size=256, shuffle=True, num_workers=0 or 2)``
(persistent workers, one untimed warm-up epoch first) over

- an in-RAM uint8 tensor behind a Dataset with ``__getitems__`` (the ceiling),
- ``entry.dataset()`` (batched sorted fancy index on the memmap),
- the same entry read item by item (``__getitems__`` hidden), and with a per-item
  ``v2.ToDtype(torch.float32, scale=True)`` (on the first ``SLOW_ROWS`` rows, to keep the
  run short), to show what each costs,
- the seed's Dataset: per item PIL open + ``Resize((32, 32))`` + ``ToTensor`` (512 covers).

The contestants take turns (whole epochs, round-robin, four turns per run), so load from
other processes on the machine hits them alike; each figure is the median of the runs. The entry is made by ``Cache.map``
from generated uint8 rows: reading does not depend on the pixel values.

Memory: 4 fresh interpreters each iterate the whole entry once (batch 256, shuffled, no
workers) and, while all 4 still hold it, read their PSS (``/proc/self/smaps_rollup``, and
the PSS of the data file's mapping from ``/proc/self/smaps``). Pages of a shared file mapping
count 1/K in each of K processes, so the sum is about 1x the entry when they share one
page-cache copy, and would be 4x with a private copy each.

Everything is written under a temporary directory (or ``work``), removed at the end.
``measure(...)`` is what ``benchmarks/run.py`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's cachekit

BATCH = 256
WORKERS = (0, 2)
READERS = 4
SHAPE = (3, 32, 32)
# A timed run gives each contestant whole epochs in ROUNDS turns, round-robin, until it has
# had RUN_SECONDS: load from other processes then falls on all contestants alike.
RUN_SECONDS = 0.8
ROUNDS = 4
BARRIER_TIMEOUT = 300.0
SEED_ROWS = 512  # two batches: with 2 workers both have work
SLOW_ROWS = 5_000
CACHEKIT = "cachekit entry.dataset()"


# --- datasets --------------------------------------------------------------------------

def ram_dataset(data: Any):
    """The ceiling: a uint8 tensor in RAM, a batch fetched with one fancy index.

    It indexes the tensor's numpy view: ``tensor[torch.as_tensor(indices)]`` is far
    slower than numpy's fancy index, so torch indexing would make a weak ceiling
    (docs/dataloader.md has the timings).
    """
    import numpy as np
    import torch
    from torch.utils.data import Dataset

    class InRam(Dataset):
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def __len__(self) -> int:
            return len(self.tensor)

        def __getitem__(self, i: int) -> torch.Tensor:
            return self.tensor[i].clone()

        def __getitems__(self, indices: Sequence[int]) -> list:
            rows = self.tensor.numpy()[np.asarray(indices, dtype=np.intp)]
            return list(torch.from_numpy(rows).unbind(0))

    return InRam(torch.from_numpy(data))


def per_item(dataset: Any):
    """``dataset`` without ``__getitems__``: the DataLoader calls ``__getitem__`` per row."""
    from torch.utils.data import Dataset

    class PerItem(Dataset):
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, i: int) -> Any:
            return dataset[i]

    return PerItem()


def seed_dataset(paths: Sequence[str]):
    """The seed report's per-item path: PIL open, Resize((32, 32)), ToTensor."""
    from PIL import Image
    from torch.utils.data import Dataset
    from torchvision import transforms

    class SeedImages(Dataset):
        def __init__(self) -> None:
            self.scale = transforms.Resize((32, 32))
            self.tensor = transforms.ToTensor()

        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> Any:
            with Image.open(paths[i]) as img:
                return self.tensor(self.scale(img))

    return SeedImages()


# --- throughput ------------------------------------------------------------------------

def make_entry(root: Path, rows: int, seed: int = 0):
    """An entry of ``rows`` generated (3, 32, 32) uint8 rows, built with Cache.map."""
    import numpy as np
    import pandas as pd

    import cachekit

    data = np.random.default_rng(seed).integers(0, 256, size=(rows, *SHAPE), dtype=np.uint8)

    def row(i: int) -> np.ndarray:
        return data[i]

    entry = cachekit.Cache(root, progress=False).map(row, pd.Series(np.arange(rows)))
    return entry, data


def timed_epochs(loader: Any, seconds: float) -> tuple[int, float]:
    """(rows, elapsed seconds) of whole epochs, repeated until ``seconds`` have passed."""
    done, start = 0, time.perf_counter()
    while True:
        for batch in loader:
            done += len(batch)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done, elapsed


def make_loader(dataset: Any, workers: int):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                      persistent_workers=workers > 0)


def throughput(contestants: dict[str, Any], repeats: int, log: Callable[[str], None],
               run_seconds: float) -> dict[tuple[str, int], list[float]]:
    """Items/s of every (contestant, workers), ``repeats`` runs of ``run_seconds`` each,
    round-robin."""
    loaders = {}
    for name, dataset in contestants.items():
        for workers in WORKERS:
            loader = make_loader(dataset, workers)
            for _ in loader:  # warm-up: start workers, fault pages in
                pass
            loaders[name, workers] = loader
    runs: dict[tuple[str, int], list[float]] = {key: [] for key in loaders}
    for repeat in range(repeats):
        rows = dict.fromkeys(loaders, 0)
        spent = dict.fromkeys(loaders, 0.0)
        for _ in range(ROUNDS):
            for key, loader in loaders.items():
                if spent[key] < run_seconds:  # a slow contestant's one epoch may be enough
                    done, elapsed = timed_epochs(loader, run_seconds / ROUNDS)
                    rows[key] += done
                    spent[key] += elapsed
        for key in loaders:
            runs[key].append(rows[key] / spent[key])
        log(f"  throughput run {repeat + 1}/{repeats} done")
    return runs


# --- memory of K readers ---------------------------------------------------------------

def pss_kib(data_file: Optional[str] = None) -> int:
    """PSS of this process in KiB; with ``data_file``, of that file's mappings only."""
    if data_file is None:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and head[5] == data_file
            elif inside and head[0] == "Pss:":
                total += int(head[1])
    return total


def wait_for(paths: Sequence[Path]) -> None:
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier: still waiting for {[str(p) for p in paths]}")
        time.sleep(0.01)


def reader(entry_dir: str, barrier: str, index: int, count: int) -> None:
    """One of the K reader processes (run as ``bench_dataloader.py pss-reader ...``)."""
    import cachekit
    from cachekit.store import manifest as manifests

    folder = Path(barrier)
    entry = cachekit.Entry(Path(entry_dir), manifests.read(Path(entry_dir)), source="local")
    loader = make_loader(entry.dataset(), 0)
    (folder / f"ready.{index}").touch()
    wait_for([folder / "go"])
    before = pss_kib()
    for _ in loader:
        pass
    (folder / f"read.{index}").touch()
    wait_for([folder / f"read.{i}" for i in range(count)])  # all K hold the pages now
    result = {"before": before, "after": pss_kib(),
              "mapping": pss_kib(str(entry.path / manifests.DATA_FILE))}
    print(json.dumps(result), flush=True)
    (folder / f"measured.{index}").touch()
    wait_for([folder / f"measured.{i}" for i in range(count)])  # nobody leaves early


def readers_pss(entry_dir: Path, barrier: Path, count: int = READERS) -> dict[str, float]:
    """Summed PSS growth and summed data-mapping PSS of ``count`` readers, in bytes."""
    barrier.mkdir(parents=True)
    command = [sys.executable, str(Path(__file__).resolve()), "pss-reader", str(entry_dir),
               str(barrier)]
    procs = [subprocess.Popen(command + [str(i), str(count)], stdout=subprocess.PIPE,
                              text=True) for i in range(count)]
    try:
        wait_for([barrier / f"ready.{i}" for i in range(count)])
        (barrier / "go").touch()
        outputs = [p.communicate(timeout=BARRIER_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a PSS reader failed: exit codes {[p.returncode for p in procs]}")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return {"growth": 1024.0 * sum(r["after"] - r["before"] for r in results),
            "mapping": 1024.0 * sum(r["mapping"] for r in results),
            "total": 1024.0 * sum(r["after"] for r in results)}


# --- the whole measurement -------------------------------------------------------------

def measure(rows: int = 50_000, repeats: int = 3, *, work: Optional[Path] = None,
            paths_file: Optional[Path] = None, seed_rows: int = SEED_ROWS,
            pss_repeats: int = 1, run_seconds: float = RUN_SECONDS,
            log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Measure everything; return dicts with the fields of ``bench_report.Row``.

    Each has ``section`` ("dataloader"), ``label``, ``runs`` (one figure per repeat),
    ``ref`` (label of the cachekit row it is compared with: ``entry.dataset()`` at the same
    num_workers; None for the reference rows), ``detail`` (unit and context) and
    ``cachekit`` (True for the reference rows). ``paths_file``: a text file of image
    paths for the seed's Dataset (else ``seed_rows`` sample covers are written).
    ``pss_repeats``: PSS is page counting, not timing, so one run is the default.
    ``run_seconds``: each contestant's time in one timed run.
    """
    log = log or _say
    import torch
    from torch.utils.data import Subset
    from torchvision.transforms import v2

    from cachekit.samples import write_sample_images

    owned = work is None
    base = Path(tempfile.mkdtemp(prefix="cachekit-bench-dl-")) if owned else \
        Path(tempfile.mkdtemp(prefix="bench-dataloader-", dir=work))
    try:
        log(f"building an entry of {rows} x {SHAPE} uint8 rows ...")
        entry, data = make_entry(base / "cache", rows)
        log(f"{READERS} readers iterating the entry, for PSS ...")
        # First, while no page of the entry is mapped in this process (PSS splits a page
        # among every process that maps it).
        pss = [readers_pss(entry.path, base / f"barrier.{r}") for r in range(pss_repeats)]
        if paths_file is not None:
            paths = Path(paths_file).read_text(encoding="utf-8").split()[:seed_rows]
        else:
            log(f"writing {seed_rows} sample covers for the seed's Dataset ...")
            paths = write_sample_images(base / "covers", seed_rows, seed=7)
        dataset = entry.dataset()
        slow = range(min(rows, SLOW_ROWS))
        scaled = entry.dataset(transform=v2.ToDtype(torch.float32, scale=True))
        contestants = {
            "in-RAM uint8 tensor": ram_dataset(data),
            CACHEKIT: dataset,
            "cachekit, item by item (no __getitems__)": per_item(dataset),
            f"cachekit + per-item v2.ToDtype(float32, scale=True) ({len(slow)} rows)":
                Subset(scaled, slow),
            f"seed: PIL open + Resize + ToTensor per item ({len(paths)} covers)":
                seed_dataset(paths),
        }
        log("DataLoader throughput ...")
        runs = throughput(contestants, repeats, log, run_seconds)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    out = []
    for (name, workers), figures in runs.items():
        reference = name == CACHEKIT
        out.append({"section": "dataloader", "label": f"{name}, num_workers={workers}",
                    "runs": figures, "ref": None if reference else f"{CACHEKIT}, "
                    f"num_workers={workers}", "detail": "items/s", "cachekit": reference})
    size = float(entry.array.nbytes)
    total = statistics.median(p["total"] for p in pss) / 1e6
    for key, what in (("growth", "summed PSS growth"), ("mapping", "summed PSS of data.npy")):
        out.append({"section": "dataloader",
                    "label": f"{READERS} readers of one entry: {what} / entry size",
                    "runs": [p[key] / size for p in pss], "ref": None,
                    "detail": f"x entry size ({size / 1e6:.1f} MB; {READERS} private copies: "
                              f"{READERS}x; readers' whole PSS {total:.0f} MB)",
                    "cachekit": True})
    return out


_STARTED = time.perf_counter()


def _say(text: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:5.1f} s] {text}", file=sys.stderr, flush=True)


def table(results: list[dict]) -> str:
    """Markdown table: median, range, and cachekit's figure over the row's."""
    by_label = {r["label"]: r for r in results}
    lines = [f"| what | median | range | unit | {CACHEKIT} / this |",
             "|---|---:|---:|---|---:|"]
    for r in results:
        median = statistics.median(r["runs"])
        ref = by_label.get(r["ref"]) if r["ref"] else None
        ratio = f"{statistics.median(ref['runs']) / median:.2f}x" if ref else ""
        small = median < 100
        spread = (f"{min(r['runs']):.2f}-{max(r['runs']):.2f}" if small
                  else f"{min(r['runs']):,.0f}-{max(r['runs']):,.0f}")
        shown = f"{median:.2f}" if small else f"{median:,.0f}"
        lines.append(f"| {r['label']} | {shown} | {spread} | {r['detail']} | {ratio} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One sentence per num_workers: share of the in-RAM ceiling, speed-up over the seed."""
    median = {r["label"]: statistics.median(r["runs"]) for r in results}
    parts = []
    for workers in WORKERS:
        ours = median[f"{CACHEKIT}, num_workers={workers}"]
        ram = median[f"in-RAM uint8 tensor, num_workers={workers}"]
        seed = next(v for k, v in median.items()
                    if k.startswith("seed") and k.endswith(f"num_workers={workers}"))
        parts.append(f"num_workers={workers}: {ours / ram:.0%} of the in-RAM ceiling, "
                     f"{ours / seed:,.0f}x the seed's per-item decode")
    return "; ".join(parts) + "."


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pss-reader"]:
        reader(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10k rows instead of 50k")
    parser.add_argument("--rows", type=int, help="rows of the entry (default 50000)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = args.rows or (10_000 if args.quick else 50_000)
    started = time.perf_counter()
    results = measure(rows, args.repeats)
    print(f"DataLoader over a cache entry: {rows} rows of {'x'.join(map(str, SHAPE))} uint8, "
          f"batch {BATCH}, shuffle, median of {args.repeats} runs; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the end (other processes share the "
          "machine: figures are noisy).\n")
    print(table(results))
    print("\n" + summary(results))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
