"""The check a hit of an images entry keyed by its paths alone makes: did its files change?
(A build that shares rows on their donors' recorded stats checks its entry the same way.)

With ``validate="path"`` (the default) the key is made from the paths, so a file rewritten
under the same name is a hit and serves the pixels decoded before. An entry records each
file's (size, mtime_ns) when it was built (``row_stats.npy``). A hit then:

- compares :data:`SAMPLE_ROWS` rows picked at random, however large the entry (every row
  of a smaller one), against the files now, on the hit's own path: that finds a column
  that changed in bulk (a data set regenerated, a folder copied over) at once;
- the first time an entry is hit in a process, and on a hit :data:`CONFIRMED_SECONDS` or
  more after its last one (a sweep agent that runs trial after trial in one process),
  starts a background thread that compares every row's file (about 0.5 s for 130k files
  on a local disk), so that one file rewritten among many is found too, without slowing
  the hit. The threads run one at a time, and a row whose file this process found
  unchanged against the same record within the last :data:`CONFIRMED_SECONDS` is not
  stat'ed again: ten folds of one column called one after another stat each file once,
  and a fold hit after the last one trained for minutes stats them all again. They stat
  only once the process has made no cachekit call for :data:`QUIET_SECONDS`
  (:func:`call_running`; each waits at most :data:`YIELD_SECONDS` for that in all), so
  that neither the call that started one nor the calls that follow it wait for the
  interpreter behind them.

Either says so once per process and entry (an entry built again under the same key, as
healing does, is another entry), as one :class:`StaleEntryWarning` attributed to
the user's call (the background check's too), or as a line on stderr where warnings of
that kind are filtered out: how many rows and the first few paths. What it finds is told
to the caller, which records it beside the entry, so that the next call of the column
builds the entry again, decoding only the rows whose files changed. A process that exits
right after a hit still says what the check found: at exit it waits for the check at most
:data:`EXIT_WAIT` seconds, and says so if the check could not finish. Only the process
that called ``images()`` checks: datasets in DataLoader workers never do.
``$CACHEKIT_STALE_CHECK``: ``all`` (the default), ``sample`` (no background thread, e.g. on
a network filesystem with millions of files) or ``off``. Rows of objects in a bucket are
not checked: a hit makes no request (validate="stat" keys their size and tag instead).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from .. import keys, redaction, source_stats
from ..errors import CacheCorruptError, InvalidArgument, StaleEntryWarning
from ..messages import say
from ..store.manifest import ROW_IDS_FILE, ROW_STATS_FILE, Manifest
from ..store.row_view import open_row_file

SAMPLE_ROWS = 16
QUIET_SECONDS = 0.05
"""Seconds without a cachekit call in the process before a background check stats files
(the interpreter's switch interval is 5 ms: a call would wait behind the check)."""
SHOWN_PATHS = 3
"""Paths a warning names; it counts the others."""
EXIT_WAIT = 1.0
"""Seconds an exiting process waits for its background checks (130,000 files take about
0.7 s on a local disk)."""
YIELD_SECONDS = 1.0
"""Seconds a background check waits, at most, for the process's calls to leave it quiet."""
CHUNK_ROWS = 256
"""Files a background check stats between two looks at whether a call ran."""
CONFIRMED_SECONDS = 60.0
"""Seconds a file a background check found unchanged is not stat'ed again by the process's
next checks, and an entry's files are not checked again in the background after a hit;
a file rewritten after that is found by the first check that follows."""
CHECK_ENV = "CACHEKIT_STALE_CHECK"
CHECKS = ("all", "sample", "off")
EntryId = tuple[str, float]
"""An entry as the checks know it: its key and its manifest's ``created`` time, so that the
entry built again under the key (healed) is checked and said anew."""
_warned: set[EntryId] = set()
_started: dict[EntryId, float] = {}
"""When each entry's last background check was started (``time.monotonic()``)."""
_lock = threading.Lock()
_threads: list[threading.Thread] = []
"""The background checks not known to have ended (the ended ones are dropped as new ones
start)."""
_waits_at_exit = False
_serial = threading.Lock()
"""Held by the background check that runs: one at a time, each after what the others
confirmed."""
_confirmed: list[tuple[float, np.ndarray]] = []
"""What the background checks found unchanged: (when the check began to stat, the hashes
of its rows' (identity, recorded stat)), oldest first; used under ``_serial`` only."""
_calls = 0
_last_call_ended = 0.0
_no_call = threading.Condition()


Found = Callable[[str, float, list[int]], None]
"""Told (key, the entry's created time, the changed rows found) when files changed."""


class Recorded(NamedTuple):
    """An entry's rows as a background check compares them: each row's identity word
    (``row_ids.npy``'s first column) and its file's recorded stat."""

    ids: np.ndarray
    stats: np.ndarray


def check(entry_path: Path, manifest: Manifest, paths: Any,
          found: Optional[Found] = None, built: Optional[Recorded] = None) -> None:
    """Check the files of the column ``paths`` against the stats ``manifest``'s entry
    recorded: a sample now, every row in a background thread (see the module docstring).
    What changed is told to ``found`` (which records it, so that the next call of the
    column heals the entry) before it is said. ``built``: the entry's rows, when this call
    built it sharing rows on their donors' records (the build took the sample): only the
    background check runs."""
    mode = check_mode()
    entry = (manifest.key, manifest.created)
    if (mode == "off" or not manifest.has_row_records(ROW_STATS_FILE) or entry in _warned
            or not manifest.rows):
        return
    caller = _callers_frame()
    if built is None:
        try:  # (mapped: the sample reads 16 rows of it, the background check all)
            recorded = open_row_file(entry_path, manifest, ROW_STATS_FILE)
        except (OSError, CacheCorruptError):
            return  # a hit does not stop for an advisory record
        if recorded.shape != (manifest.rows, 2):
            return
        rows = np.sort(np.random.default_rng().choice(
            manifest.rows, min(SAMPLE_ROWS, manifest.rows), replace=False))
        changed = _changed(rows, recorded, paths, stop_at=1)
        if changed:
            _tell(found, manifest, changed)
            _warn(entry, changed, None, caller)
            return
    global _waits_at_exit
    with _lock:
        now, last = time.monotonic(), _started.get(entry)
        if mode != "all" or (last is not None and now - last < CONFIRMED_SECONDS):
            return
        _started[entry] = now
        if not _waits_at_exit:
            _at_exit()
            _waits_at_exit = True
        thread = threading.Thread(target=_check_all,
                                  args=(entry_path, manifest, built, paths, caller, found),
                                  name=f"cachekit stale check {manifest.key[:12]}", daemon=True)
        _threads[:] = [t for t in _threads if t.is_alive()]
        _threads.append(thread)
        thread.start()  # (under the lock: a waiter never joins a thread not started yet)


def changed_rows(entry_path: Path, manifest: Manifest, paths: Any) -> list[int]:
    """The rows of the entry whose files differ now from its record, every file stat'ed
    here, at once: how a heal holds another host's entry of the key that it downloaded
    instead of building (:mod:`.row_request`) to what its own build would share. [] when
    the entry records no stats, or the checks are off."""
    if check_mode() == "off" or not manifest.has_row_records(ROW_STATS_FILE) \
            or not manifest.rows:
        return []
    recorded = open_row_file(entry_path, manifest, ROW_STATS_FILE)
    return [row for row, _, _, _ in _changed(np.arange(manifest.rows), recorded, paths)]


@contextlib.contextmanager
def call_running() -> Iterator[None]:
    """Tell the background checks that a cachekit call runs in this process: they stat
    once the calls have left the process quiet for :data:`QUIET_SECONDS`, not while a call
    would wait for the interpreter (the GIL) behind them."""
    global _calls, _last_call_ended
    with _no_call:
        _calls += 1
    try:
        yield
    finally:
        with _no_call:
            _calls -= 1
            _last_call_ended = time.monotonic()
            _no_call.notify_all()


def _wait_for_quiet(deadline: float) -> None:
    """Return once no cachekit call ran in the process for :data:`QUIET_SECONDS`, or at
    ``deadline``."""
    with _no_call:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            quiet = now - _last_call_ended
            if not _calls and quiet >= QUIET_SECONDS:
                return
            _no_call.wait(deadline - now if _calls else min(QUIET_SECONDS - quiet,
                                                            deadline - now))


def check_mode() -> str:
    """``$CACHEKIT_STALE_CHECK``: ``all`` (unset), ``sample`` or ``off``."""
    mode = os.environ.get(CHECK_ENV, "").strip().lower() or "all"
    if mode not in CHECKS:
        raise InvalidArgument(f"{CHECK_ENV} must be one of {', '.join(CHECKS)}; got {mode!r}")
    return mode


def wait_for_checks(timeout: Optional[float] = None) -> None:
    """Wait for the background checks this process started (for a script that wants their
    word before it exits; a hit never waits)."""
    for thread in list(_threads):
        thread.join(timeout)


def _at_exit() -> None:
    """Wait for the background checks at exit (at most :data:`EXIT_WAIT` seconds in all),
    so that a script that ends right after a hit still hears what they found."""
    import atexit

    def wait() -> None:
        deadline = time.monotonic() + EXIT_WAIT
        for thread in list(_threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                say(f"{thread.name[len('cachekit '):]}: not finished when the process exited "
                    f"(it waited {EXIT_WAIT:g} s); the entry's files were not all compared",
                    always=True)

    atexit.register(wait)


def _check_all(entry_path: Path, manifest: Manifest, built: Optional[Recorded],
               paths: Any, caller: Any, found: Optional[Found]) -> None:
    deadline = time.monotonic() + YIELD_SECONDS
    _wait_for_quiet(deadline)  # the call that started it returns first
    with _serial:
        try:
            ids, recorded = built or _rows_of(entry_path, manifest)
        except (OSError, CacheCorruptError, IndexError):
            return  # removed or damaged meanwhile: the next open says so
        hashes = _hashes(ids, recorded)
        began = time.monotonic()
        rows = np.flatnonzero(~np.isin(hashes, _recently_confirmed(began)))
        changed = []
        for first in range(0, len(rows), CHUNK_ROWS):
            _wait_for_quiet(deadline)
            changed += _changed(rows[first:first + CHUNK_ROWS], recorded, paths)
        unchanged = rows[~np.isin(rows, [row for row, _, _, _ in changed])]
        _confirmed.append((began, hashes[unchanged]))
    if changed:
        _tell(found, manifest, changed)
        try:
            _warn((manifest.key, manifest.created), changed, len(changed), caller,
                  built is not None)
        except StaleEntryWarning as e:  # warnings made errors: no traceback from a thread
            say(str(e), always=True)


def _recently_confirmed(now: float) -> np.ndarray:
    """The hashes the checks found unchanged within :data:`CONFIRMED_SECONDS` of ``now``;
    older findings are forgotten."""
    while _confirmed and now - _confirmed[0][0] > CONFIRMED_SECONDS:
        _confirmed.pop(0)
    if not _confirmed:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate([hashes for _, hashes in _confirmed])


def _rows_of(entry_path: Path, manifest: Manifest) -> Recorded:
    """The identity words and recorded stats of every row of a hit's entry, read whole
    (gathered through a derived entry's row map)."""
    ids = open_row_file(entry_path, manifest, ROW_IDS_FILE)
    stats = open_row_file(entry_path, manifest, ROW_STATS_FILE)
    return Recorded(np.asarray(ids[:])[:, 0], np.asarray(stats[:]))


def _hashes(ids: np.ndarray, recorded: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row's (identity word, recorded stat): what a check found
    unchanged is known by it."""
    return keys.frame_hashes([ids, recorded[:, 0], recorded[:, 1]], keys.PANDAS_HASH_KEY)


def _changed(rows: np.ndarray, recorded: np.ndarray, paths: Any, stop_at: int = 0
             ) -> list[tuple[int, str, tuple[int, int], tuple[int, int]]]:
    """(row, path, stat then, stat now) of each of ``rows`` whose file differs."""
    values = paths.iloc[rows].to_numpy(dtype=object)
    recorded = np.asarray(recorded[rows])  # one gather, whichever files hold them
    now, remote = source_stats.local_stat_signature(values)
    now[remote] = recorded[remote]  # not checked: a hit makes no request (docs/object-stores.md)
    differ = np.flatnonzero((now != recorded).any(axis=1))[:stop_at or None]
    return [(int(rows[i]), redaction.value(values[i]), (int(recorded[i, 0]), int(recorded[i, 1])),
             (int(now[i, 0]), int(now[i, 1]))) for i in differ]


def _tell(found: Optional[Found], manifest: Manifest, changed: list[Any]) -> None:
    if found is not None:
        found(manifest.key, manifest.created, [row for row, _, _, _ in changed])


def _warn(entry: EntryId, changed: list[tuple[int, str, tuple[int, int], tuple[int, int]]],
          total: Optional[int], caller: Any, built: bool = False) -> None:
    """Say once per process and entry that files changed: all of them (``total``, from the
    full check) or at least the first one found (the sample)."""
    with _lock:
        if entry in _warned:
            return
        _warned.add(entry)
    key = entry[0]
    row, path, then, now = changed[0]
    if total is None or total == 1:
        what = (f"the file of row {row} ({path}) changed since entry {key[:12]} was built "
                f"({_describe(then)} then, {_describe(now)} now)")
    else:
        shown = ", ".join(p for _, p, _, _ in changed[:SHOWN_PATHS])
        more = f" and {total - SHOWN_PATHS} more" if total > SHOWN_PATHS else ""
        what = f"{total} files changed since entry {key[:12]} was built ({shown}{more})"
    served = ("the entry this call built holds" if built else "this hit serves")
    text = (f"{what}; {served} the pixels decoded then, because validate=\"path\" "
            "keys the paths only. The next call of this column builds the entry again, "
            "decoding only the rows whose files changed (the others are shared); pass "
            "validate=\"stat\" to key each file's size and mtime as well")
    filename, lineno, module, registry = caller
    if _ignored(text, module, lineno):
        say(text, always=True)
        return
    warnings.warn_explicit(StaleEntryWarning(text), StaleEntryWarning, filename, lineno,
                           module, registry)


def _callers_frame() -> tuple[str, int, str, dict]:
    """Where the user called cachekit: (file, line, module, its warnings registry) of the
    first frame outside cachekit, however deep the library's path to here, for a warning
    attributed to that line (from this thread or a background one)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] \
            == "cachekit":
        frame = frame.f_back
    globals_ = frame.f_globals
    registry = globals_.setdefault("__warningregistry__", {})
    return frame.f_code.co_filename, frame.f_lineno, globals_.get("__name__", "?"), registry


def _ignored(text: str, module: str, lineno: int) -> bool:
    """Whether the warnings filters in force ignore a StaleEntryWarning of ``text`` from
    ``module``: then nobody would hear of it but for a line on stderr."""
    for action, message, category, module_re, line in warnings.filters:
        if (message is None or message.match(text)) and issubclass(StaleEntryWarning, category) \
                and (module_re is None or module_re.match(module)) \
                and (line == 0 or line == lineno):
            return action == "ignore"
    return False


def _describe(stat: tuple[int, int]) -> str:
    if stat == (-1, -1):
        return "missing"
    when = datetime.datetime.fromtimestamp(stat[1] / 1e9, datetime.timezone.utc)
    return f"{stat[0]} bytes, modified {when.isoformat(sep=' ', timespec='milliseconds')}"
