"""torch's side of the ``"tensor"`` backend: torchvision's JPEG decoder and torch's uint8
antialiased resize.

The resize is the kernel ``torchvision.transforms.v2.functional.resize`` runs on a uint8
tensor (``torch.nn.functional.interpolate(..., antialias=True)``), called the way it calls
it, so the pixels are v2's on the same tensor. It serves the fits whose geometry torch's
kernel can give as Pillow's, in Pillow's arithmetic:

- ``"stretch"``: ``resize(img, [h, w])``;
- ``"pad"``: ``resize`` to the size ``ImageOps.contain`` picks, then zeros around it at
  ``ImageOps.pad``'s offsets.

(A ``"crop"`` resamples ``ImageOps.fit``'s box in float coordinates, which torch's kernel,
sampling from whole pixels, cannot: :func:`.images.backend_for` leaves it to Pillow.)

Importing this module imports torch (seconds, once per process) and loads torchvision's
image extension without importing torchvision, whose own import costs about as much again.
In a cachekit worker process torch is set to one intra-op thread: a worker computes one row
at a time (the builder's threads never need it: nothing here runs torch's intra-op pool,
see docs/build-engine.md).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import os
import platform
import sys
import warnings
from typing import Any, Callable, Optional

import numpy as np
import torch
from PIL import Image
from torch.nn import functional

from ...messages import prefix
from ..running import _worker_main
from .decode_pil import fit_size
from .images import decoder_versions

__all__ = ["decode_jpeg", "resize_fit"]

if _worker_main.serving():
    torch.set_num_threads(1)


def _image_ops() -> Any:
    """``torch.ops.image``, torchvision's decoders, loaded without importing torchvision.

    ``import torchvision`` imports its models and ops, and through them torch._dynamo: more
    CPU than torch's own import, paid by every worker process. The extension library is
    the one ``torchvision.io`` loads (``torch.ops.load_library`` on the same file, so a
    later ``import torchvision`` finds it loaded); when it cannot be found that way,
    torchvision.io loads it.
    """
    if "torchvision.io" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")  # a top-level package: not imported
        folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
        finder = folder and importlib.machinery.FileFinder(
            folder, (importlib.machinery.ExtensionFileLoader,
                     importlib.machinery.EXTENSION_SUFFIXES))
        library = finder and finder.find_spec("image_stable")
        if library is not None and library.origin:
            torch.ops.load_library(library.origin)
        else:
            import torchvision.io  # noqa: F401  (registers torch.ops.image)
    return torch.ops.image


# The op itself, not torchvision.io.decode_jpeg: that wrapper warns (DeprecationWarning,
# torchvision 0.29) on every call, and a warning filter cannot be set per thread. It is
# called with (data, mode) only: torchvision 0.16's op takes no third argument, and the
# apply_exif_orientation that 0.17 added defaults to False, as orientation is applied here.
_DECODE_JPEG: Callable[..., torch.Tensor] = _image_ops().decode_jpeg
_UNCHANGED = 0  # torchvision.io.ImageReadMode.UNCHANGED: the file's own channels


def _decoded(data: bytes) -> torch.Tensor:
    """torchvision's (C, H, W) uint8 tensor of the JPEG ``data``: the one call of the op, so
    that :func:`decoder_fault` tries it exactly as :func:`decode_jpeg` makes it."""
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # writable: no warning
    return _DECODE_JPEG(encoded, _UNCHANGED)


def decoder_fault() -> Optional[str]:
    """Why torchvision's decoder cannot decode a small JPEG that Pillow wrote, or None when
    it can. A fault here is the decoder's, not a file's: every JPEG would fall back to the
    "pil" pipeline, unseen (as all did on torchvision 0.16 while the op was called with a
    third argument it does not take)."""
    sample = io.BytesIO()
    Image.new("L", (16, 8), 128).save(sample, "JPEG")
    try:
        decoded = _decoded(sample.getvalue())
    except (RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    if tuple(decoded.shape) != (1, 8, 16):
        return f"it gave a tensor of shape {tuple(decoded.shape)} for an 8 x 16 gray image"
    return None


def _check_decoder() -> bool:
    """Whether torchvision's decoder works here; warns once, in this process, when not."""
    fault = decoder_fault()
    if fault is not None:
        warnings.warn(f"{prefix()}: torchvision's JPEG decoder fails here ({fault}), so the "
                      "tensor backend decodes JPEGs with Pillow in this process: the \"pil\" "
                      "pipeline's pixels and speed for them (torchvision "
                      f"{decoder_versions()['torchvision']})", RuntimeWarning, stacklevel=2)
    return fault is None


