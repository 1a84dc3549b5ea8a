"""The remote store against a real S3 server (SeaweedFS on loopback): create-only writes and
every answer a store gives to a failed one, uploads, and remote data treated as untrusted."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachekit
from cachekit.store import manifest as manifests
import s3
from helpers import remote_object
from cachekit.admin.remote_verify import verify as verify_remote
from cachekit.errors import CacheCorruptError, RemoteUnavailableError, RemoteWarning
from cachekit.obtain import background
from cachekit.store import LocalStore, bucket, remote_upload
from cachekit.store.remote import (CHECK, EXISTS, OTHER, RemoteStore, classify_failed_create,
    redact)


def row(v):
    return np.full((3, 8, 8), v % 251, dtype=np.uint8)


VALUES = list(range(40))


def local_entry(root: Path) -> cachekit.Entry:
    """A local entry, built without any remote."""
    return cachekit.Cache(root, remote="", workers=2, progress=False).map(row, VALUES)


def remote_of(env: dict[str, str], endpoint: str | None = None) -> RemoteStore:
    if endpoint is not None:
        import s3fs
        # A second endpoint: its own filesystem, not the instance cached for the first.
        store = RemoteStore(env["CACHEKIT_REMOTE"])
        store._fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True,
                                      config_kwargs={"read_timeout": 10,
                                                     "retries": {"max_attempts": 1}})
        store._root = env["CACHEKIT_REMOTE"][len("s3://"):]
        import os

        store._pid = os.getpid()
        return store
    return RemoteStore(env["CACHEKIT_REMOTE"])


def published(root: Path, key: str):
    found = LocalStore(root).lookup(key)
    assert found is not None
    return found


# Create-only writes ------------------------------------------------------------------------


def test_a_second_create_only_write_is_refused_by_seaweedfs_as_einval_and_means_exists(s3_env):
    remote = remote_of(s3_env)
    path = remote.path("probe")
    assert remote.create(path, b"first", "probing") is True
    with pytest.raises(OSError) as refused:  # what s3fs makes of SeaweedFS's 412
        remote.fs.pipe_file(path, b"second", mode="create")
    assert refused.value.errno == errno.EINVAL and not isinstance(refused.value,
                                                                  FileExistsError)
    assert classify_failed_create(refused.value) == EXISTS
    assert remote.create(path, b"second", "probing") is False
    assert remote.fs.cat_file(path) == b"first"


@pytest.mark.parametrize("answer, raised", [
    ("412-condition", FileExistsError),  # AWS: s3fs reads the Condition element
    ("412", OSError),                    # SeaweedFS: OSError(EINVAL)
    ("409", OSError),                    # a concurrent conflict: OSError(EBUSY)
])
def test_each_store_answer_to_a_failed_create_means_exists(s3_server, s3_env, answer, raised):
    proxy = s3.Proxy(("127.0.0.1", s3_server.ports["s3.port"]), mode=answer)
    try:
        remote = remote_of(s3_env, proxy.endpoint)
        path = remote.path("fresh-object")
        with pytest.raises(raised) as e:
            remote.fs.pipe_file(path, b"x", mode="create")
        assert type(e.value) is raised
        assert classify_failed_create(e.value) == EXISTS
        assert remote.create(path, b"x", "probing") is False
        assert proxy.rejected == 2
        proxy.mode = "forward"  # the object never existed: the proxy answered for it
        assert not remote.fs.exists(path)
    finally:
        proxy.stop()


def test_an_ambiguous_failure_is_settled_by_looking_whether_the_object_exists(s3_env,
                                                                              monkeypatch):
    remote = remote_of(s3_env)
    assert classify_failed_create(OSError(errno.EINVAL, "x")) == CHECK
    assert classify_failed_create(PermissionError("denied")) == OTHER
    existing, missing = remote.path("there"), remote.path("not-there")
    remote.fs.pipe_file(existing, b"1")

    def refuse(path, data, mode="overwrite"):
        raise OSError(errno.EINVAL, "no HTTP answer attached")

    monkeypatch.setattr(remote.fs, "pipe_file", refuse)
    assert remote.create(existing, b"2", "probing") is False
    with pytest.raises(RemoteUnavailableError, match="does not exist"):
        remote.create(missing, b"2", "probing")


def test_a_local_folder_remote_refuses_a_second_create_with_file_exists(tmp_path):
    remote = RemoteStore((tmp_path / "shared").as_uri())
    (tmp_path / "shared").mkdir()
    path = remote.path("x")
    assert remote.create(path, b"1", "probing") is True
    assert remote.create(path, b"2", "probing") is False


def test_urls_are_shown_without_credentials():
    assert redact("s3://key:secret@bucket/prefix") == "s3://bucket/prefix"
    assert redact("s3://bucket/prefix") == "s3://bucket/prefix"
    error = RemoteUnavailableError(redact("ftp://u:pw@host/x"), "reading", "boom")
    assert "pw" not in str(error)


# Upload ------------------------------------------------------------------------------------


def test_two_uploads_of_one_key_leave_one_manifest_and_only_its_data(s3_env, tmp_path):
    entry_a = local_entry(tmp_path / "a")
    entry_b = local_entry(tmp_path / "b")
    remote = remote_of(s3_env)
    assert remote.upload(published(tmp_path / "a", entry_a.key)) is True
    assert remote.upload(published(tmp_path / "b", entry_b.key)) is False
    keys, unknown, _ = remote.scan()
    assert unknown == [] and [k.key for k in keys] == [entry_a.key]
    assert keys[0].manifest is not None and len(keys[0].uploads) == 1


@pytest.mark.parametrize("part_bytes", [None, 1024])  # one write; in parts
def test_an_upload_checks_every_checksum_and_sends_no_damaged_entry(tmp_path, part_bytes,
                                                                   monkeypatch):
    entry = local_entry(tmp_path / "a")
    with open(entry.path / "data.npy", "r+b") as f:  # a flipped byte: the size is unchanged
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0xFF]))
    remote = RemoteStore((tmp_path / "shared").as_uri())
    if part_bytes is not None:
        monkeypatch.setattr(bucket, "RANGE_BYTES", part_bytes)
    put, sent = remote_upload._put, []
    monkeypatch.setattr(remote_upload, "_put",
                        lambda *args: sent.append(args[2].name) or put(*args))
    with pytest.raises(CacheCorruptError, match=r"data\.npy: checksum mismatch: the "
                       r"manifest says .*nothing was uploaded"):
        remote.upload(published(tmp_path / "a", entry.key))
    assert sent.count("data.npy") == 1  # read and hashed once: damage is not tried again
    assert remote.lookup(entry.key) is None  # no manifest was published
    keys, _, _ = remote.scan()
    assert all(not k.uploads for k in keys)  # and no data objects are left


def test_of_two_uploaders_racing_past_the_lookup_exactly_one_manifest_wins(s3_env, tmp_path,
                                                                           monkeypatch):
    entry = local_entry(tmp_path / "a")
    remote = remote_of(s3_env)
    with monkeypatch.context() as patch:  # both think the key is free
        patch.setattr(remote_upload, "lookup", lambda store, key: None)
        first = remote.upload(published(tmp_path / "a", entry.key))
    assert first is True
    second_store = remote_of(s3_env)
    real_lookup = remote_upload.lookup
    calls = []

    def miss_once(store, key):
        calls.append(key)
        return None if len(calls) == 1 else real_lookup(store, key)

    monkeypatch.setattr(remote_upload, "lookup", miss_once)
    assert second_store.upload(published(tmp_path / "a", entry.key)) is False
    keys, _, _ = remote.scan()
    assert len(keys[0].uploads) == 1  # the loser removed its data objects
    assert remote.lookup(entry.key).upload in keys[0].uploads


def test_a_large_file_goes_up_in_parts_and_comes_back_whole(s3_env, tmp_path, monkeypatch):
    monkeypatch.setattr(bucket, "RANGE_BYTES", 5 << 20)  # S3's smallest part
    values = np.arange(3 * (5 << 20) // 4096 + 7)

    def big(v):
        return np.full(4096, v % 256, dtype=np.uint8)

    entry = cachekit.Cache(tmp_path / "a", remote="", workers=2, progress=False).map(big, values)
    remote = remote_of(s3_env)
    assert remote.upload(published(tmp_path / "a", entry.key)) is True
    found = remote.lookup(entry.key)
    got, won = remote.download(found, LocalStore(tmp_path / "b"))
    assert won and got.manifest == entry._manifest
    assert (tmp_path / "b" / "entries" / entry.key / "data.npy").read_bytes() == \
        (entry.path / "data.npy").read_bytes()


# Untrusted remote data --------------------------------------------------------------------


@pytest.fixture
def uploaded(s3_env, tmp_path):
    entry = local_entry(tmp_path / "a")
    remote = remote_of(s3_env)
    assert remote.upload(published(tmp_path / "a", entry.key))
    data = remote_object(remote, entry.key, "data.npy")
    return remote, entry, data, remote.manifest_path(entry.key)


def obtain_from_remote(root: Path, env: dict[str, str]) -> cachekit.Entry:
    """The entry of VALUES in ``root``, its upload over if it built it."""
    entry = cachekit.Cache(root, remote=env["CACHEKIT_REMOTE"], workers=2,
                           progress=False).map(row, VALUES)
    background.wait_all()
    return entry


def built_in_place_of_broken(root: Path, env: dict[str, str], *names: str) -> cachekit.Entry:
    """A call that meets a broken remote entry: it warns once (naming each of ``names``),
    builds, and leaves one valid remote entry, its own, in place of the broken one."""
    remote = remote_of(env)
    with pytest.warns(RemoteWarning, match="it counts as missing") as seen:
        entry = obtain_from_remote(root, env)
    assert len(seen) == 1 and all(name in str(seen[0].message) for name in names)
    assert entry.source == "built" and np.array_equal(entry.array, np.stack(
        [row(v) for v in VALUES]))
    assert list((root / "tmp").glob("*")) == []  # nothing of the broken download is left
    assert verify_remote(remote) == (1, [])
    return entry


def test_a_flipped_byte_in_a_data_object_is_a_miss_that_is_repaired(uploaded, s3_env,
                                                                    tmp_path):
    remote, entry, data, _ = uploaded
    upload = remote.lookup(entry.key).upload
    body = bytearray(remote.fs.cat_file(data))
    body[-5] ^= 0x01
    remote.fs.pipe_file(data, bytes(body))
    built_in_place_of_broken(tmp_path / "b", s3_env, "checksum mismatch",
                             remote.object_url(data))
    assert remote.lookup(entry.key).upload != upload  # a fresh upload
    # The damaged pool object was removed by the reader, and sent again by the repair.
    assert remote.fs.cat_file(data) != bytes(body)
    pulled = obtain_from_remote(tmp_path / "c", s3_env)  # the next host downloads it
    assert pulled.source == "remote"


def test_a_truncated_object_is_a_miss_found_before_it_is_read(uploaded, s3_env, tmp_path):
    remote, entry, data, _ = uploaded
    remote.fs.pipe_file(data, remote.fs.cat_file(data)[:-100])
    built_in_place_of_broken(tmp_path / "b", s3_env, "bytes, the manifest says",
                             remote.object_url(data))


def test_a_missing_data_object_is_a_miss_that_is_repaired(uploaded, s3_env, tmp_path):
    remote, entry, data, _ = uploaded
    remote.fs.rm_file(data)
    built_in_place_of_broken(tmp_path / "b", s3_env, "missing", remote.object_url(data))


def edit_manifest(remote: RemoteStore, path: str, change) -> None:
    raw = json.loads(remote.fs.cat_file(path))
    change(raw)
    remote.fs.pipe_file(path, json.dumps(raw).encode())


def test_a_tampered_manifest_checksum_is_found_after_the_download(uploaded, s3_env, tmp_path):
    remote, entry, data, manifest = uploaded
    edit_manifest(remote, manifest, lambda m: m["files"][0].update(
        checksum="blake2b-128:" + "0" * 32))
    # A data file lies in the pool under its checksum: the manifest names one not there.
    built_in_place_of_broken(tmp_path / "b", s3_env, "is missing")


def test_a_tampered_manifest_shape_is_found_before_any_download(uploaded, s3_env, tmp_path):
    remote, entry, data, manifest = uploaded

    def grow(m):
        m["rows"] = m["shape"][0] = m["files"][0]["shape"][0] = 10 ** 12

    edit_manifest(remote, manifest, grow)
    built_in_place_of_broken(tmp_path / "b", s3_env, remote.object_url(manifest))


@pytest.mark.parametrize("field", ["file name", "upload"])
def test_a_manifest_naming_a_path_is_a_miss(uploaded, s3_env, tmp_path, field):
    remote, entry, data, manifest = uploaded
    if field == "file name":
        edit_manifest(remote, manifest, lambda m: m["files"][0].update(name="../x"))
    else:
        edit_manifest(remote, manifest, lambda m: m.update(upload="../x"))
    built_in_place_of_broken(tmp_path / "b", s3_env, "../x", remote.object_url(manifest))
    assert not (tmp_path / "b" / "x").exists() and not (tmp_path / "x").exists()


def test_an_oversized_manifest_is_a_miss(uploaded, s3_env, tmp_path, monkeypatch):
    from cachekit.store import manifest as manifests

    remote, entry, data, manifest = uploaded
    original = remote.fs.cat_file(manifest)
    monkeypatch.setattr(manifests, "MANIFEST_LIMIT", 100)
    with pytest.warns(RemoteWarning, match="larger than 100 bytes"):
        assert obtain_from_remote(tmp_path / "b", s3_env).source == "built"
    monkeypatch.undo()
    assert verify_remote(remote) == (1, [])
    assert remote.fs.cat_file(manifest) != original  # the repair's own manifest


def test_with_signing_on_an_unsigned_remote_entry_is_replaced_by_a_signed_one(
        uploaded, s3_env, tmp_path, monkeypatch):
    remote, entry, data, manifest = uploaded
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "team secret")
    built_in_place_of_broken(tmp_path / "b", s3_env, "not signed",
                             remote.object_url(manifest))
    assert json.loads(remote.fs.cat_file(manifest))["signature"].startswith("hmac-sha256:")


def test_with_signing_on_a_signed_remote_entry_is_downloaded_and_stays_signed(s3_env, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "team secret")
    built = obtain_from_remote(tmp_path / "a", s3_env)
    assert built.source == "built"
    remote = remote_of(s3_env)
    raw = json.loads(remote.fs.cat_file(remote.manifest_path(built.key)))
    assert raw["signature"].startswith("hmac-sha256:")
    pulled = obtain_from_remote(tmp_path / "b", s3_env)
    assert pulled.source == "remote" and np.array_equal(pulled.array, built.array)
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "another key")
    built_in_place_of_broken(tmp_path / "c", s3_env, "does not match")


def test_without_fsspec_a_remote_says_which_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now fails
    store = RemoteStore("s3://bucket/prefix")  # nothing imported yet
    with pytest.raises(ImportError, match=r'cachekit\[remote\]'):
        store.fs


def test_a_transient_failure_is_retried_unless_the_stores_client_retries_itself(tmp_path):
    """A folder's calls are retried by cachekit; S3's are not again: botocore and s3fs
    retry them already, and retrying each of their rounds made a dead endpoint cost three
    rounds of theirs on the first miss."""
    def flaky(failures: list[int]):
        def read() -> str:
            if len(failures) < 2:
                failures.append(1)
                raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
            return "read"
        return read

    folder, reset = bucket.Bucket((tmp_path / "shared").as_uri()), []
    assert folder.call("reading x", flaky(reset)) == "read" and len(reset) == 2
    s3_bucket, reset = bucket.Bucket("s3://bucket/prefix"), []  # no connection is made
    with pytest.raises(RemoteUnavailableError, match="connection reset by peer"):
        s3_bucket.call("reading x", flaky(reset))
    assert len(reset) == 1


def test_a_shared_folder_works_as_a_remote(tmp_path):
    url = (tmp_path / "shared").as_uri()
    built = cachekit.Cache(tmp_path / "a", remote=url, workers=2, progress=False).map(
        row, VALUES)
    pulled = cachekit.Cache(tmp_path / "b", remote=url, workers=2, progress=False).map(
        row, VALUES)
    assert (built.source, pulled.source) == ("built", "remote")
    assert np.array_equal(built.array, pulled.array)
    keys, unknown, _ = RemoteStore(url).scan()
    assert unknown == [] and len(keys) == 1 and len(keys[0].uploads) == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def remote_manifest(tmp_path_factory) -> tuple[str, dict]:
    entry = local_entry(tmp_path_factory.mktemp("manifest") / "a")
    from cachekit.store import manifest as manifests

    raw = manifests.dumps(entry._manifest, {"upload": "0" * 32})
    return entry.key, json.loads(raw)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.lists(st.integers(0, 20), min_size=1, max_size=3), value=json_values)
def test_a_remote_manifest_either_parses_whole_or_is_refused_as_corrupt(remote_manifest,
                                                                        where, value):
    key, good = remote_manifest
    raw = json.loads(json.dumps(good))
    node = raw
    for step in where[:-1]:  # walk down to a container, then replace one of its items
        children = list(node) if isinstance(node, dict) else list(range(len(node))) \
            if isinstance(node, list) else []
        if not children or not isinstance(node[children[step % len(children)]],
                                          (dict, list)):
            break
        node = node[children[step % len(children)]]
    children = list(node) if isinstance(node, dict) else list(range(len(node)))
    if children:
        node[children[where[-1] % len(children)]] = value
    try:
        parsed = RemoteStore.parse_manifest(json.dumps(raw).encode(), "s3://b/m.json", key)
    except CacheCorruptError:
        return
    assert parsed.key == key and len(parsed.upload) == 32
    names = [f.name for f in parsed.manifest.files]  # never a path: names of a fixed set
    assert names[0] == "data.npy" and len(set(names)) == len(names)
    assert all(manifests.allowed_file_name(i, name) for i, name in enumerate(names))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_as_a_remote_manifest_are_refused_as_corrupt(data):
    with pytest.raises(CacheCorruptError):
        RemoteStore.parse_manifest(data, "s3://b/m.json", "0" * 32)


def test_without_conditional_writes_two_uploads_still_leave_one_valid_entry(s3_env, tmp_path,
                                                                           monkeypatch):
    entry = local_entry(tmp_path / "a")
    for _ in range(2):  # a store that ignores If-None-Match: both uploads "win"
        remote = remote_of(s3_env)
        monkeypatch.setattr(remote_upload, "lookup", lambda store, key: None)

        def overwrite(path, data, what, remote=remote, **options):
            remote.fs.pipe_file(path, data)
            return True

        remote.create = overwrite
        assert remote.upload(published(tmp_path / "a", entry.key)) is True
    remote = remote_of(s3_env)
    found = remote.lookup(entry.key)
    got, _ = remote.download(found, LocalStore(tmp_path / "b"))
    assert got.manifest == entry._manifest  # the last manifest names a complete upload
    keys, _, _ = remote.scan()
    assert len(keys[0].uploads) == 2  # the other upload is an orphan for clear --remote


def test_a_size_or_existence_asked_after_a_listing_is_the_stores_answer_now(s3_env):
    """fsspec keeps each listing and answers ``info`` and ``exists`` from it. A process that
    listed the pool (a sweep, ``verify --remote``) and later pushes must not take an object
    that another host removed since for present: its manifest would name a missing object."""
    from cachekit.store.bucket import Bucket

    here, there = Bucket(s3_env["CACHEKIT_REMOTE"]), Bucket(s3_env["CACHEKIT_REMOTE"])
    gone, sent = here.path("parts", "a" * 32), here.path("parts", "b" * 32)
    here.fs.pipe_file(gone, b"x" * 10)
    assert set(here.find(here.path("parts"))) == {gone}
    there.fs.rm(gone)
    there.fs.pipe_file(sent, b"y" * 20)
    with pytest.raises(FileNotFoundError):
        here.size(gone)
    assert not here.exists(gone)
    assert here.size(sent) == 20 and here.exists(sent)
