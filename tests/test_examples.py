"""Every code block of README.md and docs/*.md runs, or says why it does not.

The rules (docs/index.md, "About the examples", says the same for readers):

- A fenced block's language decides what runs. ```python: the block's code, in a Python
  interpreter. ```console: each line that starts with "$ " is a shell command (a line
  ending in a backslash continues on the next); the lines under a command, up to the next
  one, are what it prints: its stdout and stderr together, in the order written, must be
  those lines (each compared without trailing spaces, ``...`` standing for any text, as in
  a claim below). A command with no lines under it is not compared. Every command must exit
  with status 0.
- An HTML comment line directly above the opening fence marks a block:
  ``<!-- not run: REASON -->`` skips it, and the reason must not be empty (the same marker
  may instead follow the language on the opening fence, ```` ```console not run: REASON ````,
  which renders as nothing and keeps HTML comments out of the README's first screen);
  ``<!-- needs: s3 -->`` runs it with the environment of the ``s3_env`` fixture (a test S3
  server; CACHEKIT_REMOTE and the AWS_* variables), and the placeholder URL
  ``s3://bucket/prefix`` in its code stands for that server's $CACHEKIT_REMOTE.
  A block in any other language (```bash, ```text, none) without ``not run`` fails, so a
  new block cannot silently go unrun.
- Each page runs in a temporary folder of its own holding sample data: covers/ with 24
  cover-like JPEGs and covers.csv with the columns img_path (relative paths, e.g.
  covers/cover_0_000000.jpg) and label (0, 1 or 2), made by cachekit.samples;
  CACHEKIT_DIR is ./cache there; the checkout is on PYTHONPATH and its interpreter first on
  PATH (``python``, ``cachekit``). Progress bars are off: stderr is not a terminal.
- The blocks of a page run in document order, each once. The python blocks of a page share
  one interpreter, like the cells of a notebook: a block may use what an earlier python
  block of the same page defined. The commands of one console block run in one bash
  process (a variable set on one line is seen on the next), with ``set -e``. Running a
  block first runs the page's earlier blocks (so ``-k`` picking one block still works).
- A page's python interpreter is forked from one that imported numpy, pandas, Pillow and
  torch once for all pages (:mod:`page_sessions`; never cachekit), then takes the page's
  folder and environment: each page would otherwise import torch again.
- A ``needs: s3`` block runs on its own, in a fresh interpreter or shell with the s3
  environment: it must not depend on other blocks.
- A comment ``# -> TEXT`` on a line of a python block claims what that line's statement
  prints (on stdout, from this interpreter; its last newline dropped): it must be TEXT, in
  which ``...`` stands for any text. So ``print(entry.source)  # -> built`` fails the
  block if it prints ``local``. A statement runs where the block's own line is running: a
  print inside a function, called from the line, is that line's; a statement inside a loop
  or an ``if`` is its own line's. Other comments are prose and are not compared.
- A failing block fails its test with the block's file:line and its output (stderr
  included; tracebacks point at lines of the markdown file). Later blocks of that page are
  skipped, naming the failed one.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import pytest

from page_sessions import BLOCK_TIMEOUT, PythonSession, Zygote

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = ("python", "console")
SAMPLE_IMAGES = 24
PLACEHOLDER_URL = "s3://bucket/prefix"  # in a `needs: s3` block: the test server's bucket

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
_MARK = re.compile(r"^\s*<!--\s*(not run|needs)\s*:(.*?)-->\s*$")
_FENCE_NOT_RUN = re.compile(r"^\s*(\S*)\s+not run\s*:(.*)$")  # ```console not run: REASON


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown page."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: Optional[str]  # the reason, "" when the marker has none; None: no marker
    needs: tuple[str, ...]

    @property
    def where(self) -> str:
        return self.at(self.line)

    def at(self, line: int) -> str:
        """``README.md:12``: line ``line`` of the block's page."""
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{line}"

    @property
    def first_code_line(self) -> int:
        return self.line + 1


