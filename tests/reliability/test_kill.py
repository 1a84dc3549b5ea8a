"""Builders killed with SIGKILL at every stage: nothing partial is published, no lock is left
blocking, and the next builder computes exactly the chunks that were not done (done chunks
need not be a prefix: two workers finish chunks in any order).

Real processes, real SIGKILL. To keep each trial cheap, a "zygote" interpreter imports
cachekit, numpy, pandas, Pillow and the default decoder's torch once and forks one child per
build; the test kills the child by pid once it reports (through a file) that it reached the
chosen kill point. The child reaches a kill point through patched module functions (a row
that blocks, or a step of publish that blocks), so the product carries no test hooks.

Trial counts: ``CACHEKIT_SOAK_TRIALS`` (default 6) sets the number of random multi-kill
trials of ``test_soak_random_kill_chains``, for a longer soak run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import arrays
from cachekit.store import locks, manifest as manifests
from cachekit.store import Layout
from cachekit.engine.decoding.images import load_image

from helpers import rows_not_done, small_chunks

N_ROWS, CHUNK, SIZE = 24, 4, (8, 8)
SOAK_TRIALS = int(os.environ.get("CACHEKIT_SOAK_TRIALS", "6"))

ZYGOTE = textwrap.dedent(r'''
    import glob, json, os, signal, sys, time, traceback
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit
    from cachekit import _fs, arrays
    from cachekit.engine.decoding import decode_tensor, images  # the default backend: torch
    from cachekit.engine.filling import plan
    from cachekit.store import manifest as manifests
    from cachekit.store import local

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the killed children
    real = {"load": images.load_image, "seal": arrays.seal, "checksum": arrays.block_checksums,
            "write_manifest": manifests.write_at, "rename": _fs.DirHandle.rename,
            "fsync": _fs.DirHandle.fsync, "begin": local.LocalStore.begin}

    def run(job):
        root, point, chunk = Path(job["root"]), job["point"], job["chunk"]
        os.environ["CACHEKIT_LOCK"] = job["lock"]
        os.environ.update(job.get("env", {}))
        plan.PAGE_BYTES, plan.MAX_CHUNK_ROWS, plan.CHUNKS_PER_WORKER = 1, chunk, 1
        paths = job["paths"]
        index = {p: i for i, p in enumerate(paths)}
        decoded = []
        passed = set()

        def barrier(name):  # wait until every process of the job has got here once
            spec = job.get("barriers", {}).get(name)
            if spec and name not in passed:
                passed.add(name)
                (Path(spec[0]) / str(os.getpid())).touch()
                while len(os.listdir(spec[0])) < spec[1]:
                    time.sleep(0.002)

        def reach(name):
            if name == point:
                Path(job["signal"] + ".tmp").write_text(name)
                os.replace(job["signal"] + ".tmp", job["signal"])
                while True:
                    time.sleep(3600)

        def done_chunks():
            return {int(f.rsplit(".", 1)[1])
                    for f in glob.glob(str(root / "tmp" / "*" / "data.npy.chunks" / "done.*"))}

        def load(path, *args, **kwargs):
            row = index[path]
            if point == f"row:{row}":  # block here once every earlier chunk is done
                while not set(range(row // chunk)) <= done_chunks():
                    time.sleep(0.002)
                reach(point)
            decoded.append(row)
            return real["load"](path, *args, **kwargs)

        def seal(directory, name, digest=None):  # each file's header check, then the fsyncs
            reach("fsync")
            return real["seal"](directory, name, digest)

        def checksum(directory, name, block_rows):  # the data file's, before the seal
            reach("checksum")
            return real["checksum"](directory, name, block_rows)

        def write_manifest(directory, manifest, **kw):
            reach("manifest")
            real["write_manifest"](directory, manifest, **kw)
            reach("manifest-written")

        def rename(directory, name, to, new_name):
            if to.path.name == "entries":  # the rename that publishes
                reach("rename")
                barrier("rename")
            if new_name == "claimed":  # a dead build claimed for resuming
                barrier("claim")
            return real["rename"](directory, name, to, new_name)

        def fsync_dir(directory):
            real["fsync"](directory)
            if directory.path == root / "entries":
                reach("published")

        def begin(store, key):
            barrier("begin")  # every builder has looked for live builds and found none
            return real["begin"](store, key)

        images.load_image = load
        arrays.seal, arrays.block_checksums, manifests.write_at = seal, checksum, write_manifest
        _fs.DirHandle.rename, _fs.DirHandle.fsync = rename, fsync_dir
        local.LocalStore.begin = begin
        if job.get("start"):
            while not os.path.exists(job["start"]):
                time.sleep(0.002)
        entry = cachekit.Cache(root, workers=2, progress=False).images(
            pd.Series(paths), tuple(job["size"]))
        # written aside, then renamed: the test reads the result as soon as it exists
        Path(job["result"] + ".tmp").write_text(json.dumps({
            "decoded": sorted(decoded), "hit": entry.hit, "key": entry.key,
            "builder": entry.manifest["builder"]["pid"],
            "sha": __import__("hashlib").sha256(np.asarray(entry.array).tobytes()).hexdigest()}))
        os.replace(job["result"] + ".tmp", job["result"])

    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run(job)
            except BaseException:
                Path(job["result"] + ".err").write_text(traceback.format_exc())
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)
''')


class Zygote:
    """One warmed-up interpreter that forks a builder per job and reports its pid."""

    def __init__(self) -> None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def fork(self, **job) -> int:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Distinct small cover images, one per row, and their reference decodes."""
    from cachekit.samples import write_sample_images

    paths = write_sample_images(tmp_path_factory.mktemp("covers"), N_ROWS, seed=3)
    reference = np.stack([load_image(p, SIZE) for p in paths])
    return paths, reference


