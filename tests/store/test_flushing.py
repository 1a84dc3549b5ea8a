"""A batch of fsyncs (cachekit/flushing.py): every file is fsynced, an error is raised, and a
forked child makes its own threads."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest

from cachekit import _fs, flushing


def test_every_file_and_the_directory_are_fsynced_and_a_failure_is_raised(tmp_path,
                                                                       monkeypatch):
    for name in "abc":
        (tmp_path / name).write_bytes(name.encode())
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.fstat(fd).st_ino == os.stat(tmp_path / "b").st_ino:
            synced.append(os.fstat(fd).st_ino)
            raise OSError(errno.EIO, "Input/output error")  # at once, the others still busy
        time.sleep(0.2)
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with _fs.DirHandle.open(tmp_path) as directory, pytest.raises(OSError, match="Input/output"):
        flushing.fsync_names(directory, ["b", "a", "c"], directory_too=True)
    expected = {os.stat(tmp_path / n).st_ino for n in "abc"} | {os.stat(tmp_path).st_ino}
    assert sorted(synced) == sorted(expected)  # the others were done before it was raised


def test_a_forked_child_fsyncs_with_threads_of_its_own(tmp_path):
    for name in "ab":
        (tmp_path / name).write_bytes(b"x")
    with _fs.DirHandle.open(tmp_path) as directory:
        flushing.fsync_names(directory, ["a", "b"])  # the parent's threads exist now
        pid = os.fork()
        if pid == 0:
            try:
                flushing.fsync_names(directory, ["a", "b"], directory_too=True)
                os._exit(0)
            except BaseException:
                os._exit(1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:  # waiting on threads it does not have
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's fsyncs never ran")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
