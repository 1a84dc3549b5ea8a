"""Run reporting into wandb (cachekit/_wandb.py) and the sweep example with real agents.

The reporting tests put a stand-in ``wandb`` module into ``sys.modules``, the way a user's
``import wandb`` would, so they run without wandb installed. The sweep test starts four fresh
interpreters the way ``wandb agent`` does and needs the real wandb (the ``wandb`` extra).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import _wandb

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "wandb_sweep.py"
FIELDS = ("key", "hit", "outcome", "source", "build_seconds", "decode_seconds", "join_seconds",
          "wait_seconds", "rows",
          "shape", "bytes")


def _row(value: int) -> np.ndarray:
    return np.full((2, 3), value, dtype=np.int16)


class _Summary(dict):
    def update(self, *args: Any, **kwargs: Any) -> None:  # wandb's summary has update()
        super().update(*args, **kwargs)


class _BrokenSummary:
    def __init__(self) -> None:
        self.calls = 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        raise ConnectionError("wandb-core went away")


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for an imported wandb with an active run, and a fresh reporter state."""
    module = types.ModuleType("wandb")
    module.run = types.SimpleNamespace(id="run-1", summary=_Summary())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv(_wandb.ENV, raising=False)
    monkeypatch.setattr(_wandb, "_warned", False)
    monkeypatch.setattr(_wandb, "_totals", {})
    return module


def test_a_miss_then_a_hit_are_recorded_in_the_run_summary(fake_wandb, cache_root):
    cache = cachekit.Cache(cache_root, progress=False)
    built = cache.map(_row, pd.Series([1, 2, 3]))
    summary = fake_wandb.run.summary
    assert summary["cachekit/key"] == built.key
    assert summary["cachekit/hit"] is False
    assert summary["cachekit/build_seconds"] == built.build_seconds  # this process's own
    assert built.build_seconds >= built.manifest["build_seconds"]  # begin to commit, and more
    assert summary["cachekit/decode_seconds"] == built.decode_seconds <= built.build_seconds
    assert summary["cachekit/rows"] == 3
    assert summary["cachekit/shape"] == [3, 2, 3]
    assert summary["cachekit/bytes"] == 3 * 2 * 3 * 2
    assert summary["cachekit/entries"] == 1
    assert (summary["cachekit/rows_decoded"], summary["cachekit/rows_joined"],
            summary["cachekit/rows_reused"]) == (3, 0, 0)

    hit = cache.map(_row, pd.Series([1, 2, 3]))
    assert hit.hit
    assert summary["cachekit/hit"] is True
    assert summary["cachekit/build_seconds"] == 0.0  # nothing was built by this call
    assert summary["cachekit/decode_seconds"] == 0.0
    assert summary["cachekit/wait_seconds"] == 0.0
    assert (hit.build_seconds, hit.decode_seconds, hit.wait_seconds) == (0.0, 0.0, 0.0)
    assert summary["cachekit/entries"] == 2
    assert summary["cachekit/build_seconds_total"] == built.build_seconds
    assert summary["cachekit/decode_seconds_total"] == built.decode_seconds
    assert (summary["cachekit/rows_decoded"], summary["cachekit/rows_reused"]) == (0, 0)
    assert summary["cachekit/rows_decoded_total"] == 3
    assert set(summary) == {f"cachekit/{name}" for name in FIELDS} | {
        "cachekit/entries", "cachekit/build_seconds_total", "cachekit/decode_seconds_total",
        "cachekit/wait_seconds_total",
        "cachekit/rows_decoded", "cachekit/rows_joined", "cachekit/rows_reused",
        "cachekit/rows_decoded_total", "cachekit/rows_joined_total",
        "cachekit/rows_reused_total"}


def test_a_build_that_reuses_rows_reports_the_three_counts(fake_wandb, cache_root):
    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    cache.map(_row, pd.Series([1, 2, 3, 4]))
    grown = cache.map(_row, pd.Series([1, 2, 3, 4, 5, 6]))
    summary = fake_wandb.run.summary
    assert (grown.rows_decoded, grown.rows_joined, grown.rows_reused) == (2, 0, 4)
    assert (summary["cachekit/rows_decoded"], summary["cachekit/rows_joined"],
            summary["cachekit/rows_reused"]) == (2, 0, 4)
    assert (summary["cachekit/rows_decoded_total"], summary["cachekit/rows_reused_total"]) \
        == (6, 4)


