"""Every line cachekit says on stderr names its process: the pid, and the torchrun rank."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cachekit import messages

RANKLESS = {name: "" for name in messages.RANK_VARIABLES}


@pytest.mark.parametrize("env, named", [
    (RANKLESS, ""),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, " rank 3/4 local 1"),
    ({"RANK": "0", "WORLD_SIZE": "", "LOCAL_RANK": ""}, " rank 0"),
    ({"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": "2"}, " local 2"),
    ({"RANK": "one", "WORLD_SIZE": "-2", "LOCAL_RANK": "1\x1b[31m"}, ""),  # not a launcher's
])
def test_the_prefix_names_the_pid_and_the_rank(monkeypatch, env, named):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert messages.prefix() == f"cachekit[pid {os.getpid()}{named}]"


def test_say_writes_one_line_on_stderr(monkeypatch, capfd):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    messages.say("joined the build")
    out, err = capfd.readouterr()
    assert out == "" and err == f"cachekit[pid {os.getpid()} rank 1/2]: joined the build\n"


def test_no_library_module_prints_on_stderr_but_through_say():
    """A message printed straight to stderr, or a warning in words of its own, would name
    no process: only the command line (whose errors and results are its own) and
    messages.py print there."""
    package = Path(messages.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith("cli/") or relative in ("messages.py", "demo.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            to_stderr = any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr"
                            for k in node.keywords)
            own_words = called == "warnings.warn" and node.args and \
                ast.unparse(node.args[0]).lstrip("f").strip("'\"").startswith("cachekit")
            if (called == "print" and to_stderr) or own_words:
                offenders.append(f"{relative}:{node.lineno}")
    assert offenders == []


def test_a_rank_of_torchrun_is_named_in_a_real_message(tmp_path):
    """A real wait report in a process started as torchrun starts its ranks."""
    code = ("from cachekit.obtain.wait import Awaited, Wait, WAITING\n"
            "import time\n"
            "w = Wait('ab' * 16, None)\n"
            "answers = iter([WAITING] * 8 + [None])\n"
            "w.until(lambda s: time.sleep(0.2) or next(answers), "
            "Awaited('lock', lambda: 'pid 1 on h'), poll=0.2)\n")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"cachekit\[pid \d+ rank 1/2 local 1\]: waited 1 s for pid 1 on h "
                        r"to build entry abababababab\n", done.stderr), done.stderr


def test_lines_go_through_the_cachekit_logger_and_a_quiet_call_keeps_its_warnings(capfd):
    """An application sees every line as a record of the ``cachekit`` logger; within a
    quiet call (``Cache(progress=False)``) notes of the call's work go unsaid on stderr,
    warnings are said all the same."""
    import logging

    from cachekit.messages import prefix, quiet, say

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("cachekit")
    logger.addHandler(handler)
    try:
        say("a note")
        with quiet():
            say("a note of a quiet call")
            say("a warning", always=True)
    finally:
        logger.removeHandler(handler)
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "a note"), ("INFO", "a note of a quiet call"), ("WARNING", "a warning")]
    assert capfd.readouterr().err == f"{prefix()}: a note\n{prefix()}: a warning\n"


@pytest.mark.parametrize("say, said", [
    ("from cachekit.messages import say", r"cachekit\[pid \d+\]: "),
    ("from cachekit.cli.output import say as print_line\n"
     "say = lambda text: print_line(text, file=sys.stderr)", ""),  # the command line's own
], ids=["library", "command-line"])
def test_processes_sharing_one_stderr_never_split_each_other_s_lines(tmp_path, say, said):
    """Sweep agents and torchrun ranks share one log. With ``PYTHONUNBUFFERED`` (common in
    containers and job scripts, which want lines at once) stderr writes through, so a line
    written as its text and then its newline lets another process's line fall between the
    two. Each line goes out in one write, whole."""
    code = (f"import sys\n{say}\n"
            "for i in range(2000):\n    say(f'line {i} of {sys.argv[1]}')\n")
    log = tmp_path / "shared.log"
    with open(log, "ab") as shared:
        agents = [subprocess.Popen([sys.executable, "-c", code, str(n)], stderr=shared,
                                   env={**os.environ, **RANKLESS, "PYTHONUNBUFFERED": "1"})
                  for n in range(4)]
        assert [agent.wait(timeout=120) for agent in agents] == [0] * 4
    lines = log.read_text(encoding="utf-8").splitlines()
    whole = re.compile(said + r"line (\d+) of (\d)")
    assert [line for line in lines if not whole.fullmatch(line)] == []
    for n in range(4):
        assert [int(m[1]) for m in map(whole.fullmatch, lines) if m[2] == str(n)] == \
            list(range(2000))
