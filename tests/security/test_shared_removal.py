"""Removing on a root a team shares: a member's dead build is that member's to remove.

A build directory is writable by its builder alone (no other member may plant files in a
build), so when a member's build dies (SIGKILL, a lost node) only that member, or root, can
empty its directory. Another member's ``clear``, ``prune`` and budget leave it alone and
say whose it is; before, they moved it to ``tmp/deleting.*``, failed on its first file
(exit 1) and left its bytes there, under a name its owner's next build no longer resumes.
Its owner then removes it with the command ``cachekit ls`` names. An entry a member's live
job uses is left by the others' ``prune`` and budget until that job ends, and a member's
fold of a teammate's entry, a copy of its rows, has room made for it under a budget.

Two plain uids of one group share the root the README way (tests/users.py): the "attacker"
plays the teammate whose build died. Every child is a real interpreter; every wait is
bounded by a subprocess timeout. Images are decoded with Pillow (no child imports torch).
"""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path

from cachekit.units import format_size

import users
from helpers import write_pictures
from hosts import finish, wait_for

TIMEOUT = 60.0
"""Seconds any one child may run (none needs more than about 10 here)."""

BUILD = textwrap.dedent(r'''
    """A member's images call (one worker, Pillow); with GATE, its decode of row GATE
    creates the file GATE_FILE and waits there to be killed. Reports the entry.

    argv: ROOT CONFIG. config: paths, size, gate ([row, file], or null), umask (or null:
    the team's 002), holding (a file: created once the entry is obtained, then the child
    holds the entry until it is killed), progress (say the call's notes; default: no).
    """
    import json, os, sys, time
    from pathlib import Path

    import cachekit
    from hosts import report, stop_decoding_at

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    if config.get("umask") is not None:
        os.umask(config["umask"])
    if config["gate"]:
        stop_decoding_at(*config["gate"])
    entry = cachekit.Cache(root, workers=1, progress=config.get("progress", False)).images(
        config["paths"], config["size"], backend="pil")
    report(key=entry.key, source=entry.source, rows_decoded=entry.rows_decoded)
    if config.get("holding"):
        Path(config["holding"]).touch()
        time.sleep(600)
''')


def tree(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` with its size, by path relative to it."""
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_teammates_dead_build_is_left_to_them_by_clear_prune_and_a_budget(shared_root):
    """The teammate's build is SIGKILLed mid-way. The other member's ``ls`` names who can
    remove it; their ``clear --all``, ``prune`` and a call under a budget of 1 byte all
    succeed and leave its directory as it was (same name, same files); the teammate's own
    ``clear`` then removes it."""
    shared = shared_root
    paths = write_pictures(shared.base / "images", 320)  # 5 chunks of 64 rows (8x8 RGB)
    gate = shared.work / "gate"
    config = shared.write_json("teammate.json", {"paths": paths, "size": 8,
                                                 "gate": [200, str(gate)]})
    teammate = shared.attacker.python(shared.script(BUILD), shared.root, config)
    wait_for(gate.exists, timeout=TIMEOUT, what="the teammate's build to reach row 200",
             watch=[teammate])
    teammate.kill_group()  # SIGKILL
    teammate.reap()
    assert teammate.returncode == -signal.SIGKILL
    (build,) = (shared.root / "tmp").iterdir()
    before = tree(build)
    assert "data.npy" in before, before
    key = build.name.split(".")[0]

    listed = finish(shared.victim.cli(shared.root, "ls"), TIMEOUT)
    assert listed.ok, listed.failure()
    assert (f"uid {users.ATTACKER_UID}, its owner, can remove it with `cachekit clear "
            f"{key[:12]}`") in listed.stderr, listed.stderr

    for command in (["clear", "--all", "--yes"], ["prune", "--max-size", "0", "--yes"]):
        done = finish(shared.victim.cli(shared.root, *command), TIMEOUT)
        assert done.ok, done.failure()
        assert f"uid {users.ATTACKER_UID} owns it" in done.stdout + done.stderr, done.failure()
        assert [p.name for p in (shared.root / "tmp").iterdir()] == [build.name], command
        assert tree(build) == before, command

    keys = []
    for name, rows, budget in (("first", paths[:40], {}), ("second", paths[40:80],
                                                        {"CACHEKIT_MAX_SIZE": "1"})):
        column = shared.write_json(f"{name}.json", {"paths": rows, "size": 8, "gate": None})
        built = finish(shared.victim.python(shared.script(BUILD), shared.root, column,
                                            env=budget), TIMEOUT)
        assert built.report()["source"] == "built", built.failure()
        keys.append(built.report()["key"])
    assert [p.name for p in (shared.root / "entries").iterdir()] == keys[1:]  # (evicted)
    assert [p.name for p in (shared.root / "tmp").iterdir()] == [build.name]
    assert tree(build) == before

    cleared = finish(shared.attacker.cli(shared.root, "clear", key[:12], "--yes"), TIMEOUT)
    assert cleared.ok, cleared.failure()
    assert list((shared.root / "tmp").iterdir()) == [], cleared.stdout


