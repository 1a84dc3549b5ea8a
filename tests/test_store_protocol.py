"""The store seam (cachekit/store/protocol.py): the local and the remote store answer the
cache's questions with one shape, and the store package names what other layers use."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import cachekit
from cachekit import store
from cachekit.store import LocalStore, Store, TempName, parse_temp_name
from cachekit.store.remote import RemoteStore

METHODS = [name for name, value in vars(Store).items()
           if callable(value) and not name.startswith("_")]


def parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_asks_for_lookup_remove_and_keys():
    assert sorted(METHODS) == ["keys", "lookup", "remove_entry"]


@pytest.mark.parametrize("cls", [LocalStore, RemoteStore])
@pytest.mark.parametrize("method", METHODS)
def test_both_stores_have_each_method_with_the_protocols_parameters(cls, method):
    assert parameters(getattr(cls, method)) == parameters(getattr(Store, method))


def test_both_stores_are_stores(tmp_path):
    assert isinstance(LocalStore(tmp_path), Store)
    assert isinstance(RemoteStore("s3://bucket/prefix"), Store)  # no connection made yet
    assert not isinstance(object(), Store)


def built(root):
    return cachekit.Cache(root, remote="", workers=1, progress=False).map(
        lambda v: np.full(4, v, dtype=np.uint8), list(range(5)))


def test_the_local_store_lists_and_removes_its_entries_by_key(tmp_path):
    local = LocalStore(tmp_path)
    assert local.keys() == []
    entry = built(tmp_path)
    (tmp_path / "entries" / ("f" * 32)).write_text("a file, not an entry")
    assert local.keys() == [entry.key]
    assert local.remove_entry(entry.key) is True
    assert local.keys() == [] and local.lookup(entry.key) is None
    assert local.remove_entry(entry.key) is False


def test_the_remote_store_lists_and_removes_its_entries_by_key(tmp_path):
    (tmp_path / "shared").mkdir()
    remote = RemoteStore((tmp_path / "shared").as_uri())  # a shared folder: no server
    assert remote.keys() == []
    entry = built(tmp_path / "local")
    assert remote.upload(LocalStore(tmp_path / "local").lookup(entry.key)) is True
    assert remote.keys() == [entry.key]
    upload = remote.lookup(entry.key).upload
    assert remote.remove_entry(entry.key) is True
    assert remote.keys() == [] and remote.lookup(entry.key) is None
    listed, unknown = remote.scan()
    assert unknown == [] and all(upload not in item.uploads for item in listed)
    assert remote.remove_entry(entry.key) is False


@pytest.mark.parametrize("name, expected", [
    ("ab" * 16 + ".node7.4242.0123456789ab", TempName("build", "ab" * 16, "node7", 4242)),
    ("ab" * 16 + ".a.b.c.17.0123456789ab", TempName("build", "ab" * 16, "a.b.c", 17)),
    ("deleting." + "ab" * 16 + ".node7.4242.0123456789ab",
     TempName("removal", "ab" * 16, "node7", 4242)),
    ("ab" * 16 + ".node7.x.0123456789ab", TempName("build", "ab" * 16, "node7", None)),
    ("ab" * 16, None),
    ("deleting.notakey.node7.1.0123456789ab", None),
    (".hidden.tmp", None),
])
def test_a_temp_name_tells_its_kind_key_host_and_pid(name, expected):
    assert parse_temp_name(name) == expected


def test_the_package_exports_what_admin_needs():
    assert {"LocalStore", "Store", "TempName", "parse_temp_name", "BUILD", "REMOVAL",
            "BuildState", "default_root"} <= set(store.__all__)
    assert all(hasattr(store, name) for name in store.__all__)
