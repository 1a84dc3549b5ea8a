"""Assertions and loaders shared by several test modules."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import filelock
import pytest

from cachekit.obtain import background

IN_THE_BACKGROUND = pytest.mark.skipif(
    not background.THREADS_START_AT_EXIT,
    reason="this Python uploads before the call returns (3.12.0 to 3.12.2, CPython gh-117029)")
"""For the tests of what an upload in the background does."""


class LazyModule:
    """A module imported when a test first uses one of its names, not when its test file is
    collected: every xdist worker collects every file, and ``import torchvision`` alone costs
    seconds of CPU (its models import torch._dynamo) that only the workers running its tests
    should pay."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):  # pytest's collection asks for __test__, __bases__
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


def assert_cache_as_it_was(root: Path) -> None:
    """No published entry, no build directory, and every build lock free."""
    assert list((root / "entries").glob("*")) == []
    assert list((root / "tmp").glob("*")) == []
    for lock_path in (root / "locks").glob("*.lock"):
        lock = filelock.FileLock(str(lock_path))
        lock.acquire(timeout=0)  # raises filelock.Timeout if a build still held it
        lock.release()


def leftovers(root: Path) -> list[str]:
    """The names under ROOT/tmp (build directories and what else is left there), sorted."""
    tmp = root / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


def flip_a_byte(path: Path, from_end: int = 1) -> None:
    """Damage a file on disk as a failing disk does: one byte, ``from_end`` bytes before its
    end, inverted; its size and header kept."""
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))


def load_module(path: Path, name: str, body: str):
    """Write ``body`` to ``path`` and import it fresh as module ``name``."""
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GATED_BUILDER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit

    root, started, go, crash = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

    def slow(v):
        if v == 3:  # mid-build: tell the test, then die or wait for its go-ahead
            started.touch()
            if crash == "crash":
                os._exit(3)  # as a killed sweep agent would
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return np.full(8, v, dtype=np.int64)

    entry = cachekit.Cache(root, workers=1, progress=False).map(slow, pd.Series(range(64)))
    assert not entry.hit
    print(entry.key)