def parse_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (CommonMark fences: ``` or ~~~, indented at most
    three spaces, closed by a fence of the same character at least as long), with the
    marker comments on the lines directly above each opening fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or (opening.group(2)[0] == "`" and "`" in opening.group(3)):
            i += 1
            continue
        indent, fence, info = opening.groups()
        end = i + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if (closing and closing.group(2)[0] == fence[0]
                    and len(closing.group(2)) >= len(fence) and not closing.group(3).strip()):
                break
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        not_run, needs = None, []
        above = i - 1
        while above >= 0 and (mark := _MARK.match(lines[above])):
            if mark.group(1) == "not run":
                not_run = mark.group(2).strip()
            else:
                needs += [n.strip() for n in mark.group(2).split(",") if n.strip()]
            above -= 1
        on_fence = _FENCE_NOT_RUN.match(info)
        if on_fence is not None:
            info, not_run = on_fence.group(1), on_fence.group(2).strip()
        language = info.strip().split()[0].lower() if info.strip() else ""
        blocks.append(Block(page, i + 1, language, "\n".join(body) + "\n", not_run,
                            tuple(needs)))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in parse_blocks(page)]


# --- what a block claims it prints ------------------------------------------------------

CLAIM = "# ->"


@dataclass(frozen=True)
class Claim:
    """A ``# -> TEXT`` comment: the statement of markdown line ``line`` prints ``text``."""

    line: int
    text: str

    def matches(self, printed: str) -> bool:
        """Whether ``printed`` (its last newline dropped) is the text, ``...`` standing for
        any text."""
        pattern = ".*".join(re.escape(part) for part in self.text.split("..."))
        return re.fullmatch(pattern, printed.removesuffix("\n"), re.DOTALL) is not None


def claims(block: Block) -> list[Claim]:
    """The ``# ->`` comments of a python block (real comments, not text in strings)."""
    if block.language != "python":
        return []
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(block.code).readline)
    for token in tokens:
        if token.type == tokenize.COMMENT and token.string.startswith(CLAIM):
            found.append(Claim(block.first_code_line + token.start[0] - 1,
                               token.string[len(CLAIM):].strip()))
    return found


def _statement_lines(block: Block) -> dict[int, tuple[int, int]]:
    """markdown line -> the (first, last) markdown lines of the innermost statement of the
    block that holds it: a claim and a print are compared by statement, whichever of its
    lines each names."""
    spans = sorted(((node.lineno, node.end_lineno or node.lineno)
                    for node in ast.walk(ast.parse(block.code)) if isinstance(node, ast.stmt)),
                   key=lambda span: span[0] - span[1])  # widest first: inner ones win
    offset = block.first_code_line - 1
    innermost: dict[int, tuple[int, int]] = {}
    for first, last in spans:
        for line in range(first, last + 1):
            innermost[line + offset] = (first + offset, last + offset)
    return innermost


def claim_problems(block: Block, printed: dict[int, str]) -> list[str]:
    """Each claim of ``block`` that what it printed (markdown line -> text, from
    :attr:`PythonSession.printed`) does not bear out, said with the claim's file:line."""
    found = claims(block)
    if not found:
        return []
    statement = _statement_lines(block)
    by_statement: dict[tuple[int, int], str] = {}
    for line, text in sorted(printed.items()):
        span = statement.get(line, (line, line))
        by_statement[span] = by_statement.get(span, "") + text
    problems = []
    for claim in found:
        span = statement.get(claim.line, (claim.line, claim.line))
        actual = by_statement.get(span, "")
        if not claim.matches(actual):
            problems.append(f"{block.at(claim.line)}: claims `{CLAIM} {claim.text}`, but the "
                            f"statement printed {actual.removesuffix(chr(10))!r}")
    return problems


# --- running -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    """A ``$ `` command of a console block: its markdown line, its text, and the lines the
    block shows under it (its sample output, until the next command)."""

    line: int
    text: str
    shown: tuple[str, ...]


def console_commands(block: Block) -> list[Command]:
    """The block's ``$ `` commands (a line ending in a backslash continues on the next),
    each with the output lines shown under it."""
    commands: list[list] = []  # [line, text, shown lines]
    continued = False
    for number, line in enumerate(block.code.splitlines(), block.first_code_line):
        if continued:
            commands[-1][1] += "\n" + line
        elif line.startswith("$ "):
            commands.append([number, line[2:], []])
        elif commands:
            commands[-1][2].append(line)
        continued = line.endswith("\\") and (continued or line.startswith("$ "))
    return [Command(number, text, tuple(shown)) for number, text, shown in commands]


def _marker(number: int) -> str:
    return f"@@cachekit-example-command-{number}@@"


_MARKER = re.compile(r"\n?@@cachekit-example-command-(\d+)@@\n")


def console_script(block: Block, markers: bool = False) -> str:
    """The block's "$ " commands as one bash script that stops at the first failure; with
    ``markers``, each command's output is preceded by a line naming the command's markdown
    line (:func:`split_console_output` takes them out again)."""
    commands = console_commands(block)
    if not commands:
        raise AssertionError(f"{block.where}: a console block with no `$ ` command; mark it "
                             "`<!-- not run: REASON -->` or use a ```text block")
    trap = 'trap \'echo "[exit status $?: $BASH_COMMAND]" >&2\' ERR'
    lines = ["set -eE -o pipefail", trap]
    for command in commands:
        if markers:  # bash's own printf, once the previous command has ended
            lines.append(f"printf '\\n%s\\n' '{_marker(command.line)}'")
        lines.append(command.text)
    return "\n".join(lines) + "\n"


def split_console_output(raw: str) -> tuple[str, dict[int, str]]:
    """(the output without the markers, markdown line of each command -> its output)."""
    parts = _MARKER.split(raw)
    printed = {int(line): text for line, text in zip(parts[1::2], parts[2::2])}
    return parts[0] + "".join(parts[2::2]), printed


def run_console(block: Block, cwd: Path, env: dict[str, str]
                ) -> tuple[bool, str, dict[int, str]]:
    """Run the console block; (succeeded, its output, each command's output by line)."""
    try:
        done = subprocess.run(["bash", "-c", console_script(block, markers=True)], cwd=cwd,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raw = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output
        output, printed = split_console_output(raw or "")
        return False, f"{output}\n(timed out after {BLOCK_TIMEOUT:g} s)", printed
    output, printed = split_console_output(done.stdout)
    return done.returncode == 0, output, printed


def console_problems(block: Block, printed: dict[int, str]) -> list[str]:
    """Each command of a console block whose shown output is not what it printed (stdout
    and stderr in the order written, lines compared without their trailing spaces, ``...``
    standing for any text). A command with nothing shown under it is not compared."""
    problems = []
    for command in console_commands(block):
        if not command.shown:
            continue
        shown = "\n".join(line.rstrip() for line in command.shown).strip("\n")
        actual = "\n".join(line.rstrip() for line in printed.get(command.line, "").splitlines())
        if not Claim(command.line, shown).matches(actual.strip("\n")):
            problems.append(f"{block.at(command.line)}: shows this output of `$ {command.text}`:"
                            f"\n{shown}\nbut it printed:\n{actual.strip(chr(10))}")
    return problems


def make_samples(folder: Path) -> None:
    """covers/*.jpg and covers.csv (img_path, label) in ``folder``: the examples' data."""
    import pandas as pd

    from cachekit.samples import write_sample_images

    paths = write_sample_images(folder / "covers", SAMPLE_IMAGES, seed=0)
    relative = [os.path.relpath(p, folder) for p in paths]
    pd.DataFrame({"img_path": relative, "label": [i % 3 for i in range(len(relative))]}
                 ).to_csv(folder / "covers.csv", index=False)


def base_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHEKIT_", "AWS_", "WANDB_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["CACHEKIT_DIR"] = str(folder / "cache")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.MULTILINE)


def imported_modules(blocks: Sequence[Block]) -> list[str]:
    """The top-level modules that the python blocks import, in order of first import."""
    names = [m for b in blocks if b.language == "python" for m in _IMPORT.findall(b.code)]
    return list(dict.fromkeys(names))


class Page:
    """A page's folder, its interpreter session and which of its blocks ran.

    The session starts at once, importing what the page's blocks import, so that the slow
    imports (torch takes seconds) overlap the blocks of the page before it."""

    def __init__(self, folder: Path, blocks: Sequence[Block], zygote: Zygote) -> None:
        self.folder = folder
        self.env = base_env(folder)
        self.done: dict[Block, bool] = {}
        self.session: Optional[PythonSession] = None
        in_order = [b for b in blocks if _runs_in_page_order(b) and b.language == "python"]
        if in_order:
            self.session = PythonSession(folder, self.env, imported_modules(in_order), zygote)
        self.logs = 0

    def run(self, block: Block, extra_env: Optional[dict[str, str]] = None) -> tuple[bool, str]:
        """Run ``block``; (succeeded, its output). A python block's claims, or a console
        block's shown output, are then checked: ``claim_problems`` holds those it failed."""
        self.claim_problems: list[str] = []
        ok, output, printed = self._run(block, extra_env)
        if ok:
            self.claim_problems = (console_problems(block, printed)
                                   if block.language == "console"
                                   else claim_problems(block, printed))
        return ok, output

    def _run(self, block: Block, extra_env: Optional[dict[str, str]]
             ) -> tuple[bool, str, dict[int, str]]:
        self.logs += 1
        log = self.folder.parent / f"{self.folder.name}-block-{self.logs}.log"
        if extra_env is not None:  # on its own, with the extra environment
            env = {**self.env, **extra_env}
            if "CACHEKIT_REMOTE" in env:
                block = replace(block, code=block.code.replace(PLACEHOLDER_URL,
                                                               env["CACHEKIT_REMOTE"]))
            if block.language == "console":
                return run_console(block, self.folder, env)
            alone = PythonSession(self.folder, env)
            try:
                return (*alone.run(block, log), alone.printed)
            finally:
                alone.close()
        if block.language == "console":
            return run_console(block, self.folder, self.env)
        if self.session is None:
            self.session = PythonSession(self.folder, self.env)
        return (*self.session.run(block, log), self.session.printed)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory, request):
    samples = tmp_path_factory.mktemp("samples")
    make_samples(samples)
    made: dict[Path, Page] = {}
    zygote = Zygote(base_env(samples))  # a page's environment but for CACHEKIT_DIR

    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) and "block" in item.callspec.params]
    order = list(dict.fromkeys(b.page for b in selected if _runs_in_page_order(b)))

    def make(path: Path) -> Page:
        if path not in made:
            folder = tmp_path_factory.mktemp(path.stem.lower())
            shutil.copytree(samples, folder, dirs_exist_ok=True)
            made[path] = Page(folder, [b for b in ALL_BLOCKS if b.page == path], zygote)
        return made[path]

    def page_of(path: Path) -> Page:
        page = make(path)
        if path in order and order.index(path) + 1 < len(order):
            make(order[order.index(path) + 1])  # its imports overlap this page's blocks
        return page

    try:
        yield page_of
    finally:
        try:
            for page in made.values():
                page.close()
        finally:
            zygote.close()


