"""Carrying out a removal the one way every destructive command does (``clear``, ``prune``,
``clear --remote``): show what it leaves alone and what it will remove, stop there on a dry
run, ask on a terminal (refuse without ``--yes`` when there is none), execute, and report
what went, what stayed and what failed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..admin.removal import Removal, Skipped
from ..errors import UsageError
from ..store.holds import IN_USE
from .output import holders, say


def check_can_confirm(args: argparse.Namespace) -> None:
    """Refuse, before anything is looked at, to remove without a way to ask."""
    if not (args.dry_run or args.yes or sys.stdin.isatty()):
        raise UsageError("refusing to remove anything without confirmation: stdin is not a "
                         "terminal; pass --yes (or --dry-run to see what would go)")


def carry_out(removal: Removal, args: argparse.Namespace) -> int:
    """Show ``removal``, confirm it, execute it, and report; the exit status (1 when
    something could not be removed)."""
    for skipped in removal.skipped:
        say(f"skipping {skipped.name}: {_reason(skipped)}")
    if not len(removal):
        say(f"nothing to remove {removal.goal}")
        return 0
    for item in removal.items:
        if item.line:  # lock files left behind are only counted
            say(f"  {item.line}")
    summary = removal.summary()
    if args.dry_run:
        say(f"would remove {summary} (dry run: nothing removed)")
        return 0
    if not args.yes and not confirm(f"remove {summary}? [y/N] "):
        say("nothing removed")
        return 0
    report = removal.execute()
    for skipped in report.skipped[len(removal.skipped):]:
        say(f"skipped {skipped.name}: {_reason(skipped)}")
    say(f"removed {report.summary()}")
    for failed in report.failed:
        say(f"cachekit: error: could not remove {failed.path}: {failed.reason}", file=sys.stderr)
    return 1 if report.failed else 0


def _reason(skipped: Skipped) -> str:
    """Why ``skipped`` stays, naming the processes that hold an entry in use."""
    who = holders(skipped.path) if skipped.reason == IN_USE and isinstance(
        skipped.path, Path) else ""
    return f"{skipped.reason} ({who})" if who else skipped.reason


def confirm(question: str) -> bool:
    """Ask ``question`` on stderr; whether the answer read from stdin is yes."""
    say(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")
