"""How a fill shows its progress: a tqdm bar on a terminal, and where stderr is not one (a
job under nohup or Slurm, an agent whose output goes to a file) plain lines instead: one
when the build starts, one every :data:`LINE_SECONDS` with the rows done, the rate and the
time left, and one when it ends, as a waiting process reports its wait."""

from __future__ import annotations

import time
from typing import Any

from ...messages import say
from ...units import count
from .claimed import Report

LINE_SECONDS = 10.0
"""Seconds between two progress lines of a build whose stderr is not a terminal."""


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines:
    """Progress as lines on stderr (``cachekit[pid N]: ...``), at most one per
    :data:`LINE_SECONDS` between the first and the last."""

    def __init__(self, total: int, description: str) -> None:
        self.total, self.description = total, description
        self.done = 0
        self.started = time.monotonic()
        self.next_line = self.started + LINE_SECONDS
        say(f"{description}: filling {count(total, 'row')}")

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self.next_line and self.done < self.total:
            rate = self.done / max(now - self.started, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            say(f"{self.description}: {self.done} of {self.total} rows "
                f"({100 * self.done / max(1, self.total):.0f}%), {rate:.0f} rows/s, "
                f"about {left:.0f} s left")
            self.next_line = now + LINE_SECONDS

    def close(self) -> None:
        seconds = time.monotonic() - self.started
        say(f"{self.description}: {count(self.done, 'row')} filled in {seconds:.1f} s")


def progress(total: int, report: Report) -> Any:
    """What a fill of ``total`` rows updates as rows are done and closes at the end: a bar
    (``report.progress``), lines (``report.lines``), or nothing."""
    if report.progress:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=report.description, unit="img", dynamic_ncols=True,
                    smoothing=0.1)
    if report.lines:
        return _Lines(total, report.description)
    return _Silent()
