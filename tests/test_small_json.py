"""Reading records that other processes write: within a limit, whatever their size."""

from __future__ import annotations

import os
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachekit import small_json

CONTENT = bytes(range(256)) * 12


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, len(CONTENT)), limit=st.integers(0, len(CONTENT) + 10))
def test_a_record_reads_as_a_read_of_one_byte_past_the_limit(tmp_path, size, limit):
    path = tmp_path / "record"
    path.write_bytes(CONTENT[:size])
    with open(path, "rb") as f:
        assert small_json.read_limited(f, limit) == CONTENT[:size][:limit + 1]


def test_a_record_that_grew_after_its_size_was_read_is_read_to_its_end_within_the_limit(
        tmp_path):
    path = tmp_path / "record"
    path.write_bytes(b"x" * 10)
    fstat = os.fstat

    def before_the_append(fd: int) -> os.stat_result:  # the size a writer then added to
        st = fstat(fd)
        return os.stat_result((*st[:6], 4, *st[7:]))

    with open(path, "rb") as f, mock.patch.object(small_json.os, "fstat", before_the_append):
        assert small_json.read_limited(f, 100) == b"x" * 10
        f.seek(0)
        assert small_json.read_limited(f, 7) == b"x" * 8
