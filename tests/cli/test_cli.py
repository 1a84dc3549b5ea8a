"""The ``cachekit`` command line against real cache roots: ``cachekit.cli.main`` in this
process, and every command also as the real console script (and ``python -m cachekit``) in
a subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit import units
from cachekit.store import manifest as manifests
from cachekit.cli.main import main
from helpers import GATED_ROWS, entry_disk_bytes, start_gated_builder

SCRIPT = Path(sys.executable).with_name("cachekit")
DAY = 86400.0

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="console script not installed")


def cachekit_cmd(*args: str, root: Path | None = None, stdin: str | None = "",
                 env: dict[str, str] | None = None, script: bool = False
                 ) -> subprocess.CompletedProcess:
    """Run ``cachekit [--root ROOT] ARGS`` with stdin not a terminal, and what it printed.

    By default ``cachekit.cli.main`` runs in this process, the script's own code without an
    interpreter's start-up (a third of a second of CPU each, seventy times here); with
    ``script`` the installed console script runs, as a user types it: each command tested
    here does in at least one test (``demo`` in tests/face/test_demo.py)."""
    argv = (["--root", str(root)] if root is not None else []) + list(args)
    if script:
        result = subprocess.run([str(SCRIPT), *argv], input=stdin, capture_output=True,
                                text=True, timeout=120, env={**os.environ, **(env or {})})
        assert "Traceback" not in result.stderr, result.stderr
        return result
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), \
            mock.patch.object(sys, "stdin", io.StringIO(stdin or "")), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def in_process(*args: str, root: Path | None = None) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``cachekit [--root ROOT] ARGS`` run in this process."""
    result = cachekit_cmd(*args, root=root)
    return result.returncode, result.stdout, result.stderr


def block(value: int) -> np.ndarray:
    return np.full((2, 4), value % 256, dtype=np.uint8)


def small_block_entry(root: Path, start: int, rows: int = 6) -> cachekit.Entry:
    return cachekit.Cache(root).map(block, pd.Series(range(start, start + rows)))


def keys_in(root: Path) -> set[str]:
    """The keys of the root's entries (not the rows of failed builds)."""
    return {e.key for e in cachekit.Cache(root).entries() if e.failed_build is None}


class Made(NamedTuple):
    """An entry a test made, by key and directory: its ``Entry`` let go, so that no live
    process holds it (``prune`` and ``clear --older-than`` pass over a held entry)."""

    key: str
    path: Path


@pytest.fixture
def three(cache_root: Path) -> list[Made]:
    """Three entries, used 300, 200 and 10 s ago (the first made is the least recently used)."""
    entries = [small_block_entry(cache_root, i * 10) for i in range(3)]
    now = time.time()
    for entry, age in zip(entries, (300, 200, 10)):
        os.utime(entry.path, (now - age, now - age))
    return [Made(e.key, e.path) for e in entries]


# -- dir, help, python -m ------------------------------------------------------------------

def test_dir_prints_the_root_from_option_or_environment(tmp_path):
    assert cachekit_cmd("dir", root=tmp_path / "a").stdout.strip() == str(tmp_path / "a")
    assert cachekit_cmd("dir", "--root", str(tmp_path / "b")).stdout.strip() == str(tmp_path / "b")
    result = cachekit_cmd("dir", script=True, env={"CACHEKIT_DIR": str(tmp_path / "c")})
    assert result.returncode == 0 and result.stdout.strip() == str(tmp_path / "c")


