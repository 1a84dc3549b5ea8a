"""Write faults, full disks and read-only roots: a clear error, the build directory removed,
the lock released, nothing published, and the cache still usable afterwards.

Faults are injected three ways: ``mock.patch`` on module-qualified calls failing at every
call position a clean build makes; ``RLIMIT_FSIZE`` in a child interpreter; and, where the
tests may mount (root with CAP_SYS_ADMIN), a real full tmpfs and a read-only remount.
"""

from __future__ import annotations

import builtins
import errno
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import ImageDecodeError, arrays, keys
from cachekit.store import locks, manifest as manifests
from cachekit.store import Layout
from cachekit.engine.decoding.images import load_image

from helpers import small_chunks

SIZE = (8, 8)

# module-qualified call -> the error it raises when injected
TARGETS = {
    "cachekit._fs.os.replace": OSError(errno.ENOSPC, "No space left on device"),
    "cachekit._fs.os.fsync": OSError(errno.EIO, "Input/output error"),
    "cachekit._fs.os.rename": OSError(errno.EIO, "Input/output error"),
    "cachekit._fs.os.posix_fallocate": OSError(errno.ENOSPC, "No space left on device"),
    "cachekit._fs.os.open": OSError(errno.EDQUOT, "Disk quota exceeded"),
    "cachekit._fs.os.write": OSError(errno.ENOSPC, "No space left on device"),
    "cachekit.arrays.os.ftruncate": OSError(errno.EFBIG, "File too large"),
    "cachekit.arrays.block_checksums": OSError(errno.EIO, "Input/output error"),
    "cachekit.arrays.flush_bytes": OSError(errno.EIO, "Input/output error"),
    "cachekit._fs.json.dumps": OSError(errno.ENOSPC, "No space left on device"),
}


@pytest.fixture
def column(cover_paths):
    return pd.Series(cover_paths)


@pytest.fixture
def reference(cover_paths):
    return np.stack([load_image(p, SIZE) for p in cover_paths])


def fresh_build(root: Path, column: pd.Series) -> cachekit.Entry:
    return cachekit.Cache(root, workers=2, progress=False, lock_timeout=0).images(column, SIZE)


def resolve(target: str):
    """The object and attribute a dotted target such as ``cachekit._fs.os.replace`` names."""
    parts = target.split(".")
    owner = importlib.import_module(".".join(parts[:2]))
    for attr in parts[2:-1]:
        owner = getattr(owner, attr)
    return owner, parts[-1]


def count_calls(target: str, run) -> int:
    owner, name = resolve(target)
    real = getattr(owner, name)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(owner, name, counting):
        run()
    return len(calls)


