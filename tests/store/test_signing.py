"""Signed manifests (cachekit/signing.py): CACHEKIT_SIGNING_KEY set means every manifest
cachekit writes is signed with HMAC-SHA256 and an entry without a valid signature is refused."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import _fs, UnsignedEntryError
from cachekit.admin import integrity
from cachekit.messages import prefix
from cachekit.store import signing
from cachekit.store import manifest as manifests
from cachekit.cli.main import main
from cachekit.obtain.lookup import find_entry
from cachekit.store import LocalStore, Published, Refused

KEY = "team key \u00e9 0xC0FFEE-7f3a9b"  # not ASCII: the key is the variable's UTF-8 bytes
VALUES = pd.Series([1, 2, 3, 4])
NOT_SIGNED = "the manifest is not signed, and CACHEKIT_SIGNING_KEY is set"


def row(v):
    return np.full(3, v, dtype=np.int16)


def expected() -> np.ndarray:
    return np.stack([row(v) for v in VALUES])


def make(cache_root: Path) -> cachekit.Entry:
    return cachekit.Cache(cache_root, workers=1, progress=False).map(row, VALUES, version="1")


def raw_manifest(entry_dir: Path) -> dict:
    return json.loads((entry_dir / manifests.MANIFEST_FILE).read_text())


def rewrite_manifest(entry_dir: Path, raw: dict) -> None:
    path = entry_dir / manifests.MANIFEST_FILE
    path.chmod(0o644)
    path.write_text(json.dumps(raw, indent=1, sort_keys=True))


def entry_names(cache_root: Path) -> list[str]:
    return sorted(p.name for p in (cache_root / "entries").iterdir())


def assert_signed(entry_dir: Path) -> None:
    raw = raw_manifest(entry_dir)
    assert raw["signature"].startswith("hmac-sha256:") and len(raw["signature"]) == 12 + 64
    assert signing.problem(raw, KEY.encode()) is None


# The canonical form and the signature, pinned ---------------------------------------------

PINNED_MANIFEST = manifests.Manifest(
    key="0123456789abcdef" * 2, kind="map", rows=2,
    files=(manifests.FileRecord("data.npy", (2, 3), "|u1", 134,
                                "blake2b-128:" + "0123456789abcdef" * 2),),
    created=1700000000.5, params={"on_error": "raise", "size": [2, 3]}, column="img_path",
    builder={"host": "node7", "pid": 4242}, build_seconds=0.25, cachekit_version="2.0.0")
PINNED_CANONICAL = (
    b'{"build_seconds":0.25,"builder":{"host":"node7","pid":4242},"cachekit_version":"2.0.0",'
    b'"column":"img_path","created":1700000000.5,"dtype":"|u1","failed_rows":[],"files":'
    b'[{"bytes":134,"checksum":"blake2b-128:0123456789abcdef0123456789abcdef","dtype":"|u1",'
    b'"kind":"numpy","name":"data.npy","shape":[2,3]}],"format":5,'
    b'"key":"0123456789abcdef0123456789abcdef","kind":"map","params":{"on_error":"raise",'
    b'"size":[2,3]},"rows":2,"shape":[2,3]}')
# Cross-checked with: openssl dgst -sha256 -mac HMAC -macopt hexkey:<hex of the key's UTF-8>
PINNED_SIGNATURE = "hmac-sha256:fb50ab25c7ecfa2fdaec0ec03a3b99e8b56bcad9b796f3ff1e5945f88e5bae7b"


def test_the_canonical_form_and_the_signature_are_pinned(monkeypatch):
    obj = PINNED_MANIFEST.to_json()
    assert signing.canonical(obj) == PINNED_CANONICAL
    assert signing.sign(PINNED_CANONICAL, "team key \u00e9".encode()) == PINNED_SIGNATURE
    # The signature field itself and the order of fields are not part of what is signed.
    shuffled = dict(reversed(list({**obj, "signature": "anything"}.items())))
    assert signing.canonical(shuffled) == PINNED_CANONICAL

    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "team key \u00e9")
    written = manifests.dumps(PINNED_MANIFEST)
    assert json.loads(written)["signature"] == PINNED_SIGNATURE
    path = Path("/nowhere") / manifests.MANIFEST_FILE
    assert manifests.loads(written, path, PINNED_MANIFEST.key) == PINNED_MANIFEST


def test_without_a_key_nothing_is_signed_and_an_empty_key_is_no_key(monkeypatch):
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    assert "signature" not in json.loads(manifests.dumps(PINNED_MANIFEST))
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "")
    assert signing.key() is None and not signing.enabled()
    assert "signature" not in json.loads(manifests.dumps(PINNED_MANIFEST))
    with pytest.raises(ValueError):
        signing.sign(b"payload")


def test_the_key_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "one")
    first = json.loads(manifests.dumps(PINNED_MANIFEST))["signature"]
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", "two")
    second = json.loads(manifests.dumps(PINNED_MANIFEST))["signature"]
    assert first != second
    assert second == signing.sign(PINNED_CANONICAL, b"two")


def test_unsigned_entry_error_is_corrupt_picklable_and_says_how_to_fix():
    error = UnsignedEntryError("/root/entries/abc/manifest.json", NOT_SIGNED)
    assert isinstance(error, cachekit.CacheCorruptError) and isinstance(error, OSError)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is UnsignedEntryError
    assert (clone.path, clone.reason, str(clone)) == (error.path, error.reason, str(error))
    assert "/root/entries/abc/manifest.json" in str(error)
    assert "CACHEKIT_SIGNING_KEY" in str(error) and "cachekit clear" in str(error)


# Hits, refusals and replacements -----------------------------------------------------------


def test_a_signed_entry_is_a_hit_with_the_key_set(cache_root, monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    built = make(cache_root)
    assert built.source == "built"
    assert_signed(built.path)
    again = make(cache_root)
    assert again.source == "local" and again.hit
    np.testing.assert_array_equal(np.asarray(again.array), expected())
    assert again.manifest == built.manifest  # entry.manifest does not carry the signature
    assert "signature" not in again.manifest


def test_an_unsigned_entry_is_refused_and_replaced_by_a_signed_one(cache_root, monkeypatch,
                                                                    capfd):
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    unsigned = make(cache_root)
    assert "signature" not in raw_manifest(unsigned.path)
    capfd.readouterr()

    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    with pytest.raises(UnsignedEntryError) as refused:
        manifests.read(unsigned.path)
    assert str(unsigned.path / manifests.MANIFEST_FILE) in str(refused.value)
    replaced = make(cache_root)
    assert replaced.source == "built"
    np.testing.assert_array_equal(np.asarray(replaced.array), expected())
    assert_signed(replaced.path)
    assert entry_names(cache_root) == [unsigned.key]
    assert [p.name for p in (cache_root / "tmp").iterdir()] == []  # the refused one is gone
    err = capfd.readouterr().err
    notes = [line for line in err.splitlines() if "refused" in line]
    assert len(notes) == 1 and notes[0].startswith(f"{prefix()}: refused entry {unsigned.key[:12]}")
    assert make(cache_root).source == "local"


@pytest.mark.parametrize("tamper", ["column", "checksum", "rows", "other key"])
def test_a_tampered_signed_manifest_is_refused(cache_root, monkeypatch, tamper):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    entry = make(cache_root)
    raw = raw_manifest(entry.path)
    if tamper == "column":
        raw["column"] = "someone else's column"
    elif tamper == "checksum":
        raw["files"][0]["checksum"] = "blake2b-128:" + "0" * 32
    elif tamper == "rows":  # a consistent manifest of 3 rows, with the old signature
        raw["rows"] = 3
        raw["shape"][0] = raw["files"][0]["shape"][0] = 3
    else:  # the same contents, signed with another key
        raw["signature"] = signing.sign(signing.canonical(raw), b"not the team key")
    rewrite_manifest(entry.path, raw)

    with pytest.raises(UnsignedEntryError, match="does not match"):
        manifests.read(entry.path)
    again = make(cache_root)
    assert again.source == "built"
    np.testing.assert_array_equal(np.asarray(again.array), expected())
    assert_signed(again.path)
    assert raw_manifest(again.path)["column"] is None
    assert entry_names(cache_root) == [entry.key]


def test_a_signature_that_is_not_a_string_or_a_manifest_that_is_not_an_object(cache_root,
                                                                               monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    entry = make(cache_root)
    raw = raw_manifest(entry.path)
    for bad in (None, 7, ["hmac-sha256:00"], "hmac-sha256:\udcff"):
        assert signing.problem({**raw, "signature": bad}) is not None
    assert signing.problem([raw]) is not None
    rewrite_manifest(entry.path, {**raw, "signature": 7})
    with pytest.raises(UnsignedEntryError):
        manifests.read(entry.path)


def test_with_the_key_unset_signed_entries_still_hit(cache_root, monkeypatch):
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    built = make(cache_root)
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY")
    again = make(cache_root)
    assert again.source == "local"
    np.testing.assert_array_equal(np.asarray(again.array), expected())
    assert manifests.read(built.path) == manifests.read(again.path)


def test_a_signed_entry_put_in_place_meanwhile_is_kept(cache_root, monkeypatch):
    """The refusal claims the entry first and reads it again: if another process replaced the
    refused entry with a signed one in between, that one is put back, not deleted."""
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    entry = make(cache_root)
    store = LocalStore(cache_root)
    store.remove_refused(Refused(entry.key, UnsignedEntryError(
        entry.path, "read before it was replaced")))
    assert entry_names(cache_root) == [entry.key]
    assert_signed(entry.path)
    assert make(cache_root).source == "local"


def test_a_lookup_writes_nothing_and_returns_what_it_refused(cache_root, monkeypatch):
    """The store's lookup only reads: an unsigned entry comes back as Refused and stays in
    place, and a good entry's last use is not moved (the caller records both)."""
    entry = make(cache_root)  # unsigned
    store = LocalStore(cache_root)
    os.utime(entry.path, (1_000_000, 1_000_000))
    assert isinstance(store.lookup(entry.key), Published)
    assert entry.path.stat().st_mtime == 1_000_000
    assert find_entry(store, entry.key).path == entry.path  # the caller records the use
    assert entry.path.stat().st_mtime > time.time() - 60
    os.utime(entry.path, (1_000_000, 1_000_000))
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    refused = store.lookup(entry.key)
    assert isinstance(refused, Refused) and refused.key == entry.key
    assert entry_names(cache_root) == [entry.key] and entry.path.stat().st_mtime == 1_000_000
    store.remove_refused(refused)
    assert entry_names(cache_root) == []


