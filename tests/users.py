"""Plain numeric users sharing one group, for tests of a cache root that a team shares.

A team shares a root the README way: group-owned, setgid, every job under ``umask 002``, so
any member can write anywhere under it. Here the members are bare numeric ids with no
``/etc/passwd`` entry: :data:`VICTIM_UID` and :data:`ATTACKER_UID`, both with the primary and
only supplementary group :data:`GID`.

How a child becomes such a user (this needs root): the parent starts ::

    unshare --mount --propagation private -- sh -c MOUNTS sh \\
        PYTHON -I -S -c BOOTSTRAP UID GID UMASK HOME  PYTHON SCRIPT ARGS...

- ``MOUNTS`` runs as root in the child's own mount namespace and makes the interpreter,
  the checkout and the test's directory reachable for the plain uid without changing
  anything on the real system: plain ``setuid`` fails here because the interpreter lives
  under ``/root`` (mode 0700), and pytest's ``tmp_path`` under ``/tmp/pytest-of-root``
  (0700 too). For each such path the highest ancestor that others cannot search gets a
  fresh tmpfs (mode 0755) over it in the child's namespace, and the path itself is bound
  back at the same place. Paths stay identical for parent and child (the interpreter's
  prefix, ``RPATH`` and every file name a test compares), and nothing leaks out
  (``--propagation private``; :func:`why_no_two_uids` checks).
- ``BOOTSTRAP`` does ``setgroups([GID]); setgid(GID); setuid(UID); umask(UMASK)``, checks
  that all real, effective and saved ids changed, enters ``HOME`` and ``exec``\\ s a fresh
  interpreter for the script, so nothing of the user's run (not even ``site``) runs as root.

Parent side: :func:`make_shared_root` lays out one test's directories and returns a
:class:`SharedRoot`; :meth:`User.python` and :meth:`User.cli` start children, which report
through stdout JSON and their exit status (:func:`hosts.finish`, :func:`hosts.report`);
:class:`hosts.StartBarrier` synchronises them; :meth:`SharedRoot.kill_all` ends them all.
Children import only ``hosts`` (standard library) and what their script needs.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from hosts import CHECKOUT, HostProcess, Launcher, child_env, kill_all

GID = 50000
VICTIM_UID = 50001
ATTACKER_UID = 50002
UMASK = 0o002
_TMPFS_NAME = "cachekit-users"
"""The source name of the covering tmpfs mounts, to recognise them in /proc/self/mounts."""

_BOOTSTRAP = textwrap.dedent("""
    import os, sys
    uid, gid, mask, home = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3], 8), sys.argv[4]
    os.setgroups([gid]); os.setgid(gid); os.setuid(uid); os.umask(mask)
    if (os.getresuid(), os.getresgid(), os.getgroups()) != ((uid,) * 3, (gid,) * 3, [gid]):
        raise SystemExit(f"bootstrap: still {os.getresuid()} {os.getresgid()} {os.getgroups()}")
    os.chdir(home)
    os.execv(sys.argv[5], sys.argv[5:])
""")


def interpreter_paths() -> list[Path]:
    """What a child needs of this interpreter: its prefixes (lib, site-packages, libpython)."""
    found = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found.add(Path(sys.executable).resolve().parent.parent)
    return sorted(found)


def exposure_plan(paths: Sequence[Path]) -> list[tuple[Path, list[Path]]]:
    """(cover, paths under it) for every path others cannot reach: the cover is the highest
    ancestor that others cannot search. Paths nested in another one are dropped (reachable
    through it); a path that is itself unsearchable for others is an error."""
    wanted = sorted({Path(p).resolve() for p in paths})
    wanted = [p for p in wanted if not any(q != p and q in p.parents for q in wanted)]
    plan: dict[Path, list[Path]] = {}
    for path in wanted:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            raise ValueError(f"{path} itself is not searchable by others (mode "
                             f"{stat.filemode(os.stat(path).st_mode)}); expose a child of it")
        cover = next((a for a in reversed(path.parents)
                      if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if cover is not None:
            plan.setdefault(cover, []).append(path)
    return sorted(plan.items())


@functools.lru_cache(maxsize=None)
def _stage() -> Path:
    """Empty directories for this session's children to park bind mounts on while they
    cover an ancestor (each child's mounts live in its own namespace, so all may share)."""
    stage = Path(tempfile.mkdtemp(prefix="cachekit-users-stage-"))
    atexit.register(shutil.rmtree, stage, True)
    return stage


def mount_script(paths: Sequence[Path]) -> str:
    """The shell text, run as root in a fresh mount namespace, that makes ``paths``
    reachable for any uid and then runs ``"$@"``."""
    plan = exposure_plan(paths)
    stage = _stage()
    for cover, _ in plan:
        if cover == stage or cover in stage.parents:
            raise ValueError(f"the stage directory {stage} lies under {cover}; set TMPDIR")
    staged = [(path, stage / str(i)) for i, path in
              enumerate(p for _, under in plan for p in under)]
    q = shlex.quote
    lines = ["set -e", "umask 022"]
    for path, parked in staged:
        parked.mkdir(exist_ok=True)
        lines.append(f"mount --bind {q(str(path))} {q(str(parked))}")
    for cover, _ in plan:
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m,nosuid,nodev {_TMPFS_NAME} "
                     f"{q(str(cover))}")
    for path, parked in staged:
        lines += [f"mkdir -p {q(str(path))}", f"mount --bind {q(str(parked))} {q(str(path))}",
                  f"umount {q(str(parked))}"]
    lines.append('exec "$@"')
    return "\n".join(lines)


