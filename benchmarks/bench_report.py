"""Results of a benchmark run: rows, the markdown table, the PNG chart, the machine line.

A :class:`Row` is one contestant's figure in one section, with every run kept; tables show
the median, the range, and the ratio to the section's cachekit row, said in words
("cachekit 3.1x faster") so the direction is never in doubt.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    unit: str
    higher_is_better: bool
    better: str  # the word for "cachekit is ahead": faster, less CPU, ...
    worse: str
    explain: str  # one sentence for the README and the table page
    log_scale: bool = False


SECTIONS: dict[str, Section] = {s.key: s for s in (
    Section("build", "Cold build", "images/s", True, "faster", "slower",
            "Images decoded and resized to 3x32x32 per second into an empty cache, in a fresh "
            "process (imports not timed), JPEGs warm in the page cache."),
    Section("hit", "Hit latency", "s", False, "faster", "slower",
            "First call of a fresh process (imports done) that finds the column stored, until "
            "it holds the result: a memmap (cachekit, joblib), a lazy Arrow dataset "
            "(datasets) or the unpickled Series (seed). cachekit loads its modules in that "
            "call, the others in their import, so the detail adds each import.",
            log_scale=True),
    Section("agents_wall", "4 agents at once, wall time", "s", False, "faster", "slower",
            "Four fresh interpreters released together (start-file barrier) on an empty cache, "
            "each wanting the column: seconds until the last one holds its data."),
    Section("agents_cpu", "4 agents at once, total CPU", "CPU s", False, "less CPU",
            "more CPU",
            "CPU seconds of every process of that race (the Manager's server included) from "
            "the children's rusage, interpreter start and imports included."),
    Section("rss", "Build peak RSS", "MB", False, "less memory", "more memory",
            "Peak resident memory (ru_maxrss) of the process that builds, at two sizes of "
            "the same cover set."),
    Section("dataloader", "DataLoader epoch throughput", "items/s", True, "faster", "slower",
            "Items per second of shuffled epochs of DataLoader(batch_size=256) over the "
            "entry and its alternatives, contestants taking turns (bench_dataloader.py).",
            log_scale=True),
    Section("pss", "4 readers, summed PSS", "x entry size", False, "less memory",
            "more memory",
            "Four fresh processes iterate the same entry; their proportional set sizes "
            "summed, over the entry's size: about 1 when they share one page-cache copy, 4 "
            "with a private copy each."),
)}
DETAIL_NOTES = {
    "hit": "detail: the median of the contestant's import (`import cachekit`, `import "
           "joblib`, ...; pandas already loaded) plus its first call, and of the calls after "
           "the first in the same process.",
    "agents_cpu": "detail: how many agents decoded images, and the CPU spent after the start "
                  "signal (imports excluded).",
    "rss": "detail: the peak of anonymous memory, which leaves out the page-cache pages of the "
           "output file the builder maps, and the growth from the smaller size.",
}


@dataclass
class Row:
    section: str
    label: str
    runs: list[float]
    ref: Optional[str] = None  # label of the cachekit row to compare with; None: a reference
    detail: str = ""
    cachekit: bool = False
    extra: dict[str, float] = field(default_factory=dict)  # numbers behind ``detail``

    @property
    def median(self) -> float:
        return statistics.median(self.runs)


@dataclass
class Report:
    rows: list[Row]
    meta: dict[str, Any]
    notes: dict[str, list[str]] = field(default_factory=dict)

    def row(self, section: str, label: str) -> Optional[Row]:
        return next((r for r in self.rows if r.section == section and r.label == label), None)

    def section_rows(self, key: str) -> list[Row]:
        return [r for r in self.rows if r.section == key]

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "notes": self.notes,
                           "rows": [asdict(r) for r in self.rows]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Report":
        raw = json.loads(text)
        return cls([Row(**r) for r in raw["rows"]], raw["meta"], raw["notes"])


def advantage(report: Report, row: Row) -> Optional[float]:
    """How many times better cachekit's reference row is than ``row`` (None: no reference)."""
    ref = report.row(row.section, row.ref) if row.ref else None
    if ref is None or ref.median <= 0 or row.median <= 0:
        return None
    section = SECTIONS[row.section]
    return ref.median / row.median if section.higher_is_better else row.median / ref.median


