"""A healed entry and the remote tier: the host that heals an entry whose files changed
replaces the bucket's copy of that stale entry, so hosts that come later download the healed
entry; a host whose copy is stale too, once the bucket holds another host's healed entry,
downloads that one instead of replacing it, linking the rows its stale copy holds
(cachekit/obtain/remote.py, cachekit/store/local_copies.py).

The bucket is a real S3 server on loopback (``s3_env``); the host that heals second runs in
an interpreter of its own, for a process says once what it found stale in an entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.cli.main import main as cli_main
from cachekit.errors import StaleEntryWarning
from cachekit.obtain import background, staleness
from cachekit.store.remote import RemoteStore
from helpers import write_pictures

ROWS = 8
CHANGED = 3

HOST = textwrap.dedent("""
    import json, sys, time, warnings
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit
    from cachekit.obtain import background, staleness

    root, paths, ready, hosts = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    cache = cachekit.Cache(root, workers=1)  # saying what it does
    column = pd.Series(json.loads(paths))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.images(column, 8)              # its copy is stale: said, and recorded
        staleness.wait_for_checks(timeout=60)
    (ready / root.replace("/", "_")).touch()
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < hosts:  # the hosts heal at once
        assert time.monotonic() < deadline, "the other hosts never got ready"
        time.sleep(0.005)
    again = cache.images(column, 8)          # heals
    background.wait_all()
    print(json.dumps({"stale": [str(w.message) for w in caught
                                if issubclass(w.category, cachekit.StaleEntryWarning)],
                      "source": again.source,
                      "decoded": again.rows_decoded, "row": again.array[3].tolist()}))
""")


def _hosts(roots: list[Path], column: pd.Series, tmp_path: Path) -> list[dict]:
    """Each root's host, in an interpreter of its own, finds its copy stale and heals it,
    all at once: what each reports."""
    ready = tmp_path / f"ready-{len(list(tmp_path.glob('ready-*')))}"
    ready.mkdir()
    runs = [subprocess.Popen([sys.executable, "-c", HOST, str(root), json.dumps(list(column)),
                              str(ready), str(len(roots))], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ)
            for root in roots]
    reports = []
    try:
        for run in runs:
            out, err = run.communicate(timeout=180)
            assert run.returncode == 0, err
            reports.append(json.loads(out))
            assert len(reports[-1]["stale"]) == 1, err
            reports[-1]["said"] = err
    finally:
        for run in runs:  # none outlives a failed test
            if run.poll() is None:
                run.kill()
                run.wait()
    return reports


@pytest.fixture(autouse=True)
def sample_every_row(monkeypatch):
    """A hit here samples every row of these 8-row entries: 16 draws miss a given row one
    time in 8, and a process checks an entry in the background once a minute only (a
    host's copy downloaded into this process counts as the same entry)."""
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 1000)


def _rewrite(path: str) -> None:
    """New pixels in the file, and another mtime, as a data set fixed in place."""
    from PIL import Image

    pixels = np.random.default_rng(99).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    os.utime(path, ns=(2, 2))


def _heal(cache: cachekit.Cache, column: pd.Series) -> cachekit.Entry:
    """A hit that finds the changed file, then the call that heals the entry."""
    with pytest.warns(StaleEntryWarning):
        cache.images(column, 8)
        staleness.wait_for_checks(timeout=60)
    healed = cache.images(column, 8)
    background.wait_all()
    return healed


def test_a_healed_entry_replaces_the_stale_copy_in_the_bucket(s3_env, tmp_path, capsys):
    column = pd.Series(write_pictures(tmp_path / "pictures", ROWS))
    host_a = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    built = host_a.images(column, 8)
    stale_row = np.array(built.array[CHANGED])
    background.wait_all()
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    stale_upload = remote.lookup(built.key).upload
    _rewrite(column[CHANGED])

    capsys.readouterr()
    healed = _heal(cachekit.Cache(tmp_path / "a", workers=1), column)  # saying what it does
    assert (healed.source, healed.rows_decoded, healed.rows_reused) == ("built", 1, ROWS - 1)
    assert "was the entry whose files changed here: removed, the entry built now replaces " \
        "it" in capsys.readouterr().err
    in_bucket = remote.lookup(built.key)
    assert in_bucket.upload != stale_upload
    assert in_bucket.manifest.created == healed._manifest.created

    later = cachekit.Cache(tmp_path / "c", workers=1, progress=False).images(column, 8)
    assert later.source == "remote" and later.rows_decoded == 0
    np.testing.assert_array_equal(later.array, healed.array)
    assert not np.array_equal(later.array[CHANGED], stale_row)


