"""The measured phases of a benchmark run: cold builds, hits, racing agents, DataLoader.

Each phase runs its jobs in fresh interpreters (``bench_worker.py``), interleaving the
contestants so that load from elsewhere on the machine falls on all of them alike, and
returns :class:`bench_report.Row` objects.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import bench_report
from bench_report import Row
from bench_worker import RESULT_PREFIX

HERE = Path(__file__).resolve().parent
WORKER_TIMEOUT = 1200.0
HIT_WARM_CALLS = 2  # calls after the first in each hit process (quick: the first counts too)


@dataclass(frozen=True)
class Config:
    covers: int  # rows of the cold-build column (the larger RSS size)
    rss_small: int  # the smaller RSS size
    agents_rows: int  # rows each of the racing agents asks for
    hit_rows: int  # rows of the hit-path column
    repeats: int
    agents: int = 4
    workers: int = 2
    agents_import_torch: bool = True  # every agent imports torch, as a training agent does
    builds_import_torchvision: bool = True  # False: cachekit's builds import torch only
    fresh_process_per_run: bool = True  # False: repeats of a build or hit share a process
    dataloader_rows: int = 50_000
    dataloader_seconds: Optional[float] = None  # a DataLoader contestant's time in one
    # timed run (None: bench_dataloader.RUN_SECONDS)


FULL = Config(covers=2000, rss_small=500, agents_rows=2000, hit_rows=130_000, repeats=3)
"""The full run: about 10 minutes on 2 quiet cores."""
QUICK = Config(covers=120, rss_small=40, agents_rows=80, hit_rows=5_000, repeats=1,
               agents_import_torch=False, builds_import_torchvision=False,
               fresh_process_per_run=False, dataloader_rows=5_000, dataloader_seconds=0.2)
"""``--quick``: small sizes and shared processes, to check the script (its numbers are not
for quoting)."""


@dataclass(frozen=True)
class Data:
    work: Path
    covers: dict[int, Path]  # rows -> paths file of that many cover JPEGs, shuffled order
    hit: Path  # paths file of the hit-path column


# --- running workers ---------------------------------------------------------------------

def worker_command(role: str, arguments: dict[str, Any]) -> list[str]:
    return [sys.executable, str(HERE / "bench_worker.py"), role, json.dumps(arguments)]


def parse_result(stdout: str, what: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"{what}: no result line in its output")


def run_worker(role: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Run one job in a fresh interpreter and return its result; raise with its stderr."""
    done = subprocess.run(worker_command(role, arguments), capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{role} {arguments.get('contestant', '')} failed "
                           f"({done.returncode}):\n{done.stderr[-3000:]}")
    return parse_result(done.stdout, role)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


_STARTED = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {text}", file=sys.stderr, flush=True)


def fresh_store(work: Path, name: str) -> Path:
    path = work / "stores" / name
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# --- cold build and build memory ---------------------------------------------------------

BUILD_JOBS = (  # (contestant, label of its timing or None, workers, draft)
    ("seed", None, 1, False),
    ("manager", None, 1, False),
    ("joblib", None, 1, False),
    ("datasets", None, 2, False),
    ("cachekit", "cachekit exact, 1 worker", 1, False),
    ("cachekit", "cachekit exact, 2 workers", 2, False),
    ("cachekit", "cachekit draft, 2 workers", 2, True),
)
BUILD_LABELS = {
    "seed serial": "seed serial loop",
    "seed dump": "seed torch.save dump",
    "seed manager": "seed Manager dict, 1 agent",
    "joblib": "joblib.Memory",
    "datasets": "datasets map, num_proc=2",
}
BUILD_REF = "cachekit exact, 2 workers"
RSS_JOBS = {"seed": "seed torch.save dump", "joblib": "joblib.Memory",
            BUILD_REF: BUILD_REF}


def split_repeats(config: Config) -> tuple[int, int]:
    """(fresh processes, runs in each): every run in its own process unless ``--quick``."""
    return (config.repeats, 1) if config.fresh_process_per_run else (1, config.repeats)


