"""The ``"tensor"`` backend: torchvision decodes JPEGs, torch's uint8 antialiased kernel resizes.

One file, step by step:

1. Read whole (up to the read cap) and its header parsed by Pillow (``Image.open``), so a
   file is identified, refused as a decompression bomb, and oriented exactly as the
   ``"pil"`` pipeline does it; a plain JPEG's header is read by :mod:`.jpeg_header`
   instead, which answers as Pillow would, in a fraction of its time.
2. Decoded to uint8: an 8-bit RGB or grayscale JPEG by torchvision's decoder (libjpeg-turbo:
   the pixels Pillow's libjpeg-turbo gives); an 8-bit L, LA, RGB or RGBA PNG, neither
   animated nor with a transparency chunk, by Pillow (torchvision 0.29's PNG decoder crashed
   the process on a PNG with a damaged data stream, so it is not used). With ``draft=True``
   a JPEG that libjpeg can decode at 1/2, 1/4 or 1/8 scale is decoded so by Pillow
   (``Image.draft``), otherwise as without it; a DCT-scaled image of fewer than
   :data:`TORCH_RESIZES_FROM` pixels is then the ``"pil"`` pipeline's to resize.
3. Turned upright by its EXIF orientation and converted to the mode with Pillow's formulas
   (``L = (19595 R + 38470 G + 7471 B + 32768) >> 16``, gray copied into each channel,
   alpha 255 added).
4. Resized with torch's uint8 antialiased kernel (:mod:`.resize_tensor`): the pixels of
   ``torchvision.transforms.v2`` on the upright, converted tensor.

Everything else goes through the ``"pil"`` pipeline (:func:`.decode_pil.decode`, on the
image already opened), for that file alone: other formats (GIF, WebP, BMP, TIFF, ...), CMYK
and YCCK JPEGs, palette, 16-bit and low-bit PNGs, PNGs with transparency or frames, a PNG
with an alpha channel asked for in mode RGBA (Pillow resizes it with premultiplied alpha,
where torch's kernel, as v2, resizes each channel alone: they differ by far more than a
level at the edges of transparent parts), a file above the read cap, and a file torchvision
cannot decode (there Pillow raises the error reported for the row). The ``nearest``,
``lanczos`` and ``box`` filters are the ``"pil"`` pipeline for every file
(:func:`.images.backend_for`).
"""

from __future__ import annotations

import io
from typing import Any, Callable, Optional

import numpy as np
from PIL import Image

from .. import _fs, options
from . import decode_pil, jpeg_header, resize_tensor

__all__ = ["load"]

TORCH_RESIZES_FROM = 8192
"""Pixels of a DCT-scaled image (``draft=True``) from which torch's kernel resizes it faster
than Pillow's: below, Pillow's smaller fixed cost per call wins (measured with
benchmarks/bench_backends.py, see docs/usage.md)."""
_JPEG_MODES = {"RGB": 3, "L": 1}
_JPEG_SOURCES = {channels: mode for mode, channels in _JPEG_MODES.items()}
_PNG_MODES = frozenset({"L", "LA", "RGB", "RGBA"})
_ALPHA = frozenset({"LA", "RGBA"})  # resized premultiplied by Pillow, not by torch's kernel
_PNG_DEPTH_AT = 24  # IHDR's bit depth: signature 8, chunk length 4, type 4, width 4, height 4

_UPRIGHT: dict[int, Callable[[np.ndarray], np.ndarray]] = {  # views, as decode_pil.TRANSPOSITIONS
    2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda a: a[::-1, ::-1],  # ROTATE_180
    4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
    5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],  # ROTATE_270
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # TRANSVERSE
    8: lambda a: a.transpose(1, 0, 2)[::-1],  # ROTATE_90
}


