"""Every bad argument of the public API raises a CachekitError that is also the builtin
kind (ValueError or TypeError), and its message says what to pass instead."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.cli import main

FIX = re.compile(r"\b(pass|use|must|drop|convert|e\.g\.|one of|move|define|raise)\b")


def _double(x):
    return np.array([x * 2])


# (id, call(cache, paths, tmp_path), builtin kind)
BAD_CALLS = [
    ("empty column", lambda c, p, t: c.images(pd.Series([], dtype=str), size=8), ValueError),
    ("size zero", lambda c, p, t: c.images(p, size=0), ValueError),
    ("size negative", lambda c, p, t: c.images(p, size=(-1, 5)), ValueError),
    ("size a string", lambda c, p, t: c.images(p, size="big"), TypeError),
    ("mode", lambda c, p, t: c.images(p, size=8, mode="XYZ"), ValueError),
    ("column of ints", lambda c, p, t: c.images(pd.Series([1, 2, 3]), size=8), TypeError),
    ("missing paths", lambda c, p, t: c.images(pd.Series([p[0], None]), size=8), ValueError),
    ("not a column", lambda c, p, t: c.images(pd.DataFrame({"a": p}), size=8), TypeError),
    ("fit", lambda c, p, t: c.images(p, size=8, fit="squash"), ValueError),
    ("resample", lambda c, p, t: c.images(p, size=8, resample="cubicish"), ValueError),
    ("on_error", lambda c, p, t: c.images(p, size=8, on_error="ignore"), ValueError),
    ("validate", lambda c, p, t: c.images(p, size=8, validate="never"), ValueError),
    ("backend", lambda c, p, t: c.images(p, size=8, backend="jax"), ValueError),
    ("draft", lambda c, p, t: c.images(p, size=8, draft="yes"), TypeError),
    ("lock_timeout", lambda c, p, t: cachekit.Cache(t / "r", lock_timeout=-1), ValueError),
    ("workers", lambda c, p, t: cachekit.Cache(t / "r", workers=0), ValueError),
    ("executor name", lambda c, p, t: cachekit.Cache(t / "r", executor="gpus"), ValueError),
    ("executor type", lambda c, p, t: cachekit.Cache(t / "r", executor=3), TypeError),
    ("progress", lambda c, p, t: cachekit.Cache(t / "r", progress="loud"), ValueError),
    ("join", lambda c, p, t: cachekit.Cache(t / "r", join="yes"), TypeError),
    ("remote type", lambda c, p, t: cachekit.Cache(t / "r", remote=5), TypeError),
    ("remote without a bucket", lambda c, p, t: cachekit.Cache(t / "r", remote="s3://"),
     ValueError),
    ("map a non-Series", lambda c, p, t: c.map(_double, 5), TypeError),
    ("map empty", lambda c, p, t: c.map(_double, []), ValueError),
    ("memoize an unsupported argument",
     lambda c, p, t: c.memoize(lambda x: np.zeros(1))(object()), TypeError),
    ("memoize a non-function", lambda c, p, t: c.memoize(5), TypeError),
    ("dataset mismatched targets",
     lambda c, p, t: c.map(_double, [1, 2, 3]).dataset(targets=[0, 1]), ValueError),
    ("dataset scalar targets",
     lambda c, p, t: c.map(_double, [1, 2, 3]).dataset(targets=7), TypeError),
    ("dataset transform", lambda c, p, t: c.map(_double, [1, 2, 3]).dataset(transform=1),
     TypeError),
]


@pytest.mark.parametrize("call, kind", [(c, k) for _, c, k in BAD_CALLS],
                         ids=[name for name, _, _ in BAD_CALLS])
def test_a_bad_argument_is_a_cachekit_error_of_the_builtin_kind_naming_a_fix(
        cache: cachekit.Cache, cover_paths: list[str], tmp_path: Path, call, kind) -> None:
    with pytest.raises(cachekit.CachekitError) as info:
        call(cache, pd.Series(cover_paths), tmp_path)
    assert isinstance(info.value, kind)
    assert isinstance(info.value, (cachekit.InvalidArgument, cachekit.InvalidArgumentType))
    assert FIX.search(str(info.value)), str(info.value)


def test_a_bad_column_is_named_as_the_call_names_it(cache: cachekit.Cache) -> None:
    with pytest.raises(cachekit.InvalidArgument, match="^paths is empty"):
        cache.images(pd.Series([], dtype=str), size=8)
    with pytest.raises(cachekit.InvalidArgumentType, match="^paths must be a pandas Series"):
        cache.images(pd.DataFrame({"a": ["x.jpg"]}), size=8)
    with pytest.raises(cachekit.InvalidArgument, match="^values is empty"):
        cache.map(_double, [])


@pytest.mark.parametrize("name, value", [("CACHEKIT_LOCK", "bogus"),
                                         ("CACHEKIT_LOCK_LEASE", "0"),
                                         ("CACHEKIT_MAX_SIZE", "lots"),
                                         ("CACHEKIT_STALE_CHECK", "maybe")])
def test_a_bad_setting_is_an_invalid_argument_naming_it(
        name: str, value: str, cover_paths: list[str], tmp_path: Path, monkeypatch) -> None:
    cache = cachekit.Cache(tmp_path / "root", workers=1, progress=False)
    cache.images(cover_paths, size=8)  # so that the call below is a hit, which checks files
    monkeypatch.setenv(name, value)
    with pytest.raises(cachekit.InvalidArgument, match=f"{name}.*(must|use)") as info:
        # A setting read on a hit raises here; one read by a build only, on the miss below.
        cachekit.Cache(tmp_path / "root", workers=1, progress=False).images(cover_paths, 8)
        cachekit.Cache(tmp_path / "root", workers=1, progress=False).map(_double, [1, 2])
    assert value in str(info.value)


@pytest.mark.parametrize("cls", [cachekit.InvalidArgument, cachekit.InvalidArgumentType])
def test_argument_errors_survive_pickling(cls) -> None:
    error = pickle.loads(pickle.dumps(cls("size must be positive; pass size=32")))
    assert type(error) is cls and str(error) == "size must be positive; pass size=32"


def test_the_cli_exits_with_2_for_a_bad_argument(tmp_path: Path, capsys) -> None:
    status = main(["--root", str(tmp_path / "root"), "build", "--size", "0x-3",
                   str(tmp_path / "list.txt")])
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert "HxW" in err, err


def test_build_help_explains_each_choice(capsys) -> None:
    assert main(["build", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("channels stored", "crop the centre", "resampling filter",
                  "store it as zeros", "what the key covers"):
        assert words in text, words