def marking_problem(block: Block) -> Optional[str]:
    """Why ``block`` is marked wrongly (so that it could go unrun silently), or None."""
    if block.not_run is not None:
        if not block.not_run:
            return f"{block.where}: `<!-- not run: -->` needs a reason after the colon"
        return None
    if block.language not in RUNNABLE:
        return (f"{block.where}: a ```{block.language} block is not runnable; make it "
                "```python or ```console, or put `<!-- not run: REASON -->` directly above "
                "its opening fence")
    unknown = set(block.needs) - {"s3"}
    if unknown:
        return f"{block.where}: unknown `needs` marker {sorted(unknown)}; known: s3"
    return None


def _runs_in_page_order(block: Block) -> bool:
    return block.not_run is None and block.language in RUNNABLE and not block.needs


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[f"{b.where}-{b.language or 'plain'}"
                                                  for b in ALL_BLOCKS])
def test_example(block: Block, pages, request) -> None:
    problem = marking_problem(block)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    if block.not_run is not None:
        pytest.skip(f"{block.where}: not run: {block.not_run}")
    page = pages(block.page)
    for earlier in [b for b in ALL_BLOCKS if b.page == block.page and b.line < block.line
                    and _runs_in_page_order(b)]:
        if earlier not in page.done:
            page.done[earlier], output = page.run(earlier)
            if not page.done[earlier]:
                pytest.fail(f"{earlier.where}: an earlier block of this page, run first, "
                            f"failed:\n{output}", pytrace=False)
        if not page.done[earlier]:
            pytest.skip(f"the earlier block {earlier.where} of this page failed")
    extra = dict(request.getfixturevalue("s3_env")) if "s3" in block.needs else None
    ok, output = page.run(block, extra)
    page.done[block] = ok
    if page.session is not None and all(b in page.done for b in ALL_BLOCKS
                                        if b.page == block.page and _runs_in_page_order(b)):
        page.session.finish()  # its exit (atexit work: wandb's, say) overlaps later pages
    if not ok:
        pytest.fail(f"{block.where}: this ```{block.language} block failed:\n{output}",
                    pytrace=False)
    if page.claim_problems:
        pytest.fail("\n".join(page.claim_problems) + f"\n--- the block's output ---\n{output}",
                    pytrace=False)