def test_python_dash_m_is_the_same_command_line(cache_root, three):
    via_m = subprocess.run([sys.executable, "-m", "cachekit", "--root", str(cache_root), "ls",
                            "--json"], capture_output=True, text=True, timeout=120)
    via_script = cachekit_cmd("ls", "--json", root=cache_root, script=True)
    assert via_m.returncode == via_script.returncode == 0
    assert json.loads(via_m.stdout) == json.loads(via_script.stdout)
    bad = subprocess.run([sys.executable, "-m", "cachekit", "frobnicate"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2


def test_help_and_usage_errors(cache_root):
    result = cachekit_cmd("--help", script=True)
    assert result.returncode == 0
    for command in ("dir", "ls", "info", "clear", "prune", "verify", "build", "demo"):
        assert command in result.stdout
    result = cachekit_cmd("ls", "--sort", "name", root=cache_root, script=True)
    assert result.returncode == 2 and result.stderr.startswith("cachekit: error: argument --sort")
    assert len(result.stderr.strip().splitlines()) == 1
    assert in_process("demo", "--help")[0] == 0
    for args in (["frobnicate"], [], ["prune"],
                 ["prune", "--max-size", "lots", "--yes"], ["clear", "--older-than", "7x", "--yes"],
                 ["build", "x.csv", "--column", "p", "--size", "3by3"],
                 ["build", "x.csv", "--column", "p", "--size", "8", "--workers", "0"],
                 ["demo", "--images", "-3"]):
        status, _, err = in_process(*args, root=cache_root)
        assert status == 2, args
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cachekit: error:"), err


@pytest.mark.parametrize("option, good, bad", [
    ("--size", {"8": (8, 8), "12x10": (12, 10), "12X10": (12, 10)},
     ("3by3", "0x8", "8x0", "0", "8x8x8", "x8", "8x", "\u00b2", "-8", "")),
    ("--workers", {"1": 1, "16": 16}, ("0", "-1", "1.5", "\u00b2", "two", "")),
])
def test_argument_types_accept_and_reject(cache_root, monkeypatch, option, good, bad):
    seen = {}
    monkeypatch.setattr("cachekit.cli.local.build",
                        lambda args: seen.setdefault("args", args) and 0)
    for text, value in good.items():
        seen.clear()
        status, _, err = in_process("build", "x.csv", "--column", "p", "--size", "8",
                                    option, text, root=cache_root)
        assert status == 0, err
        assert getattr(seen["args"], option[2:]) == value
    for text in bad:
        status, _, err = in_process("build", "x.csv", "--column", "p", "--size", "8",
                                    f"{option}={text}", root=cache_root)
        assert status == 2, text
        assert err.startswith(f"cachekit: error: argument {option}: ") and repr(text) in err, err
        assert err.count("\n") == 1, err


def test_import_and_ls_load_neither_torch_nor_pandas(cache_root, three):
    """Nor, for ``ls``, ``info`` and ``prune``, numpy, the remote tier or the build's
    modules: every module is start-up time that they pay on each run (numpy alone was about
    half of it), and they read and check each manifest without it."""
    probe = textwrap.dedent(f"""
        import sys
        import cachekit.cli
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "ls"]) == 0
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "ls", "--json"]) == 0
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "ls"]) == 0
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "info", {three[0].key!r}]) == 0
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "prune", "--max-size", "1M",
                                  "--dry-run"]) == 0
        unused = sorted(m for m in ("numpy", "cachekit.store.remote", "cachekit.cli.remote",
                                    "cachekit.admin.remote", "cachekit.admin.remote_clear",
                                    "cachekit.obtain",
                                    "cachekit.engine.running.executors", "fsspec")
                        if m in sys.modules)
        assert not unused, unused
        assert cachekit.cli.main(["--root", {str(cache_root)!r}, "verify"]) == 0
        heavy = sorted(m for m in ("torch", "pandas", "PIL", "torchvision") if m in sys.modules)
        assert not heavy, heavy
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# -- exit status ---------------------------------------------------------------------------

@pytest.mark.parametrize("error, status, message", [
    (KeyboardInterrupt(), 130, "cachekit: error: interrupted\n"),
    (BrokenPipeError(32, "Broken pipe"), 141, ""),
    (OSError(5, "Input/output error"), 1, "cachekit: error: [Errno 5] Input/output error\n"),
    (OSError(), 1, "cachekit: error: OSError\n"),
    (cachekit.CacheCorruptError("/r/entries/x", "bad\nsecond line"), 1,
     "cachekit: error: corrupt cache entry /r/entries/x: bad\n"),
    (ValueError("CACHEKIT_SOMETHING='x' is bad"), 2,
     "cachekit: error: CACHEKIT_SOMETHING='x' is bad\n"),
])
def test_exit_status_of_each_kind_of_error(cache_root, monkeypatch, error, status,
                                           message):
    def fail(layout):
        raise error

    monkeypatch.setattr("cachekit.admin.inspect.scan", fail)
    assert in_process("ls", root=cache_root) == (status, "", message)


@pytest.mark.parametrize("env", [{"CACHEKIT_LOCK": "bogus"}, {"CACHEKIT_LOCK_LEASE": "-1"}])
def test_a_bad_setting_is_a_usage_error_for_every_command(tmp_path, cache_root, cover_paths,
                                                          env):
    csv = write_csv(tmp_path / "train.csv", cover_paths[:2])
    name = next(iter(env))
    for args in (["ls"], ["verify"], ["clear", "--all", "--yes"],
                 ["build", str(csv), "--column", "img_path", "--size", "8"]):
        result = cachekit_cmd(*args, root=cache_root, env=env)
        assert result.returncode == 2 and result.stdout == "", (args, result)
        assert result.stderr.startswith(f"cachekit: error: {name}=") and \
            result.stderr.count("\n") == 1, result.stderr
    assert keys_in(cache_root) == set()


def test_closed_output_exits_141_quietly(cache_root, three):
    for args in (["ls"], ["ls", "--json"], ["verify"], ["info", three[0].key]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the command writes (`| head` that quit)
        try:
            result = subprocess.run([str(SCRIPT), "--root", str(cache_root), *args],
                                    stdout=write_end, stderr=subprocess.PIPE, text=True,
                                    timeout=120)
        finally:
            os.close(write_end)
        assert (result.returncode, result.stderr) == (141, ""), args


def test_ctrl_c_at_the_confirmation_exits_130_and_removes_nothing(cache_root, three):
    master, slave = pty.openpty()
    # A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored
    # across exec (Python then installs no KeyboardInterrupt handler). A handled one is
    # reset to the default, so the command gets Ctrl-C however pytest was started.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([str(SCRIPT), "--root", str(cache_root), "clear", "--all"],
                                stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        signal.signal(signal.SIGINT, previous)
        os.close(slave)
        asked, deadline = b"", time.monotonic() + 120
        while b"[y/N]" not in asked:
            assert proc.poll() is None and time.monotonic() < deadline, asked
            if select.select([proc.stderr], [], [], 0.1)[0]:
                asked += os.read(proc.stderr.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
        os.close(master)
    assert proc.returncode == 130
    assert err.decode().endswith("cachekit: error: interrupted\n") and b"Traceback" not in err
    assert b"removed" not in out and len(keys_in(cache_root)) == 3


# -- ls and info ---------------------------------------------------------------------------

def test_ls_on_an_empty_or_missing_root(tmp_path):
    result = cachekit_cmd("ls", root=tmp_path / "none")
    assert result.returncode == 0 and "no entries" in result.stdout
    assert json.loads(cachekit_cmd("ls", "--json", root=tmp_path / "none").stdout) == []


def test_ls_table_and_json(cache_root, three, cover_paths):
    images = cachekit.Cache(cache_root).images(pd.Series(cover_paths[:2], name="img_path"), 8)
    table = cachekit_cmd("ls", root=cache_root, script=True)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["KEY", "KIND", "ROWS", "SHAPE", "DTYPE", "OWN", "SHARED",
                                "CREATED", "LAST", "USED", "MADE", "WITH"]
    row = next(line for line in lines if line.startswith(images.key[:12]))
    assert "images" in row and "3x8x8" in row and "uint8" in row and "column img_path" in row
    assert "validate=path fit=stretch backend=tensor" in row  # what tells entries apart
    mapped = next(line for line in lines if line.startswith(three[0].key[:12]))
    assert re.search(r"\btest_cli\.block\b", mapped), mapped  # the function, by name
    assert any(line.startswith(three[0].key[:12]) and "5 min ago" in line for line in lines)
    assert lines[-1].startswith("4 entries,") and str(cache_root) in lines[-1]
    listed = json.loads(cachekit_cmd("ls", "--json", root=cache_root).stdout)
    assert {e["key"] for e in listed} == {images.key} | {e.key for e in three}
    first = next(e for e in listed if e["key"] == images.key)
    assert first["kind"] == "images" and first["rows"] == 2 and first["shape"] == [2, 3, 8, 8]
    assert first["dtype"] == "uint8" and first["path"] == str(images.path)
    assert first["bytes"] == entry_disk_bytes(images.path)
    assert isinstance(first["created"], float) and isinstance(first["last_used"], float)


@pytest.mark.parametrize("sort, order", [("used", [2, 1, 0]), ("created", [2, 1, 0]),
                                         ("size", None)])
def test_ls_sort(cache_root, three, sort, order):
    listed = json.loads(cachekit_cmd("ls", "--json", "--sort", sort, root=cache_root).stdout)
    if order is not None:
        assert [e["key"] for e in listed] == [three[i].key for i in order]
    else:
        sizes = [e["bytes"] for e in listed]
        assert sizes == sorted(sizes, reverse=True)


def test_ls_sort_size_puts_the_largest_first(cache_root):
    small = small_block_entry(cache_root, 0, rows=2)
    large = small_block_entry(cache_root, 10, rows=400)
    listed = json.loads(cachekit_cmd("ls", "--json", "--sort", "size", root=cache_root).stdout)
    assert [e["key"] for e in listed] == [large.key, small.key]


def test_ls_flags_a_broken_entry_and_goes_on(cache_root, three):
    (three[1].path / manifests.MANIFEST_FILE).write_text("{")
    result = cachekit_cmd("ls", root=cache_root)
    assert result.returncode == 0 and "PROBLEM: unreadable manifest" in result.stdout
    assert "3 entries" in result.stdout


def tiny_entry(root: Path) -> cachekit.Entry:
    return cachekit.Cache(root, progress=False).map(lambda v: np.full(3, v, np.uint8),
                                                    pd.Series([1, 2]))


def tamper(entry: cachekit.Entry, **fields) -> None:
    """Rewrite fields of ``entry``'s manifest, as someone sharing the cache root could."""
    path = entry.path / manifests.MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


CONTROLS = ("\x1b", "\x07", "\x9b", "\x00", "\x7f", "\r")


def test_text_from_manifests_reaches_the_terminal_escaped(cache_root):
    entry = tiny_entry(cache_root)
    tamper(entry, column="\x1b[31mred",
           params={"\x1b]0;title\x07": "\x1b[2J", "on_error": "raise"},
           builder={"pid": 1, "host": "\x1b[1Ahost\r"}, cachekit_version="1\x00\x7f",
           failed_rows=[[1, "\x1b[31mbad.jpg", "gone\x1b[0m\u00e9 \u4e2d"]])
    (cache_root / "entries" / "\x1b[32mjunk").write_text("")
    listing = cachekit_cmd("ls", root=cache_root)
    info = cachekit_cmd("info", entry.key[:6], root=cache_root, script=True)
    dry = cachekit_cmd("clear", "--all", "--dry-run", root=cache_root)
    for result in (listing, info, dry):
        assert result.returncode == 0, result.stderr
        assert not any(c in result.stdout + result.stderr for c in CONTROLS), result
    assert "column \\x1b[31mred" in listing.stdout
    assert "warning: " in listing.stderr and "\\x1b[32mjunk: not a cache entry" in listing.stderr
    assert "\ncolumn:" in info.stdout and " \\x1b[31mred\n" in info.stdout
    assert "on \\x1b[1Ahost\\x0d in" in info.stdout and "cachekit 1\\x00\\x7f" in info.stdout
    assert '\\x1b]0;title\\x07: "\\u001b[2J"' in info.stdout  # a params name; the value is JSON
    # (printable Unicode is kept)
    assert "failed row 1: \\x1b[31mbad.jpg: gone\\x1b[0m\u00e9 \u4e2d" in info.stdout
    listed = cachekit_cmd("ls", "--json", root=cache_root)
    assert not any(c in listed.stdout for c in CONTROLS)
    assert json.loads(listed.stdout)[0]["column"] == "\x1b[31mred"  # JSON escapes; intact
    raw = json.loads((entry.path / manifests.MANIFEST_FILE).read_text())
    tamper(entry, files=[{**raw["files"][0], "checksum": "\x1b[31mfake"}])
    verified = cachekit_cmd("verify", root=cache_root)
    assert verified.returncode == 1 and "bad checksum '\\x1b[31mfake'" in verified.stdout
    assert not any(c in verified.stdout + verified.stderr for c in CONTROLS)


def test_info_survives_a_builder_that_is_not_an_object(cache_root):
    entry = tiny_entry(cache_root)
    tamper(entry, builder="pid 1")
    result = cachekit_cmd("info", entry.key, root=cache_root)
    assert result.returncode == 0 and "built by" not in result.stdout


def test_info_names_the_processes_that_joined_the_build(cache_root):
    entry = tiny_entry(cache_root)
    assert "joined by" not in cachekit_cmd("info", entry.key, root=cache_root).stdout
    tamper(entry, builder={**entry.manifest["builder"], "joined": [
        {"host": "node7", "pid": 4243, "rows": 480}, {"host": "vm", "pid": 12, "rows": 3}]})
    result = cachekit_cmd("info", entry.key, root=cache_root)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^joined by: +pid 4243 on node7 \(480 rows\), pid 12 on vm \(3 rows\)$",
                     result.stdout, re.M), result.stdout
    tamper(entry, builder={"pid": 1, "host": "h", "joined": ["someone", {"pid": "x"}]})
    result = cachekit_cmd("info", entry.key, root=cache_root)  # any JSON may be there
    assert result.returncode == 0 and re.search(
        r"^joined by: +'someone', pid x on None \(None rows\)$", result.stdout, re.M), result


@pytest.mark.parametrize("created", [float("inf"), float("nan")])
def test_a_created_time_that_is_not_a_number_is_a_problem_not_a_crash(cache_root, created):
    entry = tiny_entry(cache_root)
    tamper(entry, created=created)  # (JSON gets Infinity and NaN as Python writes them)
    info = cachekit_cmd("info", entry.key, root=cache_root)
    assert info.returncode == 0 and "bad created time" in info.stdout, info
    listing = cachekit_cmd("ls", root=cache_root)
    assert listing.returncode == 0 and "PROBLEM: bad created time" in listing.stdout, listing


@pytest.mark.parametrize("created", [1e300, -1e300])
def test_ls_and_info_show_an_absurd_created_time_as_it_is(cache_root, created):
    entry = tiny_entry(cache_root)
    tamper(entry, created=created)  # (JSON gets Infinity and NaN as Python writes them)
    info = cachekit_cmd("info", entry.key, root=cache_root)
    assert info.returncode == 0, info.stderr
    lines = dict(line.split(":", 1) for line in info.stdout.splitlines()[:10])
    assert lines["created"].strip() == f"{created!r} (not a valid time)"
    assert re.search(r"\((just now|\d s ago)\)$", lines["last used"]), lines  # moments ago
    listing = cachekit_cmd("ls", root=cache_root)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith(entry.key[:12]))
    assert row.split()[7:9] == ["-", "?"], row  # shared: nothing; created: not a time
    # last used: a second may pass between the commands
    assert re.match(r"(just now|\d s ago)\s", " ".join(row.split()[9:]) + " "), row


def test_info_by_unique_prefix(cache_root, three):
    result = cachekit_cmd("info", three[0].key[:5], root=cache_root)
    assert result.returncode == 0
    assert "key:" in result.stdout and three[0].key in result.stdout
    assert "shape:" in result.stdout and "6x2x4 uint8" in result.stdout
    assert "data.npy:" in result.stdout and "blake2b-128:" in result.stdout and str(three[0].path) in result.stdout


def make_twin(cache_root: Path, entry: cachekit.Entry) -> Path:
    """A valid copy of ``entry`` under a key sharing its first 4 digits."""
    twin = cache_root / "entries" / (entry.key[:4] + "f" * 28)
    twin.mkdir()
    for item in entry.path.iterdir():
        (twin / item.name).write_bytes(item.read_bytes())
    manifest = json.loads((twin / manifests.MANIFEST_FILE).read_text())
    (twin / manifests.MANIFEST_FILE).write_text(json.dumps({**manifest, "key": twin.name}))
    return twin


def test_info_rejects_ambiguous_unknown_and_malformed_keys(cache_root, three):
    twin = make_twin(cache_root, three[0])
    result = cachekit_cmd("info", three[0].key[:4], root=cache_root)
    assert result.returncode == 2 and "ambiguous" in result.stderr
    assert three[0].key in result.stderr and twin.name in result.stderr
    assert in_process("info", three[0].key[:5], root=cache_root)[0] == 0
    result = cachekit_cmd("info", "../entries", root=cache_root)
    assert result.returncode == 2 and "not a cache key" in result.stderr
    for bad in ("ab/cd", "xyz", "..", three[0].key + "0", "", "-"):
        status, _, err = in_process("info", "--", bad, root=cache_root)
        assert status == 2 and "not a cache key" in err, bad
    missing = "0123" if not any(k.startswith("0123") for k in keys_in(cache_root)) else "fedc"
    status, _, err = in_process("info", missing, root=cache_root)
    assert status == 2 and "no cache entry matches" in err


@pytest.mark.parametrize("command", [["info"], ["clear", "--yes"], ["verify"]])
def test_every_command_taking_keys_rejects_bad_ones_alike(cache_root, three, command):
    make_twin(cache_root, three[0])
    missing = "0123" if not any(k.startswith("0123") for k in keys_in(cache_root)) else "fedc"
    for key, message in (("zz", "not a cache key or key prefix: 'zz'"),
                         (missing, f"no cache entry matches '{missing}'"),
                         (three[0].key[:4], f"key prefix '{three[0].key[:4]}' is ambiguous")):
        status, out, err = in_process(*command, "--", key, root=cache_root)
        assert status == 2 and out == "", (key, out)
        assert err.startswith(f"cachekit: error: {message}") and err.count("\n") == 1, err
    assert len(keys_in(cache_root)) == 4


# -- clear ---------------------------------------------------------------------------------

def test_clear_needs_a_selection_and_confirmation(cache_root, three):
    for args in (["clear", "--yes"], ["clear", three[0].key, "--all", "--yes"]):
        assert in_process(*args, root=cache_root)[0] == 2
    result = cachekit_cmd("clear", "--all", root=cache_root, script=True)  # not a terminal
    assert result.returncode == 2 and "--yes" in result.stderr
    assert len(keys_in(cache_root)) == 3


def test_clear_dry_run_removes_nothing(cache_root, three):
    result = cachekit_cmd("clear", "--all", "--dry-run", root=cache_root)
    assert result.returncode == 0 and "would remove 3 entries" in result.stdout
    assert all(e.key[:12] in result.stdout for e in three)
    assert len(keys_in(cache_root)) == 3


def test_clear_keys_by_prefix(cache_root, three):
    result = cachekit_cmd("clear", three[0].key[:6], three[2].key, "--yes", root=cache_root)
    assert result.returncode == 0 and "removed 2 entries" in result.stdout
    assert keys_in(cache_root) == {three[1].key}
    assert cachekit_cmd("clear", three[0].key, "--yes", root=cache_root).returncode == 2


def test_clear_older_than(cache_root, three):
    old = time.time() - 8 * DAY
    os.utime(three[1].path, (old, old))
    result = cachekit_cmd("clear", "--older-than", "7d", "--yes", root=cache_root)
    assert result.returncode == 0 and "removed 1 entry" in result.stdout
    assert keys_in(cache_root) == {three[0].key, three[2].key}
    result = cachekit_cmd("clear", "--older-than", "1w", "--yes", root=cache_root)
    assert "nothing to remove" in result.stdout and len(keys_in(cache_root)) == 2
    result = cachekit_cmd("clear", "--all", "--older-than", "250s", "-y", root=cache_root)
    assert keys_in(cache_root) == {three[2].key}


def test_clear_all(cache_root, three):
    result = cachekit_cmd("clear", "--all", "--yes", root=cache_root, script=True)
    assert result.returncode == 0 and "removed 3 entries" in result.stdout
    assert keys_in(cache_root) == set()
    assert list((cache_root / "tmp").iterdir()) == []


def run_on_terminal(args: list[str], answer: bytes) -> subprocess.CompletedProcess:
    """Run the console script with a pseudo-terminal as stdin, typing ``answer``."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([str(SCRIPT), *args], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        os.close(slave)
        os.write(master, answer)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_clear_asks_on_a_terminal(cache_root, three):
    declined = run_on_terminal(["--root", str(cache_root), "clear", "--all"], b"n\n")
    assert declined.returncode == 0 and "[y/N]" in declined.stderr
    assert "nothing removed" in declined.stdout and len(keys_in(cache_root)) == 3
    accepted = run_on_terminal(["--root", str(cache_root), "clear", three[0].key[:8]], b"y\n")
    assert accepted.returncode == 0 and "removed 1 entry" in accepted.stdout
    assert len(keys_in(cache_root)) == 2


def test_a_reader_that_mapped_an_entry_keeps_reading_after_clear(cache_root):
    entry = small_block_entry(cache_root, 7, rows=300)
    view = entry.array  # mapped by this process before another process clears the cache
    assert cachekit_cmd("clear", "--all", "--yes", root=cache_root).returncode == 0
    assert not entry.path.exists() and keys_in(cache_root) == set()
    np.testing.assert_array_equal(view, np.stack([block(v) for v in range(7, 307)]))


def test_clear_all_while_another_process_builds(tmp_path, cache_root):
    other = small_block_entry(cache_root, 500)
    proc, go = start_gated_builder(tmp_path, cache_root)
    try:
        listing = cachekit_cmd("ls", root=cache_root)
        assert "build in progress:" in listing.stderr and f"pid {proc.pid}" in listing.stderr
        result = cachekit_cmd("clear", "--all", "--yes", root=cache_root)
        assert result.returncode == 0, result.stderr
        assert "removed 1 entry" in result.stdout
        assert f"being built by pid {proc.pid}" in result.stdout
        assert keys_in(cache_root) == set() and other.key not in keys_in(cache_root)
        pruned = cachekit_cmd("prune", "--max-size", "0", "--yes", root=cache_root)
        assert pruned.returncode == 0 and f"being built by pid {proc.pid}" in pruned.stdout
    finally:
        go.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    key = out.strip()
    assert keys_in(cache_root) == {key}
    assert cachekit_cmd("verify", root=cache_root).returncode == 0
    entry = cachekit.Cache(cache_root).entries()[0]
    data = manifests.read(entry.path).files[0].open(entry.path)
    np.testing.assert_array_equal(data, np.repeat(np.arange(GATED_ROWS)[:, None], 8, axis=1))


# -- prune ---------------------------------------------------------------------------------

def test_prune_removes_the_least_recently_used_first(cache_root, three):
    sizes = {e.key: e.bytes for e in cachekit.Cache(cache_root).entries()}
    keep_two = sizes[three[1].key] + sizes[three[2].key]
    dry = cachekit_cmd("prune", "--max-size", str(keep_two), "--dry-run", root=cache_root)
    assert dry.returncode == 0 and "would remove 1 entry" in dry.stdout
    assert three[0].key[:12] in dry.stdout and len(keys_in(cache_root)) == 3
    assert cachekit_cmd("prune", "--max-size", str(keep_two), root=cache_root).returncode == 2
    result = cachekit_cmd("prune", "--max-size", str(keep_two), "--yes", root=cache_root,
                          script=True)
    assert result.returncode == 0 and "removed 1 entry" in result.stdout
    assert keys_in(cache_root) == {three[1].key, three[2].key}
    keep_one = str(sizes[three[2].key])  # (a per-row entry's data start on a 4 KiB page)
    result = cachekit_cmd("prune", "--max-size", keep_one, "--yes", root=cache_root)
    assert keys_in(cache_root) == {three[2].key}
    result = cachekit_cmd("prune", "--max-size", "10G", "--yes", root=cache_root)
    assert result.returncode == 0 and "nothing to remove" in result.stdout


# -- verify --------------------------------------------------------------------------------

def test_verify_passes_a_healthy_cache_and_fails_on_a_flipped_byte(cache_root, three):
    healthy = cachekit_cmd("verify", root=cache_root, script=True)
    assert healthy.returncode == 0 and "3 entries verified, no problems" in healthy.stdout
    data = three[1].path / manifests.DATA_FILE
    with open(data, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x01]))
    result = cachekit_cmd("verify", root=cache_root, script=True)
    assert result.returncode == 1
    assert f"{three[1].key}: checksum mismatch in data.npy" in result.stdout
    assert "1 problem in 3 entries" in result.stdout
    assert cachekit_cmd("verify", three[0].key[:6], three[2].key, root=cache_root).returncode == 0
    assert cachekit_cmd("verify", three[1].key[:6], root=cache_root).returncode == 1
    assert cachekit_cmd("verify", "zz", root=cache_root).returncode == 2


# -- build ---------------------------------------------------------------------------------

def write_csv(path: Path, paths: list[str]) -> Path:
    pd.DataFrame({"img_path": paths, "label": range(len(paths))}).to_csv(path, index=False)
    return path


def test_build_prints_the_key_that_training_code_will_hit(tmp_path, cache_root, cover_paths):
    csv = write_csv(tmp_path / "train.csv", cover_paths[:4])
    result = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "12x10",
                          root=cache_root, script=True)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert "built: 4 rows 4x3x12x10 uint8" in result.stderr
    entry = cachekit.Cache(cache_root).images(pd.read_csv(csv)["img_path"], (12, 10))
    assert entry.hit and entry.key == key
    again = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "12x10",
                         root=cache_root)
    assert again.stdout.strip() == key and "already cached" in again.stderr


def test_build_and_ls_report_one_size_for_one_entry(tmp_path, cache_root, cover_paths):
    csv = write_csv(tmp_path / "train.csv", cover_paths)
    built = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "32x32",
                         "--backend", "pil", root=cache_root)  # pil: no torch to import
    assert built.returncode == 0, built.stderr
    (listed,) = json.loads(cachekit_cmd("ls", "--json", root=cache_root).stdout)
    size = units.format_size(listed["bytes"])
    assert listed["bytes"] > 12 * 3 * 32 * 32  # the data, its header and the manifest
    assert f"built: 12 rows 12x3x32x32 uint8, {size}" in built.stderr, built.stderr
    table = cachekit_cmd("ls", root=cache_root).stdout
    assert re.search(rf"^{listed['key'][:12]} .* {re.escape(size)} ", table, re.M), table
    info = cachekit_cmd("info", listed["key"], root=cache_root).stdout
    assert f"{size} ({listed['bytes']} bytes)" in info


def test_a_root_that_is_a_file_is_one_line_of_error(tmp_path):
    file = tmp_path / "cache"
    file.write_text("not a directory")
    result = cachekit_cmd("ls", root=file)
    assert result.returncode == 1 and result.stderr == (
        f"cachekit: error: cache root {file} exists and is not a directory; give "
        "Cache(root) (or --root, or CACHEKIT_DIR) a directory, or a path where one can be "
        "made\n")


def test_build_passes_every_option(tmp_path, cache_root, cover_paths):
    csv = write_csv(tmp_path / "train.csv", cover_paths[:3])
    result = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "9",
                          "--mode", "L", "--fit", "crop", "--resample", "nearest",
                          "--workers", "1", "--on-error", "zero", "--validate", "stat",
                          "--draft", "--backend", "pil", root=cache_root)
    assert result.returncode == 0, result.stderr
    entry = cachekit.Cache(cache_root).images(
        pd.read_csv(csv)["img_path"], 9, mode="L", fit="crop", resample="nearest",
        on_error="zero", validate="stat", draft=True, backend="pil")
    assert entry.hit and entry.key == result.stdout.strip()
    assert entry.array.shape == (3, 1, 9, 9)


def test_build_takes_the_backend(tmp_path, cache_root, cover_paths):
    csv = write_csv(tmp_path / "train.csv", cover_paths[:3])
    keys = {}
    for backend in ("pil", "tensor"):
        result = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "9",
                              "--backend", backend, root=cache_root)
        assert result.returncode == 0, result.stderr
        entry = cachekit.Cache(cache_root).images(pd.read_csv(csv)["img_path"], 9,
                                                  backend=backend)
        assert entry.hit and entry.key == result.stdout.strip()
        keys[backend] = entry.key
    assert keys["pil"] != keys["tensor"]
    refused = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "9",
                           "--backend", "cuda", root=cache_root)
    assert refused.returncode == 2 and "invalid choice: 'cuda'" in refused.stderr


def test_a_failed_build_lists_the_bad_rows_and_publishes_no_entry(tmp_path, cache_root,
                                                                   cover_paths):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    csv = write_csv(tmp_path / "train.csv",
                    [cover_paths[0], str(tmp_path / "missing.jpg"), cover_paths[1], str(broken)])
    # pil: no torch to import in the child (the failure list is the backends' common code)
    result = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "8x8",
                          "--backend", "pil", root=cache_root)
    assert result.returncode == 1 and result.stdout == ""
    assert "2 row(s) could not be decoded" in result.stderr
    assert f"row 1: {tmp_path / 'missing.jpg'}" in result.stderr
    assert f"row 3: {broken}" in result.stderr
    assert keys_in(cache_root) == set()  # (its kept rows are no entry)
    zeroed = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "8x8",
                          "--on-error", "zero", "--backend", "pil", root=cache_root)
    assert zeroed.returncode == 0 and "2 failed rows stored as zeros" in zeroed.stderr
    assert keys_in(cache_root) == {zeroed.stdout.strip()}


@pytest.mark.parametrize("column, reason", [
    (["{0}", None], "column 'img_path' of {csv} is empty on line(s) 3: give each of those "
                    "rows an image path, or delete those lines"),
    ([1, 2], "column 'img_path' of {csv} holds int64 values, not image paths (line 2: 1); "
             "pick the column of paths with --column"),
    ([], "{csv} has a header but no rows: add one line per image, with its path in column "
         "'img_path'"),
])
def test_a_column_that_holds_no_paths_is_a_usage_error_in_words_of_the_csv(
        tmp_path, cache_root, cover_paths, column, reason):
    csv = tmp_path / "train.csv"
    column = [cover_paths[0] if c == "{0}" else c for c in column]
    pd.DataFrame({"img_path": pd.Series(column, dtype=object)}).to_csv(csv, index=False)
    result = cachekit_cmd("build", str(csv), "--column", "img_path", "--size", "8",
                          root=cache_root)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"cachekit: error: {reason.format(csv=csv)}\n"
    assert "astype" not in result.stderr and "dropna" not in result.stderr
    assert keys_in(cache_root) == set()


def test_a_negative_size_is_refused_in_its_own_words(cache_root):
    result = cachekit_cmd("prune", "--max-size", "-5G", root=cache_root)
    assert result.returncode == 2
    assert "a size must not be negative: '-5G'" in result.stderr


def test_prune_answers_in_the_unit_it_was_given(cache_root):
    result = cachekit_cmd("prune", "--max-size", "300M", "--yes", root=cache_root)
    assert result.returncode == 0 and "at most 300 MB" in result.stdout + result.stderr


def test_build_usage_errors(tmp_path, cache_root, cover_paths):
    csv = write_csv(tmp_path / "train.csv", cover_paths[:1])
    result = cachekit_cmd("build", str(csv), "--column", "path", "--size", "8", root=cache_root)
    assert result.returncode == 2 and "img_path" in result.stderr
    status, _, err = in_process("build", str(tmp_path / "nope.csv"), "--column",
                                "img_path", "--size", "8", root=cache_root)
    assert status == 2 and "nope.csv" in err
    status, _, err = in_process("build", str(csv), "--column", "img_path", "--size",
                                "8", "--mode", "CMYK", root=cache_root)
    assert status == 2 and "--mode" in err
    assert keys_in(cache_root) == set()


def test_ls_tells_apart_entries_of_one_column(cache_root, cover_paths):
    """Entries that differ only by validate, fit or backend, or by the function and version
    of map: each row says which (issue 43)."""
    cache = cachekit.Cache(cache_root, progress=False)
    column = pd.Series(cover_paths[:2], name="img_path")
    a = cache.images(column, 8, backend="pil")
    b = cache.images(column, 8, backend="pil", validate="stat")
    c = cache.images(column, 8, fit="crop", on_error="zero")
    d = cache.map(block, pd.Series(range(2)), version="7")
    lines = cachekit_cmd("ls", root=cache_root).stdout.splitlines()

    def row(entry):
        return next(line for line in lines if line.startswith(entry.key[:12]))

    assert "validate=path fit=stretch backend=pil" in row(a)
    assert "validate=stat fit=stretch backend=pil" in row(b)
    assert "validate=path fit=crop backend=pil on_error=zero" in row(c)
    assert re.search(r"test_cli\.block version=7", row(d))
