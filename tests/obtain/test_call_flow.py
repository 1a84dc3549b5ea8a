"""The flow from the public face to the store reads in one direction (traced, not read).

Every call between two cachekit modules is recorded with ``sys.settrace`` while a call
runs: the face (``cache.py``) hands over to ``obtain/``, which uses the engine and the
store and returns; no module calls back into a layer above its own. A hit makes nothing
that only a build uses: no build, no wait, no lock.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pandas as pd

import cachekit
from test_layers import MODULES, layer

HEIGHT = {"base": 0, "engine": 1, "store": 1, "obtain": 2, "admin": 2, "face": 3, "cli": 4}
"""How high each layer sits: a call may go down or stay level, never up."""
FILES = {str(path): name for name, path in MODULES.items()}
BUILD_ONLY = {"RowRequest.start", "RowBuild.__init__", "Miss.__init__", "OwnWork.__init__",
              "LocalWait.__init__", "Wait.__init__", "make_lock", "build_and_commit"}
"""What only a miss makes or runs: the build, the accounting of its work, the wait and the
build lock."""


def traced(run: Callable[[], object]) -> list[tuple[str, str, str]]:
    """(caller module, callee module, callee qualified name) of every call from one
    cachekit module into another, or into a function of cachekit, while ``run`` runs."""
    calls: list[tuple[str, str, str]] = []

    def tracer(frame, event, arg):
        if event == "call":
            callee = FILES.get(frame.f_code.co_filename)
            if callee is not None:
                caller = frame.f_back
                calls.append((FILES.get(caller.f_code.co_filename, "") if caller else "",
                              callee, frame.f_code.co_qualname))
        return None

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return calls


def upward(calls: list[tuple[str, str, str]]) -> set[str]:
    """The calls that climb: from a cachekit module into a layer above its own."""
    return {f"{caller} -> {callee}.{name}" for caller, callee, name in calls
            if caller and HEIGHT[layer(callee)] > HEIGHT[layer(caller)]}


def test_a_hit_goes_down_from_the_face_and_back_making_no_build(cache_root: Path,
                                                                 cover_paths: list[str]):
    cache = cachekit.Cache(cache_root, workers=1, executor="threads", progress=False)
    column = pd.Series(cover_paths[:4])
    assert cache.images(column, 8).source == "built"
    calls = traced(lambda: cache.images(column, 8))
    assert upward(calls) == set()
    made = {name for _, _, name in calls}
    assert made & BUILD_ONLY == set()
    assert "find_entry" in made and "LocalStore.lookup" in made and "Entry.__init__" in made
    # Down and back: the face calls obtain, obtain the store; the face then opens the entry.
    first = {layer(callee): i for i, (_, callee, _) in reversed(list(enumerate(calls)))}
    assert first["face"] < first["obtain"] < first["store"]
    assert ("cachekit.cache", "cachekit.entry", "Entry.from_outcome") in calls


def test_a_cold_call_never_calls_back_up(cache_root: Path, cover_paths: list[str]):
    """A build: the engine fills rows, the store commits, nothing of either calls into
    obtain, nor obtain into the face."""
    cache = cachekit.Cache(cache_root, workers=1, executor="threads", progress=False)
    entry = {}
    calls = traced(lambda: entry.setdefault("got", cache.images(pd.Series(cover_paths[:4]), 8)))
    assert entry["got"].source == "built"
    made = {name for _, _, name in calls}
    assert {"RowRequest.start", "build_and_commit", "RowBuild.committed"} <= made
    assert upward(calls) == set()


def test_the_climb_finder_sees_a_call_back_up():
    """What the two tests above rely on: a call from the store into obtain is seen."""
    from cachekit.obtain import accounting

    calls = [("cachekit.store.local", "cachekit.obtain.accounting", "OwnWork.joined"),
             ("cachekit.obtain.flow", "cachekit.store.local", "LocalStore.lookup")]
    assert upward(calls) == {"cachekit.store.local -> cachekit.obtain.accounting.OwnWork.joined"}
    assert accounting.__name__ in FILES.values()


def test_a_memoize_hit_makes_no_build(cache_root: Path):
    cache = cachekit.Cache(cache_root, progress=False)

    @cache.memoize
    def prepared(n: int):
        import numpy as np

        return np.arange(n)

    assert prepared(5).tolist() == list(range(5))
    calls = traced(lambda: prepared(5))
    made = {name for _, _, name in calls}
    assert "_Build.__init__" not in made and made & BUILD_ONLY == set()
    assert upward(calls) == set()


BUILD_MODULES = {"cachekit.obtain.miss", "cachekit.obtain.built", "cachekit.obtain.row_build",
                 "cachekit.obtain.commit",
                 "cachekit.obtain.local_wait", "cachekit.obtain.wait",
                 "cachekit.obtain.donors", "cachekit.engine.filling.claimed",
                 "cachekit.engine.filling.builder", "cachekit.engine.running.executors",
                 "cachekit.store.remote", "filelock", "PIL", "torch"}
"""What only a miss needs: the first hit of a sweep agent pays for every module it
imports."""
HIT_IN_A_FRESH_INTERPRETER = """
import json, sys
import pandas as pd
import cachekit
root, paths = sys.argv[1], json.loads(sys.argv[2])
entry = cachekit.Cache(root, workers=1, executor="threads", progress=False).images(
    pd.Series(paths), 8)
assert entry.hit and entry.outcome == "hit", entry
print(json.dumps(sorted(sys.modules)))
"""


def test_a_first_hit_in_a_fresh_interpreter_imports_none_of_the_build(
        cache_root: Path, cover_paths: list[str]):
    import json
    import subprocess

    cache = cachekit.Cache(cache_root, workers=1, executor="threads", progress=False)
    assert cache.images(pd.Series(cover_paths[:4]), 8).source == "built"
    run = subprocess.run([sys.executable, "-c", HIT_IN_A_FRESH_INTERPRETER, str(cache_root),
                          json.dumps(cover_paths[:4])], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = {name.split(".")[0] if not name.startswith("cachekit") else name
              for name in json.loads(run.stdout)}
    assert {"cachekit.obtain.flow", "cachekit.store.local", "pandas"} <= loaded
    assert loaded & BUILD_MODULES == set()