# --- the runner itself ------------------------------------------------------------------


def test_every_page_is_found_and_has_blocks() -> None:
    assert REPO / "README.md" in PAGES and (REPO / "docs" / "index.md") in PAGES
    assert sum(b.language in RUNNABLE and b.not_run is None for b in ALL_BLOCKS) >= 20


def test_the_parser_finds_fences_markers_and_line_numbers(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# t", "", "```python", "x = 1", "```", "", "<!-- needs: s3 -->", "~~~~console",
        "$ echo ```", "~~~~", "<!-- not run: needs a GPU -->", "```bash", "nvidia-smi",
        "```", "<!-- not run: -->", "```", "plain", "````", "",
        "```console not run: installs packages", "$ pip install -e .", "```",
        "```text not run:", "x", "```", "```text", "unclosed"]),
        encoding="utf-8")
    blocks = parse_blocks(page)
    assert [(b.line, b.language, b.not_run, b.needs) for b in blocks] == [
        (3, "python", None, ()), (8, "console", None, ("s3",)),
        (12, "bash", "needs a GPU", ()), (16, "", "", ()),
        (20, "console", "installs packages", ()), (23, "text", "", ()), (26, "text", None, ())]
    assert blocks[4].code == "$ pip install -e .\n"
    assert "needs a reason" in marking_problem(blocks[5])
    assert blocks[0].code == "x = 1\n" and blocks[1].code == "$ echo ```\n"
    assert blocks[3].code == "plain\n"  # a longer closing fence closes it


