"""A pool of clean worker processes: the ``executor="processes"`` of
cachekit.engine.running.executors.

Why not ``ProcessPoolExecutor``: with spawn or forkserver (fork is ruled out, the builder has
threads) every worker first re-runs the user's main script as ``__mp_main__``. A training script
imports torch at the top, so each pool paid seconds before its first row (docs/build-engine.md), and
a script without an ``if __name__ == "__main__":`` guard would run its own training, or its own
``cache.images`` call, in every worker. These workers are fresh interpreters that import only their
loop (:mod:`cachekit.engine.running._worker_main`) and what the pickled task names (a fraction of a
second of CPU), and never the main script; a function defined in the main script therefore cannot
run here, which :func:`main_references` lets the caller say before any work starts.

The worker's loop is :mod:`cachekit.engine.running._worker_main`: length-prefixed pickles over its
stdin and stdout. The worker's own stdout is moved to stderr, so a print in a row function cannot
corrupt the channel, and it exits when its stdin closes, so it never outlives the builder.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import types
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from ._worker_main import receive_bytes, send

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                       "MKL_NUM_THREADS")}
"""Each worker is one of many processes: its numpy (and a map function's torch) runs one
thread, as DataLoader workers do, unless the user's environment says otherwise. Without it,
numpy's OpenBLAS starts a thread per core at import, more CPU per worker for nothing
(docs/build-engine.md)."""
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from cachekit.engine.running._worker_main import serve; serve()")


class WorkerPool(Executor):
    """``workers`` fresh interpreters; each runs one submitted call at a time."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shutdown = False
        self._broken: Optional[str] = None
        self._processes: list[subprocess.Popen] = []
        self._threads = [threading.Thread(target=self._feed, name=f"cachekit-worker-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._broken is not None:
                raise BrokenProcessPool(self._broken)
            if self._shutdown:
                raise RuntimeError("cannot submit to a WorkerPool after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                if cancel_futures:
                    self._cancel_queued()
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    def _cancel_queued(self) -> None:
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                pending.append(item)
            elif item[0].cancel():
                item[0].set_running_or_notify_cancel()  # what tells wait() it is over
        for item in pending:
            self._queue.put(item)

    def _feed(self) -> None:
        """One worker process: start it at once (it boots while the builder plans and
        computes), then hand it calls one by one until the sentinel."""
        process = None
        try:
            try:
                process = self._start()
            except Exception:  # noqa: S110 - tried again for the first call, which gets the error
                pass
            while True:
                item = self._queue.get()
                if item is None:
                    return
                future, fn, args, kwargs = item
                if not future.set_running_or_notify_cancel():
                    continue
                if self._broken is not None:
                    future.set_exception(BrokenProcessPool(self._broken))
                    continue
                try:
                    if process is None:
                        process = self._start()
                    ok, value = _call(process, (fn, args, kwargs))
                except BrokenProcessPool as died:
                    self._break(str(died))
                    future.set_exception(died)
                    continue
                except BaseException as exc:  # noqa: B036 - our side failed to send it
                    future.set_exception(exc)
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        finally:
            if process is not None:
                _stop(process)

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", _BOOT, _PACKAGE_PARENT],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env={**_ONE_THREAD, **os.environ})
        with self._lock:
            self._processes.append(process)
        send(process.stdin, list(sys.path))  # the builder's imports resolve the same way
        return process

    def _break(self, why: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = why
            self._cancel_queued()


def _call(process: subprocess.Popen, message: Any) -> tuple[bool, Any]:
    try:
        send(process.stdin, message)
        return _receive(process.stdout)
    except (EOFError, BrokenPipeError, struct.error) as exc:
        code = process.wait()
        raise BrokenProcessPool(f"a cachekit worker process exited with code {code} while "
                          f"computing rows ({type(exc).__name__}); see its stderr above") from None


def _stop(process: subprocess.Popen) -> None:
    try:
        process.stdin.close()  # the worker exits at end of input
    except OSError:
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()


def _receive(stream: BinaryIO) -> Any:
    return pickle.loads(receive_bytes(stream))


def main_references(obj: Any) -> list[str]:
    """Names of the main script's globals that pickling ``obj`` refers to: a worker that does
    not run the main script cannot load them."""
    found: list[str] = []

    class Finder(pickle._Pickler):  # the Python pickler: each object it saves is seen
        def save(self, obj: Any, save_persistent_id: bool = True) -> None:
            if (isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))
                    and getattr(obj, "__module__", None) == "__main__"):
                found.append(f"__main__.{getattr(obj, '__qualname__', obj)}")
            super().save(obj, save_persistent_id)

    Finder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return found
