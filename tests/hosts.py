"""Simulated hosts that share one cache root on a filesystem whose locks work only per host.

Each process of a :class:`Host` runs under ``unshare --uts --mount`` (this needs root) with
the host's own hostname, which cachekit records at import as the owner of builds and locks,
and the host's private directory bound over ``ROOT/locks``. flock(2) locks taken on one host
are then invisible on another, as on an NFS mount with ``localflock``. ``ROOT/entries`` and
``ROOT/tmp`` stay shared, and so does the PID namespace: another host's pids are real
processes here, but their owner records name another host.

Every process of a host gets a fresh pair of namespaces; what makes processes one host is
the same hostname and the same private lock directory (flock works on that directory's
inodes from any mount namespace).

Parent side: :meth:`Host.python` and :meth:`Host.cli` start processes,
:meth:`StartBarrier.release` lets them go together, :func:`finish` collects what they print.
Child side (children have this directory on their ``PYTHONPATH``, so ``import hosts``
works): :meth:`StartBarrier.wait` and :func:`report`.

This module only uses the standard library, so children import it cheaply.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

TESTS = Path(__file__).resolve().parent
CHECKOUT = TESTS.parent
"""The checkout these tests belong to: children import cachekit from here, not from
wherever it happens to be installed."""

_ENTER = 'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"'
"""Run inside the new namespaces: name the host, hide the shared lock directory behind the
private one, then become the command. No fork: the Popen's pid is the command's pid."""


def namespace_argv(hostname: str, private: Path, target: Path, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` as ``hostname`` with ``private`` bound over ``target``.

    ``--propagation private`` keeps the bind mount from propagating back into the parent's
    mount namespace (it is util-linux's default for ``--mount``; spelled out to be sure).
    """
    return ["unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", _ENTER, "sh", hostname, str(private), str(target), *argv]


@functools.lru_cache(maxsize=None)
def why_no_hosts() -> Optional[str]:
    """Why hosts cannot be simulated here, or None when they can (probed once per session)."""
    if os.geteuid() != 0:
        return "simulating hosts needs root (unshare --mount, mount --bind)"
    for tool in ("unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"simulating hosts needs {tool!r} on PATH"
    with tempfile.TemporaryDirectory(prefix="cachekit-hosts-probe-") as scratch:
        target, private = Path(scratch, "shared"), Path(scratch, "private")
        target.mkdir()
        private.mkdir()
        (private / "marker").touch()
        argv = namespace_argv("cachekit-probe", private, target,
                              ["sh", "-c", 'hostname && ls "$0"', str(target)])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unshare --uts --mount does not work here: {e}"
        if done.returncode != 0 or done.stdout.split() != ["cachekit-probe", "marker"]:
            return (f"unshare --uts --mount does not work here (exit {done.returncode}): "
                    f"{done.stderr.strip() or done.stdout.strip()}")
        if any(target.iterdir()):
            return "a bind mount made in a private mount namespace leaked into this one"
    return None


def child_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment of a child: ours without CACHEKIT_* settings, importing cachekit and
    ``hosts`` from this checkout, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKIT_")}
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), str(TESTS), *inherited])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