def wait_for_kill_point(path: Path, pid: int, result: Path) -> None:
    """Until the child reports reaching its kill point; fail if it ended without doing so."""
    deadline = time.monotonic() + 120
    while not path.exists():
        err = Path(str(result) + ".err")
        assert not err.exists(), err.read_text()
        assert not result.exists(), "the child finished without reaching its kill point"
        assert time.monotonic() < deadline, "the child never reached its kill point"
        time.sleep(0.002)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it had ended already
        return
    while True:  # the zygote ignores SIGCHLD, so the kernel reaps the child: wait until gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.002)


def kill_at(zygote, root: Path, paths, point: str, lock: str, tag: str) -> None:
    signal_file, result = root.parent / f"{tag}.reached", root.parent / f"{tag}.json"
    pid = zygote.fork(root=str(root), point=point, chunk=CHUNK, lock=lock, paths=paths,
                      size=SIZE, signal=str(signal_file), result=str(result))
    try:
        wait_for_kill_point(signal_file, pid, result)
    finally:
        kill(pid)  # also when it never got there: a stuck child must not outlive the test


def assert_nothing_partial(root: Path, key: str, reference: np.ndarray) -> None:
    """entries/ holds nothing, or only the complete, correct entry."""
    entries = root / "entries"
    names = sorted(p.name for p in entries.iterdir()) if entries.exists() else []
    assert names in ([], [key])
    if names:
        assert_valid_entry(root / "entries" / key, reference)


def assert_valid_entry(entry_dir: Path, reference: np.ndarray) -> None:
    manifest = manifests.read(entry_dir)
    assert arrays.checksum(entry_dir / manifests.DATA_FILE)[1] == manifest.files[0].checksum
    np.testing.assert_array_equal(np.asarray(manifest.files[0].open(entry_dir)), reference)
    assert sorted(p.name for p in entry_dir.iterdir()) == sorted(
        [manifests.MANIFEST_FILE, *(f.name for f in manifest.files)])  # its data and row files
    for record in manifest.files[1:]:
        assert arrays.checksum(entry_dir / record.name)[1] == record.checksum


def assert_lock_free(root: Path, key: str, lock: str) -> None:
    """A fresh lock of the same kind is acquired without waiting (the dead holder blocks no one)."""
    build_lock = locks.make_lock(Layout(root).lock_path(key), lock)
    assert build_lock.acquire(timeout=0)
    build_lock.release()


def resume(root: Path, paths, lock: str, monkeypatch) -> tuple[cachekit.Entry, list[int]]:
    """Build in this process, counting the rows it decodes."""
    index = {p: i for i, p in enumerate(paths)}
    decoded: list[int] = []

    def counted(path, *args, **kwargs):
        decoded.append(index[path])
        return load_image(path, *args, **kwargs)

    monkeypatch.setenv("CACHEKIT_LOCK", lock)
    small_chunks(monkeypatch, CHUNK)
    monkeypatch.setattr("cachekit.engine.decoding.images.load_image", counted)
    entry = cachekit.Cache(root, workers=2, progress=False, lock_timeout=60).images(
        pd.Series(paths), SIZE)
    return entry, sorted(decoded)


