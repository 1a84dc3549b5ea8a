"""The commands on the local root: ``dir``, ``ls``, ``info``, ``clear``, ``prune``,
``verify``, ``build`` and ``demo``. Each takes the parsed arguments and returns the exit
status. They only format and confirm: the work is done by :mod:`cachekit.admin.inspect`,
:mod:`cachekit.admin.local_removal` and :mod:`cachekit.admin.integrity`, and only ``build`` (which
reads a CSV) imports pandas or torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from .. import units
from ..admin import inspect, permissions
from ..errors import (CachekitError, ImageDecodeError, InvalidArgument, InvalidArgumentType,
                      UsageError)
from ..store import holds
from ..store import manifest as manifests
from .confirm import carry_out, check_can_confirm
from .output import SHORT_KEY, SORTS, ByteProgress, ago, clear_advice, count, fail, fields, \
    file_fields, holders, joined_by, listing, other_versions, say, shape, when
from .parser import check_clear_selection, key_errors
from .stores import local_store


def show_root(args: argparse.Namespace) -> int:
    say(local_store(args).root)
    return 0


def ls(args: argparse.Namespace) -> int:
    store = local_store(args)
    found = inspect.scan(store)
    listed = sorted(found.entries, key=lambda e: getattr(e, SORTS[args.sort]), reverse=True)
    entries = [e for e in listed if e.failed_build is None]
    stray = sum(s.bytes for s in found.stray_index)
    now = time.time()
    used = holds.in_use(store.layout, [e.key for e in entries])
    listing(entries, lambda: [{**e.to_json(), "in_use": e.key in used} for e in listed],
            args.json, f"no entries in {store.root}",
            ("KEY", "KIND", "ROWS", "SHAPE", "DTYPE", "OWN", "SHARED", "CREATED", "LAST USED",
             "MADE WITH", ""),
            lambda e: (e.key[:SHORT_KEY], e.kind or "?", "?" if e.rows is None else str(e.rows),
                       _row_shape(e), e.dtype or "?", units.format_size(e.own_bytes),
                       units.format_size(e.shared_bytes) if e.shared_bytes else "-",
                       ago(e.created, now), ago(e.last_used, now), made_with(e.kind, e.params),
                       _note(e, e.key in used)),
            right=(2, 5, 6),
            total=lambda: f"{count(len(entries), 'entry', 'entries')}, "
                          f"{units.format_size(inspect.stored_bytes(listed) + stray)} on disk "
                          f"in {store.root} (a shared file counted once)")
    if not args.json:
        _report_failed_builds([e for e in listed if e.failed_build is not None],
                              store.failure_keys())
    if found.stray_index:
        say(f"{count(len(found.stray_index), 'row index file', 'row index files')} of entries "
            f"removed outside cachekit ({units.format_size(stray)}); `cachekit prune` or "
            "`cachekit clear --all` removes them", file=sys.stderr)
    _report_temp_dirs(found.temp_dirs)
    for problem in found.problems:
        if problem.key is None:
            say(f"warning: {problem.path}: {problem.message}", file=sys.stderr)
    return 0


def info(args: argparse.Namespace) -> int:
    store = local_store(args)
    found = inspect.scan(store)
    with key_errors():
        key = inspect.resolve_keys(
            [args.key], [e.key for e in found.entries] + [t.key for t in found.temp_dirs]
            + [e.failed_build for e in found.entries if e.failed_build is not None])[0]
    entry = next((e for e in found.entries if key in (e.key, e.failed_build)), None)
    if entry is not None:
        _print_entry(entry, {e.key for e in found.entries}, holds.held(store.layout, entry.key))
    _report_temp_dirs([t for t in found.temp_dirs if t.key == key], out=sys.stdout)
    return 0


def _print_entry(e: inspect.EntryInfo, published: set[str], in_use: bool) -> None:
    now = time.time()
    pairs: list[tuple[str, Any]] = [("key", e.key), ("path", e.path), ("kind", e.kind)]
    if e.failed_build is not None:
        pairs.append(("kept rows of", f"the failed build of {e.failed_build}: its rows that "
                                      "decoded, which the next build of them reuses"))
    if e.problem is not None:
        pairs.append(("PROBLEM", f"{e.problem} (remove it with `cachekit clear "
                                 f"{e.key[:SHORT_KEY]}`)"))
    else:
        pairs += [("rows", e.rows), ("shape", f"{shape(e.shape)} {e.dtype}"),
                  ("column", e.column), ("failed rows", e.failed_rows)]
    pairs += [("size", f"{units.format_size(e.bytes)} ({e.bytes} bytes)"),
              ("shared", f"{units.format_size(e.shared_bytes)} of it with other entries "
                         "(stored once)" if e.shared_bytes else "nothing"),
              ("created", when(e.created, now)), ("last used", when(e.last_used, now))]
    if in_use:
        pairs.append(("in use", f"by {holders(e.path) or 'a live process'}: `prune`, budgets "
                                "and `clear --older-than` pass over it"))
    manifest: dict[str, Any] = {}
    contiguous = False
    if e.problem is None:
        try:
            read = manifests.read(e.path)
            manifest, contiguous = read.to_json(), read.contiguous
        except (OSError, CachekitError):
            pass
    builder = manifest.get("builder")
    if isinstance(builder, dict) and builder:  # (not a checked field: any JSON may be there)
        pairs.append(("built by", f"pid {builder.get('pid')} on {builder.get('host')} in "
                                  f"{manifest.get('build_seconds', '?')} s with cachekit "
                                  f"{manifest.get('cachekit_version', '?')}"))
        pairs.append(("joined by", joined_by(builder)))
    if e.params is not None:
        pairs += [(f"  {name}", json.dumps(value, sort_keys=True))
                  for name, value in sorted(e.params.items())]
    pairs += _origin_pairs(e.origin, published, contiguous)
    fields(pairs)
    file_fields((f["name"], f["bytes"], f["checksum"]) for f in manifest.get("files") or [])
    failed = (manifest.get("failed_rows") or [])[:20]
    for row, path, reason in failed:
        say(f"  failed row {row}: {path}: {reason}")
    if e.failed_rows > len(failed):
        say(f"  ... and {e.failed_rows - len(failed)} more")


def _origin_pairs(origin: Optional[dict[str, Any]], published: set[str], contiguous: bool
                  ) -> list[tuple[str, Any]]:
    """Where the entry's rows came from: decoded by its builder, by other processes, and
    shared with which entries (linked), or copied from them into its own file (another
    user's rows; every row of a contiguous entry, which an entry made before copies were
    recorded says by being contiguous), and repeating earlier rows of its column; those
    entries in this root or not (removed since, or never here, as for an entry pulled from
    a remote)."""
    if origin is None:
        return []
    reused = origin["reused"]
    copied = dict(origin.get("copied") or (reused if contiguous else []))
    shared = [(key, rows - copied.get(key, 0)) for key, rows in reused
              if rows > copied.get(key, 0)]
    took = [("shared with", shared)] if shared else []
    if copied:
        took.append(("copied from", list(copied.items())))
    clauses = [f"{origin['decoded']} decoded by its builder",
               f"{origin['joined']} by other processes (joiners, resumed builds)"]
    clauses += [f"{sum(rows for _, rows in by)} {how} {len(by)} "
                f"{'entry' if len(by) == 1 else 'entries'}" for how, by in took]
    if origin.get("repeated"):
        clauses.append(f"{origin['repeated']} repeating earlier rows of its column")
    pairs: list[tuple[str, Any]] = [("rows from", ", ".join(clauses))]
    for how, by in took:
        pairs += [(f"  {how} {key[:SHORT_KEY]}",
                   f"{rows} rows{'' if key in published else ' (not in this root)'}")
                  for key, rows in by]
    return pairs


def clear(args: argparse.Namespace) -> int:
    check_clear_selection(args)
    check_can_confirm(args)
    from ..admin.local_removal import removal_for_clear

    with key_errors():
        removal = removal_for_clear(local_store(args), args.keys or None,
                                    older_than=args.older_than)
    return carry_out(removal, args)


def prune(args: argparse.Namespace) -> int:
    check_can_confirm(args)
    from ..admin.local_removal import removal_for_prune

    return carry_out(removal_for_prune(local_store(args), args.max_size), args)


def verify(args: argparse.Namespace) -> int:
    from ..admin.integrity import verify as verify_entries

    store = local_store(args)
    others: list[inspect.EntryInfo] = []
    with ByteProgress("cachekit verify") as progress, key_errors():
        problems = verify_entries(store, args.keys or None, on_start=progress.start,
                                  on_bytes=progress.advance, on_other=others.extend)
    for problem in problems:
        say(f"{problem.key or problem.path}: {problem.message}")
    other_versions(len(others), inspect.stored_bytes(others),
                   "`cachekit prune`, a budget or `cachekit clear --older-than` removes them "
                   "before the entries in use")
    checked = count(progress.entries, "entry", "entries")
    if not args.keys:
        _report_temp_dirs(inspect.list_temp_dirs(store)[0])
    if problems:
        say(f"{count(len(problems), 'problem', 'problems')} in {checked}; "
            f"{clear_advice(problems, 'cachekit clear', 'rebuilt on next use')}")
        return 1
    say(f"{checked} verified, no problems")
    return 0


def show(args: argparse.Namespace) -> int:
    """Write a contact sheet of an entry's rows as a PNG and print where."""
    from .. import sheet
    from ..store.entry_files import open_rows

    found = inspect.scan(local_store(args))
    with key_errors():
        key = inspect.resolve_keys([args.key], [e.key for e in found.entries])[0]
    described = next(e for e in found.entries if e.key == key)
    if described.problem is not None:
        raise CachekitError(f"entry {key[:SHORT_KEY]}: {described.problem}")
    manifest = manifests.read(described.path)
    array = open_rows(described.path, manifest)
    labels = None
    if args.csv is not None:
        import pandas as pd

        try:
            labels = pd.read_csv(args.csv)[args.column].astype(str).tolist()
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"cannot read column {args.column!r} of {args.csv}: {e}") from None
        if len(labels) != manifest.rows:
            raise UsageError(f"{args.csv} has {len(labels)} rows, entry {key[:SHORT_KEY]} has "
                             f"{manifest.rows}: it was built from another column")
    try:
        rows = sheet.choose_rows(manifest.rows, args.rows, args.sample)
        picture = sheet.contact_sheet(array, rows, labels)
    except (InvalidArgument, InvalidArgumentType) as e:
        raise UsageError(f"entry {key[:SHORT_KEY]}: {e}") from None
    output = Path(args.output or f"sheet-{key[:SHORT_KEY]}.png")
    picture.save(output, format="PNG")
    say(str(output.resolve()))
    return 0


