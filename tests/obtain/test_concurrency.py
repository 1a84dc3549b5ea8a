"""Several real interpreters racing on one key: exactly one builds, all read the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

AGENT = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from pathlib import Path
    import numpy as np, pandas as pd
    import cachekit, cachekit.engine.decoding.images

    root, paths_file, counter, start = sys.argv[1:5]
    decode = cachekit.engine.decoding.images.load_image

    def counted(path, *args, **kwargs):
        with open(counter, "a") as f:  # one line per decoded image, from any process
            f.write(f"{os.getpid()} {path}\\n")
        time.sleep(0.02)  # keep the build open long enough for every agent to miss
        return decode(path, *args, **kwargs)

    cachekit.engine.decoding.images.load_image = counted
    paths = pd.Series(Path(paths_file).read_text().splitlines())
    while not os.path.exists(start):  # start barrier: all agents ask at the same moment
        time.sleep(0.005)
    entry = cachekit.Cache(root, workers=2).images(paths, (16, 16), backend="pil")  # no torch
    print(json.dumps({"pid": os.getpid(), "hit": entry.hit, "key": entry.key,
                      "waited": entry.wait_seconds,
                      "sha": hashlib.sha256(np.asarray(entry.array).tobytes()).hexdigest()}))
""")


def test_four_interpreters_build_once_and_read_identical_bytes(tmp_path, cover_paths):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    paths_file = tmp_path / "paths.txt"
    paths_file.write_text("\n".join(cover_paths))
    counter, start = tmp_path / "decoded.txt", tmp_path / "start"
    agents = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), str(paths_file),
                          str(counter), str(start)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    time.sleep(1.0)  # let the interpreters import; the barrier makes the exact moment moot
    start.touch()
    reports = []
    for agent in agents:
        out, err = agent.communicate(timeout=120)
        assert agent.returncode == 0, err
        reports.append(json.loads(out))

    decoded = counter.read_text().splitlines()
    builders = {line.split()[0] for line in decoded}
    assert len(decoded) == len(cover_paths)  # every image decoded exactly once in total
    assert len(builders) == 1
    assert [r["hit"] for r in reports].count(False) == 1
    assert {str(r["pid"]) for r in reports if not r["hit"]} == builders
    assert len({r["key"] for r in reports}) == 1
    assert len({r["sha"] for r in reports}) == 1
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
