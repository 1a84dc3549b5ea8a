"""The cores a joiner brings to a build of its own host: a builder and the joiners on its host
share one budget of CPUs.

A builder that runs as many workers as it has usable CPUs keeps all of them busy; a joiner
on the same host that runs on those CPUs adds only contention, claims and polling, and the
build ends no sooner. So a joiner on the builder's host joins with the cores the build
leaves free (:func:`spare_cores`): its own CPUs outside the builder's affinity set, and the
builder's CPUs that the builder's workers leave idle. For each core it uses it takes a seat
in the build's journal folder (:class:`Seats`), so that the joiners after it count it; with
no core left, it only waits. A joiner on another host brings cores of its own: it joins
with its own workers and takes no seat.

The budget counts cachekit's processes only, not what else runs on the host, and cores,
not which core runs what: the kernel's scheduler places the threads.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import AbstractSet, Any, Optional

from ... import _fs, processes, small_json
from ..running.executors import executor_size

SEAT_PREFIX = "seat."
"""A seat in a journal folder: ``seat.cpu.C`` (CPU C, outside the builder's set) or
``seat.idle.I`` (the I-th core the builder leaves idle), created once by the joiner that
uses it, holding its owner, removed when it stops joining."""


@dataclass(frozen=True)
class Spare:
    """The cores a joiner on the builder's host may add to its build: ``cpus``, the joiner's
    CPUs that the builder may not run on; ``idle``, how many of the builder's CPUs left idle
    by its workers the joiner may run on; ``idle_seats``, how many the builder leaves idle in
    all (the seats for them are shared by every joiner)."""

    cpus: tuple[int, ...]
    idle: int
    idle_seats: int

    @property
    def count(self) -> int:
        return len(self.cpus) + self.idle


def spare_cores(builder_cpus: AbstractSet[int], builder_workers: int,
                own: Optional[AbstractSet[int]] = None) -> Spare:
    """What a joiner whose affinity set is ``own`` (None: this process's) may add to a build
    whose builder runs ``builder_workers`` rows at once on ``builder_cpus``, before counting
    the seats other joiners hold."""
    own = _fs.cpu_affinity() if own is None else own
    idle = max(0, len(builder_cpus) - builder_workers)
    return Spare(tuple(sorted(set(own) - set(builder_cpus))),
                 min(idle, len(set(own) & set(builder_cpus))), idle)


def runs_at_once(executor: Any, workers: int) -> int:
    """How many rows a build runs at once: ``workers`` on cachekit's threads or processes,
    the pool's size on an Executor instance (a cluster's too: a joiner here would send its
    rows to the same pool)."""
    return executor_size(executor) if isinstance(executor, Executor) else workers


class Seats:
    """The seats one joiner holds in a build's journal folder ``folder``."""

    def __init__(self, folder: _fs.DirHandle, names: list[str]) -> None:
        self.folder, self.names = folder, names

    @classmethod
    def take(cls, folder: _fs.DirHandle, free: Spare, most: int) -> "Seats":
        """Take up to ``most`` of the seats ``free`` offers that no live joiner holds: its
        own CPUs first, then the builder's idle cores. Seats of joiners that died (on this
        host, so their pids tell) are taken over."""
        own = [f"{SEAT_PREFIX}cpu.{cpu}" for cpu in free.cpus]
        idle = [f"{SEAT_PREFIX}idle.{i}" for i in range(free.idle_seats)]
        seats = cls(folder, [])
        try:
            taken_idle = 0
            for name in own + idle:
                if len(seats.names) >= most:
                    break
                if name in idle and taken_idle >= free.idle:
                    break
                if seats._sit(name):
                    seats.names.append(name)
                    taken_idle += name in idle
        except BaseException:
            seats.release()
            raise
        return seats

    def _sit(self, name: str) -> bool:
        """Create seat ``name``, or take it over from a dead owner; False when a live
        joiner (or one that cannot be judged) holds it. (Two joiners taking one dead seat
        over at once may both sit: one core too many, for the rest of the build at most.)"""
        for _ in range(2):
            try:
                fd = self.folder.create(name)
            except FileExistsError:
                if not self._owner_dead(name):
                    return False
                self.folder.unlink(name)
                continue
            try:
                os.write(fd, json.dumps(processes.owner()).encode())
            finally:
                os.close(fd)
            return True
        return False

    def _owner_dead(self, name: str) -> bool:
        try:
            with self.folder.open_file(name) as f:
                owner = small_json.read_dict(f, 4096)
        except FileNotFoundError:
            return True  # released since: take it
        except OSError:
            return False
        # None: being written right now, or damaged: leave it
        return owner is not None and processes.owner_state(owner) == "dead"

    def release(self) -> None:
        """Give every seat up (idempotent)."""
        for name in self.names:
            self.folder.unlink(name)
        self.names = []
