"""A budget for the root (issue 42, its first part): ``Cache(max_size=...)`` or
``$CACHEKIT_MAX_SIZE``. After each commit the least recently used entries go until the
root fits; never the entry the call returns, and a process that hits an entry as it is
evicted obtains it again (a rebuild), never fails."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from typing import Iterator

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.cli.main import main as cli_main
from cachekit.units import format_size


def _column(start: int) -> pd.Series:
    return pd.Series(range(start, start + 200))


def _row(v: int) -> np.ndarray:
    return np.full(1000, v % 251, np.uint8)  # 1,000 bytes a row: 200 KB an entry


def _root_bytes(root) -> int:
    return sum(e.bytes for e in cachekit.Cache(root).entries())


def test_each_commit_keeps_the_root_within_its_budget_least_recently_used_first(tmp_path,
                                                                                 capsys):
    cache = cachekit.Cache(tmp_path, max_size="500K", workers=1)  # two entries of ~209 KB
    first = cache.map(_row, _column(0)).path  # the Entry let go: the entry is not in use
    cache.map(_row, _column(1000))
    os.utime(first, (time.time() + 5, time.time() + 5))  # first is used more recently
    third = cache.map(_row, _column(2000))
    keys = {e.key for e in cache.entries()}
    assert keys == {first.name, third.key}  # second, the least recently used, went
    assert _root_bytes(tmp_path) <= 500_000
    assert "cache budget 500 KB: removed 1 least recently used entry" in capsys.readouterr().err
    np.testing.assert_array_equal(third.array[5], _row(2005))


def test_a_build_has_room_made_for_its_rows_before_it_writes_them_keeping_its_donors(
        tmp_path, capsys):
    """Entries A and B (about 210 KB each, A the least recently used), a 450 KB budget, and a
    column of A's 200 rows and 100 new ones: room for the 100 KB it writes is made before
    the build writes them. A lends its rows, so B goes, although A was used longer ago."""
    cache = cachekit.Cache(tmp_path, max_size="450K", workers=1)
    lender = cache.map(_row, _column(0)).path
    other = cache.map(_row, _column(1000)).path
    os.utime(lender, (time.time() - 5, time.time() - 5))
    capsys.readouterr()
    grown = cache.map(_row, pd.Series(range(300)))
    said = capsys.readouterr().err
    assert re.search(r"removed 1 least recently used entry \(\d+ KB\) to make room for the "
                     f"100 KB entry {grown.key[:12]} is about to write", said), said
    assert not other.exists() and (grown.rows_decoded, grown.rows_reused) == (100, 200)
    np.testing.assert_array_equal(np.asarray(grown.array), np.stack([_row(v) for v in range(300)]))


def test_a_build_whose_shared_rows_cannot_be_linked_has_room_made_for_its_copy(
        tmp_path, capsys, monkeypatch):
    """As above, but the lender's files cannot be linked here (another user's files, say):
    the build copies all 300 rows, and room is made for those before it writes them, not
    only for the 100 it expected to decode."""
    from cachekit import _fs

    cache = cachekit.Cache(tmp_path, max_size="700K", workers=1)
    lender = cache.map(_row, _column(0)).path
    other = cache.map(_row, _column(1000)).path
    os.utime(lender, (time.time() - 5, time.time() - 5))
    monkeypatch.setattr(_fs.DirHandle, "link_open_file", lambda self, f, name: False)
    capsys.readouterr()
    grown = cache.map(_row, pd.Series(range(300)))
    said = capsys.readouterr().err
    assert re.search(r"removed 1 least recently used entry \(\d+ KB\) to make room for the "
                     f"300 KB entry {grown.key[:12]} is about to write", said), said
    assert grown.contiguous and lender.exists() and not other.exists()
    np.testing.assert_array_equal(np.asarray(grown.array), np.stack([_row(v) for v in range(300)]))


def test_room_is_made_for_a_write_of_one_percent_of_the_budget_or_more(tmp_path):
    """A smaller write goes ahead without a scan of the root (which costs more than it):
    the commit's own check then keeps the budget."""
    from cachekit.admin.budget import ROOM_SHARE, make_room
    from cachekit.store import LocalStore

    old = cachekit.Cache(tmp_path, workers=1).map(_row, _column(0)).path
    budget = _root_bytes(tmp_path) + 1000  # any write of over 1,000 bytes is over it
    small = math.ceil(budget * ROOM_SHARE) - 1
    make_room(LocalStore(tmp_path), budget, small, ["0" * 32])
    assert old.exists()
    make_room(LocalStore(tmp_path), budget, small + 1, ["0" * 32])
    assert not old.exists()


