"""Shared fixtures: small real image files, an empty cache root per test, simulated hosts,
plain users sharing one cache root."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import cachekit
import hosts
import users


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def cover_paths(tmp_path: Path) -> list[str]:
    """Twelve cover-like JPEGs (200-500 x 300-700 px) in a fresh directory."""
    from cachekit.samples import write_sample_images

    return write_sample_images(tmp_path / "covers", 12, seed=7)


@pytest.fixture
def cache(cache_root: Path) -> cachekit.Cache:
    return cachekit.Cache(cache_root, workers=2, progress=False)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[tuple[hosts.Host, hosts.Host]]:
    """Hosts "host-a" and "host-b" sharing the cache root ``tmp_path/cache`` (and the scratch
    directory ``tmp_path/work``) whose flock locks do not reach each other; see tests/hosts.py.
    Skips when not root or when ``unshare --uts --mount`` does not work. Processes still
    running at teardown are killed."""
    reason = hosts.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    a, b = hosts.make_hosts(tmp_path, ("host-a", "host-b"))
    try:
        yield a, b
    finally:
        a.kill_all()
        b.kill_all()


@pytest.fixture
def shared_root(tmp_path: Path) -> Iterator[users.SharedRoot]:
    """A cache root ``tmp_path/shared/cache`` owned by root:GID with mode 2775 (setgid) and
    two plain uids of group GID that share it, ``victim`` and ``attacker``; see
    tests/users.py. Skips when not root or when children cannot run as those uids here.
    Processes still running at teardown are killed."""
    reason = users.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    shared = users.make_shared_root(tmp_path)
    try:
        yield shared
    finally:
        shared.kill_all()
