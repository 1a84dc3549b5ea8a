"""Shared fixtures: small real image files, an empty cache root per test, simulated hosts,
plain users sharing one cache root, a real S3 server on loopback."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import uuid

import pytest
from hypothesis import HealthCheck, settings

import cachekit
import hosts
from hostile_http import HostileServer
import s3
import users

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
"""The interpreters a test starts cache bytecode, as users' interpreters do: where
``PYTHONDONTWRITEBYTECODE`` is set (the development machines set it), each of them would
compile cachekit anew (``__pycache__`` is ignored by git)."""

_SHARED_SEAWEED = pytest.StashKey[s3.Seaweed]()
"""The controller's S3 server, which every xdist worker uses."""
_SHARED_SEAWEED_INPUT = "cachekit_tests_seaweed"
"""Its key in each worker's ``workerinput``: what :meth:`s3.Seaweed.attach` needs."""


def pytest_configure(config: pytest.Config) -> None:
    """Compile cachekit and the tests' helpers once, before any worker starts: the plain
    uids of the shared-root tests (:mod:`users`) cannot write into the checkout, so without
    this each of their interpreters compiles every module it imports anew. An xdist
    controller also starts the workers' one S3 server (:func:`s3_server`)."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller compiled them
    import compileall

    here = Path(__file__).resolve().parent
    for folder in (here.parent / "cachekit", here):
        compileall.compile_dir(folder, quiet=2, workers=0)
    if (config.getoption("numprocesses", None) and config.getoption("dist", "no") != "no"
            and not config.option.collectonly and s3.why_no_server() is None):
        config.stash[_SHARED_SEAWEED] = s3.Seaweed(
            Path(tempfile.mkdtemp(prefix="cachekit-tests-seaweed-"))).launch()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Tell each xdist worker where the controller's S3 server is."""
    server = node.config.stash.get(_SHARED_SEAWEED, None)
    if server is not None:
        node.workerinput[_SHARED_SEAWEED_INPUT] = server.describe()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the controller's S3 server once every worker is done."""
    server = config.stash.get(_SHARED_SEAWEED, None)
    if server is not None:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)


settings.register_profile("shared-machine", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")
"""A test's inputs take as long to make as the machine lets them: CI runs three workers on
two cores, and a slow draw there is load, not a slow strategy."""


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def cover_paths(tmp_path: Path) -> list[str]:
    """Twelve cover-like JPEGs (200-500 x 300-700 px) in a fresh directory."""
    from cachekit.samples import write_sample_images

    return write_sample_images(tmp_path / "covers", 12, seed=7)


@pytest.fixture
def cache(cache_root: Path) -> cachekit.Cache:
    """Two workers on threads: the executor never depends on a test's row count (the
    executors are tested one by one in test_executors.py)."""
    return cachekit.Cache(cache_root, workers=2, executor="threads", progress=False)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[tuple[hosts.Host, hosts.Host]]:
    """Hosts "host-a" and "host-b" sharing the cache root ``tmp_path/cache`` (and the scratch
    directory ``tmp_path/work``) whose flock locks do not reach each other; see tests/hosts.py.
    Skips when not root or when ``unshare --uts --mount`` does not work. Processes still
    running at teardown are killed."""
    reason = hosts.why_no_hosts()
    if reason is not None:
        pytest.skip(reason)
    a, b = hosts.make_hosts(tmp_path, ("host-a", "host-b"))
    try:
        yield a, b
    finally:
        a.kill_all()
        b.kill_all()


@pytest.fixture
def shared_root(tmp_path: Path) -> Iterator[users.SharedRoot]:
    """A cache root ``tmp_path/shared/cache`` owned by root:GID with mode 2775 (setgid) and
    two plain uids of group GID that share it, ``victim`` and ``attacker``; see
    tests/users.py. Skips when not root or when children cannot run as those uids here.
    Processes still running at teardown are killed."""
    reason = users.why_no_two_uids()
    if reason is not None:
        pytest.skip(reason)
    shared = users.make_shared_root(tmp_path)
    try:
        yield shared
    finally:
        shared.kill_all()


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3.Seaweed]:
    """One SeaweedFS ``weed mini`` for the session, on 127.0.0.1 only, free ports, with
    credentials of its own (see tests/s3.py); stopped at the end of the session. Under
    xdist the workers share the one their controller started (each test has a prefix of
    its own, :func:`s3_env`): one server idles instead of four. Skips when ``weed`` is not
    installed."""
    reason = s3.why_no_server()
    if reason is not None:
        pytest.skip(reason)
    shared = getattr(request.config, "workerinput", {}).get(_SHARED_SEAWEED_INPUT)
    if shared is not None:
        yield s3.Seaweed.attach(shared)  # the controller stops it
        return
    server = s3.Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: s3.Seaweed, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh ``s3://BUCKET/PREFIX`` on the session's server, as the environment variables
    a process needs to reach it through fsspec/s3fs's own configuration: CACHEKIT_REMOTE,
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION (and
    settings that keep boto away from the user's ~/.aws). They are also set in this
    process for the test's duration."""
    env = s3_server.env(f"t-{uuid.uuid4().hex[:12]}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture(autouse=True)
def background_uploads_end_with_their_test() -> Iterator[None]:
    """A test's background uploads (cachekit.obtain.background) end with the test, so that
    none writes into the next test's bucket or its captured stderr."""
    yield
    from cachekit.obtain import background

    background.wait_all()


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    """A hostile HTTP server of the test's own on 127.0.0.1 (tests/hostile_http.py): huge,
    endless, gzip-bomb and trickling answers, a silent HEAD; stopped with the test."""
    server = HostileServer()
    try:
        yield server
    finally:
        server.stop()
