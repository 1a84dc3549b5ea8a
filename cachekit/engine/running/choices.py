"""What a cache's ``workers`` and ``executor`` may be, checked when a :class:`~cachekit.Cache`
is made: apart from :mod:`.executors`, which makes the runners, so that a process that only
hits its entries never imports the machinery that builds them.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

from ... import _fs
from ...errors import InvalidArgument, InvalidArgumentType

KINDS = ("threads", "processes")
"""The executors named by a string."""


def usable_cpus() -> int:
    """How many CPUs this process may run on (:func:`cachekit._fs.cpu_affinity`)."""
    return len(_fs.cpu_affinity())


def check_workers(workers: Any) -> int:
    """How many rows a build runs at once for ``workers``: the number itself, or the usable
    CPUs for None; ValueError for anything else."""
    if workers is None:
        return usable_cpus()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgument(f"workers must be None or an int >= 1, not {workers!r}")
    return workers


def check_executor(executor: Any) -> None:
    """ValueError for an unknown executor name, TypeError for anything else unusable."""
    if executor is None or isinstance(executor, Executor):
        return
    if isinstance(executor, str):
        if executor not in KINDS:
            raise InvalidArgument(f"executor must be None, 'threads', 'processes' or a "
                                  f"concurrent.futures.Executor; got {executor!r}")
        return
    raise InvalidArgumentType(f"executor must be None, 'threads', 'processes' or a "
                              f"concurrent.futures.Executor (a ProcessPoolExecutor, loky, dask's "
                              f"client.get_executor()); got {type(executor).__qualname__}")
