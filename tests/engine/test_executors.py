"""cachekit.engine.running.executors: every executor gives the same bytes and key, errors cross
processes.

Processes are real: cachekit's own worker interpreters, a ProcessPoolExecutor, and a Dask
LocalCluster with worker processes on loopback. The row functions used with processes are
module-level (workers import this module by name), and count their calls in files, since a
worker's globals are not the test's.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

import cachekit
from cachekit.engine.running import executors, pieces
from cachekit.errors import ImageDecodeError, NotAnArrayError
from cachekit.engine.running.executors import RowTask, make_runner

SIZE = (12, 10)


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    stop: int


def chunks_of(n: int, size: int) -> list[Chunk]:
    return [Chunk(i, start, min(start + size, n)) for i, start in enumerate(range(0, n, size))]


# --- module-level row functions (picklable by reference) ----------------------------------

class RowError(Exception):
    """A user's own exception type: it must come back from a worker as itself."""


def square_row(value: int) -> np.ndarray:
    if value < 0:
        raise RowError(f"negative {value}")
    return np.array([value, value * value], dtype=np.int64)


def talkative_row(value: int) -> np.ndarray:
    print(f"row {value}")  # a worker's stdout must not corrupt its result channel
    return np.array([value], dtype=np.int64)


def not_an_array_row(value: int) -> list:
    return [value]


def wrong_shape_row(value: int) -> np.ndarray:
    return np.zeros(3 if value == 5 else 2, dtype=np.int64)


def dying_row(value: int) -> np.ndarray:
    if value == 3:
        os._exit(7)  # a worker killed mid-chunk
    return np.array([value], dtype=np.int64)


@dataclass(frozen=True)
class CountedRow:
    """Appends each value to a file, so decodes are counted across processes."""

    log: str

    def __call__(self, value: int) -> np.ndarray:
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {value}\n")
        return np.array([value], dtype=np.int64)


