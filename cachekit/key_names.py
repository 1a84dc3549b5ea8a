"""What a key looks like, and the entry format every key includes: what the store and the
command line need to tell a key from other names, without the machinery of
:mod:`cachekit.keys` that derives keys (numpy), so a listing never imports it."""

from __future__ import annotations

import re

FORMAT_VERSION = 5
"""The entry format (3: a per-row entry's data start on a page boundary,
:mod:`cachekit.engine.filling.plan`; 4: a derived entry that decoded none of its rows lists no
row files of its own, its parts' copies describe every row; 5: nor a data file, its row map
numbers its parts from 0): part of every key and recipe,
so that entries of another format are never hits nor sources of rows
(:mod:`cachekit.store.manifest` checks it on reading)."""
KEY_HEX_LENGTH = 32
_KEY = re.compile(f"[0-9a-f]{{{KEY_HEX_LENGTH}}}")


def is_key(text: str) -> bool:
    """True when ``text`` is a well-formed full key (safe to use as a directory name)."""
    return _KEY.fullmatch(text) is not None