''')
"""A builder of 64 rows (row v is eight int64 v) that stops at row 3 until ``go`` exists, or
dies there with status 3."""

GATED_ROWS = 64


def start_gated_builder(work: Path, root: Path, *, crash: bool = False
                        ) -> tuple[subprocess.Popen, Path]:
    """Start :data:`GATED_BUILDER` on ``root``; return once it is mid-build, with the file
    whose creation lets it go on."""
    script = work / "gated_builder.py"
    script.write_text(GATED_BUILDER)
    started, go = work / "started", work / "go"
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(started), str(go),
                             "crash" if crash else "wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None or crash, f"the builder died early: {proc.communicate()}"
        assert time.monotonic() < deadline, "the builder never started"
        time.sleep(0.01)
    return proc, go


def small_chunks(monkeypatch, rows: int) -> None:
    """Make every build's chunks ``rows`` rows long (while the row count allows): no page
    alignment, at most ``rows`` rows, one chunk per worker at least."""
    from cachekit.engine.filling import plan

    monkeypatch.setattr(plan, "PAGE_BYTES", 1)
    monkeypatch.setattr(plan, "MAX_CHUNK_ROWS", rows)
    monkeypatch.setattr(plan, "CHUNKS_PER_WORKER", 1)


def chunk_journal(build_dir: Path) -> Path:
    return build_dir / "data.npy.chunks"


def done_chunks(build_dir: Path) -> set[int]:
    """Indices of the chunks a build directory's journal records done."""
    journal = chunk_journal(build_dir)
    if not journal.is_dir():
        return set()
    return {int(p.name[5:]) for p in journal.iterdir()
            if p.name.startswith("done.") and p.name[5:].isdigit()}


def rows_not_done(build_dir: Path) -> list[int]:
    """The rows of a build directory that a resume must still compute (all rows when it
    has no plan)."""
    import json

    plan = json.loads((chunk_journal(build_dir) / "plan.json").read_text())
    step, done = plan["chunk_rows"], done_chunks(build_dir)
    return [r for r in range(plan["rows"]) if r // step not in done]


def rewrite_entry(entry_dir: Path, array, structure=None) -> None:
    """Make the published entry ``entry_dir`` hold ``array`` as its main data file, with a
    manifest that agrees with it in every respect (rows, shape, dtype, size, checksum, and
    a signature when CACHEKIT_SIGNING_KEY is set): only the call can tell it is wrong.
    ``structure``: a memoize entry's new structure (its files stay)."""
    import json
    import os

    import numpy as np

    from cachekit import arrays
    from cachekit.store import manifest as manifests

    data = entry_dir / manifests.DATA_FILE
    if array is not None:
        np.save(entry_dir / "replacement.npy", np.ascontiguousarray(array))
        os.replace(entry_dir / "replacement.npy", data)
    size, checksum = arrays.checksum(data)
    path = entry_dir / manifests.MANIFEST_FILE
    raw = json.loads(path.read_text())
    raw.pop("signature", None)
    if array is not None:
        shape, dtype = list(array.shape), array.dtype.str
        raw.update(rows=shape[0], shape=shape, dtype=dtype, failed_rows=[])
        raw["files"][0].update(shape=shape, dtype=dtype, bytes=size, checksum=checksum)
    if structure is not None:
        raw["structure"] = structure
    manifest = manifests.Manifest.from_json(raw, path)
    (entry_dir / "replacement.json").write_bytes(manifests.dumps(manifest))
    os.replace(entry_dir / "replacement.json", path)


def rows_by(work: Path) -> dict[str, list[int]]:
    """Who computed which rows (in order), from the ``rows.txt`` counter that the joining
    tests' agents append ``NAME ROW`` lines to."""
    out: dict[str, list[int]] = {}
    for line in (work / "rows.txt").read_text().splitlines():
        me, value = line.split()
        out.setdefault(me, []).append(int(value))
    return out


def build_journal(root: Path) -> Path:
    """The chunk journal of the one build under way in the cache ``root``."""
    journals = list(root.glob("tmp/*/data.npy.chunks"))
    assert len(journals) == 1, journals
    return journals[0]


_PICTURES: dict[tuple[int, tuple[int, int]], Path] = {}
"""The pictures :func:`write_pictures` encoded, by count and shape, once per process."""


def write_pictures(folder: Path, count: int, shape: tuple[int, int] = (10, 12)) -> list[str]:
    """``count`` small PNGs in the new folder ``folder``, picture ``i`` of its own random
    pixels (seed ``i``), named in order: what incremental builds are tested on. Encoded
    once per process and copied as new files (a hundred tests ask for the same 120)."""
    import atexit
    import shutil
    import tempfile

    made = _PICTURES.get((count, shape))
    if made is None:
        made = Path(tempfile.mkdtemp(prefix="cachekit-test-pictures-")) / "pictures"
        atexit.register(shutil.rmtree, made.parent, ignore_errors=True)
        _encode_pictures(made, count, shape)
        _PICTURES[count, shape] = made
    folder.mkdir()
    for i in range(count):
        shutil.copyfile(made / f"p{i:04d}.png", folder / f"p{i:04d}.png")
    return [str(folder / f"p{i:04d}.png") for i in range(count)]


def _encode_pictures(folder: Path, count: int, shape: tuple[int, int]) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir()
    for i in range(count):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(
            folder / f"p{i:04d}.png")


def lines_in(path: Path) -> list[str]:
    """The lines of a marker file that children append to (who decoded which row, ...);
    [] while none has written it."""
    return path.read_text().splitlines() if path.exists() else []


def one_valid_entry(remote) -> str:
    """Assert that the remote store holds exactly one entry, whole (``verify --remote``'s
    check of every byte), and only that entry's upload; its key."""
    from cachekit.admin.remote_verify import verify

    assert verify(remote) == (1, [])
    keys, unknown, _ = remote.scan()
    assert unknown == [] and len(keys) == 1 and keys[0].manifest is not None
    assert list(keys[0].uploads) == [remote.lookup(keys[0].key).upload]
    return keys[0].key


def remote_object(remote, key: str, name: str) -> str:
    """The object that holds file ``name`` of ``key``'s published remote entry: under its
    upload, or in the pool."""
    found = remote.lookup(key)
    names = [f.name for f in found.manifest.files]
    return found.objects(remote)[names.index(name)]


class FunctionRequest:
    """A request (``cachekit.obtain.Request``) whose build is the one function
    ``build_fn(current, on_chunk) -> Built``, for tests that drive ``obtain`` directly: it is
    its own build, never joined."""

    raise_failures = True
    joinable = False
    replaces = False
    heals = None

    def __init__(self, key: str, build_fn, expected=None) -> None:
        self.key, self.build_fn, self.expected = key, build_fn, expected

    def start(self) -> "FunctionRequest":
        return self

    def computes_nothing(self) -> bool:
        return False

    def build(self, current, on_chunk):
        return self.build_fn(current, on_chunk)

    def join(self, directory, spare) -> None:
        return None

    def committed(self, published) -> None:
        pass


def entry_disk_bytes(entry_dir: Path) -> int:
    """The bytes of an entry's files and of its row index files (ROOT/index/RECIPE/KEY.npy),
    which go with it: what ``cachekit ls`` counts as the entry's."""
    index = entry_dir.parent.parent / "index"
    files = list(entry_dir.iterdir()) + list(index.glob(f"*/{entry_dir.name}.npy"))
    return sum(p.stat().st_size for p in files)
