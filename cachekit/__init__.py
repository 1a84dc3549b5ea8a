"""cachekit: a content-addressed, process-safe preprocessing cache for PyTorch pipelines.

``cachekit.Cache(...).images(df["img_path"], size=32)`` decodes and resizes the images once
into a uint8 memmap that every later process maps in milliseconds.

``Cache`` and ``Entry`` are imported on first use (PEP 562): a build's worker processes
import cachekit's row functions, and should not pay for the cache's own machinery.
"""

import typing as _typing

from ._version import __version__
from .errors import (
    CacheCorruptError,
    CachekitError,
    CacheRootError,
    EntryNotFoundError,
    ImageDecodeError,
    InvalidArgument,
    InvalidArgumentType,
    LockTimeout,
    ReadOnlyCacheError,
    RemoteWarning,
    StaleEntryWarning,
    UnsignedEntryError,
)

if _typing.TYPE_CHECKING:
    from .cache import Cache
    from .entry import Entry

__all__ = [
    "Cache",
    "CacheCorruptError",
    "CachekitError",
    "CacheRootError",
    "Entry",
    "EntryNotFoundError",
    "ImageDecodeError",
    "InvalidArgument",
    "InvalidArgumentType",
    "LockTimeout",
    "ReadOnlyCacheError",
    "RemoteWarning",
    "StaleEntryWarning",
    "UnsignedEntryError",
    "__version__",
]

_LAZY = {"Cache": "cache", "Entry": "entry"}


def __getattr__(name: str) -> _typing.Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'cachekit' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
