"""The commands on the remote tier: ``push``, ``pull``, and ``ls|info|verify|clear
--remote``. The remote's URL is the global ``--remote URL`` or ``$CACHEKIT_REMOTE``; the
commands' own ``--remote`` flag says to act on it instead of the local root. Like the local
commands (:mod:`cachekit.cli.local`), these only format and confirm; the work is done by
:mod:`cachekit.store.remote`, :mod:`cachekit.obtain.remote`, :mod:`cachekit.admin.remote` and
:mod:`cachekit.admin.remote_clear`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .. import units
from ..admin import remote as admin
from ..admin.remote_clear import removal_for_clear
from ..admin.remote_verify import verify as verify_remote
from ..admin.inspect import list_entries, resolve_keys
from ..errors import CacheCorruptError, UsageError
from ..obtain.remote import Tier, pull as pull_entry
from ..store import Published
from ..store.remote import RemoteEntry, RemoteStore, sent_note
from .confirm import carry_out, check_can_confirm
from .output import SHORT_KEY, ByteProgress, ago, clear_advice, count, fields, file_fields, \
    joined_by, listing, other_versions, say, shape, when
from .parser import check_clear_selection, key_errors
from .stores import local_store, remote_store


def push(args: argparse.Namespace) -> int:
    if args.all == bool(args.keys):
        raise UsageError("give KEYs or --all")
    remote, local = remote_store(args), local_store(args)
    entries, _ = list_entries(local)
    good = [e.key for e in entries if e.problem is None]
    with key_errors():
        keys = resolve_keys(args.keys, good) if args.keys else good
    status = 0
    for key in keys:
        published = local.lookup(key)
        if not isinstance(published, Published):
            why = "removed locally meanwhile" if published is None else \
                f"not pushed: {published.error.reason}"
            say(f"{key[:SHORT_KEY]}: {why}", file=sys.stderr)
            status = 1
            continue
        sent: list[int] = []
        if remote.upload(published, progress=sys.stderr.isatty(), sent=sent.append):
            say(f"pushed {key} ({units.format_size(published.manifest.bytes)}"
                f"{sent_note(sum(sent), published.manifest.bytes)})")
        else:
            say(f"{key}: already on {remote.display}")
    return status


def pull(args: argparse.Namespace) -> int:
    remote, local = remote_store(args), local_store(args)
    found = admin.scan(remote)
    with key_errors():
        keys = resolve_keys(args.keys, [e.key for e in found.entries])
    tier = Tier(remote, progress=sys.stderr.isatty())
    status = 0
    for key in keys:
        try:
            linked: list[int] = []
            got = pull_entry(tier, local, key, linked.append)
        except CacheCorruptError as e:
            say(f"cachekit: error: {e}", file=sys.stderr)
            status = 1
            continue
        if got is None:
            say(f"cachekit: error: {key} was removed from {remote.display}", file=sys.stderr)
            status = 1
        elif got[1] == "local":
            say(f"{key}: already in {local.root}")
        else:
            say(f"pulled {key} ({units.format_size(got[0].manifest.bytes)}"
                f"{_linked_note(sum(linked))}) into {local.root}")
    return status


def _linked_note(linked: int) -> str:
    """What a pull message adds when ``linked`` bytes of the pulled entry were linked from
    entries of this root rather than downloaded (:mod:`cachekit.store.local_copies`)."""
    if not linked:
        return ""
    return f"; {units.format_size(linked)} of it linked from entries here, not downloaded"


def ls(args: argparse.Namespace) -> int:
    remote = remote_store(args)
    found = admin.scan(remote)
    sort = {"used": "created", "created": "created", "size": "bytes"}[args.sort]
    entries = sorted(found.entries, key=lambda e: getattr(e, sort), reverse=True)
    now = time.time()

    def row(e: admin.RemoteEntryInfo) -> tuple[str, ...]:
        m = e.entry.manifest if e.entry is not None else None
        return (e.key[:SHORT_KEY], m.kind if m else "?", str(m.rows) if m else "?",
                shape(m.shape[1:]) or "-" if m else "?", m.dtype.name if m else "?",
                units.format_size(e.bytes), ago(e.created, now),
                f"not used: {e.problem}" if e.other_format else
                f"PROBLEM: {e.problem}" if e.problem else
                (f"column {m.column}" if m and m.column else ""))

    listing(entries, lambda: [e.to_json() for e in entries], args.json,
            f"no entries in {remote.display}",
            ("KEY", "KIND", "ROWS", "SHAPE", "DTYPE", "SIZE", "CREATED", ""), row,
            right=(2, 5), total=lambda: f"{count(len(entries), 'entry', 'entries')}, "
                                        f"{units.format_size(found.stored_bytes())} in "
                                        f"{remote.display}")
    _report_leftovers(found)
    return 0


def _report_leftovers(found: admin.RemoteScan, out: Any = None) -> None:
    out = sys.stderr if out is None else out
    published = {e.key for e in found.entries}
    for x in found.leftovers:
        if x.what == "lease" and x.key in published:
            continue  # the lease of a finished build: clear --remote KEY removes it
        state = "removable" if x.removable else x.kept_because
        if x.pool:
            say(f"{x.what}: {len(x.objects)} object(s), {units.format_size(x.bytes)} "
                f"({state}); any `cachekit clear --remote` removes them", file=out)
            continue
        how = (f"`cachekit clear --remote {x.key[:SHORT_KEY]}` removes it"
               if x.key not in published else  # (an entry replaced: a heal, a repair)
               "`cachekit clear --remote --older-than AGE` removes it, and the entries "
               f"uploaded more than AGE ago (`clear --remote {x.key[:SHORT_KEY]}` would "
               "remove the entry too)")
        say(f"{x.what} of {x.key[:SHORT_KEY]}: {len(x.objects)} object(s), "
            f"{units.format_size(x.bytes)} ({state}); {how}", file=out)
    for obj in found.unknown[:20]:
        say(f"warning: {obj.path}: not a cachekit object", file=out)


def info(args: argparse.Namespace) -> int:
    remote = remote_store(args)
    found = admin.scan(remote)
    with key_errors():
        key = resolve_keys([args.key], found.keys)[0]
    entry_info = next((e for e in found.entries if e.key == key), None)
    if entry_info is not None:
        try:
            entry = remote.lookup(key)
        except CacheCorruptError as e:
            fields([("key", key), ("url", entry_info.url), ("PROBLEM", e.reason)])
            entry = None
        if entry is not None:
            _print_entry(remote, entry, entry_info)
    leftovers = admin.RemoteScan(tuple(e for e in found.entries if e.key == key),
                                 tuple(x for x in found.leftovers if x.key == key), (), ())
    _report_leftovers(leftovers, out=sys.stdout)
    return 0


def _print_entry(remote: RemoteStore, entry: RemoteEntry, info: admin.RemoteEntryInfo) -> None:
    m = entry.manifest
    now = time.time()
    pairs: list[tuple[str, Any]] = [
        ("key", m.key), ("url", info.url), ("kind", m.kind), ("rows", m.rows),
        ("shape", f"{shape(m.shape)} {m.dtype.name}"), ("column", m.column),
        ("failed rows", m.failed_count),
        ("size", f"{units.format_size(m.bytes)} ({m.bytes} bytes)"),
        ("created", when(m.created, now)),
        ("uploaded", when(info.uploaded, now) if info.uploaded else None),
        ("upload", entry.upload)]
    builder = m.builder
    pairs.append(("built by", f"pid {builder.get('pid')} on {builder.get('host')} in "
                              f"{m.build_seconds} s with cachekit {m.cachekit_version}"))
    pairs.append(("joined by", joined_by(builder)))
    decoders = builder.get("decoders")
    if isinstance(decoders, dict):
        pairs.append(("decoders", ", ".join(f"{k} {v}" for k, v in sorted(decoders.items()))))
    pairs += [(f"  {name}", json.dumps(value, sort_keys=True))
              for name, value in sorted(m.params.items())]
    fields(pairs)
    file_fields((record.name, record.bytes, record.checksum) for record in m.files)


def verify(args: argparse.Namespace) -> int:
    remote = remote_store(args)
    others: list[admin.RemoteEntryInfo] = []
    with ByteProgress("cachekit verify") as progress, key_errors():
        checked, problems = verify_remote(remote, args.keys or None, on_start=progress.start,
                                         on_bytes=progress.advance, on_other=others.extend)
    for problem in problems:
        say(f"{problem.key}: {problem.message}")
    other_versions(len(others), sum(e.bytes for e in others),
                   "`cachekit clear --remote KEY` removes one")
    if not args.keys:
        _report_leftovers(admin.scan(remote))
    entries = count(checked, "entry", "entries")
    if problems:
        say(f"{count(len(problems), 'problem', 'problems')} in {entries} on "
            f"{remote.display}; " + clear_advice(problems, "cachekit clear --remote",
                                                 "built and uploaded again on next use"))
        return 1
    say(f"{entries} verified on {remote.display}, no problems")
    return 0


def clear(args: argparse.Namespace) -> int:
    check_clear_selection(args)
    check_can_confirm(args)
    remote = remote_store(args)
    with key_errors():
        removal = removal_for_clear(remote, args.keys or None,
                                          older_than=args.older_than)
    return carry_out(removal, args)
