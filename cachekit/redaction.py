"""The one rule by which a value of a column (and any text that may quote one) is shown or
stored: in exceptions, stderr lines, warnings, manifests, failure records, CLI output and
W&B.

A column value may carry secrets: ``https://user:password@host/a.jpg``, a presigned URL
whose query holds ``X-Amz-Signature=...``, a token in a fragment. Whatever cachekit shows
or stores of a value, a group member of a shared root may read, so :func:`value` keeps
only what names the image (scheme, host, path) and :func:`text` does the same to every URL
inside a message (an exception's text quotes the URL it failed on). Both escape control
characters (a file name may hold terminal escapes) and bound the length, so that a stored
failure has a size of its own, whatever the column holds.

When a URL's authority cannot be read as ``host[:port]`` once its userinfo is dropped, or
its path holds an ``@`` after a ``:`` (a password holding a raw ``/``, ``?`` or ``#``
splits a URL there), the whole URL is shown as ``scheme://[redacted]``: the rule errs on
the side of showing less. In a message, a URL runs to the next white space.
"""

from __future__ import annotations

import re
from typing import Any

from .messages import printable

VALUE_CHARS = 300
"""The most characters a shown or stored value keeps (its head and tail, the middle elided)."""
TEXT_CHARS = 400
"""The most characters a shown or stored message (a failed row's reason) keeps."""
REDACTED = "[redacted]"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# (starting only where a scheme can start: a long run of letters is tried once, not at
# each of its letters)
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://\S*")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]*\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(:[0-9]*)?")
_AUTHORITY_END = re.compile(r"[/?#\\]")


def url(raw: str) -> str:
    """The URL ``raw`` as shown and stored: ``scheme://host[:port]/path``, without
    userinfo (however many ``@`` it holds), query or fragment. Text that is not a URL is
    returned as it is."""
    match = _SCHEME.match(raw)
    if match is None:
        return raw
    scheme, rest = match.group(0), raw[match.end():]
    end = _AUTHORITY_END.search(rest)
    authority, tail = (rest[:end.start()], rest[end.start():]) if end else (rest, "")
    authority = authority.rpartition("@")[2]
    path = re.split(r"[?#]", tail, maxsplit=1)[0]
    if not _HOST_PORT.fullmatch(authority) or (
            "@" in path and ":" in authority + path.rpartition("@")[0]):
        # userinfo with a raw reserved character: where the host starts is a guess
        return scheme + REDACTED
    return scheme + authority + path


def value(raw: Any) -> str:
    """A column value as shown and stored: a URL by :func:`url`, control characters
    escaped, at most :data:`VALUE_CHARS` characters (the tail, which names the file, kept)."""
    shown = printable(url(raw) if isinstance(raw, str) else str(raw))
    return _bounded(shown, VALUE_CHARS)


def text(raw: Any) -> str:
    """A message that may quote column values (an exception's text): every URL in it by
    :func:`url`, control characters escaped, at most :data:`TEXT_CHARS` characters."""
    shown = str(raw)
    if "://" in shown:
        shown = _URL_IN_TEXT.sub(lambda m: url(m.group(0)), shown)
    return _bounded(printable(shown), TEXT_CHARS)


def _bounded(shown: str, limit: int) -> str:
    if len(shown) <= limit:
        return shown
    head = limit // 3
    return f"{shown[:head]}...{shown[len(shown) - (limit - head - 3):]}"
