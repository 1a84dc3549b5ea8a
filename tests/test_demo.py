"""`cachekit demo`, the README's first command, runs end to end and tells the truth."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def test_demo_builds_once_and_reports_hits(tmp_path):
    result = subprocess.run(
        ["cachekit", "--root", str(tmp_path / "root"), "demo", "--images", "24", "--agents", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("built the entry") == 1
    assert len(re.findall(r"agent \d \(pid \d+\): hit", out)) >= 3  # the whole warm wave
    joined = len(re.findall(r"agent \d \(pid \d+\): joined the build", out))
    assert f"{5 - joined} of 6 agents decoded nothing" in out
    # each joiner's own words, relayed: it joined, and how much it filled
    assert len(re.findall(r"its stderr: cachekit\[pid \d+\]: joined the build of entry \w+ by pid \d+ .*"
                          r"filled \d+ of its \d+ chunks", out)) >= joined
    if joined:  # the builder's own words: who joined, and the rows each computed
        assert len(re.findall(rf"its stderr: cachekit\[pid \d+\]: built entry \w+ with "
                              rf"{joined} joining process(es)?, which computed \d+ of its 24 "
                              r"rows \(pid \d+ on .*\); this process made the other \d+", out)
                   ) == 1, out
    # it says where the images and the race were, that both are gone, that the user's cache
    # got nothing (no entry, no sample images: nothing `ls` or `clear` would have to find),
    # and what to try next
    samples = re.search(r"24 cover-like JPEGs .* in (\S+)\n", out)
    race = re.search(r"raced in a temporary cache, (\S+), now removed with the sample images", out)
    assert samples and race and not Path(samples.group(1)).exists()
    assert not Path(race.group(1)).exists() and not Path(race.group(1)).parent.exists()
    assert f"nothing of your cache at {tmp_path / 'root'} was made or touched" in out
    assert not (tmp_path / "root").exists()
    assert "cachekit build train.csv --column img_path --size 32x32" in out
    assert 'cachekit.Cache().images(pd.read_csv("train.csv")["img_path"], size=32)' in out


def test_demo_rejects_nonsense_sizes(tmp_path):
    result = subprocess.run(["cachekit", "--root", str(tmp_path), "demo", "--agents", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "positive integer" in result.stderr