def _slow_row(value: int) -> np.ndarray:
    time.sleep(0.1)
    return np.full(2, value, dtype=np.int16)


def test_a_builder_that_waited_for_nobody_reports_no_wait(fake_wandb, cache_root):
    # wait_seconds is time spent waiting for another process's build, not this one's build
    cache = cachekit.Cache(cache_root, workers=1, progress=False)
    built = cache.map(_slow_row, pd.Series([1, 2, 3, 4]))
    summary = fake_wandb.run.summary
    assert built.source == "built" and summary["cachekit/build_seconds"] >= 0.4
    assert summary["cachekit/decode_seconds"] >= 0.4  # four rows of 0.1 s, computed here
    assert summary["cachekit/wait_seconds"] < summary["cachekit/build_seconds"] / 4


def test_totals_start_again_with_a_new_run(fake_wandb, cache_root):
    cache = cachekit.Cache(cache_root, progress=False)
    cache.map(_row, pd.Series([1]))
    cache.map(_row, pd.Series([2]))
    assert fake_wandb.run.summary["cachekit/entries"] == 2
    fake_wandb.run = types.SimpleNamespace(id="run-2", summary=_Summary())  # wandb.agent(function=)
    cache.map(_row, pd.Series([1]))
    assert fake_wandb.run.summary["cachekit/entries"] == 1
    assert fake_wandb.run.summary["cachekit/build_seconds_total"] == 0.0


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_the_environment_variable_turns_reporting_off(fake_wandb, cache_root, monkeypatch,
                                                      value):
    monkeypatch.setenv("CACHEKIT_WANDB", value)
    cachekit.Cache(cache_root, progress=False).map(_row, pd.Series([1]))
    assert fake_wandb.run.summary == {}


def test_nothing_is_recorded_without_an_active_run(fake_wandb, cache_root):
    fake_wandb.run = None  # imported, but no wandb.init() (or after run.finish())
    entry = cachekit.Cache(cache_root, progress=False).map(_row, pd.Series([1]))
    assert len(entry) == 1