_DECODER_WORKS = _check_decoder()


def decode_jpeg(data: bytes, channels: int, height: int, width: int) -> Optional[np.ndarray]:
    """The (H, W, C) uint8 pixels libjpeg-turbo decodes from the JPEG ``data`` (writable, C
    order), or None when torchvision refuses the file or gives another shape than the
    header promised (the caller then lets Pillow decode it, and report its error)."""
    if not _DECODER_WORKS:
        return None
    try:
        decoded = _decoded(data)
    except RuntimeError:
        return None
    if tuple(decoded.shape) != (channels, height, width):
        return None
    hwc = decoded.permute(1, 2, 0)  # torchvision's CHW is a view of libjpeg's HWC rows
    return hwc.numpy() if hwc.is_contiguous() else np.ascontiguousarray(hwc.numpy())


def resize_fit(hwc: np.ndarray, size: tuple[int, int], fit: str, resample: str,
               channels: int) -> np.ndarray:
    """``hwc`` ((H, W, C) uint8, C order) resized by ``fit`` ("stretch" or "pad") to
    ``size`` (h, w): the (channels, h, w) uint8 C-contiguous row.

    When ``channels`` is more than C, the resized image is filled up before any padding: a
    single channel copied into the first three, a fourth (alpha) set to 255. The pixels are
    those of filling up first, on fewer pixels: torch's kernel resizes each channel alike
    whatever their number, and keeps a constant channel constant.
    """
    h, w = size
    scaled = fit_size(hwc.shape[:2], size, fit)
    if min(scaled) == 0:  # "pad" of a sliver: ImageOps.contain gives an empty image
        return np.zeros((channels, h, w), dtype=np.uint8)
    resized = _resize(hwc, scaled, resample)
    if fit == "stretch":
        if resized.shape[0] == channels and resized.flags.c_contiguous:
            return resized  # torch's new output itself
        return _filled(resized, channels, np.empty((channels, h, w), dtype=np.uint8))
    rh, rw = scaled
    out = np.zeros((channels, h, w), dtype=np.uint8)
    top, left = round((h - rh) * 0.5), round((w - rw) * 0.5)  # as ImageOps.pad
    _filled(resized, channels, out[:, top:top + rh, left:left + rw])
    return out


def _filled(chw: np.ndarray, channels: int, out: np.ndarray) -> np.ndarray:
    """``chw`` copied into ``out`` ((channels, h, w)), filled up as resize_fit says."""
    if chw.shape[0] == channels:
        out[...] = chw
        return out
    out[:3] = chw[:3]  # one gray channel broadcasts into three
    if channels == 4:
        out[3] = chw[3] if chw.shape[0] == 4 else 255
    return out


def _resize(hwc: np.ndarray, size: tuple[int, int], resample: str) -> np.ndarray:
    """``resize_image`` of torchvision.transforms.v2 on the CHW view of ``hwc``: the (C, h, w)
    result, as an array over the tensor's memory."""
    image = torch.from_numpy(hwc).permute(2, 0, 1).unsqueeze(0)  # channels_last 1CHW
    if tuple(size) == hwc.shape[:2]:
        return image[0].numpy()
    if _NATIVE_UINT8[resample]:
        out = functional.interpolate(image, size=list(size), mode=resample,
                                     align_corners=False, antialias=True)
    else:  # as v2 does where torch has no uint8 bilinear kernel: in float32, rounded (v2
        # clamps first only for bicubic, which always has its uint8 kernel)
        out = functional.interpolate(image.to(torch.float32), size=list(size), mode=resample,
                                     align_corners=False, antialias=True)
        out = out.round_().to(torch.uint8)
    return out[0].numpy()


def _native_uint8() -> dict[str, bool]:
    """Where v2's resize runs torch's kernel on uint8 itself (``_do_native_uint8_resize_on_cpu``
    in torchvision.transforms.v2.functional): bicubic always, bilinear on AVX2, AVX-512 and
    ARM64 CPUs."""
    vector = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
              or platform.machine() in ("aarch64", "arm64"))
    return {"bilinear": vector, "bicubic": True}


_NATIVE_UINT8 = _native_uint8()