def _check_column(frame: Any, column: str, csv: str) -> None:
    """UsageError, in the CSV's terms, for a column that holds no image paths: no rows,
    empty cells, or numbers (lines counted as a text editor does, the header being 1)."""
    import pandas as pd

    values = frame[column]
    if len(values) == 0:
        raise UsageError(f"{csv} has a header but no rows: add one line per image, with its "
                         f"path in column {column!r}")
    missing = values.isna().to_numpy().nonzero()[0]
    if len(missing):
        lines = ", ".join(str(row + 2) for row in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise UsageError(f"column {column!r} of {csv} is empty on line(s) {lines}{more}: give "
                         "each of those rows an image path, or delete those lines")
    if not pd.api.types.is_string_dtype(values) and not values.map(
            lambda v: isinstance(v, str)).all():
        row = int(next(i for i, v in enumerate(values) if not isinstance(v, str)))
        others = [str(c) for c in frame.columns if c != column]
        raise UsageError(f"column {column!r} of {csv} holds {values.dtype} values, not image "
                         f"paths (line {row + 2}: {values.iloc[row]}); pick the column of "
                         f"paths with --column" + (f" (others: {', '.join(others)})"
                                                   if others else ""))


def build(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..cache import Cache

    try:
        frame = pd.read_csv(args.csv)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {args.csv}: {e}") from None
    if args.column not in frame.columns:
        raise UsageError(f"{args.csv} has no column {args.column!r}; its columns are "
                         f"{', '.join(map(str, frame.columns))}")
    _check_column(frame, args.column, args.csv)
    store = local_store(args)
    cache = Cache(store.root, remote=args.remote_url, workers=args.workers,
                  executor=args.executor)
    height, width = args.size
    say(f"cachekit build: {len(frame)} images from column {args.column!r} of {args.csv} "
        f"at {height}x{width} {args.mode} into {cache.root}", file=sys.stderr)
    try:
        entry = cache.images(frame[args.column], args.size, mode=args.mode, fit=args.fit,
                             resample=args.resample, on_error=args.on_error,
                             validate=args.validate, draft=args.draft,
                             backend=args.backend, contiguous=args.contiguous)
        if entry.outcome == "hit":  # the background stale check's word, before "cached"
            from ..obtain import staleness

            staleness.wait_for_checks()
    except ImageDecodeError as e:
        say(f"cachekit: error: build failed, nothing published: {len(e.failures)} "
            "row(s) could not be decoded:", file=sys.stderr)
        for row, path, reason in e.failures:
            say(f"  row {row}: {path}: {reason}", file=sys.stderr)
        return 1
    except (InvalidArgument, InvalidArgumentType) as e:  # the cache refused the column
        return fail(f"{args.csv}, column {args.column!r}: {e}", 2)
    detailed, failed = entry.manifest["failed_rows"], int((~entry.valid).sum())
    for row, path, reason in detailed:
        say(f"  row {row} stored as zeros: {path}: {reason}", file=sys.stderr)
    if failed > len(detailed):
        say(f"  ... and {failed - len(detailed)} more", file=sys.stderr)
    how = {"hit": "already cached", "pulled": "downloaded",
           "waited": "built by another process", "joined": "built with another process"
           }.get(entry.outcome, "built")
    # The sizes `ls` shows: every file of the entry, and those other entries hold too.
    listed = next((e for e in inspect.list_entries(store)[0] if e.key == entry.key), None)
    size = units.format_size(listed.bytes if listed is not None else entry.array.nbytes)
    if listed is not None and listed.shared_bytes:
        size += f" ({units.format_size(listed.shared_bytes)} of it shared with other entries)"
    zeros = f", {units.count(failed, 'failed row')} stored as zeros" if failed else ""
    say(f"{how}: {units.count(len(entry), 'row')} {shape(entry.array.shape)} "
        f"{entry.array.dtype}, {size}{zeros}", file=sys.stderr)
    say(entry.key)
    return 0


def demo(args: argparse.Namespace) -> int:
    from ..demo import CSV_IMAGES, RACE_IMAGES, run, write_csv

    if args.csv is not None:
        return write_csv(Path(args.csv).expanduser(), images=args.images or CSV_IMAGES)
    return run(Path(args.root).expanduser() if args.root else None,
               images=args.images or RACE_IMAGES, agents=args.agents)


def _report_temp_dirs(temp_dirs: Iterable[inspect.TempDir], out: Any = None) -> None:
    out = sys.stderr if out is None else out
    for t in temp_dirs:
        size = units.format_size(t.bytes)
        if t.state == inspect.BUILDING:
            say(f"build in progress: {t.key[:SHORT_KEY]} by {t.owner}, {size} so far", file=out)
        elif t.state == inspect.DELETING:
            say(f"being removed: {t.key[:SHORT_KEY]} ({t.owner}), {size}", file=out)
        else:
            who = ("remove" if t.blocked_by is None
                   else f"{permissions.user(t.blocked_by)}, its owner, can remove it")
            say(f"{t.state} temporary directory {t.path} ({t.owner}), {size}; "
                f"{who} with `cachekit clear {t.key[:SHORT_KEY]}`", file=out)


def _report_failed_builds(kept: list[inspect.EntryInfo], failed: list[str]) -> None:
    """Say which builds failed and what each kept: the rows that decoded, which the next
    build of those rows copies (``cachekit clear KEY`` removes them)."""
    keeping = {e.failed_build: e for e in kept}
    for key in sorted(set(failed) | set(keeping)):
        e = keeping.get(key)
        if e is None:
            say(f"failed build of {key[:SHORT_KEY]}: recorded in locks/, no rows kept")
            continue
        good = (e.rows or 0) - e.failed_rows
        say(f"failed build of {key[:SHORT_KEY]}: {units.count(e.failed_rows, 'row')} failed; "
            f"{units.count(good, 'row')} kept as {e.key[:SHORT_KEY]} "
            f"({units.format_size(e.bytes)}), which the next build of them reuses")


def _note(e: inspect.EntryInfo, in_use: bool = False) -> str:
    if e.other_format:
        return f"not used: {e.problem}"
    if e.problem is not None:
        return f"PROBLEM: {e.problem}"
    parts = [f"column {e.column}"] if e.column else []
    if e.failed_rows:
        parts.append(units.count(e.failed_rows, "failed row"))
    if in_use:
        parts.append("in use")
    return ", ".join(parts)


IMAGE_DEFAULTS = {"resample": "bilinear", "on_error": "raise", "draft": False}
"""Options of an images entry ``ls`` names only when they differ from these."""


def made_with(kind: Optional[str], params: Optional[dict[str, Any]]) -> str:
    """What tells apart entries of one column, in a few words: an images entry's
    ``validate``, ``fit`` and backend (and any other option not at its default); a map or
    memoize entry's function, by qualified name, and its ``version``."""
    params = params or {}
    if kind == "images":
        parts = [f"validate={params.get('validate', '?')}", f"fit={params.get('fit', '?')}",
                 f"backend={params.get('backend', 'pil')}"]
        parts += [f"{name}={params[name]}" for name, default in IMAGE_DEFAULTS.items()
                  if name in params and params[name] != default]
        return " ".join(parts)
    function = params.get("function")
    if isinstance(function, dict) and "partial" in function:
        function = function["partial"]
    if not isinstance(function, dict):
        return ""
    name = ".".join(str(function[k]) for k in ("module", "qualname") if function.get(k))
    version = function.get("version")
    return name + ("" if version is None else f" version={version}")


def _row_shape(e: inspect.EntryInfo) -> str:
    return "?" if e.shape is None else shape(e.shape[1:]) or "-"