def test_a_memoized_result_has_room_made_before_it_is_written(tmp_path, capsys):
    cache = cachekit.Cache(tmp_path, max_size="300K", workers=1)
    old = cache.map(_row, _column(0)).path  # about 210 KB, let go

    @cache.memoize
    def table(n: int) -> np.ndarray:
        return np.zeros((n, 1000), np.uint8)

    capsys.readouterr()
    assert table(150).shape == (150, 1000)
    said = capsys.readouterr().err
    assert f"to make room for the 150 KB entry {table.cache_key(150)[:12]} is about to write" \
        in said and not old.exists(), said


def test_a_column_that_repeats_files_has_room_made_for_each_file_once(tmp_path, capsys):
    """20 rows naming 10 files, each on two rows: the build writes 10 rows (the repeats
    point at them), so it asks room for 10 rows' bytes before it writes, not 20."""
    from helpers import write_pictures

    pictures = write_pictures(tmp_path / "pictures", 30)
    row = 3 * 64 * 64
    cache = cachekit.Cache(tmp_path / "root", max_size=25 * row, workers=1)
    old = cache.images(pd.Series(pictures[:20]), 64).path  # 20 rows, let go
    capsys.readouterr()
    twice = cache.images(pd.Series([p for p in pictures[20:] for _ in range(2)]), 64)
    said = capsys.readouterr().err
    assert f"to make room for the {format_size(10 * row)} entry {twice.key[:12]} is about " \
           "to write" in said and not old.exists(), said
    assert len(twice) == 20 and twice.rows_decoded == 10


@pytest.mark.parametrize("progress", [True, False])
def test_an_entry_larger_than_the_budget_is_returned_and_said(tmp_path, capsys, monkeypatch,
                                                              progress):
    """The line is a warning: a quiet call (``progress=False``) says it too, as the root
    is left over the budget the user set."""
    monkeypatch.setenv("CACHEKIT_MAX_SIZE", "100K")
    cache = cachekit.Cache(tmp_path, workers=1, progress=progress)
    assert cache.max_size == 100_000
    entry = cache.map(_row, _column(0))
    [listed] = cache.entries()
    assert len(entry) == 200 and listed.key == entry.key
    # the size said is the one `cachekit ls` shows: every file of the entry, not its data alone
    assert f"entry {entry.key[:12]} alone ({format_size(listed.bytes)}) is larger than the " \
           "cache budget of 100 KB; it is returned all the same" in capsys.readouterr().err


def test_a_fold_larger_than_the_budget_is_said_in_one_line_while_others_are_held(tmp_path,
                                                                                 capsys):
    """A fold links the file of its full entry, which alone exceeds the budget, and this
    process holds the full entry and an earlier fold. The root could not fit whatever else
    went: one line says so, the bytes held included (a second line warned of the entries
    held, as if letting go of them would make the root fit)."""
    cache = cachekit.Cache(tmp_path, workers=1, progress=False)
    full = cache.map(_row, _column(0), version="1")  # (rows are shared under a version)
    first = cache.map(_row, _column(0).iloc[::2], version="1")
    capsys.readouterr()
    budget = cachekit.Cache(tmp_path, max_size="100K", workers=1, progress=False)
    fold = budget.map(_row, _column(0).iloc[1::2], version="1")
    assert not fold.contiguous and {full.key, first.key} <= {e.key for e in cache.entries()}
    said = [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines()
            if "100 KB" in line]
    root = format_size(sum(size for _, _, size in {f for e in cache.entries()
                                                   for f in e.files}))
    [listed] = [e for e in cache.entries() if e.key == fold.key]
    assert said == [f"entry {fold.key[:12]} alone ({format_size(listed.bytes)}) is "
                    "larger than the cache budget of 100 KB; it is returned all the same; the "
                    f"root holds {root}, with 2 entries live processes use"], said


