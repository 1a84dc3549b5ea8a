"""Reading what the user typed: an argument parser whose errors are one-line usage errors,
argument types, the options several commands share, and KEY arguments, whose errors are
usage errors too (exit status 2, before anything is changed)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable, Iterator, NoReturn, TypeVar

from ..errors import UsageError

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError with one line instead of printing its usage
    and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from a parser that raises ValueError: its message becomes the
    one-line usage error."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def positive_int(text: str) -> int:
    """``text`` as an integer >= 1 (ASCII digits only: ``²`` is no number here)."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_destructive(p: argparse.ArgumentParser) -> None:
    """The options of a command that removes things: ``--dry-run`` and ``--yes``."""
    p.add_argument("--dry-run", action="store_true", help="show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")


def add_remote_flag(p: argparse.ArgumentParser) -> None:
    """The commands' ``--remote`` flag: act on the remote instead of the local root."""
    p.add_argument("--remote", dest="on_remote", action="store_true",
                   help="the remote (global --remote URL or $CACHEKIT_REMOTE) instead of "
                        "the local root")


def check_clear_selection(args: argparse.Namespace) -> None:
    """``clear`` (local or remote) names what to clear: KEYs, ``--all`` or ``--older-than``."""
    if args.all and args.keys:
        raise UsageError("give KEYs or --all, not both")
    if not (args.all or args.keys or args.older_than is not None):
        raise UsageError("say what to clear: KEY ..., --all, or --older-than AGE")


@contextlib.contextmanager
def key_errors() -> Iterator[None]:
    """Turn what :func:`cachekit.admin.inspect.resolve_keys` raises for KEY arguments
    (EntryNotFoundError: no match; InvalidArgument: not a key, or an ambiguous prefix) into
    a usage error.
    Every command that takes KEYs resolves them in this block."""
    try:
        yield
    except (KeyError, ValueError) as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None
