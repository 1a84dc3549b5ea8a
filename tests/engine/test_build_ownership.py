"""Only the owner of a build writes its data file (cachekit/engine/).

A joiner computes into a rows file of its own; a resumed build copies the done chunks of a
dead one into a file of its own, and only those whose bytes match the checksum in their
done record. These tests drive the engine in one process on real files; the same rules
with real processes, uids and paused hosts are in test_join.py and test_ownership.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cachekit import _fs
from cachekit.engine.filling.builder import DeadBuilds, fill as fill_build
from cachekit.engine.filling.claimed import RowSpec
from cachekit.engine.filling.joiner import join as join_build
from cachekit.engine.filling import journal as journals

from helpers import small_chunks

ROWS, CHUNK = 24, 4
KEY = "0" * 32


class Stop(KeyboardInterrupt):
    """Ends a fill the way Ctrl-C does, leaving its journal behind."""


def row(value: int) -> np.ndarray:
    return np.full((3,), value, dtype=np.int32)


def stopping_at(stop: int, computed: list[int]):
    def fn(value: int) -> np.ndarray:
        if value == stop:
            raise Stop
        computed.append(value)
        return row(value)
    return fn


def counting(computed: list[int]):
    def fn(value: int) -> np.ndarray:
        computed.append(value)
        return row(value)
    return fn


EXPECTED = np.repeat(np.arange(ROWS, dtype=np.int32)[:, None], 3, axis=1)
TEMPLATE = ((3,), np.dtype(np.int32))


@pytest.fixture
def folders(tmp_path, monkeypatch):
    small_chunks(monkeypatch, CHUNK)
    for name in ("dead", "fresh"):
        (tmp_path / name).mkdir(mode=0o700)
    with _fs.DirHandle.open(tmp_path / "dead") as dead, \
            _fs.DirHandle.open(tmp_path / "fresh") as fresh:
        yield tmp_path, dead, fresh


def stopped_and_joined(dead: _fs.DirHandle, stop: int) -> None:
    """A builder stopped at row ``stop``, then a joiner that filled every free chunk."""
    with pytest.raises(Stop):
        fill_build(dead, "data.npy", list(range(ROWS)), stopping_at(stop, []),
                   rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY))
    joined = join_build(dead, "data.npy", list(range(ROWS)), row,
                        rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY))
    assert joined is not None and joined.chunks == (ROWS - stop) // CHUNK


def records(folder: Path) -> dict[int, dict]:
    chunks = folder / "data.npy.chunks"
    return {int(p.name[5:]): json.loads(p.read_text()) for p in chunks.iterdir()
            if p.name.startswith("done.")}


def test_a_joiner_never_writes_the_builders_data_file(folders):
    tmp, dead, _ = folders
    with pytest.raises(Stop):
        fill_build(dead, "data.npy", list(range(ROWS)), stopping_at(8, []),
                   rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY))
    before = (tmp / "dead" / "data.npy").read_bytes()
    join_build(dead, "data.npy", list(range(ROWS)), row,
               rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY))
    assert (tmp / "dead" / "data.npy").read_bytes() == before
    done = records(tmp / "dead")
    assert sorted(done) == list(range(ROWS // CHUNK))
    by_joiner = {i for i, r in done.items() if r["file"] is not None}
    assert by_joiner == set(range(8 // CHUNK, ROWS // CHUNK))
    assert all(journals.is_rows_file(done[i]["file"]) for i in by_joiner)


def test_a_resume_copies_verified_chunks_and_recomputes_a_tampered_one(folders):
    tmp, dead, fresh = folders
    stopped_and_joined(dead, 8)
    done = records(tmp / "dead")
    own, joined = 0, 3  # chunk 0 in the builder's file, chunk 3 in the joiner's
    for index in (own, joined):
        name = done[index]["file"] or "data.npy"
        path = tmp / "dead" / ("data.npy.chunks/" + name if done[index]["file"] else name)
        data = bytearray(path.read_bytes())
        data[-(ROWS - done[index]["start"]) * 12] ^= 0xFF  # first byte of the chunk
        path.write_bytes(bytes(data))
    computed: list[int] = []
    filled = fill_build(fresh, "data.npy", list(range(ROWS)), counting(computed),
                        rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY),
                        resuming=DeadBuilds(dead=[dead]))
    assert sorted(computed) == [*range(0, 4), *range(12, 16)]  # the two tampered chunks
    assert filled.resumed == ROWS - 2 * CHUNK
    np.testing.assert_array_equal(np.load(tmp / "fresh" / "data.npy"), EXPECTED)


@pytest.mark.parametrize("change", ["key", "rows", "template"])
def test_a_plan_of_another_fill_is_never_copied(folders, change):
    tmp, dead, fresh = folders
    stopped_and_joined(dead, 8)
    values = list(range(ROWS + (change == "rows")))
    template = ((4,), np.dtype(np.int32)) if change == "template" else TEMPLATE
    key = "1" * 32 if change == "key" else KEY
    computed: list[int] = []

    def fn(value: int) -> np.ndarray:
        computed.append(value)
        return np.full(template[0], value, dtype=np.int32)

    filled = fill_build(fresh, "data.npy", values, fn,
                        rows=RowSpec(workers=1, record=False, template=template, key=key),
                        resuming=DeadBuilds(dead=[dead]))
    assert filled.resumed == 0 and sorted(computed) == values


def test_a_huge_planned_file_is_never_allocated_for_another_rows_count(folders):
    """A dead build whose plan declares a huge file is checked before anything it sizes is
    read or allocated: the new file is the size of the caller's own rows."""
    tmp, dead, fresh = folders
    stopped_and_joined(dead, 8)
    plan_path = tmp / "dead" / "data.npy.chunks" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["rows"] = 1 << 40
    plan_path.unlink()
    plan_path.write_text(json.dumps(plan))
    filled = fill_build(fresh, "data.npy", list(range(ROWS)), row,
                        rows=RowSpec(workers=1, record=False, template=TEMPLATE, key=KEY),
                        resuming=DeadBuilds(dead=[dead]))
    assert filled.resumed == 0
    assert (tmp / "fresh" / "data.npy").stat().st_size < 4096
