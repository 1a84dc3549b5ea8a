"""The ``cachekit`` command line (also ``python -m cachekit``): look at, check, clean and
prebuild a cache.

Exit codes: 0 success, 1 a problem found (``verify``) or a failed build, 2 usage error;
130 on Ctrl-C. In full:

- 0: done, also ``--help``, ``--version``, a dry run and a declined confirmation.
- 1: the command ran and failed or found a problem: ``verify`` found one; a build failed
  (rows that cannot be decoded, or a column the cache refuses: empty, missing values, not
  paths); a removal failed; an error while working (I/O, lock timeout, corrupt entry, a
  remote that fails or does not answer within ``$CACHEKIT_REMOTE_TIMEOUT``).
- 2: usage error, found before anything is changed: bad arguments; a KEY that is not a
  key, matches nothing or is ambiguous; a CSV that cannot be read or lacks the column; a
  bad setting (``$CACHEKIT_LOCK``, ``$CACHEKIT_LOCK_LEASE``, ``$CACHEKIT_REMOTE_TIMEOUT``);
  a remote command without a remote (``--remote URL`` or ``$CACHEKIT_REMOTE``).
- 128 + the number of a signal, as a shell reports a command that signal ended: 130 on
  Ctrl-C (SIGINT); 141 when the reader of the output has gone (SIGPIPE, e.g.
  ``cachekit ls | head``), without a message.

Errors are one line on stderr. Destructive commands show what they will remove, ask on a
terminal, and refuse without ``--yes`` when there is none. This module only parses,
formats and confirms: the work is done by :mod:`cachekit.admin.inspect`,
:mod:`cachekit.admin.removal` and :mod:`cachekit.admin.integrity`, and nothing here imports torch or
pandas except ``build``, which reads a CSV.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence, TypeVar

from .. import _version, liveness, options, units
from ..engine import executors
from ..store import locks
from ..admin import inspect as maintenance
from ..store import manifest as manifests
from ..errors import CachekitError, ImageDecodeError, UsageError
from ..store import LocalStore, default_root
from ..store import remote as remote_store
from . import remote as cli_remote

SHORT_KEY = 12
SORTS = {"used": "last_used", "size": "bytes", "created": "created"}
T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
        _check_settings()
        status = args.run(args)
        sys.stdout.flush()  # here, so that a reader that left is seen as one (below)
        return status
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        return _fail(str(e), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # e.g. `cachekit ls | head`: the reader left, so stop quietly
        with contextlib.suppress(OSError, ValueError):  # (a stdout with no descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for exit's flush
        return 141
    except (CachekitError, OSError) as e:
        return _fail((str(e).splitlines() or [type(e).__name__])[0], 1)
    except ValueError as e:  # a bad setting read later than _check_settings
        return _fail(str(e), 2)


def _check_settings() -> None:
    """Refuse a bad $CACHEKIT_LOCK, $CACHEKIT_LOCK_LEASE or $CACHEKIT_REMOTE_TIMEOUT before
    any command starts, so that it is a usage error for every command, whether or not (or
    how late) it takes a lock or calls the remote."""
    try:
        locks.kind_from_env()
        liveness.lease_from_env()
        remote_store.timeout_from_env()
    except ValueError as e:
        raise UsageError(str(e)) from None


# C0 controls, DEL and C1 controls (terminal escape sequences start with these) as \xNN, and
# lone surrogates (which cannot be written out) as \uNNNN; printable Unicode stays as is.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({c: f"\\u{c:04x}" for c in range(0xD800, 0xE000)})


def _printable(text: Any) -> str:
    """``text`` with its control characters escaped. Manifests, journals and names under a
    cache root are written by whoever else uses it, so none of their text may reach a
    terminal raw: everything printed goes through here (``_say``, ``_table``), and
    ``--json`` output is JSON, whose strings escape control characters anyway."""
    return str(text).translate(_ESCAPES)


def _say(text: Any = "", **kwargs: Any) -> None:
    """``print`` one line (``kwargs`` as for print) with control characters escaped."""
    print(_printable(text), **kwargs)


def _fail(message: str, status: int) -> int:
    _say(f"cachekit: error: {message}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    root_help = ("cache root (default: $CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, "
                 "else ~/.cache/cachekit)")
    parser = _Parser(prog="cachekit",
                     description="Inspect, check, clean and prebuild a cachekit cache.")
    parser.add_argument("--root", metavar="DIR", default=None, help=root_help)
    parser.add_argument("--remote", metavar="URL", dest="remote_url", default=None,
                        help="fsspec URL of the remote tier (default: $CACHEKIT_REMOTE)")
    # Also accepted after the command; SUPPRESS keeps a --root given before it.
    common = _Parser(add_help=False)
    common.add_argument("--root", metavar="DIR", default=argparse.SUPPRESS, help=root_help)
    parser.add_argument("--version", action="version", version=f"cachekit {_version.__version__}")
    sub = parser.add_subparsers(metavar="COMMAND", required=True)
    positive = _arg(_positive_int)

    def command(name: str, run: Callable[[argparse.Namespace], int], text: str):
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        p.set_defaults(run=run)
        return p

    command("dir", _dir, "print the cache root")
    p = command("ls", _ls, "list entries, builds in progress and leftovers")
    p.add_argument("--json", action="store_true", help="print a JSON array of entries")
    p.add_argument("--sort", choices=tuple(SORTS), default="used",
                   help="newest use, largest, or newest entry first (default: used)")
    cli_remote.add_flag(p)
    p = command("info", _info, "show one entry in full")
    p.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
    cli_remote.add_flag(p)
    p = command("clear", _clear, "remove entries (safe while other processes read)")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or unique prefixes")
    p.add_argument("--all", action="store_true", help="remove every entry")
    p.add_argument("--older-than", metavar="AGE", type=_arg(units.parse_duration),
                   help="only entries unused for this long, e.g. 7d, 12h, 1w")
    _destructive(p)
    cli_remote.add_flag(p)
    p = command("prune", _prune, "remove least recently used entries down to a size")
    p.add_argument("--max-size", metavar="SIZE", type=_arg(units.parse_size), required=True,
                   help="size to shrink to, e.g. 10G (GiB), 500MB, 2.5T")
    _destructive(p)
    p = command("verify", _verify, "check entries fully, data checksums included")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or prefixes (default: all)")
    cli_remote.add_flag(p)
    p = command("build", _build, "decode and resize a CSV's image column into the cache")
    p.add_argument("csv", metavar="CSV", help="CSV file with a column of image paths")
    p.add_argument("--column", required=True, help="the image path column, e.g. img_path")
    p.add_argument("--size", required=True, type=_arg(units.parse_image_size),
                   help="HxW, e.g. 32x32, or N")
    p.add_argument("--mode", choices=tuple(options.MODES), default="RGB")
    p.add_argument("--fit", choices=options.FITS, default="stretch")
    p.add_argument("--resample", choices=options.RESAMPLE_NAMES, default="bilinear")
    p.add_argument("--workers", type=positive, default=None,
                   help="parallel decode workers (default: CPUs)")
    p.add_argument("--executor", choices=executors.KINDS, default=None,
                   help="where rows are decoded (default: cachekit's rule, see "
                        "docs/build-engine.md)")
    p.add_argument("--on-error", choices=options.ON_ERROR, default="raise")
    p.add_argument("--validate", choices=options.VALIDATE, default="path")
    p.add_argument("--draft", action="store_true", help="fast reduced-scale JPEG decoding")
    cli_remote.add_commands(command)
    p = command("demo", _demo, "the end-to-end demo on generated sample images")
    p.add_argument("--images", type=positive, default=2000)
    p.add_argument("--agents", type=positive, default=4)
    return parser


def _destructive(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def _arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from a parser that raises ValueError: its message becomes the
    one-line usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(text)


def _layout(args: argparse.Namespace) -> LocalStore:
    return LocalStore((Path(args.root).expanduser() if args.root else default_root()).absolute())


def _dir(args: argparse.Namespace) -> int:
    _say(_layout(args).root)
    return 0


def _ls(args: argparse.Namespace) -> int:
    if args.on_remote:
        return cli_remote.ls(args)
    layout = _layout(args)
    found = maintenance.scan(layout)
    entries = sorted(found.entries, key=lambda e: getattr(e, SORTS[args.sort]), reverse=True)
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=1))
    elif not entries:
        _say(f"no entries in {layout.root}")
    else:
        now = time.time()
        rows = [("KEY", "KIND", "ROWS", "SHAPE", "DTYPE", "SIZE", "CREATED", "LAST USED", "")]
        rows += [(e.key[:SHORT_KEY], e.kind or "?", _text(e.rows), _row_shape(e), e.dtype or "?",
                  units.format_size(e.bytes), _age(e.created, now),
                  _age(e.last_used, now), _note(e)) for e in entries]
        _table(rows, right=(2, 5))
        total = sum(e.bytes for e in entries)
        _say(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
             f"{units.format_size(total)} in {layout.root}")
    _report_temp_dirs(found.temp_dirs)
    for problem in found.problems:
        if problem.key is None:
            _say(f"warning: {problem.path}: {problem.message}", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    if args.on_remote:
        return cli_remote.info(args)
    layout = _layout(args)
    found = maintenance.scan(layout)
    with _key_errors():
        key = maintenance.resolve_keys(
            [args.key], [e.key for e in found.entries] + [t.key for t in found.temp_dirs])[0]
    entry = next((e for e in found.entries if e.key == key), None)
    if entry is not None:
        _print_entry(entry)
    _report_temp_dirs([t for t in found.temp_dirs if t.key == key], out=sys.stdout)
    return 0


def _print_entry(e: maintenance.EntryInfo) -> None:
    now = time.time()
    fields: list[tuple[str, Any]] = [("key", e.key), ("path", e.path), ("kind", e.kind)]
    if e.problem is not None:
        fields.append(("PROBLEM", f"{e.problem} (remove it with `cachekit clear {e.key[:SHORT_KEY]}`)"))
    else:
        fields += [("rows", e.rows), ("shape", f"{_shape(e.shape)} {e.dtype}"),
                   ("column", e.column), ("failed rows", e.failed_rows)]
    fields += [("size", f"{units.format_size(e.bytes)} ({e.bytes} bytes)"),
               ("created", _when(e.created, now)), ("last used", _when(e.last_used, now))]
    manifest: dict[str, Any] = {}
    if e.problem is None:
        try:
            manifest = manifests.read(e.path).to_json()
        except (OSError, CachekitError):
            pass
    builder = manifest.get("builder")
    if isinstance(builder, dict) and builder:  # (not a checked field: any JSON may be there)
        fields.append(("built by", f"pid {builder.get('pid')} on {builder.get('host')} in "
                                   f"{manifest.get('build_seconds', '?')} s with cachekit "
                                   f"{manifest.get('cachekit_version', '?')}"))
    if e.params is not None:
        fields += [(f"  {name}", json.dumps(value, sort_keys=True))
                   for name, value in sorted(e.params.items())]
    for record in manifest.get("files") or []:
        fields.append((record["name"], f"{record['bytes']} bytes, checksum {record['checksum']}"))
    fields = [(_printable(name), value) for name, value in fields if value is not None]
    width = max(len(name) for name, _ in fields) + 1
    for name, value in fields:
        _say(f"{name + ':':<{width}} {value}")
    failed = manifest.get("failed_rows") or []
    for row, path, reason in failed[:20]:
        _say(f"  failed row {row}: {path}: {reason}")
    if len(failed) > 20:
        _say(f"  ... and {len(failed) - 20} more")


def _clear(args: argparse.Namespace) -> int:
    if args.on_remote:
        return cli_remote.clear(args)
    if args.all and args.keys:
        raise UsageError("give KEYs or --all, not both")
    if not (args.all or args.keys or args.older_than is not None):
        raise UsageError("say what to clear: KEY ..., --all, or --older-than AGE")
    _check_can_confirm(args)
    from ..admin.removal import plan_clear

    layout = _layout(args)
    with _key_errors():
        plan = plan_clear(layout, args.keys or None, older_than=args.older_than)
    return _carry_out(plan, args, f"in {layout.root}")


def _prune(args: argparse.Namespace) -> int:
    _check_can_confirm(args)
    from ..admin.removal import plan_prune

    layout = _layout(args)
    plan = plan_prune(layout, args.max_size)
    return _carry_out(plan, args, f"to bring {layout.root} to at most "
                                  f"{units.format_size(args.max_size)}")


def _check_can_confirm(args: argparse.Namespace) -> None:
    if not (args.dry_run or args.yes or sys.stdin.isatty()):
        raise UsageError("refusing to remove anything without confirmation: stdin is not a "
                         "terminal; pass --yes (or --dry-run to see what would go)")


def _carry_out(plan, args: argparse.Namespace, goal: str) -> int:
    """Show ``plan``, confirm it, execute it, and report what happened."""
    for skipped in plan.skipped:
        _say(f"skipping {skipped.path.name}: {skipped.reason}")
    if not len(plan):
        _say(f"nothing to remove {goal}")
        return 0
    now = time.time()
    for e in plan.entries:
        _say(f"  {e.key[:SHORT_KEY]}  {e.kind or '?':<7} {units.format_size(e.bytes):>9}  "
             f"last used {_age(e.last_used, now)}")
    for t in plan.temp_dirs:
        _say(f"  {t.path.name}  {t.state} ({t.owner})  {units.format_size(t.bytes)}")
    for key in plan.failure_records:
        _say(f"  {key[:SHORT_KEY]}  recorded build failure")
    what = _count(len(plan.entries), "entry", "entries")
    if plan.temp_dirs:
        what += f" and {_count(len(plan.temp_dirs), 'leftover directory', 'leftover directories')}"
    if plan.failure_records:
        what += f" and {_count(len(plan.failure_records), 'failure record', 'failure records')}"
    summary = f"{what} ({units.format_size(plan.bytes)}) {goal}"
    if args.dry_run:
        _say(f"would remove {summary} (dry run: nothing removed)")
        return 0
    if not args.yes and not _confirm(f"remove {summary}? [y/N] "):
        _say("nothing removed")
        return 0
    report = plan.execute()
    for skipped in report.skipped[len(plan.skipped):]:
        _say(f"skipped {skipped.path.name}: {skipped.reason}")
    _say(f"removed {_count(len(report.removed_entries), 'entry', 'entries')}"
         + (f" and {_count(len(report.removed_temp_dirs), 'leftover directory', 'leftover directories')}"
            if report.removed_temp_dirs else "")
         + f", freed {units.format_size(report.freed_bytes)}")
    for failed in report.failed:
        _say(f"cachekit: error: could not remove {failed.path}: {failed.reason}", file=sys.stderr)
    return 1 if report.failed else 0


def _confirm(question: str) -> bool:
    _say(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _verify(args: argparse.Namespace) -> int:
    if args.on_remote:
        return cli_remote.verify(args)
    from ..admin.integrity import verify

    layout = _layout(args)
    checking = {"entries": 0, "bar": None}

    def start(entries: int, total_bytes: int) -> None:
        checking["entries"], checking["bar"] = entries, _bytes_bar(total_bytes)

    def advance(size: int) -> None:
        if checking["bar"] is not None:
            checking["bar"].update(size)

    try:
        with _key_errors():
            problems = verify(layout, args.keys or None, on_start=start, on_bytes=advance)
    finally:
        if checking["bar"] is not None:
            checking["bar"].close()
    for problem in problems:
        _say(f"{problem.key or problem.path}: {problem.message}")
    checked = checking["entries"]
    if not args.keys:
        _report_temp_dirs(maintenance.list_temp_dirs(layout)[0])
    if problems:
        _say(f"{_count(len(problems), 'problem', 'problems')} in "
             f"{_count(checked, 'entry', 'entries')}; remove a broken entry with "
             "`cachekit clear KEY` (it is rebuilt on next use)")
        return 1
    _say(f"{_count(checked, 'entry', 'entries')} verified, no problems")
    return 0


def _bytes_bar(total: int):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="cachekit verify", leave=False)


def _build(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..cache import Cache

    try:
        frame = pd.read_csv(args.csv)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {args.csv}: {e}") from None
    if args.column not in frame.columns:
        raise UsageError(f"{args.csv} has no column {args.column!r}; its columns are "
                         f"{', '.join(map(str, frame.columns))}")
    cache = Cache(_layout(args).root, remote=args.remote_url, workers=args.workers,
                  executor=args.executor)
    height, width = args.size
    _say(f"cachekit build: {len(frame)} images from column {args.column!r} of {args.csv} "
         f"at {height}x{width} {args.mode} into {cache.root}", file=sys.stderr)
    try:
        entry = cache.images(frame[args.column], args.size, mode=args.mode, fit=args.fit,
                             resample=args.resample, on_error=args.on_error,
                             validate=args.validate, draft=args.draft)
    except ImageDecodeError as e:
        _say(f"cachekit: error: build failed, nothing published: {len(e.failures)} "
             "row(s) could not be decoded:", file=sys.stderr)
        for row, path, reason in e.failures:
            _say(f"  row {row}: {path}: {reason}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:  # the cache refused the column (empty, NaN, not str)
        return _fail(f"build failed: {e}", 1)
    failed = entry.manifest["failed_rows"]
    for row, path, reason in failed:
        _say(f"  row {row} stored as zeros: {path}: {reason}", file=sys.stderr)
    how = {"local": "already cached", "remote": "downloaded"}.get(entry.source, "built")
    _say(f"{how}: {len(entry)} rows {_shape(entry.array.shape)} {entry.array.dtype}, "
         f"{units.format_size(entry.array.nbytes)}"
         + (f", {len(failed)} failed rows stored as zeros" if failed else ""), file=sys.stderr)
    _say(entry.key)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run

    return run(Path(args.root).expanduser() if args.root else None,
               images=args.images, agents=args.agents)


@contextlib.contextmanager
def _key_errors() -> Iterator[None]:
    """Turn what :func:`maintenance.resolve_keys` raises for KEY arguments (KeyError: no
    match; ValueError: not a key, or an ambiguous prefix) into a usage error. Every command
    that takes KEYs runs its resolution in this block.
    """
    try:
        yield
    except (KeyError, ValueError) as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None


def _report_temp_dirs(temp_dirs, out=None) -> None:
    out = sys.stderr if out is None else out
    for t in temp_dirs:
        size = units.format_size(t.bytes)
        if t.state == maintenance.BUILDING:
            _say(f"build in progress: {t.key[:SHORT_KEY]} by {t.owner}, {size} so far", file=out)
        elif t.state == maintenance.DELETING:
            _say(f"being removed: {t.key[:SHORT_KEY]} ({t.owner}), {size}", file=out)
        else:
            _say(f"{t.state} temporary directory {t.path} ({t.owner}), {size}; "
                 f"remove with `cachekit clear {t.key[:SHORT_KEY]}`", file=out)


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> None:
    rows = [tuple(_printable(cell) for cell in row) for row in rows]  # before measuring
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        _say("  ".join(cells).rstrip())


def _note(e: maintenance.EntryInfo) -> str:
    if e.problem is not None:
        return f"PROBLEM: {e.problem}"
    parts = [f"column {e.column}"] if e.column else []
    if e.failed_rows:
        parts.append(f"{e.failed_rows} failed rows")
    return ", ".join(parts)


def _row_shape(e: maintenance.EntryInfo) -> str:
    return "?" if e.shape is None else _shape(e.shape[1:]) or "-"


def _shape(shape: Optional[Sequence[int]]) -> str:
    return "?" if shape is None else "x".join(str(n) for n in shape)


def _text(value: Any) -> str:
    return "?" if value is None else str(value)


def _local_time(t: float) -> Optional[datetime.datetime]:
    """``t`` (seconds since the epoch) as a local time; None when it is not one, as in a
    manifest that says it was created at 1e300, -1e300 or NaN."""
    try:
        return datetime.datetime.fromtimestamp(t)
    except (OverflowError, OSError, ValueError):
        return None


def _when(t: float, now: float) -> str:
    stamp = _local_time(t)
    if stamp is None:
        return f"{t!r} (not a valid time)"
    return f"{stamp:%Y-%m-%d %H:%M:%S} ({units.format_age(now - t)})"


def _age(t: float, now: float) -> str:
    return "?" if _local_time(t) is None else units.format_age(now - t)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
