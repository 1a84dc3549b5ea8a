"""Holds (cachekit.store.holds): an entry a live process uses is one that a removal of
unused entries cannot lock; the hold goes with its last descriptor, a forked child's
included, and a process holds at most MAX_HOLDS entries at once; other machines see a hold
by its beating record (cachekit.store.hold_records)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cachekit
import hosts
from cachekit import _fs
from cachekit.store import hold_records, holds


def _free(entries: Path, key: str) -> bool:
    with _fs.DirHandle.open(entries) as folder, holds.unheld(folder, key) as free:
        return free


def _named(records: Path) -> list[Path]:
    """The records in the folder ``records`` (none while it is missing), without one
    being written (its name starts with a dot until it is whole)."""
    return [p for p in records.iterdir() if not p.name.startswith(".")] \
        if records.exists() else []


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


def test_a_hold_kept_past_a_quarter_lease_shows_in_a_beating_record_until_let_go(
        tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "4")  # a beat a second
    (tmp_path / "entries" / "KEY").mkdir(parents=True)
    records = tmp_path / hold_records.FOLDER
    taken = holds.hold(tmp_path / "entries" / "KEY")
    assert not records.exists()  # a hit writes nothing
    (record,) = hosts.wait_for(lambda: _named(records),
                               timeout=30, what="the record")
    assert record.name.startswith("KEY.") and json.loads(record.read_text())["pid"] == os.getpid()
    written = record.stat().st_mtime
    hosts.wait_for(lambda: record.stat().st_mtime > written, timeout=30, what="a beat")
    record.unlink()  # as a removal does that takes it for a dead one, or a group member
    (record,) = hosts.wait_for(lambda: _named(records), timeout=30,
                               what="the record written again")
    child = os.fork()
    if child == 0:  # a forked DataLoader worker lets its copy of the hold go
        taken.close()
        os._exit(0)
    os.waitpid(child, 0)
    assert record.exists()  # the parent's, which it still holds
    taken.close()
    assert _named(records) == []


def test_a_root_removed_under_a_holder_is_not_made_again_by_its_beats(
        tmp_path, monkeypatch, cover_paths):
    """``rm -rf`` of a root (a temporary directory's cleanup) while a process still holds
    an entry of it: the hold's beats neither make the root again nor write into it."""
    import shutil

    import cachekit

    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "0.4")  # a beat every 0.1 s
    root = tmp_path / "cache"
    entry = cachekit.Cache(root, progress=False).images(cover_paths, size=8)
    hosts.wait_for(lambda: (root / hold_records.FOLDER).exists(), timeout=30,
                   what="the record")
    shutil.rmtree(root)
    time.sleep(0.5)
    assert not root.exists() and len(entry) == 12


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


HOLDER = """
import fcntl, sys, time
import cachekit
from cachekit.store import holds

class Unseen:  # Linux's NFS client keeps a directory's flock to the machine that takes it
    LOCK_SH, LOCK_EX, LOCK_NB = fcntl.LOCK_SH, fcntl.LOCK_EX, fcntl.LOCK_NB
    flock = staticmethod(lambda fd, operation: None)

holds.fcntl = Unseen
entry = cachekit.Cache(sys.argv[1], progress=False).images(sys.argv[2:], size=8)
print(entry.key, flush=True)
time.sleep(600)
"""