def test_an_entry_a_teammate_made_under_umask_022_is_left_to_them(shared_root):
    """A member who works under ``umask 022`` publishes an entry whose directory the group
    cannot empty. Another member's ``clear --all`` succeeds, says whose it is and leaves it
    published; their budget counts it and removes their own entries instead; its owner's
    next call still hits it."""
    shared = shared_root
    paths = write_pictures(shared.base / "images", 96)
    mine = shared.write_json("mine.json", {"paths": paths[:16], "size": 8, "gate": None})
    assert finish(shared.victim.python(shared.script(BUILD), shared.root, mine),
                  TIMEOUT).report()["source"] == "built"
    theirs = shared.write_json("theirs.json", {"paths": paths[16:80], "size": 8, "gate": None,
                                               "umask": 0o022})
    key = finish(shared.attacker.python(shared.script(BUILD), shared.root, theirs),
                 TIMEOUT).report()["key"]
    before = tree(shared.root / "entries" / key)

    done = finish(shared.victim.cli(shared.root, "clear", "--all", "--yes"), TIMEOUT)
    assert done.ok, done.failure()
    assert f"uid {users.ATTACKER_UID} owns it" in done.stdout + done.stderr, done.failure()
    assert [p.name for p in (shared.root / "entries").iterdir()] == [key]
    assert tree(shared.root / "entries" / key) == before
    assert list((shared.root / "tmp").iterdir()) == []

    # A budget that their entry's removal would meet on paper, and only our oldest does:
    keys = []
    for name, rows in (("first", paths[80:88]), ("second", paths[88:96])):
        column = shared.write_json(f"{name}.json", {"paths": rows, "size": 8, "gate": None})
        budget = {} if not keys else {"CACHEKIT_MAX_SIZE": str(2 * sizes[keys[0]]
                                                               + sizes[key] // 2)}
        keys.append(finish(shared.victim.python(shared.script(BUILD), shared.root, column,
                                                env=budget), TIMEOUT).report()["key"])
        listed = finish(shared.victim.cli(shared.root, "ls", "--json"), TIMEOUT)
        sizes = {e["key"]: e["bytes"] for e in json.loads(listed.stdout)}
    assert sorted(sizes) == sorted([key, keys[1]])  # the first went; theirs stays, counted

    again = finish(shared.attacker.python(shared.script(BUILD), shared.root, theirs), TIMEOUT)
    assert again.report() == {"key": key, "source": "local", "rows_decoded": 0}


def test_an_entry_a_teammate_uses_is_left_by_the_others_budget_and_prune_until_they_end(
        shared_root):
    """A teammate's job holds its entry (its ``Entry`` lives) while another member's calls
    commit under a budget of 1 byte and their ``prune --max-size 0`` runs: both leave it,
    as in use (a shared flock on its directory, which another uid can test), and prune
    says so. Once the teammate's job is SIGKILLed, the member's prune removes it."""
    shared = shared_root
    paths = write_pictures(shared.base / "images", 48)
    holding = shared.work / "holding"
    theirs = shared.write_json("theirs.json", {"paths": paths[:32], "size": 8, "gate": None,
                                               "holding": str(holding)})
    teammate = shared.attacker.python(shared.script(BUILD), shared.root, theirs)
    try:
        wait_for(holding.exists, timeout=TIMEOUT, what="the teammate's entry",
                 watch=[teammate])
        (key,) = [p.name for p in (shared.root / "entries").iterdir()]
        mine = shared.write_json("mine.json", {"paths": paths[32:], "size": 8, "gate": None})
        built = finish(shared.victim.python(shared.script(BUILD), shared.root, mine,
                                            env={"CACHEKIT_MAX_SIZE": "1"}), TIMEOUT)
        assert built.report()["source"] == "built"
        assert sorted(p.name for p in (shared.root / "entries").iterdir()) == sorted(
            [key, built.report()["key"]])  # theirs left; the call's own entry returned
        pruned = finish(shared.victim.cli(shared.root, "prune", "--max-size", "0", "--yes"),
                        TIMEOUT)
        assert pruned.ok, pruned.failure()
        assert f"skipping {key}: in use by a live process" in pruned.stdout + pruned.stderr
        assert [p.name for p in (shared.root / "entries").iterdir()] == [key]
    finally:
        teammate.kill_group()  # SIGKILL: the kernel drops the hold with the job
        teammate.reap()
    pruned = finish(shared.victim.cli(shared.root, "prune", "--max-size", "0", "--yes"),
                    TIMEOUT)
    assert pruned.ok, pruned.failure()
    assert list((shared.root / "entries").iterdir()) == []


def test_a_fold_of_a_teammates_entry_has_room_made_for_its_copy_under_a_budget(shared_root):
    """A member's fold of a teammate's entry copies its rows: it never links another user's
    files, which their owner could change. Under a budget, room is made for that copy
    before it is written (the member's own entry, the least recently used, goes; the
    teammate's, which lends the rows, stays), not only for the rows it decodes (none)."""
    shared = shared_root
    paths = write_pictures(shared.base / "images", 64)
    keys = {}
    for name, user, rows in (("own", shared.victim, paths[48:]),
                             ("theirs", shared.attacker, paths[:48])):
        config = shared.write_json(f"{name}.json", {"paths": rows, "size": 32, "gate": None})
        built = finish(user.python(shared.script(BUILD), shared.root, config), TIMEOUT)
        assert built.ok, built.failure()
        keys[name] = built.report()["key"]
    copy_bytes = 24 * 3 * 32 * 32
    budget = sum(tree(shared.root / "entries").values()) + copy_bytes // 2
    config = shared.write_json("fold.json", {"paths": paths[:48:2], "size": 32, "gate": None,
                                             "progress": True})
    fold = finish(shared.victim.python(shared.script(BUILD), shared.root, config,
                                       env={"CACHEKIT_MAX_SIZE": str(budget)}), TIMEOUT)
    assert fold.ok and fold.report()["rows_decoded"] == 0, fold.failure()
    said, key = fold.stderr, fold.report()["key"]
    assert f"entry {key[:12]}: copying 24 rows from 1 entry of the same recipe; nothing " \
        "left to decode" in said, said  # (not "sharing": nothing of theirs is linked)
    assert f"to make room for the {format_size(copy_bytes)} entry {key[:12]} is about to " \
        "write" in said, said
    assert sorted(p.name for p in (shared.root / "entries").iterdir()) == sorted(
        [keys["theirs"], key])
