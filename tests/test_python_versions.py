"""cachekit runs on every Python that ``python_requires`` admits, not only the one CI has.

CI and the development machines run one interpreter (3.11); ``setup.cfg`` admits 3.10, the
default Python of many clusters. The stdlib grows keyword arguments and functions in each
version (``shutil.rmtree(dir_fd=...)`` is 3.11+, and cachekit called it once), which no
test on 3.11 can catch. vermin reads the source and names every such use.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def oldest_admitted() -> str:
    """The oldest Python ``setup.cfg``'s ``python_requires`` admits, e.g. "3.10"."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    found = re.fullmatch(r">=\s*(3\.\d+)", config["options"]["python_requires"].strip())
    assert found, config["options"]["python_requires"]
    return found[1]


def test_the_package_needs_nothing_newer_than_the_oldest_python_it_admits() -> None:
    oldest = oldest_admitted()
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())",
         "--quiet", "--no-tips", "--no-parse-comments", "--violations",
         f"--target={oldest}-", str(REPO / "cachekit")],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"needs a Python newer than {oldest}:\n{run.stdout}{run.stderr}"
