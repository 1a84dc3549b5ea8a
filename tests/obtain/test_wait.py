"""The one wait loop that local and remote waits share (cachekit.obtain.wait): its
deadline, its reports and its LockTimeout. The waits themselves, on real locks, builders
and leases, are in test_reliability_locks, test_reliability_resume and test_remote_tier."""

from __future__ import annotations

import pickle
import time

import pytest

from cachekit.errors import LockTimeout
from cachekit.messages import prefix, quiet
from cachekit.options import check_lock_timeout
from cachekit.obtain.wait import WAITING, Awaited, Wait

HOLDER = Awaited("/r/locks/k.lock", lambda: "pid 4242 on node7 (5/12 rows, 42%)",
                 "a hint", note=" (remote s3://b/p)")


def test_a_wait_gives_up_at_its_deadline_naming_the_holder_and_the_hint(capfd):
    steps: list[float] = []

    def nothing_yet(seconds: float) -> object:
        steps.append(seconds)
        time.sleep(seconds)
        return WAITING

    wait = Wait("ab" * 16, 0.6)
    with pytest.raises(LockTimeout, match=r"pid 4242 on node7 \(5/12 rows, 42%\)") as caught, \
            quiet():
        wait.until(nothing_yet, HOLDER, poll=0.25)
    assert wait.seconds >= 0.6  # it waited the whole lock_timeout, not one poll less
    assert all(0 <= s <= 0.25 for s in steps) and len(steps) >= 3
    error = caught.value
    assert (error.lock_path, error.timeout, error.hint) == ("/r/locks/k.lock", 0.6, "a hint")
    assert pickle.loads(pickle.dumps(error)).owner == error.owner
    assert capfd.readouterr().err == ""  # a quiet call says nothing


def test_a_wait_with_no_time_left_looks_once_then_gives_up():
    looks = []
    with pytest.raises(LockTimeout):
        Wait("k" * 32, 0).until(lambda s: looks.append(s) or WAITING, HOLDER)
    assert looks == [0.0]


def test_a_step_ends_the_wait_with_any_result_even_none():
    answers = iter([WAITING, WAITING, None])
    wait = Wait("k" * 32, None)  # no deadline
    assert wait.remaining() is None
    assert wait.until(lambda s: next(answers), HOLDER, poll=0.01) is None


def test_a_long_wait_says_whom_it_waits_for(capfd):
    def nothing_yet(seconds: float) -> object:
        time.sleep(seconds)
        return WAITING

    with pytest.raises(LockTimeout):
        Wait("0123456789abcdef" * 2, 1.5).until(nothing_yet, HOLDER, poll=0.25)
    reports = [line for line in capfd.readouterr().err.splitlines() if line]
    me = f"{prefix()}: waited "  # each line names the process
    assert reports and all(line.startswith(me) for line in reports), reports
    assert reports[0].endswith(" s for pid 4242 on node7 (5/12 rows, 42%) to build entry "
                               "0123456789ab (remote s3://b/p)")
    assert len(reports) == 1  # the next is due WAIT_REPORT_SECONDS later


@pytest.mark.parametrize("bad", [-1, "1", True, [1]])
def test_lock_timeout_is_none_or_seconds(bad):
    with pytest.raises(ValueError, match="lock_timeout must be None or seconds >= 0"):
        check_lock_timeout(bad)
    for good in (None, 0, 2.5):
        check_lock_timeout(good)
