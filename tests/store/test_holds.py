"""Holds (cachekit.store.holds): an entry a live process uses is one that a removal of
unused entries cannot lock; the hold goes with its last descriptor, a forked child's
included, and a process holds at most MAX_HOLDS entries at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from cachekit import _fs
from cachekit.store import holds


def _free(entries: Path, key: str) -> bool:
    with _fs.DirHandle.open(entries) as folder, holds.unheld(folder, key) as free:
        return free


def test_a_hold_keeps_an_entry_in_use_until_it_is_closed(tmp_path):
    (tmp_path / "KEY").mkdir()
    assert _free(tmp_path, "KEY")
    taken = holds.hold(tmp_path / "KEY")
    assert taken is not None and not _free(tmp_path, "KEY")
    assert holds.holders(tmp_path / "KEY") == [os.getpid()]  # as `cachekit info` names it
    again = holds.hold(tmp_path / "KEY")  # a second Entry of the same entry shares it
    assert again is not None
    taken.close()
    assert not _free(tmp_path, "KEY")
    del again  # collected: released
    assert _free(tmp_path, "KEY") and holds.holders(tmp_path / "KEY") == []
    assert _free(tmp_path, "GONE")  # nothing to hold back a removal that finds nothing


def test_a_forked_child_keeps_the_hold_its_parent_let_go_until_it_ends(tmp_path):
    (tmp_path / "KEY").mkdir()
    taken = holds.hold(tmp_path / "KEY")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a DataLoader worker forked from the process that holds the entry
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        taken.close()
        assert not _free(tmp_path, "KEY")  # the child's inherited descriptor holds it
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(write)
    assert _free(tmp_path, "KEY")


def test_a_process_holds_at_most_max_holds_entries_at_once_and_says_so_once(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(holds, "MAX_HOLDS", holds._count + 3)
    monkeypatch.setattr(holds, "_said_full", False)
    for name in "abcde":
        (tmp_path / name).mkdir()
    taken = [holds.hold(tmp_path / name) for name in "abc"]
    assert None not in taken and "holds" not in capsys.readouterr().err
    assert holds.hold(tmp_path / "d") is None and _free(tmp_path, "d")
    assert holds.hold(tmp_path / "e") is None
    said = [line for line in capsys.readouterr().err.splitlines() if "are not held" in line]
    assert len(said) == 1 and f"holds {holds.MAX_HOLDS} entries" in said[0] \
        and " d and the others" in said[0]
    taken.pop().close()
    assert holds.hold(tmp_path / "d") is not None


def test_a_script_that_keeps_entries_in_globals_ends_without_a_word(tmp_path, cover_paths):
    """An Entry (and its Dataset) left in a script's globals is released at exit, with
    torch imported too, which makes its module's names go before the Entry does."""
    root = tmp_path / "cache"
    script = (
        "import torch, cachekit\n"
        f"cache = cachekit.Cache({str(root)!r}, progress=False)\n"
        f"full = cache.images({cover_paths!r}, size=8)\n"
        f"fold = cache.images({cover_paths[3:]!r}, size=8)  # a derived entry\n"
        "dataset = fold.dataset()\n"
        "assert not fold.contiguous and len(dataset) == 9\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stderr) == (0, "")
