"""What the stores answer alike, and what the store package names for other layers: the
local and the remote store each list their entries' keys and remove an entry by key
(``cachekit ls`` and ``clear`` ask both), and the package exports what admin/ imports.
"""

from __future__ import annotations

import numpy as np
import pytest

import cachekit
from cachekit import store
from cachekit.store import LocalStore, TempName, parse_temp_name
from cachekit.store.remote import RemoteStore


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
    listed, unknown, _ = remote.scan()
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
    assert {"LocalStore", "TempName", "parse_temp_name", "BUILD", "REMOVAL",
            "BuildState", "default_root"} <= set(store.__all__)
    assert all(hasattr(store, name) for name in store.__all__)
