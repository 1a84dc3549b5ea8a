"""Optional HMAC-SHA256 signatures of manifests, for shared roots whose writers are not all
trusted.

When the environment variable ``CACHEKIT_SIGNING_KEY`` is set and not empty, every manifest
cachekit writes carries a ``"signature"`` field, and a manifest without a valid one is
refused (:class:`cachekit.errors.UnsignedEntryError`). Unset or empty: nothing is signed,
and a ``"signature"`` field found in a manifest is ignored.

The key
    The variable's text encoded as UTF-8 (``value.encode("utf-8", "surrogateescape")``:
    on POSIX with a UTF-8 locale, exactly the variable's bytes). It is read from the
    environment at every call, never cached, and never logged, printed or put in an error
    message or a file. Every writer and reader of one root must use the same key.

What is signed
    The manifest's JSON object without its ``"signature"`` field, in one canonical form:
    ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)`` encoded as
    ASCII (:func:`canonical`). It is defined on the *parsed* JSON object, not on the file's
    bytes, so whitespace and key order in ``manifest.json`` do not matter, and every field of
    the object is covered: the key, the file list with every checksum (and so, through
    ``cachekit verify``, every data byte), params, column, builder, times. A signature names
    its entry through the ``"key"`` field, which reading checks against the entry's
    directory name, so a signed manifest copied under another key is still refused.

The signature
    ``"hmac-sha256:"`` followed by the 64 lowercase hex digits of
    ``HMAC-SHA256(key, canonical bytes)`` (:func:`sign`); checked with
    :func:`hmac.compare_digest` (:func:`is_valid`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Mapping, Optional

ENV_VAR = "CACHEKIT_SIGNING_KEY"
FIELD = "signature"
"""The manifest field that holds the signature."""
SCHEME = "hmac-sha256:"


def key() -> Optional[bytes]:
    """The signing key from ``$CACHEKIT_SIGNING_KEY`` (its UTF-8 bytes), or None when the
    variable is unset or empty. Read at every call."""
    value = os.environ.get(ENV_VAR)
    if not value:
        return None
    return value.encode("utf-8", "surrogateescape")


def enabled() -> bool:
    """Whether manifests are signed and checked (``$CACHEKIT_SIGNING_KEY`` is set)."""
    return key() is not None


def canonical(obj: Mapping[str, Any]) -> bytes:
    """The bytes that are signed for the manifest object ``obj``: ``obj`` without its
    ``"signature"`` field, as sorted-key, compact, ASCII-only JSON."""
    unsigned = {name: value for name, value in obj.items() if name != FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode("ascii")


def sign(payload: bytes, secret: Optional[bytes] = None) -> str:
    """``"hmac-sha256:<hex>"`` of ``payload`` with ``secret`` (default: :func:`key`).

    ValueError when no key is given and ``$CACHEKIT_SIGNING_KEY`` is unset or empty.
    """
    secret = key() if secret is None else secret
    if not secret:
        raise ValueError(f"no signing key: {ENV_VAR} is unset or empty")
    return SCHEME + hmac.new(secret, payload, hashlib.sha256).hexdigest()


def is_valid(payload: bytes, signature: Any, secret: Optional[bytes] = None) -> bool:
    """Whether ``signature`` (any JSON value read from a manifest) is the signature of
    ``payload`` with ``secret`` (default: :func:`key`); compared in constant time."""
    if not isinstance(signature, str):
        return False
    expected = sign(payload, secret).encode("ascii")
    return hmac.compare_digest(expected, signature.encode("utf-8", "surrogatepass"))


def problem(obj: Any, secret: Optional[bytes] = None) -> Optional[str]:
    """Why the parsed manifest ``obj`` is not validly signed with ``secret`` (default:
    :func:`key`), or None when it is. The reason never contains the key or the expected
    signature."""
    if not isinstance(obj, dict) or FIELD not in obj:
        return f"the manifest is not signed, and {ENV_VAR} is set"
    if not is_valid(canonical(obj), obj[FIELD], secret):
        return f"the manifest's signature does not match its contents with this {ENV_VAR}"
    return None
