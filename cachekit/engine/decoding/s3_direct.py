"""Reading S3 objects at the store's speed: a presigned GET on an aiohttp session of our own.

A ``get_object`` through s3fs and aiobotocore costs about 1.5 ms of the client's CPU per
object (the request's assembly and signing, event hooks, the answer's parsing), as much as
decoding a small image: on a loaded host the fetch then competes with the decode for the
cores. Presigning the same request with the same client (its endpoint, region and
credentials, from fsspec's and boto's configuration) and sending it with aiohttp costs about
0.45 ms (measured on loopback SeaweedFS, docs/object-stores.md). The signed URL lives only
in this process's memory, for :data:`EXPIRES` seconds, and is never shown: errors name the
object's ``s3://`` URL (:func:`cachekit.urls.describe` drops any query string).

Used for s3 by :mod:`.fetch` unless ``$CACHEKIT_SOURCE_PRESIGNED=0``, or when the
filesystem adds request arguments (requester pays, SSE-C: ``req_kw``), where s3fs's own
``_cat_file`` is used.
"""

from __future__ import annotations

import asyncio
import atexit
import re
from typing import Any, Optional

from ... import urls
from ...errors import CachekitError
from . import bounded_read

EXPIRES = 900
"""Seconds a presigned URL is valid: far longer than one request with its retries."""


class DirectError(CachekitError, OSError):
    """An S3 answer other than the object: its HTTP status and error code, in the shape
    of botocore's ClientError (``response``), so :func:`cachekit.urls.classify` reads it."""

    def __init__(self, status: int, code: Optional[str], url: str) -> None:
        super().__init__(f"HTTP {status}{' ' + code if code else ''} for {urls.shown(url)}")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status},
                         "Error": {"Code": code or ""}}


def usable(fs: Any) -> bool:
    """Whether ``fs`` (an s3fs filesystem) can be read by presigned GETs."""
    return not getattr(fs, "req_kw", None) and not getattr(fs, "version_aware", False)


class Reader:
    """Presigned GETs of one s3fs filesystem's objects, on its event loop."""

    def __init__(self, fs: Any, settings: urls.FetchSettings) -> None:
        self.fs, self.settings = fs, settings
        self.session: Any = None
        self._opening: Any = None

    async def read(self, path: str, end: int, url: str,
                   received: Optional[bounded_read.Received] = None) -> bytes:
        """Bytes ``[0, end)`` of the object at filesystem path ``path`` (all of it when
        shorter), read within :mod:`.bounded_read`'s bounds; DirectError for any other
        answer."""
        if self.session is None:
            if self._opening is None:  # one session, however many reads wait for it
                self._opening = asyncio.ensure_future(self._open())
            await asyncio.shield(self._opening)
        bucket, key, version = self.fs.split_path(path)
        params = {"Bucket": bucket, "Key": key, **({"VersionId": version} if version else {})}
        signed = await self.fs.s3.generate_presigned_url("get_object", Params=params,
                                                         ExpiresIn=EXPIRES)
        status, body = await bounded_read.get(self.session, signed, end - 1, url, received)
        if status in (200, 206):
            return body
        if status == 416:
            return b""  # a range of an empty object
        match = re.search(rb"<Code>([^<]{1,64})</Code>", body)
        raise DirectError(status, match.group(1).decode("ascii", "replace") if match else None,
                          url)

    async def _open(self) -> None:
        import aiohttp

        try:
            await self.fs.set_session()
        except BaseException:
            self._opening = None  # the next read tries again
            raise
        timeout = self.settings.timeout
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.settings.concurrency),
            timeout=aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout),
            auto_decompress=False)
        atexit.register(_close, self.session, self.fs.loop)


def _close(session: Any, loop: Any) -> None:
    """Close a session at exit, while fsspec's loop still runs (best effort)."""
    import asyncio

    try:
        asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=2)
    except Exception:  # the loop is gone: nothing left to close cleanly
        pass
