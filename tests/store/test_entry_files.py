"""The files an Entry keeps open (cachekit.store.entry_files): closed when it goes, passed
as descriptors only to a child that multiprocessing starts, and only so many to one child."""

from __future__ import annotations

import gc
import os
import pickle
from multiprocessing import context

import numpy as np
import pandas as pd
import pytest

import cachekit
from cachekit.store import entry_files
from helpers import write_pictures


def _descriptors() -> set[str]:
    """This process's open descriptors, each as its number and what it is open on."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd} {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


class _Starting:
    """What multiprocessing's spawn Popen lends a pickle that it sends to its child."""

    def __init__(self) -> None:
        self._fds: list[int] = []  # (as spawn's and forkserver's Popen name them)

    def duplicate_for_child(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    class DupFd:
        def __init__(self, fd: int) -> None:
            self.fd = fd

        def detach(self) -> int:
            return os.dup(self.fd)  # the child's own descriptor of the same open file


def _pickled_for_a_child(thing: object) -> tuple[bytes, list[int]]:
    starting = _Starting()
    context.set_spawning_popen(starting)
    try:
        return pickle.dumps(thing), starting._fds
    finally:
        context.set_spawning_popen(None)


@pytest.fixture
def entries(tmp_path) -> tuple[cachekit.Entry, cachekit.Entry]:
    """A contiguous entry and a derived one (a fold of it: its part and its row map)."""
    cache = cachekit.Cache(tmp_path / "root", progress=False, executor="threads")
    paths = pd.Series(write_pictures(tmp_path / "pictures", 12))
    full = cache.images(paths, 6)
    fold = cache.images(paths.iloc[1:10], 6)
    assert full.contiguous and not fold.contiguous
    return full, fold


def test_an_entry_closes_the_files_it_kept_when_it_goes(entries):
    full, fold = entries
    before = _descriptors()
    again = [pickle.loads(pickle.dumps(entry)) for entry in entries]
    rows = [np.asarray(entry.array) for entry in again]  # each opens and keeps its files
    assert len(_descriptors() - before) >= 3
    np.testing.assert_array_equal(rows[1], np.asarray(fold.array))
    del again, rows  # (a mapping keeps a descriptor of its own while it lives)
    gc.collect()
    assert _descriptors() <= before


def test_open_rows_keeps_no_descriptor(entries):
    before = _descriptors()
    for entry in entries:
        rows = entry_files.open_rows(entry.path, entry._manifest)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(entry.array))
        del rows  # (a mapping keeps a descriptor of its own while it lives)
        gc.collect()
    assert _descriptors() <= before


def test_only_a_child_being_started_receives_the_descriptors(entries):
    for entry in entries:
        assert pickle.loads(pickle.dumps(entry)).__dict__.get("_files") is None
        blob, passed = _pickled_for_a_child(entry)
        assert len(passed) == len(entry._files._descriptors)
        received = pickle.loads(blob)
        assert received._files is not None
        np.testing.assert_array_equal(np.asarray(received.array), np.asarray(entry.array))


def test_a_child_is_sent_at_most_passed_files_descriptors_in_all(entries, monkeypatch):
    """forkserver refuses to start a child sent more than 252 descriptors: past
    PASSED_FILES, all entries together, an entry goes as its location only."""
    full, fold = entries  # one data file; a part and its row map
    monkeypatch.setattr(entry_files, "PASSED_FILES", 2)
    blob, passed = _pickled_for_a_child([full, fold])
    assert len(passed) == 1
    received_full, received_fold = pickle.loads(blob)
    assert received_full._files is not None and received_fold.__dict__.get("_files") is None
    np.testing.assert_array_equal(np.asarray(received_fold.array), np.asarray(fold.array))
    blob, passed = _pickled_for_a_child([fold, full])
    assert len(passed) == 2 and pickle.loads(blob)[1].__dict__.get("_files") is None
