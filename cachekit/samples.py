"""Generated sample images like book covers, for the demo, the benchmarks and the tests.

Real covers are smooth gradients and flat blocks with some text-like detail, 200-500 px wide
and 300-700 px high; random noise would make JPEG decoding unrealistically slow.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np


def cover(rng: np.random.Generator) -> np.ndarray:
    """One synthetic cover as an (H, W, 3) uint8 array."""
    width = int(rng.integers(200, 501))
    height = int(rng.integers(300, 701))
    top, bottom = rng.integers(0, 256, size=(2, 3))
    ramp = np.linspace(0.0, 1.0, height)[:, None]
    rows = (top * (1 - ramp) + bottom * ramp).astype(np.uint8)  # (H, 3) vertical gradient
    image = np.repeat(rows[:, None, :], width, axis=1)
    for _ in range(int(rng.integers(2, 6))):  # title blocks and an illustration
        y, x = int(rng.integers(0, height - 40)), int(rng.integers(0, width - 40))
        h, w = int(rng.integers(20, height - y)), int(rng.integers(20, width - x))
        image[y:y + h, x:x + w] = rng.integers(0, 256, size=3)
    y = int(rng.integers(0, height - 30))  # a line of "text": fine high-contrast detail
    image[y:y + 24, 10:width - 10] = np.where(rng.random((24, width - 20, 1)) < 0.35, 20, 235)
    grain = rng.integers(0, 8, size=(64, 64, 1), dtype=np.uint8)  # paper grain, tiled
    image |= np.tile(grain, (height // 64 + 1, width // 64 + 1, 1))[:height, :width]
    return image


def write_sample_images(directory: str | Path, count: int, *, seed: int = 0,
                        quality: int = 90, workers: int = 4) -> list[str]:
    """Write ``count`` cover-like JPEGs into ``directory`` (kept if already there); return paths.

    Image ``i`` of ``seed`` is always the same picture, so data sets are reproducible.
    """
    from concurrent.futures import ThreadPoolExecutor

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"cover_{seed}_{index:06d}.jpg" for index in range(count)]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # JPEG encoding releases the GIL
        list(pool.map(lambda i: _write_cover(paths[i], seed, i, quality), range(count)))
    return [str(p) for p in paths]


def _write_cover(path: Path, seed: int, index: int, quality: int) -> None:
    from PIL import Image

    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    Image.fromarray(cover(np.random.default_rng([seed, index]))).save(
        tmp, format="JPEG", quality=quality)
    os.replace(tmp, path)  # a killed generator never leaves a truncated sample behind
