"""What a decoder reads a row from: a local path (or ``file://`` URL), read capped from the
disk, or an object's bytes already fetched from a store (:class:`Fetched`, made by
:mod:`.fetch` where the rows run). Both backends open a row's bytes through
:func:`open_source`, so a fetched object decodes to the same pixels as its local copy.
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO

from ... import _fs, urls


class Fetched:
    """The bytes of the object at ``url``, fetched whole (at most the read cap)."""

    __slots__ = ("url", "data")

    def __init__(self, url: str, data: bytes) -> None:
        self.url, self.data = url, data

    def __repr__(self) -> str:
        return f"Fetched({urls.shown(self.url)!r}, {len(self.data)} bytes)"


def open_source(source: Any, max_read_bytes: int) -> BinaryIO:
    """The bytes of a row to parse: a :class:`Fetched` object's in memory; a local path's
    as :func:`cachekit._fs.read_capped` reads them. An exception instance (a fetch that
    failed) is raised, so that the row fails with the fetch's reason."""
    if isinstance(source, Fetched):
        return io.BytesIO(source.data)
    if isinstance(source, BaseException):
        raise source
    if urls.is_remote(source):
        raise ValueError(f"{urls.shown(source)} must be fetched before it is decoded")
    return _fs.read_capped(urls.local_path(source), max_read_bytes, follow_symlinks=True)


def name_of(source: Any) -> str:
    """The row's path or URL, for messages (a URL without credentials)."""
    if isinstance(source, Fetched):
        return urls.shown(source.url)
    return str(source)
