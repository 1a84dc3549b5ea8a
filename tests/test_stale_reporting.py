"""A stale file is never passed over in silence (issue 43): a script that exits right after
a hit still hears what the background check found, once, as a warning attributed to its
own line (or a stderr line where such warnings are ignored), and ``cachekit build`` says it
before "already cached". Fresh interpreters, real files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from cachekit.samples import write_sample_images

ROWS = 300
CHANGED = 217

SCRIPT = textwrap.dedent('''
    import sys
    import cachekit
    paths = open(sys.argv[2]).read().split()
    entry = cachekit.Cache(sys.argv[1], progress=False).images(paths, 8, backend="pil")
    print(entry.outcome)
''')


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """An entry of ROWS covers; then one file among them rewritten in place."""
    work = tmp_path_factory.mktemp("stale")
    paths = write_sample_images(work / "covers", ROWS, seed=3)
    listing = work / "paths.txt"
    listing.write_text("\n".join(paths))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(work / "cache"), str(listing)],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["built"]
    os.utime(paths[CHANGED], ns=(1, 1))  # as a copy that kept another date would
    return work, listing, paths


def _run(work: Path, listing: Path, *flags: str) -> subprocess.CompletedProcess:
    script = work / "hit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, *flags, str(script), str(work / "cache"),
                           str(listing)], capture_output=True, text=True, check=True)


def test_a_script_that_exits_right_after_a_hit_hears_of_the_changed_file_once(built):
    work, listing, paths = built
    done = _run(work, listing)
    assert done.stdout.split() == ["hit"]
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