def test_a_bad_budget_is_refused(tmp_path, monkeypatch):
    with pytest.raises(cachekit.InvalidArgument, match="must not be negative"):
        cachekit.Cache(tmp_path, max_size="-5G")
    with pytest.raises(cachekit.InvalidArgumentType):
        cachekit.Cache(tmp_path, max_size=1.5)
    monkeypatch.setenv("CACHEKIT_MAX_SIZE", "lots")
    with pytest.raises(cachekit.InvalidArgument, match="CACHEKIT_MAX_SIZE"):
        cachekit.Cache(tmp_path)


READER = textwrap.dedent('''
    import sys, time
    import numpy as np, pandas as pd
    import cachekit
    from test_budget import _column, _row
    root, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
    calls = rebuilt = 0
    while time.monotonic() < deadline:
        entry = cachekit.Cache(root, workers=1, progress=False).map(_row, _column(0))
        rebuilt += calls > 0 and entry.outcome in ("built", "joined", "waited")
        assert np.array_equal(np.asarray(entry.array[7]), _row(7)), "wrong bytes"
        calls += 1
        del entry  # let go: until the next call, a budget may evict it
        time.sleep(0.01)
    print(calls, rebuilt)
''')


def test_readers_of_an_entry_never_fail_while_builders_evict_it(tmp_path):
    """Two processes keep reading one entry, letting it go between calls, while this one
    builds new entries under a budget that fits one: a commit between two calls evicts
    the readers' entry; the next call obtains it again (a rebuild) and reads the right
    bytes, never an error."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    root = tmp_path / "root"
    readers = [subprocess.Popen([sys.executable, str(script), str(root), "6"], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    builder = cachekit.Cache(root, max_size="250K", workers=1, progress=False)
    built = 0
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        builder.map(_row, _column(10_000 + 1000 * built))
        built += 1
    rebuilds = []
    outs = [reader.communicate(timeout=120) for reader in readers]  # none left running
    for reader, (out, err) in zip(readers, outs):
        assert reader.returncode == 0, err
        calls, rebuilt = map(int, out.split()[-2:])
        assert calls > 0
        rebuilds.append(rebuilt)
    # the readers' entry was evicted between their calls at least once (an entry used
    # between the eviction's listing and its removal is left alone, as prune leaves it)
    assert built > 2 and sum(rebuilds) >= 1


HOLDER = textwrap.dedent('''
    import sys, time
    import cachekit
    from test_budget import _column, _row
    entry = cachekit.Cache(sys.argv[1], workers=1, progress=False).map(_row, _column(0))
    print(entry.key, flush=True)
    time.sleep(600)  # holding the entry, until killed
''')


def _env() -> dict[str, str]:
    """The environment in which a child process imports this module as ``test_budget``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)),
         os.environ.get("PYTHONPATH", "")])}


@contextlib.contextmanager
def _holding(root) -> Iterator[tuple[subprocess.Popen, str]]:
    """Another process that made the entry of ``_column(0)`` in ``root`` and holds it (its
    ``Entry`` lives) until the block ends; then it is SIGKILLed, and the kernel drops its
    hold with it."""
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], env=_env(),
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            key = holder.stdout.readline().strip()
            assert key, "the holder made no entry"
            yield holder, key
        finally:
            holder.kill()


def test_an_entry_a_live_process_holds_is_left_by_budgets_and_prune_until_it_dies(
        tmp_path, capsys):
    """Another process made an entry and holds it (its ``Entry`` lives). Commits under a
    budget that fits one entry evict everything else but leave it, and say so; ``ls``
    (``--json`` too) and ``info`` mark it in use, and ``prune`` lists it as skipped for
    that. Once that process is SIGKILLed, the kernel drops its hold and the next commit
    evicts it."""
    root = tmp_path / "root"
    with _holding(root) as (holder, key):
        held = os.stat(root / "entries" / key)
        builder = cachekit.Cache(root, max_size="250K", workers=1)
        for i in range(3):
            last = builder.map(_row, _column(10_000 + 1000 * i)).key
        assert {e.key for e in builder.entries()} == {key, last}
        assert os.stat(root / "entries" / key).st_ino == held.st_ino
        assert "cache budget 250 KB: the root holds 4" in capsys.readouterr().err
        assert cli_main(["--root", str(root), "ls"]) == 0
        marked = [line.split()[0] for line in capsys.readouterr().out.splitlines()
                  if line.endswith("in use")]
        assert marked == [key[:12]]
        assert cli_main(["--root", str(root), "ls", "--json"]) == 0
        assert {e["key"]: e["in_use"] for e in json.loads(capsys.readouterr().out)} == {
            key: True, last: False}
        assert cli_main(["--root", str(root), "info", key[:12]]) == 0
        assert f"in use:      by pid {holder.pid} (python" in capsys.readouterr().out
        assert cli_main(["--root", str(root), "prune", "--max-size", "0", "--dry-run"]) == 0
        said = capsys.readouterr()
        assert f"skipping {key}: in use by a live process (pid {holder.pid} (python" in \
            said.out + said.err
        report = builder.prune(0)
        assert [e.key for e in report.removed_entries] == [last]
        assert [(s.key, s.reason) for s in report.skipped] == [
            (key, "in use by a live process")]
    builder.map(_row, _column(20_000))
    assert key not in {e.key for e in builder.entries()}


