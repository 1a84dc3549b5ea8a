"""A contact sheet: rows of an images entry side by side as one picture, each under its row
number and the tail of its path, so a person can see that row i is image i (the bug a
home-made cache had: rows assigned in another order than the column's).

Each tile is the row's pixels exactly, scaled up by a whole factor with nearest-neighbour
(a 32x32 row is drawn 3x), so a tile can be compared with the entry's row byte for byte.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from . import redaction
from .errors import InvalidArgument

TILE_PIXELS = 96
"""Rows smaller than this are scaled up by a whole factor to about this size."""
LABEL_HEIGHT = 26
LABEL_CHARS = 18
"""Characters of a path's tail shown under its tile."""
GAP = 4


def choose_rows(count: int, rows: Optional[Sequence[int]] = None, sample: int = 16,
                seed: int = 0) -> list[int]:
    """The rows a sheet shows: ``rows`` as given (checked against ``count``), else
    ``sample`` rows spread at random over the entry, in order."""
    if rows is not None:
        chosen = [int(r) for r in rows]
        bad = [r for r in chosen if not 0 <= r < count]
        if bad or not chosen:
            raise InvalidArgument(f"rows must be between 0 and {count - 1}; got "
                                  f"{bad[:5] if bad else 'none'}")
        return chosen
    if sample < 1:
        raise InvalidArgument(f"sample must be at least 1, not {sample}")
    picked = np.random.default_rng(seed).choice(count, size=min(sample, count), replace=False)
    return sorted(int(r) for r in picked)


def scale_of(shape: Sequence[int]) -> int:
    """The whole factor a row of (C, H, W) ``shape`` is drawn at."""
    return max(1, TILE_PIXELS // max(int(shape[-2]), int(shape[-1]), 1))


def layout(count: int, shape: Sequence[int]) -> tuple[int, int, int, int]:
    """(columns, cell width, cell height, scale) of a sheet of ``count`` rows of ``shape``."""
    scale = scale_of(shape)
    height, width = int(shape[-2]) * scale, int(shape[-1]) * scale
    columns = max(1, math.ceil(math.sqrt(count)))
    return columns, max(width, 6 * LABEL_CHARS) + GAP, height + LABEL_HEIGHT + GAP, scale


def tile_origin(index: int, count: int, shape: Sequence[int]) -> tuple[int, int]:
    """The (x, y) of the top left pixel of the ``index``-th tile of a sheet."""
    columns, cell_width, cell_height, _ = layout(count, shape)
    return GAP + (index % columns) * cell_width, GAP + (index // columns) * cell_height


def contact_sheet(array: Any, rows: Sequence[int],
                  labels: Optional[Sequence[str]] = None) -> Any:
    """A PIL image of ``rows`` of ``array`` ((N, C, H, W) uint8, C of 1, 3 or 4), each
    under ``row N`` and, with ``labels``, the tail of its label (one per row of the
    entry)."""
    from PIL import Image, ImageDraw

    shape = tuple(array.shape)
    if len(shape) != 4 or shape[1] not in (1, 3, 4) or np.dtype(array.dtype) != np.uint8:
        raise InvalidArgument(f"a contact sheet shows images entries ((N, C, H, W) uint8 "
                              f"with C of 1, 3 or 4); this entry holds {array.dtype} {shape}")
    columns, cell_width, cell_height, scale = layout(len(rows), shape)
    lines = math.ceil(len(rows) / columns)
    sheet = Image.new("RGB", (GAP + columns * cell_width, GAP + lines * cell_height), "white")
    draw = ImageDraw.Draw(sheet)
    for index, row in enumerate(rows):
        pixels = np.asarray(array[row]).transpose(1, 2, 0)
        if scale > 1:
            pixels = pixels.repeat(scale, axis=0).repeat(scale, axis=1)
        tile = Image.fromarray(pixels[:, :, 0] if shape[1] == 1 else pixels,
                               {1: "L", 3: "RGB", 4: "RGBA"}[shape[1]]).convert("RGB")
        x, y = tile_origin(index, len(rows), shape)
        sheet.paste(tile, (x, y))
        text = f"row {row}"
        if labels is not None:
            label = redaction.value(labels[row])
            text += "\n" + (label if len(label) <= LABEL_CHARS else "..." + label[-LABEL_CHARS:])
        draw.multiline_text((x, y + tile.height + 1), text, fill="black", spacing=1)
    return sheet
