"""Cache.images end to end in one process: keys, hits, errors, entries and their checks."""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import cachekit
from cachekit import arrays
from cachekit.store import manifest as manifests
from cachekit.store import Layout, LocalStore
from cachekit.engine.decoding.images import load_image

from helpers import leftovers

MISSING = pd.Series([f"/nonexistent/cachekit/{name}.jpg" for name in "abc"], name="img_path")


def published(root: Path) -> list[str]:
    entries = root / "entries"
    return sorted(p.name for p in entries.iterdir()) if entries.exists() else []


def only_kept_rows(root: Path) -> bool:
    """Whether the root holds no entry but the rows one failed build kept."""
    return [e.failed_build is not None for e in cachekit.Cache(root).entries()] == [True]


def test_pinned_key_for_a_fixed_column_and_parameters(cache_root):
    entry = cachekit.Cache(cache_root).images(MISSING, (8, 6), on_error="zero", backend="pil")
    assert entry.key == "f1a52787294053060138dd8ad73c909d"  # "pil" adds nothing to it


def test_build_then_hit_returns_the_same_pixels(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root, workers=2)
    column = pd.Series(cover_paths, name="img_path")
    built = cache.images(column, (16, 12))
    assert not built.hit and built.array.shape == (12, 3, 16, 12)
    assert built.array.dtype == np.uint8 and not built.array.flags.writeable
    for row in (0, 5, 11):
        np.testing.assert_array_equal(built.array[row], load_image(cover_paths[row], (16, 12)))
    again = cachekit.Cache(cache_root).images(column, (16, 12))
    assert again.hit and again.key == built.key and again.path == built.path
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(built.array))
    assert len(again) == 12 and again.valid.all()
    manifest = again.manifest
    assert manifest["column"] == "img_path" and manifest["rows"] == 12
    assert manifest["params"]["size"] == [16, 12] and manifest["builder"]["pid"] == os.getpid()
    assert manifest["files"][0]["checksum"] == arrays.checksum(again.path / manifests.DATA_FILE)[1]


def test_object_and_str_columns_share_one_entry(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    first = cache.images(pd.Series(cover_paths, dtype=object), 8)
    second = cache.images(pd.Series(cover_paths, dtype="str"), 8)
    assert second.hit and second.key == first.key


@pytest.mark.parametrize("kind", ["list of str", "list of Path", "tuple", "numpy str array",
                                  "numpy object array of Path", "Series of Path"])
def test_any_sequence_of_str_or_pathlike_shares_the_entry_of_the_str_series(
        cache_root, cover_paths, kind):
    cache = cachekit.Cache(cache_root)
    first = cache.images(pd.Series(cover_paths, name="img_path"), 8)
    paths = {"list of str": list(cover_paths),
             "list of Path": [Path(p) for p in cover_paths],
             "tuple": tuple(cover_paths),
             "numpy str array": np.array(cover_paths),
             "numpy object array of Path": np.array([Path(p) for p in cover_paths],
                                                    dtype=object),
             "Series of Path": pd.Series([Path(p) for p in cover_paths])}[kind]
    again = cache.images(paths, 8)
    assert again.hit and again.key == first.key
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(first.array))


def test_a_list_of_path_builds_like_its_str_series(cache_root, cover_paths):
    built = cachekit.Cache(cache_root).images([Path(p) for p in cover_paths[:3]], 8)
    assert built.source == "built" and len(built) == 3
    assert cachekit.Cache(cache_root).images(pd.Series(cover_paths[:3]), 8).hit


def test_missing_relative_paths_name_the_working_directory(cache_root, cover_paths,
                                                          tmp_path, monkeypatch):
    covers = Path(cover_paths[0]).parent
    relative = [f"covers/{Path(p).name}" for p in cover_paths[:3]]
    monkeypatch.chdir(covers)  # one level too deep: covers/covers/... does not exist
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cachekit.Cache(cache_root).images(relative, 8)
    message = str(caught.value)
    assert f"looked up from the working directory {covers}" in message
    assert "absolute paths" in message and "on_error='zero'" not in message
    monkeypatch.chdir(covers.parent)  # where they resolve
    assert cachekit.Cache(cache_root).images(relative, 8).source == "built"


