"""The "tensor" backend: torchvision v2's pixels on the decoded tensor, within one level of the
"pil" pipeline, the fallbacks to it, and the key that tells the two apart.

References are built here from public APIs only: torchvision.io's decoders, the
torchvision.transforms.v2 functionals, Pillow's own conversion formula written out in torch,
and the "pil" pipeline. Image files are real ones, written into tmp_path.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
import torch  # resize_tensor imports it anyway
from hypothesis import HealthCheck, example, given, settings, strategies as st
import PIL
from PIL import Image, ImageOps, features

import cachekit
from cachekit.engine.decoding import decode_pil, decode_tensor, images, jpeg_header, resize_tensor
from cachekit.engine.decoding.images import load_image
from helpers import LazyModule

tvio = LazyModule("torchvision.io")  # torchvision: imported by the tests that use it
VF = LazyModule("torchvision.transforms.v2.functional")

FITS = ("stretch", "crop", "pad")
MODES = ("RGB", "L", "RGBA")
MODES_CHANNELS = {"RGB": 3, "L": 1, "RGBA": 4}
FILTERS = ("bilinear", "bicubic")
TENSOR_CASES = {("stretch", "bilinear"), ("pad", "bilinear")}
"""(fit, resample) that torch's kernel resizes; the rest is the "pil" pipeline throughout."""


def pixels(h: int, w: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """Gradients, a block and noise: every kernel tap and offset leaves a trace."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    planes = [x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256,
              255 - (x * y) % 256][:channels]
    img = np.stack(planes, -1)
    img[h // 4: h // 2, w // 3: w // 2] = (250, 10, 120, 200)[:channels]
    return np.clip(img + rng.integers(-20, 21, img.shape), 0, 255).astype(np.uint8)


def write(path: Path, image: Image.Image, **options) -> str:
    image.save(path, **options)
    return str(path)


def sources(folder: Path, h: int = 40, w: int = 60, seed: int = 0) -> dict[str, str]:
    """One file per kind the tensor path covers: (name -> path)."""
    rgb = Image.fromarray(pixels(h, w, seed))
    rgba = Image.fromarray(pixels(h, w, seed, 4), "RGBA")
    gray = rgb.convert("L")
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "jpeg-rgb": write(folder / "rgb.jpg", rgb, quality=90),
        "jpeg-rgb-444": write(folder / "rgb444.jpg", rgb, quality=95, subsampling=0),
        "jpeg-progressive": write(folder / "progressive.jpg", rgb, progressive=True),
        "jpeg-gray": write(folder / "gray.jpg", gray),
        "png-rgb": write(folder / "rgb.png", rgb),
        "png-gray": write(folder / "gray.png", gray),
        "png-rgba": write(folder / "rgba.png", rgba),
        "png-la": write(folder / "la.png", rgba.convert("LA")),
    }


@pytest.fixture(scope="module")
def covered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return sources(tmp_path_factory.mktemp("covered"))


# --- the reference: torchvision.io and v2 functionals on the decoded tensor ---------------

def decoded_tensor(path: str) -> torch.Tensor:
    """The upright uint8 CHW tensor torchvision.io decodes from the file."""
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders, loudly
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return tvio.decode_image(data, apply_exif_orientation=True)
        except TypeError:  # torchvision 0.16 has no such argument: its pixels as stored
            return upright_by_pillow(tvio.decode_image(data), path)


def upright_by_pillow(t: torch.Tensor, path: str) -> torch.Tensor:
    """``t`` turned as ``ImageOps.exif_transpose`` turns the file at ``path``: each plane
    an "L" image tagged with the file's orientation."""
    with Image.open(path) as im:
        exif = im.getexif()
    planes = []
    for plane in t.numpy():
        image = Image.fromarray(plane)
        image.info["exif"] = exif.tobytes()
        planes.append(np.asarray(ImageOps.exif_transpose(image)))
    return torch.from_numpy(np.stack(planes))


def pillow_mode(t: torch.Tensor, mode: str) -> torch.Tensor:
    """``Image.convert(mode)`` of a CHW tensor in L, LA, RGB or RGBA, written out in torch.

    The result keeps the decoders' layout, a CHW view of HWC rows (torch 2.14's uint8 kernel
    fails an internal assert on a plain CHW 3-channel tensor resized to 1 x 1).
    """
    hwc = t.permute(1, 2, 0)
    channels = hwc.shape[2]
    color = hwc[..., :3] if channels >= 3 else hwc[..., :1].expand(-1, -1, 3)
    if mode == "L":
        if channels < 3:
            out = hwc[..., :1]
        else:
            r, g, b = color.to(torch.int32).unbind(2)
            out = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8)[..., None]
    elif mode == "RGB":
        out = color
    else:
        alpha = hwc[..., -1:] if channels in (2, 4) else torch.full_like(hwc[..., :1], 255)
        out = torch.cat([color, alpha], 2)
    return out.contiguous().permute(2, 0, 1)


