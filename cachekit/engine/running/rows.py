"""The per-row functions of ``Cache.images`` and ``Cache.map``, as picklable objects.

A build may run its rows in other processes or on a cluster (cachekit.engine.running.executors), so
the row function travels by pickle: these are module-level classes holding plain parameters, not
closures. Importing this module imports neither Pillow nor torch: a cache hit never needs them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ... import redaction
from ...errors import NotAnArrayError


def as_row(result: Any) -> np.ndarray:
    """A row function's result as an array: numpy arrays and torch tensors (or anything
    numpy can view)."""
    if isinstance(result, np.ndarray):
        return result
    if hasattr(result, "detach") and hasattr(result, "cpu"):
        return result.detach().cpu().numpy()
    return np.asarray(result)


@dataclass(frozen=True)
class ImageRow:
    """``path -> (C, H, W) uint8``: :func:`cachekit.engine.decoding.images.load_image` with fixed
    options.

    ``max_read_bytes``: the caller's cap on whole-file reads, so that workers elsewhere (a
    cluster) read as the caller asked; None: each worker's ``$CACHEKIT_MAX_READ_BYTES``.
    ``backend``: "tensor" or "pil" (cachekit.engine.decoding.images).
    ``storage_options`` and ``fetch``: how the rows that are remote URLs are fetched
    (cachekit.engine.decoding.fetch; None: fsspec's configuration and the caller's
    ``$CACHEKIT_SOURCE_*``). The options may hold credentials: they are not in the repr.
    """

    size: tuple[int, int]
    mode: str = "RGB"
    fit: str = "stretch"
    resample: str = "bilinear"
    draft: bool = False
    max_read_bytes: Optional[int] = None
    backend: str = "tensor"
    storage_options: Optional[dict[str, Any]] = field(default=None, repr=False, compare=False,
                                                      hash=False)
    fetch: Any = None

    @property
    def imports_torch(self) -> bool:
        """Whether computing a row imports torch (seconds of CPU in a fresh process): the
        executor rule counts it (cachekit.engine.running.executors.default_executor)."""
        from ..decoding.images import backend_for

        return backend_for(self.backend, self.fit, self.resample) == "tensor"

    def __call__(self, path: Any) -> np.ndarray:
        """One row from a path, a URL, or what :meth:`prefetch` made of one (its bytes)."""
        from ..decoding import images

        if isinstance(path, str) and "://" in path[:40]:
            path = self._fetched(path)
        # Looked up on the module at each call (not bound once), so a test that patches
        # cachekit.engine.decoding.images.load_image to count decodes sees every row.
        return images.load_image(path, self.size, self.mode, self.fit, self.resample,
                                 self.draft, self.max_read_bytes, self.backend)

    @property
    def fetches(self) -> bool:
        """Whether the column holds remote URLs (the caller then set ``fetch``): the
        runner keeps more pieces in flight (cachekit.engine.running.pieces)."""
        return self.fetch is not None

    def prefetch(self, values: Sequence[Any]) -> Any:
        """``values`` as this function reads them, their remote objects being fetched many
        at once where the rows run (cachekit.engine.running.compute calls it)."""
        from ..decoding import fetch

        return fetch.prefetch(values, self._cap(), self.storage_options, self.fetch)

    def _fetched(self, url: str) -> Any:
        from ... import urls

        if not urls.is_remote(url):
            return url
        from ..decoding import fetch

        return fetch.fetch_one(url, self._cap(), self.storage_options, self.fetch)

    def _cap(self) -> int:
        if self.max_read_bytes is not None:
            return self.max_read_bytes
        from ... import options

        return options.max_read_bytes()


class ArrayRow:
    """``fn`` checked to return a plain-dtype numpy array or a torch tensor.

    Anything else raises :class:`NotAnArrayError`: a bug in ``fn``, so it is never recorded
    as a failed row. Pickles when ``fn`` does (a module-level function).
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.__wrapped__ = fn  # the convention functools.wraps uses: names the user's function

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.__wrapped__,))

    def __call__(self, value: Any) -> Any:
        fn = self.__wrapped__
        result = fn(value)
        if isinstance(result, (np.ndarray, np.generic)) and not result.dtype.hasobject:
            return result
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(result, torch.Tensor):
            return result
        raise NotAnArrayError(f"map: {getattr(fn, '__qualname__', fn)} returned "
                              f"{type(result).__qualname__} {redaction.text(result)[:80]} for "
                              f"{redaction.value(value)!r}; "
                              "it must return a numpy array (not of Python objects) or a "
                              "torch tensor")
