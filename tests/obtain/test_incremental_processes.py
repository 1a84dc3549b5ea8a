"""Incremental builds with real processes: joiners fill only the rows nobody copies, a build
that dies while it computes its rest is resumed without computing again what it finished,
and every executor copies and computes the same rows.

Each process logs the values its row function computes (one short ``O_APPEND`` write per
row), so the test counts every decode of every process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.store import manifest as manifests
from helpers import write_pictures

AGENT = textwrap.dedent('''
    import json, logging, os, sys, time, traceback
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit

    root, log, start, ready, first, last, crash_at = sys.argv[1:8]
    first, last, crash_at = int(first), int(last), int(crash_at)

    def slow(v):
        if v == crash_at:
            os._exit(3)  # as a killed agent would, mid-build
        calls = "<".join(f.name for f in reversed(traceback.extract_stack()[-12:-1]))
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{os.getpid()} {v} {time.monotonic():.3f} {calls}\\n".encode())
        os.close(fd)
        time.sleep(0.02)
        return np.full(512, v, dtype=np.int64)  # 4 KiB rows: a chunk is a few rows

    class Notes(logging.Handler):  # what the quiet call would have said, for a failure's message
        def emit(self, record):
            sys.stderr.write(f"said: {record.getMessage()}\\n")

    logging.getLogger("cachekit").addHandler(Notes())
    cache = cachekit.Cache(root, workers=1, executor="threads", progress=False)
    Path(ready).touch()
    while not os.path.exists(start):
        time.sleep(0.001)
    values = np.repeat(np.arange(first, last), int(os.environ.get("REPEAT", "1")))
    entry = cache.map(slow, pd.Series(values))
    assert (np.asarray(entry.array)[:, 0] == values).all()
    print(json.dumps({"pid": os.getpid(), "source": entry.source, "key": entry.key,
                      "counts": [entry.rows_decoded, entry.rows_joined, entry.rows_reused]}))
''')


def run_agents(work: Path, root: Path, rows: tuple[int, int], agents: int, *,
               crash_at: int = -1, repeat: int = 1) -> list[dict]:
    """Start ``agents`` agents on ``range(*rows)`` (each value on ``repeat`` rows in a row)
    behind a start barrier; their reports (None for an agent that died)."""
    script = work / "agent.py"
    script.write_text(AGENT)
    log, start = work / "computed.log", work / f"start-{time.monotonic_ns()}"
    ready = [work / f"ready-{i}-{time.monotonic_ns()}" for i in range(agents)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "REPEAT": str(repeat)}
    procs = [subprocess.Popen([sys.executable, str(script), str(root), str(log), str(start),
                               str(r), str(rows[0]), str(rows[1]), str(crash_at)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.005)
    start.touch()
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        if crash_at >= 0 and proc.returncode == 3:
            reports.append(None)
            continue
        assert proc.returncode == 0, err
        said = [line[6:] for line in err.splitlines() if line.startswith("said: ")]
        reports.append({**json.loads(out), "said": said[:6] + said[6:][-6:]})
    return reports


def computed(work: Path) -> list[tuple[int, int]]:
    """(pid, value) of every row computed so far, then forget them."""
    return [(pid, v) for pid, v, *_ in computed_where(work)]


def computed_where(work: Path) -> list[tuple[int, int, float, str]]:
    """(pid, value, when (time.monotonic), the calls that computed it, innermost first) of
    every row computed so far, then forget them."""
    log = work / "computed.log"
    if not log.exists():
        return []
    lines = log.read_text().splitlines()
    log.unlink()
    return [(int(pid), int(v), float(at), calls)
            for pid, v, at, calls in (line.split() for line in lines)]


def test_joiners_compute_only_rows_that_nobody_copies(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    [first] = run_agents(tmp_path, root, (0, 40), 1)
    assert first["counts"] == [40, 0, 0]
    computed(tmp_path)
    reports = run_agents(tmp_path, root, (20, 140), 2)
    where = computed_where(tmp_path)
    rows = [(pid, v) for pid, v, *_ in where]
    times = Counter(v for _, v in rows)
    twice = sorted(row for row in where if times[row[1]] > 1)
    assert sorted(v for _, v in rows) == list(range(40, 140)), (  # each new row once, no other
        f"rows computed twice, (pid, value, when, calls): {twice}; the agents, with the "
        f"first and last lines each said: {reports}")
    by_source = {r["source"]: r for r in reports}
    assert set(by_source) == {"built", "joined"}, reports
    built, joined = by_source["built"], by_source["joined"]
    assert built["counts"][2] == 20 and sum(built["counts"]) == 120
    mine = sum(1 for pid, _ in rows if pid == joined["pid"])
    assert joined["counts"][0] == mine == built["counts"][1] > 0
    assert built["counts"][0] == sum(1 for pid, _ in rows if pid == built["pid"])
    # the joiner says what the builder did as joined, and the rows shared as reused
    assert joined["counts"] == [mine, built["counts"][0], 20]


def test_a_builder_and_its_joiner_compute_a_repeated_value_once_between_them(
        tmp_path: Path) -> None:
    """Each value of the column is on three rows: the build computes each once (its
    joiner too, from the rows the journal names) and stores each once, in a part of its
    own, and the repeats count as reused."""
    reports = run_agents(tmp_path, tmp_path / "cache", (0, 120), 2, repeat=3)
    [entry] = (tmp_path / "cache" / "entries").iterdir()
    [part] = [p for p in entry.iterdir() if manifests.is_part_name(p.name)]
    assert np.load(part, mmap_mode="r").shape == (120, 512)  # (no data.npy of 360 rows)
    assert not (entry / manifests.DATA_FILE).exists()
    rows = computed(tmp_path)
    assert sorted(v for _, v in rows) == list(range(120)), reports
    by_source = {r["source"]: r for r in reports}
    assert set(by_source) == {"built", "joined"}, reports
    built, joined = by_source["built"], by_source["joined"]
    assert built["counts"][2] == 240 and sum(built["counts"]) == 360
    assert joined["counts"][0] == built["counts"][1] == sum(
        1 for pid, _ in rows if pid == joined["pid"]) > 0
    assert joined["counts"] == [built["counts"][1], built["counts"][0], 240]


@pytest.mark.parametrize("repeat", [1, 3])
def test_a_build_that_dies_in_its_rest_is_resumed_without_computing_it_again(
        tmp_path: Path, repeat: int) -> None:
    """With ``repeat`` 3 each value is on three rows: the rows that repeat one are no
    part of the build's work, dead or resumed (they count as reused)."""
    root = tmp_path / "cache"
    run_agents(tmp_path, root, (0, 40), 1)
    computed(tmp_path)
    assert run_agents(tmp_path, root, (20, 140), 1, crash_at=100, repeat=repeat) == [None]
    before = sorted(v for _, v in computed(tmp_path))
    assert before == list(range(40, 100))
    [after] = run_agents(tmp_path, root, (20, 140), 1, repeat=repeat)
    again = sorted(v for _, v in computed(tmp_path))
    decoded, joined, reused = after["counts"]
    assert after["source"] == "built" and reused == 20 * repeat + 100 * (repeat - 1)
    assert decoded == len(again) and decoded + joined == 100
    assert joined > 0 and set(again) >= set(range(100, 140))  # a dead build's rows: joined
    assert not list((root / "tmp").glob(f"{after['key']}.*"))


@pytest.mark.parametrize("executor", ["threads", "processes", "pool"])
def test_every_executor_copies_and_decodes_the_same_rows(tmp_path: Path, executor: str) -> None:
    paths = write_pictures(tmp_path / "pictures", 160, (9, 11))
    pool = ProcessPoolExecutor(2) if executor == "pool" else None
    try:
        cache = cachekit.Cache(tmp_path / "cache", workers=2, progress=False,
                               executor=pool if pool is not None else executor)
        cache.images(pd.Series(paths[:120]), 8)
        grown = cache.images(pd.Series(paths[40:160]), 8)
    finally:
        if pool is not None:
            pool.shutdown()
    assert (grown.rows_decoded, grown.rows_joined, grown.rows_reused) == (40, 0, 80)
    expected = cachekit.Cache(tmp_path / "fresh", workers=1, progress=False).images(
        pd.Series(paths[40:160]), 8)
    np.testing.assert_array_equal(grown.array, expected.array)