def test_an_entry_a_process_of_another_host_holds_stays_until_its_record_stops_beating(
        two_hosts, cover_paths):
    """host-a trains on an entry, its flock unseen by host-b (as on NFS). host-b's prune
    and ``ls`` see the entry in use while host-a's record beats. Once the holder is killed,
    its record stays behind: host-a's own prune takes the entry at once (its host's records
    are left to the flock), host-b's once the record is older than the lease (2 s here)."""
    a, b = two_hosts
    lease = {"CACHEKIT_LOCK_LEASE": "2"}
    prune = ("prune", "--max-size", "0", "--yes")

    def hold_on_a() -> tuple[hosts.HostProcess, Path]:
        holder = a.python(HOLDER, a.root, *cover_paths, env=lease)
        key = holder.stdout.readline().strip()
        assert (a.root / "entries" / key).is_dir(), hosts.finish(holder).failure()
        return holder, a.root / "entries" / key

    def kill(holder: hosts.HostProcess) -> Path:
        (record,) = hosts.wait_for(lambda: _named(a.root / hold_records.FOLDER),
                                   timeout=30, what="the holder's record", watch=[holder])
        holder.kill_group()
        holder.reap()
        assert record.exists()  # a killed holder's record stays behind
        return record

    holder, entry = hold_on_a()
    time.sleep(2.5)  # longer than the lease: the record (written at 0.5 s) beats
    kept = hosts.finish(b.cli(*prune, env=lease))
    assert kept.ok and entry.is_dir(), kept.failure()
    said = f"skipping {entry.name}: in use by a live process (pid {holder.pid} on host-a)"
    assert said in kept.stdout, kept.failure()
    listed = hosts.finish(b.cli("ls", "--json", env=lease))
    assert [e["in_use"] for e in json.loads(listed.stdout)] == [True]
    told = hosts.finish(b.cli("info", entry.name, env=lease))
    assert f"by pid {holder.pid} on host-a: `prune`" in told.stdout, told.failure()
    planted = a.root / hold_records.FOLDER / f"{entry.name}.planted"  # by a group member
    planted.write_text(json.dumps({"host": "host-a", "pid": "\x1b[2J"}))
    told = hosts.finish(b.cli("info", entry.name, env=lease))
    assert "by pid \\x1b[2J on host-a, pid" in told.stdout, told.failure()  # shown escaped
    planted.unlink()
    kill(holder)
    removed = hosts.finish(a.cli(*prune, env=lease))
    assert removed.ok and not entry.exists(), removed.failure()

    holder, entry = hold_on_a()
    record = kill(holder)
    hosts.wait_for(lambda: time.time() - record.stat().st_mtime > 2.1, timeout=30,
                   what="the killed holder's record to outlive the lease")
    removed = hosts.finish(b.cli(*prune, env=lease))
    assert removed.ok and not entry.exists(), removed.failure()


KEEPER = """
import sys, time
from pathlib import Path
from cachekit.store import holds
taken = holds.hold(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_removal_takes_the_records_holders_left_of_entries_that_stay(tmp_path,
                                                                       monkeypatch):
    """A holder killed (or ended by a SIGTERM, which runs no exit handler) leaves its
    record; the next clear or prune removes it, and another host's that stopped beating,
    and one whose writer was killed before naming it, whatever entry they hold; it leaves
    the records of live holders, and one being written."""
    monkeypatch.setenv("CACHEKIT_LOCK_LEASE", "2")  # a record written 0.5 s after a hold
    cache = cachekit.Cache(tmp_path / "root", progress=False)
    entries = tmp_path / "root" / "entries"
    for key in ("KEPT", "MINE"):
        (entries / key).mkdir(parents=True)
    records = tmp_path / "root" / hold_records.FOLDER
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER, str(entries / "KEPT")],
                              stdout=subprocess.PIPE, text=True)
    assert keeper.stdout.readline() == "held\n"
    (left,) = hosts.wait_for(lambda: _named(records),
                             timeout=30, what="the keeper's record")
    keeper.kill()
    keeper.wait()
    keeper.stdout.close()
    mine = holds.hold(entries / "MINE")
    hosts.wait_for(lambda: len(_named(records)) == 2, timeout=30, what="my record")
    away = json.dumps({"host": "host-b", "pid": 77, "pidns": "pid:[1]", "started": 1})
    for name, text, age in (("KEPT.host-b.77.live", away, 0),
                            ("MINE.host-b.78.stopped", away, 10),
                            (".KEPT.host-b.79.being-written", "", 0),
                            (".MINE.host-b.80.writer-killed", "", 10)):
        (records / name).write_text(text)
        os.utime(records / name, (time.time() - age,) * 2)
    planned = subprocess.run([sys.executable, "-m", "cachekit", "--root", str(tmp_path / "root"),
                              "prune", "--max-size", "1G", "--dry-run"],
                             capture_output=True, text=True)
    assert "would remove 0 entries and 3 hold records (0 B)" in planned.stdout, planned
    report = cache.prune("1G")  # removes no entry
    assert sorted(item.noun for item in report.removed) == ["hold record"] * 3
    assert sorted(p.name for p in entries.iterdir()) == ["KEPT", "MINE"]
    names = sorted(p.name for p in records.iterdir())
    assert left.name not in names and "MINE.host-b.78.stopped" not in names
    assert ".MINE.host-b.80.writer-killed" not in names
    assert len(names) == 3 and {"KEPT.host-b.77.live", ".KEPT.host-b.79.being-written"} < set(
        names)  # and mine
    mine.close()
