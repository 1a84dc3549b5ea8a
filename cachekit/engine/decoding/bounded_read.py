"""Reading one object's answer within its bounds while it arrives, never after.

A source answers what it likes: a ``Content-Length`` of 100 GB, a chunked body that never
ends, a small gzip answer that inflates to gigabytes. Every read here therefore

- asks for the first ``cap + 1`` bytes (a ``Range``) and for the identity encoding;
- refuses an answer whose ``Content-Encoding`` is not the identity (image bytes are never
  decompressed on the way: a compressed answer is a failed row naming the encoding);
- refuses an answer whose ``Content-Length`` says it is larger than the cap before reading
  any of its body, and otherwise counts the bytes as they arrive and stops as soon as they
  pass the cap (the row fails as larger than the cap).

The deadline of an object (connect, headers, body, every attempt) is the caller's
(:mod:`.fetch` wraps each object in one). Used for ``http(s)://`` sources through fsspec's
HTTP filesystem's own session and settings, for S3 through s3fs, and for S3's presigned GETs
(:mod:`.s3_direct`).
"""

from __future__ import annotations

import errno
from typing import Any, Awaitable, Callable, Mapping, Optional

from ... import urls
from ...errors import CachekitError

CHUNK = 256 << 10
"""Bytes asked of a body at a time."""
IDENTITY = ("", "identity")


def check_answer(headers: Mapping[str, str], cap: int, url: str) -> None:
    """OSError naming the bound when ``headers`` announce a compressed body, or one longer
    than ``cap`` bytes (a ranged answer's length is the range's)."""
    encoding = (headers.get("Content-Encoding") or "").strip().lower()
    if encoding not in IDENTITY:
        raise OSError(errno.EPROTO, f"the answer is {encoding}-encoded; image bytes are read "
                                    "as they are stored, never decompressed on the way",
                      urls.shown(url))
    length = headers.get("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > cap:
        raise OSError(errno.EFBIG, f"the object is larger than the read cap of {cap} bytes "
                                   f"(CACHEKIT_MAX_READ_BYTES): the answer announced "
                                   f"{int(length)} bytes; none of it was read", urls.shown(url))


Received = Callable[[int], Awaitable[None]]
"""Told the size of each chunk of a body as it arrives (and awaited: it may pause the read
while the process's window is full, :class:`cachekit.engine.decoding.fetch._Pool`)."""


async def read_body(stream: Any, limit: int, url: Optional[str] = None,
                    received: Optional[Received] = None) -> bytes:
    """At most ``limit`` bytes of ``stream`` (aiohttp's ``StreamReader`` or aiobotocore's
    body: anything with ``async read(n)``), counted as they arrive. With ``url``, a body
    that goes on past ``limit`` is OSError(EFBIG) at once, its bytes dropped unjoined (what
    an endless body costs is the cap, never twice it)."""
    parts, size = [], 0
    while True:
        part = await stream.read(CHUNK)
        if not part:
            return b"".join(parts)
        if received is not None:
            await received(len(part))
        size += len(part)
        if size > limit:
            if url is not None:
                parts.clear()
                raise OSError(errno.EFBIG, f"the object is larger than the read cap of "
                                           f"{limit} bytes (CACHEKIT_MAX_READ_BYTES); no more "
                                           "of it was read", urls.shown(url))
            parts.append(part[:len(part) - (size - limit)])
            return b"".join(parts)
        parts.append(part)


def ranged_headers(end: int, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Request headers for bytes ``[0, end)`` in the identity encoding."""
    headers = dict(extra or {})
    headers["Accept-Encoding"] = "identity"
    if end > 0:
        headers["Range"] = f"bytes=0-{end - 1}"
    return headers


async def get(session: Any, url: str, cap: int, shown_url: str,
              received: Optional[Received] = None, **kwargs: Any) -> tuple[int, bytes]:
    """(status, body) of a GET of the first ``cap + 1`` bytes of ``url`` on the aiohttp
    ``session``: for 200 and 206 the body within the bounds above, for any other status at
    most 64 KiB of it (an error's text). ``shown_url``: how errors name the object."""
    headers = ranged_headers(cap + 1, kwargs.pop("headers", None))
    async with session.get(url, headers=headers, auto_decompress=False, **kwargs) as answer:
        if answer.status not in (200, 206):
            return answer.status, await read_body(answer.content, 64 << 10)
        check_answer(answer.headers, cap, shown_url)
        return answer.status, await read_body(answer.content, cap, shown_url, received)


async def http(fs: Any, url: str, cap: int, received: Optional[Received] = None) -> bytes:
    """The first ``cap + 1`` bytes of ``url`` through fsspec's HTTP filesystem ``fs`` (its
    session and request options: headers, auth, ...), within the bounds above."""
    options = dict(fs.kwargs)
    session = await fs.set_session()
    status, body = await get(session, fs.encode_url(url), cap, url, received, **options)
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, "no such object", urls.shown(url))
    if status == 416:
        return b""  # a range of an empty object
    if status not in (200, 206):
        raise HTTPStatusError(status, url)
    return body


async def s3(fs: Any, path: str, cap: int, url: str,
             received: Optional[Received] = None) -> bytes:
    """The first ``cap + 1`` bytes of the object at s3fs path ``path`` through s3fs's
    client, within the bounds above (``url``: how errors name it)."""
    bucket, key, version = fs.split_path(path)
    answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{cap}",
                               **({"VersionId": version} if version else {}))
    body = answer["Body"]
    try:
        check_answer({"Content-Encoding": answer.get("ContentEncoding") or "",
                      "Content-Length": str(answer.get("ContentLength", ""))}, cap, url)
        return await read_body(body, cap, url, received)
    finally:
        body.close()


class HTTPStatusError(CachekitError, OSError):
    """An HTTP answer other than the object's bytes: its status, for
    :func:`cachekit.urls.classify` (``.status``)."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(errno.EIO, f"HTTP {status}", urls.shown(url))
        self.status = status
