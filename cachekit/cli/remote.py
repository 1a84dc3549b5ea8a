"""The remote half of the command line: ``push``, ``pull``, and ``ls|info|verify|clear
--remote``. The remote's URL is the global ``--remote URL`` or ``$CACHEKIT_REMOTE``; the
commands' own ``--remote`` flag says to act on it instead of the local root. Like
:mod:`cachekit.cli`, this only parses, formats and confirms; the work is done by
:mod:`cachekit.store.remote` and :mod:`cachekit.admin.remote`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from . import main as cli
from ..store import locks
from .. import units
from ..admin import remote as rm
from ..errors import CacheCorruptError, UsageError
from ..admin.inspect import list_entries, resolve_keys
from ..store.remote import REMOTE_ENV, RemoteStore

Command = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def add_commands(command: Command) -> None:
    """Add ``push`` and ``pull`` to the parser (``command`` makes a subcommand)."""
    p = command("push", push, "upload local entries to the remote (manifest last)")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or unique prefixes")
    p.add_argument("--all", action="store_true", help="upload every local entry")
    p = command("pull", pull, "download remote entries into the root")
    p.add_argument("keys", metavar="KEY", nargs="+", help="keys or unique prefixes")


def add_flag(p: argparse.ArgumentParser) -> None:
    """The commands' ``--remote`` flag: act on the remote instead of the local root."""
    p.add_argument("--remote", dest="on_remote", action="store_true",
                   help="the remote (global --remote URL or $CACHEKIT_REMOTE) instead of "
                        "the local root")


def store(args: argparse.Namespace) -> RemoteStore:
    url = getattr(args, "remote_url", None) or os.environ.get(REMOTE_ENV)
    if not url:
        raise UsageError(f"no remote: pass --remote URL before the command, or set "
                         f"{REMOTE_ENV}")
    try:
        return RemoteStore(url)
    except ValueError as e:
        raise UsageError(str(e)) from None


def push(args: argparse.Namespace) -> int:
    if args.all == bool(args.keys):
        raise UsageError("give KEYs or --all")
    remote, local = store(args), cli._layout(args)
    entries, _ = list_entries(local)
    with cli._key_errors():
        keys = resolve_keys(args.keys, [e.key for e in entries if e.problem is None]) \
            if args.keys else [e.key for e in entries if e.problem is None]
    status = 0
    for key in keys:
        published = local.lookup(key)
        if published is None:
            cli._say(f"{key[:cli.SHORT_KEY]}: removed locally meanwhile", file=sys.stderr)
            status = 1
            continue
        if remote.upload(published, progress=sys.stderr.isatty()):
            cli._say(f"pushed {key} ({units.format_size(published.manifest.bytes)})")
        else:
            cli._say(f"{key}: already on {remote.display}")
    return status


def pull(args: argparse.Namespace) -> int:
    remote, local = store(args), cli._layout(args)
    found = rm.scan(remote)
    with cli._key_errors():
        keys = resolve_keys(args.keys, [e.key for e in found.entries])
    status = 0
    for key in keys:
        if local.lookup(key) is not None:
            cli._say(f"{key}: already in {local.root}")
            continue
        local.ensure_writable(key)
        lock = locks.make_lock(local.layout.lock_path(key))
        lock.acquire(timeout=None)  # agents of this host share one download
        try:
            if local.lookup(key) is not None:
                cli._say(f"{key}: already in {local.root}")
                continue
            entry = remote.lookup(key)
            if entry is None:
                cli._say(f"cachekit: error: {key} was removed from {remote.display}",
                         file=sys.stderr)
                status = 1
                continue
            try:
                published, _ = remote.download(entry, local, progress=sys.stderr.isatty())
            except CacheCorruptError as e:
                cli._say(f"cachekit: error: {e}", file=sys.stderr)
                status = 1
                continue
        finally:
            lock.release()
        cli._say(f"pulled {key} ({units.format_size(published.manifest.bytes)}) into "
                 f"{local.root}")
    return status


def ls(args: argparse.Namespace) -> int:
    remote = store(args)
    found = rm.scan(remote)
    sort = {"used": "created", "created": "created", "size": "bytes"}[args.sort]
    entries = sorted(found.entries, key=lambda e: getattr(e, sort), reverse=True)
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=1))
    elif not entries:
        cli._say(f"no entries in {remote.display}")
    else:
        now = time.time()
        rows = [("KEY", "KIND", "ROWS", "SHAPE", "DTYPE", "SIZE", "CREATED", "")]
        for e in entries:
            m = e.entry.manifest if e.entry is not None else None
            rows.append((e.key[:cli.SHORT_KEY], m.kind if m else "?",
                         str(m.rows) if m else "?",
                         cli._shape(m.shape[1:]) or "-" if m else "?",
                         m.dtype.name if m else "?", units.format_size(e.bytes),
                         cli._age(e.created, now),
                         f"PROBLEM: {e.problem}" if e.problem else
                         (f"column {m.column}" if m and m.column else "")))
        cli._table(rows, right=(2, 5))
        cli._say(f"{cli._count(len(entries), 'entry', 'entries')}, "
                 f"{units.format_size(sum(e.bytes for e in entries))} in {remote.display}")
    _report_leftovers(found)
    return 0


def _report_leftovers(found: rm.RemoteScan, out: Any = None) -> None:
    out = sys.stderr if out is None else out
    published = {e.key for e in found.entries}
    for x in found.leftovers:
        if x.what == "lease" and x.key in published:
            continue  # the lease of a finished build: clear --remote KEY removes it
        state = "removable" if x.removable else x.kept_because
        cli._say(f"{x.what} of {x.key[:cli.SHORT_KEY]}: {len(x.objects)} object(s), "
                 f"{units.format_size(x.bytes)} ({state}); `cachekit clear --remote "
                 f"{x.key[:cli.SHORT_KEY]}` removes it", file=out)
    for obj in found.unknown[:20]:
        cli._say(f"warning: {obj.path}: not a cachekit object", file=out)