def advantage_text(report: Report, row: Row) -> str:
    if row.ref is None:
        return "reference" if row.cachekit else ""
    factor = advantage(report, row)
    if factor is None:
        return "n/a"
    section = SECTIONS[row.section]
    if row.cachekit:  # a cachekit variant: how it compares with the default
        return f"{_times(1 / factor)} the reference"
    if factor >= 1:
        return f"cachekit {_times(factor)} {section.better}"
    return f"cachekit {_times(1 / factor)} {section.worse}"


def not_ahead(report: Report) -> list[Row]:
    """Rows where cachekit's reference is not better than the contestant by over 5%."""
    out = []
    for row in sorted(report.rows, key=lambda r: list(SECTIONS).index(r.section)):
        if row.cachekit:
            continue
        factor = advantage(report, row)
        if factor is not None and factor <= 1.05:
            out.append(row)
    return out


def _times(factor: float) -> str:
    if factor >= 10:
        return f"{factor:,.0f}x"
    return f"{factor:.2f}x" if factor < 2 else f"{factor:.1f}x"


def fmt(value: float, unit: str = "") -> str:
    if unit == "s" and value < 1:
        return f"{value * 1000:.1f} ms" if value < 0.1 else f"{value * 1000:.0f} ms"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text}{'' if unit[:1] in ('/', 'x') else ' '}{unit}".strip()


# --- markdown ----------------------------------------------------------------------------

def markdown(report: Report, budget: Sequence[str] = ()) -> str:
    """The whole results page; ``budget``: table lines of the budget checks."""
    meta = report.meta
    lines = [
        "# cachekit benchmarks",
        "",
        f"Generated by `{meta['command']}` on {meta['date']}; do not edit by hand, re-run "
        "the command.",
        "",
        f"**Machine**: {meta['machine']}",
        "",
        f"**Load average** (1 min) at start {meta['load_start']:.2f}, at end "
        f"{meta['load_end']:.2f}; total run {meta['elapsed']:.0f} s.",
        "",
        f"**Software**: {meta['software']}",
        "",
        f"**Data**: {meta['data']}",
        "",
        f"Every figure is the median of {meta['repeats']} runs (range in brackets).",
        "",
    ]
    if budget:
        lines += ["## Performance budget", "", *budget, ""]
    for key, section in SECTIONS.items():
        rows = report.section_rows(key)
        if not rows and not report.notes.get(key):
            continue
        lines += [f"## {section.title}" + (f" ({section.unit})" if section.unit else ""), "",
                  section.explain, ""]
        if rows:
            lines += ["| contestant | median | range (runs) | vs cachekit | detail |",
                      "|---|---:|---:|---|---|"]
            for row in rows:
                name = f"**{row.label}**" if row.cachekit else row.label
                spread = (f"{fmt(min(row.runs), section.unit)} - "
                          f"{fmt(max(row.runs), section.unit)} ({len(row.runs)})")
                lines.append(f"| {name} | {fmt(row.median, section.unit)} | {spread} | "
                             f"{advantage_text(report, row)} | {row.detail} |")
            lines.append("")
        notes = report.notes.get(key, []) + ([DETAIL_NOTES[key]] if key in DETAIL_NOTES else [])
        lines += [f"- {note}" for note in notes]
        if notes:
            lines.append("")
    behind = not_ahead(report)
    lines += ["## Where cachekit is level (within 5%) or behind", ""]
    if behind:
        lines += [f"- {SECTIONS[r.section].title}: {r.label} ({advantage_text(report, r)})"
                  for r in behind]
    else:
        lines.append("- nowhere in this run")
    lines.append("")
    return "\n".join(lines)


# --- chart -------------------------------------------------------------------------------

CACHEKIT_COLOR = "#1f77b4"
OTHER_COLOR = "#b0b0b0"


SHORT_UNITS = {"images/s": "/s", "items/s": "/s", "CPU s": "s", "x entry size": "x"}


