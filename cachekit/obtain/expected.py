"""What a call knows of the entry it must get back, checked against every entry it is handed.

A manifest may have been written by another process, user or host. One that parses and
agrees with its own data files can still describe something other than what the call asked
for: ``images`` returning uint16, or another number of rows. :class:`Expected` holds what
the call knows before any entry is read (``images``: kind, rows, row shape and uint8;
``map``: kind and rows; ``memoize``: kind, and that its files are the leaves its structure
names), and :meth:`Expected.check` says what disagrees.
:func:`cachekit.obtain.flow.obtain` checks every entry, whatever its source; a
mismatch is removed and built again locally, and refused (a miss) from a remote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..store.manifest import Manifest


@dataclass(frozen=True)
class Expected:
    """The entry a call must get: ``kind``; ``rows`` (None: unknown up front); ``row_shape``
    and ``dtype`` of the main array's rows (None: unknown, fixed by the first row built);
    ``leaves``: the files must be exactly the leaves the manifest's structure names (memoize).
    A dtype holding Python objects is never expected."""

    kind: str
    rows: Optional[int] = None
    row_shape: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    leaves: bool = False

    def check(self, manifest: Manifest) -> Optional[str]:
        """None when ``manifest`` describes such an entry, else what disagrees, in words."""
        if manifest.kind != self.kind:
            return f"it is a {manifest.kind!r} entry, the call makes {self.kind!r}"
        if self.rows is not None and manifest.rows != self.rows:
            return f"it has {manifest.rows} rows, the call makes {self.rows}"
        dtype = manifest.dtype
        if dtype.hasobject:
            return f"its dtype {dtype.str} holds Python objects"
        if self.dtype is not None and dtype != np.dtype(self.dtype):
            return f"its dtype is {dtype.str}, the call makes {np.dtype(self.dtype).str}"
        if self.row_shape is not None and manifest.shape != (manifest.rows, *self.row_shape):
            return (f"its shape is {list(manifest.shape)}, the call makes "
                    f"{[manifest.rows, *self.row_shape]}")
        if self.leaves:
            return _leaf_problem(manifest.structure, len(manifest.files))
        return None


def _leaf_problem(structure: Any, files: int) -> Optional[str]:
    """None when ``structure`` names each of ``files`` leaves exactly once, as a memoize
    build writes it (malformed nodes are left to the loader, which refuses them)."""
    named: list[Any] = []
    stack = [structure]
    while stack:  # iterative: a hostile structure may nest deeply
        node = stack.pop()
        if isinstance(node, dict):
            for tag, body in node.items():
                if tag == "array":
                    named.append(body)
                else:
                    stack.append(body)
        elif isinstance(node, list):
            stack.extend(node)
    if all(type(i) is int for i in named) and sorted(named) == list(range(files)):
        return None
    return f"its structure names leaves {named[:10]!r}, not each of its {files} files once"