class HostProcess(subprocess.Popen):
    """A ``subprocess.Popen`` that remembers which host runs it and what it was asked to run
    (for failure messages). It leads its own session, so its process group can be killed."""

    def __init__(self, host: str, command: Sequence[str], argv: Sequence[str],
                 env: Mapping[str, str]) -> None:
        self.host = host
        self.command = list(command)
        super().__init__(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(env), start_new_session=True)

    def describe(self) -> str:
        return f"[{self.host} pid {self.pid}] {' '.join(self.command)}"

    def kill_group(self) -> None:
        """SIGKILL the process and anything it started, if it is still running."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        """Kill the process if it still runs, wait for it and close its pipes."""
        self.kill_group()
        try:
            self.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # unkillable (stuck in the kernel): nothing more a test can do


def kill_all(processes: Sequence[HostProcess]) -> None:
    """Kill every one of ``processes`` still running, then reap them all (fixture teardown)."""
    for process in processes:
        process.kill_group()
    for process in processes:
        process.reap()


class Launcher:
    """What starts the processes of a host or of a user, and records them in ``processes``:
    :meth:`popen`, :meth:`python`, :meth:`run_cli`. Each says only how a command runs there
    (:meth:`_launch`: the argv and environment that wrap it)."""

    name: str
    processes: list[HostProcess]

    def _launch(self, command: list[str], env: Optional[Mapping[str, str]]
                ) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def popen(self, argv: Sequence[Any], *,
              env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Start ``argv`` here (stdout and stderr piped, as text, own session)."""
        command = [str(a) for a in argv]
        process = HostProcess(self.name, command, *self._launch(command, env))
        self.processes.append(process)
        return process

    def python(self, script: Path, *args: object,
               env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Run the Python script file ``script`` here."""
        return self.popen([sys.executable, script, *args], env=env)

    def run_cli(self, root: Path, *args: object,
                env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Run ``python -m cachekit --root ROOT ARGS...`` here."""
        return self.popen([sys.executable, "-m", "cachekit", "--root", root, *args], env=env)

    def kill_all(self) -> None:
        """Kill every process started here that is still running (fixture teardown)."""
        kill_all(self.processes)


@dataclass
class Host(Launcher):
    """One simulated machine: a hostname and a private lock directory over ``root/locks``.

    ``work`` is a scratch directory shared by every host (scripts, barriers, counters).
    Every process started here is recorded in ``processes``; :meth:`kill_all` ends them.
    """

    name: str
    root: Path
    private_locks: Path
    work: Path
    processes: list[HostProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        for directory in (self.root / "locks", self.private_locks, self.work):
            directory.mkdir(parents=True, exist_ok=True)  # a bind mount needs its target

    def _launch(self, command: list[str], env: Optional[Mapping[str, str]]
                ) -> tuple[list[str], dict[str, str]]:
        return (namespace_argv(self.name, self.private_locks, self.root / "locks", command),
                child_env(env))

    def python(self, script: Union[Path, str], *args: object,
               env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Run a Python script on this host: ``script`` is a file when it is a ``Path`` and
        source text when it is a ``str`` (written to a file under ``work`` named by its hash,
        so every host runs the same file and functions defined in it key alike)."""
        path = script if isinstance(script, Path) else self._script_file(script)
        return super().python(path, *args, env=env)

    def cli(self, *args: object, env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Run ``python -m cachekit --root ROOT ARGS...`` on this host, on its root."""
        return self.run_cli(self.root, *args, env=env)

    def _script_file(self, source: str) -> Path:
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = self.work / f"script_{digest}.py"
        if not path.exists():
            partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            partial.write_text(source)
            os.replace(partial, path)
        return path


def make_hosts(base: Path, names: Iterable[str]) -> list[Host]:
    """Hosts sharing the cache root ``base/cache`` and the scratch directory ``base/work``,
    each with its lock directory under ``base/private``."""
    root, work = base / "cache", base / "work"
    return [Host(name, root, base / "private" / f"{name}-locks", work) for name in names]


@dataclass(frozen=True)
class Finished:
    """A child's exit status and output."""

    process: HostProcess
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> str:
        """A readable account of the child for an assertion message."""
        return (f"{self.process.describe()} exited {self.returncode}\n"
                f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}")

    def report(self) -> dict[str, Any]:
        """The JSON object the child printed last; AssertionError if it failed or printed none."""
        if not self.ok:
            raise AssertionError(self.failure())
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        if not lines:
            raise AssertionError(f"no report on stdout\n{self.failure()}")
        return json.loads(lines[-1])


def finish(process: HostProcess, timeout: float = 180.0) -> Finished:
    """Wait for ``process``; kill it (and fail) when it runs longer than ``timeout`` seconds."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill_group()
        stdout, stderr = process.communicate()
        raise AssertionError(f"{process.describe()} still ran after {timeout:.0f} s; killed\n"
                             f"--- stdout ---\n{stdout}--- stderr ---\n{stderr}") from None
    return Finished(process, process.returncode, stdout, stderr)


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str,
             watch: Sequence[HostProcess] = ()) -> Any:
    """Poll ``condition`` until it returns something truthy, and return that.

    Fails after ``timeout`` seconds, or as soon as a process in ``watch`` exits (with its
    output), since it would then never come true.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for process in watch:
            if process.poll() is not None:
                raise AssertionError(f"exited while waiting for {what}\n"
                                     f"{finish(process).failure()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


@dataclass(frozen=True)
class StartBarrier:
    """A start-file barrier: each child creates ``NAME.ready.ME`` in ``directory`` and spins
    until ``NAME`` exists; the parent creates ``NAME`` once every child is ready."""

    directory: Path
    name: str = "start"

    @property
    def start_file(self) -> Path:
        return Path(self.directory) / self.name

    def wait(self, me: str, timeout: float = 300.0) -> None:
        """Child side: announce readiness, then return as soon as the parent says go."""
        (Path(self.directory) / f"{self.name}.ready.{me}").touch()
        deadline = time.monotonic() + timeout
        while not self.start_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody released barrier {self.start_file}")
            time.sleep(0.002)

    def release(self, processes: Sequence[HostProcess], timeout: float = 120.0) -> None:
        """Parent side: wait until every one of ``processes`` is ready, then let them go."""
        wait_for(lambda: len(list(Path(self.directory).glob(f"{self.name}.ready.*")))
                 >= len(processes),
                 timeout=timeout, what=f"{len(processes)} processes at barrier {self.name}",
                 watch=processes)
        self.start_file.touch()


def report(**fields: Any) -> None:
    """Child side: print one JSON object on stdout, the child's report to the test."""
    print(json.dumps(fields), flush=True)


def stop_decoding_at(row: int, file: str, seconds: float = 120.0) -> None:
    """Child side: make cachekit's images decoder, at its decode of row ``row`` (with one
    worker rows are decoded in order), create ``file`` and wait there up to ``seconds`` for
    the test's signal (SIGINT or SIGKILL)."""
    import cachekit.engine.decoding.images as images

    decode, decoded = images.load_image, [0]

    def load_image(*args: Any, **kwargs: Any) -> Any:
        decoded[0] += 1
        if decoded[0] == row + 1:
            Path(file).touch()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the signal lands here
        return decode(*args, **kwargs)

    images.load_image = load_image
