"""Decode, orient, convert and resize one image file: the decoding backends' one entry point.

:func:`load_image` turns a path into a (C, H, W) uint8 row with the backend asked for:

- ``"pil"`` (:mod:`.decode_pil`): Pillow throughout, bit-identical to
  torchvision ``Resize((h, w))`` on the PIL image;
- ``"tensor"`` (:mod:`.decode_tensor`): torchvision's JPEG decoder, then torch's uint8
  antialiased resize, the pixels of ``torchvision.transforms.v2`` on the decoded tensor; a file
  or setting it does not cover goes through ``"pil"`` for that file.

A backend is a module with a ``load`` of :func:`load_image`'s signature (the
:class:`Backend` protocol), imported on first use: a build with ``"pil"`` never imports
torch. A device backend (batched nvJPEG decoding on a GPU) would be one more such module,
with a second entry point that fills a whole piece of rows at once; see docs/usage.md.
"""

from __future__ import annotations

import functools

import importlib
from typing import Optional, Protocol

import numpy as np

from ...options import BACKENDS, FITS, MODES, RESAMPLE_NAMES

__all__ = ["BACKENDS", "FITS", "MODES", "RESAMPLE_NAMES", "TENSOR_RESAMPLES", "Backend",
           "TENSOR_FITS", "backend_for", "decoder_versions", "load_image"]

TENSOR_FITS: tuple[str, ...] = ("stretch", "pad")
TENSOR_RESAMPLES: tuple[str, ...] = ("bilinear",)
"""Where the ``"tensor"`` backend runs: where torch's uint8 antialiased resize stays within a
level of the ``"pil"`` pipeline's pixels (:func:`backend_for`)."""

_MODULES = {"pil": "decode_pil", "tensor": "decode_tensor"}
_LOADED: dict[str, Backend] = {}


class Backend(Protocol):
    """What decodes a row: ``load(path, size, mode, fit, resample, draft, max_read_bytes)``
    returns the (C, H, W) uint8 row, or raises for a file that cannot be decoded."""

    def load(self, path: str, size: tuple[int, int], mode: str, fit: str, resample: str,
             draft: bool, max_read_bytes: Optional[int]) -> np.ndarray: ...


def backend_for(backend: str, fit: str, resample: str) -> str:
    """The backend that decodes every file of a call: ``backend``, or ``"pil"`` for a
    ``"tensor"`` call that torch's kernel cannot resize within a level of Pillow's pixels.

    Bilinear "stretch" and "pad" it can. A "crop" it cannot: ``ImageOps.fit`` samples its box in
    float coordinates, torch's kernel from whole pixels, up to half a pixel apart (docs/usage.md
    gives how far off, measured). Nor bicubic: each of torch's 1-D passes is within a level of
    Pillow's, but Pillow picks the order of its two passes per image and clips in between, torch
    does not. Nor nearest, lanczos and box, which torch's kernel does not have. There, resizing
    torchvision's pixels with Pillow would cost more than Pillow decoding them itself (handing them
    over copies them), so the whole call is the ``"pil"`` pipeline, with its key.
    """
    if backend == "tensor" and (fit not in TENSOR_FITS or resample not in TENSOR_RESAMPLES):
        return "pil"
    return backend


def load_image(
    path: str,
    size: tuple[int, int],
    mode: str = "RGB",
    fit: str = "stretch",
    resample: str = "bilinear",
    draft: bool = False,
    max_read_bytes: Optional[int] = None,
    backend: str = "tensor",
) -> np.ndarray:
    """Decode one image file into a (C, H, W) uint8 C-contiguous array; size is (height, width).

    The steps and their pixels are each backend's (:func:`.decode_pil.load`,
    :func:`.decode_tensor.load`). Any read or decode failure raises the error Pillow gives
    for the file (``OSError``, ``UnidentifiedImageError``, ``DecompressionBombError``, ...),
    whatever the backend. The array may be read-only; copy it to modify it.
    """
    name = backend_for(backend, fit, resample)
    module = _LOADED.get(name)
    if module is None:
        module = _LOADED[name] = importlib.import_module(f".{_MODULES[name]}", __package__)
    return module.load(path, size, mode, fit, resample, draft, max_read_bytes)


def decoder_versions() -> dict[str, Optional[str]]:
    """The versions of what decodes the images: Pillow, its libjpeg (the libjpeg API level,
    e.g. "6.2" or "8.0") and libjpeg-turbo when that is the implementation, torch and
    torchvision (None when not installed). Recorded in an images entry's manifest
    (``builder.decoders``), not in its key: see docs/object-stores.md. Read once per
    process (package metadata costs milliseconds, and a fold builds in tens of them)."""
    return dict(_decoder_versions())


@functools.lru_cache(maxsize=1)
def _decoder_versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    import PIL
    from PIL import features

    def version(feature: str) -> Optional[str]:
        try:
            return features.version(feature)
        except (ValueError, KeyError):  # a feature this Pillow does not know
            return None

    def installed(package: str) -> Optional[str]:
        try:  # from the package's metadata: importing torch would cost seconds
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {"pillow": PIL.__version__, "libjpeg": version("jpg"),
            "libjpeg_turbo": version("libjpeg_turbo"), "torch": installed("torch"),
            "torchvision": installed("torchvision")}
