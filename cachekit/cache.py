"""``Cache`` and ``Entry``: the public face of cachekit.

``Cache.images`` and ``Cache.map`` both come down to one path: make a key from the rows and
the parameters, then :func:`cachekit.publish.obtain` an entry, building it with
:func:`cachekit.build.fill` on a miss.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from . import build, keys, publish, store
from .errors import ImageDecodeError

PathLike = Union[str, "os.PathLike[str]"]
ON_ERROR = ("raise", "zero")
VALIDATE = ("path", "stat", "content")


class Entry:
    """A published cache entry, mapped read-only.

    ``array`` is an (N, ...) read-only numpy memmap in row order; ``valid`` marks the rows
    that were produced (False where ``on_error="zero"`` stored zeros).
    """

    def __init__(self, path: Path, manifest: dict[str, Any], *, hit: bool,
                 wait_seconds: float = 0.0) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.key: str = manifest["key"]
        self.hit = hit
        self.wait_seconds = wait_seconds
        self.array: np.ndarray = store.open_array(self.path, manifest)
        valid = np.ones(manifest["rows"], dtype=bool)
        valid[[row for row, _, _ in manifest["failed_rows"]]] = False
        valid.flags.writeable = False
        self.valid = valid

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    def __repr__(self) -> str:
        how = "hit" if self.hit else "built"
        return f"<cachekit.Entry {self.key} {self.array.dtype}{list(self.array.shape)} {how}>"

    def tensor(self):
        """A torch.Tensor over the entry's file, without copying.

        It maps the file copy-on-write: pages are shared with ``array`` and every other
        reader through the page cache, and a write to the tensor changes only this process's
        copy of that page, never the cache (a read-only mapping would crash on write).
        """
        import torch

        return torch.from_numpy(store.open_array(self.path, self.manifest, mode="c"))

    def dataset(self, targets: Any = None, transform: Optional[Callable] = None):
        """A torch Dataset over this entry: item i -> uint8 tensor, or (tensor, targets[i])."""
        from .dataset import EntryDataset

        return EntryDataset(self, targets=targets, transform=transform)


class Cache:
    """A content-addressed, process-safe cache of preprocessed arrays under ``root``.

    ``root``: a directory, or None for $CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else
    ~/.cache/cachekit. ``lock_timeout``: seconds to wait for another process's build (None
    waits forever). ``workers``: parallel rows in a build (None: usable CPUs). ``progress``:
    show bars (None: only when stderr is a terminal).
    """

    def __init__(self, root: Optional[PathLike] = None, *, lock_timeout: Optional[float] = None,
                 workers: Optional[int] = None, progress: Optional[bool] = None) -> None:
        if lock_timeout is not None and (
            isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float))
            or lock_timeout < 0
        ):
            raise ValueError(f"lock_timeout must be None or seconds >= 0, not {lock_timeout!r}")
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise ValueError(f"workers must be None or an int >= 1, not {workers!r}")
        if progress not in (True, False, None):
            raise ValueError(f"progress must be True, False or None, not {progress!r}")
        self.root = Path(root).expanduser() if root is not None else store.default_root()
        self.lock_timeout = lock_timeout
        self.workers = workers if workers is not None else build.usable_cpus()
        self.progress = progress
        self._layout = store.Layout(self.root)

    def __repr__(self) -> str:
        return f"cachekit.Cache({str(self.root)!r})"

    def _show_progress(self) -> bool:
        if self.progress is None:
            return sys.stderr is not None and sys.stderr.isatty()
        return self.progress

    def images(self, paths: Any, size: Union[int, Sequence[int]], *, mode: str = "RGB",
               fit: str = "stretch", resample: str = "bilinear", on_error: str = "raise",
               validate: str = "path", draft: bool = False) -> Entry:
        """Decode, orient, convert and resize every image of ``paths`` into an (N, C, H, W)
        uint8 entry, built once whatever the number of processes asking at the same time.

        ``draft=True`` lets JPEGs decode at a reduced DCT scale first: much faster, close to
        but not identical with the exact pixels (see README); it is part of the key.
        """
        from . import images

        paths = _path_column(paths)
        height, width = _image_size(size)
        _choose("mode", mode, tuple(images.MODES))
        _choose("fit", fit, images.FITS)
        _choose("resample", resample, tuple(images.RESAMPLES))
        _choose("on_error", on_error, ON_ERROR)
        _choose("validate", validate, VALIDATE)
        if not isinstance(draft, bool):
            raise TypeError(f"draft must be True or False, not {draft!r}")
        params = {"size": [height, width], "mode": mode, "fit": fit, "resample": resample,
                  "on_error": on_error, "validate": validate, "draft": draft}
        values = paths.to_numpy(dtype=object)
        material: dict[str, Any] = {"rows": keys.pandas_row_hashes(paths)}
        if validate == "stat":
            material["stat"] = keys.stat_signature(values)
        elif validate == "content":
            material["content"] = keys.content_signature(values, self.workers)

        def row(path: str) -> np.ndarray:
            return images.load_image(path, (height, width), mode, fit, resample, draft)

        channels = images.MODES[mode]
        return self._rows("images", values, row, params, material, column=paths.name,
                          template=((channels, height, width), np.dtype(np.uint8)),
                          collect_errors=True, on_error=on_error)

    def map(self, fn: Callable[[Any], Any], values: Any, *, version: Optional[str] = None,
            on_error: str = "raise") -> Entry:
        """Run ``fn`` on every value (in parallel threads) and stack the results to (N, ...).

        The first result fixes the row shape and dtype. The key covers ``fn``'s module,
        qualified name and source, ``version``, and the values in order. With
        ``on_error="raise"`` an exception from ``fn`` propagates unchanged and nothing is
        published; with ``"zero"`` the row is stored as zeros and marked invalid.
        """
        column = _value_column(values)
        _choose("on_error", on_error, ON_ERROR)
        params = {"function": keys.function_identity(fn, version), "on_error": on_error}
        material = {"rows": keys.pandas_row_hashes(column), "dtype": _dtype_family(column)}
        return self._rows("map", column.to_numpy(dtype=object), fn, params, material,
                          column=column.name, template=None, collect_errors=False,
                          on_error=on_error)

    def _rows(self, kind: str, values: Sequence[Any], row_fn: Callable[[Any], Any],
              params: dict[str, Any], material: dict[str, Any], *, column: Any,
              template: Optional[tuple], collect_errors: bool, on_error: str) -> Entry:
        """Key, then obtain: the one path every per-row entry takes."""
        key = keys.digest({"kind": kind, "format": store.FORMAT_VERSION, "params": params,
                           "n": len(values), **material})
        record_failures = collect_errors or on_error == "zero"

        def build_entry(build_dir: Path, on_chunk: publish.ChunkCallback) -> dict[str, Any]:
            filled = build.fill(build_dir / store.DATA_FILE, values, row_fn,
                                workers=self.workers, record=lambda exc: record_failures,
                                template=template, on_chunk=on_chunk,
                                progress=self._show_progress(), description=f"cachekit {kind}")
            if filled.failures and on_error == "raise":
                raise ImageDecodeError(filled.failures)
            return {"kind": kind, "params": params,
                    "column": column if isinstance(column, str) else None,
                    "rows": len(values), "shape": list(filled.shape),
                    "dtype": filled.dtype.str,
                    "failed_rows": [list(f) for f in filled.failures]}

        outcome = publish.obtain(self._layout, key, build_entry, lock_timeout=self.lock_timeout,
                                 announce=self.progress is not False)
        return Entry(outcome.entry_dir, outcome.manifest, hit=outcome.hit,
                     wait_seconds=outcome.wait_seconds)


def _choose(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _image_size(size: Any) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        pair: Sequence[Any] = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        pair = size
    else:
        raise TypeError(f"size must be an int or a (height, width) pair, not {size!r}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0
               for n in pair):
        raise ValueError(f"size must be positive ints (height, width); got {size!r}")
    return int(pair[0]), int(pair[1])


def _value_column(values: Any):
    import pandas as pd

    if not isinstance(values, pd.Series):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(f"values must be a pandas Series (or a list), not {type(values)}")
        values = pd.Series(list(values))
    if len(values) == 0:
        raise ValueError("values is empty; there is nothing to cache")
    return values


def _path_column(paths: Any):
    """Check the image-path column: a non-empty Series of str, no missing values."""
    import pandas as pd

    column = _value_column(paths)
    missing = np.flatnonzero(column.isna().to_numpy())
    if len(missing):
        raise ValueError(f"paths has missing values (NaN/None) at rows {missing[:10].tolist()}; "
                         "drop them first, e.g. df.dropna(subset=[column])")
    if pd.api.types.infer_dtype(column, skipna=False) != "string":
        bad = next(i for i, p in enumerate(column) if not isinstance(p, str))
        raise TypeError(f"paths must hold str; row {bad} is {type(column.iloc[bad]).__name__} "
                        f"{column.iloc[bad]!r} (convert with .astype(str))")
    return column


def _dtype_family(column: Any) -> str:
    """The column's dtype for the key, with object-of-str and str dtypes counted as one."""
    import pandas as pd

    if pd.api.types.infer_dtype(column, skipna=True) == "string":
        return "string"
    return str(column.dtype)