def measure_builds(data: Data, config: Config, contestants: set[str]) -> list[Row]:
    """Cold builds at ``covers`` rows (images/s and RSS) and at ``rss_small`` rows (RSS)."""
    jobs = [(config.covers, job) for job in BUILD_JOBS if job[0] in contestants]
    if config.rss_small != config.covers:
        jobs += [(config.rss_small, job) for job in BUILD_JOBS
                 if job[0] in contestants and (job[1] or job[0]) in RSS_JOBS]
    speed: dict[str, list[float]] = {}
    rss: dict[tuple[str, int], list[tuple[float, float]]] = {}
    processes, per_process = split_repeats(config)
    for rep in range(processes):
        for rows, (who, label, workers, draft) in jobs:  # interleaved: drift hits everyone
            say(f"build {rep + 1}/{processes}: {label or who}, {rows} rows")
            store = fresh_store(data.work, f"build-{who}")
            result = run_worker("build", {"contestant": who, "paths_file": str(data.covers[rows]),
                                          "store": str(store), "workers": workers,
                                          "draft": draft, "repeats": per_process,
                                          "torchvision": config.builds_import_torchvision})
            shutil.rmtree(store, ignore_errors=True)
            for name, runs in result["seconds"].items():
                name = label or BUILD_LABELS[name]
                if rows == config.covers:
                    speed.setdefault(name, []).extend(rows / seconds for seconds in runs)
                if name in RSS_JOBS.values():
                    rss.setdefault((name, rows), []).extend(
                        zip(result["max_rss_mb"], result["anon_peak_mb"]))
    out = []
    for name, runs in speed.items():
        cachekit = name.startswith("cachekit")
        out.append(Row("build", name, runs, ref=None if name == BUILD_REF else BUILD_REF,
                       cachekit=cachekit))
    out += rss_rows(rss, config)
    return out


def rss_rows(rss: dict[tuple[str, int], list[tuple[float, float]]],
             config: Config) -> list[Row]:
    """Peak RSS rows, cachekit first, each contestant at both sizes with its growth."""
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    order = list(RSS_JOBS.values())[::-1]  # cachekit, joblib, seed
    out = []
    for (name, rows), runs in sorted(rss.items(), key=lambda i: (order.index(i[0][0]), i[0][1])):
        label, ref = f"{name}, N={rows:,}", f"{BUILD_REF}, N={rows:,}"
        anon = median([a for _, a in runs])
        detail = f"anon peak {anon:,.0f} MB"
        small = rss.get((name, config.rss_small))
        if rows != config.rss_small and small:
            grew = median([m for m, _ in runs]) - median([m for m, _ in small])
            grew_anon = anon - median([a for _, a in small])
            detail += (f"; from N={config.rss_small:,}: RSS {grew:+,.0f} MB, anon "
                       f"{grew_anon:+,.0f} MB")
        out.append(Row("rss", label, [m for m, _ in runs], ref=None if label == ref else ref,
                       detail=detail, cachekit=name == BUILD_REF,
                       extra={"anon_mb": anon, "rows": rows}))
    return out


# --- hit path ----------------------------------------------------------------------------

HIT_JOBS = (  # (contestant, label, dtypes)
    ("cachekit", "cachekit", ("object", "str")),
    ("seed", "seed torch.load", ("object",)),
    ("joblib", "joblib.Memory", ("object", "str")),
    ("datasets", "datasets map reload", ("object", "str")),
)


def warm_calls(config: Config, who: str) -> int:
    """Calls after the first in a hit process: none for the seed in a full run (a 130k-row
    torch.load takes seconds, and its first call is the figure)."""
    if not config.fresh_process_per_run:
        return config.repeats - 1
    return 0 if who == "seed" else HIT_WARM_CALLS


