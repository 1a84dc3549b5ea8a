"""What cachekit says on stderr, in one voice: every line names the process that says it.

Several sweep agents or torchrun ranks share one terminal or log, so a line such as
``cachekit[pid 4242 rank 1/2 local 1]: joined the build of entry ...`` says who joined: the
pid always, and the rank, world size and local rank that torch.distributed's launchers put
in ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` when they are set. The command line's own
results and errors (``cachekit: error: ...``) are not library messages and keep their form.
Every line has its control characters escaped (:func:`printable`), the command line's too,
and goes out in one write (:func:`write_line`), so that processes sharing a log do not split
each other's lines (a write under 4 KiB to a pipe or an appended file is never interleaved).

Lines go through the ``cachekit`` logger, whose one handler writes them to stderr with the
prefix (a formatter). What a call says of its own work (whom it waits for, what it shares,
joins or resumes) is INFO, and a call made quiet (``Cache(progress=False)``: :func:`quiet`)
drops it; what must be heard whatever the call (an entry refused or removed, a failed
upload) is WARNING. An application may raise the logger's level, or add its own handlers.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
from typing import Any, Iterator

# C0 controls, DEL and C1 controls (terminal escape sequences start with these) as \xNN, and
# lone surrogates (which cannot be written out) as \uNNNN; printable Unicode stays as is.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({c: f"\\u{c:04x}" for c in range(0xD800, 0xE000)})
_NEEDS_ESCAPE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""The environment variables torchrun (and torch.distributed.launch) set for each rank."""


def prefix() -> str:
    """``cachekit[pid 4242]``, or with the rank when one is set:
    ``cachekit[pid 4242 rank 1/2 local 1]``. Read afresh each time: a fork has another pid."""
    rank, world, local = (_number(name) for name in RANK_VARIABLES)
    parts = [f"pid {os.getpid()}"]
    if rank is not None:
        parts.append(f"rank {rank}" + (f"/{world}" if world is not None else ""))
    if local is not None:
        parts.append(f"local {local}")
    return f"cachekit[{' '.join(parts)}]"


def printable(text: Any) -> str:
    """``text`` with its control characters escaped: host names, paths and reasons read
    from files under a shared root or from a bucket are written by whoever else uses it,
    so none of their text may reach a terminal raw."""
    text = str(text)
    return text.translate(_ESCAPES) if _NEEDS_ESCAPE.search(text) else text


def write_line(stream: Any, text: str, *, end: str = "\n", flush: bool = True) -> None:
    """Write ``text`` and ``end`` to ``stream`` in one write (then flush): where the stream
    writes through (``PYTHONUNBUFFERED``), ``print``'s separate write of the newline lets
    another process's line fall between the two."""
    stream.write(text + end)
    if flush:
        stream.flush()


def say(text: str, *, always: bool = False) -> None:
    """Say ``text`` as one line on stderr, after this process's :func:`prefix`, with its
    control characters escaped: a note of this call's work, or with ``always`` a warning
    that a quiet call says too."""
    LOGGER.log(logging.WARNING if always else logging.INFO, "%s", text)


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """While in this block, in this thread or task, notes of a call's work go unsaid."""
    token = _QUIET.set(on)
    try:
        yield
    finally:
        _QUIET.reset(token)


def speaking() -> bool:
    """Whether notes of a call's work are said here (not within :func:`quiet`)."""
    return not _QUIET.get()


class _Voice(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{prefix()}: {printable(record.getMessage())}"


class _Stderr(logging.Handler):
    """Writes each line to the ``sys.stderr`` of the moment (tests and notebooks swap it),
    dropping a quiet call's notes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or speaking()) and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(sys.stderr, self.format(record))
        except Exception:
            self.handleError(record)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("cachekit_quiet", default=False)
LOGGER = logging.getLogger("cachekit")
"""Where every library line goes; it does not propagate to the root logger, so an
application's logging setup does not print each line twice."""
_handler = _Stderr()
_handler.setFormatter(_Voice())
LOGGER.addHandler(_handler)
LOGGER.setLevel(logging.INFO)
LOGGER.propagate = False


def _number(name: str) -> str | None:
    """The variable's value if it is a whole number (anything else is not a launcher's)."""
    value = os.environ.get(name, "").strip()
    return value if value.isdigit() else None
