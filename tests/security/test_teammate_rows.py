"""A member's entries built from a teammate's rows, on a root a team shares.

A build never links another user's data files (their owner could change them, and with
them this member's entry): it copies their rows. Before, one such file made the build copy
every row, its own files' too, into one contiguous file, and the row lookup offered the
teammate's entry first (the most rows), so each of a member's k-fold entries held a full
copy of its rows. Now a member's entries are offered first and only another user's rows
are copied, beside the member's own files, which stay linked: a member stores a
teammate's row once, and their later folds link that copy.

Two plain uids of one group share the root the README way (tests/users.py): the
"attacker" plays the teammate. Every child is a real interpreter; images are decoded with
Pillow (no child imports torch).
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import numpy as np

from helpers import write_pictures
from hosts import finish

TIMEOUT = 60.0
"""Seconds any one child may run (none needs more than a few here)."""

CALL = textwrap.dedent(r'''
    """A member's images call (one worker, Pillow, its notes said on stderr): saves the
    entry's rows to SAVE and reports the entry. argv: ROOT CONFIG (paths, size, save)."""
    import json, sys
    from pathlib import Path

    import numpy as np

    import cachekit
    from hosts import report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    entry = cachekit.Cache(root, workers=1).images(config["paths"], config["size"],
                                                    backend="pil")
    np.save(config["save"], np.asarray(entry.array))
    report(key=entry.key, hit=entry.hit, rows_decoded=entry.rows_decoded,
           contiguous=entry.contiguous)
''')


def test_a_member_copies_a_teammates_rows_once_and_links_that_copy_after(shared_root):
    shared = shared_root
    paths = write_pictures(shared.base / "images", 64)

    def call(user, name: str, rows: list[str]) -> tuple[dict, str, np.ndarray, Path]:
        saved = shared.work / f"{name}.npy"
        config = shared.write_json(f"{name}.json", {"paths": rows, "size": 8,
                                                    "save": str(saved)})
        done = finish(user.python(shared.script(CALL), shared.root, config), TIMEOUT)
        assert done.ok, done.failure()
        got = done.report()
        return got, done.stderr, np.load(saved), shared.root / "entries" / got["key"]

    _, _, full, _ = call(shared.attacker, "full", paths[:48])
    theirs, _, more, _ = call(shared.attacker, "more", paths[48:])

    train, said, _, train_dir = call(shared.victim, "train", paths[:36])
    assert f"entry {train['key'][:12]}: copying 36 rows from 1 entry" in said, said
    assert train["contiguous"] and train["rows_decoded"] == 0
    val, _, _, val_dir = call(shared.victim, "val", paths[36:48])
    assert val["contiguous"] and val["rows_decoded"] == 0

    # another fold: every row is in the member's own copies, linked, none copied again
    fold, said, rows, fold_dir = call(shared.victim, "fold", paths[12:48])
    assert f"entry {fold['key'][:12]}: sharing 36 rows with 2 entries of the same recipe " \
        "(stored once); nothing left to decode" in said, said
    assert not fold["contiguous"] and fold["rows_decoded"] == 0
    assert "data.npy" not in os.listdir(fold_dir)
    assert inodes(fold_dir) == {os.stat(d / "data.npy").st_ino for d in (train_dir, val_dir)}
    np.testing.assert_array_equal(rows, full[12:48])

    # rows of the member's copies and rows only the teammate holds: links and copies
    mixed, said, rows, mixed_dir = call(shared.victim, "mixed", paths[30:40] + paths[48:52])
    assert f"entry {mixed['key'][:12]}: sharing 10 rows with 2 entries of the same recipe " \
        "(stored once), copying 4 rows from 1 entry; nothing left to decode" in said, said
    assert f"entry {mixed['key'][:12]}: its rows are in 3 files of other entries; links 2 " \
        "of them and copies the rows of the other 1 into its own file; another user's files " \
        "are copied, never linked" in said, said
    assert not mixed["contiguous"] and mixed["rows_decoded"] == 0
    assert np.load(mixed_dir / "data.npy", mmap_mode="r").shape[0] == 4  # the copied rows
    assert inodes(mixed_dir) == inodes(fold_dir)
    np.testing.assert_array_equal(rows, np.concatenate([full[30:40], more[:4]]))
    again, _, rows, _ = call(shared.victim, "again", paths[30:40] + paths[48:52])
    assert again["hit"] and again["key"] == mixed["key"]
    np.testing.assert_array_equal(rows, np.concatenate([full[30:40], more[:4]]))
    info = finish(shared.victim.cli(shared.root, "info", mixed["key"]), TIMEOUT)
    assert "0 by other processes (joiners, resumed builds), 10 shared with 2 entries, 4 " \
        "copied from 1 entry\n" in info.stdout, info.failure()
    assert re.search(f"  copied from {theirs['key'][:12]}: +4 rows\n", info.stdout), info.stdout
    checked = finish(shared.victim.cli(shared.root, "verify"), TIMEOUT)
    assert checked.ok and "6 entries verified, no problems" in checked.stdout, checked.failure()


def inodes(entry_dir: Path) -> set[int]:
    """The inodes of the data files ``entry_dir`` links (``part_*.npy``, not sidecars)."""
    return {os.stat(p).st_ino for p in entry_dir.glob("part_*.npy")
            if p.name.count(".") == 1}