def test_a_host_whose_copy_is_stale_downloads_the_entry_another_host_healed(
        s3_env, tmp_path):
    column = pd.Series(write_pictures(tmp_path / "pictures", ROWS))
    host_a = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    host_a.images(column, 8)
    background.wait_all()
    pulled = cachekit.Cache(tmp_path / "b", workers=1, progress=False).images(column, 8)
    assert pulled.source == "remote"
    staleness.wait_for_checks(timeout=60)  # its files, checked before any changes
    _rewrite(column[CHANGED])
    healed = _heal(host_a, column)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    healed_upload = remote.lookup(healed.key).upload
    entry_b = tmp_path / "b" / "entries" / healed.key
    stale_rows = (entry_b / "data.npy").stat().st_ino

    [second] = _hosts([tmp_path / "b"], column, tmp_path)
    assert column[CHANGED] in second["stale"][0]
    assert (second["source"], second["decoded"]) == ("remote", 0)
    assert "holds it built again by another host; downloaded that instead of building it " \
        "here (" in second["said"]
    assert second["row"] == healed.array[CHANGED].tolist()
    assert remote.lookup(healed.key).upload == healed_upload  # not replaced again
    # The rows it shares with its stale copy were linked from it, not downloaded again:
    data_parts = [p for p in entry_b.glob("part_*.npy") if p.name.count(".") == 1]
    assert [p.stat().st_ino for p in data_parts] == [stale_rows]
    assert not list((tmp_path / "b" / "tmp").glob("deleting.*"))  # the stale copy went


def test_hosts_that_heal_at_once_replace_the_stale_copy_once(s3_env, tmp_path):
    """The lease lets one host replace the stale copy; the other waits for it and downloads
    the healed entry."""
    column = pd.Series(write_pictures(tmp_path / "pictures", ROWS))
    roots = [tmp_path / "a", tmp_path / "b"]
    built = cachekit.Cache(roots[0], workers=1, progress=False).images(column, 8)
    background.wait_all()
    assert cachekit.Cache(roots[1], workers=1, progress=False).images(column, 8).source \
        == "remote"
    staleness.wait_for_checks(timeout=60)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    stale = remote.lookup(built.key)
    _rewrite(column[CHANGED])

    reports = _hosts(roots, column, tmp_path)
    assert sorted((r["source"], r["decoded"]) for r in reports) == [("built", 1),
                                                                    ("remote", 0)]
    assert reports[0]["row"] == reports[1]["row"]
    assert [("downloaded that instead" in r["said"], "the entry built now replaces it" in
             r["said"]) for r in sorted(reports, key=lambda r: r["source"])] == [
        (False, True), (True, False)]  # the builder replaced, the other downloaded
    healed = remote.lookup(built.key)
    assert healed.upload != stale.upload and healed.manifest.created != stale.manifest.created
    later = cachekit.Cache(tmp_path / "c", workers=1, progress=False).images(column, 8)
    assert later.source == "remote" and later.array[CHANGED].tolist() == reports[0]["row"]


def test_the_stale_copys_leftovers_are_swept_and_the_healed_entry_stays(
        s3_env, tmp_path, capsys, monkeypatch):
    """The stale copy's own objects (its upload) stay for the routine sweep, which readers
    still downloading it need; the sweep takes them and leaves the healed entry whole."""
    column = pd.Series(write_pictures(tmp_path / "pictures", ROWS))
    host_a = cachekit.Cache(tmp_path / "a", workers=1, progress=False)
    key = host_a.images(column, 8).key
    background.wait_all()
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    stale = remote.lookup(key)
    _rewrite(column[CHANGED])
    healed = _heal(host_a, column)
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.5")
    capsys.readouterr()
    assert cli_main(["ls", "--remote"]) == 0
    said = capsys.readouterr().err
    assert f"orphaned upload {stale.upload} of {key[:12]}" in said
    assert "`cachekit clear --remote --older-than AGE` removes it" in said

    time.sleep(4)  # untouched for twice the lease, by the store's clock (whole seconds)
    assert cli_main(["clear", "--remote", "--older-than", "7d", "--yes"]) == 0
    [item] = remote.scan().keys
    assert list(item.uploads) == [remote.lookup(key).upload] != [stale.upload]
    assert cli_main(["verify", "--remote"]) == 0
    later = cachekit.Cache(tmp_path / "c", workers=1, progress=False).images(column, 8)
    assert later.source == "remote"
    np.testing.assert_array_equal(later.array, healed.array)


def test_a_heal_never_serves_another_hosts_entry_that_is_stale_too(s3_env, tmp_path):
    """The bucket's copy may be another host's build of the key from before the change (not
    the copy this host found stale): downloaded, it is stat'ed in full, found stale too, and
    built again here in place of the bucket's copy: the call returns fresh rows."""
    column = pd.Series(write_pictures(tmp_path / "pictures", ROWS))
    in_bucket = cachekit.Cache(tmp_path / "a", workers=1, progress=False).images(column, 8)
    background.wait_all()
    host_b = cachekit.Cache(tmp_path / "b", workers=1, progress=False, remote="")
    own = host_b.images(column, 8)  # built here, without the remote: another entry
    assert own.source == "built" and own._manifest.created != in_bucket._manifest.created
    _rewrite(column[CHANGED])
    with pytest.warns(StaleEntryWarning):
        host_b.images(column, 8)
        staleness.wait_for_checks(timeout=60)

    healed = cachekit.Cache(tmp_path / "b", workers=1, progress=False).images(column, 8)
    background.wait_all()
    assert (healed.source, healed.rows_decoded) == ("built", 1)
    np.testing.assert_array_equal(healed.array, cachekit.Cache(
        tmp_path / "fresh", workers=1, progress=False, remote="").images(column, 8).array)
    remote = RemoteStore(s3_env["CACHEKIT_REMOTE"])
    assert remote.lookup(healed.key).manifest.created == healed._manifest.created