@pytest.mark.parametrize("paths, why", [
    (["covers/a.jpg", "{0}"], "one path exists"),
    (["{missing}"], "the path is absolute"),
])
def test_the_working_directory_is_named_only_when_every_relative_path_is_missing(
        cache_root, cover_paths, tmp_path, monkeypatch, paths, why):
    monkeypatch.chdir(tmp_path)
    paths = [p.format(cover_paths[0], missing=tmp_path / "missing.jpg") for p in paths]
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cachekit.Cache(cache_root).images(paths, 8)
    assert "working directory" not in str(caught.value), why
    assert "on_error='zero'" in str(caught.value)


@pytest.mark.parametrize("paths, hint", [
    (pd.Series(["a.jpg", 3]), True),
    (["a.jpg", 3], False),
    ([Path("a.jpg"), b"b.jpg"], False),
])
def test_the_astype_hint_is_given_for_a_series_only(cache_root, paths, hint):
    with pytest.raises(TypeError, match="must hold str or os.PathLike; row 1") as caught:
        cachekit.Cache(cache_root).images(paths, 8)
    assert (".astype(str)" in str(caught.value)) is hint
    assert published(cache_root) == []


def test_row_order_changes_key_and_result_follows_row_order(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    forward = cache.images(pd.Series(cover_paths), 8)
    backward = cache.images(pd.Series(cover_paths[::-1]), 8)
    assert backward.key != forward.key and not backward.hit
    np.testing.assert_array_equal(np.asarray(backward.array), np.asarray(forward.array)[::-1])


@pytest.mark.parametrize("change", [
    {"size": 9}, {"size": (8, 9)}, {"mode": "L"}, {"mode": "RGBA"}, {"fit": "crop"},
    {"fit": "pad"}, {"resample": "nearest"}, {"resample": "lanczos"}, {"on_error": "zero"},
    {"validate": "stat"}, {"validate": "content"}, {"draft": True},
])
def test_each_parameter_changes_the_key(cache_root, cover_paths, change):
    cache = cachekit.Cache(cache_root)
    base = {"size": 8}
    assert cache.images(pd.Series(cover_paths[:2]), **{**base, **change}).key != \
        cache.images(pd.Series(cover_paths[:2]), **base).key


def test_rewritten_file_changes_stat_and_content_keys(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    column = pd.Series(cover_paths[:3])
    path_key = cache.images(column, 8).key
    stat_key = cache.images(column, 8, validate="stat").key
    content_key = cache.images(column, 8, validate="content").key
    target = Path(cover_paths[1])
    before = target.stat()
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF  # same size: only the content differs
    target.write_bytes(bytes(data))
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.images(column, 8).key == path_key
    assert cache.images(column, 8, validate="stat").key == stat_key
    assert cache.images(column, 8, validate="content").key != content_key
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert cache.images(column, 8, validate="stat").key != stat_key


def test_hit_takes_no_lock_and_decodes_nothing(cache_root, cover_paths, monkeypatch):
    cache = cachekit.Cache(cache_root)
    built = cache.images(pd.Series(cover_paths), 8)

    def forbidden(*args, **kwargs):
        raise AssertionError("a hit must not lock or decode")

    monkeypatch.setattr("cachekit.store.locks.make_lock", forbidden)
    monkeypatch.setattr("filelock.FileLock", forbidden)
    monkeypatch.setattr("cachekit.engine.decoding.images.load_image", forbidden)
    hit = cache.images(pd.Series(cover_paths), 8)
    assert hit.hit and hit.key == built.key


@pytest.fixture
def bad_files(tmp_path, cover_paths) -> dict[str, str]:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.jpg").write_bytes(b"")
    whole = Path(cover_paths[0]).read_bytes()
    (bad / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (bad / "text.jpg").write_text("this is not an image\n")
    (bad / "folder.jpg").mkdir()
    return {"missing": str(bad / "missing.jpg"), "empty": str(bad / "empty.jpg"),
            "truncated": str(bad / "truncated.jpg"), "text": str(bad / "text.jpg"),
            "directory": str(bad / "folder.jpg")}


def test_on_error_raise_lists_every_bad_row_and_publishes_no_entry(cache_root, cover_paths,
                                                                   bad_files):
    paths = [cover_paths[0], *bad_files.values(), cover_paths[1]]
    with pytest.raises(cachekit.ImageDecodeError) as caught:
        cachekit.Cache(cache_root).images(pd.Series(paths), 8)
    failures = caught.value.failures
    assert [row for row, _, _ in failures] == [1, 2, 3, 4, 5]
    assert [path for _, path, _ in failures] == list(bad_files.values())
    assert all(reason for _, _, reason in failures)
    assert isinstance(caught.value, ValueError) and "on_error='zero'" in str(caught.value)
    assert only_kept_rows(cache_root) and leftovers(cache_root) == []
    clone = pickle.loads(pickle.dumps(caught.value))
    assert clone.failures == failures


def test_on_error_zero_stores_zeros_and_marks_rows_invalid(cache_root, cover_paths, bad_files):
    paths = [cover_paths[0], *bad_files.values(), cover_paths[1]]
    entry = cachekit.Cache(cache_root).images(pd.Series(paths), 8, on_error="zero")
    assert entry.valid.tolist() == [True, False, False, False, False, False, True]
    assert not np.asarray(entry.array[1:6]).any()
    assert np.asarray(entry.array[0]).any() and np.asarray(entry.array[6]).any()
    assert [row for row, _, _ in entry.manifest["failed_rows"]] == [1, 2, 3, 4, 5]
    assert cachekit.Cache(cache_root).images(pd.Series(paths), 8, on_error="zero").hit


def test_truncated_data_file_raises_cache_corrupt_error(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    entry = cache.images(pd.Series(cover_paths), 8)
    data = entry.path / manifests.DATA_FILE
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(cachekit.CacheCorruptError, match="bytes, expected") as caught:
        cache.images(pd.Series(cover_paths), 8)
    assert str(data) in str(caught.value) and isinstance(caught.value, OSError)


def square_block(v: int) -> np.ndarray:
    return np.full((3, 8, 8), v, dtype=np.uint8)


def test_manifest_shape_disagreeing_with_data_raises(cache_root):
    # map: the call knows the rows, not their shape, so only the data file can tell.
    cache = cachekit.Cache(cache_root)
    entry = cache.map(square_block, list(range(12)))
    manifest_path = entry.path / manifests.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["shape"] = manifest["files"][0]["shape"] = [12, 3, 4, 16]  # same bytes, other shape
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(cachekit.CacheCorruptError, match="manifest says"):
        cache.map(square_block, list(range(12)))


def test_tensor_shares_the_file_without_a_warning(cache_root, cover_paths):
    import torch

    entry = cachekit.Cache(cache_root).images(pd.Series(cover_paths), 8)
    tensor = entry.tensor()  # filterwarnings=error turns a non-writable warning into a failure
    assert tensor.dtype == torch.uint8 and tuple(tensor.shape) == entry.array.shape
    assert torch.equal(tensor, torch.from_numpy(np.array(entry.array)))
    tensor[0] = 0  # copy-on-write: the cache file stays intact
    assert np.asarray(entry.array[0]).any()
    assert arrays.checksum(entry.path / manifests.DATA_FILE)[1] == entry.manifest["files"][0]["checksum"]


@pytest.mark.parametrize("rows", ["all", "every other"])
def test_tensor_of_an_entry_removed_after_its_call_reads_the_files_it_kept_open(
        cache_root, cover_paths, rows):
    """Another agent's budget may evict the entry a call just returned: its tensor is then
    made of the files the entry keeps open (mapped copy-on-write for a contiguous entry);
    an entry unpickled elsewhere, which opens its files by path, cannot."""
    cache = cachekit.Cache(cache_root)
    full = cache.images(pd.Series(cover_paths), 8)
    expected = np.array(full.array)
    chosen = pd.Series(cover_paths) if rows == "all" else pd.Series(cover_paths[::2])
    entry = full if rows == "all" else cache.images(chosen, 8)
    assert entry.contiguous == (rows == "all")
    unpickled = pickle.loads(pickle.dumps(entry))
    cache.clear()
    assert not entry.path.exists()
    tensor = entry.tensor()
    np.testing.assert_array_equal(tensor.numpy(), expected[:: 1 if rows == "all" else 2])
    tensor[0] = 0  # its own copy of the row
    assert np.asarray(entry.array[0]).any() and entry.tensor()[0].any()
    with pytest.raises(cachekit.CacheCorruptError):
        unpickled.tensor()


@pytest.mark.parametrize("paths, error, words", [
    (pd.Series([], dtype=object), ValueError, "empty"),
    (pd.Series(["a.jpg", None]), ValueError, "rows [1]"),
    (pd.Series(["a.jpg", float("nan")]), ValueError, "rows [1]"),
    (pd.Series(["a.jpg", 3]), TypeError, "row 1"),
    ("a.jpg", TypeError, "Series"),
])
def test_bad_path_columns_are_rejected(cache_root, paths, error, words):
    with pytest.raises(error) as caught:
        cachekit.Cache(cache_root).images(paths, 8)
    assert words in str(caught.value)
    assert published(cache_root) == []


@pytest.mark.parametrize("kwargs, error, words", [
    ({"size": 0}, ValueError, "size"), ({"size": (8, -1)}, ValueError, "size"),
    ({"size": (8,)}, TypeError, "size"), ({"size": 8.0}, TypeError, "size"),
    ({"size": True}, TypeError, "size"),
    ({"mode": "CMYK"}, ValueError, "'RGB', 'L', 'RGBA'"),
    ({"fit": "zoom"}, ValueError, "'stretch', 'crop', 'pad'"),
    ({"resample": "cubic"}, ValueError, "'bilinear'"),
    ({"on_error": "skip"}, ValueError, "'raise', 'zero'"),
    ({"validate": "mtime"}, ValueError, "'path', 'stat', 'content'"),
    ({"draft": "yes"}, TypeError, "draft"),
])
def test_bad_arguments_name_the_argument_and_allowed_values(cache_root, kwargs, error, words):
    with pytest.raises(error) as caught:
        cachekit.Cache(cache_root).images(MISSING, **{"size": 8, **kwargs})
    assert words in str(caught.value)


@pytest.mark.parametrize("kwargs", [{"lock_timeout": -1}, {"lock_timeout": "1"},
                                    {"workers": 0}, {"workers": 1.5}, {"progress": "yes"}])
def test_bad_cache_options_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        cachekit.Cache("/tmp/unused", **kwargs)


def test_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEKIT_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cachekit.Cache().root == tmp_path / "explicit"
    assert cachekit.Cache(tmp_path / "given").root == tmp_path / "given"
    monkeypatch.delenv("CACHEKIT_DIR")
    assert cachekit.Cache().root == tmp_path / "xdg" / "cachekit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cachekit.Cache().root == tmp_path / "home" / ".cache" / "cachekit"


def test_lock_timeout_when_another_process_holds_the_build_lock(cache_root):
    import filelock

    cache = cachekit.Cache(cache_root, lock_timeout=0.5)
    lock_path = Layout(cache_root).lock_path(
        cachekit.Cache(cache_root.parent / "probe").images(MISSING, 8, on_error="zero").key)
    lock_path.parent.mkdir(parents=True)
    with filelock.FileLock(str(lock_path)):
        with pytest.raises(cachekit.LockTimeout) as caught:
            cache.images(MISSING, 8, on_error="zero")
    assert isinstance(caught.value, TimeoutError) and str(lock_path) in str(caught.value)
    assert pickle.loads(pickle.dumps(caught.value)).lock_path == str(lock_path)
    assert cache.images(MISSING, 8, on_error="zero").valid.tolist() == [False] * 3


def test_errors_pickle_and_subclass_the_stdlib_types():
    corrupt = cachekit.CacheCorruptError("/x/data.npy", "file is 3 bytes")
    clone = pickle.loads(pickle.dumps(corrupt))
    assert (clone.path, clone.reason, str(clone)) == (corrupt.path, corrupt.reason, str(corrupt))
    assert isinstance(corrupt, OSError) and isinstance(corrupt, cachekit.CachekitError)
    assert issubclass(cachekit.LockTimeout, TimeoutError)
    assert issubclass(cachekit.ImageDecodeError, ValueError)


@pytest.mark.parametrize("below", ["", "sub/cache"])
def test_a_root_that_is_a_file_is_refused_at_construction(tmp_path, below):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    root = file / below if below else file
    with pytest.raises(cachekit.CacheRootError) as caught:
        cachekit.Cache(root)
    error = caught.value
    assert isinstance(error, NotADirectoryError) and isinstance(error, cachekit.CachekitError)
    assert (error.root, error.blocker) == (str(root), str(file))
    assert str(file) in str(error) and "a directory" in str(error)
    assert len(traceback.extract_tb(error.__traceback__)) <= 4  # raised near the call
    assert cachekit.Cache(tmp_path / "new" / "cache").root == tmp_path / "new" / "cache"
    assert not (tmp_path / "new").exists()  # nothing made before a build


@pytest.mark.parametrize("root", ["/proc/cachekit-root", "/proc/cachekit-root/below"])
def test_a_root_that_cannot_be_made_is_said_so_on_the_first_build(root, cover_paths):
    """/proc exists and refuses new folders: the build's error names the root it could not
    make and what to give instead, and stays the OSError that making it raised."""
    with pytest.raises(FileNotFoundError) as caught:
        cachekit.Cache(root, progress=False).images(pd.Series(cover_paths[:2]), 8)
    assert str(caught.value).startswith(f"[Errno 2] the cache root {root} cannot be made")
    assert "CACHEKIT_DIR" in str(caught.value)


def test_public_names_match_all():
    public = {name for name in dir(cachekit) if not name.startswith("_")
              and not isinstance(getattr(cachekit, name), types.ModuleType)}
    assert public == set(cachekit.__all__) - {"__version__"}


def test_entry_cleared_between_manifest_and_data_is_built_again(cache_root, cover_paths,
                                                                monkeypatch):
    import shutil

    cache = cachekit.Cache(cache_root)
    built = np.array(cache.images(pd.Series(cover_paths), 8).array)
    real_lookup, raced = LocalStore.lookup, []

    def lookup_then_clear(store, key):
        found = real_lookup(store, key)
        if found is not None and not raced:  # `cachekit clear` removes it right after
            raced.append(key)
            shutil.rmtree(found.path)
        return found

    monkeypatch.setattr(LocalStore, "lookup", lookup_then_clear)
    again = cache.images(pd.Series(cover_paths), 8)
    assert raced and not again.hit
    np.testing.assert_array_equal(np.asarray(again.array), built)


def test_categorical_path_column_is_keyed_like_str(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    plain = cache.images(pd.Series(cover_paths), 8)
    categorical = cache.images(pd.Series(cover_paths, dtype="category"), 8)
    assert categorical.hit and categorical.key == plain.key


def test_entry_directory_without_manifest_is_corrupt_not_a_miss(cache_root, cover_paths):
    cache = cachekit.Cache(cache_root)
    entry = cache.images(pd.Series(cover_paths), 8)
    (entry.path / manifests.MANIFEST_FILE).unlink()
    with pytest.raises(cachekit.CacheCorruptError, match="manifest is missing"):
        cache.images(pd.Series(cover_paths), 8)


def test_an_entry_removed_while_a_lookup_reads_it_is_a_miss_not_corrupt(cache_root, cover_paths,
                                                                        monkeypatch):
    """``clear``, ``prune`` and the budget rename an entry aside and then delete its files: a
    lookup that opened the entry's directory just before reads no manifest there, and
    builds again instead of calling the entry corrupt."""
    first = cachekit.Cache(cache_root).images(pd.Series(cover_paths), 8)
    store, read = LocalStore(cache_root), manifests.read_at

    def removed_meanwhile(directory, key):
        monkeypatch.setattr(manifests, "read_at", read)
        assert store.remove_entry(key)
        return read(directory, key)

    monkeypatch.setattr(manifests, "read_at", removed_meanwhile)
    again = cachekit.Cache(cache_root).images(pd.Series(cover_paths), 8)
    assert again.outcome == "built" and again.key == first.key
    np.testing.assert_array_equal(np.asarray(again.array), np.asarray(first.array))


def test_content_validation_does_not_hang_on_a_fifo(tmp_path, cover_paths):
    import subprocess
    import sys

    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    code = (
        "import sys, pandas as pd, cachekit\n"
        "entry = cachekit.Cache(sys.argv[1]).images(pd.Series(sys.argv[2:]), 8,"
        " validate='content', on_error='zero', backend='pil')\n"  # (no torch to import)
        "print(entry.valid.tolist())\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache"),
                             cover_paths[0], str(fifo)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[True, False]"


def test_waiters_share_a_failed_build_instead_of_repeating_it(cache_root, cover_paths,
                                                               bad_files, monkeypatch):
    import threading
    import time

    from cachekit.engine.decoding import images

    decoded, real = [], images.load_image

    def slow(path, *args):
        decoded.append(path)
        time.sleep(0.05)  # keeps the build open while every caller asks
        return real(path, *args)

    monkeypatch.setattr("cachekit.engine.decoding.images.load_image", slow)
    paths = pd.Series([*cover_paths[:6], bad_files["text"]])
    barrier, errors = threading.Barrier(3), []

    def agent():
        barrier.wait()
        try:
            cachekit.Cache(cache_root, workers=1, progress=False).images(paths, 8)
        except cachekit.ImageDecodeError as e:
            errors.append(e.failures)

    threads = [threading.Thread(target=agent) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3 and all(f == errors[0] for f in errors)
    assert errors[0][0][0] == 6
    assert len(decoded) == len(paths)  # one build for the three callers
    assert only_kept_rows(cache_root)
    with pytest.raises(cachekit.ImageDecodeError):  # a later call tries the failed row again
        cachekit.Cache(cache_root, progress=False).images(paths, 8)
    assert len(decoded) == len(paths) + 1


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(st.characters(exclude_categories=()), min_size=1, max_size=12),
       validate=st.sampled_from(["path", "stat", "content"]))
@example(name="nul\0byte.png", validate="path")
@example(name="\ud800.png", validate="stat")
def test_no_path_string_fails_the_whole_call_under_on_error_zero(tmp_path, cover_paths, name,
                                                                 validate):
    """Any str at all as a path (a NUL byte, a lone surrogate, a directory name, "."):
    under on_error="zero" that row alone fails, and the good row decodes."""
    root = tmp_path / f"cache-{len(os.listdir(tmp_path))}"
    entry = cachekit.Cache(root, workers=1, progress=False).images(
        [cover_paths[0], name], 8, on_error="zero", validate=validate)
    assert entry.valid[0] and entry.array[0].any()
    if not entry.valid[1]:
        assert not entry.array[1].any()


def test_a_cold_call_enters_cache_py_once_and_obtain_drives_the_rest(cache_root, cover_paths):
    """The public face checks, keys and hands over: nothing below calls back into it."""
    import cachekit.cache as face

    entered: list[str] = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == face.__file__:
            caller = frame.f_back
            if caller is None or caller.f_code.co_filename != face.__file__:
                entered.append(frame.f_code.co_name)
        return None

    cache = cachekit.Cache(cache_root, workers=1, executor="threads", progress=False)
    sys.settrace(tracer)
    try:
        entry = cache.images(pd.Series(cover_paths[:4]), 8)
    finally:
        sys.settrace(None)
    assert entry.source == "built" and entered == ["images"]
