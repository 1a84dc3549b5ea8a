"""A stale file is never passed over in silence, and is healed (issue 43): a script that
exits right after a hit still hears what the background check found, once, as a warning
attributed to its own line (or a stderr line where such warnings are ignored), ``cachekit
build`` says it before "already cached", and the next call of the column, in another
process, serves the new pixels having decoded only that row. Fresh interpreters, real
files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from cachekit.engine.decoding.images import load_image
from cachekit.samples import write_sample_images

ROWS = 60
CHANGED = 37

SCRIPT = textwrap.dedent('''
    import sys
    import cachekit
    paths = open(sys.argv[2]).read().split()
    entry = cachekit.Cache(sys.argv[1]).images(paths, 8, backend="pil")
    print(entry.outcome, entry.rows_decoded, entry.rows_reused)
    print(entry.array[CHANGED].tobytes().hex())
''').replace("CHANGED", str(CHANGED))


@pytest.fixture
def built(tmp_path) -> tuple[Path, Path, list[str]]:
    """An entry of ROWS covers; then one file among them rewritten in place."""
    work = tmp_path / "stale"
    paths = write_sample_images(work / "covers", ROWS, seed=3)
    listing = work / "paths.txt"
    listing.write_text("\n".join(paths))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(work / "cache"), str(listing)],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split()[:3] == ["built", str(ROWS), "0"]
    Image.fromarray(np.full((30, 20, 3), 90, np.uint8)).save(paths[CHANGED], format="JPEG")
    os.utime(paths[CHANGED], ns=(1, 1))  # rewritten, as a copy that kept another date would
    return work, listing, paths


def _run(work: Path, listing: Path, *flags: str) -> subprocess.CompletedProcess:
    script = work / "hit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, *flags, str(script), str(work / "cache"),
                           str(listing)], capture_output=True, text=True, check=True)


def test_a_script_that_exits_right_after_a_hit_hears_of_the_changed_file_once(built):
    work, listing, paths = built
    done = _run(work, listing)
    assert done.stdout.split()[:3] == ["hit", "0", "0"]
    assert done.stderr.count("StaleEntryWarning") == 1, done.stderr
    assert f"hit.py:5: StaleEntryWarning: the file of row {CHANGED} ({paths[CHANGED]})" \
        in done.stderr  # the user's line, whether the sample or the background check saw it
    assert "cachekit[pid" not in done.stderr  # one report, not a line and a warning


def test_where_such_warnings_are_ignored_it_is_said_on_stderr(built):
    work, listing, paths = built
    done = _run(work, listing, "-W", "ignore::UserWarning")
    assert "StaleEntryWarning" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "changed since entry" in line]
    assert len(lines) == 1 and lines[0].startswith("cachekit[pid ") and paths[CHANGED] in lines[0]


def test_cachekit_build_says_it_before_already_cached(built, tmp_path):
    work, listing, paths = built
    csv = tmp_path / "column.csv"
    pd.DataFrame({"img_path": paths}).to_csv(csv, index=False)
    done = subprocess.run([sys.executable, "-m", "cachekit", "--root", str(work / "cache"),
                           "build", str(csv), "--column", "img_path", "--size", "8",
                           "--backend", "pil"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    said = done.stderr
    assert f"the file of row {CHANGED}" in said and "already cached" in said
    assert said.index(f"the file of row {CHANGED}") < said.index("already cached")


def test_the_next_call_heals_the_entry_decoding_only_the_changed_row(built):
    work, listing, paths = built
    first = _run(work, listing)  # a hit: it says so, and records what changed
    old_row = first.stdout.split()[3]
    assert "StaleEntryWarning" in first.stderr
    healed = _run(work, listing)  # another process: builds it again, one decode
    outcome, decoded, reused, row = healed.stdout.split()
    assert (outcome, decoded, reused) == ("built", "1", str(ROWS - 1)), healed.stderr
    assert row != old_row
    assert bytes.fromhex(row) == load_image(paths[CHANGED], (8, 8), backend="pil").tobytes()
    assert healed.stderr.count("files changed since it was built") == 1
    after = _run(work, listing)  # and then a hit, with nothing left to say
    assert after.stdout.split()[:3] == ["hit", "0", "0"] and after.stdout.split()[3] == row
    assert "changed" not in after.stderr


def test_a_column_of_paths_file_urls_and_bucket_objects_is_checked_without_a_request(
        tmp_path, monkeypatch):
    """The check compares a local path and a ``file://`` URL with their files, and leaves
    an object in a bucket alone: a hit makes no request (any would fail here)."""
    from cachekit import source_stats, urls
    from cachekit.obtain import staleness

    files = write_sample_images(tmp_path / "c", 3, seed=5)
    column = pd.Series([files[0], "file://" + files[1], "s3://no-such-bucket/a.jpg", files[2]])
    recorded = source_stats.file_stats([files[0], files[1], "\0", files[2]])
    recorded[2] = (7, 7)  # whatever the object's record, it is not looked at
    monkeypatch.setattr(urls, "filesystem", lambda *a, **k: pytest.fail("a request was made"))
    rows = np.arange(len(column))
    assert staleness._changed(rows, recorded, column) == []
    os.utime(files[1], ns=(1, 1))
    os.utime(files[2], ns=(2, 2))
    changed = staleness._changed(rows, recorded, column)
    assert [(row, now) for row, _, _, now in changed] == [
        (1, (int(recorded[1, 0]), 1)), (3, (int(recorded[3, 0]), 2))]
    assert len(staleness._changed(rows, recorded, column, stop_at=1)) == 1


def test_a_background_check_stats_nothing_while_a_call_of_its_process_runs(
        built, monkeypatch):
    """The check waits for the process's cachekit calls to end (they would wait for the
    interpreter behind it), then finds the changed file."""
    import time
    import warnings

    import cachekit
    from cachekit.errors import StaleEntryWarning
    from cachekit.obtain import staleness

    work, _, paths = built
    monkeypatch.setattr(staleness, "SAMPLE_ROWS", 0)  # only the background check looks
    monkeypatch.setattr(staleness, "QUIET_SECONDS", 0.0)
    monkeypatch.setattr(staleness, "YIELD_SECONDS", 120.0)
    looked: list[int] = []
    real = staleness._changed

    def counted(rows, recorded, column, stop_at=0):
        if not stop_at:
            looked.append(len(rows))
        return real(rows, recorded, column, stop_at)

    monkeypatch.setattr(staleness, "_changed", counted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with staleness.call_running():  # another call of this process, still running
            hit = cachekit.Cache(work / "cache", progress=False).images(paths, 8, backend="pil")
            assert hit.hit
            time.sleep(0.5)
            assert looked == []
        staleness.wait_for_checks(timeout=60)
    assert sum(looked) == ROWS
    assert [w.category for w in caught] == [StaleEntryWarning]
    assert paths[CHANGED] in str(caught[0].message)
