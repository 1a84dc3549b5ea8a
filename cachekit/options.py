"""The allowed values of ``Cache`` and ``Cache.images`` options, and the one setting read
from the environment for decoding, importable without Pillow.

A cache hit validates its arguments against these, so it must not pay for importing Pillow.
"""

from __future__ import annotations

from typing import Any

from . import units
from .errors import InvalidArgument

MODES: dict[str, int] = {"RGB": 3, "L": 1, "RGBA": 4}
"""Target mode -> number of channels."""

FITS: tuple[str, ...] = ("stretch", "crop", "pad")
RESAMPLE_NAMES: tuple[str, ...] = ("nearest", "bilinear", "bicubic", "lanczos", "box")
BACKENDS: tuple[str, ...] = ("tensor", "pil")
"""Decoding backends of ``Cache.images``, the default first (cachekit.engine.decoding.images)."""
ON_ERROR: tuple[str, ...] = ("raise", "zero")
VALIDATE: tuple[str, ...] = ("path", "stat", "content")

MAX_READ_ENV = "CACHEKIT_MAX_READ_BYTES"
DEFAULT_MAX_READ_BYTES = 256 << 20


def max_read_bytes() -> int:
    """The largest image file read whole into memory to be decoded:
    ``$CACHEKIT_MAX_READ_BYTES`` (a size such as ``64M``; ``0`` never reads whole), default
    256 MiB. A larger file is decoded from the open file instead, so a huge file in a column
    (an image or not) costs each worker what the decoder reads of it, not its size.
    ValueError naming the variable when it is not a size."""
    return units.size_from_env(MAX_READ_ENV, DEFAULT_MAX_READ_BYTES)


def check_lock_timeout(lock_timeout: Any) -> None:
    """ValueError unless ``lock_timeout`` is None (wait for good) or seconds >= 0."""
    if lock_timeout is not None and (
        isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float))
        or lock_timeout < 0
    ):
        raise InvalidArgument(f"lock_timeout must be None or seconds >= 0, not {lock_timeout!r}")
