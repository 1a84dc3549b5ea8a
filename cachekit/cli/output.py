"""What the command line prints, and how: every line goes through :func:`say`, which
escapes control characters, because manifests, journals and names under a cache root (or in
a bucket) are written by whoever else uses it, so none of their text may reach a terminal
raw. ``--json`` output is JSON, whose strings escape control characters anyway.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from .. import processes, units
from ..admin.inspect import SHORT_KEY, Problem, ago, local_time
from ..messages import printable, write_line
from ..store import hold_records, holds
from ..store.layout import Layout

__all__ = ["SHORT_KEY", "SORTS", "ByteProgress", "ago", "clear_advice", "count", "fail", "fields",
           "file_fields", "holders", "joined_by", "listing", "other_versions", "printable",
           "say", "shape", "table", "when"]

SORTS = {"used": "last_used", "size": "bytes", "created": "created"}
"""``ls --sort`` choices and the EntryInfo field each sorts by (newest or largest first)."""


def say(text: Any = "", *, file: Any = None, end: str = "\n", flush: bool = False) -> None:
    """Print ``text`` and ``end`` (as ``print`` would, to stdout unless ``file``) with
    control characters escaped, in one write (:func:`~cachekit.messages.write_line`)."""
    write_line(sys.stdout if file is None else file, printable(text), end=end, flush=flush)


def other_versions(entries: int, size: int, removes: str) -> None:
    """Say that ``verify`` left ``entries`` entries (``size`` bytes) of another cachekit
    version unchecked, and what ``removes`` them (a clause)."""
    if entries:
        say(f"{count(entries, 'entry', 'entries')} of another cachekit version not checked "
            f"({units.format_size(size)}): this version never uses them; {removes}")


def fail(message: str, status: int) -> int:
    """Say ``message`` as the command's one-line error on stderr; return ``status``."""
    say(f"cachekit: error: {message}", file=sys.stderr)
    return status


def table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> None:
    """Print ``rows`` (the first is the heading) in aligned columns; the columns numbered in
    ``right`` are aligned right."""
    rows = [tuple(map(printable, row)) for row in rows]  # before measuring
    widths = [max(map(len, column)) for column in zip(*rows)]
    line = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))
    for row in rows:
        say(line.format(*row).rstrip())


def listing(shown: Sequence[Any], as_json: Callable[[], list[dict[str, Any]]],
            json_wanted: bool, empty: str, heading: tuple[str, ...],
            row: Callable[[Any], tuple[str, ...]], right: tuple[int, ...],
            total: Callable[[], str]) -> None:
    """What ``ls`` prints, of a root or a bucket: ``as_json()`` as JSON when ``json_wanted``;
    else ``empty`` when nothing is ``shown``, or a table of ``row`` of each entry shown
    under ``heading`` (``right``: its columns aligned right) and the ``total`` line."""
    if json_wanted:
        print(json.dumps(as_json(), indent=1))
    elif not shown:
        say(empty)
    else:
        table([heading, *(row(e) for e in shown)], right=right)
        say(total())


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """Print ``name: value`` lines with the values aligned, leaving out None values."""
    shown = [(printable(name), value) for name, value in pairs if value is not None]
    width = max(len(name) for name, _ in shown) + 1
    for name, value in shown:
        say(f"{name + ':':<{width}} {value}")


def file_fields(files: Iterable[tuple[str, int, str]]) -> None:
    """The ``files:`` block of ``info``: each (name, bytes, checksum) of an entry's files,
    aligned on their own (a derived entry's part names are long) and not with the fields
    above them."""
    lines = [(f"  {name}", f"{size} bytes, checksum {checksum}")
             for name, size, checksum in files]
    if lines:
        say("files:")
        fields(lines)


def joined_by(builder: Any) -> Optional[str]:
    """``pid 4243 on node7 (480 rows), ...``: the processes that joined a build, from a
    manifest's ``builder`` (any JSON: not a checked field); None when nobody joined."""
    joined = builder.get("joined") if isinstance(builder, dict) else None
    if not isinstance(joined, list) or not joined:
        return None
    return ", ".join(f"pid {j.get('pid')} on {j.get('host')} ({j.get('rows')} rows)"
                     if isinstance(j, dict) else repr(j) for j in joined)


def shape(dims: Optional[Sequence[int]]) -> str:
    """``3x32x32``; ``?`` when unknown."""
    return "?" if dims is None else "x".join(str(n) for n in dims)


def when(t: float, now: float) -> str:
    """A time and how long ago it was: ``2024-05-01 12:00:00 (3 d ago)``."""
    stamp = local_time(t)
    if stamp is None:
        return f"{t!r} (not a valid time)"
    return f"{stamp:%Y-%m-%d %H:%M:%S} ({units.format_age(now - t)})"


def count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def clear_advice(problems: Iterable[Problem], command: str, again: str) -> str:
    """What to do about the problems ``verify`` found: clear every broken entry with one
    ``command``, each named, since an entry left that links a damaged file would lend its
    rows to the others' rebuilds. ``again``: what becomes of a cleared entry."""
    keys = list(dict.fromkeys(p.key[:SHORT_KEY] for p in problems if p.key is not None))
    if not keys:
        return f"remove a broken entry with `{command} KEY` (it is {again})"
    if len(keys) == 1:
        return f"remove it with `{command} {keys[0]}` (it is {again})"
    return (f"remove them all with `{command} {' '.join(keys)}` (each is {again}; an entry "
            "kept that links a damaged file would lend its rows to a rebuild)")


class ByteProgress:
    """A progress bar in bytes on stderr when it is a terminal (none otherwise), for a
    check that says what it is about to read (``start``, again when it finds more) and then
    what it read (``advance``); used as a context manager, which closes the bar."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.entries = 0
        self._bar: Any = None

    def start(self, entries: int, total_bytes: int) -> None:
        """Count ``entries`` more to check, of ``total_bytes`` more to read."""
        self.entries += entries
        if self._bar is not None:
            self._bar.total += total_bytes
            self._bar.refresh()
        elif sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True,
                             desc=self.description, leave=False)

    def advance(self, size: int) -> None:
        if self._bar is not None:
            self._bar.update(size)

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()


def holders(path: Path) -> str:
    """Who holds the entry at ``path`` (:mod:`cachekit.store.holds`): ``pid 4242
    (python), pid 77 on gpu-2, ...``, as far as this machine's kernel and other machines'
    records tell; "" when they do not."""
    named = [f"pid {pid}" + (f" ({name})" if name else "")
             for pid, name in ((pid, processes.process_name(pid)) for pid in holds.holders(path))]
    named += [f"pid {pid} on {host}" for host, pid in
              hold_records.holders_elsewhere(Layout(path.parent.parent), path.name)]
    return ", ".join(named)