def reference(path: str, size: tuple[int, int], mode: str, fit: str, resample: str
              ) -> np.ndarray:
    """torchvision v2's pixels for cachekit's tensor path, on torchvision.io's tensor."""
    t = pillow_mode(decoded_tensor(path), mode)
    interpolation = VF.InterpolationMode[resample.upper()]
    if fit == "stretch":
        out = VF.resize(t, list(size), interpolation, antialias=True)
    else:
        h, w = size
        scaled = decode_pil.fit_size(tuple(t.shape[1:]), size, "pad")
        if min(scaled) == 0:  # ImageOps.contain of a sliver: an empty image, all padding
            return np.zeros((t.shape[0], h, w), dtype=np.uint8)
        resized = VF.resize(t, list(scaled), interpolation, antialias=True)
        top, left = round((h - scaled[0]) * 0.5), round((w - scaled[1]) * 0.5)
        out = VF.pad(resized, [left, top, w - scaled[1] - left, h - scaled[0] - top], fill=0)
    return out.numpy()


def off_by(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


# --- pixels --------------------------------------------------------------------------------

@pytest.mark.parametrize("resample", FILTERS)
@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [(10, 10), (16, 24), (20, 10), (80, 80)])
def test_pixels_are_v2_on_the_decoded_tensor_and_within_one_level_of_pil(
        covered: dict[str, str], size: tuple[int, int], mode: str, fit: str,
        resample: str) -> None:
    for name, path in covered.items():
        out = load_image(path, size, mode, fit, resample)
        assert out.dtype == np.uint8 and out.shape == (MODES_CHANNELS[mode], *size)
        assert out.flags.c_contiguous
        pil = load_image(path, size, mode, fit, resample, backend="pil")
        assert off_by(out, pil) <= 1, name
        if (fit, resample) not in TENSOR_CASES or (mode == "RGBA" and name in ALPHA):
            np.testing.assert_array_equal(out, pil, err_msg=name)  # see the tests below
        else:
            np.testing.assert_array_equal(out, reference(path, size, mode, fit, resample),
                                          err_msg=name)


ALPHA = ("png-rgba", "png-la")