@contextmanager
def failing_call(target: str, nth: int, error: OSError):
    """Patch ``target`` to raise ``error`` on its ``nth`` call (1-based) and pass through else."""
    owner, name = resolve(target)
    real = getattr(owner, name)
    calls = []

    def sometimes(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:  # like the real call, name the file when there is one
            named = args and isinstance(args[0], (str, os.PathLike))
            raise type(error)(error.errno, error.strerror, *([str(args[0])] if named else []))
        return real(*args, **kwargs)

    with mock.patch.object(owner, name, sometimes):
        yield calls


def assert_clean_after_failure(root: Path, key: str) -> None:
    """No build directory left, no lock held, and no entry unless a complete one (a fault
    when reading back a just-published entry fails the call, not the entry)."""
    published = sorted(p.name for p in (root / "entries").iterdir()) if (
        root / "entries").exists() else []
    assert published in ([], [key], [keys.kept_key(key)])  # (a fault on one image: kept rows)
    if published:
        entry = root / "entries" / published[0]
        manifest = manifests.read(entry)
        assert arrays.checksum(entry / manifests.DATA_FILE)[1] == manifest.files[0].checksum
    assert not (root / "tmp").exists() or list((root / "tmp").iterdir()) == []
    lock = locks.make_lock(Layout(root).lock_path(key), "os")
    assert lock.acquire(timeout=0)  # released: a fresh lock in this very process gets it
    lock.release()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_write_fault_at_every_call_position_fails_cleanly(tmp_path, column, reference,
                                                            target, monkeypatch):
    small_chunks(monkeypatch, 4)  # 12 rows: three chunks, three done records
    monkeypatch.setenv("CACHEKIT_LOCK", "os")
    key = fresh_build(tmp_path / "probe", column).key
    calls = count_calls(target, lambda: fresh_build(tmp_path / "count", column))
    assert calls >= 1, f"a clean build never calls {target}"
    failed = 0
    for nth in range(1, calls + 1):
        root = tmp_path / f"fault{nth}"
        error = TARGETS[target]
        try:
            with failing_call(target, nth, error):
                entry = fresh_build(root, column)
        except ImageDecodeError as caught:  # the fault hit the read of a source image
            failed += 1
            assert error.strerror in caught.failures[0][2]
            assert_clean_after_failure(root, key)
        except OSError as caught:
            failed += 1
            assert caught.errno == error.errno, caught
            if error.errno in (errno.ENOSPC, errno.EDQUOT):  # says where and what happened
                assert ("nothing was published" in str(caught) and str(root) in str(caught)
                        or str(root) in str(caught.filename))
            assert_clean_after_failure(root, key)
        else:  # a fault in a best-effort step: the entry must still be complete and right
            np.testing.assert_array_equal(np.asarray(entry.array), reference)
        again = fresh_build(root, column)  # the cache is still usable
        np.testing.assert_array_equal(np.asarray(again.array), reference)
        assert arrays.checksum(again.path / manifests.DATA_FILE)[1] == again.manifest["files"][0]["checksum"]
        assert list((root / "tmp").iterdir()) == []
    assert failed >= 1


FSIZE_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from pathlib import Path
    import pandas as pd
    import cachekit

    root, limit, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    cache = cachekit.Cache(root, workers=2, progress=False, lock_timeout=0)
    report = {}
    try:
        # 12 x 3 x 96 x 96 bytes: beyond the limit. pil: the limit hits the store's
        # writes, whatever decodes, and no torch to import
        cache.images(pd.Series(paths), 96, backend="pil")
    except OSError as e:
        report["errno"], report["message"] = e.errno, str(e)
    report["tmp"] = os.listdir(Path(root) / "tmp")
    report["entries"] = os.listdir(Path(root) / "entries")
    small = cache.images(pd.Series(paths), 8, backend="pil")  # the cache is still usable
    report["small"] = [small.hit, list(small.array.shape)]
    print(json.dumps(report))
""")


def test_file_size_limit_in_a_child_fails_cleanly_and_the_cache_stays_usable(tmp_path,
                                                                           cover_paths):
    out = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path / "cache"),
                          str(64 << 10), *cover_paths], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errno"] == errno.EFBIG and "nothing was published" in report["message"]
    assert report["tmp"] == [] and report["entries"] == []
    assert report["small"] == [False, [12, 3, 8, 8]]


def can_mount() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0 and sys.platform.startswith("linux")


@contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


DISK_FULL_CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import pandas as pd
    import cachekit, cachekit._fs

    root, prealloc, paths = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
    if not prealloc:
        cachekit._fs.preallocate_fd = lambda fd: None
    cache = cachekit.Cache(root, workers=2, progress=False, lock_timeout=0)
    report = {}
    try:
        # 12 x 3 x 256 x 256: about 2.4 MB. pil: as in FSIZE_CHILD
        cache.images(pd.Series(paths), 256, backend="pil")
    except OSError as e:
        report["errno"], report["message"] = e.errno, str(e)
    report["tmp"] = os.listdir(Path(root) / "tmp")
    report["entries"] = os.listdir(Path(root) / "entries")
    small = cache.images(pd.Series(paths), 8, backend="pil")
    report["small"] = [small.hit, list(small.array.shape)]
    print(json.dumps(report))
""")


@pytest.mark.skipif(not can_mount(), reason="needs root on Linux to mount a small tmpfs")
def test_a_really_full_disk_raises_enospc_instead_of_killing_the_process(tmp_path, cover_paths):
    with tmpfs(tmp_path / "small", "1m") as mount:
        out = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(mount / "cache"), "1",
                              *cover_paths], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["errno"] == errno.ENOSPC and "nothing was published" in report["message"]
        assert report["tmp"] == [] and report["entries"] == []
        assert report["small"] == [False, [12, 3, 8, 8]]


@pytest.mark.skipif(not can_mount(), reason="needs root on Linux to mount a small tmpfs")
def test_without_preallocation_a_full_disk_kills_the_builder_with_sigbus(tmp_path, cover_paths):
    """Why a fill preallocates (arrays.create_array): the same build, with it switched off,
    dies of SIGBUS."""
    with tmpfs(tmp_path / "small", "1m") as mount:
        out = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(mount / "cache"), "0",
                              *cover_paths], capture_output=True, text=True, timeout=120)
        assert out.returncode == -signal.SIGBUS, (out.returncode, out.stderr[-2000:])


