"""A root a team shares: what a member's k-fold entries of a teammate's entry cost on disk
and in time, as ratios in one run.

    python benchmarks/bench_team.py                  # 4,000 covers at 64x64, 3 rounds
    python benchmarks/bench_team.py --quick          # 200 covers: checks the script

It needs root: the teammate and the member are two plain uids of one group that share the
root the README way (the tests' ``users.py``). A build never links another user's files
(their owner could change them), so a member copies a teammate's rows. Each round, in two
such roots of its own: the teammate builds the full entry of the N covers (Pillow, one
worker); the member then makes the 10 calls of a shuffled 5-fold split (5 training and 5
validation columns, in one process), in one root with the defaults and in the other with
``contiguous=True``, where every entry is a copy of its rows (what each of a member's folds
cost before it linked the member's own copies). The figures: the bytes the member's entries
add to the root (each file once, as ``du`` counts) against the full entry alone (one copy
of the rows is 1x), and the member's 10 calls against the teammate's fresh build.

A figure is the median of the rounds, with every round's value shown.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's cachekit, whatever else is installed
sys.path.insert(0, str(HERE))  # bench_storage, next to this file
sys.path.insert(0, str(HERE.parent / "tests"))  # users.py: the tests' plain uids
from bench_storage import SIZE, disk, fold_columns, report  # noqa: E402

CALLS = textwrap.dedent(r'''
    """One member's calls (Pillow, one worker): config columns (lists of paths) and
    contiguous; reports the seconds they took together."""
    import json, sys, time
    from pathlib import Path

    import cachekit
    from hosts import report

    root, config = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    cache = cachekit.Cache(root, workers=1, progress=False)
    started = time.perf_counter()
    for column in config["columns"]:
        cache.images(column, config["size"], backend="pil", contiguous=config["contiguous"])
    report(seconds=time.perf_counter() - started)
''')


def say(text: str) -> None:
    print(f"[bench_team] {text}", file=sys.stderr, flush=True)


def member_folds(paths: list[str], work: Path, contiguous: bool) -> tuple[float, float]:
    """In a new shared root under ``work``: (bytes the member's fold entries add / the
    teammate's full entry, the member's 10 calls s / the teammate's build s)."""
    import users
    from hosts import finish

    shared = users.make_shared_root(work)
    try:
        def run(member: Any, name: str, columns: list[list[str]]) -> float:
            config = shared.write_json(f"{name}.json", {"columns": columns, "size": SIZE,
                                                        "contiguous": contiguous})
            done = finish(member.python(shared.script(CALLS), shared.root, config), 3600)
            if not done.ok:
                raise SystemExit(done.failure())
            return float(done.report()["seconds"])

        build_s = run(shared.attacker, "full", [paths])
        full = disk(shared.root)
        calls_s = run(shared.victim, "folds", fold_columns(paths))
        return (disk(shared.root) - full) / full, calls_s / build_s
    finally:
        shared.kill_all()


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--covers", type=int, help="default 4,000 (--quick: 200)")
    parser.add_argument("--rounds", type=int, help="default 3 (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.covers = args.covers or (200 if args.quick else 4000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    import users
    from cachekit.samples import write_sample_images

    why_not = users.why_no_two_uids()
    if why_not is not None:
        raise SystemExit(f"bench_team: {why_not}")
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="cachekit-bench-team-") as scratch:
        base = Path(scratch)
        base.chmod(0o755)  # (the members read the covers here)
        say(f"writing {args.covers} covers")
        paths = write_sample_images(base / "covers", args.covers, seed=11)
        for i in range(args.rounds):
            figures: dict[str, float] = {}
            for contiguous, how in ((False, ""), (True, ", contiguous=True")):
                say(f"round {i + 1} of {args.rounds}{how}")
                work = base / f"round-{i}{'-contiguous' if contiguous else ''}"
                work.mkdir()
                added, calls = member_folds(paths, work, contiguous)
                figures[f"member's 10 folds{how}: bytes added / full entry"] = added
                figures[f"member's 10 fold calls{how} s / teammate's build s"] = calls
            rounds.append(figures)
    return report(args, rounds)


if __name__ == "__main__":
    main()
