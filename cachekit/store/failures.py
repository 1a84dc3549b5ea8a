"""Failure records (``locks/KEY.failed.json``): the rows of a build that failed, so that the
processes waiting for it raise the same error instead of each decoding every row again.

A record binds to its writer. Another member of a shared root's group can write into
``locks/``, so a record is honoured only when the file belongs to this user and, with
``CACHEKIT_SIGNING_KEY`` set, when it carries a valid signature over its contents and its
key. Anything else is refused with the reason, which the caller says once; it never fails
a call. The other records of a user in ``locks/`` (a key's stale files, the listing memo
of :mod:`cachekit.admin.listing_memo`) are kept the same way.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .. import _fs, small_json
from . import signing

LIMIT = 64 << 20
"""Bytes read of a record at most (a record lists every failed row): a larger one is
refused, never read whole."""


def write(locks: _fs.DirHandle, name: str, key: str, record: dict[str, Any]) -> None:
    """Write ``record`` of ``key`` as ``name`` (readers see the old file or the new one),
    signed when signing is on."""
    record = {**record, "key": key}
    if signing.enabled():
        record[signing.FIELD] = signing.sign(signing.canonical(record))
    locks.replace_json(name, record)


def read(locks: _fs.DirHandle, name: str, key: str) -> tuple[Optional[dict[str, Any]],
                                                              Optional[str]]:
    """(the record of ``key``, None) when it may be honoured; (None, why not) when a record
    is there but refused; (None, None) when there is none or it cannot be read."""
    try:
        with locks.open_file(name) as f:
            uid = os.fstat(f.fileno()).st_uid
            data = small_json.read_limited(f, LIMIT)
    except OSError:
        return None, None
    if uid != os.geteuid():
        return None, f"it belongs to uid {uid}, not to this user"
    if len(data) > LIMIT:
        return None, f"it is larger than {LIMIT} bytes"
    try:
        record = small_json.load(data)
    except ValueError:
        return None, "it is not valid JSON"
    if not isinstance(record, dict) or record.get("key") != key:
        return None, "it does not name this entry"
    if signing.enabled():
        problem = signing.problem(record)
        if problem is not None:
            return None, problem.replace("the manifest", "the record")
    return record, None
