"""The checksums cachekit records: 16-byte BLAKE2b, written as ``blake2b-128:`` and 32 hex
digits. Apart from :mod:`cachekit.arrays`, which computes them over files, so that a
manifest's reader checks their form without importing numpy."""

from __future__ import annotations

import hashlib
from typing import Any

CHECKSUM_PREFIX = "blake2b-128:"
"""How every checksum cachekit records begins (a manifest's files, a chunk's done record)."""


def hasher() -> Any:
    """A fresh hasher of the checksums cachekit records (16-byte BLAKE2b)."""
    return hashlib.blake2b(digest_size=16)


def hex_checksum(hashed: Any) -> str:
    """The recorded form of a :func:`hasher`'s digest: ``blake2b-128:`` and 32 hex digits."""
    return CHECKSUM_PREFIX + hashed.hexdigest()