def test_a_refused_entry_that_cannot_be_removed_raises(cache_root, monkeypatch):
    """Where this process cannot move the refused entry away (say, a read-only root), the hit
    raises UnsignedEntryError, whose message says what to do, and leaves the entry alone."""
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    unsigned = make(cache_root)
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)

    def cannot(handle, name, to, new_name):
        raise PermissionError(13, "Permission denied", str(handle.path / name))

    monkeypatch.setattr(_fs.DirHandle, "rename", cannot)
    with pytest.raises(UnsignedEntryError, match="CACHEKIT_SIGNING_KEY for every process"):
        make(cache_root)
    assert entry_names(cache_root) == [unsigned.key]
    assert "signature" not in raw_manifest(unsigned.path)


def test_a_build_that_loses_the_race_to_an_unsigned_entry_publishes_its_own(cache_root,
                                                                             monkeypatch):
    """An unsigned entry published between a builder's lookups and its rename is refused at
    commit, and the signed build takes its place."""
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    unsigned = make(cache_root)
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    real_lookup, calls = LocalStore.lookup, []

    def blind_lookup(self, key):  # the lookups before the build do not see the entry
        calls.append(key)
        return None if len(calls) <= 2 else real_lookup(self, key)

    monkeypatch.setattr(LocalStore, "lookup", blind_lookup)
    built = make(cache_root)
    assert built.source == "built" and len(calls) == 3
    assert_signed(built.path)
    np.testing.assert_array_equal(np.asarray(built.array), expected())
    assert entry_names(cache_root) == [unsigned.key]


