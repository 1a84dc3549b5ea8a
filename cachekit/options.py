"""The allowed values of ``Cache.images`` options, importable without Pillow.

A cache hit validates its arguments against these, so it must not pay for importing Pillow.
"""

from __future__ import annotations

MODES: dict[str, int] = {"RGB": 3, "L": 1, "RGBA": 4}
"""Target mode -> number of channels."""

FITS: tuple[str, ...] = ("stretch", "crop", "pad")
RESAMPLE_NAMES: tuple[str, ...] = ("nearest", "bilinear", "bicubic", "lanczos", "box")
ON_ERROR: tuple[str, ...] = ("raise", "zero")
VALIDATE: tuple[str, ...] = ("path", "stat", "content")
