"""Tests for cachekit.engine.decoding.images: pixels against torchvision / Pillow references,
errors, draft.

Pixel references here are the "pil" pipeline's (bit-identical to torchvision Resize on the PIL
image): those tests pass ``backend="pil"``. What every backend must do alike (layout, errors,
frames, threads) runs for both; the "tensor" backend's pixels are in test_tensor_backend.py.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from cachekit import _fs
from cachekit.engine.decoding.decode_pil import RESAMPLES, _draft_request
from cachekit.engine.decoding.images import BACKENDS, FITS, MODES, load_image
from helpers import LazyModule

transforms = LazyModule("torchvision.transforms")  # imported by the tests that use it

SRC_W, SRC_H = 37, 23  # odd, non-square: crop and pad both have work to do
SIZES = [(16, 20), (24, 12)]  # (height, width): wider and taller than the source ratio


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Gradients, a block and noise: every filter and offset leaves a visible trace."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
    img[h // 4 : h // 2, w // 3 : w // 2] = (250, 10, 120)
    img = img + rng.integers(-20, 21, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _make_sources(root: Path) -> dict[str, Path]:
    """One file per source mode, in a format that stores that mode."""
    rgb = _rgb(SRC_H, SRC_W)
    base = Image.fromarray(rgb)
    gray = np.asarray(base.convert("L"))
    alpha = Image.fromarray(np.linspace(0, 255, SRC_H * SRC_W).reshape(SRC_H, SRC_W).astype(np.uint8))
    pal = base.quantize(64)
    pal_int = pal.copy()
    pal_int.info["transparency"] = 3  # PNG tRNS with one entry reopens as an int
    pal_bytes = pal.copy()
    pal_bytes.info["transparency"] = bytes(range(0, 256, 4))  # reopens as bytes
    ramp = gray.astype(np.int64)
    images: dict[str, tuple[Image.Image, str]] = {
        "1": (Image.fromarray(gray > 127), "png"),
        "L": (Image.fromarray(gray), "png"),
        "LA": (Image.merge("LA", (Image.fromarray(gray), alpha)), "png"),
        "P": (pal, "png"),
        "P-trns-int": (pal_int, "png"),
        "P-trns-bytes": (pal_bytes, "png"),
        "RGB": (base, "png"),
        "RGBA": (Image.merge("RGBA", (*base.split(), alpha)), "png"),
        "CMYK": (base.convert("CMYK"), "tif"),
        "I;16": (Image.fromarray((ramp * 4).astype(np.uint16)), "png"),  # clipped at 255
        "I": (Image.fromarray((ramp * 2 - 100).astype(np.int32)), "tif"),  # clipped both ends
        "F": (Image.fromarray(ramp.astype(np.float32) * 1.5 - 40.25), "tif"),
        "RGB-jpeg": (base, "jpg"),
        "L-jpeg": (Image.fromarray(gray), "jpg"),
        "CMYK-jpeg": (base.convert("CMYK"), "jpg"),
        "RGBA-webp": (Image.merge("RGBA", (*base.split(), alpha)), "webp"),
        "LAB": (base.convert("LAB"), "tif"),
    }
    paths = {}
    for name, (im, ext) in images.items():
        path = root / f"{name}.{ext}"
        im.save(path, **({"lossless": True} if ext == "webp" else {}))
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _make_sources(tmp_path_factory.mktemp("sources"))


def _reference_converted(path: Path, mode: str) -> Image.Image:
    """Decoded and converted by plain Pillow calls, independently of cachekit."""
    with Image.open(path) as im:
        im.load()
        if isinstance(im.info.get("transparency"), bytes) and mode != "RGBA":
            # Pillow warns, then drops the transparency and converts; do the same silently.
            im = im.copy()
            del im.info["transparency"]
        if im.mode == "LAB" and mode == "L":
            # Pillow converts LAB only to RGB(A) (littlecms); "L" is documented from RGB.
            return im.convert("RGB").convert("L")
        return im.convert(mode)


def _np_chw(im: Image.Image) -> np.ndarray:
    a = np.asarray(im)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _check_layout(out: np.ndarray, mode: str, size: tuple[int, int]) -> None:
    assert out.dtype == np.uint8
    assert out.shape == (MODES[mode], *size)
    assert out.flags.c_contiguous


SOURCE_NAMES = [
    "1", "L", "LA", "P", "P-trns-int", "P-trns-bytes", "RGB", "RGBA", "CMYK",
    "I;16", "I", "F", "RGB-jpeg", "L-jpeg", "CMYK-jpeg", "RGBA-webp", "LAB",
]  # fmt: skip


def test_sources_have_the_intended_modes(sources: dict[str, Path]) -> None:
    for name, path in sources.items():
        with Image.open(path) as im:
            # Pillow before 10.3 opened 16-bit gray PNGs as "I" (python-pillow/Pillow#7849)
            assert im.mode == name.split("-")[0] or (name, im.mode) == ("I;16", "I"), name
            if name.startswith("P-trns"):
                expected = int if name == "P-trns-int" else bytes
                assert isinstance(im.info["transparency"], expected)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("source", SOURCE_NAMES)
def test_pixels_match_reference(
    sources: dict[str, Path], source: str, mode: str, fit: str, size: tuple[int, int]
) -> None:
    h, w = size
    out = load_image(str(sources[source]), size, mode=mode, fit=fit, backend="pil")
    _check_layout(out, mode, size)
    conv = _reference_converted(sources[source], mode)
    if fit == "stretch":
        ref = transforms.Resize(size, interpolation=transforms.InterpolationMode.BILINEAR)(conv)
    elif fit == "crop":
        # The docstring's definition: largest centered box of the target ratio, in floats.
        scale = max(w / conv.width, h / conv.height)
        cw, ch = w / scale, h / scale
        left, top = (conv.width - cw) / 2, (conv.height - ch) / 2
        ref = conv.resize((w, h), Image.Resampling.BILINEAR, box=(left, top, left + cw, top + ch))
    else:
        ref = ImageOps.pad(conv, (w, h), Image.Resampling.BILINEAR, color=0)
    np.testing.assert_array_equal(out, _np_chw(ref))


@pytest.mark.parametrize("size", SIZES)
def test_crop_is_close_to_torchvision_resize_then_center_crop(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    # Smooth content, because torchvision rounds the intermediate size and crop offset.
    y, x = np.mgrid[0:230, 0:370]
    smooth = np.stack([x * 255 // 369, y * 255 // 229, (x + y) * 255 // 598], -1).astype(np.uint8)
    path = tmp_path / "smooth.png"
    Image.fromarray(smooth).save(path)
    h, w = size
    scale = max(w / 370, h / 230)
    tv = transforms.Compose(
        [transforms.Resize((round(230 * scale), round(370 * scale))), transforms.CenterCrop(size)]
    )
    ref = _np_chw(tv(Image.fromarray(smooth))).astype(int)
    diff = np.abs(load_image(str(path), size, fit="crop", backend="pil").astype(int) - ref)
    assert diff.mean() < 4 and diff.max() <= 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_leaves_zero_borders(sources: dict[str, Path], backend: str) -> None:
    out = load_image(str(sources["RGBA"]), (30, 30), mode="RGBA", fit="pad", backend=backend)
    # 37x23 fit into 30x30 -> 30x19 (rounded), 11 free rows: 6 above, 5 below.
    assert not out[:, :6].any() and not out[:, 25:].any()
    assert out[3, 6:25].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, channels", [("RGB", 3), ("L", 1), ("RGBA", 4)])
@pytest.mark.parametrize("wide", [True, False])
def test_pad_of_a_sliver_is_zeros_whatever_the_pillow(tmp_path: Path, monkeypatch, backend: str,
                                                      mode: str, channels: int,
                                                      wide: bool) -> None:
    """A 200x1 banner padded into 8x8 keeps 0.04 of a pixel: zeros, as Pillow 13's
    ``ImageOps.contain`` gives. Pillows before 13 (which cachekit admits) raise there, so
    the row would fail: ``contain`` here raises as theirs does."""
    path = tmp_path / "banner.png"
    Image.new("RGB", (200, 1) if wide else (1, 200), (200, 100, 50)).save(path)
    contain = ImageOps.contain

    def contain_before_pillow_13(image: Image.Image, size, *args, **kwargs) -> Image.Image:
        result = contain(image, size, *args, **kwargs)
        if 0 in result.size:
            raise ValueError("height and width must be > 0")
        return result

    monkeypatch.setattr(ImageOps, "contain", contain_before_pillow_13)
    out = load_image(str(path), (8, 8), mode=mode, fit="pad", backend=backend)
    assert out.shape == (channels, 8, 8) and not out.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["1", "L", "LA", "I;16", "I", "F", "L-jpeg"])
@pytest.mark.parametrize("fit", FITS)
def test_grayscale_to_rgb_has_equal_channels(
    sources: dict[str, Path], source: str, fit: str, backend: str
) -> None:
    out = load_image(str(sources[source]), (16, 20), mode="RGB", fit=fit, backend=backend)
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])
    assert out.std() > 0


def test_resample_filters_match_torchvision_and_differ(tmp_path: Path) -> None:
    path = tmp_path / "noise.png"
    noise = np.random.default_rng(1).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)
    outs = {}
    for name in RESAMPLES:
        outs[name] = load_image(str(path), (17, 23), resample=name, backend="pil")
        tv = transforms.Resize((17, 23), interpolation=transforms.InterpolationMode[name.upper()])
        np.testing.assert_array_equal(outs[name], _np_chw(tv(Image.fromarray(noise))))
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not np.array_equal(outs[a], outs[b]), (a, b)
    # nearest only picks existing pixels; the averaging filters do not.
    assert np.isin(outs["nearest"][0], noise[..., 0]).all()


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_orientation_is_applied_before_resizing(
    tmp_path: Path, orientation: int, draft: bool
) -> None:
    pixels = Image.fromarray(_rgb(240, 400, seed=2))
    tagged = tmp_path / "tagged.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels.save(tagged, quality=95, exif=exif)
    size = (30, 20)
    with Image.open(tagged) as im:  # Pillow's own reading of the tag, the reference
        upright = ImageOps.exif_transpose(im)
    ref = _np_chw(upright.resize(size[::-1], Image.Resampling.BILINEAR)).astype(int)
    out = load_image(str(tagged), size, draft=draft, backend="pil").astype(int)
    if draft:
        assert np.abs(out - ref).mean() < 3
    else:
        np.testing.assert_array_equal(out, ref)


@pytest.fixture(scope="module")
def large_jpeg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("large") / "large.jpg"
    Image.fromarray(_rgb(1200, 1600, seed=3)).save(path, quality=90)
    return path


@pytest.mark.parametrize("fit", FITS)
def test_draft_is_close_to_exact_and_exact_is_reference(large_jpeg: Path, fit: str) -> None:
    size = (48, 32)
    exact = load_image(str(large_jpeg), size, fit=fit, backend="pil")
    fast = load_image(str(large_jpeg), size, fit=fit, draft=True, backend="pil")
    with Image.open(large_jpeg) as im:
        im.load()
        if fit == "stretch":
            ref = transforms.Resize(size)(im)
        elif fit == "crop":
            ref = ImageOps.fit(im, size[::-1], Image.Resampling.BILINEAR)
        else:
            ref = ImageOps.pad(im, size[::-1], Image.Resampling.BILINEAR, color=0)
    np.testing.assert_array_equal(exact, _np_chw(ref))
    _check_layout(fast, "RGB", size)
    assert not np.array_equal(fast, exact)  # the DCT-scaled path really ran
    assert np.abs(fast.astype(int) - exact.astype(int)).mean() < 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_is_ignored_for_non_jpeg(sources: dict[str, Path], backend: str) -> None:
    path = str(sources["RGB"])
    np.testing.assert_array_equal(
        load_image(path, (8, 8), draft=True, backend=backend),
        load_image(path, (8, 8), draft=False, backend=backend)
    )


@pytest.mark.parametrize(
    ("src", "target", "fit", "orientation", "expected"),
    [
        ((1600, 1200), (32, 48), "stretch", 1, (32, 48)),
        ((1600, 1200), (32, 48), "stretch", 6, (48, 32)),  # stored sideways
        ((1600, 1200), (32, 48), "crop", 1, (64, 48)),  # height must cover 48
        ((1600, 1200), (32, 48), "pad", 1, (32, 24)),  # width limits to 32
        ((400, 700), (64, 64), "crop", 1, (64, 112)),
        ((400, 700), (64, 64), "pad", 1, (37, 64)),
    ],
)
def test_draft_request_covers_what_the_resize_samples(
    src: tuple[int, int],
    target: tuple[int, int],
    fit: str,
    orientation: int,
    expected: tuple[int, int],
) -> None:
    assert _draft_request(src, target, fit, orientation) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_animated_images_give_the_first_frame(tmp_path: Path, backend: str) -> None:
    frames = [Image.new("RGB", (20, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    for ext in ("gif", "webp"):
        path = tmp_path / f"anim.{ext}"
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
        with Image.open(path) as im:
            assert im.n_frames == 2
        out = load_image(str(path), (5, 10), backend=backend)
        assert (out[0] > 200).all() and (out[2] < 50).all(), ext


def _truncated_jpeg(path: Path) -> None:
    buf = io.BytesIO()
    Image.fromarray(_rgb(256, 256, seed=4)).save(buf, format="JPEG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) * 3 // 5])


_BAD_FILES = {
    "missing": lambda p: None,
    "zero-bytes": lambda p: p.write_bytes(b""),
    "truncated-jpeg": _truncated_jpeg,
    "text-named-jpg": lambda p: p.write_text("not an image\n"),
    "directory": lambda p: p.mkdir(),
    "fifo": lambda p: os.mkfifo(p),  # opening it for reading would block forever
}


READS = {"read whole": None, "read from the file": 0}
"""``max_read_bytes`` of each way a file reaches Pillow: the default cap, and a cap of 0."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("kind", list(_BAD_FILES))
def test_unreadable_files_raise(tmp_path: Path, kind: str, read: str, backend: str) -> None:
    path = tmp_path / "bad.jpg"
    _BAD_FILES[kind](path)
    with pytest.raises(OSError) as info:  # FileNotFound, IsADirectory, UnidentifiedImage...
        load_image(str(path), (8, 8), max_read_bytes=READS[read], backend=backend)
    assert str(info.value)
    if kind == "text-named-jpg":
        assert str(path) in str(info.value)  # the file, not a BytesIO or a file object


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ext", ["png", "jpg"])
@pytest.mark.parametrize("read", list(READS))
def test_decompression_bomb_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   read: str, ext: str, backend: str) -> None:
    path = tmp_path / f"bomb.{ext}"
    Image.new("L", (100, 100)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 10,000 px > 2 x limit: an error
    with pytest.raises(Image.DecompressionBombError):
        load_image(str(path), (8, 8), max_read_bytes=READS[read], backend=backend)


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("fit", FITS)
def test_a_file_above_the_read_cap_gives_the_same_pixels(
        sources: dict[str, Path], large_jpeg: Path, fit: str, draft: bool) -> None:
    for path in [large_jpeg, *sources.values()]:
        size = path.stat().st_size
        whole = load_image(str(path), (24, 12), fit=fit, draft=draft, backend="pil")
        for cap in (0, size - 1):
            streamed = load_image(str(path), (24, 12), fit=fit, draft=draft,
                                  max_read_bytes=cap, backend="pil")
            np.testing.assert_array_equal(streamed, whole, err_msg=f"{path.name} cap {cap}")


def test_the_read_cap_comes_from_the_environment(large_jpeg: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    whole = load_image(str(large_jpeg), (16, 16), backend="pil")
    monkeypatch.setenv("CACHEKIT_MAX_READ_BYTES", "1K")  # far below the JPEG's size
    np.testing.assert_array_equal(load_image(str(large_jpeg), (16, 16), backend="pil"), whole)
    monkeypatch.setenv("CACHEKIT_MAX_READ_BYTES", "a lot")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="CACHEKIT_MAX_READ_BYTES='a lot'"):
            load_image(str(large_jpeg), (16, 16), backend=backend)


@pytest.mark.parametrize("cap", [0, 10, 11, 1 << 20])
def test_read_capped_holds_a_file_in_memory_only_up_to_the_cap(tmp_path: Path,
                                                               cap: int) -> None:
    path = tmp_path / "ten.bin"
    path.write_bytes(b"0123456789")
    with _fs.read_capped(path, cap) as f:
        assert isinstance(f, io.BytesIO) == (cap >= 10)
        assert f.read() == b"0123456789"
    assert f.closed
    for planted in ("fifo", "dir"):
        other = tmp_path / planted
        os.mkfifo(other) if planted == "fifo" else other.mkdir()
        with pytest.raises(OSError):  # EINVAL at once: a FIFO never blocks the open
            _fs.read_capped(other, cap)
        other.unlink() if planted == "fifo" else other.rmdir()


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_give_the_same_pixels_as_serial_calls(sources: dict[str, Path],
                                                      backend: str) -> None:
    # The build calls load_image from a thread pool; warnings raised there fail it too.
    jobs = [(str(path), mode) for path in sources.values() for mode in MODES] * 2

    def run(job: tuple[str, str]) -> np.ndarray:
        return load_image(job[0], (16, 20), mode=job[1], fit="crop", draft=True,
                          backend=backend)

    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(run, jobs))
    for job, out in zip(jobs, threaded):
        np.testing.assert_array_equal(out, run(job))
