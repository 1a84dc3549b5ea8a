"""Run a build's chunks of rows on threads, on processes, or on any concurrent.futures.Executor.

The build engine decides the chunks (which rows, in what order, what is already done); a
:class:`ChunkRunner` only computes them into the output array and says when each chunk is
complete. Three kinds, one contract (:meth:`ChunkRunner.run`):

- ``"threads"``: the rows of a chunk run in a thread pool and are written in place into the
  output memmap; Pillow releases the GIL while it decodes and resizes. One worker runs the
  rows in the calling thread: a pool of one only adds hand-offs.
- ``"processes"``: the builder's own thread and ``workers - 1`` fresh worker interpreters
  this runner owns (:mod:`cachekit.engine.running._workers`): never ``fork`` (the builder has
  threads, whose locks a forked child would inherit mid-use), and, unlike spawn or forkserver pools,
  the workers never re-run the user's main script. Their rows come back as arrays and are copied
  into the output; the builder's own rows are computed in place.
- an Executor instance of the user (a process pool, loky, Dask's ``client.get_executor()``):
  pieces of chunks are submitted to it, their rows come back as arrays and are copied into
  the output here, so the executor's workers need no access to the cache's filesystem.

Work travels as pieces of chunks (:mod:`.pieces`); what runs in a worker, and the runners'
contract, is :mod:`.compute`. This module chooses and makes the runner (:func:`make_runner`)
and checks that a row function can run where it is sent; what ``workers`` and ``executor``
may be is checked in :mod:`.choices`.

The default (``executor=None``) is :func:`default_executor`'s rule; see
docs/build-engine.md for the measurements behind it.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

from ...errors import InvalidArgumentType
from .choices import KINDS, check_executor, check_workers, usable_cpus
from .compute import ChunkRunner, InlineRunner, RowTask
from .pieces import CLUSTER_SIZES, PROCESS_SIZES, THREAD_SIZES, PieceRunner

__all__ = ["ChunkRunner", "KINDS", "PROCESSES_FROM_ROWS", "PROCESSES_FROM_ROWS_WITH_TORCH",
           "RowTask", "check_executor", "check_workers", "default_executor", "make_runner",
           "usable_cpus"]

ExecutorSpec = Union[None, str, Executor]

PROCESSES_FROM_ROWS = 1024
"""The default rule's threshold: builds of at least this many rows, with 2 or more workers,
run on processes. See :func:`default_executor`."""
PROCESSES_FROM_ROWS_WITH_TORCH = 16384
"""The threshold for a row function that imports torch (``imports_torch``: the ``"tensor"``
decoding backend), whose worker interpreters each import torch first."""


def default_executor(workers: int, task: RowTask, rows: Optional[int] = None) -> str:
    """The executor ``executor=None`` stands for: "threads" or "processes".

    Processes when all of: 2 or more workers; at least PROCESSES_FROM_ROWS rows to compute
    (PROCESSES_FROM_ROWS_WITH_TORCH for a row function whose ``imports_torch`` is true;
    ``rows`` None: unknown, so no); and a row function that cachekit's worker processes can
    load (it pickles and needs nothing from the main script). Threads otherwise.

    Why (benchmarks/bench_engine.py and bench_backends.py; the measurements are in
    docs/build-engine.md): part of each image's decode holds the GIL (most of it for small
    images), so Amdahl's law caps threads well below the core count, where processes scale
    with the cores; but a worker process costs CPU to start, which a small build does not
    earn back: threads start at once. With a start cost of s seconds per worker, t seconds
    per row and a GIL share g, processes catch up with threads after about s / (t * g) rows
    whatever the number of cores: about a thousand for Pillow's rows (numpy and Pillow to
    import), over ten thousand for the tensor backend's (torch to import, shorter rows).
    """
    threshold = (PROCESSES_FROM_ROWS_WITH_TORCH if getattr(task.row_fn, "imports_torch", False)
                 else PROCESSES_FROM_ROWS)
    if workers < 2 or rows is None or rows < threshold:
        return "threads"
    try:
        check_picklable(task, "processes")
    except TypeError:
        return "threads"  # a lambda or a function of the main script: threads can run it
    return "processes"


def make_runner(executor: ExecutorSpec, workers: Optional[int], task: RowTask, *,
                rows: Optional[int] = None) -> ChunkRunner:
    """A runner for ``executor``: None (the default rule), "threads", "processes", or a
    concurrent.futures.Executor instance. ``workers`` sizes threads and processes (None:
    the usable CPUs; an Executor instance has its own size). ``rows``: how many rows the
    build will compute, a hint for the default rule.

    Raises TypeError naming the row function when it cannot be pickled for a process or
    cluster executor, before any work starts.
    """
    check_executor(executor)
    workers = check_workers(workers)
    if executor is None:
        executor = default_executor(workers, task, rows)
    if executor == "threads":
        if workers == 1:
            return InlineRunner(task)
        # No caller_runs here: threads start at once, and the builder's thread stays free to
        # record each chunk done as soon as its rows are in.
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachekit")
        return PieceRunner(pool, workers, THREAD_SIZES, task, owned=True, in_place=True,
                            rows=rows)
    if isinstance(executor, ThreadPoolExecutor):  # the user's threads: in process, no pickling
        return PieceRunner(executor, executor_size(executor), THREAD_SIZES, task,
                            owned=False, in_place=True, rows=rows)
    check_picklable(task, executor)
    if executor == "processes":
        if workers == 1:
            return InlineRunner(task)
        from ._workers import WorkerPool

        return PieceRunner(WorkerPool(workers - 1), workers - 1, PROCESS_SIZES, task,
                            owned=True, in_place=False, caller_runs=True, rows=rows)
    return PieceRunner(executor, executor_size(executor), CLUSTER_SIZES, task,
                        owned=False, in_place=False, rows=rows)


def check_picklable(task: RowTask, executor: Any) -> None:
    """TypeError naming the row function when ``task`` cannot be pickled for ``executor``,
    or, for "processes" (whose workers do not run the main script), when it refers to a
    function of the main script."""
    where = executor if isinstance(executor, str) else type(executor).__qualname__
    try:
        pickle.dumps(task)
    except Exception as exc:  # PicklingError, AttributeError ("local object"), TypeError
        raise InvalidArgumentType(
            f"the row function {describe(task.row_fn)} cannot be pickled, so it cannot run "
            f"on the {where} executor ({type(exc).__name__}: {exc}); define it at the top "
            "level of a module (not a lambda, a local function or a closure), or use "
            "executor='threads'") from exc
    if executor == "processes":
        from ._workers import main_references

        names = main_references(task)
        if names:
            raise InvalidArgumentType(
                f"the row function {describe(task.row_fn)} needs {', '.join(names)}, defined "
                "in the main script, which cachekit's worker processes do not run; move it "
                "into an importable module, or pass executor='threads' or your own "
                "concurrent.futures.ProcessPoolExecutor")


def describe(row_fn: Callable[..., Any]) -> str:
    """The name of the user's function behind ``row_fn`` (wrappers set ``__wrapped__``)."""
    fn = getattr(row_fn, "__wrapped__", row_fn)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None)
    if name is None:
        return repr(fn)
    return f"{module}.{name}" if module else name


def executor_size(executor: Executor) -> int:
    """How many tasks ``executor`` runs at once, to size the pieces and the window."""
    client = getattr(executor, "_client", None)  # distributed.cfexecutor.ClientExecutor
    if client is not None and hasattr(client, "nthreads"):
        try:
            return max(1, sum(client.nthreads().values()))
        except Exception:  # a closed or unreachable client: fall back to this host's size
            return usable_cpus()
    size = getattr(executor, "_max_workers", None)  # ProcessPool/ThreadPool, loky
    return size if isinstance(size, int) and size > 0 else usable_cpus()