def load(
    path: str,
    size: tuple[int, int],
    mode: str = "RGB",
    fit: str = "stretch",
    resample: str = "bilinear",
    draft: bool = False,
    max_read_bytes: Optional[int] = None,
) -> np.ndarray:
    """Decode one image file into a (C, H, W) uint8 C-contiguous array; size is (height, width).

    The steps are the module's. ``fit`` and ``resample`` as in :func:`.decode_pil.load`, with
    the geometry of :mod:`.resize_tensor`; ``resample`` must be "bilinear" or "bicubic".
    Raises what the ``"pil"`` pipeline raises for a file that cannot be decoded.
    """
    height, width = size
    if max_read_bytes is None:
        max_read_bytes = options.max_read_bytes()
    with _fs.read_capped(path, max_read_bytes, follow_symlinks=True) as data:
        header = None
        if isinstance(data, io.BytesIO) and not draft:
            header = jpeg_header.read(data.getvalue())
        if header is not None:  # a plain JPEG: Pillow need not parse it
            pixels = _plain_jpeg(data.getvalue(), header, mode)
        else:
            with decode_pil.open_image(data, path) as im:
                pixels = _upright(im, data, mode, (width, height), fit, draft)
                if pixels is None:  # not covered: the "pil" pipeline, for this file
                    return decode_pil.decode(im, (height, width), mode, fit, resample, draft)
        if pixels is None:  # torchvision refused it: Pillow decodes it, or says why not
            with decode_pil.open_image(data, path) as im:
                return decode_pil.decode(im, (height, width), mode, fit, resample, draft)
    return resize_tensor.resize_fit(pixels, (height, width), fit, resample, options.MODES[mode])


def _plain_jpeg(data: bytes, header: jpeg_header.Header, mode: str) -> Optional[np.ndarray]:
    """:func:`_upright` for a JPEG whose header :mod:`.jpeg_header` read, or None when
    torchvision refuses it."""
    hwc = resize_tensor.decode_jpeg(data, header.channels, header.height, header.width)
    if hwc is None:
        return None
    return _converted(_oriented(hwc, header.orientation), _JPEG_SOURCES[header.channels], mode)


def _upright(im: Image.Image, data: Any, mode: str, target: tuple[int, int], fit: str,
             draft: bool) -> Optional[np.ndarray]:
    """The decoded pixels of ``im`` (the file's bytes in ``data``), upright, as (H, W, C) uint8
    in C order, in ``mode`` but for what the resize fills up (gray copied into three
    channels, alpha 255 added: :func:`.resize_tensor.resize_fit`). None when this backend
    does not cover the file."""
    if not isinstance(data, io.BytesIO):  # above the read cap: parsed from the open file
        return None
    if im.format == "JPEG" and im.mode in _JPEG_MODES:
        if draft:
            full = im.size
            decode_pil.request_draft(im, target, fit)
            if im.size != full:  # libjpeg decodes it at a reduced scale: Pillow does that
                if im.width * im.height < TORCH_RESIZES_FROM:
                    return None  # and resizes it faster than torch: the "pil" pipeline
                return _from_pillow(im, mode)
        hwc = resize_tensor.decode_jpeg(data.getvalue(), _JPEG_MODES[im.mode], im.height,
                                        im.width)
        if hwc is None:
            return None
        return _converted(_oriented(hwc, decode_pil.orientation(im)), im.mode, mode)
    if (im.format == "PNG" and im.mode in _PNG_MODES and "transparency" not in im.info
            and not (mode == "RGBA" and im.mode in _ALPHA)
            and not getattr(im, "is_animated", False)
            and data.getvalue()[_PNG_DEPTH_AT:_PNG_DEPTH_AT + 1] == b"\x08"):
        return _from_pillow(im, mode)
    return None


def _from_pillow(im: Image.Image, mode: str) -> np.ndarray:
    """``im`` decoded, oriented and converted by Pillow, as the ``"pil"`` pipeline does."""
    im.load()
    converted = decode_pil.convert(decode_pil.orient(im), mode)
    hwc = np.array(converted)  # a copy: Pillow's array view is read-only, torch wants it not
    return hwc[:, :, None] if hwc.ndim == 2 else hwc


def _oriented(hwc: np.ndarray, orientation: Any) -> np.ndarray:
    """``hwc`` turned upright for the EXIF ``orientation`` (a view; unchanged for 1 and for
    what is not one of 2-8, as in the "pil" pipeline)."""
    turn = _UPRIGHT.get(orientation)
    return hwc if turn is None else turn(hwc)


def _converted(hwc: np.ndarray, source: str, mode: str) -> np.ndarray:
    """``hwc`` of mode ``source`` (RGB or L) in ``mode``, in C order, but for what the resize
    fills up. RGB to L is Pillow's own conversion (``Image.convert``, exact)."""
    if mode == "L" and source == "RGB":
        rgb = Image.frombuffer("RGB", (hwc.shape[1], hwc.shape[0]), np.ascontiguousarray(hwc),
                               "raw", "RGB", 0, 1)
        return np.array(rgb.convert("L"))[:, :, None]
    return np.ascontiguousarray(hwc)