def dtype_label(dtype: str) -> str:
    """``object``, or ``str`` with its storage: pandas 3 backs it by pyarrow when installed."""
    if dtype != "str":
        return dtype
    import pandas as pd

    storage = getattr(pd.Series(["a"], dtype="str").dtype, "storage", None)
    return f"str ({storage})" if storage else "str"


def measure_hits(data: Data, config: Config, contestants: set[str]) -> list[Row]:
    """First hit in a fresh process, ``repeats`` processes per contestant and dtype."""
    jobs = [(who, label, dtype) for who, label, dtypes in HIT_JOBS if who in contestants
            for dtype in dtypes]
    stores = {}
    for who, label, dtypes in HIT_JOBS:
        if who in contestants:
            say(f"hit: storing {label}'s payload for {config.hit_rows:,} rows")
            stores[who] = fresh_store(data.work, f"hit-{who}")
            run_worker("fixture", {"contestant": who, "paths_file": str(data.hit),
                                   "store": str(stores[who]), "dtypes": list(dtypes)})
    first: dict[tuple[str, str], list[float]] = {}
    warm: dict[tuple[str, str], list[float]] = {}
    imported: dict[tuple[str, str], list[float]] = {}  # the import, then the first call
    processes, _ = split_repeats(config)
    for rep in range(processes):
        for who, label, dtype in jobs:
            say(f"hit {rep + 1}/{processes}: {label}, {dtype}")
            result = run_worker("hit", {"contestant": who, "paths_file": str(data.hit),
                                        "store": str(stores[who]), "dtypes": [dtype],
                                        "warm": warm_calls(config, who)})
            runs = result["seconds"][dtype]
            imported.setdefault((label, dtype), []).append(result["import_seconds"] + runs[0])
            if config.fresh_process_per_run:  # the headline is the first call of a process
                first.setdefault((label, dtype), []).append(runs[0])
                warm.setdefault((label, dtype), []).extend(runs[1:])
            else:
                first.setdefault((label, dtype), []).extend(runs)
    for store in stores.values():
        shutil.rmtree(store, ignore_errors=True)
    out = []
    for who, label, dtype in jobs:
        shown = dtype_label(dtype)
        name, ref = f"{label}, {shown}", f"cachekit, {shown}"
        extra = {"with_import": statistics.median(imported[label, dtype])}
        details = [f"import and first call: {bench_report.fmt(extra['with_import'], 's')}"]
        warm_runs = warm.get((label, dtype), [])
        if warm_runs:
            details.append("later calls in the same process: "
                           f"{bench_report.fmt(statistics.median(warm_runs), 's')}")
        out.append(Row("hit", name, first[label, dtype], ref=None if name == ref else ref,
                       detail="; ".join(details), cachekit=who == "cachekit", extra=extra))
    return out


# --- agents racing on an empty cache -----------------------------------------------------

AGENT_JOBS = (("cachekit", "cachekit"), ("seed", "seed torch.save dump"),
              ("manager", "seed Manager dict"), ("joblib", "joblib.Memory"))


def _wait_ready(files: Sequence[Path], processes: Sequence[subprocess.Popen]) -> None:
    deadline = time.monotonic() + WORKER_TIMEOUT
    while not all(f.exists() for f in files):
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"agent exited before the start:\n{process.stderr.read()}")
        if time.monotonic() > deadline:
            raise TimeoutError("agents did not get ready")
        time.sleep(0.01)


def _finish(process: subprocess.Popen, what: str) -> dict[str, Any]:
    stdout, stderr = process.communicate(timeout=WORKER_TIMEOUT)
    if process.returncode != 0:
        raise RuntimeError(f"{what} failed ({process.returncode}):\n{stderr[-3000:]}")
    return parse_result(stdout, what)