def info(args: argparse.Namespace) -> int:
    remote = store(args)
    found = rm.scan(remote)
    with cli._key_errors():
        key = resolve_keys([args.key], found.keys)[0]
    entry_info = next((e for e in found.entries if e.key == key), None)
    if entry_info is not None:
        try:
            entry = remote.lookup(key)
        except CacheCorruptError as e:
            cli._say(f"key:     {key}\nurl:     {entry_info.url}\nPROBLEM: {e.reason}")
            entry = None
        if entry is not None:
            _print_entry(remote, entry, entry_info)
    leftovers = rm.RemoteScan(tuple(e for e in found.entries if e.key == key),
                              tuple(x for x in found.leftovers if x.key == key), (), ())
    _report_leftovers(leftovers, out=sys.stdout)
    return 0


def _print_entry(remote: RemoteStore, entry: Any, info: rm.RemoteEntryInfo) -> None:
    m = entry.manifest
    now = time.time()
    fields: list[tuple[str, Any]] = [
        ("key", m.key), ("url", info.url), ("kind", m.kind), ("rows", m.rows),
        ("shape", f"{cli._shape(m.shape)} {m.dtype.name}"), ("column", m.column),
        ("failed rows", len(m.failed_rows)),
        ("size", f"{units.format_size(m.bytes)} ({m.bytes} bytes)"),
        ("created", cli._when(m.created, now)),
        ("uploaded", cli._when(info.uploaded, now) if info.uploaded else None),
        ("upload", entry.upload)]
    builder = m.builder
    fields.append(("built by", f"pid {builder.get('pid')} on {builder.get('host')} in "
                               f"{m.build_seconds} s with cachekit {m.cachekit_version}"))
    decoders = builder.get("decoders")
    if isinstance(decoders, dict):
        fields.append(("decoders", ", ".join(f"{k} {v}" for k, v in sorted(decoders.items()))))
    fields += [(f"  {name}", json.dumps(value, sort_keys=True))
               for name, value in sorted(m.params.items())]
    for record in m.files:
        fields.append((record.name, f"{record.bytes} bytes, checksum {record.checksum}"))
    fields = [(cli._printable(n), v) for n, v in fields if v is not None]
    width = max(len(n) for n, _ in fields) + 1
    for name, value in fields:
        cli._say(f"{name + ':':<{width}} {value}")


def verify(args: argparse.Namespace) -> int:
    remote = store(args)
    checking: dict[str, Any] = {"bar": None}

    def start(entries: int, total: int) -> None:
        checking["bar"] = cli._bytes_bar(total)

    def advance(size: int) -> None:
        if checking["bar"] is not None:
            checking["bar"].update(size)

    try:
        with cli._key_errors():
            checked, problems = rm.verify(remote, args.keys or None, on_start=start,
                                          on_bytes=advance)
    finally:
        if checking["bar"] is not None:
            checking["bar"].close()
    for problem in problems:
        cli._say(f"{problem.key}: {problem.message}")
    if not args.keys:
        _report_leftovers(rm.scan(remote))
    if problems:
        cli._say(f"{cli._count(len(problems), 'problem', 'problems')} in "
                 f"{cli._count(checked, 'entry', 'entries')} on {remote.display}; remove a "
                 "broken entry with `cachekit clear --remote KEY` (it is built and uploaded "
                 "again on next use)")
        return 1
    cli._say(f"{cli._count(checked, 'entry', 'entries')} verified on {remote.display}, "
             "no problems")
    return 0


def clear(args: argparse.Namespace) -> int:
    if args.all and args.keys:
        raise UsageError("give KEYs or --all, not both")
    if not (args.all or args.keys or args.older_than is not None):
        raise UsageError("say what to clear: KEY ..., --all, or --older-than AGE")
    cli._check_can_confirm(args)
    remote = store(args)
    with cli._key_errors():
        plan = rm.plan_clear(remote, args.keys or None, older_than=args.older_than)
    for x in plan.kept:
        cli._say(f"skipping the {x.what} of {x.key[:cli.SHORT_KEY]}: {x.kept_because}")
    if not len(plan):
        cli._say(f"nothing to remove in {remote.display}")
        return 0
    now = time.time()
    for e in plan.entries:
        kind = e.entry.manifest.kind if e.entry is not None else "?"
        cli._say(f"  {e.key[:cli.SHORT_KEY]}  {kind:<7} {units.format_size(e.bytes):>9}  "
                 f"created {cli._age(e.created, now)}")
    for x in plan.leftovers:
        cli._say(f"  {x.key[:cli.SHORT_KEY]}  {x.what}  {units.format_size(x.bytes)}")
    what = cli._count(len(plan.entries), "entry", "entries")
    if plan.leftovers:
        what += f" and {cli._count(len(plan.leftovers), 'leftover', 'leftovers')}"
    summary = f"{what} ({units.format_size(plan.bytes)}) in {remote.display}"
    if args.dry_run:
        cli._say(f"would remove {summary} (dry run: nothing removed)")
        return 0
    if not args.yes and not cli._confirm(f"remove {summary}? [y/N] "):
        cli._say("nothing removed")
        return 0
    failed = plan.execute()
    cli._say(f"removed {summary}" if not failed else f"removed part of {summary}")
    for what_failed, reason in failed:
        cli._say(f"cachekit: error: could not remove {what_failed}: {reason}", file=sys.stderr)
    return 1 if failed else 0

