"""Small JSON records that other processes write (lock holders, build states, journals,
seats, failure records, leases): read within a size limit, parsed without trusting them,
and their fields checked, so that a damaged or hostile record is "unreadable", never an
exception from deep inside a caller or an allocation it sizes."""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO, Optional

from . import _fs


def load(data: bytes | str) -> Any:
    """``json.loads(data)``; ValueError for anything that is not JSON, nesting too deep for
    the parser included."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the record is nested too deeply") from None


def read_limited(f: BinaryIO, limit: int) -> bytes:
    """``f.read(limit + 1)`` of a file just opened: its bytes up to its end or one past
    ``limit`` (so the caller sees that it is too large), read from its descriptor as
    :func:`cachekit._fs.read_to_end` reads, with a buffer of the size the file has rather
    than of ``limit`` (a read of a 64 MiB limit allocates 64 MiB: 30 us a small record)."""
    return _fs.read_to_end(f.fileno(), os.fstat(f.fileno()).st_size, limit)


def read_dict(f: BinaryIO, limit: int) -> Optional[dict[str, Any]]:
    """The JSON object in the first ``limit`` bytes of the open file ``f``; None when they
    are not one (cut short, damaged, or another JSON value)."""
    try:
        record = load(read_limited(f, limit - 1))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def is_count(value: Any) -> bool:
    """Whether a record's field is a count: an int (as JSON reads one: not a bool), not
    negative."""
    return type(value) is int and value >= 0


def is_number(value: Any) -> bool:
    """Whether a record's field is a number (an int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def progress(done: Any, total: Any) -> str:
    """A build's progress as a record says it, for people: ``2048/10000 rows, 20%``, or
    ``starting`` when the record gives no usable counts."""
    if is_count(done) and is_count(total) and total:
        return f"{done}/{total} rows, {100 * done / total:.0f}%"
    return "starting"
