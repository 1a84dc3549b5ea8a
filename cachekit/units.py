"""Sizes and durations as people type and read them: ``10G``, ``1.2 GB``, ``7d``, ``3 d ago``.

Sizes are read and shown in one system, powers of 1000: ``300M`` and ``300MB`` are both
300,000,000 bytes, and ``cachekit`` shows them as ``300 MB``, so a size copied from
``cachekit ls`` parses back to the same number of bytes and ``prune --max-size 300M``
answers in the unit it was given. An ``iB`` suffix (``512MiB``) is taken at its word, a
power of 1024.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Union

from .errors import InvalidArgument, InvalidArgumentType

_PREFIXES = "KMGTP"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?b)?|(b))?\s*", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)", re.IGNORECASE)
_IMAGE_SIZE = re.compile(r"(\d+)(?:x(\d+))?", re.IGNORECASE | re.ASCII)

Duration = Union[int, float, str, datetime.timedelta]


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``512``, ``512B``, ``10G`` and ``10GB`` (1000-based, as shown),
    ``512MiB`` (1024-based). A negative size is refused in words of its own."""
    if text.strip().startswith("-") and _SIZE.fullmatch(text.strip()[1:]):
        raise InvalidArgument(f"a size must not be negative: {text.strip()!r}")
    match = _SIZE.fullmatch(text)
    if match is None:
        raise InvalidArgument(
            f"not a size: {text!r}; use a number with an optional unit, e.g. 500M, 10G, 1.5GB, 512KiB"
        )
    number, prefix, suffix, _ = match.groups()
    if prefix is None:
        return int(float(number))
    base = 1024 if suffix is not None and suffix.lower() == "ib" else 1000
    return int(float(number) * base ** (_PREFIXES.index(prefix.upper()) + 1))


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 failed row", "2 failed rows"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.2 GB``, ``345 MB`` (powers of 1000)."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for prefix in _PREFIXES:
        value /= 1000
        if value < 999.5 or prefix == _PREFIXES[-1]:
            return f"{value:.1f} {prefix}B" if value < 99.95 else f"{value:.0f} {prefix}B"
    raise AssertionError("unreachable")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an s/m/h/d/w unit, or several (``1d12h``); bare = s."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != re.sub(r"\s+", "", text):
        raise InvalidArgument(
            f"not a duration: {text!r}; use a number with a unit s, m, h, d or w, e.g. 7d, 12h, 1d12h"
        )
    return float(sum(float(n) * _DURATION_UNITS[(u or "s").lower()] for n, u in parts))


def parse_image_size(text: str) -> tuple[int, int]:
    """``(height, width)`` in ``text``: ``HxW`` such as ``32x24``, or ``N`` for ``NxN``; both
    positive, as ``Cache.images(size=...)`` requires."""
    match = _IMAGE_SIZE.fullmatch(text)
    height, width = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if height < 1 or width < 1:
        raise InvalidArgument(f"not an image size: {text!r}; use HxW with positive numbers, "
                              "e.g. 32x32 (or 32 for a square)")
    return height, width


def parse_row_range(text: str) -> range:
    """Rows ``A:B`` (``B`` excluded, as a Python slice; ``:B`` from 0), or one row ``A``."""
    match = re.fullmatch(r"\s*(\d*)\s*(?::\s*(\d+))?\s*", text)
    if match is None or (not match[1] and not match[2]):
        raise InvalidArgument(f"not a row range: {text!r}; use A:B, e.g. 0:16 (B excluded)")
    start = int(match[1] or 0)
    stop = int(match[2]) if match[2] is not None else start + 1
    if stop <= start:
        raise InvalidArgument(f"not a row range: {text!r}; its end must come after its start")
    return range(start, stop)


def seconds(value: Duration) -> float:
    """A duration given as seconds, a ``timedelta`` or a string like ``7d``, in seconds."""
    if isinstance(value, datetime.timedelta):
        result = value.total_seconds()
    elif isinstance(value, str):
        result = parse_duration(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        raise InvalidArgumentType("a duration must be seconds, a timedelta or a string like "
                                  f"'7d', not {value!r}")
    if result < 0:
        raise InvalidArgument(f"a duration must not be negative: {value!r}")
    return result


def byte_count(value: Union[int, str]) -> int:
    """A size given as an int or a string like ``10G``, in bytes."""
    if isinstance(value, str):
        result = parse_size(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        result = value
    else:
        raise InvalidArgumentType("a size must be an int of bytes or a string like '10G', not "
                                  f"{value!r}")
    if result < 0:
        raise InvalidArgument(f"a size must not be negative: {value!r}")
    return result


def format_age(age: float) -> str:
    """An age in seconds for people: ``just now``, ``42 s ago``, ``5 min ago``, ``3 d ago``."""
    if age < 1:
        return "just now"
    for unit, span in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("min", 60)):
        if age >= span * (2 if unit == "w" else 1):
            return f"{int(age // span)} {unit} ago"
    return f"{int(age)} s ago"


def seconds_from_env(name: str, default: float) -> float:
    """A positive, finite number of seconds from environment variable ``name``; ``default``
    when it is unset or blank. Anything else raises ValueError naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InvalidArgument(f"{name}={text!r} must be a positive number of seconds")
    return value


def size_from_env(name: str, default: int) -> int:
    """A byte count (``512``, ``256M``, ``1GB``, as :func:`parse_size` reads it) from
    environment variable ``name``; ``default`` when it is unset or blank. Anything else
    raises ValueError naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return parse_size(text)
    except ValueError:
        raise InvalidArgument(f"{name}={text!r} must be a size in bytes, e.g. 256M, 1G or "
                              "268435456") from None