@pytest.mark.skipif(not can_mount(), reason="needs root on Linux to mount a small tmpfs")
def test_a_disk_the_budget_fits_holds_each_build_room_made_before_it_writes(
        tmp_path, cover_paths, capsys):
    """A 4 MB disk and a 3 MB budget: the second entry (2.1 MB) would not fit beside the
    first (2.4 MB, no longer used), which goes before the build writes, not after."""
    with tmpfs(tmp_path / "small", "4m") as mount:
        cache = cachekit.Cache(mount / "cache", max_size="3M", workers=2)
        first = cache.images(pd.Series(cover_paths), 256, backend="pil").path
        capsys.readouterr()
        second = cache.images(pd.Series(cover_paths), 240, backend="pil")
        said = capsys.readouterr().err
        assert f"make room for the 2.1 MB entry {second.key[:12]} is about to write" in said
        assert second.outcome == "built" and not first.exists()
        assert [e.key for e in cache.entries()] == [second.key]


@pytest.mark.skipif(not can_mount(), reason="needs root on Linux to remount a tmpfs read-only")
def test_a_read_only_root_serves_hits_and_names_itself_on_a_miss(tmp_path, cover_paths,
                                                                 reference):
    with tmpfs(tmp_path / "ro", "16m") as mount:
        root = mount / "cache"
        column = pd.Series(cover_paths)
        built = fresh_build(root, column)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with pytest.raises(OSError) as probe:
            (mount / "probe").touch()
        assert probe.value.errno == errno.EROFS  # really read-only, even for root
        cache = cachekit.Cache(root, progress=False)
        hit = cache.images(column, SIZE)
        assert hit.hit and hit.key == built.key
        np.testing.assert_array_equal(np.asarray(hit.array), reference)
        assert hit.tensor().shape == (12, 3, 8, 8)
        for miss in (lambda: cache.images(column, 9),
                     lambda: cache.map(np.sqrt, pd.Series([1.0, 4.0]), version="1")):
            with pytest.raises(cachekit.ReadOnlyCacheError, match="read-only") as caught:
                miss()
            assert str(root) in str(caught.value) and isinstance(caught.value, PermissionError)


def test_an_unwritable_root_is_reported_as_read_only(cache_root, cover_paths):
    """Portable stand-in for the mount test (tests often run as root, which chmod cannot stop)."""
    column = pd.Series(cover_paths[:3])
    fresh_build(cache_root, column)
    real_access = os.access

    def no_write(path, mode, *args, **kwargs):
        return False if mode & os.W_OK else real_access(path, mode, *args, **kwargs)

    with mock.patch("cachekit.store.local.os.access", no_write):
        assert fresh_build(cache_root, column).hit
        with pytest.raises(cachekit.ReadOnlyCacheError, match="is read-only"):
            fresh_build(cache_root, pd.Series(cover_paths[:4]))


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def test_a_hit_writes_nothing_but_its_best_effort_use_stamp(cache_root, cover_paths):
    column = pd.Series(cover_paths)
    fresh_build(cache_root, column)
    import torch  # noqa: F401  (imported before the guard: importing is not the hit's doing)

    real_open, real_os_open = builtins.open, os.open

    def read_only_open(file, mode="r", *args, **kwargs):
        assert not set(str(mode)) & set("wax+"), f"a hit opened {file} with mode {mode}"
        return real_open(file, mode, *args, **kwargs)

    def read_only_os_open(path, flags, *args, **kwargs):
        assert not flags & WRITE_FLAGS, f"a hit opened {path} for writing"
        return real_os_open(path, flags, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError(f"a hit changed the filesystem: {args}")

    patches = [mock.patch("builtins.open", read_only_open),
               mock.patch("os.open", read_only_os_open)]
    patches += [mock.patch(f"os.{name}", forbidden) for name in (
        "mkdir", "makedirs", "rename", "replace", "unlink", "remove", "rmdir", "truncate",
        "ftruncate", "posix_fallocate", "link", "symlink", "chmod")]
    for patch in patches:
        patch.start()
    try:
        entry = cachekit.Cache(cache_root, progress=False).images(column, SIZE)
        assert entry.hit and np.asarray(entry.array).any() and entry.valid.all()
        assert entry.tensor().shape == (12, 3, 8, 8)
    finally:
        for patch in patches:
            patch.stop()


def test_a_filesystem_without_hard_links_still_builds(tmp_path, column, reference,
                                                      monkeypatch):
    """Done records are published with link(2); where a mount refuses links (EPERM, some
    FUSE and SMB mounts) they fall back to a checked rename, and the build still works."""
    small_chunks(monkeypatch, 4)
    refused = []

    def no_links(*args, **kwargs):
        refused.append(args)
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr("cachekit._fs.os.link", no_links)
    entry = fresh_build(tmp_path / "cache", column)
    assert refused  # every chunk's done record took the fallback
    np.testing.assert_array_equal(np.asarray(entry.array), reference)
