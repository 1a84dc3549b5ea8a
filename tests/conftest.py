"""Shared fixtures: small real image files and an empty cache root per test."""

from __future__ import annotations

from pathlib import Path

import pytest

import cachekit


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
