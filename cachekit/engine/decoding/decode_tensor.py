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
   a JPEG that libjpeg can decode at 1/2, 1/4 or 1/8 scale is decoded so, by Pillow's
   decoder at the scale ``Image.draft`` picks, otherwise as without it.
3. Turned upright by its EXIF orientation and converted to the mode with Pillow's formulas
   (``L = (19595 R + 38470 G + 7471 B + 32768) >> 16``, gray copied into each channel,
   alpha 255 added).
4. Resized by torch's uint8 antialiased kernel (:mod:`.resize_tensor`): the pixels of
   ``torchvision.transforms.v2`` on the upright, converted tensor, within a level of
   Pillow's (two, for a rare value: the kernels round their fixed-point weights apart); a
   DCT-scaled image of fewer than :data:`TORCH_RESIZES_FROM` pixels is resized by Pillow,
   which is faster there.

Everything else goes through the ``"pil"`` pipeline (:func:`.decode_pil.decode`, on the
image already opened), for that file alone: other formats (GIF, WebP, BMP, TIFF, ...), CMYK
and YCCK JPEGs, palette, 16-bit and low-bit PNGs, PNGs with transparency or frames, a PNG
with an alpha channel asked for in mode RGBA (Pillow resizes it with premultiplied alpha,
where torch's kernel, as v2, resizes each channel alone: they differ by far more than a
level at the edges of transparent parts), a file above the read cap, and a file torchvision
cannot decode (there Pillow raises the error reported for the row). A "crop", and every
filter but bilinear, are the ``"pil"`` pipeline for every file: torch's kernel would be
more than a level off there (:func:`.images.backend_for`).
"""

from __future__ import annotations

import io
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
from PIL import Image

from ... import options
from . import decode_pil, payload
from . import jpeg_header
from . import resize_tensor

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


def load(path: str, size: tuple[int, int], mode: str, fit: str, resample: str, draft: bool,
         max_read_bytes: Optional[int]) -> np.ndarray:
    """Decode one image file into a (C, H, W) uint8 C-contiguous array; size is (height, width).

    The steps are the module's. ``fit`` and ``resample`` as in :func:`.decode_pil.load`, but
    only "stretch" or "pad" and "bilinear" (:func:`.images.backend_for`). Raises what the
    ``"pil"`` pipeline raises for a file that cannot be decoded.
    """
    if max_read_bytes is None:
        max_read_bytes = options.max_read_bytes()
    step = _Resize(size, mode, fit, resample)
    name = payload.name_of(path)
    with payload.open_source(path, max_read_bytes) as data:  # a path, or fetched bytes
        header = jpeg_header.read(data.getvalue()) if isinstance(data, io.BytesIO) else None
        if header is not None:  # a plain JPEG: Pillow need not parse it
            row = _plain_jpeg(data.getvalue(), header, step, draft)
            if row is not None:
                return row
            with decode_pil.open_image(data, name) as im:  # refused: Pillow says why
                return decode_pil.decode(im, size, mode, fit, resample, draft)
        with decode_pil.open_image(data, name) as im:
            row = _opened(im, data, step, draft)
            if row is None:  # not covered: the "pil" pipeline, for this file
                return decode_pil.decode(im, size, mode, fit, resample, draft)
            return row


class _Resize(NamedTuple):
    """The last step of a call: the upright, decoded pixels to the row."""

    size: tuple[int, int]
    mode: str
    fit: str
    resample: str

    def of_array(self, hwc: np.ndarray, source: str) -> np.ndarray:
        """The row of ``hwc`` ((H, W, C) uint8, upright) of mode ``source`` (RGB or L)."""
        return resize_tensor.resize_fit(_converted(hwc, source, self.mode), self.size,
                                        self.fit, self.resample, options.MODES[self.mode])

    def of_image(self, im: Image.Image, drafted: bool = False) -> np.ndarray:
        """The row of ``im`` (decoded by Pillow, upright), resized by torch's kernel; a
        DCT-scaled (``drafted``) image of fewer than :data:`TORCH_RESIZES_FROM` pixels as
        the ``"pil"`` pipeline resizes it, which is faster there."""
        converted = decode_pil.convert(im, self.mode)
        if drafted and im.width * im.height < TORCH_RESIZES_FROM:
            return decode_pil.resized(converted, self.size, self.fit, self.resample)
        hwc = np.array(converted)  # a copy: Pillow's array view is read-only, torch wants it not
        return resize_tensor.resize_fit(hwc[:, :, None] if hwc.ndim == 2 else hwc, self.size,
                                        self.fit, self.resample, options.MODES[self.mode])


def _plain_jpeg(data: bytes, header: jpeg_header.Header, step: _Resize, draft: bool
                ) -> Optional[np.ndarray]:
    """The row of a JPEG whose header :mod:`.jpeg_header` read, or None when the decoder
    refuses it. With ``draft``, decoded at the DCT scale Pillow's ``Image.draft`` picks, by
    the decoder Pillow's ``load`` runs, on the whole file in one call (its own header parse
    and file reads are a third of a small draft decode's CPU)."""
    if draft:
        size = (header.width, header.height)
        scale = decode_pil.draft_scale(size, step.size[::-1], step.fit, header.orientation)
        if scale > 1:
            source = _JPEG_SOURCES[header.channels]
            scaled = ((header.width + scale - 1) // scale, (header.height + scale - 1) // scale)
            try:
                im = Image.frombytes(source, scaled, data, "jpeg", source, "", scale, 0)
            except (ValueError, OSError):  # damaged or truncated
                return None
            method = decode_pil.TRANSPOSITIONS.get(header.orientation)
            return step.of_image(im if method is None else im.transpose(method), drafted=True)
    hwc = resize_tensor.decode_jpeg(data, header.channels, header.height, header.width)
    if hwc is None:
        return None
    return step.of_array(_oriented(hwc, header.orientation), _JPEG_SOURCES[header.channels])


def _opened(im: Image.Image, data: Any, step: _Resize, draft: bool) -> Optional[np.ndarray]:
    """The row of ``im``, opened by Pillow from the file's bytes in ``data``; None when this
    backend does not cover the file."""
    if not isinstance(data, io.BytesIO):  # above the read cap: parsed from the open file
        return None
    if im.format == "JPEG" and im.mode in _JPEG_MODES:
        if draft:
            full = im.size
            decode_pil.request_draft(im, step.size[::-1], step.fit)
            if im.size != full:  # libjpeg decodes it at a reduced scale: Pillow does that
                im.load()
                return step.of_image(decode_pil.orient(im), drafted=True)
        hwc = resize_tensor.decode_jpeg(data.getvalue(), _JPEG_MODES[im.mode], im.height,
                                        im.width)
        if hwc is None:
            return None
        return step.of_array(_oriented(hwc, decode_pil.orientation(im)), im.mode)
    if (im.format == "PNG" and im.mode in _PNG_MODES and "transparency" not in im.info
            and not (step.mode == "RGBA" and im.mode in _ALPHA)
            and not getattr(im, "is_animated", False)
            and data.getvalue()[_PNG_DEPTH_AT:_PNG_DEPTH_AT + 1] == b"\x08"):
        im.load()
        return step.of_image(decode_pil.orient(im))
    return None


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
