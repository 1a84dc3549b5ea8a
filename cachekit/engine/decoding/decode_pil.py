"""The ``"pil"`` backend: Pillow decodes, orients, converts and resizes one image file.

Its pixels are bit-identical to torchvision ``Resize((h, w))`` on the PIL image, and stay so: the
keys of every ``"pil"`` entry rely on it. The ``"tensor"`` backend (:mod:`.decode_tensor`) falls
back to it, file by file, for what it does not cover. Called once per row, in threads or worker
processes, so everything here is stateless and thread-safe: no global Pillow settings are changed
and no warning filters are touched. Argument values are validated by the caller.
"""

from __future__ import annotations

import math
from typing import Any, BinaryIO, Optional

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from ... import options
from ...options import FITS, MODES, RESAMPLE_NAMES
from . import payload

__all__ = ["FITS", "MODES", "RESAMPLES", "convert", "decode", "draft_scale", "fit_size", "load",
           "open_image", "orient", "orientation", "request_draft", "resized", "TRANSPOSITIONS"]

RESAMPLES: dict[str, Image.Resampling] = {
    name: Image.Resampling[name.upper()] for name in RESAMPLE_NAMES
}

_ORIENTATION = ExifTags.Base.Orientation
TRANSPOSITIONS: dict[int, Image.Transpose] = {  # as in ImageOps.exif_transpose
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# EXIF orientations 5-8 swap width and height (transpose, rotate 90/270, transverse).
_SWAPS_AXES = frozenset({5, 6, 7, 8})


def load(path: str, size: tuple[int, int], mode: str, fit: str, resample: str, draft: bool,
         max_read_bytes: Optional[int]) -> np.ndarray:
    """Decode one image file into a (C, H, W) uint8 C-contiguous array. size is (height, width).

    Steps: first frame only (animated GIF/WebP); EXIF orientation applied; pixels converted
    like ``Image.convert(mode)`` (see :func:`convert`); then resized by ``fit``:

    - ``"stretch"``: ``im.resize((w, h), resample)``, the exact pixels of torchvision
      ``Resize((h, w), interpolation=...)`` on the converted PIL image.
    - ``"crop"``: ``ImageOps.fit(im, (w, h), resample)``: the largest centered box of the
      target aspect ratio, in float coordinates (no rounding of the intermediate size or
      offset), is resampled to (w, h) in one pass with ``resize(..., box=box)``.
    - ``"pad"``: the pixels of ``ImageOps.pad(im, (w, h), resample, color=0)``: resized to
      fit inside with ``ImageOps.contain`` (aspect kept, the free side rounded), placed at
      offset ``round(free * 0.5)`` (Python's half-to-even) on zeros, i.e. transparent
      black for RGBA.

    ``draft=True`` lets libjpeg decode JPEGs at 1/2, 1/4 or 1/8 scale (``Image.draft``), the
    smallest scale still at least as large as the resize needs; other formats ignore it.
    Faster but not pixel-identical; ``draft=False`` is the exact path. Its speed and pixel
    differences, as measured, are in docs/usage.md ("Fast decoding").

    Any read or decode failure raises (``OSError``, ``UnidentifiedImageError``,
    ``DecompressionBombError``, ...); truncated files raise because ``load()`` is forced
    and ``ImageFile.LOAD_TRUNCATED_IMAGES`` is left False.  The returned array may be
    read-only (for "L" it shares the buffer Pillow produced); copy it to modify it.

    ``max_read_bytes`` (None: ``$CACHEKIT_MAX_READ_BYTES``, default 256 MiB, see
    :func:`cachekit.options.max_read_bytes`) caps the file read whole into memory: a larger
    file is parsed from the open file, with Pillow's own streaming reads and decompression
    bomb checks, to the same pixels.
    """
    height, width = size
    if max_read_bytes is None:
        max_read_bytes = options.max_read_bytes()
    # A FIFO or device path would block or never end: only regular files are opened. A file
    # up to the cap is read whole first (the same pixels; less CPU per draft decode than
    # Pillow's small reads from a file object, see docs/build-engine.md); a larger one is
    # parsed from the file, so a huge non-image costs its header, not its size.
    with payload.open_source(path, max_read_bytes) as data:  # a path, or fetched bytes
        with open_image(data, payload.name_of(path)) as im:
            return decode(im, (height, width), mode, fit, resample, draft)


def open_image(data: BinaryIO, path: str) -> Image.Image:
    """``Image.open(data)`` (the header only), its failure naming ``path``.

    A TIFF's EXIF is read here, from the open file: Pillows before 10.1 read it at the first
    ``getexif()``, and after a multi-page TIFF's ``load()`` their file is gone."""
    try:
        im = Image.open(data)
    except UnidentifiedImageError:  # its message would name the BytesIO, not the file
        raise UnidentifiedImageError(f"cannot identify image file {path!r}") from None
    if hasattr(im, "tag_v2"):
        im.getexif()
    return im


def decode(im: Image.Image, size: tuple[int, int], mode: str, fit: str, resample: str,
           draft: bool) -> np.ndarray:
    """:func:`load`'s steps on the opened image ``im``, called inside its ``with``:
    _convert may return ``im`` itself, and a closed image is not guaranteed to keep its
    pixels."""
    if draft:
        request_draft(im, size[::-1], fit)
    im.load()
    return resized(convert(orient(im), mode), size, fit, resample)


def resized(im: Image.Image, size: tuple[int, int], fit: str, resample: str) -> np.ndarray:
    """The pipeline's last step: ``im``, upright and in its final mode, resized by ``fit`` to
    ``size`` (h, w) with the filter ``resample``, as a (C, H, W) uint8 array (see
    :func:`load`). The ``"tensor"`` backend ends here too for a small DCT-scaled image."""
    height, width = size
    filt = RESAMPLES[resample]
    if fit == "stretch":
        return _chw(np.asarray(im.resize((width, height), filt)))
    if fit == "crop":
        return _chw(np.asarray(ImageOps.fit(im, (width, height), filt)))
    return _pad(im, (width, height), filt)


def request_draft(im: Image.Image, target: tuple[int, int], fit: str) -> None:
    """Let a JPEG decode at the smallest DCT scale (``Image.draft``) that still covers what
    the resize to ``target`` (w, h) samples; other formats ignore it."""
    im.draft(None, _draft_request(im.size, target, fit, orientation(im)))


def orient(im: Image.Image) -> Image.Image:
    """``im`` (loaded) turned upright by its EXIF orientation, or ``im`` itself."""
    # After load(): some formats (PNG eXIf after the pixels) only then have their EXIF.
    # The same transposition as ImageOps.exif_transpose, without its rewriting of the
    # EXIF bytes, which nothing here reads again.
    method = TRANSPOSITIONS.get(orientation(im))
    return im if method is None else im.transpose(method)


def orientation(im: Image.Image) -> Any:
    """The EXIF orientation tag of ``im`` as Pillow reads it (EXIF, else XMP), 1 when none.
    Returned as stored: a value that is not one of 2-8 leaves the image as it is."""
    return im.getexif().get(_ORIENTATION, 1)


def convert(im: Image.Image, mode: str) -> Image.Image:
    """Return ``im.convert(mode)`` pixels without the warnings Pillow emits on the way.

    A "P" image whose transparency is per-palette-entry bytes (PNG tRNS) makes Pillow warn
    "should be converted to RGBA images" on conversion to "L" or "RGB", then drop the
    transparency.  Going through "RGBA" (the conversion that warning names) gives the same
    pixels, because RGBA -> L/RGB ignores alpha, without the warning.  Every other source
    mode Image.open produces (1, L, LA, P, RGB, RGBA, CMYK, YCbCr, I;16*, I, F, and LAB via
    littlecms) converts directly in Pillow 13; "I", "I;16" and "F" are clipped to 0..255,
    not rescaled.
    """
    if im.mode == mode:
        return im
    if im.mode == "P" and mode != "RGBA" and isinstance(im.info.get("transparency"), bytes):
        im = im.convert("RGBA")
    elif im.mode == "LAB" and mode == "L":
        # Pillow converts LAB only to/from RGB(A) (through littlecms); LAB -> L raises
        # "conversion from LAB to RGB not supported".  Go through RGB explicitly.
        im = im.convert("RGB")
    return im.convert(mode)


def _pad(im: Image.Image, size: tuple[int, int], filt: Image.Resampling) -> np.ndarray:
    """Resize to fit inside ``size`` (w, h) and center on zeros, as ImageOps.pad(color=0).
    A sliver whose free side rounds to 0 pixels gives zeros, as Pillow 13's contain does
    (older Pillows raise "height and width must be > 0")."""
    width, height = size
    if min(fit_size((im.height, im.width), (height, width), "pad")) == 0:
        return np.zeros((len(im.getbands()), height, width), dtype=np.uint8)
    resized = np.asarray(ImageOps.contain(im, size, filt))
    if resized.ndim == 2:
        resized = resized[:, :, None]
    h, w, channels = resized.shape
    out = np.zeros((channels, height, width), dtype=np.uint8)
    # Same offsets as ImageOps.pad, including Python's round-half-to-even.
    top, left = round((height - h) * 0.5), round((width - w) * 0.5)
    out[:, top : top + h, left : left + w] = resized.transpose(2, 0, 1)
    return out


def _chw(hwc: np.ndarray) -> np.ndarray:
    """(H, W) or (H, W, C) -> C-contiguous (C, H, W); no copy for single-channel images."""
    if hwc.ndim == 2:
        return hwc[None]
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


def draft_scale(src: tuple[int, int], target: tuple[int, int], fit: str, orientation: int
                ) -> int:
    """The s of the 1/s DCT scale that :func:`request_draft` makes libjpeg decode a JPEG of
    size ``src`` (w, h) at for ``target`` (w, h): what ``JpegImageFile.draft`` picks."""
    request_w, request_h = _draft_request(src, target, fit, orientation)
    room = min(src[0] // request_w, src[1] // request_h)
    return next((s for s in (8, 4, 2) if room >= s), 1)


def _draft_request(
    src: tuple[int, int], target: tuple[int, int], fit: str, orientation: int
) -> tuple[int, int]:
    """The (w, h), in stored (pre-EXIF) orientation, that the resize step will sample.

    ``JpegImageFile.draft`` picks the largest scale 1/s (s in 8, 4, 2, 1) with
    ``s <= min(src_w // req_w, src_h // req_h)``, so the drafted image is never smaller
    than this request: for "stretch" the target itself, for "crop" the image scaled until
    its shorter side covers the target, for "pad" the image scaled to fit inside it.
    """
    src_w, src_h = src
    tw, th = target
    if orientation in _SWAPS_AXES:
        tw, th = th, tw
    if fit == "stretch":
        return tw, th
    pick = max if fit == "crop" else min
    scale = pick(tw / src_w, th / src_h)
    return math.ceil(src_w * scale), math.ceil(src_h * scale)


def fit_size(src: tuple[int, int], target: tuple[int, int], fit: str) -> tuple[int, int]:
    """The (height, width) the image of size ``src`` (h, w) is resized to for "stretch" and
    "pad" (for "pad", ``ImageOps.contain``'s arithmetic, its rounding included)."""
    (src_h, src_w), (h, w) = src, target
    if fit == "stretch":
        return h, w
    im_ratio, dest_ratio = src_w / src_h, w / h
    if im_ratio > dest_ratio:
        return round(src_h / src_w * w), w
    if im_ratio < dest_ratio:
        return h, round(src_w / src_h * h)
    return h, w
