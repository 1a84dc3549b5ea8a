"""What the public face is given, checked: ``Cache``'s options and the arguments of
``Cache.images`` and ``Cache.map``, each turned into what the call uses or refused with an
:class:`~cachekit.errors.InvalidArgument` (or its ``TypeError`` kin) that says what to pass.
A hit checks its arguments too, so nothing here imports Pillow, and the remote tier's
modules only when there is one."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import urls
from .errors import InvalidArgument, InvalidArgumentType

MAX_SIZE_ENV = "CACHEKIT_MAX_SIZE"


def budget(max_size: Optional[Union[int, str]]) -> Optional[int]:
    """The budget in bytes of ``max_size``, else of ``$CACHEKIT_MAX_SIZE``; None: none."""
    from .units import byte_count, size_from_env

    if max_size is None:
        value = size_from_env(MAX_SIZE_ENV, -1)
        return None if value < 0 else value
    return byte_count(max_size)


def fetch_settings(paths: Any, storage_options: Any) -> Optional[urls.FetchSettings]:
    """For a column with remote URLs, the fetch settings of ``$CACHEKIT_SOURCE_*``, once
    fsspec and the stores' filesystems are known to import
    (:class:`cachekit.urls.MissingRemoteSupport` naming the extra); None for local paths."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidArgumentType(f"storage_options must be a dict of fsspec filesystem "
                                  f"arguments or None, not {type(storage_options).__qualname__}")
    protocols = urls.column_protocols(paths)
    if not protocols:
        return None
    urls.check_available(protocols)
    return urls.FetchSettings.from_env()


def remote_tier(remote: Any) -> tuple[Optional[str], Any]:
    """(URL or None, RemoteStore or None) for Cache(remote=...): None -> $CACHEKIT_REMOTE;
    "" -> local only. The remote store's modules are imported only when there is one, and
    it imports fsspec only when it is first used."""
    from .store.remote_fs import url_from_env

    if remote is None:
        remote = url_from_env()
    elif not isinstance(remote, str):
        raise InvalidArgumentType(f"remote must be an fsspec URL (str) or None, not "
                                  f"{type(remote).__qualname__}")
    if not remote:
        return None, None
    from .store.remote import RemoteStore

    return remote, RemoteStore(remote)


def choose(name: str, value: Any, allowed: Sequence[str]) -> None:
    """Refuse ``value`` of the option ``name`` unless it is one of ``allowed``."""
    if value not in allowed:
        raise InvalidArgument(f"{name} must be one of {', '.join(map(repr, allowed))}; "
                              f"got {value!r}")


def image_size(size: Any) -> tuple[int, int]:
    """(height, width) of ``size``: an int for a square, or a pair of positive ints."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        pair: Sequence[Any] = (size, size)
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        pair = size
    else:
        raise InvalidArgumentType(f"size must be an int or a (height, width) pair, not {size!r}")
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0
               for n in pair):
        raise InvalidArgument(f"size must be positive ints (height, width); got {size!r}")
    return int(pair[0]), int(pair[1])


def value_column(values: Any, name: str = "values"):
    """``values`` (the argument ``name``) as a non-empty Series."""
    import pandas as pd

    if not isinstance(values, pd.Series):
        if (isinstance(values, (str, bytes, pd.DataFrame)) or not hasattr(values, "__len__")
                or getattr(values, "ndim", 1) != 1):
            raise InvalidArgumentType(
                f"{name} must be a pandas Series (or a list), one value per row; got "
                f"{type(values).__qualname__} (pick a column: df['img_path'])")
        values = list(values)
        try:  # an empty list is given a dtype: pandas 1.x warns when it must guess one
            values = pd.Series(values, dtype=None if values else object)
        except UnicodeEncodeError:  # pandas' str dtype holds UTF-8 only: a path that is
            values = pd.Series(values, dtype=object)  # not (see keys._row_hashes) stays str
    if len(values) == 0:
        raise InvalidArgument(f"{name} is empty; there is nothing to cache: pass a column "
                              "with at least one row")
    return values


def path_column(paths: Any):
    """Check the image-path column: a non-empty Series, or any sequence (a list, a tuple, a
    numpy array), of str or os.PathLike, no missing values. A PathLike becomes its str, so
    a list of pathlib.Path has the key of the Series of the same str."""
    import pandas as pd

    column = value_column(paths, "paths")
    all_str = pd.api.types.infer_dtype(column, skipna=False) == "string"
    if all_str and (column.dtype == object or not column.hasnans):
        return column  # an object column of only str has no NaN/None: skip the isna pass
    missing = np.flatnonzero(column.isna().to_numpy())
    if len(missing):
        raise InvalidArgument(
            f"paths has missing values (NaN/None) at rows {missing[:10].tolist()}; drop them "
            "first" + (", e.g. df.dropna(subset=[column])" if isinstance(paths, pd.Series)
                       else ""))
    if column.dtype == object and any(isinstance(p, os.PathLike) for p in column):
        column = pd.Series([os.fspath(p) if isinstance(p, os.PathLike) else p for p in column],
                           name=column.name, dtype=object)
    bad = next((i for i, p in enumerate(column) if not isinstance(p, str)), None)
    if bad is not None:  # (a categorical column of str is fine: it hashes like str)
        value = column.iloc[bad]
        hint = " (convert with .astype(str))" if isinstance(paths, pd.Series) else ""
        raise InvalidArgumentType(f"paths must hold str or os.PathLike; row {bad} is "
                                  f"{type(value).__name__} {value!r}{hint}")
    return column