def test_a_budget_warns_of_entries_in_use_only_when_they_leave_the_root_over_it(
        tmp_path, capsys):
    """Another process holds the least recently used entry. Under a budget that two
    entries fit, a quiet call's commit passes over it, evicts the next one, and the root
    fits: nothing to warn of. Under a budget that fits one, the root stays over it for the
    held entry: a warning, which a quiet call says too."""
    root = tmp_path / "root"
    with _holding(root) as (holder, key):
        quiet = cachekit.Cache(root, max_size="500K", workers=1, progress=False)
        second = quiet.map(_row, _column(10_000)).key
        quiet.map(_row, _column(11_000))
        assert second not in {e.key for e in quiet.entries()}  # evicted in the held one's place
        assert key in {e.key for e in quiet.entries()}
        assert "cache budget" not in capsys.readouterr().err
        quiet = cachekit.Cache(root, max_size="250K", workers=1, progress=False)
        quiet.map(_row, _column(12_000))
        said = capsys.readouterr().err
        assert "cache budget 250 KB: the root holds 4" in said
        assert "live processes use 1 entry (" in said
        assert "of it, kept until no process holds it" in said


def test_spawn_workers_of_a_later_epoch_read_the_entry_another_process_budget_would_evict(
        tmp_path):
    """A DataLoader with ``spawn`` workers, not persistent: each epoch's worker is sent
    the entry anew. Between two epochs another process commits under a budget that
    fits only its own entry; the entry this process holds stays, and the second epoch
    reads every row (it raised "the entry was removed" when the budget evicted it)."""
    import torch
    from torch.utils.data import DataLoader

    root = tmp_path / "root"
    entry = cachekit.Cache(root, workers=1, progress=False).map(_row, _column(0))
    loader = DataLoader(entry.dataset(), batch_size=64, num_workers=1,
                        multiprocessing_context="spawn")
    want = torch.from_numpy(np.stack([_row(v) for v in range(200)]))
    assert torch.equal(torch.cat(list(loader)), want)
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f'''
        import cachekit
        from test_budget import _column, _row
        cachekit.Cache({str(root)!r}, max_size="250K", workers=1).map(_row, _column(5000))
    ''')], env=_env(), capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    assert "live processes use 1 entry" in other.stderr
    assert torch.equal(torch.cat(list(loader)), want)


def test_the_bytes_held_entries_keep_count_the_files_they_share(tmp_path, capsys):
    """A fold shares its rows' file with the full entry: held, the two keep the whole
    file, which is what the warning counts (it counted each entry's own bytes: a few KB
    for a fold that holds no row of its own)."""
    cache = cachekit.Cache(tmp_path, max_size="250K", workers=1, progress=False)
    full = cache.map(_row, _column(0), version="1")  # (rows are shared under a version)
    fold = cache.map(_row, _column(0).iloc[::2], version="1")
    assert not fold.contiguous
    capsys.readouterr()
    cache.map(_row, _column(5000))
    held = [e for e in cache.entries() if e.key in (full.key, fold.key)]
    shared = format_size(sum(size for _, _, size in {f for e in held for f in e.files}))
    said = capsys.readouterr().err
    assert (f"live processes use 2 entries ({shared}, the files they share with others "
            "included) of it") in said, said
