"""The peer tools a user would reach for instead: joblib.Memory and Hugging Face datasets.

Both get the same per-image work as cachekit's exact path (PIL open, RGB, bilinear resize to
32x32, uint8 CHW), written as a user would write it, so the differences measured are the
caches' own. The ``zeros_*`` functions make the large hit-path payloads cheaply: a hit does
not look at pixels, only at the key and the stored file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

SIZE = (32, 32)
SHAPE = (3, *SIZE)


computed = 0
"""Calls of the cached functions below in this process: 0 after a call means it was a hit."""


def _count() -> None:
    global computed
    computed += 1


def decode(path: str) -> np.ndarray:
    """A user's per-image function: (3, 32, 32) uint8."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").resize(SIZE[::-1], Image.Resampling.BILINEAR)
        return np.asarray(small).transpose(2, 0, 1).copy()


def decode_column(paths: Any) -> np.ndarray:
    """Decode a whole column serially into one (N, 3, 32, 32) uint8 array."""
    _count()
    out = np.empty((len(paths), *SHAPE), dtype=np.uint8)
    for row, path in enumerate(paths):
        out[row] = decode(path)
    return out


def zeros_column(paths: Any) -> np.ndarray:
    """Stand-in payload for the hit fixtures: (N, 3, 32, 32) uint8 zeros."""
    _count()
    return np.zeros((len(paths), *SHAPE), dtype=np.uint8)


# --- joblib.Memory ---------------------------------------------------------------------------

def joblib_call(location: Path, fn: Any, column: Any) -> np.ndarray:
    """``Memory(location, mmap_mode="r").cache(fn)(column)``: a hit returns a read-only memmap."""
    import joblib

    memory = joblib.Memory(str(location), mmap_mode="r", verbose=0)
    return memory.cache(fn)(column)


# --- Hugging Face datasets -------------------------------------------------------------------

def decode_batch(batch: dict[str, list]) -> dict[str, list]:
    _count()
    return {"pixels": [decode(path) for path in batch["img_path"]]}


def zeros_batch(batch: dict[str, list]) -> dict[str, Any]:
    return {"pixels": zeros_column(batch["img_path"])}


def datasets_map(cache_file: Path, fn: Any, column: Any, num_proc: int = 2):
    """``Dataset.from_pandas(frame).map(fn, cache_file_name=..., num_proc=...)``.

    On a hit ``map`` finds the per-process shard files by name and maps them (Arrow); it
    returns a lazy Dataset. The name is the whole key: ``datasets`` does not check that the
    input column is the one the files were made from.
    """
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    features = datasets.Features({
        "img_path": datasets.Value("string"),
        "pixels": datasets.Array3D(shape=SHAPE, dtype="uint8"),
    })
    frame = column.rename("img_path").to_frame()
    source = datasets.Dataset.from_pandas(frame, preserve_index=False)
    return source.map(fn, batched=True, batch_size=256, features=features,
                      cache_file_name=str(cache_file), num_proc=num_proc)
