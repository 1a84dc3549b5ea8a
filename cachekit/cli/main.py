"""The ``cachekit`` command line (also ``python -m cachekit``): look at, check, clean and
prebuild a cache, local or remote. This module builds the parser, runs one command and
turns errors into exit codes; the commands are in :mod:`cachekit.cli.local` and
:mod:`cachekit.cli.remote`.

Exit codes: 0 success, 1 a problem found (``verify``) or a failed build, 2 usage error;
130 on Ctrl-C. In full:

- 0: done, also ``--help``, ``--version``, a dry run and a declined confirmation.
- 1: the command ran and failed or found a problem: ``verify`` found one; a build failed
  (rows that cannot be decoded); a removal failed; an error while working (I/O, lock
  timeout, corrupt entry, a remote that fails or does not answer within
  ``$CACHEKIT_REMOTE_TIMEOUT``).
- 2: usage error, found before anything is changed: bad arguments (a negative size
  included); a KEY that is not a key, matches nothing or is ambiguous; a CSV that cannot
  be read, lacks the column, has no rows, or whose column has empty cells or numbers in
  place of paths (said by line of the CSV); a
  bad setting (``$CACHEKIT_LOCK``, ``$CACHEKIT_LOCK_LEASE``, ``$CACHEKIT_REMOTE_TIMEOUT``);
  a remote command without a remote (``--remote URL`` or ``$CACHEKIT_REMOTE``).
- 128 + the number of a signal, as a shell reports a command that signal ended: 130 on
  Ctrl-C (SIGINT); 141 when the reader of the output has gone (SIGPIPE, e.g.
  ``cachekit ls | head``), without a message.

Errors are one line on stderr. Destructive commands show what they will remove, ask on a
terminal, and refuse without ``--yes`` when there is none (:mod:`cachekit.cli.confirm`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Callable, Optional, Sequence

from .. import _version, liveness, options, units
from ..engine.running.choices import KINDS as EXECUTORS
from ..errors import CachekitError, UsageError
from ..store import locks, remote_fs
from .output import SORTS, fail
from .parser import Parser, add_destructive, add_remote_flag, arg, positive_int

Run = Callable[[argparse.Namespace], int]


VALUED_OPTIONS = ("--max-size", "--older-than")
"""Options whose value may be typed negative by mistake (``--max-size -5G``)."""


def _joined_negatives(argv: Sequence[str]) -> list[str]:
    """``--max-size -5G`` as ``--max-size=-5G``: argparse takes a value that starts with
    ``-`` for an option ("expected one argument"); joined, the value's own check refuses it
    in words ("a size must not be negative")."""
    out: list[str] = []
    for word in argv:
        if out and out[-1] in VALUED_OPTIONS and word[:1] == "-" and word[1:2].isdigit():
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    try:
        args = parser().parse_args(_joined_negatives(sys.argv[1:] if argv is None else argv))
        _check_settings()
        status = args.run(args)
        sys.stdout.flush()  # here, so that a reader that left is seen as one (below)
        return status
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        return fail(str(e), 2)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:  # e.g. `cachekit ls | head`: the reader left, so stop quietly
        with contextlib.suppress(OSError, ValueError):  # (a stdout with no descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for exit's flush
        return 141
    except (CachekitError, OSError) as e:
        return fail((str(e).splitlines() or [type(e).__name__])[0], 1)
    except ValueError as e:  # a bad setting read later than _check_settings
        return fail(str(e), 2)


def _check_settings() -> None:
    """Refuse a bad $CACHEKIT_LOCK, $CACHEKIT_LOCK_LEASE or $CACHEKIT_REMOTE_TIMEOUT before
    any command starts, so that it is a usage error for every command, whether or not (or
    how late) it takes a lock or calls the remote."""
    try:
        locks.kind_from_env()
        liveness.lease_from_env()
        remote_fs.timeout_from_env()
    except ValueError as e:
        raise UsageError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    """The parser of every command; each sets ``run``, the function that carries it out."""
    root_help = ("cache root (default: $CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, "
                 "else ~/.cache/cachekit)")
    top = Parser(prog="cachekit",
                 description="Inspect, check, clean and prebuild a cachekit cache.")
    top.add_argument("--root", metavar="DIR", default=None, help=root_help)
    top.add_argument("--remote", metavar="URL", dest="remote_url", default=None,
                     help="fsspec URL of the remote tier (default: $CACHEKIT_REMOTE)")
    # Also accepted after the command; SUPPRESS keeps a --root given before it.
    common = Parser(add_help=False)
    common.add_argument("--root", metavar="DIR", default=argparse.SUPPRESS, help=root_help)
    top.add_argument("--version", action="version", version=f"cachekit {_version.__version__}")
    sub = top.add_subparsers(metavar="COMMAND", required=True)
    positive = arg(positive_int)

    def command(name: str, run: str, text: str, on_remote: Optional[str] = None
                ) -> argparse.ArgumentParser:
        """A subcommand that runs the function ``run`` (``MODULE.FUNCTION`` of this package,
        imported when it runs); with ``on_remote``, also its ``--remote`` flag, which runs
        that one."""
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        p.set_defaults(run=_imported(run) if on_remote is None
                       else _local_or_remote(_imported(run), _imported(on_remote)))
        if on_remote is not None:
            add_remote_flag(p)
        return p

    command("dir", "local.show_root", "print the cache root")
    p = command("ls", "local.ls", "list entries, builds in progress and leftovers", "remote.ls")
    p.add_argument("--json", action="store_true", help="print a JSON array of entries")
    p.add_argument("--sort", choices=tuple(SORTS), default="used",
                   help="newest use, largest, or newest entry first (default: used)")
    p = command("info", "local.info", "show one entry in full", "remote.info")
    p.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
    p = command("show", "local.show", "write a contact sheet (PNG) of an images entry's rows")
    p.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rows", metavar="A:B", type=arg(units.parse_row_range),
                       help="the rows to show, e.g. 0:16 (as a Python slice, end excluded)")
    which.add_argument("--sample", metavar="N", type=positive, default=16,
                       help="show N rows spread at random over the entry (default: 16)")
    p.add_argument("-o", "--output", metavar="PNG", default=None,
                   help="where to write it (default: sheet-KEY.png here)")
    p.add_argument("--csv", metavar="CSV", default=None,
                   help="the CSV the entry was built from, to label each row with its path")
    p.add_argument("--column", metavar="NAME", default="img_path",
                   help="the column of paths in --csv (default: img_path)")
    p = command("clear", "local.clear", "remove entries (safe while other processes read)",
                "remote.clear")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or unique prefixes")
    p.add_argument("--all", action="store_true", help="remove every entry")
    p.add_argument("--older-than", metavar="AGE", type=arg(units.parse_duration),
                   help="only entries unused for this long, e.g. 7d, 12h, 1w")
    add_destructive(p)
    p = command("prune", "local.prune", "remove least recently used entries down to a size")
    p.add_argument("--max-size", metavar="SIZE", type=arg(units.parse_size), required=True,
                   help="size to shrink to, e.g. 10G (GiB), 500MB, 2.5T")
    add_destructive(p)
    p = command("verify", "local.verify", "check entries fully, data checksums included",
                "remote.verify")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or prefixes (default: all)")
    p = command("build", "local.build", "decode and resize a CSV's image column into the cache")
    p.add_argument("csv", metavar="CSV", help="CSV file with a column of image paths")
    p.add_argument("--column", required=True, help="the image path column, e.g. img_path")
    p.add_argument("--size", required=True, type=arg(units.parse_image_size),
                   help="HxW, e.g. 32x32, or N")
    p.add_argument("--mode", choices=tuple(options.MODES), default="RGB",
                   help="channels stored: RGB (3), L (1, grey) or RGBA (4) (default: RGB)")
    p.add_argument("--fit", choices=options.FITS, default="stretch",
                   help="stretch to the size, crop the centre, or pad to keep the aspect "
                        "ratio (default: stretch)")
    p.add_argument("--resample", choices=options.RESAMPLE_NAMES, default="bilinear",
                   help="Pillow resampling filter of the resize (default: bilinear)")
    p.add_argument("--workers", type=positive, default=None,
                   help="parallel decode workers (default: CPUs)")
    p.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="where rows are decoded (default: cachekit's rule, see "
                        "docs/build-engine.md)")
    p.add_argument("--on-error", choices=options.ON_ERROR, default="raise",
                   help="raise: a row that cannot be decoded fails the build and lists every "
                        "bad row; zero: store it as zeros (default: raise)")
    p.add_argument("--validate", choices=options.VALIDATE, default="path",
                   help="what the key covers: the paths, also each file's size and mtime "
                        "(stat), or every byte (content) (default: path)")
    p.add_argument("--draft", action="store_true", help="fast reduced-scale JPEG decoding")
    p.add_argument("--contiguous", action="store_true",
                   help="store the rows in one file of the entry's own, copying rows that "
                        "other entries hold instead of sharing them")
    p.add_argument("--backend", choices=options.BACKENDS, default=options.BACKENDS[0],
                   help="what decodes and resizes: torchvision and torch (default) or Pillow "
                        "throughout (v1's pixels); its own key")
    p = command("push", "remote.push", "upload local entries to the remote (manifest last)")
    p.add_argument("keys", metavar="KEY", nargs="*", help="keys or unique prefixes")
    p.add_argument("--all", action="store_true", help="upload every local entry")
    p = command("pull", "remote.pull", "download remote entries into the root")
    p.add_argument("keys", metavar="KEY", nargs="+", help="keys or unique prefixes")
    p = command("demo", "local.demo", "the end-to-end demo on generated sample images")
    p.add_argument("--images", type=positive, default=None,
                   help="sample images (default: 2000 for the race, 24 with --csv: the "
                        "README's examples)")
    p.add_argument("--agents", type=positive, default=4,
                   help="agents in each of the two waves (default: 4)")
    p.add_argument("--csv", metavar="PATH", default=None,
                   help="instead of the race, write the sample images into a folder covers/ "
                        "beside PATH and PATH itself, a CSV with the columns img_path and "
                        "label (e.g. --csv covers.csv)")
    return top


def _imported(where: str) -> Run:
    """The command function ``MODULE.FUNCTION`` of this package, imported when it runs, so
    that a command loads only what it uses: ``ls`` neither the remote tier nor the build
    engine."""
    module, name = where.split(".")

    def run(args: argparse.Namespace) -> int:
        command: Run = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return command(args)

    return run


def _local_or_remote(on_local: Run, on_remote: Run) -> Run:
    """Run ``on_remote`` when the command's ``--remote`` flag is given, else ``on_local``."""
    def run(args: argparse.Namespace) -> int:
        return (on_remote if args.on_remote else on_local)(args)

    return run