@pytest.mark.parametrize("fit", ["stretch", "pad"])
def test_an_alpha_channel_kept_is_resized_by_pillow(covered: dict[str, str], fit: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Pillow resizes RGBA and LA premultiplied: colors under transparent pixels do not
    # bleed. v2's kernel resizes each channel alone, which here differs by tens of levels.
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    for name in ALPHA:
        path = covered[name]
        out = load_image(path, (10, 10), "RGBA", fit)
        np.testing.assert_array_equal(out, load_image(path, (10, 10), "RGBA", fit,
                                                      backend="pil"))
        assert off_by(out, reference(path, (10, 10), "RGBA", fit, "bilinear")) > 1
    assert resized.count == 0


def test_the_decoded_tensor_is_the_one_pillow_decodes(covered: dict[str, str]) -> None:
    for name, path in covered.items():
        with Image.open(path) as im:
            ours = np.asarray(im)
        theirs = decoded_tensor(path).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(theirs, ours.reshape(theirs.shape), err_msg=name)


FILE_PER_EXAMPLE = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
"""Each example writes its image into the test's tmp_path (overwriting the last one)."""


@st.composite
def geometry(draw) -> tuple[tuple[int, int], tuple[int, int]]:
    h, w = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    src = (draw(st.integers(1, 120)), draw(st.integers(1, 120)))
    return src, (h, w)


@settings(max_examples=60, deadline=None, suppress_health_check=FILE_PER_EXAMPLE)
@given(geometry(), st.sampled_from(FITS), st.sampled_from(MODES), st.sampled_from(FILTERS),
       st.sampled_from(["jpg", "png"]), st.integers(0, 2**16))
@example(((18, 18), (16, 16)), "stretch", "RGB", "bilinear", "png", 29)  # two levels off
def test_any_geometry_is_v2_on_the_decoded_tensor(tmp_path: Path, shapes, fit: str, mode: str,
                                                  resample: str, ext: str, seed: int) -> None:
    (src_h, src_w), size = shapes
    path = write(tmp_path / f"any.{ext}", Image.fromarray(pixels(src_h, src_w, seed)))
    out = load_image(path, size, mode, fit, resample)
    if (fit, resample) in TENSOR_CASES:
        np.testing.assert_array_equal(out, reference(path, size, mode, fit, resample))
    # Two levels for a rare value: torch's and Pillow's kernels round their fixed-point
    # weights apart (an 18 x 18 PNG to 16 x 16, seed 29; docs/usage.md has the figures).
    assert off_by(out, load_image(path, size, mode, fit, resample, backend="pil")) <= 2


@pytest.mark.parametrize("ext", ["jpg", "png"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_pillow_does(tmp_path: Path, orientation: int,
                                                    ext: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = write(tmp_path / f"tagged.{ext}", Image.fromarray(pixels(40, 64, seed=2)),
                 exif=exif, **({"quality": 95} if ext == "jpg" else {}))
    size = (20, 12)
    with Image.open(path) as im:
        upright = np.asarray(ImageOps.exif_transpose(im))
    for fit in FITS:
        out = load_image(path, size, "RGB", fit)
        if fit != "crop":  # (a crop is the "pil" pipeline's)
            np.testing.assert_array_equal(out, reference(path, size, "RGB", fit, "bilinear"))
        assert off_by(out, load_image(path, size, "RGB", fit, backend="pil")) <= 1
    # the upright image itself, through a resize that changes nothing
    same = load_image(path, upright.shape[:2], "RGB", "stretch")
    np.testing.assert_array_equal(same, upright.transpose(2, 0, 1))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_upright_views_are_pillows_transpositions(orientation: int) -> None:
    a = pixels(5, 7, seed=orientation)
    method = decode_pil.TRANSPOSITIONS.get(orientation)
    ref = a if method is None else np.asarray(Image.fromarray(a).transpose(method))
    np.testing.assert_array_equal(decode_tensor._oriented(a, orientation), ref)


@pytest.mark.parametrize("source", ["RGB", "L"])
@pytest.mark.parametrize("mode", MODES)
def test_mode_conversion_is_pillows(tmp_path: Path, source: str, mode: str) -> None:
    image = Image.fromarray(pixels(30, 50, seed=5))
    if source == "L":
        image = image.convert("L")
    path = write(tmp_path / "m.jpg", image, quality=95)
    with Image.open(path) as im:
        ref = np.asarray(im.convert(mode))
    out = load_image(path, (30, 50), mode)  # no resize: the converted pixels themselves
    np.testing.assert_array_equal(out, ref.reshape(30, 50, -1).transpose(2, 0, 1))


def test_rgba_padding_is_transparent(covered: dict[str, str]) -> None:
    for name in ("jpeg-rgb", "png-rgba", "png-la"):
        out = load_image(covered[name], (30, 30), "RGBA", "pad")
        # 60 x 40 fit into 30 x 30: 30 x 20, 10 free rows, 5 above and 5 below
        assert not out[:, :5].any() and not out[:, 25:].any(), name
        if name == "jpeg-rgb":
            assert (out[3, 5:25] == 255).all()


def test_draft_decodes_dct_scaled_then_resizes_with_torch(tmp_path: Path) -> None:
    path = write(tmp_path / "large.jpg", Image.fromarray(pixels(800, 1200, seed=3)),
                 quality=90)
    size = (40, 60)
    with Image.open(path) as im:
        im.draft(None, (60, 40))  # 1/8: what the resize needs
        small = np.asarray(im.convert("RGB"))
        assert small.shape == (100, 150, 3)
    t = torch.from_numpy(small.copy()).permute(2, 0, 1)
    expected = VF.resize(t, list(size), antialias=True).numpy()
    np.testing.assert_array_equal(load_image(path, size, draft=True), expected)
    exact = load_image(path, size)
    assert np.abs(load_image(path, size, draft=True).astype(int) - exact).mean() < 2


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("gray", [False, True])
@pytest.mark.parametrize("size", [(200, 300), (100, 150), (50, 75)])  # 1/2, 1/4, 1/8
def test_draft_has_the_pixels_of_pillows_draft_decode(tmp_path: Path, orientation: int,
                                                      mode: str, gray: bool,
                                                      size: tuple[int, int]) -> None:
    # A plain JPEG is draft-decoded without Image.open: it must be Pillow's DCT-scaled
    # image all the same, upright, converted, then resized by torch (Pillow when small).
    exif = Image.Exif()
    exif[0x0112] = orientation
    picture = Image.fromarray(pixels(400, 600, seed=orientation))
    path = write(tmp_path / "large.jpg", picture.convert("L") if gray else picture,
                 exif=exif, quality=90)
    with Image.open(path) as im:
        decode_pil.request_draft(im, size[::-1], "stretch")
        im.load()
        drafted = decode_pil.convert(decode_pil.orient(im), mode)
    out = load_image(path, size, mode, draft=True)
    if drafted.width * drafted.height < decode_tensor.TORCH_RESIZES_FROM:
        expected = load_image(path, size, mode, draft=True, backend="pil")
    else:
        hwc = np.array(drafted).reshape(drafted.height, drafted.width, -1)
        expected = VF.resize(torch.from_numpy(hwc).permute(2, 0, 1), list(size),
                             antialias=True).numpy()
    np.testing.assert_array_equal(out, expected)
    assert off_by(out, load_image(path, size, mode, draft=True, backend="pil")) <= 1


def test_a_small_dct_scaled_image_is_resized_by_pillow(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "small.jpg", Image.fromarray(pixels(320, 400, seed=4)), quality=90)
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    out = load_image(path, (20, 25), draft=True)  # decoded at 1/8: 50 x 40 pixels
    assert 50 * 40 < decode_tensor.TORCH_RESIZES_FROM and resized.count == 0
    np.testing.assert_array_equal(out, load_image(path, (20, 25), draft=True, backend="pil"))


def test_draft_with_no_scale_to_gain_is_the_exact_tensor_path(covered: dict[str, str]) -> None:
    path = covered["jpeg-rgb"]  # 60 x 40 to 40 x 30: libjpeg has nothing to scale down
    np.testing.assert_array_equal(load_image(path, (30, 40), draft=True),
                                  load_image(path, (30, 40)))


# --- what falls back to the "pil" pipeline ---------------------------------------------------

def fallback_files(folder: Path) -> dict[str, str]:
    rgb = Image.fromarray(pixels(40, 60, seed=9))
    folder.mkdir(parents=True, exist_ok=True)
    frames = [rgb, Image.fromarray(pixels(40, 60, seed=10))]
    files = {
        "CMYK JPEG": write(folder / "cmyk.jpg", rgb.convert("CMYK")),
        "palette PNG": write(folder / "p.png", rgb.quantize(64)),
        "RGB PNG with tRNS": write(folder / "trns.png", rgb, transparency=(1, 2, 3)),
        "grayscale PNG with tRNS": write(folder / "trnsl.png", rgb.convert("L"),
                                         transparency=7),
        "16-bit PNG": write(folder / "i16.png",
                            Image.fromarray(pixels(40, 60, seed=9)[..., 0].astype(np.uint16)
                                            * 200)),
        "1-bit PNG": write(folder / "bit.png", rgb.convert("1")),
        "GIF": write(folder / "g.gif", rgb),
        "BMP": write(folder / "b.bmp", rgb),
        "TIFF": write(folder / "t.tif", rgb),
        "animated PNG": write(folder / "anim.png", frames[0], save_all=True,
                              append_images=frames[1:]),
    }
    if features.check("webp"):
        files["WebP"] = write(folder / "w.webp", rgb, lossless=True)
    return files


@pytest.fixture(scope="module")
def fallbacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return fallback_files(tmp_path_factory.mktemp("fallbacks"))


class Calls:
    """Counts the calls of a function of a module, calling it through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module, name: str) -> None:
        self.count = 0
        real: Callable = getattr(module, name)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("mode", MODES)
def test_what_the_tensor_path_does_not_cover_gets_the_pil_pixels(
        fallbacks: dict[str, str], monkeypatch: pytest.MonkeyPatch, mode: str,
        fit: str) -> None:
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    for name, path in fallbacks.items():
        np.testing.assert_array_equal(load_image(path, (16, 24), mode, fit),
                                      load_image(path, (16, 24), mode, fit, backend="pil"),
                                      err_msg=name)
    assert resized.count == 0


@pytest.mark.parametrize("fit, resample", [
    ("stretch", "nearest"), ("stretch", "lanczos"), ("pad", "box"),  # filters torch lacks
    ("crop", "bilinear"), ("crop", "bicubic"), ("stretch", "bicubic"), ("pad", "bicubic")])
def test_what_torch_cannot_resize_within_a_level_is_the_pil_pipeline(
        covered: dict[str, str], fit: str, resample: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = Calls(monkeypatch, resize_tensor, "decode_jpeg")
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    for path in covered.values():
        np.testing.assert_array_equal(load_image(path, (16, 24), fit=fit, resample=resample),
                                      load_image(path, (16, 24), fit=fit, resample=resample,
                                                 backend="pil"))
    assert resized.count == decoded.count == 0
    assert images.backend_for("tensor", fit, resample) == "pil"


def test_torchs_kernel_would_be_more_than_a_level_off_there(tmp_path: Path) -> None:
    # Why a crop and bicubic are the "pil" pipeline. 61 x 40 to 24 x 16: ImageOps.fit's box
    # is (0.5, 0, 60.5, 40), half a pixel off the nearest box torch's kernel can sample.
    path = write(tmp_path / "odd.png", Image.fromarray(pixels(40, 61, seed=5)))
    t = decoded_tensor(path)
    v2_crop = VF.resized_crop(t, 0, 0, 40, 60, [16, 24], antialias=True)
    assert off_by(v2_crop.numpy(), load_image(path, (16, 24), "RGB", "crop", backend="pil")) > 1
    # Bicubic: each 1-D pass is within a level of Pillow's, but Pillow runs the two passes
    # in an order of its own choosing (here the vertical one first), and clips in between.
    # Before Pillow 13 the horizontal pass always came first (python-pillow/Pillow#9549),
    # and torch's pixels were Pillow's here: the "pil" pipeline is right on either.
    if int(PIL.__version__.split(".")[0]) < 13:
        return
    blocks = np.zeros((303, 226, 3), dtype=np.uint8)
    blocks[50:150, 100:180] = 255
    blocks[200:260, ::7] = 255
    path = write(tmp_path / "blocks.png", Image.fromarray(blocks))
    v2_cubic = VF.resize(decoded_tensor(path), [224, 224], VF.InterpolationMode.BICUBIC,
                         antialias=True)
    pil_cubic = load_image(path, (224, 224), "RGB", "stretch", "bicubic", backend="pil")
    assert off_by(v2_cubic.numpy(), pil_cubic) > 1


def test_the_covered_files_take_the_tensor_path(covered: dict[str, str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = Calls(monkeypatch, resize_tensor, "decode_jpeg")
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    for path in covered.values():
        load_image(path, (16, 24))
    jpegs = sum(path.endswith(".jpg") for path in covered.values())
    assert decoded.count == jpegs and resized.count == len(covered)


def test_the_decoder_of_the_oldest_torchvision_admitted_still_decodes(
        covered: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # torchvision 0.16's op is image::decode_jpeg(Tensor, int): it raises on the third
    # argument (apply_exif_orientation) that 0.17 added. Called with one, every JPEG fell
    # back to the "pil" pipeline, silently and under the tensor backend's key.
    newer = resize_tensor._DECODE_JPEG
    expected = {name: load_image(path, (16, 24)) for name, path in covered.items()}

    def as_in_0_16(data: torch.Tensor, mode: int, *more: object) -> torch.Tensor:
        if more:
            raise RuntimeError("image::decode_jpeg() expected at most 2 argument(s) but "
                               f"received {2 + len(more)} argument(s)")
        return newer(data, mode)

    monkeypatch.setattr(resize_tensor, "_DECODE_JPEG", as_in_0_16)
    assert resize_tensor.decoder_fault() is None  # the start-up check calls it the same way
    resized = Calls(monkeypatch, resize_tensor, "resize_fit")
    for name, path in covered.items():
        np.testing.assert_array_equal(load_image(path, (16, 24)), expected[name], err_msg=name)
    assert resized.count == len(covered)  # every JPEG too: none went to the "pil" pipeline


def test_a_decoder_that_fails_every_file_is_said_once_and_pillow_decodes(
        covered: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert resize_tensor.decoder_fault() is None  # the real one

    def needs_more(data: torch.Tensor, mode: int, device: str) -> torch.Tensor:
        raise AssertionError("never called with two arguments")  # a signature yet to come

    monkeypatch.setattr(resize_tensor, "_DECODE_JPEG", needs_more)
    with pytest.warns(RuntimeWarning, match=r"JPEG decoder fails here \(TypeError: .*"
                                            r"missing .*'device'.*decodes JPEGs with Pillow"):
        assert resize_tensor._check_decoder() is False
    monkeypatch.setattr(resize_tensor, "_DECODER_WORKS", False)
    jpeg = covered["jpeg-rgb"]
    np.testing.assert_array_equal(load_image(jpeg, (16, 24)),
                                  load_image(jpeg, (16, 24), backend="pil"))


def test_a_file_above_the_read_cap_gets_the_pil_pixels(covered: dict[str, str]) -> None:
    for path in covered.values():
        cap = os.path.getsize(path) - 1
        np.testing.assert_array_equal(load_image(path, (16, 24), max_read_bytes=cap),
                                      load_image(path, (16, 24), backend="pil"))


@pytest.mark.parametrize("draft", [False, True])  # (draft: decoded at 1/8 without Image.open)
def test_a_file_torchvision_refuses_fails_with_pillows_error(tmp_path: Path,
                                                             draft: bool) -> None:
    whole = io.BytesIO()
    Image.fromarray(pixels(400, 600, seed=4)).save(whole, format="JPEG")
    path = tmp_path / "truncated.jpg"
    path.write_bytes(whole.getvalue()[: len(whole.getvalue()) * 3 // 5])
    errors = []
    for backend in images.BACKENDS:
        with pytest.raises(OSError) as caught:
            load_image(str(path), (50, 75), draft=draft, backend=backend)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1] and "truncated" in errors[0][1]


# --- the cache: the default, the key, the manifest ------------------------------------------

def test_the_default_backend_is_tensor_and_every_format_decodes(
        tmp_path: Path, covered: dict[str, str], fallbacks: dict[str, str]) -> None:
    paths = [*covered.values(), *fallbacks.values()]
    entry = cachekit.Cache(tmp_path / "cache", workers=2, progress=False).images(
        pd.Series(paths), (16, 24))
    assert entry.manifest["params"]["backend"] == "tensor" and entry.valid.all()
    for row, path in enumerate(paths):
        np.testing.assert_array_equal(entry.array[row], load_image(path, (16, 24)))


def test_the_backend_is_in_the_key_and_pil_keys_are_v1s(tmp_path: Path,
                                                       covered: dict[str, str]) -> None:
    cache = cachekit.Cache(tmp_path / "cache", progress=False)
    column = pd.Series(list(covered.values()))
    tensor = cache.images(column, 8)
    pil = cache.images(column, 8, backend="pil")
    assert tensor.key != pil.key and not pil.hit
    assert "backend" not in pil.manifest["params"]  # as a v1 entry's params
    assert cache.images(column, 8, backend="tensor").hit
    # "tensor" where torch's kernel would be off is "pil" throughout: one entry, one key
    for options in ({"resample": "nearest"}, {"resample": "bicubic"}, {"fit": "crop"}):
        assert cache.images(column, 8, **options).key == cache.images(
            column, 8, backend="pil", **options).key, options


MISSING = pd.Series([f"/nonexistent/cachekit/{name}.jpg" for name in "abc"], name="img_path")


def test_pinned_keys_of_both_backends(tmp_path: Path) -> None:
    # test_cache pins the same call with backend="pil" (entry format 5's keys)
    cache = cachekit.Cache(tmp_path / "cache")
    assert cache.images(MISSING, (8, 6), on_error="zero").key == \
        "dc0333372c04ba855506e69b099b43dc"
    assert cache.images(MISSING, (8, 6), on_error="zero", backend="pil").key == \
        "f1a52787294053060138dd8ad73c909d"


def test_an_unknown_backend_is_refused(tmp_path: Path, covered: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="backend must be one of 'tensor', 'pil'"):
        cachekit.Cache(tmp_path / "cache").images(pd.Series(list(covered.values())), 8,
                                                  backend="cuda")


# --- threads ---------------------------------------------------------------------------------

def torch_threads_row(value: int) -> np.ndarray:
    """(process id, torch's intra-op threads once the tensor backend is loaded)."""
    import torch as loaded_torch

    from cachekit.engine.decoding import resize_tensor as loaded  # noqa: F401

    return np.array([os.getpid(), loaded_torch.get_num_threads()], dtype=np.int64)


def test_a_worker_process_runs_torch_on_one_thread(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # torch reads both at start
        monkeypatch.setenv(variable, "2")  # the user's own settings reach the workers
    entry = cachekit.Cache(tmp_path / "cache", executor="processes", workers=2,
                           progress=False).map(torch_threads_row, pd.Series(range(2000)))
    in_workers = entry.array[entry.array[:, 0] != os.getpid()]
    assert len(in_workers) and set(in_workers[:, 1].tolist()) == {1}


# --- the JPEG header reader -------------------------------------------------------------------

def jpeg_bytes(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 90), st.integers(1, 90), st.booleans(), st.booleans(),
       st.sampled_from([None, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 300]), st.booleans(),
       st.sampled_from([None, "II", "MM"]))
def test_the_header_reader_answers_as_pillow_does(h: int, w: int, gray: bool,
                                                  progressive: bool, orientation,
                                                  comment: bool, order) -> None:
    image = Image.fromarray(pixels(h, w, seed=h * w))
    if gray:
        image = image.convert("L")
    options: dict = {"progressive": progressive}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        if order == "MM":
            exif.endian = ">"  # (Pillow writes little-endian unless told)
        options["exif"] = exif.tobytes()
    if comment:
        options["comment"] = b"made by a test"
    data = jpeg_bytes(image, **options)
    header = jpeg_header.read(data)
    assert header is not None
    with Image.open(io.BytesIO(data)) as im:
        assert header == (im.width, im.height, len(im.getbands()),
                          im.getexif().get(0x0112, 1))


def test_the_header_reader_leaves_the_unusual_to_pillow() -> None:
    rgb = Image.fromarray(pixels(20, 30, seed=1))
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    exif = Image.Exif()
    exif[0x0112] = 3
    exif[0x0110] = "camera"  # a second tag: the orientation is found among several
    unusual = {
        "CMYK (Adobe segment)": jpeg_bytes(rgb.convert("CMYK")),
        "XMP": with_xmp(jpeg_bytes(rgb), xmp),
        "MPO": _mpo(rgb),
        "not a JPEG": b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
        "truncated header": jpeg_bytes(rgb)[:30],
        "empty": b"",
    }
    for name, data in unusual.items():
        assert jpeg_header.read(data) is None, name
    assert jpeg_header.read(jpeg_bytes(rgb, exif=exif)).orientation == 3
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = 20 * 30 - 1  # Pillow would warn: let it
        assert jpeg_header.read(jpeg_bytes(rgb)) is None
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def with_xmp(jpeg: bytes, xmp: bytes) -> bytes:
    """``jpeg`` with an XMP packet in an APP1 segment after its JFIF one, as Pillow's
    ``xmp=`` writes it (Pillow 9.4, the oldest admitted, has no such option)."""
    assert jpeg[2:4] == b"\xff\xe0"
    at = 4 + int.from_bytes(jpeg[4:6], "big")
    payload = b"http://ns.adobe.com/xap/1.0/\x00" + xmp
    return jpeg[:at] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + jpeg[at:]


def _mpo(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="MPO", save_all=True, append_images=[image])
    return buffer.getvalue()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_header_reader_never_raises_on_damaged_bytes(data) -> None:
    original = bytearray(jpeg_bytes(Image.fromarray(pixels(16, 24, seed=3)),
                                    exif=_exif_with_orientation(6)))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(original) - 1))
        original[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(original)))
    header = jpeg_header.read(bytes(original[:cut]))
    assert header is None or (header.width >= 1 and header.height >= 1
                              and header.channels in (1, 3))


def _exif_with_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def test_the_default_rule_counts_torchs_start_in_a_worker() -> None:
    from cachekit.engine.running import executors
    from cachekit.engine.running.rows import ImageRow

    tensor = executors.RowTask(ImageRow((8, 8)), True)
    pil = executors.RowTask(ImageRow((8, 8), backend="pil"), True)
    nearest = executors.RowTask(ImageRow((8, 8), resample="nearest"), True)  # Pillow's rows
    rows = executors.PROCESSES_FROM_ROWS * 4
    assert ImageRow((8, 8)).imports_torch and not ImageRow((8, 8), backend="pil").imports_torch
    assert executors.default_executor(2, pil, rows) == "processes"
    assert executors.default_executor(2, nearest, rows) == "processes"
    assert executors.default_executor(2, tensor, rows) == "threads"
    big = executors.PROCESSES_FROM_ROWS_WITH_TORCH
    assert executors.default_executor(2, tensor, big) == "processes"
    assert executors.default_executor(16, tensor, big - 1) == "threads"