def pid_row(value: int) -> np.ndarray:
    """Logs the process that computed each row to $PID_LOG (workers inherit it)."""
    with open(os.environ["PID_LOG"], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {value}\n")
    return np.array([value], dtype=np.int64)


def pids(log: Path) -> set[int]:
    return {int(line.split()[0]) for line in log.read_text(encoding="utf-8").splitlines()}


def counted(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [int(line.split()[1]) for line in log.read_text(encoding="utf-8").splitlines()]


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dask_executor() -> Iterator[Executor]:
    """``client.get_executor()`` of a LocalCluster: 2 worker processes on 127.0.0.1."""
    distributed = pytest.importorskip("distributed")
    # dashboard_address=None would still bind the dashboard on 0.0.0.0:8787, and warn (an
    # error here) when another cluster on this machine holds that port: a free loopback port.
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       host="127.0.0.1", dashboard_address="127.0.0.1:0")
    client = distributed.Client(cluster)
    try:
        yield client.get_executor()
    finally:
        client.close()
        cluster.close()


@pytest.fixture(scope="module")
def process_pool() -> Iterator[ProcessPoolExecutor]:
    import multiprocessing

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _executor(kind: str, request: pytest.FixtureRequest):
    if kind == "pool":
        return request.getfixturevalue("process_pool")
    if kind == "dask":
        return request.getfixturevalue("dask_executor")
    return kind


KINDS = ["threads", "processes", "pool", "dask"]


# --- same bytes, same key ----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_every_executor_gives_the_same_bytes_and_key(tmp_path, cover_paths, kind, request):
    column = pd.Series(cover_paths, name="img_path")
    reference = cachekit.Cache(tmp_path / "ref", workers=1, executor="threads",
                               progress=False).images(column, SIZE)
    cache = cachekit.Cache(tmp_path / "cache", workers=2, executor=_executor(kind, request),
                           progress=False)
    entry = cache.images(column, SIZE)
    assert entry.source == "built"
    assert entry.key == reference.key
    assert entry.array.tobytes() == reference.array.tobytes()
    assert entry.array[:, 0].std() > 0  # real pixels, not zeros
    again = cachekit.Cache(tmp_path / "cache", executor="threads", progress=False)
    assert again.images(column, SIZE).hit  # the executor is not part of the key


@pytest.mark.parametrize("kind", KINDS)
def test_map_rows_of_every_executor_agree(tmp_path, kind, request):
    values = pd.Series(range(50))
    cache = cachekit.Cache(tmp_path / kind, workers=2, executor=_executor(kind, request),
                           progress=False)
    entry = cache.map(square_row, values)
    np.testing.assert_array_equal(entry.array, np.stack([square_row(v) for v in range(50)]))


@pytest.mark.parametrize("kind", ["threads", "processes"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize(("n", "chunk"), [(0, 4), (1, 4), (17, 4), (40, 40), (33, 1)])
def test_runner_fills_every_chunk_once(tmp_path, kind, workers, n, chunk):
    log = tmp_path / "log"
    out = np.lib.format.open_memmap(tmp_path / "out.npy", "w+", np.int64, (n, 1))
    plan = chunks_of(n, chunk)
    with make_runner(kind, workers, RowTask(CountedRow(str(log)), False)) as runner:
        seen = [c for c, failures in runner.run(plan, np.arange(n, dtype=object), out)
                if not failures]
    assert sorted(seen, key=lambda c: c.index) == plan
    assert sorted(counted(log)) == list(range(n))  # every row computed exactly once
    np.testing.assert_array_equal(out[:, 0], np.arange(n))


def test_thread_runner_yields_each_chunk_when_its_rows_are_in(tmp_path):
    out = np.zeros((20, 2), np.int64)
    with make_runner("threads", 3, RowTask(square_row, False)) as runner:
        for chunk, _ in runner.run(chunks_of(20, 6), np.arange(20, dtype=object), out):
            rows = np.arange(chunk.start, chunk.stop)
            np.testing.assert_array_equal(out[chunk.start:chunk.stop, 1], rows * rows)


def test_a_users_thread_pool_is_used_and_left_running(tmp_path):
    out = np.zeros((9, 2), np.int64)
    with ThreadPoolExecutor(2) as pool:
        runner = make_runner(pool, 1, RowTask(square_row, False))
        list(runner.run(chunks_of(9, 4), np.arange(9, dtype=object), out))
        runner.close()
        assert pool.submit(int, "5").result() == 5  # not shut down by the runner
    assert out[:, 1].tolist() == [v * v for v in range(9)]


# --- pickling -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["processes", "pool", "dask"])
def test_an_unpicklable_map_function_is_a_type_error_before_any_row(tmp_path, kind, request):
    calls = []

    def local_row(value):  # a closure: cannot be pickled
        calls.append(value)
        return np.zeros(2)

    cache = cachekit.Cache(tmp_path, workers=2, executor=_executor(kind, request),
                           progress=False)
    for fn, name in ((lambda v: calls.append(v) or np.zeros(2), "<lambda>"),
                     (local_row, "local_row")):
        with pytest.raises(TypeError, match=f"row function .*{name}.* cannot be pickled"):
            cache.map(fn, pd.Series(range(5)))
    assert calls == []  # nothing ran, not even the first row that fixes the shape
    assert cache.entries() == []


def test_threads_need_no_pickling(tmp_path):
    entry = cachekit.Cache(tmp_path, workers=2, executor="threads", progress=False).map(
        lambda v: np.full(2, v), pd.Series(range(5)))
    assert entry.array[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_the_images_row_function_pickles():
    from cachekit.engine.running.rows import ImageRow

    row = ImageRow((8, 8), "L", "crop", "bicubic", True)
    assert pickle.loads(pickle.dumps(row)) == row


MAIN_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, pandas as pd
    import cachekit

    def row(value):
        return np.zeros(2)

    if __name__ == "__main__":
        cache = cachekit.Cache(sys.argv[1], executor="processes", workers=2, progress=False)
        try:
            cache.map(row, pd.Series(range(4)))
        except TypeError as e:
            print(e)
        else:
            print("no error")
""")


def test_a_function_of_the_main_script_is_refused_for_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "__main__.row" in done.stdout and "importable module" in done.stdout


# --- failures and errors from processes ---------------------------------------------------

@pytest.mark.parametrize("kind", ["processes", "pool", "dask"])
def test_decode_failures_are_gathered_from_worker_processes(tmp_path, cover_paths, kind,
                                                           request):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    paths = list(cover_paths)
    paths[2], paths[9] = str(broken), str(tmp_path / "missing.jpg")
    cache = cachekit.Cache(tmp_path / "cache", workers=2, executor=_executor(kind, request),
                           progress=False)
    # pil: the workers need not import torch to fail (gathering failures is common code;
    # test_tensor_backend runs the tensor backend in worker processes)
    with pytest.raises(ImageDecodeError) as info:
        cache.images(pd.Series(paths), SIZE, backend="pil")
    assert [row for row, _, _ in info.value.failures] == [2, 9]
    assert "missing.jpg" in info.value.failures[1][1]
    entry = cache.images(pd.Series(paths), SIZE, on_error="zero", backend="pil")
    assert entry.valid.tolist() == [i not in (2, 9) for i in range(len(paths))]
    assert not entry.array[[2, 9]].any() and entry.array[[0, 11]].any()


@pytest.mark.parametrize("kind", ["processes", "pool"])
def test_a_row_exception_comes_back_unchanged(tmp_path, kind, request):
    cache = cachekit.Cache(tmp_path, workers=2, executor=_executor(kind, request),
                           progress=False)
    with pytest.raises(RowError, match="negative -3"):
        cache.map(square_row, pd.Series([1, 2, -3, 4]))
    zeroed = cache.map(square_row, pd.Series([1, 2, -3, 4]), on_error="zero")
    assert zeroed.valid.tolist() == [True, True, False, True]
    with pytest.raises(NotAnArrayError):  # a bug in the function: never a zeroed row
        cache.map(not_an_array_row, pd.Series([1, 2]), on_error="zero")


def test_a_row_of_another_shape_names_the_row(tmp_path):
    out = np.zeros((8, 2), np.int64)
    with make_runner("processes", 2, RowTask(wrong_shape_row, True)) as runner:
        with pytest.raises(ValueError, match="row 5 gave shape"):
            list(runner.run(chunks_of(8, 8), np.arange(8, dtype=object), out))


def test_worker_output_does_not_disturb_results(tmp_path, capfd):
    out = np.zeros((6, 1), np.int64)
    with make_runner("processes", 2, RowTask(talkative_row, False)) as runner:
        list(runner.run(chunks_of(6, 3), np.arange(6, dtype=object), out))
    assert out[:, 0].tolist() == list(range(6))
    assert "row 4" in capfd.readouterr().err


def test_a_dead_worker_breaks_the_build_instead_of_hanging(tmp_path):
    out = np.zeros((8, 1), np.int64)
    with make_runner("processes", 2, RowTask(dying_row, True)) as runner:
        with pytest.raises(BrokenProcessPool, match="exited with code 7"):
            list(runner.run(chunks_of(8, 2), np.arange(8, dtype=object), out))


def test_an_error_keeps_the_chunks_finished_before_it(tmp_path):
    """Every chunk whose rows were all computed before the error is still yielded, with its
    rows in place: a resume keeps them, and no finished work is lost."""
    out = np.zeros((24, 2), np.int64)
    values = np.array([*range(17), -17, *range(18, 24)], dtype=object)
    computed = []

    def recording_row(value):
        computed.append(value)
        return square_row(value)

    for workers in (2, 3):
        out[:] = 0
        computed.clear()
        seen = []
        with make_runner("threads", workers, RowTask(recording_row, False)) as runner:
            with pytest.raises(RowError):
                for chunk, _ in runner.run(chunks_of(24, 4), values, out):
                    seen.append(chunk)
        finished = {i // 4 for i in range(24) if i in computed}
        finished = {c for c in finished if all(r in computed for r in range(4 * c, 4 * c + 4))}
        assert {c.index for c in seen} == finished - {4}
        for chunk in seen:
            rows = np.arange(chunk.start, chunk.stop)
            assert out[chunk.start:chunk.stop].tolist() == [[r, r * r] for r in rows]


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=10),
       bad=st.sets(st.integers(0, 299), max_size=12), smallest=st.integers(1, 40),
       helpers=st.integers(1, 3), in_place=st.booleans(), caller_runs=st.booleans(),
       hint=st.booleans(), span=st.booleans())
def test_pieces_cut_across_chunks_put_every_row_in_its_place_once(
        sizes, bad, smallest, helpers, in_place, caller_runs, hint, span):
    """However pieces are cut (parts of a chunk, or several chunks, of a share of the rows
    left), every row is computed once into its place, and each chunk is reported once, with
    exactly its own failures, after all its rows are in."""
    bounds = np.cumsum([0, *sizes]).tolist()
    chunks = [Chunk(i, bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    n = bounds[-1]
    values = np.array([-(i + 1) if i in bad else i + 1 for i in range(n)], dtype=object)
    computed = []
    out = np.full((n, 2), 7, np.int64)

    def row(value):
        computed.append(value)
        return square_row(value)

    reported = []
    with ThreadPoolExecutor(helpers) as pool:
        runner = pieces.PieceRunner(
            pool, helpers, pieces.Sizes(smallest, 48, span), RowTask(row, True), owned=False,
            in_place=in_place, caller_runs=caller_runs, rows=n if hint else None)

        def rows_in_place(chunk):
            return all(out[r].tolist() == ([0, 0] if r in bad else [r + 1, (r + 1) ** 2])
                       for r in range(chunk.start, chunk.stop))

        for chunk, failures in runner.run(chunks, values, out):
            assert rows_in_place(chunk)
            reported.append(chunk.index)
            assert [f[0] for f in failures] == [r for r in range(chunk.start, chunk.stop)
                                                if r in bad]
    assert sorted(reported) == list(range(len(chunks)))
    assert sorted(computed) == sorted(values.tolist())


def test_with_processes_the_builder_is_one_of_the_workers(tmp_path, monkeypatch):
    """workers=2 on processes: the builder computes rows itself beside one worker process,
    so the pool's start-up is not waited for; workers=1 starts no process at all."""
    monkeypatch.setenv("PID_LOG", str(tmp_path / "two.log"))
    out = np.zeros((400, 1), np.int64)
    with make_runner("processes", 2, RowTask(pid_row, False), rows=400) as runner:
        done = sorted(c.index for c, _ in runner.run(chunks_of(400, 16), np.arange(400), out))
    assert done == list(range(25)) and out[:, 0].tolist() == list(range(400))
    two = pids(tmp_path / "two.log")
    assert os.getpid() in two and len(two) == 2
    monkeypatch.setenv("PID_LOG", str(tmp_path / "one.log"))
    with make_runner("processes", 1, RowTask(pid_row, False), rows=400) as runner:
        list(runner.run(chunks_of(400, 16), np.arange(400), out))
    assert pids(tmp_path / "one.log") == {os.getpid()}


# --- validation ---------------------------------------------------------------------------

def test_cache_validates_the_executor(tmp_path):
    for bad in ("thread", "dask", ""):
        with pytest.raises(ValueError, match="executor must be"):
            cachekit.Cache(tmp_path, executor=bad)
    for bad in (3, ThreadPoolExecutor, object()):
        with pytest.raises(TypeError, match="executor must be"):
            cachekit.Cache(tmp_path, executor=bad)
    with ThreadPoolExecutor(1) as pool:
        assert cachekit.Cache(tmp_path, executor=pool).executor is pool
    assert cachekit.Cache(tmp_path).executor is None


def test_the_cache_and_the_runner_validate_workers_by_one_rule(tmp_path):
    """None means the usable CPUs, for a Cache and for a runner alike; anything but None or
    an int >= 1 is refused by both with the same words."""
    assert cachekit.Cache(tmp_path).workers == executors.usable_cpus()
    assert cachekit.Cache(tmp_path, workers=3).workers == 3
    task = RowTask(square_row, False)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"workers must be None or an int >= 1") as cache:
            cachekit.Cache(tmp_path, workers=bad)
        with pytest.raises(ValueError) as runner:
            make_runner("threads", bad, task)
        assert str(runner.value) == str(cache.value)
    out = np.zeros((4, 2), np.int64)
    with make_runner("threads", None, task) as runner_of_cpus:
        list(runner_of_cpus.run(chunks_of(4, 2), np.arange(4), out))
    assert out[:, 1].tolist() == [0, 1, 4, 9]


def test_the_default_rule():
    big = executors.PROCESSES_FROM_ROWS
    task = RowTask(square_row, False)
    assert executors.default_executor(2, task, big) == "processes"
    assert executors.default_executor(64, task, 10 * big) == "processes"
    assert executors.default_executor(1, task, 10 * big) == "threads"  # one worker
    assert executors.default_executor(8, task, big - 1) == "threads"  # start-up not earned
    assert executors.default_executor(8, task, None) == "threads"  # size unknown
    unpicklable = RowTask(lambda v: v, False)
    assert executors.default_executor(8, unpicklable, 10 * big) == "threads"


def test_a_large_default_build_runs_on_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(executors, "PROCESSES_FROM_ROWS", 40)
    monkeypatch.setenv("PID_LOG", str(tmp_path / "big.log"))
    entry = cachekit.Cache(tmp_path / "cache", workers=2, progress=False).map(
        pid_row, pd.Series(range(60)))
    assert entry.array[:, 0].tolist() == list(range(60))
    # The first row (it fixes the row shape) here, the rest in worker processes.
    assert os.getpid() in pids(tmp_path / "big.log") and len(pids(tmp_path / "big.log")) >= 2
    monkeypatch.setenv("PID_LOG", str(tmp_path / "small.log"))
    cachekit.Cache(tmp_path / "cache", workers=2, progress=False).map(
        pid_row, pd.Series(range(100, 130)))  # rows of their own: none to copy from the first
    assert pids(tmp_path / "small.log") == {os.getpid()}  # a small build stays on threads


def test_cli_build_takes_an_executor(tmp_path, cover_paths):
    csv = tmp_path / "covers.csv"
    pd.DataFrame({"img_path": cover_paths}).to_csv(csv, index=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    keys = []
    for kind in ("threads", "processes"):  # pil: neither the CLI nor its workers import torch
        done = subprocess.run([sys.executable, "-m", "cachekit", "--root", str(tmp_path / kind),
                               "build", str(csv), "--column", "img_path", "--size", "8x8",
                               "--executor", kind, "--workers", "2", "--backend", "pil"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        keys.append(cachekit.Cache(tmp_path / kind).entries()[0].key)
    assert keys[0] == keys[1]
    done = subprocess.run([sys.executable, "-m", "cachekit", "build", str(csv), "--column",
                           "img_path", "--size", "8", "--executor", "cluster"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "--executor" in done.stderr