def chart(report: Report, path: Path) -> None:
    """One horizontal bar panel per section, two a row (long ones last, a row each),
    cachekit in colour, the median written at each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in SECTIONS if report.section_rows(k)]
    narrow = [k for k in keys if not _is_wide(report, k)]
    layout = [narrow[i:i + 2] for i in range(0, len(narrow), 2)]  # rows of panels
    layout += [[k] for k in keys if _is_wide(report, k)]
    labels = {k: [textwrap.fill(r.label, 70 if _is_wide(report, k) else 36)
                  for r in report.section_rows(k)] for k in keys}
    lines = {k: sum(label.count("\n") + 1 for label in labels[k]) for k in keys}
    heights = [max(lines[k] for k in row) * 0.22 + 0.9 for row in layout]
    fig = plt.figure(figsize=(14, sum(heights)), layout="constrained")
    grid = fig.add_gridspec(len(layout), 2, height_ratios=heights)
    for i, row in enumerate(layout):
        for j, key in enumerate(row):
            span = grid[i, :] if _is_wide(report, key) else grid[i, j]
            _panel(fig.add_subplot(span), report, key, labels[key])
    meta = report.meta
    fig.suptitle(f"cachekit benchmarks: {meta['machine_short']}, median of {meta['repeats']}, "
                 f"{meta['date']} (blue: cachekit)", fontsize=11)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _is_wide(report: Report, key: str) -> bool:
    return len(report.section_rows(key)) > 8


def _panel(ax: Any, report: Report, key: str, labels: list[str]) -> None:
    section = SECTIONS[key]
    rows = report.section_rows(key)
    values = [r.median for r in rows]
    ax.barh(range(len(rows)), values,
            color=[CACHEKIT_COLOR if r.cachekit else OTHER_COLOR for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()  # first row on top, as in the table
    if section.log_scale:
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 2, max(values) * 8)
    else:
        ax.set_xlim(0, max(values) * 1.35)
    unit = SHORT_UNITS.get(section.unit, section.unit)
    for i, value in enumerate(values):
        ax.text(value, i, " " + fmt(value, unit), va="center", fontsize=8)
    arrow = "higher is better" if section.higher_is_better else "lower is better"
    ax.set_title(f"{section.title} ({section.unit}; {arrow})", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)


# --- machine -----------------------------------------------------------------------------

def machine(directory: Path) -> tuple[str, str]:
    """A long and a short description of the CPU, memory and the disk under ``directory``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = _cpuinfo_model()
    ram_gb = _meminfo_kb("MemTotal") / 1024 ** 2
    fs, device, kind = _disk(directory)
    long = (f"{cores} usable cores ({model}), {ram_gb:.0f} GB RAM; temp dir {directory} on "
            f"{fs} ({device}, {kind}); {platform.system()} {platform.release()}")
    short = f"{cores} cores, {fs} on {device}"
    return long, short


def _cpuinfo_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _meminfo_kb(field_name: str) -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def _disk(directory: Path) -> tuple[str, str, str]:
    """(filesystem type, device, what /sys says about rotation) for ``directory``."""
    best = ("", "unknown fs", "unknown device")
    target = os.path.realpath(directory)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fs = line.split()[:3]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best[0]):
                    best = (mount, fs, device)
    except OSError:
        return "unknown fs", "unknown device", "unknown disk"
    _, fs, device = best
    kind = "unknown disk"
    name = os.path.basename(os.path.realpath(device)) if device.startswith("/dev/") else ""
    for candidate in (name, name.rstrip("0123456789"), name.split("p")[0]):
        try:
            with open(f"/sys/block/{candidate}/queue/rotational") as f:
                flag = f.read().strip()
            kind = "reported rotational" if flag == "1" else "reported non-rotational (SSD)"
            break
        except OSError:
            continue
    return fs, device, kind


def versions(names: Sequence[str]) -> str:
    from importlib import metadata

    parts = [f"Python {platform.python_version()}"]
    for name in names:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


def median_table(title: str, rounds: Sequence[dict[str, float]]) -> str:
    """A markdown table of each figure of ``rounds`` (one dict a round): its median, then
    every round's value in brackets, under ``title``."""
    lines = [title, "", "| figure | value |", "| --- | --- |"]
    for name in rounds[0]:
        values = [r[name] for r in rounds if name in r]
        each = ", ".join(f"{v:.3g}" for v in values)
        lines.append(f"| {name} | {statistics.median(values):.3g} ({each}) |")
    return "\n".join(lines)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result
