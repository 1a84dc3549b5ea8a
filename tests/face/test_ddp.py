"""examples/ddp_train.py, the script of docs/ddp.md, run with torchrun: two ranks share one
build.

torchrun's rendezvous store and gloo listen on sockets, so the job runs in a network
namespace of its own whose only interface is loopback (``unshare --net``; CI runs as root):
nothing it starts can be reached from outside this machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cachekit.samples import write_sample_images

REPO = Path(__file__).resolve().parents[2]
ROWS = 240
LINE = re.compile(r"rank (\d)/2: (\w+); decoded (\d+), joined (\d+), reused (\d+) of (\d+) "
                  r"rows; all ranks decoded (\d+)")
"""A rank's line. The ranks share one stdout, where one rank's text may come between another's
line and its newline, so lines are found anywhere in it."""


SCRIPT = REPO / "examples" / "ddp_train.py"
PAGE = REPO / "docs" / "ddp.md"


def test_the_page_links_the_script_and_quotes_only_its_own_lines():
    """docs/ddp.md holds no second copy of the script that could drift: it links the file,
    its excerpt is lines of the file, its command runs the file, and its sample output has
    the form of the lines the ranks print (below)."""
    page = PAGE.read_text(encoding="utf-8")
    assert "](../examples/ddp_train.py)" in page
    script = SCRIPT.read_text(encoding="utf-8").splitlines()
    blocks = re.findall(r"^```(\w+)[^\n]*\n(.*?)^```", page, re.S | re.M)
    excerpts = [code for language, code in blocks if language == "python"]
    assert len(excerpts) == 1 and all(line in script for line in excerpts[0].splitlines())
    assert any("$ torchrun --standalone --nproc_per_node=2 examples/ddp_train.py covers.csv"
               in code for language, code in blocks if language == "console")
    (sample,) = [code for language, code in blocks if language == "text"]
    assert [int(m[1]) for m in map(LINE.fullmatch, sample.splitlines()) if m] == [0, 1]


@pytest.fixture
def job(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("this test runs torchrun in a network namespace of its own: it needs root, "
                    "unshare and ip (CI has them)")
    paths = write_sample_images(tmp_path / "covers", ROWS)
    pd.DataFrame({"img_path": paths, "label": [i % 3 for i in range(ROWS)]}).to_csv(
        tmp_path / "covers.csv", index=False)
    return tmp_path


def _torchrun(work: Path) -> subprocess.CompletedProcess:
    # TMPDIR: torchrun writes its ranks' logs in a new temporary directory it leaves behind.
    env = {**os.environ, "CACHEKIT_DIR": str(work / "cache"), "GLOO_SOCKET_IFNAME": "lo",
           "TMPDIR": str(work),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = (f"ip link set lo up && exec {sys.executable} -m torch.distributed.run "
               f"--standalone --nproc_per_node=2 {shlex.quote(str(SCRIPT))} covers.csv")
    done = subprocess.run(["unshare", "--net", "--fork", "sh", "-c", command], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _ranks(done: subprocess.CompletedProcess) -> dict[int, tuple]:
    ranks = {int(m[1]): (m[2], *map(int, m.groups()[2:])) for m in LINE.finditer(done.stdout)}
    assert sorted(ranks) == [0, 1], done.stdout
    return ranks


def test_two_ranks_share_one_build_each_says_what_it_did_and_a_second_job_decodes_nothing(job):
    # One test, not two: each torchrun job starts three interpreters that import torch, the
    # suite's dearest kind, and the second job needs the first one's entry anyway.
    done = _torchrun(job)
    ranks = _ranks(done)
    sources = sorted(source for source, *_ in ranks.values())
    assert sources in (["built", "joined"], ["built", "local"]), ranks
    for source, decoded, joined, reused, rows, total in ranks.values():
        assert rows == ROWS and reused == 0
        if source == "local":  # waited for the build, which a slow start can leave no rows to join
            assert decoded == joined == 0
        else:
            assert decoded + joined == ROWS  # every row accounted for, on a rank that built
        assert total == ROWS  # and decoded once across the ranks (an all_reduce of the counts)
    assert sum(decoded for _, decoded, *_ in ranks.values()) == ROWS
    # Every line cachekit says names its rank; the builder's names whoever joined it.
    said = [line for line in done.stderr.splitlines() if line.startswith("cachekit")]
    assert said and all(re.match(r"cachekit\[pid \d+ rank [01]/2 local [01]\]: ", line)
                        for line in said), said
    builder = next(rank for rank, (source, *_) in ranks.items() if source == "built")
    if "joined" in sources:
        assert any(re.match(rf"cachekit\[pid \d+ rank {builder}/2 local {builder}\]: built entry "
                            r"\w+ with 1 joining process", line) for line in said), said

    again = _ranks(_torchrun(job))
    assert all(counts == ("local", 0, 0, 0, ROWS, 0) for counts in again.values()), again
