"""What a process keeps of the files it read and checked, for its next reads: a
least-recently-used map from a stamp (what tells one version of the files from another) to
what they said, bounded by bytes. Committed files never change, so a value holds while its
stamp is the same.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Optional, TypeVar

T = TypeVar("T")


class Kept(Generic[T]):
    """Values by stamp, at most ``max_bytes`` of them (``size(value)``), the least
    recently used dropped first; a value larger than the bound is not kept. Thread-safe."""

    def __init__(self, max_bytes: int, size: Callable[[T], int]) -> None:
        self.max_bytes, self.size = max_bytes, size
        self._values: "OrderedDict[Hashable, T]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, stamp: Hashable) -> Optional[T]:
        with self._lock:
            value = self._values.get(stamp)
            if value is not None:
                self._values.move_to_end(stamp)
            return value

    def put(self, stamp: Hashable, value: T) -> None:
        if self.size(value) > self.max_bytes:
            return
        with self._lock:
            replaced = self._values.pop(stamp, None)
            if replaced is not None:
                self._bytes -= self.size(replaced)
            self._values[stamp] = value
            self._bytes += self.size(value)
            while self._bytes > self.max_bytes:
                self._bytes -= self.size(self._values.popitem(last=False)[1])

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._bytes = 0