def key_in(root: Path) -> str:
    """The key of the one entry a test builds, from its build or entry directory name."""
    names = [p.name for sub in ("tmp", "entries") if (root / sub).exists()
             for p in (root / sub).iterdir()]
    return names[0].split(".")[0]


def rows_left(root: Path) -> list[int]:
    """The rows a resume must compute: those of the chunks not done in the resumable dead
    build (one with a chunk journal), or every row when there is none."""
    journals = list(root.glob("tmp/*/data.npy.chunks/plan.json")) if root.exists() else []
    assert len(journals) <= 1, journals
    return rows_not_done(journals[0].parent.parent) if journals else list(range(N_ROWS))


POINTS = ["row:0", "row:3", "row:mid", "row:late", "fsync", "checksum", "manifest",
          "manifest-written", "rename", "published"]


KILLS = [(point, locks.KINDS[i % len(locks.KINDS)]) for i, point in enumerate(POINTS)]
"""Every kill point once, the lock kinds taking turns (each kind at three or four points):
the kill points do not depend on the lock, and what the lock does after a kill
(``assert_lock_free``) is checked for each kind. The soak test mixes both at random."""


@pytest.mark.parametrize("point, lock", KILLS)
def test_sigkill_at_each_point_leaves_no_partial_entry_and_the_next_build_resumes(
        zygote, rows, tmp_path, monkeypatch, lock, point):
    paths, reference = rows
    rng = random.Random(f"{point}/{lock}")
    if point == "row:mid":
        point = f"row:{rng.randrange(CHUNK, N_ROWS // 2)}"
    elif point == "row:late":
        point = f"row:{rng.randrange(N_ROWS // 2, N_ROWS)}"
    root = tmp_path / "cache"
    kill_at(zygote, root, paths, point, lock, "first")
    key = key_in(root)
    assert_nothing_partial(root, key, reference)
    assert_lock_free(root, key, lock)

    hit = point == "published"
    todo = [] if hit else rows_left(root)
    if point.startswith("row:"):
        assert int(point[4:]) in todo
    elif point != "rename":
        assert todo == []  # every chunk was done: nothing to redo
    entry, decoded = resume(root, paths, lock, monkeypatch)
    assert entry.hit is hit and entry.key == key
    assert decoded == todo
    np.testing.assert_array_equal(np.asarray(entry.array), reference)  # zero wrong reads
    assert_valid_entry(entry.path, reference)
    assert list((root / "tmp").iterdir()) == []


def test_the_lock_file_a_killed_builder_leaves_goes_with_its_build_directory(
        zygote, rows, tmp_path):
    """A lock's holder removes the lock file as it releases it; one killed mid-build
    leaves it, with its holder record, and ``cachekit clear`` removes them with the dead
    build's directory. Lock files of builds that ended are gone already."""
    from cachekit.cli.main import main as cli_main

    paths, _ = rows
    root = tmp_path / "cache"
    cachekit.Cache(root, progress=False).images(pd.Series(paths[:4]), (4, 4))  # no rows shared
    assert list((root / "locks").iterdir()) == []
    reached, result = tmp_path / "reached", tmp_path / "result.json"
    pid = zygote.fork(root=str(root), point="row:3", chunk=CHUNK, lock="os", paths=paths,
                      size=SIZE, signal=str(reached), result=str(result),
                      env={"CACHEKIT_LOCK_LEASE": "0.4"})  # its record beats from 0.1 s
    try:
        wait_for_kill_point(reached, pid, result)
        key = next((root / "tmp").iterdir()).name.split(".")[0]
        holder = root / "locks" / f"{key}.lock.holder"
        deadline = time.monotonic() + 30
        while not holder.exists():
            assert time.monotonic() < deadline, "the builder wrote no holder record"
            time.sleep(0.01)
    finally:
        kill(pid)
    assert sorted(p.name for p in (root / "locks").iterdir()) == [
        f"{key}.lock", f"{key}.lock.holder"]
    assert cli_main(["--root", str(root), "clear", "--yes", key]) == 0
    assert list((root / "locks").glob("*.lock*")) == []  # (its listing memo stays)
    assert list((root / "tmp").iterdir()) == []


