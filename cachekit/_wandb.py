"""Record cache use in the active Weights & Biases run, when the user has one.

A sweep's runs table then shows, per agent, which entry it trained on, whether it built or
hit, and how long it built or waited for another agent. This only happens when the user's
code already imported wandb and a run is active: cachekit never imports wandb itself (it
is slow to import, docs/sweeps.md, and optional). ``CACHEKIT_WANDB=0`` turns it off. A build
of an images entry also logs a contact sheet of sampled rows (``CACHEKIT_WANDB_SHEET=0``
turns that off). Nothing here ever raises into the user's code: a failure is reported once
as a warning.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from .messages import prefix
from .store.manifest import MEMOIZE_KIND

if TYPE_CHECKING:
    from .obtain import Outcome

ENV = "CACHEKIT_WANDB"
SHEET_ENV = "CACHEKIT_WANDB_SHEET"
SHEET_ROWS = 16
PREFIX = "cachekit/"
_OFF = ("0", "false", "no", "off")

_warned = False
_totals: dict[str, Any] = {}  # running totals over the entries of the current run


def enabled() -> bool:
    """False when ``CACHEKIT_WANDB`` is set to 0, false, no or off."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def report(outcome: Outcome) -> None:
    """Put this use of an entry into the active wandb run's summary, if there is one."""
    if not enabled():
        return
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    try:
        run = getattr(wandb, "run", None)
        if run is None:
            return
        run.summary.update(summary_fields(outcome, getattr(run, "id", None)))
        _log_sheet(wandb, run, outcome)
    except Exception as exc:  # wandb trouble must never break training
        _warn_once(exc)


def _log_sheet(wandb: Any, run: Any, outcome: "Outcome") -> None:
    """After a build of an images entry, log a contact sheet of :data:`SHEET_ROWS` sampled
    rows as a ``wandb.Image`` (``cachekit/sheet``), so the run shows what it trains on;
    ``CACHEKIT_WANDB_SHEET=0`` turns it off."""
    manifest = outcome.entry.manifest
    if outcome.word != "built" or manifest.kind != "images" or not hasattr(run, "log") \
            or os.environ.get(SHEET_ENV, "1").strip().lower() in _OFF:
        return
    from . import sheet
    from .store.entry_files import open_rows

    array = open_rows(outcome.entry.path, manifest)
    rows = sheet.choose_rows(manifest.rows, sample=SHEET_ROWS)
    picture = sheet.contact_sheet(array, rows)
    run.log({PREFIX + "sheet": wandb.Image(picture, caption=f"entry {manifest.key[:12]}: "
                                                            f"rows {rows}")})


def summary_fields(outcome: Outcome, run_id: Any = None) -> dict[str, Any]:
    """The summary items for one use of an entry: the latest entry's fields, and totals for
    the run.

    ``outcome`` is ``Entry.outcome``, what this process did (hit, waited, joined, built,
    pulled), and ``hit`` is True for a hit (local or pulled): a process that waited for
    another's build, or joined it, did not hit. ``source`` is ``Entry.source`` (local,
    remote, built, joined). The seconds are this process's own, so that a sweep's sum is
    the work done: ``build_seconds``, building (its own build, or the chunks it filled of
    another process's; 0 when it built nothing), of which ``decode_seconds`` computing rows
    and ``join_seconds`` filling another process's build; ``wait_seconds``, waiting for
    another process's build of the same entry (not counting the chunks it filled of it).
    ``rows_decoded``, ``rows_joined`` and ``rows_reused`` are ``Entry``'s: the rows this
    process decoded, those others decoded for its build, and those shared with other
    entries (all 0 on a hit), with run totals.
    """
    manifest = outcome.entry.manifest
    hit = outcome.word in ("hit", "pulled")  # one that waited for another's build did not
    built = round(float(outcome.build_seconds), 3)
    decoded = round(float(outcome.decode_seconds), 3)
    waited = round(float(outcome.wait_seconds), 3)
    if _totals.get("run") != run_id:  # a new run in the same process (wandb.agent(function=))
        _totals.clear()
        _totals.update(run=run_id, entries=0, build=0.0, decode=0.0, wait=0.0,
                       rows_decoded=0, rows_joined=0, rows_reused=0)
    rows_decoded, rows_joined, rows_reused = outcome.row_counts
    _totals["entries"] += 1
    _totals["build"] += built
    _totals["decode"] += decoded
    _totals["wait"] += waited
    _totals["rows_decoded"] += rows_decoded
    _totals["rows_joined"] += rows_joined
    _totals["rows_reused"] += rows_reused
    fields = {
        "key": manifest.key,
        "hit": hit,
        "outcome": outcome.word,
        "source": outcome.source,
        "join_seconds": round(float(outcome.join_seconds), 3),
        "build_seconds": built,
        "decode_seconds": decoded,
        "wait_seconds": waited,
        "rows": manifest.rows,
        "shape": list(manifest.shape),
        "bytes": manifest.array_bytes if manifest.kind != MEMOIZE_KIND
        else sum(f.data_bytes for f in manifest.files),  # the rows, once
        "entries": _totals["entries"],
        "build_seconds_total": round(_totals["build"], 3),
        "decode_seconds_total": round(_totals["decode"], 3),
        "wait_seconds_total": round(_totals["wait"], 3),
        "rows_decoded": rows_decoded,
        "rows_joined": rows_joined,
        "rows_reused": rows_reused,
        "rows_decoded_total": _totals["rows_decoded"],
        "rows_joined_total": _totals["rows_joined"],
        "rows_reused_total": _totals["rows_reused"],
    }
    return {PREFIX + name: value for name, value in fields.items()}


def _warn_once(exc: Exception) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    # stacklevel: 1 here, 2 report, 3 Cache._obtain, 4 Cache._rows, 5 Cache.images, 6 the user's call
    warnings.warn(f"{prefix()}: could not record cache use in the wandb run "
                  f"({type(exc).__name__}: {exc}); training goes on. "
                  f"Set {ENV}=0 to stop trying.", RuntimeWarning, stacklevel=6)
