"""What cachekit says on stderr, in one voice: every line names the process that says it.

Several sweep agents or torchrun ranks share one terminal or log, so a line such as
``cachekit[pid 4242 rank 1/2 local 1]: joined the build of entry ...`` says who joined: the
pid always, and the rank, world size and local rank that torch.distributed's launchers put
in ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` when they are set. The command line's own
results and errors (``cachekit: error: ...``) are not library messages and keep their form.
Every line has its control characters escaped (:func:`printable`), the command line's too.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

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


def say(text: str) -> None:
    """Write ``text`` as one line on stderr, after this process's :func:`prefix`, with its
    control characters escaped."""
    print(f"{prefix()}: {printable(text)}", file=sys.stderr, flush=True)


def _number(name: str) -> str | None:
    """The variable's value if it is a whole number (anything else is not a launcher's)."""
    value = os.environ.get(name, "").strip()
    return value if value.isdigit() else None
