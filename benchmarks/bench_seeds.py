"""The three home-made approaches of the seed report (003), rewritten from its description.

The report's author caches a W&B sweep's image preprocessing in three steps:

1. ``image_vector(path)``: open with PIL, ``transforms.Resize((32, 32))``, ``ToTensor()``;
   called row by row over the sorted paths (the "serial loop").
2. A ``multiprocessing.Manager().dict()`` created by the parent that launches the agents,
   mapping each path to its resized PIL image, consulted before decoding.
3. The whole column of tensors (as float32 numpy arrays in a pandas Series) dumped with
   ``torch.save`` to ``<dir>/<key>.pt``, ``key = hash_pandas_object(column).sum()``, and read
   back with ``torch.load``.

The known bugs are kept on purpose, because they are what the user runs: rows are built in
``sorted`` order while the frame keeps its own order, the key ignores order and size, two
agents that miss both build and both write, and ``torch.load`` must unpickle
(``weights_only=False``), i.e. run code from whoever wrote the cache directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

SIZE = (32, 32)


def _transforms():
    from torchvision import transforms

    return transforms.Resize(SIZE), transforms.ToTensor()


def image_vector(path: str, cache: Optional["ManagerCache"] = None,
                 transforms: Optional[tuple[Any, Any]] = None) -> np.ndarray:
    """One row as the seed makes it: (3, 32, 32) float32 in [0, 1], via Resize + ToTensor.

    ``transforms``: the (Resize, ToTensor) pair, made once by the caller's loop.
    """
    from PIL import Image

    resize, to_tensor = transforms or _transforms()
    image = cache.get(path) if cache is not None else None
    if image is None:
        image = resize(Image.open(path))
        if cache is not None:
            cache.put(path, image)
    tensor = to_tensor(image)
    if tensor.shape[0] != 3:  # grayscale covers are repeated to three channels
        tensor = tensor.expand(3, *tensor.shape[1:])
    return tensor.numpy().copy()


def serial_loop(paths: Sequence[str], cache: Optional["ManagerCache"] = None) -> list[np.ndarray]:
    """The seed's build: every row in ``sorted`` order (its bug), one after the other."""
    pair = _transforms()
    return [image_vector(path, cache, pair) for path in sorted(paths)]


class ManagerCache:
    """Per-path cache of resized PIL images in a ``multiprocessing.Manager`` dict proxy.

    Every lookup and store is a round trip to the manager's server process, pickling the
    image each way; the dict lives only as long as the parent that created the manager.
    """

    def __init__(self, shared: Any) -> None:
        self.shared = shared
        self.decodes = 0

    def get(self, path: str):
        return self.shared.get(path)

    def put(self, path: str, image: Any) -> None:
        self.decodes += 1
        self.shared[path] = image


def column_key(column: Any) -> int:
    """The seed's key: the sum of the per-row hashes, so row order and size are ignored."""
    import pandas as pd

    return int(pd.util.hash_pandas_object(column).sum())


def dump_path(directory: Path, column: Any) -> Path:
    return Path(directory) / f"{column_key(column)}.pt"


def dump_load(directory: Path, column: Any) -> Optional[Any]:
    """The seed's hit: unpickle the whole Series of arrays (needs ``weights_only=False``)."""
    import torch

    path = dump_path(directory, column)
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=False)


def dump_save(directory: Path, column: Any, rows: list[np.ndarray]) -> None:
    """The seed's store: ``torch.save`` of the Series, written in place (no temp, no lock)."""
    import pandas as pd
    import torch

    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(pd.Series(rows, index=column.index, name="img_vector"),
               dump_path(directory, column))


def dump_obtain(directory: Path, column: Any) -> tuple[Any, bool]:
    """Load the dump, or build it with the serial loop and dump it; returns (rows, built)."""
    cached = dump_load(directory, column)
    if cached is not None:
        return cached, False
    rows = serial_loop(list(column))
    dump_save(directory, column, rows)
    return rows, True