def race(data: Data, config: Config, who: str) -> dict[str, float]:
    """One race of ``config.agents`` fresh interpreters on an empty cache."""
    race_dir = fresh_store(data.work, f"race-{who}")
    race_dir.mkdir()
    store, start = race_dir / "cache", race_dir / "start"
    paths_file = str(data.covers[config.agents_rows])
    cpu_before = children_cpu()
    if who == "manager":
        arguments = {"paths_file": paths_file, "start_file": str(start),
                     "ready_prefix": str(race_dir / "ready"),
                     "result_prefix": str(race_dir / "result"), "agents": config.agents}
        launcher = subprocess.Popen(worker_command("manager", arguments), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        processes = [launcher]
        ready = [race_dir / f"ready{i}" for i in range(config.agents)]
    else:
        contestant = {"seed": "seed dump"}.get(who, who)
        processes, ready = [], []
        for i in range(config.agents):
            ready.append(race_dir / f"ready{i}")
            arguments = {"contestant": contestant, "paths_file": paths_file,
                         "store": str(store), "ready_file": str(ready[-1]),
                         "start_file": str(start),
                         "torch": config.agents_import_torch or who == "seed"}
            processes.append(subprocess.Popen(worker_command("agent", arguments), text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        _wait_ready(ready, processes)
        started = time.time()
        start.touch()
        results = [_finish(p, f"{who} agent") for p in processes]
    finally:
        for process in processes:  # after a failure, stop the agents still waiting
            if process.poll() is None:
                process.kill()
                process.wait()
    total_cpu = children_cpu() - cpu_before
    if who == "manager":
        agents = results[0]["agents"]
        after_start = (sum(a["cpu"] for a in agents) + results[0]["server_cpu"]
                       + results[0]["launcher_cpu"])
    else:
        agents = results
        after_start = sum(a["cpu"] for a in agents)
    shutil.rmtree(race_dir, ignore_errors=True)
    return {"wall": max(a["ended"] for a in agents) - started, "cpu": total_cpu,
            "cpu_after_start": after_start, "builders": sum(a["built"] for a in agents)}


def measure_agents(data: Data, config: Config, contestants: set[str]) -> list[Row]:
    runs: dict[str, list[dict[str, float]]] = {}
    jobs = [(who, label) for who, label in AGENT_JOBS if who in contestants]
    for rep in range(config.repeats):
        for who, label in jobs:
            say(f"agents rep {rep + 1}/{config.repeats}: {config.agents} x {label}")
            runs.setdefault(label, []).append(race(data, config, who))
    out = []
    for key in ("agents_wall", "agents_cpu"):
        figure = "wall" if key == "agents_wall" else "cpu"
        for label, results in runs.items():
            builders = sorted(r["builders"] for r in results)
            after = sorted(r["cpu_after_start"] for r in results)[len(results) // 2]
            decoded = "/".join(str(b) for b in builders)
            detail = f"agents that decoded: {decoded} of {config.agents}"
            if key == "agents_cpu":
                detail += f"; after the start signal {after:.1f} CPU s"
            out.append(Row(key, label, [r[figure] for r in results],
                           ref=None if label == "cachekit" else "cachekit",
                           detail=detail, cachekit=label == "cachekit",
                           extra={"cpu_after_start": after, "builders": builders[-1]}))
    return out


# --- DataLoader (another module) ---------------------------------------------------------

def measure_dataloader(data: Data, config: Config) -> tuple[list[Row], list[str]]:
    """Rows from ``bench_dataloader.measure(...)``, DataLoader throughput and readers' PSS."""
    import bench_dataloader

    pss_repeats = config.repeats if config.fresh_process_per_run else 1
    seconds = config.dataloader_seconds or bench_dataloader.RUN_SECONDS
    results = bench_dataloader.measure(rows=config.dataloader_rows, repeats=config.repeats,
                                       work=data.work, paths_file=data.covers[config.covers],
                                       pss_repeats=pss_repeats, run_seconds=seconds, log=say)
    rows = [Row(**result) for result in results]
    for row in rows:
        if "PSS" in row.label:  # ratios to the entry size, not items/s: a panel of their own
            row.section = "pss"
        row.cachekit = row.cachekit or row.label.startswith("cachekit")  # variants too
    return rows, []
