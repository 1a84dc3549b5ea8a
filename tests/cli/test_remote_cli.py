"""``cachekit push|pull`` and ``ls|info|verify|clear --remote`` against a real S3 server."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cachekit
from cachekit.cli import main
from cachekit.store import LocalStore
from cachekit.store.remote import RemoteStore
from helpers import remote_object


def row(v):
    return np.full((3, 4, 4), v % 251, dtype=np.uint8)


@pytest.fixture
def local(tmp_path, cover_paths):
    """A local root with two entries (a map and an images one), built without the remote."""
    import pandas as pd

    cache = cachekit.Cache(tmp_path / "a", remote="", workers=2, progress=False)
    return tmp_path / "a", [cache.map(row, list(range(20))),
                            cache.images(pd.Series(cover_paths), 8)]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_push_pull_ls_info_verify_and_clear_a_remote(s3_env, local, tmp_path, capsys):
    root, (mapped, images) = local
    status, out, _ = run(capsys, "--root", root, "push", "--all")
    assert status == 0 and out.count("pushed ") == 2
    status, out, _ = run(capsys, "--root", root, "push", mapped.key[:10])
    assert status == 0 and "already on" in out

    status, out, _ = run(capsys, "ls", "--remote")
    assert status == 0 and mapped.key[:12] in out and images.key[:12] in out
    assert "2 entries" in out
    status, out, _ = run(capsys, "ls", "--remote", "--json", "--sort", "size")
    listed = json.loads(out)
    assert {e["key"] for e in listed} == {mapped.key, images.key}
    assert all(e["problem"] is None and e["url"].startswith("s3://") for e in listed)

    status, out, _ = run(capsys, "info", "--remote", images.key[:8])
    assert status == 0 and images.key in out and "libjpeg" in out and "pillow" in out
    assert "upload:" in out and "\nfiles:\n  data.npy: " in out  # as the local info says them
    assert "checksum blake2b-128:" in out

    other = tmp_path / "b"
    status, out, _ = run(capsys, "--root", other, "pull", mapped.key[:8])
    assert status == 0 and "pulled" in out
    pulled = LocalStore(other).lookup(mapped.key)
    assert pulled is not None and pulled.manifest == mapped._manifest
    status, out, _ = run(capsys, "--root", other, "pull", mapped.key[:8])
    assert status == 0 and "already in" in out

    assert run(capsys, "verify", "--remote")[0] == 0
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    data = remote_object(remote, mapped.key, "data.npy")
    body = bytearray(remote.fs.cat_file(data))
    body[-1] ^= 0xFF
    remote.fs.pipe_file(data, bytes(body))
    status, out, _ = run(capsys, "verify", "--remote", mapped.key[:8])
    assert status == 1 and "checksum mismatch" in out

    status, out, _ = run(capsys, "clear", "--remote", "--all", "--dry-run")
    assert status == 0 and "would remove 2 entries" in out
    assert run(capsys, "clear", "--remote", "--all")[0] == 2  # no terminal, no --yes
    status, out, _ = run(capsys, "clear", "--remote", mapped.key[:8], "--yes")
    assert status == 0 and "removed 1 entry" in out
    status, out, _ = run(capsys, "ls", "--remote", "--json")
    assert [e["key"] for e in json.loads(out)] == [images.key]
    assert remote.scan()[0][0].key == images.key  # no object of the cleared key is left


def test_remote_verify_counts_no_entry_of_another_cachekit_version_as_a_problem(
        s3_env, local, capsys):
    from cachekit.key_names import FORMAT_VERSION
    from cachekit.store.remote_entry import manifest_path

    root, (mapped, images) = local
    assert run(capsys, "--root", root, "push", "--all")[0] == 0
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    path = manifest_path(remote, mapped.key)
    raw = json.loads(remote.fs.cat_file(path))
    remote.fs.pipe_file(path, json.dumps({**raw, "format": FORMAT_VERSION - 1}).encode())
    status, out, _ = run(capsys, "verify", "--remote")
    assert status == 0 and "1 entry verified" in out
    assert "1 entry of another cachekit version not checked" in out
    status, out, _ = run(capsys, "ls", "--remote")
    assert f"not used: format {FORMAT_VERSION - 1} is not {FORMAT_VERSION}" in out
    listed = {e["key"]: e for e in json.loads(run(capsys, "ls", "--remote", "--json")[1])}
    assert listed[mapped.key]["other_format"] and not listed[images.key]["other_format"]


def test_the_global_remote_option_wins_over_the_environment(s3_env, local, capsys,
                                                            monkeypatch):
    root, _ = local
    url = s3_env["CACHEKIT_REMOTE"]
    monkeypatch.setenv("CACHEKIT_REMOTE", "")
    assert run(capsys, "--root", root, "push", "--all")[0] == 2  # no remote at all
    assert run(capsys, "--root", root, "--remote", url, "push", "--all")[0] == 0
    status, out, _ = run(capsys, "--remote", url, "ls", "--remote")
    assert status == 0 and "2 entries" in out


def protocol_whose_package_is_missing() -> str:
    """A protocol fsspec knows whose package is not installed here (gcsfs's "gs" on a
    machine with the dev extra only)."""
    import importlib.util

    from fsspec.registry import known_implementations

    for protocol, spec in sorted(known_implementations.items()):
        package = spec["class"].split(".")[0]
        if "err" in spec and importlib.util.find_spec(package) is None:
            return protocol
    raise AssertionError("every store package fsspec knows is installed")


def test_remote_commands_refuse_bad_input_as_usage_errors(s3_env, local, capsys, monkeypatch):
    root, _ = local
    absent = protocol_whose_package_is_missing()
    assert run(capsys, "--root", root, "push")[0] == 2  # neither KEYs nor --all
    assert run(capsys, "--root", root, "pull", "abc")[0] == 2  # matches nothing
    assert run(capsys, "info", "--remote", "zz")[0] == 2
    for url, said in [("s3://", "remote must name a bucket or folder after s3://"),
                      ("file:///", "remote must name a bucket or folder after file://"),
                      ("nosuch://bucket/p", "is not a URL fsspec can open"),
                      (f"{absent}://bucket/p", f"no fsspec filesystem for '{absent}://")]:
        status, _, err = run(capsys, "--remote", url, "ls", "--remote")
        assert status == 2 and err.startswith("cachekit: error: ") and said in err, err
    monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", "-1")
    status, _, err = run(capsys, "ls", "--remote")
    assert status == 2 and "CACHEKIT_REMOTE_TIMEOUT" in err


def test_an_unreachable_remote_is_a_one_line_error_without_credentials(s3_env, local, capsys,
                                                                        monkeypatch):
    root, _ = local
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CACHEKIT_REMOTE_TIMEOUT", "3")
    status, out, err = run(capsys, "--root", root, "push", "--all")
    assert status == 1 and err.startswith("cachekit: error: remote s3://")
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in err + out
    assert s3_env["AWS_ACCESS_KEY_ID"] not in err + out
