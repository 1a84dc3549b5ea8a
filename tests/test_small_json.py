"""Reading records that other processes write: within a limit, whatever their size."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachekit import _fs, small_json

CONTENT = bytes(range(256)) * 12


def read_open(path, limit: int) -> bytes:
    """``small_json.read_limited`` of the file opened."""
    with open(path, "rb") as f:
        return small_json.read_limited(f, limit)


def read_by_name(path, limit: int) -> bytes:
    """``DirHandle.read_file`` of the file named in its folder's handle."""
    with _fs.DirHandle.open(path.parent) as folder:
        return folder.read_file(path.name, limit)


READERS = pytest.mark.parametrize("read", [read_open, read_by_name])


@READERS
@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, len(CONTENT)), limit=st.integers(0, len(CONTENT) + 10))
def test_a_record_reads_as_a_read_of_one_byte_past_the_limit(tmp_path, read, size, limit):
    path = tmp_path / "record"
    path.write_bytes(CONTENT[:size])
    assert read(path, limit) == CONTENT[:size][:limit + 1]


@READERS
@pytest.mark.parametrize("said, limit, expected", [(4, 100, 10), (4, 7, 8), (20, 100, 10)])
def test_a_record_whose_size_changed_after_it_was_read_is_read_to_its_end_within_the_limit(
        tmp_path, read, said, limit, expected):
    """A writer appended to it (its fstat said 4 bytes) or cut it (20) before the read."""
    path = tmp_path / "record"
    path.write_bytes(b"x" * 10)
    fstat = os.fstat

    def as_said(fd: int) -> os.stat_result:
        st = fstat(fd)
        return os.stat_result((*st[:6], said, *st[7:]))

    with mock.patch.object(os, "fstat", as_said):
        assert read(path, limit) == b"x" * expected


@READERS
def test_a_record_is_one_read_of_the_file_size_not_the_limit(tmp_path, read):
    """``os.read`` allocates what it is asked for: a manifest read under a 64 MiB limit
    must not cost 64 MiB of allocation, nor a second read (``ls`` reads every manifest of
    a root)."""
    path = tmp_path / "record"
    path.write_bytes(CONTENT)
    asked: list[int] = []
    os_read = os.read

    def counted(fd: int, n: int) -> bytes:
        asked.append(n)
        return os_read(fd, n)

    with mock.patch.object(os, "read", counted):
        assert read(path, 64 << 20) == CONTENT
        assert asked == [len(CONTENT) + 1]
        fstat = os.fstat
        with mock.patch.object(os, "fstat",  # a file that grew after its size was read
                               lambda fd: os.stat_result((*fstat(fd)[:6], 4, *fstat(fd)[7:]))):
            assert read(path, 64 << 20) == CONTENT
    assert max(asked) <= 1 << 16  # past its size too, reads are of a bounded size


@pytest.mark.parametrize("make", ["symlink", "fifo", "directory"])
def test_reading_by_name_refuses_what_is_not_a_regular_file(tmp_path, make):
    (tmp_path / "target").write_bytes(b"{}")
    path = tmp_path / "record"
    if make == "symlink":
        path.symlink_to(tmp_path / "target")
    elif make == "fifo":
        os.mkfifo(path)  # (an open that blocked would hang the test)
    else:
        path.mkdir()
    with pytest.raises(OSError) as raised:
        read_by_name(path, 100)
    assert not isinstance(raised.value, FileNotFoundError)
