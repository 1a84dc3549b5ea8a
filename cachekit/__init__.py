"""cachekit: a content-addressed, process-safe preprocessing cache for PyTorch pipelines.

``cachekit.Cache(...).images(df["img_path"], size=32)`` decodes and resizes the images once
into a uint8 memmap that every later process maps in milliseconds.
"""

from ._version import __version__
from .cache import Cache
from .entry import Entry
from .errors import (
    CacheCorruptError,
    CachekitError,
    ImageDecodeError,
    LockTimeout,
    ReadOnlyCacheError,
    UnsignedEntryError,
)

__all__ = [
    "Cache",
    "CacheCorruptError",
    "CachekitError",
    "Entry",
    "ImageDecodeError",
    "LockTimeout",
    "ReadOnlyCacheError",
    "UnsignedEntryError",
    "__version__",
]
