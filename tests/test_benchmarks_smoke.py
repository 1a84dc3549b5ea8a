"""benchmarks/run.py still runs end to end: a tiny configuration, nothing timed or compared.

The packages of the ``bench`` extra are in ``dev`` too, which CI installs: a missing one is a
failure here, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hosts
import users

RUN_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def load_run_module():
    spec = importlib.util.spec_from_file_location("cachekit_benchmarks_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


PHASE_SECTIONS = {"build": {"build", "rss"}, "hit": {"hit"},
                  "agents": {"agents_wall", "agents_cpu"}, "dataloader": {"dataloader", "pss"}}
"""The report's sections that each phase of benchmarks/run.py measures."""


@pytest.mark.parametrize("phase", sorted(PHASE_SECTIONS))
def test_a_tiny_quick_run_of_a_phase_measures_it_and_leaves_the_published_figures_alone(
        phase: str, tmp_path: Path, capsys, monkeypatch) -> None:
    # One phase per test, so that the workers run them side by side. Every peer but the
    # seed's two caches: each of their jobs is a fresh interpreter that imports
    # torchvision, which would make most of this test's time. The seed's Dataset still
    # runs in the DataLoader phase.
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its output folder goes here
    repo = RUN_PY.parent.parent
    before = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                            text=True).stdout
    run = load_run_module()
    assert set(run.PHASES) == set(PHASE_SECTIONS)
    # The smallest sizes that still give every figure: two rows per build worker, one
    # DataLoader batch (256 rows); the time is interpreters starting, not rows.
    report = run.main(["--quick", "--covers", "4", "--rss-small", "2", "--agents-rows", "2",
                       "--hit-rows", "20", "--dataloader-rows", "256", "--repeats", "1",
                       "--contestants", "joblib,datasets,cachekit", "--only", phase])
    after = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                           text=True).stdout
    assert after == before
    assert "the published ones in docs/ and README.md stay" in capsys.readouterr().err
    [out] = [p.parent for p in tmp_path.glob("cachekit-bench-quick-*/benchmarks.md")]
    assert {row.section for row in report.rows} == PHASE_SECTIONS[phase]
    assert all(len(row.runs) == 1 and row.runs[0] > 0 for row in report.rows)
    text = (out / "benchmarks.md").read_text(encoding="utf-8")
    assert (out / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if phase == "build":
        built = " ".join(row.label for row in report.rows if row.section == "build")
        assert "joblib" in built and "datasets" in built and "cachekit" in built
        assert "cachekit exact, 2 workers" in text
    if phase == "hit":
        assert any(row.label.startswith("datasets") for row in report.section_rows("hit"))
        assert "joblib.Memory, object" in text
        for row in report.section_rows("hit"):  # each import, then the first call
            assert row.extra["with_import"] > row.runs[0]
            assert "import and first call: " in row.detail
        assert "column, each library's import counted: no slower than joblib.Memory" in text
    if phase == "agents":
        race = report.row("agents_wall", "cachekit")
        assert race is not None and "decoded: 1 of 4" in race.detail  # one builder, three waiters
    if phase == "dataloader":
        loaded = [row.label for row in report.section_rows("dataloader")]
        for workers in (0, 2):
            for start in ("in-RAM", "cachekit entry.dataset()", "seed:"):
                assert any(label.startswith(start) and label.endswith(f"num_workers={workers}")
                           for label in loaded)
        assert "## DataLoader epoch throughput" in text


def test_a_replot_fills_the_generated_parts_and_keeps_the_prose(tmp_path: Path) -> None:
    run = load_run_module()
    published = RUN_PY.parent.parent / "docs" / "benchmarks.json"
    out = tmp_path / "docs"
    out.mkdir()
    page = out / "benchmarks.md"
    page.write_text(f"# By hand\n\nprose\n\n{run.RESULTS_START}\nOLD-RESULTS\n"
                    f"{run.RESULTS_END}\n\ntail\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{run.README_START}\nOLD-BLOCK\n{run.README_END}\nlinks\n",
                      encoding="utf-8")
    run.main(["--replot", str(published), "--out", str(out), "--readme", str(readme)])

    text = page.read_text(encoding="utf-8")
    assert text.startswith("# By hand\n\nprose\n") and text.endswith("\ntail\n")
    assert "OLD-RESULTS" not in text and "# cachekit benchmarks" not in text
    assert "## Cold build" in text and "range (runs)" in text and "## Contestants" in text
    front = readme.read_text(encoding="utf-8")
    assert front.startswith("intro\n") and front.endswith("links\n") and "OLD-BLOCK" not in front
    assert "![benchmark chart](docs/benchmarks.png)" in front and "| budget" in front
    assert "range (runs)" not in front  # the full tables stay on the docs page


# The datasets contestant's map(num_proc=2) pickles through the `multiprocess` package, whose
# reduction.dumps returns a memoryview of an io.BytesIO; on Python 3.13 the BytesIO, freed
# later by the cycle collector with that view alive, raises BufferError as an unraisable
# exception in whatever runs then. A peer's object, not cachekit's: ignored here alone.
@pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io\.BytesIO:pytest.PytestUnraisableExceptionWarning")
def test_the_engine_benchmark_prints_every_ratio(tmp_path: Path, monkeypatch) -> None:
    # Imported by its own name: its OpenCV pool's spawned workers import it by that name.
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    engine = importlib.import_module("bench_engine")
    result = engine.main(["--covers", "4", "--rounds", "1", "--json", str(tmp_path / "e.json")])
    text = result["table"]
    for figure in ("exact 1 worker / seed loop", "exact 1 worker / bare Pillow loop",
                   "exact 2 workers / 1 worker (threads)", "processes / threads, 2 workers",
                   "CPU per image, default build / bare loop"):
        assert f"| {figure} |" in text
    for peer in ("default build / datasets map", "draft default / OpenCV reduced decode",
                 "Dask 2 workers / 1 worker"):  # their packages are in dev: none may be missing
        assert f"| {peer} |" in text
    assert "Not measured" not in text and result["skipped"] == []
    assert all(len(runs) == 1 and runs[0][0] > 0 for runs in result["runs"].values())
    assert 0 <= result["gil"]["covers"]["gil"] <= 1
    assert (tmp_path / "e.json").exists()


def test_the_incremental_benchmark_prints_every_ratio(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    incremental = importlib.import_module("bench_incremental")
    result = incremental.main(["--quick", "--covers", "30", "--lookup-entries", "3",
                               "--lookup-rows", "3000", "--json", str(tmp_path / "i.json")])
    text = result["table"]
    for figure in ("99% shared / fresh build", "5 training columns / one full build",
                   "no entry holds the column's rows", "one more entry holds 99% of them",
                   "staleness check of a hit of 3000 rows",
                   "retry after one bad file was fixed / fresh build",
                   "first hit of 3000 rows, background check / sample only",
                   "one file rewritten among 3000: reported after (median)"):
        assert f"| {figure} |" in text
    assert result["shared"][0]["decoded"] == 1 and result["folds"][0]["decoded"] == 30
    assert all(r["reuse"] > 0 and r["fresh"] > 0 for r in result["shared"])
    assert (tmp_path / "i.json").exists()


def test_the_backends_benchmark_prints_its_ratios(tmp_path: Path, monkeypatch) -> None:
    # Imported by its own name: its OpenCV pool's spawned workers import it by that name.
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    backends = importlib.import_module("bench_backends")
    result = backends.main(["--quick", "--images", "4", "--json", str(tmp_path / "b.json"),
                            "--only", "cachekit tensor, 1", "--only", "cachekit pil, 1",
                            "--only", "OpenCV"])
    text = result["table"]
    for figure in ("default build per core / bare Pillow loop",
                   "CPU per image, default build per core / bare loop",
                   "tensor / pil, 1 worker"):
        assert f"| {figure} |" in text
    assert set(result["runs"]) == {"bare Pillow loop", "cachekit pil, 1 worker",
                                   "cachekit tensor, 1 worker (the default per core)",
                                   "OpenCV reduced decode, 2 processes"}
    assert all(0 <= g["gil"] <= 1 for g in result["gil"].values())
    assert result["diffs"]["tensor"][1] <= 1  # bilinear: within one level of pil
    assert (tmp_path / "b.json").exists()


def test_the_failures_benchmark_prints_every_figure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    failures = importlib.import_module("bench_failures")
    result = failures.main(["--quick", "--failed", "300", "--good", "4",
                            "--json", str(tmp_path / "f.json")])
    for figure in ("first build s", "retry s", "retry planning s", "failure record KB",
                   "on_error='zero' manifest KB", "next call (hit, fresh interpreter) s"):
        assert f"| {figure} |" in result["table"]
    assert all(value > 0 for value in result["rounds"][0].values())
    assert (tmp_path / "f.json").exists()


def test_the_storage_benchmark_prints_every_figure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    storage = importlib.import_module("bench_storage")
    result = storage.main(["--quick", "--covers", "60", "--hit-rows", "300",
                           "--json", str(tmp_path / "s.json")])
    for figure in ("folds disk / full entry alone", "10 fold calls s / fresh build s",
                   "a file create right after, ms", "append 1%: root growth / full entry",
                   "retry: bytes added / (1 row + row map)",
                   "shuffled epoch: fold speed / contiguous",
                   "sequential epoch: fold speed / contiguous",
                   "one shuffled epoch s (contiguous)",
                   "remote: bucket bytes / the host's root",
                   "remote: a fold pulled, bytes read / its rows",
                   "first hit: derived s / contiguous s",
                   "40 appends: files the last entry links, bounded",
                   "40 appends: root growth / full entry, unbounded",
                   "40 appends: hit of the last entry, bounded / unbounded",
                   "union of 60 entries: call s / fresh build s",
                   "union of 60 entries: files opened at most",
                   "repeats: covers on 4 rows s / once s",
                   "repeats: covers on 4 rows, disk / once"):
        assert f"| {figure} |" in result["table"]
    assert all(value > 0 for value in result["rounds"][0].values())
    assert result["rounds"][0]["folds disk / full entry alone"] < 1.5  # the folds link it
    assert result["rounds"][0]["remote: a fold pulled, bytes read / its rows"] < 0.5
    assert result["rounds"][0]["heal, remote: bytes sent / (1 row + row map)"] < 3  # not the entry
    links = [result["rounds"][0][f"40 appends: files the last entry links, {kind}"]
             for kind in ("bounded", "unbounded")]
    assert links[0] <= 32 < links[1] == 40
    assert result["rounds"][0]["union of 60 entries: files opened at most"] < 60  # not each
    assert result["rounds"][0]["repeats: bytes a fold adds / (its new rows once + map)"] < 2
    assert result["rounds"][0]["repeats: covers on 4 rows, disk / once"] < 1.5  # not 4
    assert (tmp_path / "s.json").exists()


def test_the_team_benchmark_prints_every_figure(tmp_path: Path, monkeypatch) -> None:
    """Two plain uids (as the shared-root tests: CI runs as root, so it runs): a member's
    folds of a teammate's entry add one copy of the rows, each a copy of its own five."""
    reason = users.why_no_two_uids()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    team = importlib.import_module("bench_team")
    result = team.main(["--quick", "--covers", "40", "--json", str(tmp_path / "t.json")])
    figures = result["rounds"][0]
    for how in ("", ", contiguous=True"):
        assert f"| member's 10 folds{how}: bytes added / full entry |" in result["table"]
        assert figures[f"member's 10 fold calls{how} s / teammate's build s"] > 0
    assert figures["member's 10 folds: bytes added / full entry"] < 1.5
    assert figures["member's 10 folds, contiguous=True: bytes added / full entry"] > 4.5
    assert (tmp_path / "t.json").exists()


def test_the_listing_benchmark_times_ls_at_each_count(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(RUN_PY.parent))
    listing = importlib.import_module("bench_listing")
    result = listing.main(["--quick", "--covers", "12", "--json", str(tmp_path / "l.json")])
    assert [r["entries"] for r in result["results"]] == [10, 30]
    assert all(r["ls s"] > 0 and r["ls, no memo s"] > 0 and r["start s"] > 0
               and [len(runs) for runs in r["runs"].values()] == [3, 3, 3]
               for r in result["results"])
    assert "| 30 | " in result["table"] and (tmp_path / "l.json").exists()


@pytest.mark.parametrize("mode", [[], ["--team"], ["--hosts"]], ids=["one-user", "team", "hosts"])
def test_a_short_soak_runs_its_workers_and_reports_what_they_did(tmp_path: Path,
                                                                 mode: list[str]) -> None:
    """``benchmarks/soak.py`` for 5 s with two workers (with ``--team``, two plain uids on
    a shared root; with ``--hosts``, two simulated hosts): each call is counted, and nothing
    failed (a failure makes it exit 1 and print it)."""
    reason = {"--team": users.why_no_two_uids, "--hosts": hosts.why_no_hosts}.get(
        next(iter(mode), ""), lambda: None)()
    if reason is not None:
        pytest.skip(reason)  # as the fixtures do (CI runs as root: it runs)
    result = subprocess.run([sys.executable, str(RUN_PY.with_name("soak.py")),
                             "--seconds", "5", "--workers", "2", *mode], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| built |" in result.stdout and result.stdout.rstrip().endswith("no failures")
    uids = f"{users.VICTIM_UID}, {users.ATTACKER_UID}" if mode == ["--team"] \
        else str(os.getuid())
    names = "host-a, host-b" if mode == ["--hosts"] else socket.gethostname()
    assert f"worker uids: {uids}; hosts: {names}\n" in result.stdout  # who ran workers