def test_a_failing_wandb_warns_once_and_never_raises(fake_wandb, cache_root):
    broken = _BrokenSummary()
    fake_wandb.run = types.SimpleNamespace(id="run-1", summary=broken)
    cache = cachekit.Cache(cache_root, progress=False)
    with pytest.warns(RuntimeWarning, match="could not record.*ConnectionError") as caught:
        entry = cache.map(_row, pd.Series([1, 2]))
    assert caught[0].filename == __file__  # points at the user's call
    assert entry.array.shape == (2, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second failure is silent
        assert cache.map(_row, pd.Series([1, 2])).hit
    assert broken.calls == 2


HIT_WITHOUT_WANDB = textwrap.dedent("""
    import sys
    import cachekit
    assert "wandb" not in sys.modules
    cache = cachekit.Cache(sys.argv[1], progress=False)
    cache.images(sys.argv[2:], size=8)
    assert "wandb" not in sys.modules, "a build imported wandb"
    assert cache.images(sys.argv[2:], size=8).hit
    assert "wandb" not in sys.modules, "a hit imported wandb"
    print("ok")
""")


def test_cachekit_never_imports_wandb(cache_root, cover_paths):
    done = subprocess.run([sys.executable, "-c", HIT_WITHOUT_WANDB, str(cache_root),
                           *cover_paths[:3]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_cli_prebuild_is_a_hit_for_the_train_function(tmp_path, cover_paths):
    """README: `cachekit build CSV --column img_path --size 32x32` before launching agents."""
    csv = tmp_path / "train.csv"
    pd.DataFrame({"img_path": cover_paths, "label": 0}).to_csv(csv, index=False)
    root = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "cachekit", "--root", str(root), "build",
                           str(csv), "--column", "img_path", "--size", "32x32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    entry = cachekit.Cache(root, progress=False).images(pd.read_csv(csv)["img_path"], size=32)
    assert entry.hit and entry.key == done.stdout.strip()


# ---------------------------------------------------------------------------------------
# Four `wandb agent`-style interpreters on an empty cache, with the real wandb, offline.
# Each agent reads its run summary back through wandb's public API (``dict(run.summary)``,
# the run's own copy of its summary) just before ``run.finish()`` and hands it to the test in
# out.json: the test never parses wandb's private run files (``run-ID.wandb``), whose format
# changes between wandb releases (0.31 offline writes no wandb-summary.json).

AGENT = textwrap.dedent("""
    import importlib.util, json, os, sys, time
    example, csv, decoded, ready, start, out = sys.argv[1:7]
    import wandb
    import cachekit.engine.decoding.images

    decode = cachekit.engine.decoding.images.load_image

    def counted(path, *args, **kwargs):
        with open(decoded, "a") as f:  # one line per decoded image, from any agent
            f.write(f"{os.getpid()} {path}\\n")
        return decode(path, *args, **kwargs)

    cachekit.engine.decoding.images.load_image = counted
    spec = importlib.util.spec_from_file_location("wandb_sweep", example)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    run = wandb.init(mode="offline", project="cachekit-test",
                     config={"steps": 3, "batch_size": 16, "channels": 4})
    open(ready, "w").close()
    while not os.path.exists(start):  # start barrier: every agent asks at the same moment
        time.sleep(0.005)
    result = sweep.train(csv)
    summary = dict(run.summary)  # the run's summary as wandb holds it, through its public API
    sheet = summary.pop("cachekit/sheet", None)  # the logged image: wandb's own object
    sheet = None if sheet is None else str(sheet["_type"])
    run.finish()
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "result": result, "summary": summary,
                   "sheet": sheet}, f, default=lambda o: f"<{type(o).__name__}>")
""")


def test_four_sweep_agents_build_once_and_record_it(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed "
                                        "(pip install -e '.[wandb]')")
    sweep = _load_example()
    csv = sweep.make_data(str(tmp_path / "data"), count=120)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    decoded, start = tmp_path / "decoded.txt", tmp_path / "start"
    agents = []
    for i in range(4):
        home = tmp_path / f"agent{i}"
        home.mkdir()
        env = {**os.environ, "CACHEKIT_DIR": str(tmp_path / "cache"), "WANDB_DIR": str(home),
               "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
               "WANDB_DATA_DIR": str(home / "data"), "WANDB_MODE": "offline",
               "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false",
               "OMP_NUM_THREADS": "1"}
        env.pop("CACHEKIT_WANDB", None)
        agents.append(subprocess.Popen(
            [sys.executable, str(script), str(EXAMPLE), str(csv), str(decoded),
             str(home / "ready"), str(start), str(home / "out.json")],
            env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    _wait_until_ready(agents, [tmp_path / f"agent{i}" / "ready" for i in range(4)])
    start.touch()
    errs = []
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err
        errs.append(err)

    outs = [json.loads((tmp_path / f"agent{i}" / "out.json").read_text()) for i in range(4)]
    summaries = [out["summary"] for out in outs]
    for summary, out in zip(summaries, outs):
        assert {f"cachekit/{name}" for name in FIELDS} <= set(summary)
        assert summary["cachekit/entries"] == 1
        assert summary["data_blake2b"] == out["result"]["data_blake2b"]
        assert np.isfinite(summary["loss"])

    keys = {s["cachekit/key"] for s in summaries}
    assert len(keys) == 1
    key = keys.pop()
    built = [out["pid"] for s, out in zip(summaries, outs) if s["cachekit/source"] == "built"]
    helped = {str(out["pid"]) for s, out in zip(summaries, outs)
              if s["cachekit/source"] in ("built", "joined")}
    assert len(built) == 1  # exactly one agent built; the others joined, waited or hit
    # what each did, in one word: nobody reports a hit for another agent's build it waited for
    words = {"built": {"built"}, "joined": {"joined"}, "local": {"waited", "hit"}}
    assert all(s["cachekit/outcome"] in words[s["cachekit/source"]] for s in summaries)
    assert all(s["cachekit/hit"] is (s["cachekit/outcome"] == "hit") for s in summaries)
    # stderr is a pipe, not a terminal: the builder says what it does in lines, not a bar
    sheets = {out["pid"]: out["sheet"] for out in outs if out["sheet"] is not None}
    assert list(sheets) == built and sheets[built[0]] == "image-file"  # the builder's alone
    builder_err = errs[[out["pid"] for out in outs].index(built[0])]
    assert re.search(r"cachekit images: filling \d+ rows", builder_err), builder_err
    assert re.search(r"cachekit images: \d+ rows filled in [\d.]+ s", builder_err)
    manifest = json.loads((tmp_path / "cache" / "entries" / key / "manifest.json").read_text())
    assert manifest["builder"]["pid"] == built[0]
    lines = decoded.read_text().splitlines()  # every image once, by the builder and joiners
    assert len(lines) == 120 and {line.split()[0] for line in lines} == helped
    for summary in summaries:  # each agent's own seconds, never another's
        built, decoded = summary["cachekit/build_seconds"], summary["cachekit/decode_seconds"]
        source = summary["cachekit/source"]
        if source == "built":
            assert built >= manifest["build_seconds"] and 0 < decoded <= built
        elif source == "joined":
            assert 0 < decoded == built  # the chunks it filled, not the whole build
        else:
            assert built == decoded == 0
        waited = summary["cachekit/wait_seconds"]
        # a number of seconds (wandb may hand a whole 0.0 back as 0)
        assert type(waited) in (int, float) and 0 <= waited < 300
        assert summary["cachekit/rows"] == 120
        assert summary["cachekit/shape"] == [120, 3, 32, 32]
        assert summary["cachekit/bytes"] == 120 * 3 * 32 * 32

    # Identical training data everywhere, and equal to what the cache holds.
    entry = cachekit.Cache(tmp_path / "cache", progress=False).images(
        pd.read_csv(csv)["img_path"], size=32)
    expected = hashlib.blake2b(np.ascontiguousarray(entry.array), digest_size=16)
    expected.update(pd.read_csv(csv)["label"].to_numpy(dtype=np.int64).tobytes())
    assert {s["data_blake2b"] for s in summaries} == {expected.hexdigest()}
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def _load_example() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("wandb_sweep_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_until_ready(agents: list[subprocess.Popen], ready: list[Path]) -> None:
    """Block until every agent has imported and started its run; fail if one died."""
    deadline = time.monotonic() + 240  # a hang guard only, never an assertion on speed
    while not all(path.exists() for path in ready):
        for agent in agents:
            if agent.poll() is not None:
                _, err = agent.communicate()
                pytest.fail(f"an agent exited early with {agent.returncode}:\n{err}")
        assert time.monotonic() < deadline, "agents did not start"
        time.sleep(0.05)


def test_a_build_of_images_logs_a_contact_sheet_of_sampled_rows(fake_wandb, cache_root,
                                                                cover_paths, monkeypatch):
    logged = []
    fake_wandb.run.log = logged.append
    fake_wandb.Image = lambda picture, caption: ("image", picture, caption)
    cache = cachekit.Cache(cache_root, progress=False)
    entry = cache.images(cover_paths, 8, backend="pil")
    [(kind, picture, caption)] = [item["cachekit/sheet"] for item in logged]
    assert kind == "image" and caption.startswith(f"entry {entry.key[:12]}: rows ")
    from cachekit import sheet

    rows = sheet.choose_rows(len(entry), sample=_wandb.SHEET_ROWS)
    tiles = np.asarray(picture)
    scale = sheet.scale_of(entry.array.shape)
    for index, row in enumerate(rows):
        x, y = sheet.tile_origin(index, len(rows), entry.array.shape)
        tile = tiles[y:y + 8 * scale:scale, x:x + 8 * scale:scale]
        np.testing.assert_array_equal(tile, entry.array[row].transpose(1, 2, 0))
    cache.images(cover_paths, 8, backend="pil")  # a hit logs no sheet
    monkeypatch.setenv(_wandb.SHEET_ENV, "0")
    cache.images(cover_paths, 12, backend="pil")  # a build, with the sheet turned off
    assert len(logged) == 1
