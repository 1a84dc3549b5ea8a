"""Hostile input: odd and hostile paths and image files, tampered entries, pickles, umasks.

A hostile image is never fatal to a build: its row fails with a reason (or decodes, for the
formats Pillow reads), every other row is exactly what ``load_image`` gives. A tampered
entry is ``CacheCorruptError``, never wrong data, and nothing outside the cache root is read
(every lure below is a *correct* copy placed outside: following it would have succeeded);
one whose manifest disagrees with the call (dtype, shape, rows) is built again.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image, features

import cachekit
from cachekit import redaction
from cachekit.store import manifest as manifests
from cachekit.store import Layout
from cachekit.engine.decoding.images import load_image

PACKAGE = Path(cachekit.__file__).parent


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels, with almost no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I",
                                                                        zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 10)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, tuple[str, bool]]:
    """name -> (path, whether it must decode)."""
    base = tmp_path_factory.mktemp("hostile")
    rng = np.random.default_rng(5)
    pixels = Image.fromarray(rng.integers(0, 255, (37, 29, 3), dtype=np.uint8))
    good = base / "good.png"
    pixels.save(good)
    files: dict[str, tuple[Path, bool]] = {}

    def add(name: str, path: Path, decodes: bool) -> None:
        files[name] = (path, decodes)

    for name in ("ünï cödé 日本語 🖼.png", "with space.png", "new\nline.png", "tab\there.png",
                 "quote'\"$`.png", "-leading-dash.png", "back\\slash.png"):
        shutil.copy(good, base / name)
        add(f"name {name!r}", base / name, True)
    longest = base / ("l" * 251 + ".png")  # 255 bytes: the longest name ext4 allows
    shutil.copy(good, longest)
    add("255-byte name", longest, True)
    deep = base
    while len(str(deep)) < 3500:
        deep = deep / ("d" * 200)
    deep.mkdir(parents=True)
    shutil.copy(good, deep / "deep.png")
    add("3500-character path", deep / "deep.png", True)
    add("path beyond PATH_MAX", base / (("x" * 200 + "/") * 25 + "a.png"), False)
    os.symlink(good, base / "link.png")
    add("symlink to an image", base / "link.png", True)
    os.symlink(base / "missing.png", base / "dangling.png")
    add("dangling symlink", base / "dangling.png", False)
    os.symlink(base / "loop2.png", base / "loop1.png")
    os.symlink(base / "loop1.png", base / "loop2.png")
    add("symlink loop", base / "loop1.png", False)
    (base / "folder.png").mkdir()
    add("directory", base / "folder.png", False)
    add("/dev/null", Path("/dev/null"), False)

    frames = [Image.fromarray(np.full((20, 24, 3), c, np.uint8)) for c in (10, 200, 90)]
    frames[0].save(base / "anim.gif", save_all=True, append_images=frames[1:], duration=40)
    add("animated GIF", base / "anim.gif", True)
    wide = rng.integers(0, 65535, (20, 24)).astype(np.uint16)
    Image.fromarray(wide).save(base / "sixteen.png")
    add("16-bit PNG", base / "sixteen.png", True)
    pixels.convert("CMYK").save(base / "cmyk.jpg")
    add("CMYK JPEG", base / "cmyk.jpg", True)
    pixels.save(base / "progressive.jpg", progressive=True)
    add("progressive JPEG", base / "progressive.jpg", True)
    if features.check("webp"):
        pixels.save(base / "image.webp")
        add("WebP", base / "image.webp", True)
    pixels.save(base / "image.bmp")
    add("BMP", base / "image.bmp", True)
    pixels.save(base / "image.tif")
    add("TIFF", base / "image.tif", True)
    frames[0].save(base / "pages.tif", save_all=True, append_images=frames[1:])
    add("multi-page TIFF", base / "pages.tif", True)
    pal = pixels.convert("P")
    pal.info["transparency"] = 0
    pal.save(base / "palette.png", transparency=0)
    add("palette PNG with transparency", base / "palette.png", True)
    pixels.convert("LA").save(base / "la.png")
    add("grey+alpha PNG", base / "la.png", True)
    pixels.convert("1").save(base / "bilevel.png")
    add("1-bit PNG", base / "bilevel.png", True)

    (base / "bomb.png").write_bytes(png_header(20000, 20000))
    add("decompression bomb (20000 x 20000 claimed)", base / "bomb.png", False)
    (base / "huge.png").write_bytes(png_header(2**31 - 1, 2**31 - 1))
    add("enormous dimensions (2^31-1 squared)", base / "huge.png", False)
    (base / "empty.jpg").write_bytes(b"")
    add("empty file", base / "empty.jpg", False)
    jpeg = (base / "progressive.jpg").read_bytes()
    (base / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 3])
    add("truncated JPEG", base / "truncated.jpg", False)
    (base / "page.jpg").write_text("<html><script>alert(1)</script></html>")
    add("HTML named .jpg", base / "page.jpg", False)
    broken = bytearray(good.read_bytes())
    broken[-30:-20] = b"\xff" * 10
    (base / "badcrc.png").write_bytes(bytes(broken))
    add("PNG with a damaged chunk", base / "badcrc.png", False)
    return {name: (str(path), decodes) for name, (path, decodes) in files.items()}


def decode_or_none(path: str):
    try:
        return load_image(path, (8, 8))
    except Exception:
        return None


def test_hostile_files_fail_row_by_row_and_never_disturb_other_rows(tmp_path, hostile):
    names = sorted(hostile)
    paths = [hostile[n][0] for n in names]
    expected = [decode_or_none(p) for p in paths]
    for name, result in zip(names, expected):
        assert (result is not None) == hostile[name][1], name  # the premise of each case

    root = tmp_path / "ca che\nroot ü 日本"  # the root itself has an odd name
    entry = cachekit.Cache(root, workers=2, progress=False).images(pd.Series(paths), 8,
                                                                   on_error="zero")
    failed = {row: (path, reason) for row, path, reason in entry.manifest["failed_rows"]}
    for row, (name, result) in enumerate(zip(names, expected)):
        if result is None:
            assert not entry.valid[row] and not np.asarray(entry.array[row]).any(), name
            # stored as shown: bounded, control characters escaped (cachekit.redaction)
            assert failed[row][0] == redaction.value(paths[row]) and failed[row][1], name
        else:
            assert entry.valid[row], name
            np.testing.assert_array_equal(np.asarray(entry.array[row]), result, err_msg=name)

    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cachekit.Cache(root, workers=2, progress=False).images(pd.Series(paths), 8)
    assert [row for row, _, _ in caught.value.failures] == sorted(failed)
    listed = cachekit.Cache(root).entries()  # the entry, and the rows the failed build kept
    assert [e.key for e in listed if e.failed_build is None] == [entry.key]
    assert [e.failed_rows for e in listed if e.failed_build is not None] == [len(failed)]
    assert cachekit.Cache(root).images(pd.Series(paths), 8, on_error="zero").hit


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_file_names_that_are_not_utf8_are_keyed_by_their_bytes_and_decoded(tmp_path,
                                                                          executor):
    """Names given as os.fsdecode gives them (surrogate escapes): the good one decodes, the
    bad one is a failed row naming its row and path (never a UnicodeEncodeError), and the
    key is stable: the next call is a hit, for a list and an object Series alike."""
    folder = os.fsencode(tmp_path)
    good, bad = folder + b"/caf\xe9.png", folder + b"/\xff\xfe not an image.jpg"
    pixels = np.random.default_rng(2).integers(0, 255, (9, 13, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(good, format="PNG")
    with open(bad, "wb") as f:
        f.write(b"<html>")
    paths = [os.fsdecode(good), os.fsdecode(bad)]
    cache = cachekit.Cache(tmp_path / "cache", workers=2, executor=executor, progress=False)
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cache.images(paths, 8)
    shown = redaction.value(paths[1])  # the undecodable bytes escaped, as \\udcff
    assert [(row, path) for row, path, _ in caught.value.failures] == [(1, shown)]
    assert repr(shown) in str(caught.value)
    entry = cache.images(paths, 8, on_error="zero", validate="content")
    assert entry.valid.tolist() == [True, False] and entry.source == "built"
    np.testing.assert_array_equal(entry.array[0], load_image(paths[0], (8, 8)))
    again = cache.images(pd.Series(paths, dtype=object), 8, on_error="zero",
                         validate="content")
    assert again.source == "local" and again.key == entry.key


HUGE_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, pandas as pd
    import cachekit

    def peak_kb():
        # VmHWM: this process's own peak. (ru_maxrss after fork and exec also counts the
        # parent's resident set at the fork: the test process's, not ours.)
        with open("/proc/self/status") as f:
            return [int(line.split()[1]) for line in f if line.startswith("VmHWM:")][0]

    root, paths = sys.argv[1], sys.argv[2:]
    cache = cachekit.Cache(root, workers=1, executor="threads", progress=False)
    cache.images(pd.Series(paths[:1]), 8, validate="stat")  # the imports and the decoders
    before = peak_kb()
    entry = cache.images(pd.Series(paths), 8, on_error="zero", validate="stat")
    print(json.dumps({"valid": entry.valid.tolist(), "failed": entry.manifest["failed_rows"],
                      "sum": int(np.asarray(entry.array[0]).sum()),
                      "grew_kb": peak_kb() - before}))
""")
HUGE_BYTES = 6 << 30


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM (Linux)")
def test_a_huge_non_image_fails_its_row_without_being_read_whole(tmp_path, cover_paths):
    """A 6 GiB sparse file of zeros in the column: its row fails (not an image) and the
    process's peak RSS grows by far less than the file's size (it was never read whole).
    The growth, not the peak: a build of small files alone peaks at 0.6 GB here on Python
    3.11 and 0.8 GB on 3.13, torch's import mostly."""
    huge = tmp_path / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(HUGE_BYTES)
    out = subprocess.run([sys.executable, "-c", HUGE_CHILD, str(tmp_path / "cache"),
                          cover_paths[0], str(huge)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["valid"] == [True, False] and got["sum"] > 0
    assert [(row, path) for row, path, _ in got["failed"]] == [(1, str(huge))]
    assert "cannot identify image file" in got["failed"][0][2]
    assert got["grew_kb"] * 1024 < HUGE_BYTES // 8, f"peak RSS grew {got['grew_kb'] // 1024} MB"


# --- tampered entries -------------------------------------------------------------------

FILE_FIELDS = ("shape", "dtype", "checksum", "bytes", "name")
"""Fields of the data file's record; an edit of shape or dtype changes both copies, so the
manifest stays self-consistent and only the data file can tell it is wrong."""


def manifest_edit(**changes):
    def edit(entry_dir: Path) -> None:
        path = entry_dir / manifests.MANIFEST_FILE
        manifest = json.loads(path.read_text())
        for key, value in changes.items():
            places = [manifest["files"][0]] if key in FILE_FIELDS else []
            if key not in ("checksum", "bytes", "name"):
                places.append(manifest)
            for place in places:
                if value is ...:
                    del place[key]
                else:
                    place[key] = value
        path.write_text(json.dumps(manifest))
    return edit


def _rewrite_files(entry_dir: Path, files) -> None:
    """Replace the manifest's file list (None: list the data file twice)."""
    path = entry_dir / manifests.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"] = files if files is not None else manifest["files"] * 2
    path.write_text(json.dumps(manifest))


def manifest_text(text: str):
    return lambda entry_dir: (entry_dir / manifests.MANIFEST_FILE).write_text(text)


def lure(name: str):
    """Replace ``name`` with a symlink to an identical copy outside the root."""
    def edit(entry_dir: Path) -> None:
        outside = entry_dir.parents[2] / f"outside-{name.replace('/', '_') or 'entry'}"
        target = entry_dir / name if name else entry_dir
        os.replace(target, outside) if name else shutil.move(target, outside)
        os.symlink(outside, target)
    return edit


def fifo(name: str):
    def edit(entry_dir: Path) -> None:
        (entry_dir / name).unlink()
        os.mkfifo(entry_dir / name)
    return edit


def replace_with_directory(entry_dir: Path) -> None:
    (entry_dir / manifests.MANIFEST_FILE).unlink()
    (entry_dir / manifests.MANIFEST_FILE).mkdir()


MARKER = "pickle-ran.txt"


class Payload:
    """Unpickling this creates a marker file: proof that someone unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


def pickled_data(manifest_dtype: str):
    def edit(entry_dir: Path) -> None:
        marker = str(entry_dir.parents[2] / MARKER)
        rows = json.loads((entry_dir / manifests.MANIFEST_FILE).read_text())["rows"]
        array = np.empty(rows, dtype=object)
        array[:] = [Payload(marker) for _ in range(rows)]
        with open(entry_dir / manifests.DATA_FILE, "wb") as f:
            np.lib.format.write_array(f, array, allow_pickle=True)
        manifest_edit(dtype=manifest_dtype, shape=[rows])(entry_dir)
    return edit


TAMPERED = {
    "manifest not JSON": manifest_text("{\"key\": "),
    "manifest empty": manifest_text(""),
    "manifest a list": manifest_text("[]"),
    "manifest a string": manifest_text("\"manifest\""),
    "manifest nested 100000 deep": manifest_text("[" * 100000 + "]" * 100000),
    "manifest with NaN rows": manifest_text("{\"rows\": NaN}"),
    "rows as text": manifest_edit(rows="12"),
    "rows as bool": manifest_edit(rows=True),
    "rows other than shape": manifest_edit(rows=11),
    "shape with text": manifest_edit(shape=[12, "3", 8, 8]),
    "shape negative": manifest_edit(shape=[12, -3, 8, -8]),
    "shape as bools": manifest_edit(shape=[12, True, 8, 8]),
    "shape not a list": manifest_edit(shape="12,3,8,8"),
    "shape that overflows int64": manifest_edit(shape=[12, 2**62, 2**62, 4]),
    "dtype object": manifest_edit(dtype="|O"),
    "dtype unparsable": manifest_edit(dtype=",,"),
    "dtype a number": manifest_edit(dtype=5),
    "format from the future": manifest_edit(format=99),
    "key pointing outside": manifest_edit(key="../../../../etc/passwd"),
    "key of another entry": manifest_edit(key="0" * 32),
    "failed row out of range": manifest_edit(failed_rows=[[12, "x", "y"]]),
    "failed row negative": manifest_edit(failed_rows=[[-1, "x", "y"]]),
    "failed row as text": manifest_edit(failed_rows=[["0", "x", "y"]]),
    "checksum missing": manifest_edit(checksum=...),
    "file size larger than the data": manifest_edit(bytes=10**15),
    "file size smaller than the data": manifest_edit(bytes=100),
    "file name pointing outside": manifest_edit(name="../../../../etc/passwd"),
    "files empty": lambda d: manifest_edit()(d) or _rewrite_files(d, []),
    "two files for an images entry": lambda d: _rewrite_files(d, None),
    "kind missing": manifest_edit(kind=...),
    "manifest is a symlink out": lure(manifests.MANIFEST_FILE),
    "data is a symlink out": lure(manifests.DATA_FILE),
    "entry is a symlink out": lure(""),
    "manifest is a FIFO": fifo(manifests.MANIFEST_FILE),
    "data is a FIFO": fifo(manifests.DATA_FILE),
    "manifest is a directory": replace_with_directory,
    "data missing": lambda d: (d / manifests.DATA_FILE).unlink(),
    "data truncated by a byte": lambda d: os.truncate(d / manifests.DATA_FILE,
                                                      (d / manifests.DATA_FILE).stat().st_size - 1),
    "data grown by a byte": lambda d: _append_byte(d / manifests.DATA_FILE),
    "data header garbled": lambda d: _garble_header(d / manifests.DATA_FILE),
    "data is a pickle, manifest says object": pickled_data("|O"),
}


def _append_byte(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def _garble_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"{'descr': __import__('os').system('x'), ")


MISMATCHED = {
    "shape other than the call's": manifest_edit(shape=[12, 3, 4, 16]),
    "dtype other than the call's": manifest_edit(dtype="<u2", shape=[12, 3, 8, 4]),
    "data is a pickle, manifest says uint8 of another shape": pickled_data("|u1"),
}
"""Tampered manifests that disagree with the call itself: the call removes the entry and
builds it again, before it reads a byte of the data (which disagree with the manifest too)."""


@pytest.mark.parametrize("how", sorted(MISMATCHED))
def test_an_entry_that_disagrees_with_the_call_is_rebuilt_before_its_data_is_read(
        tmp_path, cover_paths, how, capfd):
    root = tmp_path / "cache"
    column = pd.Series(cover_paths)
    cache = cachekit.Cache(root, workers=2, progress=False, lock_timeout=0)
    first = cache.images(column, 8)
    pixels = np.array(first.array)
    MISMATCHED[how](first.path)
    again = cache.images(column, 8)
    assert again.source == "built" and again.array.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(again.array), pixels)
    assert "does not match the call" in capfd.readouterr().err
    assert not (tmp_path / MARKER).exists()  # nothing was unpickled


@pytest.mark.parametrize("how", sorted(TAMPERED))
def test_a_tampered_entry_is_corrupt_never_wrong_data_and_nothing_outside_is_read(
        tmp_path, cover_paths, how):
    root = tmp_path / "cache"
    column = pd.Series(cover_paths)
    cache = cachekit.Cache(root, workers=2, progress=False, lock_timeout=0)
    entry_dir = cache.images(column, 8).path
    TAMPERED[how](entry_dir)
    with pytest.raises(cachekit.CacheCorruptError) as caught:
        entry = cache.images(column, 8)
        np.asarray(entry.array).sum()  # not reached; if it were, it would read the data
    assert str(root) in str(caught.value)
    assert not (tmp_path / MARKER).exists()  # nothing was unpickled


def test_entry_keys_that_are_not_keys_never_become_paths(tmp_path):
    layout = Layout(tmp_path)
    for bad in ("../" + "0" * 29, "0" * 31 + "/", "/etc/passwd", "..", "", "0" * 33,
                "A" * 32, "0" * 31 + "\n"):
        with pytest.raises(ValueError, match="not a cache key"):
            layout.entry_dir(bad)


# --- nothing unpickles --------------------------------------------------------------------

UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("torch", "load"), ("joblib", "load"), ("dill", "load"), ("dill", "loads"),
              ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"),
              ("pandas", "read_pickle")}
CHANNELS = {"engine/running/_workers.py", "engine/running/_worker_main.py"}
"""Modules that unpickle only what passes between a builder and the worker processes it
started itself (over their pipes), never bytes read from a cache root. Paths relative to the
package: a module of the same name in a subpackage is audited."""


def unpickling_in(tree: ast.AST, where: str) -> list[str]:
    """Every way ``tree`` can reach an unpickler: ``module.name`` under any alias of the
    module, ``from module import name``, eval/exec, and numpy loaders that allow pickles."""
    aliases = {"np": "numpy", "pd": "pandas"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names})

    def module_of(value: ast.expr) -> str:  # "np.lib.format" -> "numpy.lib.format"
        head, _, rest = ast.unparse(value).partition(".")
        return ".".join(filter(None, [aliases.get(head, head), rest]))

    problems = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            problems += [f"{at} imports {a.name} from {node.module}" for a in node.names
                         if (node.module.split(".")[-1], a.name) in UNPICKLERS]
        elif isinstance(node, ast.Attribute) and \
                (module_of(node.value).split(".")[-1], node.attr) in UNPICKLERS:
            problems.append(f"{at} uses {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("eval", "exec"):
            problems.append(f"{at} calls {node.func.id}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("load", "read_array") and \
                module_of(node.func.value) in ("numpy", "numpy.lib.format") and \
                not any(k.arg == "allow_pickle" and isinstance(k.value, ast.Constant)
                        and k.value.value is False for k in node.keywords):
            problems.append(f"{at} calls {ast.unparse(node.func)} without allow_pickle=False")
    return problems


def test_no_read_path_in_the_package_can_unpickle():
    """Every module of the package and its subpackages: no way to unpickle, and every numpy
    loader refuses pickles."""
    problems, audited = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        audited.add(name)
        if name not in CHANNELS:
            problems += unpickling_in(ast.parse(path.read_text(), name), name)
    assert problems == []
    assert CHANNELS <= audited  # an exemption names a module that exists
    assert "store/remote.py" in audited  # the module that reads untrusted remote bytes


def test_the_unpickling_audit_finds_each_way_in():
    """The audit's own check: each of these lines is a finding, and the channels' calls are."""
    for line in ("import pickle\npickle.loads(b'')", "import pickle as p\np.loads(b'')",
                 "from pickle import loads", "from pickle import Unpickler as U",
                 "import torch\nloader = torch.load", "import pandas\npandas.read_pickle(f)",
                 "import numpy\nnumpy.load(f)", "import numpy as n\nn.load(f, allow_pickle=True)",
                 "import numpy as np\nnp.lib.format.read_array(f)", "eval('1')",
                 "import marshal\nmarshal.loads(b'')", "import shelve\nshelve.open('x')"):
        assert unpickling_in(ast.parse(line), "m.py"), line
    for line in ("import pickle\npickle.dumps(1)", "import numpy as np\nnp.load(f, "
                 "allow_pickle=False)", "import json\njson.loads('1')"):
        assert unpickling_in(ast.parse(line), "m.py") == [], line
    for name in CHANNELS:
        assert unpickling_in(ast.parse((PACKAGE / name).read_text()), name)


# --- shared caches: the umask decides --------------------------------------------------------

MODES_CHILD = textwrap.dedent("""
    import json, os, stat, sys
    from pathlib import Path
    import pandas as pd
    import cachekit
    from cachekit.store import locks, manifest as manifests

    root, umask, paths = Path(sys.argv[1]), int(sys.argv[2], 8), sys.argv[3:]
    os.umask(umask)
    # pil: the modes are the store's, whatever decodes, and no torch to import
    entry = cachekit.Cache(root, progress=False).images(pd.Series(paths), 8, backend="pil")
    soft = locks.SoftLock(root / "locks" / "held.lock.soft")
    assert soft.acquire(timeout=0)
    os_lock = locks.OsLock(root / "locks" / "held.lock")
    assert os_lock.acquire(timeout=0)
    def mode(p):
        st = os.stat(p)
        return [oct(st.st_mode & 0o7777), st.st_gid]
    print(json.dumps({name: mode(path) for name, path in {
        "entries": root / "entries", "entry": entry.path,
        "data": entry.path / manifests.DATA_FILE, "manifest": entry.path / manifests.MANIFEST_FILE,
        "tmp": root / "tmp", "locks": root / "locks",
        "soft lock": soft.path, "os lock": os_lock.path}.items()}))
    soft.release()
    os_lock.release()
""")


def modes_under(root: Path, umask: str, paths) -> dict:
    out = subprocess.run([sys.executable, "-c", MODES_CHILD, str(root), umask, *paths],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_entries_and_lock_files_follow_the_umask(tmp_path, cover_paths):
    shared = modes_under(tmp_path / "shared", "002", cover_paths[:2])
    for name in ("entries", "entry", "tmp", "locks"):
        assert shared[name][0] == "0o775", name
    for name in ("soft lock", "os lock"):  # every member opens a lock file to write
        assert shared[name][0] == "0o664", name
    for name in ("data", "manifest"):  # nobody writes a published file again
        assert shared[name][0] == "0o644", name
    private = modes_under(tmp_path / "private", "077", cover_paths[:2])
    for name in ("entries", "entry", "tmp", "locks"):
        assert private[name][0] == "0o700", name
    for name in ("data", "manifest", "soft lock", "os lock"):
        assert private[name][0] == "0o600", name


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="changing a directory's group to an arbitrary gid needs root")
def test_a_setgid_root_gives_every_entry_the_shared_group(tmp_path, cover_paths):
    """The README recipe for a cache several users share: group-owned, setgid, umask 002."""
    root = tmp_path / "team"
    root.mkdir()
    os.chown(root, -1, 4242)
    os.chmod(root, 0o2775)
    modes = modes_under(root, "002", cover_paths[:2])
    for name in ("entries", "entry", "tmp", "locks"):
        assert modes[name] == ["0o2775", 4242], name
    for name in ("soft lock", "os lock"):
        assert modes[name] == ["0o664", 4242], name
    for name in ("data", "manifest"):
        assert modes[name] == ["0o644", 4242], name
