"""`cachekit demo`, the README's first command, runs end to end and tells the truth."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def test_demo_csv_writes_the_sample_images_and_a_csv_a_training_script_reads(tmp_path):
    """`cachekit demo --csv covers.csv`, the README's way to get the training line's CSV."""
    def cachekit(*args):
        return subprocess.run(["cachekit", "--root", str(tmp_path / "root"), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)

    made = cachekit("demo", "--csv", "covers.csv", "--images", "5")
    assert made.returncode == 0, made.stderr
    lines = (tmp_path / "covers.csv").read_text(encoding="utf-8").splitlines()
    assert lines == ["img_path,label"] + [f"{tmp_path}/covers/cover_0_{i:06d}.jpg,{i % 3}"
                                          for i in range(5)]  # absolute: read from anywhere
    assert 'pd.read_csv("covers.csv")["img_path"], size=224)' in made.stdout
    assert not (tmp_path / "root").exists()  # sample data only: no cache, no race
    # a build decodes every one
    built = cachekit("build", "covers.csv", "--column", "img_path", "--size", "8x8")
    assert built.returncode == 0, built.stderr
    assert "built: 5 rows 5x3x8x8 uint8" in built.stderr
    # a CSV there already is the user's: it is not overwritten
    again = cachekit("demo", "--csv", "covers.csv", "--images", "2")
    assert again.returncode == 2 and "covers.csv exists already" in again.stderr
    assert len((tmp_path / "covers.csv").read_text(encoding="utf-8").splitlines()) == 6


def test_the_readme_newcomer_path_runs_as_written(tmp_path):
    """`cachekit demo --csv covers.csv`, then the README's first lines, in another folder:
    the `# ->` outputs it shows (24 covers) are what the newcomer gets."""
    made = subprocess.run(["cachekit", "demo", "--csv", "covers.csv"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import pandas as pd, cachekit\n"
        f"df = pd.read_csv({str(tmp_path / 'covers.csv')!r})\n"
        "entry = cachekit.Cache().images(df['img_path'], size=32)\n"
        "print(entry.source, entry.array.shape)\n"
        "fold = cachekit.Cache().images(df['img_path'][4:], size=32)\n"
        "print(fold.source, fold.rows_decoded, fold.rows_reused)\n")
    ran = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "CACHEKIT_DIR": str(tmp_path / "cache")})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["built (24, 3, 32, 32)", "built 0 20"]


def _distributions(requirements: str) -> list[str]:
    """The distribution names of setup.cfg requirement lines."""
    return [_name(line) for line in requirements.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ (]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(roots: list[str]) -> set[str]:
    """``roots`` and everything they require, as installed here (extras left out)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r.partition(";")[2]]
    return seen


def dev_only_modules() -> list[str]:
    """The top-level modules that only the dev extra brings (its packages and what they
    require, less everything install_requires brings): what a lean install lacks."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg", encoding="utf-8")
    core = _closure(_distributions(cfg["options"]["install_requires"]))
    dev = _closure(_distributions(cfg["options.extras_require"]["dev"])) - core
    normal = lambda d: d.lower().replace("_", "-")  # noqa: E731
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if any(normal(d) in dev for d in dists)
                  and not any(normal(d) in core for d in dists))


_HIDE = """
import sys

HIDDEN = set({modules!r})


class _Absent:
    # a meta path finder that makes the dev extra's modules look not installed
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: not in a lean "
                                      "install)", name=name)
        return None


sys.meta_path.insert(0, _Absent)
"""


def test_the_lean_install_runs_the_demo(tmp_path):
    """The README's `pip install -e . && cachekit demo`: the demo needs nothing of `dev`.
    Every module that only the dev extra brings is hidden, in the demo and its agents."""
    hidden = dev_only_modules()
    assert {"pytest", "hypothesis", "wandb", "distributed", "datasets", "cv2",
            "matplotlib", "s3fs"} <= set(hidden)
    hider = tmp_path / "hider"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(_HIDE.format(modules=hidden), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(hider), str(REPO), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import wandb"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "hidden: not in a lean install" in probe.stderr
    result = subprocess.run(
        [sys.executable, "-m", "cachekit", "--root", str(tmp_path / "root"), "demo",
         "--images", "24", "--agents", "2"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("built the entry") == 1, result.stdout
    assert re.search(r"\n[23] of 4 agents decoded nothing", result.stdout), result.stdout