def test_unrunnable_or_unexplained_blocks_are_failures(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```bash", "ls", "```", "<!-- not run:   -->", "```python", "x", "```",
        "<!-- needs: gpu -->", "```python", "x", "```", "", "```", "plain", "```",
        "<!-- not run: output -->", "```text", "out", "```", "<!-- needs: s3 -->",
        "```console", "$ true", "```"]), encoding="utf-8")
    problems = [marking_problem(b) for b in parse_blocks(page)]
    assert f"{page}:1: a ```bash block is not runnable" in problems[0]
    assert "needs a reason" in problems[1]
    assert "unknown `needs` marker ['gpu']" in problems[2]
    assert "a ``` block is not runnable" in problems[3]
    assert problems[4:] == [None, None]


def test_console_lines_become_one_script() -> None:
    block = Block(REPO / "x.md", 1, "console",
                  "$ A=1 \\\n  B=2\noutput\n$ echo $A$B\n", None, ())
    script = console_script(block)
    assert script.endswith("A=1 \\\n  B=2\necho $A$B\n") and "output" not in script
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.stdout == "12\n"


def test_a_failing_python_block_reports_its_markdown_line(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text("intro\n\n```python\nx = 1\nraise ValueError(x)\n```\n", encoding="utf-8")
    (block,) = parse_blocks(page)
    session = PythonSession(tmp_path, base_env(tmp_path))
    try:
        ok, output = session.run(block, tmp_path / "log")
        assert not ok
        assert f'File "{page}", line 5' in output and "ValueError: 1" in output
        assert "raise ValueError(x)" in output  # the source line, read from the page
        ok, output = session.run(Block(page, 10, "python", "print(x + 1)\n", None, ()),
                                 tmp_path / "log2")
        assert ok and output == "2\n"  # one namespace per page
    finally:
        session.close()


def test_a_forked_page_session_is_the_pages_own_and_ends_when_asked(tmp_path) -> None:
    # What a fresh interpreter would have: the page's folder and environment, a __main__ of
    # its own, no cachekit before the page imports it; and its atexit work runs.
    samples, page = tmp_path / "samples", tmp_path / "page"
    samples.mkdir(), page.mkdir()
    zygote = Zygote(base_env(samples))
    try:
        session = PythonSession(page, base_env(page), (), zygote)
        code = ("import atexit, os, sys\n"
                "print(os.getcwd(), os.environ['CACHEKIT_DIR'], 'cachekit' in sys.modules,\n"
                "      sorted(n for n in dir() if not n.startswith('_')))\n"
                "atexit.register(lambda: open('exited', 'w').close())\n")
        ok, output = session.run(Block(page / "p.md", 1, "python", code, None, ()),
                                 tmp_path / "log")
        assert ok, output
        assert output == f"{page} {page / 'cache'} False ['atexit', 'os', 'sys']\n"
        session.close()
        assert (page / "exited").exists() and session.pid != zygote.proc.pid
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_a_failing_command_stops_its_block(tmp_path) -> None:
    block = Block(REPO / "x.md", 1, "console", "$ false\n$ echo unreachable\n", None, ())
    ok, output, _ = run_console(block, tmp_path, base_env(tmp_path))
    assert not ok and "unreachable" not in output and "exit status 1: false" in output


def test_a_console_block_shows_what_each_command_prints_or_fails(tmp_path) -> None:
    code = ("$ echo one; echo two >&2\none\ntwo\n$ true\n$ printf 'a  \\nb'\na\nb\n"
            "$ echo took 3 s || echo \\\n  never\ntook ... s\n$ echo built\nlocal\n")
    block = Block(tmp_path / "page.md", 10, "console", code, None, ())
    assert [(c.line, c.shown) for c in console_commands(block)] == [
        (11, ("one", "two")), (14, ()), (15, ("a", "b")), (18, ("took ... s",)),
        (21, ("local",))]
    ok, output, printed = run_console(block, tmp_path, base_env(tmp_path))
    assert ok and "@@" not in output and output.startswith("one\ntwo\n"), output
    assert console_problems(block, printed) == [
        f"{tmp_path / 'page.md'}:21: shows this output of `$ echo built`:\nlocal\n"
        "but it printed:\nbuilt"]  # stdout and stderr in order; `...`; trailing spaces


def test_the_readme_commands_are_those_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for command in ('pip install -e ".[dev]"', "python -m pytest -q -n 3 --dist worksteal"):
        assert command in ci.splitlines(), command
        assert command in readme, command
    assert "$ pip install -e . && cachekit demo\n" in readme  # the lean install: see test_demo


def _run_page(tmp_path: Path, *blocks: str) -> list[list[str]]:
    """Run python ``blocks`` as the cells of one page; each one's claim problems."""
    page = tmp_path / "page.md"
    page.write_text("".join(f"text\n\n```python\n{code}```\n\n" for code in blocks),
                    encoding="utf-8")
    session = PythonSession(tmp_path, base_env(tmp_path))
    problems = []
    try:
        for number, block in enumerate(parse_blocks(page)):
            ok, output = session.run(block, tmp_path / f"log{number}")
            assert ok, output
            problems.append(claim_problems(block, session.printed))
    finally:
        session.close()
    return problems


def test_a_wrong_output_claim_fails_and_a_right_one_passes(tmp_path) -> None:
    right, wrong = _run_page(
        tmp_path,
        'source = "local"\nprint(source)                 # -> local\n',
        'print(source)                 # -> built\nprint("# -> not a claim")\n')
    assert right == []
    assert wrong == [f"{tmp_path / 'page.md'}:11: claims `# -> built`, but the statement "
                     "printed 'local'"]


def test_claims_match_by_statement_with_ellipses(tmp_path) -> None:
    (problems,) = _run_page(tmp_path, textwrap.dedent('''\
        import sys
        def shout(text):
            print(text.upper())          # (a function's print is its caller's line's)
        shout("built")                   # -> BUILT
        if __name__ == "__main__":
            print("a", 1,
                  "b")                   # -> a 1 b
        print("took 0.42 s")             # -> took ... s
        print("nothing else"); x = 1     # -> nothing ...
        print("to stderr", file=sys.stderr)  # -> 
        x = 2                            # -> 2
        for i in range(2):
            print(i)                     # -> 0...1
        '''))
    assert problems == [f"{tmp_path / 'page.md'}:14: claims `# -> 2`, but the statement "
                        "printed ''"]  # a claim on a line that prints nothing fails


def test_the_readme_first_screen_says_what_it_is_the_demo_the_one_line_and_the_tests() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first_screen = "\n".join(readme.splitlines()[:40])
    in_order = ["preprocessing cache for PyTorch",                  # what it is
                "$ pip install -e . && cachekit demo\n",            # the lean install, the demo
                "`cachekit demo --csv covers.csv`",                  # a covers.csv in one command
                'entry = cachekit.Cache().images(df["img_path"], size=224)',
                "dataset = entry.dataset(",
                "$ python -m pytest -q -n 3 --dist worksteal\n"]    # the tests
    at = [first_screen.find(text) for text in in_order]
    assert -1 not in at and at == sorted(at), dict(zip(in_order, at))
    assert re.search(r"The tests take about \d+ minutes on a 2-core machine\.", first_screen)
    assert "<!--" not in first_screen  # the fences carry their `not run` markers
    assert readme.index("## What the demo prints") > readme.index("## The one call")
    # one table of this version's figures; the targets and misses are on docs/benchmarks.md
    benchmarks = readme[readme.index("## Benchmarks"):readme.index("## Documentation")]
    lines = benchmarks.splitlines()
    rulers = [i for i, line in enumerate(lines) if line.startswith("|---")]
    assert len(rulers) == 1 and "the field report's own" in benchmarks
    assert "target" not in lines[rulers[0] - 1] and "not met" not in readme


def test_the_readme_says_its_blocks_run_as_cells_and_claims_output() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "run like the cells of one notebook: in order, in one Python" in readme
    blocks = [b for b in ALL_BLOCKS if b.page == REPO / "README.md"]
    assert len([c for b in blocks for c in claims(b)]) >= 4  # the Dask block's among them
