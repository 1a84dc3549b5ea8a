"""The allowed values of ``Cache.images`` options, and the one setting read from the
environment for decoding, importable without Pillow.

A cache hit validates its arguments against these, so it must not pay for importing Pillow.
"""

from __future__ import annotations

from . import units

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
