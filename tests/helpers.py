"""Assertions and loaders shared by several test modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import filelock


def assert_cache_as_it_was(root: Path) -> None:
    """No published entry, no build directory, and every build lock free."""
    assert list((root / "entries").glob("*")) == []
    assert list((root / "tmp").glob("*")) == []
    for lock_path in (root / "locks").glob("*.lock"):
        lock = filelock.FileLock(str(lock_path))
        lock.acquire(timeout=0)  # raises filelock.Timeout if a build still held it
        lock.release()


def load_module(path: Path, name: str, body: str):
    """Write ``body`` to ``path`` and import it fresh as module ``name``."""
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