# ls, info, verify ---------------------------------------------------------------------------


def test_verify_and_ls_report_unsigned_entries_when_the_key_is_set(cache_root, monkeypatch,
                                                                    capsys):
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    unsigned = make(cache_root)
    assert main(["--root", str(cache_root), "verify"]) == 0
    capsys.readouterr()

    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", KEY)
    problems = integrity.verify(LocalStore(cache_root))
    assert [(p.key, p.message) for p in problems] == [(unsigned.key, NOT_SIGNED)]
    assert main(["--root", str(cache_root), "verify"]) == 1
    out = capsys.readouterr().out
    assert f"{unsigned.key}: {NOT_SIGNED}" in out
    assert main(["--root", str(cache_root), "ls"]) == 0
    out = capsys.readouterr().out
    assert f"PROBLEM: {NOT_SIGNED}" in out
    # Looking never removes anything: only a hit replaces a refused entry.
    assert entry_names(cache_root) == [unsigned.key]
    assert "signature" not in raw_manifest(unsigned.path)

    make(cache_root)  # replaced by a signed entry
    assert integrity.verify(LocalStore(cache_root)) == []
    assert main(["--root", str(cache_root), "verify"]) == 0


def test_the_key_never_appears_in_any_output_or_file(cache_root, monkeypatch, capfd):
    secret = "s3cr3t-signing-key-do-not-leak-8d1e"
    monkeypatch.delenv("CACHEKIT_SIGNING_KEY", raising=False)
    unsigned = make(cache_root)
    monkeypatch.setenv("CACHEKIT_SIGNING_KEY", secret)
    messages = []
    try:
        manifests.read(unsigned.path)
    except UnsignedEntryError as e:
        messages.append(str(e) + repr(e))
    root = str(cache_root)
    for argv in (["verify"], ["ls"], ["ls", "--json"], ["info", unsigned.key[:8]]):
        main(["--root", root, *argv])
    replaced = make(cache_root)
    raw = raw_manifest(replaced.path)
    raw["column"] = "tampered"
    rewrite_manifest(replaced.path, raw)
    for argv in (["verify"], ["ls"], ["info", unsigned.key[:8]]):
        main(["--root", root, *argv])
    make(cache_root)
    for argv in (["verify"], ["ls", "--json"], ["info", unsigned.key[:8]]):
        main(["--root", root, *argv])
    captured = capfd.readouterr()
    assert "refused" in captured.err and "PROBLEM" in captured.out  # the paths were taken

    forms = {secret, secret.encode().hex(), secret[::-1]}
    for text in (captured.out, captured.err, *messages):
        assert not any(form in text for form in forms)
    files = [p for p in Path(cache_root).rglob("*") if p.is_file()]
    assert any(p.name == manifests.MANIFEST_FILE for p in files)
    for path in files:
        data = path.read_bytes()
        assert not any(form.encode() in data for form in forms), path
    assert secret not in json.dumps(make(cache_root).manifest)
