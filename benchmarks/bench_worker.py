"""One measured job in a fresh interpreter: ``python bench_worker.py ROLE JSON``.

Every figure is taken in a process of its own, as a sweep agent would be: the imports happen
before the clock starts, the job runs, and the result is printed as one ``RESULT {json}``
line on stdout. Roles:

- ``build``: one cold build of a column by one contestant; seconds, peak RSS, peak anon RSS.
- ``fixture``: make a contestant's stored payload for the hit-path column (not timed).
- ``hit``: time a contestant's hit on that column, ``repeats`` times per dtype.
- ``agent``: one of K agents racing on an empty cache behind a start-file barrier.
- ``manager``: the seed's parent process: a Manager dict and K agents spawned from it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent))  # this checkout's cachekit, whatever else is installed

import bench_peers  # noqa: E402
import bench_seeds  # noqa: E402

RESULT_PREFIX = "RESULT "
POLL_SECONDS = 0.001


# --- measuring ---------------------------------------------------------------------------

def cpu_seconds() -> float:
    """User + system CPU of this process (all its threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU of another live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def max_rss_mb() -> float:
    """Peak resident set of this process since it started (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mb() -> float:
    """Peak resident set of this process since start or the last reset, in MB (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return max_rss_mb()  # not Linux


def reset_peak_rss() -> None:
    """Start a new peak-RSS measurement (Linux >= 4.0: "5" resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class AnonPeak:
    """Samples RssAnon every 5 ms: the process's own memory, without mapped file pages.

    ``ru_maxrss`` also counts page-cache pages of files the process maps, e.g. the output
    memmap while it is written; those are shared and reclaimable, so both are reported.
    """

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
                    return

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._sample()

    def stop_mb(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak_kb / 1024


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


# --- inputs ------------------------------------------------------------------------------

def read_column(paths_file: str, dtype: str = "object"):
    """The image-path column as a pandas Series of ``object`` or ``str`` dtype."""
    import pandas as pd

    with open(paths_file, encoding="utf-8") as f:
        paths = f.read().splitlines()
    return pd.Series(paths, name="img_path", dtype=object if dtype == "object" else "str")


def cachekit_cache(root: str, workers: int = 2, executor: Any = None):
    import cachekit

    return cachekit.Cache(root, workers=workers, executor=executor, progress=False)


# --- roles -------------------------------------------------------------------------------

def _import_for_build(who: str) -> None:
    if who in ("seed", "manager"):
        from torchvision import transforms  # noqa: F401  (imports torch too)
    elif who == "joblib":
        import joblib  # noqa: F401
    elif who == "datasets":
        import datasets  # noqa: F401
    elif who == "cachekit":
        import cachekit  # noqa: F401
    else:
        raise ValueError(f"unknown contestant {who!r}")


def _import_for_hit(who: str) -> None:
    """What a script writes before its first hit: ``import cachekit`` (its modules load on
    first use, in the call), ``import joblib``, ``import datasets``, or torch for the seed's
    ``torch.load``."""
    if who == "seed":
        import torch  # noqa: F401
    else:
        _import_for_build(who)


def _build_once(who: str, column: Any, store: Path, a: dict[str, Any]) -> dict[str, float]:
    """One cold build into the empty ``store``; seconds per timing name."""
    if who == "seed":
        started = time.perf_counter()
        rows = bench_seeds.serial_loop(list(column))
        loop = time.perf_counter() - started
        bench_seeds.dump_save(store, column, rows)
        return {"seed serial": loop, "seed dump": time.perf_counter() - started}
    if who == "manager":
        import multiprocessing

        with multiprocessing.Manager() as manager:  # started before the clock, like the seed
            cache = bench_seeds.ManagerCache(manager.dict())
            return {"seed manager": timed(
                lambda: bench_seeds.serial_loop(list(column), cache))[0]}
    if who == "joblib":
        return {"joblib": timed(lambda: bench_peers.joblib_call(
            store, bench_peers.decode_column, column))[0]}
    if who == "datasets":
        return {"datasets": timed(lambda: bench_peers.datasets_map(
            store / "pixels.arrow", bench_peers.decode_batch, column, a["workers"]))[0]}
    cache = cachekit_cache(str(store), a["workers"])
    elapsed, entry = timed(lambda: cache.images(column, 32, draft=a["draft"]))
    assert not entry.hit and len(entry) == len(column)
    return {"cachekit": elapsed}


def role_build(a: dict[str, Any]) -> dict[str, Any]:
    """``repeats`` cold builds, each into a new store, with the peak memory of each.

    Peak RSS is ``ru_maxrss`` for the first build of the process (the only one in a full
    run); later builds (``--quick``) read the kernel's high-water mark VmHWM after
    resetting it through /proc/self/clear_refs, which ``ru_maxrss`` cannot be.
    """
    who = a["contestant"]
    _import_for_build(who)
    if who == "cachekit":
        # Its default decoder is torch's. A training process has torch loaded, and the
        # seed imports torchvision before its clock too: otherwise a build's first row
        # would time torch's import (a --quick run's one build showed 1.4 images/s).
        # A --quick run imports torch alone, which keeps it off the clock as well.
        if a["torchvision"]:
            from torchvision import transforms  # noqa: F401
        else:
            import torch  # noqa: F401
    column = read_column(a["paths_file"])
    seconds: dict[str, list[float]] = {}
    peaks, anon_peaks = [], []
    for rep in range(a["repeats"]):
        if rep:
            reset_peak_rss()
        anon = AnonPeak()
        for name, value in _build_once(who, column, Path(a["store"]) / f"rep{rep}", a).items():
            seconds.setdefault(name, []).append(value)
        anon_peaks.append(anon.stop_mb())
        peaks.append(max_rss_mb() if rep == 0 else peak_rss_mb())
    return {"seconds": seconds, "max_rss_mb": peaks, "anon_peak_mb": anon_peaks}


def role_fixture(a: dict[str, Any]) -> dict[str, Any]:
    """Store each contestant's payload for the hit column without decoding anything.

    A hit hashes the column and opens what is stored; it never looks at pixels, so the
    payloads are zeros of the real shape and dtype (uint8 for the caches, float32 for the
    seed, as it stores ToTensor output).
    """
    import numpy as np

    store = Path(a["store"])
    who = a["contestant"]
    columns = [read_column(a["paths_file"], dtype) for dtype in a["dtypes"]]
    if who == "seed":
        rows = [np.zeros((3, 32, 32), dtype=np.float32) for _ in range(len(columns[0]))]
        for column in columns:
            if not bench_seeds.dump_path(store, column).exists():
                bench_seeds.dump_save(store, column, rows)
    elif who == "joblib":
        for column in columns:
            bench_peers.joblib_call(store, bench_peers.zeros_column, column)
    elif who == "datasets":
        bench_peers.datasets_map(store / "pixels.arrow", bench_peers.zeros_batch, columns[0])
    elif who == "cachekit":
        import numpy as np
        from cachekit.engine.decoding import images

        images.load_image = lambda *args, **kwargs: np.zeros((3, 32, 32), dtype=np.uint8)
        # threads: the patched load_image above lives in this process only
        keys = {cachekit_cache(a["store"], executor="threads").images(column, 32).key
                for column in columns}
        assert len(keys) == 1, "object and str columns must share one key"
    else:
        raise ValueError(f"unknown contestant {who!r}")
    return {}


def _hit(who: str, store: Path, column: Any) -> tuple[Any, bool]:
    """One hit by ``who`` on ``column``: (what it returns, whether it really was a hit)."""
    if who == "seed":
        rows = bench_seeds.dump_load(store, column)
        return rows, rows is not None and len(rows) == len(column)
    if who == "joblib":
        array = bench_peers.joblib_call(store, bench_peers.zeros_column, column)
        return array, bench_peers.computed == 0 and len(array) == len(column)
    if who == "datasets":
        dataset = bench_peers.datasets_map(store / "pixels.arrow", bench_peers.zeros_batch,
                                           column)
        shards = [Path(f["filename"]).parent for f in dataset.cache_files]
        return dataset, len(dataset) == len(column) and set(shards) == {store}
    if who == "cachekit":
        entry = cachekit_cache(str(store)).images(column, 32)
        return entry, entry.hit and len(entry) == len(column)
    raise ValueError(f"unknown contestant {who!r}")


def role_hit(a: dict[str, Any]) -> dict[str, Any]:
    """Time ``1 + warm`` hits per dtype, each with fresh objects, checking each is a hit.

    The first call is what a sweep agent pays (it asks once per process, lazy
    initialisation included); the warm calls show the steady cost. ``import_seconds``: the
    contestant's import before it (pandas already loaded), which a library that imports
    its machinery up front pays there and a lazy one in its first call.
    """
    who = a["contestant"]
    import pandas  # noqa: F401  (every contestant's column: not timed)

    import_seconds, _ = timed(lambda: _import_for_hit(who))
    results: dict[str, list[float]] = {}
    for dtype in a["dtypes"]:
        column = read_column(a["paths_file"], dtype)
        runs = []
        for _ in range(1 + a["warm"]):
            elapsed, (value, was_hit) = timed(lambda: _hit(who, Path(a["store"]), column))
            assert was_hit, f"{who}, {dtype} column: not a hit"
            del value
            runs.append(elapsed)
        results[dtype] = runs
    return {"seconds": results, "import_seconds": import_seconds}


def _wait_for_start(ready_file: str, start_file: str) -> None:
    Path(ready_file).touch()
    while not os.path.exists(start_file):
        time.sleep(POLL_SECONDS)


def _agent_prelude(with_torch: bool) -> None:
    """What every agent imports before the race (a training agent has torch loaded anyway;
    ``--quick`` leaves torch out where the contestant does not need it, to save time)."""
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    from PIL import Image  # noqa: F401

    if with_torch:
        import torch  # noqa: F401


def role_agent(a: dict[str, Any]) -> dict[str, Any]:
    _agent_prelude(a["torch"])
    who = a["contestant"]
    if who == "seed dump":
        from torchvision import transforms  # noqa: F401
    elif who == "joblib":
        import joblib  # noqa: F401
    elif who == "cachekit":
        import cachekit  # noqa: F401
    column = read_column(a["paths_file"])
    _wait_for_start(a["ready_file"], a["start_file"])
    cpu_before, started = cpu_seconds(), time.time()
    if who == "seed dump":
        _, built = bench_seeds.dump_obtain(Path(a["store"]), column)
    elif who == "joblib":
        bench_peers.joblib_call(Path(a["store"]), bench_peers.decode_column, column)
        built = bench_peers.computed > 0
    elif who == "cachekit":
        built = not cachekit_cache(a["store"]).images(column, 32).hit
    else:
        raise ValueError(f"unknown contestant {who!r}")
    return {"cpu": cpu_seconds() - cpu_before, "started": started, "ended": time.time(),
            "built": bool(built)}


def manager_agent(shared: Any, a: dict[str, Any], index: int) -> None:
    """One agent of the seed's Manager approach, spawned (a fresh interpreter) by the parent."""
    _agent_prelude(True)
    from torchvision import transforms  # noqa: F401

    column = read_column(a["paths_file"])
    _wait_for_start(f"{a['ready_prefix']}{index}", a["start_file"])
    cpu_before, started = cpu_seconds(), time.time()
    cache = bench_seeds.ManagerCache(shared)
    bench_seeds.serial_loop(list(column), cache)
    result = {"cpu": cpu_seconds() - cpu_before, "started": started, "ended": time.time(),
              "built": cache.decodes > 0, "decodes": cache.decodes}
    Path(f"{a['result_prefix']}{index}").write_text(json.dumps(result))


def role_manager(a: dict[str, Any]) -> dict[str, Any]:
    """The seed's launcher: one Manager dict, ``agents`` spawned processes sharing it."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        shared = manager.dict()
        server_pid = manager._process.pid  # no public accessor for the server process
        processes = [context.Process(target=manager_agent, args=(shared, a, i))
                     for i in range(a["agents"])]
        for process in processes:
            process.start()
        while not os.path.exists(a["start_file"]):
            time.sleep(POLL_SECONDS)
        server_before, own_before = proc_cpu_seconds(server_pid), cpu_seconds()
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"manager agent exited with {process.exitcode}")
        server_cpu = proc_cpu_seconds(server_pid) - server_before
        own_cpu = cpu_seconds() - own_before
    agents = [json.loads(Path(f"{a['result_prefix']}{i}").read_text())
              for i in range(a["agents"])]
    return {"agents": agents, "server_cpu": server_cpu, "launcher_cpu": own_cpu}


ROLES = {"build": role_build, "fixture": role_fixture, "hit": role_hit, "agent": role_agent,
         "manager": role_manager}


def main(argv: list[str]) -> None:
    role, arguments = argv[0], json.loads(argv[1])
    result = ROLES[role](arguments)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