def launch_argv(uid: int, gid: int, home: Path, argv: Sequence[str],
                expose: Sequence[Path]) -> list[str]:
    """The argv that runs ``argv`` (``argv[0]`` a Python interpreter) as ``uid``:``gid``
    with ``umask 002``, in ``home``, with ``expose`` and the interpreter reachable."""
    paths = [*interpreter_paths(), CHECKOUT, *expose]
    return ["unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", mount_script(paths), "sh",
            sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(uid), str(gid), oct(UMASK),
            str(home), *argv]


@dataclass
class User(Launcher):
    """One team member: a bare uid in group :data:`GID`, with a home of its own under the
    test's directory. Every process it starts is recorded in ``processes``."""

    name: str
    uid: int
    home: Path
    base: Path
    processes: list[HostProcess]
    gid: int = GID

    def _launch(self, command: list[str], env: Optional[Mapping[str, str]]
                ) -> tuple[list[str], dict[str, str]]:
        extra = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
                 **(env or {})}
        return (launch_argv(self.uid, self.gid, self.home, command, [self.base]),
                child_env(extra))

    def cli(self, root: Path, *args: object,
            env: Optional[Mapping[str, str]] = None) -> HostProcess:
        """Run ``python -m cachekit --root ROOT ARGS...`` as this user."""
        return self.run_cli(root, *args, env=env)


@dataclass
class SharedRoot:
    """One test's directories: ``base`` (reachable by the users; all else lives in it),
    ``root`` (the cache root: root:GID, mode 2775), ``work`` (scripts, configs and
    barriers: mode 1777, so both users create files there and neither removes the
    other's), and the users ``victim`` and ``attacker`` with homes ``base/NAME-home``."""

    base: Path
    root: Path
    work: Path
    victim: User
    attacker: User
    processes: list[HostProcess] = field(default_factory=list)

    def script(self, source: str) -> Path:
        """Write ``source`` to ``work`` (root-owned, 0644), named by its hash, so every run
        of one text is one file and the functions defined in it key alike."""
        path = self.work / f"script_{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
        if not path.exists():
            path.write_text(source)
            path.chmod(0o644)
        return path

    def write_json(self, name: str, value: Any) -> Path:
        """Write ``value`` as ``work/NAME`` (root-owned, 0644), e.g. a child's config."""
        path = self.work / name
        path.write_text(json.dumps(value))
        path.chmod(0o644)
        return path

    def kill_all(self) -> None:
        """Kill every child still running, then reap them all (fixture teardown)."""
        kill_all(self.processes)


def make_shared_root(tmp_path: Path) -> SharedRoot:
    """Lay out ``tmp_path/shared`` (see :class:`SharedRoot`) and return it."""
    base = tmp_path / "shared"
    base.mkdir()
    base.chmod(0o755)
    root, work = base / "cache", base / "work"
    root.mkdir()
    os.chown(root, 0, GID)
    root.chmod(0o2775)
    work.mkdir()
    work.chmod(0o1777)
    processes: list[HostProcess] = []
    team = []
    for name, uid in (("victim", VICTIM_UID), ("attacker", ATTACKER_UID)):
        home = base / f"{name}-home"
        home.mkdir()
        os.chown(home, uid, GID)
        home.chmod(0o755)
        team.append(User(name, uid, home, base, processes))
    return SharedRoot(base, root, work, team[0], team[1], processes)


_PROBE = textwrap.dedent("""
    import json, os, sys
    import numpy, cachekit
    print(json.dumps({"ids": [os.getresuid(), os.getresgid(), os.getgroups()],
                      "umask": os.umask(0o002), "cachekit": cachekit.__file__,
                      "cwd": os.getcwd()}))
""")


@functools.lru_cache(maxsize=None)
def why_no_two_uids() -> Optional[str]:
    """Why plain users cannot be simulated here, or None when they can (probed once per
    session, in a directory as unreachable for others as pytest's ``tmp_path``)."""
    if os.geteuid() != 0:
        return "running children as other uids needs root (setuid, unshare --mount)"
    for tool in ("unshare", "mount", "umount", "sh"):
        if shutil.which(tool) is None:
            return f"running children as other uids needs {tool!r} on PATH"
    with tempfile.TemporaryDirectory(prefix="cachekit-users-probe-") as scratch:
        shared = make_shared_root(Path(scratch))  # scratch is 0700, like tmp_path
        try:
            process = shared.victim.python(shared.script(_PROBE))
            try:
                stdout, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                return "a child as another uid did not finish within 60 s"
            if process.returncode != 0:
                return (f"cannot run a child as uid {VICTIM_UID} (exit {process.returncode}): "
                        f"{stderr.strip()[-500:]}")
            got = json.loads(stdout.splitlines()[-1])
        finally:
            shared.kill_all()
        uid, gid = VICTIM_UID, GID
        expected = {"ids": [[uid] * 3, [gid] * 3, [gid]], "umask": UMASK,
                    "cachekit": str(CHECKOUT / "cachekit" / "__init__.py"),
                    "cwd": str(shared.victim.home)}
        if got != expected:
            return f"a child as another uid is not what it should be: {got} != {expected}"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        if any(line.split()[0] == _TMPFS_NAME for line in mounts):
            return "a mount made in a child's private mount namespace leaked into this one"
    return None


def kind(path: Union[str, Path]) -> str:
    """What is at ``path`` without following it: file, dir, symlink, fifo, other, missing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    for name, test in (("symlink", stat.S_ISLNK), ("file", stat.S_ISREG),
                       ("dir", stat.S_ISDIR), ("fifo", stat.S_ISFIFO)):
        if test(mode):
            return name
    return "other"
