"""The performance budget (hits, cold builds, racing agents, build memory, reading: each
check's label states its target), checked against one run's figures.

Each check gives the target, what this run measured, and whether it was met (None when a
figure it needs was not measured). Labels are those ``run.py`` gives its rows.
"""

from __future__ import annotations

from typing import Optional

from bench_report import Report, fmt

Check = tuple[str, str, Optional[bool]]


def checks(report: Report) -> list[Check]:
    out: list[Check] = []

    def median(section: str, label: str) -> Optional[float]:
        row = report.row(section, label)
        return row.median if row else None

    for dtype in ("object", "str (pyarrow)", "str (python)", "str"):
        hit = median("hit", f"cachekit, {dtype}")
        if hit is None:
            continue
        out.append((f"hit, {dtype} column: well under 0.1 s", fmt(hit, "s"), hit < 0.1))
        joblib = median("hit", f"joblib.Memory, {dtype}")
        if joblib is not None:
            out.append((f"hit, {dtype} column: no slower than joblib.Memory",
                        f"{fmt(hit, 's')} vs {fmt(joblib, 's')}", hit <= joblib))
        ours, theirs = (report.row("hit", f"{who}, {dtype}")
                        for who in ("cachekit", "joblib.Memory"))
        if ours and theirs and "with_import" in ours.extra and "with_import" in theirs.extra:
            mine, peer = ours.extra["with_import"], theirs.extra["with_import"]
            out.append((f"hit, {dtype} column, each library's import counted: no slower "
                        "than joblib.Memory", f"{fmt(mine, 's')} vs {fmt(peer, 's')}",
                        mine <= peer))
    hit, seed = median("hit", "cachekit, object"), median("hit", "seed torch.load, object")
    if hit and seed:
        out.append(("hit: at least 100x faster than the seed's torch.load",
                    f"{seed / hit:,.0f}x", seed / hit >= 100))

    serial = median("build", "seed serial loop")
    for label in ("cachekit exact, 2 workers", "cachekit draft, 2 workers"):
        rate = median("build", label)
        if rate and serial:
            out.append((f"cold build ({label}): at least 3x the seed's serial loop",
                        f"{rate / serial:.2f}x", rate / serial >= 3))
    one, two = median("build", "cachekit exact, 1 worker"), median("build", "cachekit exact, 2 workers")
    if one and two:
        out.append(("cold build: 2 workers close to 2x one worker (>= 1.7x)",
                    f"{two / one:.2f}x", two / one >= 1.7))

    race = report.row("agents_cpu", "cachekit")
    if race and race.extra:
        rows = report.meta.get("agents_rows")
        out.append(("4 agents missing at once: one build, not 4",
                    f"{race.extra['builders']:.0f} of 4 decoded; {race.extra['cpu_after_start']:.1f}"
                    f" CPU s after the start" + (f" for {rows:,} rows" if rows else ""),
                    race.extra["builders"] == 1))

    rss = [r for r in report.section_rows("rss") if r.cachekit]
    if len(rss) == 2:
        small, large = sorted(rss, key=lambda r: r.extra["rows"])
        grew = large.extra["anon_mb"] - small.extra["anon_mb"]
        out.append((f"build memory independent of N ({small.extra['rows']:,.0f} -> "
                    f"{large.extra['rows']:,.0f} rows: anon growth < 20 MB)",
                    f"anon {grew:+.0f} MB, RSS {large.median - small.median:+.0f} MB",
                    abs(grew) < 20))

    for workers in (0, 2):
        ours = median("dataloader", f"cachekit entry.dataset(), num_workers={workers}")
        ram = median("dataloader", f"in-RAM uint8 tensor, num_workers={workers}")
        if ours and ram:
            out.append((f"DataLoader, num_workers={workers}: within reach of an in-RAM tensor "
                        "(>= 50%)",
                        f"{ours / ram:.0%} of it", ours / ram >= 0.5))
    share = median("pss", "4 readers of one entry: summed PSS of data.npy / entry size")
    if share is not None:
        out.append(("4 readers share one page-cache copy (summed PSS of the data < 1.5x)",
                    f"{share:.2f}x the entry",
                    share < 1.5))
    return out


def markdown(report: Report) -> list[str]:
    rows = checks(report)
    if not rows:
        return []
    lines = ["| budget | this run | met |", "|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "?"}
    lines += [f"| {target} | {measured} | {verdict[ok]} |" for target, measured, ok in rows]
    return lines
