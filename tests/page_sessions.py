"""The interpreters that run a markdown page's python blocks, for tests/test_examples.py.

A :class:`PythonSession` runs the blocks of one page in order, in one namespace, as the
cells of a notebook. It is a fresh ``python`` by default. Given a :class:`Zygote`, it is a
fork of that one long-lived interpreter, which imported the heavy third-party modules once
(torch alone is about three seconds of CPU, paid before by each of the dozen pages that
decode images). The fork then takes the page's folder and environment and imports what the
page imports, as a fresh interpreter would; cachekit itself is never imported before that.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

BLOCK_TIMEOUT = 180.0  # seconds; generous for a loaded machine, never hit by a sane block
ZYGOTE_MODULES = ("numpy", "pandas", "PIL.Image", "torch")
"""What the zygote imports: third-party modules only, which read nothing of a page."""

_SESSION = r"""
import sys


def _serve():
    import importlib, json, os, traceback
    requests, replies = os.fdopen(int(sys.argv[1])), os.fdopen(int(sys.argv[2]), "w")
    replies.write(json.dumps({"pid": os.getpid()}) + "\n")
    replies.flush()
    for name in sys.argv[3:]:  # what the page's blocks import anyway, while others run
        try:
            importlib.import_module(name)
        except Exception:
            pass  # the block that imports it reports the error
    # The blocks run in __main__'s own namespace, as a script's code would, so that what
    # they define pickles by reference (a process pool's workers find it after a fork).
    namespace = sys.modules["__main__"].__dict__
    saved = os.dup(1), os.dup(2)
    for line in requests:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1), os.dup2(log, 2), os.close(log)
        ok, printed, stdout = True, {}, sys.stdout
        try:
            # Padded so that line numbers in tracebacks are the markdown file's own.
            code = compile("\n" * (request["line"] - 1) + request["code"], request["file"],
                           "exec")
            sys.stdout = _ByLine(stdout, code, printed)
            exec(code, namespace)
        except BaseException:
            ok = False
            traceback.print_exc()
        finally:
            sys.stdout = stdout
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        replies.write(json.dumps({"ok": ok, "printed": printed}) + "\n")
        replies.flush()
    return replies  # kept open till the process ends, after its atexit work: see close()


class _ByLine:
    # sys.stdout while a block runs: what is written goes on to the real stream, and is
    # noted under the line of the block (its own code, not a function's) that was running.

    def __init__(self, stream, code, printed):
        self._stream, self._code, self._printed = stream, code, printed

    def write(self, text):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self._code:
            frame = frame.f_back
        if frame is not None:
            line = str(frame.f_lineno)
            self._printed[line] = self._printed.get(line, "") + text
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


_replies = _serve()
"""

_ZYGOTE = r"""
import importlib, json, os, socket, sys


def _become_session(request, fds, control):
    # In the fork: this page's folder, environment and arguments, in a __main__ holding
    # nothing of the zygote's, then the session's code, then the interpreter's own exit.
    import os, sys

    control.close()
    os.setsid()  # its own process group, which the test process may kill as one
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-c", str(fds[0]), str(fds[1]), *request["preload"]]
    namespace = sys.modules["__main__"].__dict__
    kept = {k: namespace[k] for k in ("__name__", "__doc__", "__builtins__", "__spec__",
                                      "__loader__", "__package__") if k in namespace}
    namespace.clear()
    namespace.update(kept)
    exec(request["session"], namespace)
    raise SystemExit(0)


for name in sys.argv[2:]:
    importlib.import_module(name)
control = socket.socket(fileno=int(sys.argv[1]))
while True:
    message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
    if not message:
        break  # the test process is done with us, or gone
    child = os.fork()
    if child == 0:
        if os.fork() == 0:  # the session is a grandchild: nobody here need reap it
            _become_session(json.loads(message), fds, control)
        os._exit(0)
    for fd in fds:
        os.close(fd)
    os.waitpid(child, 0)
"""


class Zygote:
    """One interpreter that imported :data:`ZYGOTE_MODULES`, forking a page's session per
    request. Its environment is a page's but for the page's own variables, which each fork
    takes on (``env`` must differ from a page's only in those)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, str(theirs.fileno()), *ZYGOTE_MODULES],
            env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()

    def fork(self, cwd: Path, env: dict[str, str], preload: Sequence[str],
             fds: tuple[int, int]) -> None:
        request = {"cwd": str(cwd), "env": env, "preload": list(preload), "session": _SESSION}
        socket.send_fds(self._control, [json.dumps(request).encode()], list(fds))

    def close(self) -> None:
        self._control.close()  # its end: the zygote's loop stops (also if this process dies)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PythonSession:
    """One interpreter that runs python blocks in order, in one namespace: a fresh one, or a
    fork of ``zygote``."""

    def __init__(self, cwd: Path, env: dict[str, str], preload: Sequence[str] = (),
                 zygote: Optional[Zygote] = None) -> None:
        to_child, self._requests = os.pipe()
        self._replies, from_child = os.pipe()
        self.proc: Optional[subprocess.Popen] = None
        if zygote is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SESSION, str(to_child), str(from_child), *preload],
                cwd=cwd, env=env, stdin=subprocess.DEVNULL, pass_fds=(to_child, from_child))
        else:
            zygote.fork(cwd, env, preload, (to_child, from_child))
        os.close(to_child)
        os.close(from_child)
        self._send = os.fdopen(self._requests, "w")
        self._receive = os.fdopen(self._replies)
        self._pid: Optional[int] = None

    @property
    def pid(self) -> Optional[int]:
        """The interpreter's process id, from the line it says first (None: it never did)."""
        if self._pid is None:
            hello = _read_line(self._receive, BLOCK_TIMEOUT)
            self._pid = json.loads(hello)["pid"] if hello else -1
        return self._pid if self._pid > 0 else None

    def run(self, block, log: Path) -> tuple[bool, str]:
        """Run ``block``; (succeeded, its output). What each line of it printed is then in
        ``printed`` (markdown line -> text)."""
        self.printed: dict[int, str] = {}
        if self.pid is None:
            return False, "(the interpreter never started)"
        self._send.write(json.dumps({"code": block.code, "line": block.first_code_line,
                                     "file": str(block.page), "log": str(log)}) + "\n")
        self._send.flush()
        reply = _read_line(self._receive, BLOCK_TIMEOUT)
        output = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        if reply is None:
            self.close()
            status = self.proc.returncode if self.proc is not None else "unknown, a fork"
            return False, output + f"\n(the interpreter died or hung; exit status {status})"
        answer = json.loads(reply)
        self.printed = {int(line): text for line, text in answer["printed"].items()}
        return answer["ok"], output

    def finish(self) -> None:
        """Let the interpreter exit (it does once its requests end), without waiting."""
        _close(self._send)
        if self.proc is not None:
            _close(self._receive)  # a fork's end is seen on it: :meth:`close` waits there

    def close(self) -> None:
        """Let the interpreter exit and wait for it (30 s at most, then kill it)."""
        self.finish()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return
        if self._receive.closed:
            return
        pid = self.pid  # a fork is not this process's child: its end is its replies' end
        if pid is not None and not _ends_within(self._receive, 30):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _close(self._receive)


def _close(f) -> None:
    try:
        f.close()
    except OSError:
        pass


def _read_line(f, timeout: float) -> Optional[str]:
    ready, _, _ = select.select([f], [], [], timeout)
    if not ready:
        return None
    return f.readline() or None


def _ends_within(f, timeout: float) -> bool:
    """Whether ``f`` reaches its end (every writer closed it) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([f], [], [], left)[0] and not f.readline():
            return True
    return False