def test_soak_random_kill_chains(zygote, rows, tmp_path, monkeypatch):
    """Random locks and kill points, up to three kills in a row before a build completes."""
    paths, reference = rows
    rng = random.Random(int(os.environ.get("CACHEKIT_SOAK_SEED", "1")))
    kills = 0
    for trial in range(SOAK_TRIALS):
        root = tmp_path / f"trial{trial}" / "cache"
        root.parent.mkdir()
        lock = rng.choice(locks.KINDS)
        todo = list(range(N_ROWS))  # the rows not done, which a row kill can still reach
        for step in range(rng.randint(1, 3)):
            point = rng.choice([f"row:{rng.choice(todo)}", *POINTS[4:-1]])
            kill_at(zygote, root, paths, point, lock, f"t{trial}s{step}")
            kills += 1
            key = key_in(root)
            assert_nothing_partial(root, key, reference)
            assert_lock_free(root, key, lock)
            todo = rows_left(root)
            if not todo:
                break  # nothing left for a row kill
        entry, decoded = resume(root, paths, lock, monkeypatch)
        assert decoded == todo, (trial, lock, point)
        np.testing.assert_array_equal(np.asarray(entry.array), reference)
        assert_valid_entry(entry.path, reference)
        assert list((root / "tmp").iterdir()) == []
    assert kills >= SOAK_TRIALS
    print(f"soak: {SOAK_TRIALS} trials, {kills} SIGKILLs, every trial ended with a valid "
          "entry equal to the reference")  # shown with -s


def run_together(zygote, root: Path, tmp_path: Path, count: int, lock: str,
                 *barriers: str) -> list[dict]:
    """``count`` builders started at once that all wait for each other at each barrier."""
    start = tmp_path / "start"
    meetings = {name: tmp_path / f"meet-{name}" for name in barriers}
    for meeting in meetings.values():
        meeting.mkdir()
    results = [tmp_path / f"builder{i}.json" for i in range(count)]
    paths = zygote.paths
    for result in results:
        zygote.fork(root=str(root), point="", chunk=CHUNK, lock=lock, paths=paths, size=SIZE,
                    signal=str(tmp_path / "unused"), result=str(result), start=str(start),
                    barriers={name: [str(m), count] for name, m in meetings.items()})
    start.touch()
    reports = []
    for result in results:
        deadline = time.monotonic() + 120
        while not result.exists():
            err = Path(str(result) + ".err")
            assert not err.exists(), err.read_text()
            assert time.monotonic() < deadline, "a builder never finished"
            time.sleep(0.01)
        reports.append(json.loads(result.read_text()))
    return reports


def test_two_resumers_never_share_a_dead_builders_directory(zygote, rows, tmp_path):
    """Without a lock, two processes find one dead build and try to claim it at the same
    moment (they meet at barriers after starting their builds and before claiming): exactly
    one gets it, the other starts afresh."""
    paths, reference = rows
    zygote.paths = paths
    root = tmp_path / "cache"
    point = f"row:{N_ROWS // 2}"
    kill_at(zygote, root, paths, point, "none", "dead")
    todo = rows_left(root)
    assert len(todo) < N_ROWS
    reports = run_together(zygote, root, tmp_path, 2, "none", "begin", "claim")
    assert sorted(r["decoded"] for r in reports) == sorted([list(range(N_ROWS)), todo])
    assert len({r["sha"] for r in reports}) == 1 and len({r["builder"] for r in reports}) == 1
    assert_valid_entry(root / "entries" / reports[0]["key"], reference)
    assert list((root / "tmp").iterdir()) == []


def test_racing_builders_without_a_lock_publish_one_entry_and_the_losers_use_it(
        zygote, rows, tmp_path):
    """CACHEKIT_LOCK=none stands in for a lock a network filesystem silently ignores: three
    builders that miss at the same instant all build (they meet once each has started its
    build, so none saw another's heartbeat, and again before renaming), one rename wins,
    and all use its entry."""
    paths, reference = rows
    zygote.paths = paths
    root = tmp_path / "cache"
    reports = run_together(zygote, root, tmp_path, 3, "none", "begin", "rename")
    assert all(r["decoded"] == list(range(N_ROWS)) and not r["hit"] for r in reports)
    assert len({r["builder"] for r in reports}) == 1  # every process got the winner's entry
    assert len({r["sha"] for r in reports}) == 1 and len({r["key"] for r in reports}) == 1
    assert sorted(p.name for p in (root / "entries").iterdir()) == [reports[0]["key"]]
    assert_valid_entry(root / "entries" / reports[0]["key"], reference)
    assert list((root / "tmp").iterdir()) == []  # the losers discarded their copies
