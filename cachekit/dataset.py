"""A torch ``Dataset`` over a cache entry, fast enough that the DataLoader is not the bottleneck.

``EntryDataset`` reads a whole DataLoader batch with one sorted fancy index on the memmap
(``__getitems__``), and pickles to worker processes as the entry's location (plus, for a
worker that ``spawn`` or ``forkserver`` starts, the descriptors of the files the entry keeps
open): each process maps the file itself on first use (again after a fork), so K workers
share one copy of the data in the page cache and the pickle stays small whatever the
number of rows.

This is the only cachekit module that imports torch at import time.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .errors import CacheCorruptError, DatasetCorruptError, InvalidArgument, InvalidArgumentType



class MappedEntry(Protocol):
    """What a dataset reads of its :class:`cachekit.Entry` (typed structurally, so that
    this module and ``entry``, which makes datasets, do not import each other)."""

    key: str
    path: Any
    manifest: dict[str, Any]
    array: np.ndarray

    def __len__(self) -> int: ...

    def _map(self, mode: str = "r") -> np.ndarray: ...

__all__ = ["DatasetCorruptError", "EntryDataset"]

class EntryDataset(Dataset):
    """Map-style Dataset over ``entry``: item i -> the row as a tensor, or (tensor, target).

    For an images entry the row is a (C, H, W) uint8 tensor. ``targets`` (array, list,
    pandas Series or tensor of length N) adds ``targets[i]``; ``transform`` is applied to
    each row tensor (torchvision.transforms.v2 transforms work). Returned tensors are the
    caller's own copies: changing one never changes the cache or a later item.
    """

    def __init__(self, entry: MappedEntry, targets: Any = None,
                 transform: Optional[Callable[[torch.Tensor], Any]] = None) -> None:
        _check_torch_dtype(np.dtype(entry.manifest["dtype"]))
        if transform is not None and not callable(transform):
            raise InvalidArgumentType(
                f"transform must be callable, not {type(transform).__name__}")
        self.entry = entry
        self.targets = _as_targets(targets, len(entry))
        self.transform = transform
        self._rows: Optional[np.ndarray] = None
        self._pid: Optional[int] = None

    def __len__(self) -> int:
        return len(self.entry)

    def __repr__(self) -> str:
        extra = "" if self.targets is None else " with targets"
        return f"<cachekit.EntryDataset of {len(self)} rows of {self.entry.key}{extra}>"

    def __getitem__(self, index: Any) -> Any:
        i = operator.index(index)
        row = torch.from_numpy(np.array(self._array()[i]))  # a copy: the caller may write it
        return self._sample(row, None if self.targets is None else self.targets[i])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples of ``indices``, in that order, read with one sorted fancy index.

        torch's DataLoader calls this with each batch's indices (auto-collation) and passes
        the returned list of samples to ``collate_fn``.
        """
        wanted = np.asarray(indices, dtype=np.intp).reshape(-1)
        if wanted.size == 0:
            return []
        n = len(self)
        if wanted.min() < 0:
            wanted = np.where(wanted < 0, wanted + n, wanted)
        if wanted.min() < 0 or wanted.max() >= n:
            bad = wanted[(wanted < 0) | (wanted >= n)][0]
            raise IndexError(f"index {int(bad)} is out of range for {n} rows")
        order = np.argsort(wanted, kind="stable")
        # Sorted reads walk the file forwards (readahead-friendly); the fancy index copies,
        # so the tensors are writable and never alias the cache.
        ascending = torch.from_numpy(self._array()[wanted[order]]).unbind(0)
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        rows = list(ascending) if order.size == 1 else \
            list(operator.itemgetter(*position.tolist())(ascending))
        if self.transform is not None:
            rows = [self.transform(row) for row in rows]
        if self.targets is None:
            return rows
        return list(zip(rows, _take(self.targets, wanted)))

    def _sample(self, row: torch.Tensor, target: Any) -> Any:
        if self.transform is not None:
            row = self.transform(row)
        return row if self.targets is None else (row, target)

    def _array(self) -> np.ndarray:
        """The entry's rows, mapped read-only on first use in this process.

        The entry maps the files it keeps open: in the process whose call returned it, in
        the workers forked from it, and in the workers that ``spawn`` or ``forkserver``
        started, which receive those descriptors. So an entry removed since (``clear``,
        ``prune``, another process's budget) is read on there, the same bytes. A dataset
        unpickled anywhere else maps the entry by its path, and when it is gone raises a
        :class:`DatasetCorruptError` that says what to do."""
        pid = os.getpid()
        if self._rows is None or self._pid != pid:
            try:
                rows = self.entry._map()  # (a derived entry's RowView gathers itself)
            except CacheCorruptError as e:
                raise DatasetCorruptError(e.path, e.reason,
                                          not self.entry.path.exists()) from None
            # A plain ndarray view: np.memmap's __array_finalize__ is a large share of a
            # batch's fancy index (docs/dataloader.md).
            self._rows = np.asarray(rows) if isinstance(rows, np.ndarray) else rows
            self._pid = pid
        return self._rows

    def __getstate__(self) -> dict[str, Any]:
        # The entry pickles as its location and manifest; the mapping is re-made lazily.
        state = self.__dict__.copy()
        state["_rows"] = None
        state["_pid"] = None
        return state


def _as_targets(targets: Any, rows: int) -> Any:
    """Targets as a tensor or a numpy array of length ``rows``, indexed by position."""
    if targets is None:
        return None
    if isinstance(targets, torch.Tensor):
        if targets.dim() == 0:
            raise InvalidArgument("targets is a 0-d tensor; pass one target per row")
        found = targets
    elif hasattr(targets, "to_numpy") and hasattr(targets, "iloc"):  # pandas, by position
        found = targets.to_numpy()
    elif isinstance(targets, (str, bytes)) or not hasattr(targets, "__len__"):
        raise InvalidArgumentType("targets must be an array, list, pandas Series or tensor, "
                                  f"not {type(targets).__name__}")
    else:
        found = _as_array(targets)
    if len(found) != rows:
        raise InvalidArgument(f"targets has {len(found)} items but the entry has {rows} rows; "
                              "pass one target per row, in row order")
    return found


def _as_array(values: Any) -> np.ndarray:
    try:
        array = np.asarray(values)
    except ValueError:  # ragged, e.g. lists of different lengths: keep them as objects
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
    if array.ndim == 0:
        raise InvalidArgument("targets is a scalar; pass one target per row")
    return array


def _take(targets: Any, rows: np.ndarray) -> Sequence[Any]:
    if isinstance(targets, torch.Tensor):
        return targets[torch.from_numpy(rows)].unbind(0)
    return list(targets[rows])


def _check_torch_dtype(dtype: np.dtype) -> None:
    try:
        torch.from_numpy(np.zeros(0, dtype))
    except TypeError:
        raise InvalidArgumentType(f"entries of dtype {dtype} cannot be torch tensors; read "
                                  "entry.array with numpy instead") from None
