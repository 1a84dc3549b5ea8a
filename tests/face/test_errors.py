"""One exception root: every error cachekit defines derives from CachekitError and pickles."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import cachekit
from cachekit import errors


def cachekit_exceptions() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(cachekit.__path__, "cachekit."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [obj for _, obj in inspect.getmembers(module, inspect.isclass)
                  if issubclass(obj, BaseException) and obj.__module__ == info.name]
    return sorted(set(found), key=lambda c: c.__qualname__)


def test_every_exception_cachekit_defines_derives_from_the_root():
    classes = cachekit_exceptions()
    assert errors.UsageError in classes and errors.NotAnArrayError in classes
    assert [c for c in classes if not issubclass(c, cachekit.CachekitError)] == []


EXAMPLES = [
    cachekit.LockTimeout("/r/locks/k.lock", 5.0, "pid 1 on a (3/9 rows, 33%)", "a hint"),
    cachekit.ImageDecodeError([(3, "/x.jpg", "OSError: truncated")]),
    cachekit.ImageDecodeError([(0, "x.jpg", "FileNotFoundError: x.jpg")], 1, "/home/me"),
    cachekit.CacheCorruptError("/r/entries/k/data.npy", "file is 3 bytes", "a fix"),
    cachekit.ReadOnlyCacheError("/r", "0" * 32),
    cachekit.CacheRootError("/r/file/cache", "/r/file"),
    errors.DatasetCorruptError("/r/entries/k/data.npy", "gone"),
    errors.DatasetCorruptError("/r/entries/k/data.npy", "file is missing", True),
    errors.NotAnArrayError("map: f returned list"),
    errors.UsageError("bad flag"),
    cachekit.EntryNotFoundError("no cache entry matches 'ab12' (see `cachekit ls`)"),
    cachekit.ImageDecodeError([(0, "4", "OSError: bad")], 1, None, "no row succeeded"),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_with_their_message(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)


def test_a_lock_timeout_gives_the_fix_for_the_lock_kind(tmp_path):
    from cachekit.store import locks

    os_lock, soft = locks.make_lock(tmp_path / "k.lock", "os"), locks.make_lock(
        tmp_path / "k.lock", "soft")
    assert "kernel releases" in os_lock.release_hint() and "delete" not in os_lock.release_hint()
    assert "taken over" in soft.release_hint() and str(soft.path) in soft.release_hint()


def test_read_only_names_a_root_that_cannot_be_created(tmp_path):
    missing = cachekit.ReadOnlyCacheError(tmp_path / "new" / "root", "0" * 32)
    assert "cannot be created" in str(missing) and "is read-only," not in str(missing)
    assert "cannot be created" in str(pickle.loads(pickle.dumps(missing)))
    existing = cachekit.ReadOnlyCacheError(tmp_path, "0" * 32)
    assert "is read-only, and entry" in str(existing)
