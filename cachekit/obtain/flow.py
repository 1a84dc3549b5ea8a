"""Get a published entry for a request, building it first if needed.

A hit reads top to bottom: :func:`obtain` looks the key up (:mod:`.lookup`), checks the
manifest against the request, and returns; nothing a build needs is made, or imported. A
miss goes to :class:`~.miss.Miss`, which starts the request's build (built at once, with no
lock, when it computes nothing: every row is committed already), waits for the key's
build lock and for the live builders it cannot see, joining their builds when it may
(:mod:`.local_wait`); with a remote tier it then downloads the key's entry or takes its
lease (:mod:`.remote`); holding the lock with no live builder left, it builds and
commits, resuming this user's dead builds of the key (:mod:`.commit`), and with a lease
hands what it built to the upload. The whole wait is bounded by one ``lock_timeout``
(:mod:`.wait`). The caller opens the entry.

This module only coordinates; where bytes live is the store's business
(:mod:`cachekit.store.local`). Correctness never depends on the lock, which only saves
duplicate work: a build happens in a private directory and is published by the store's
atomic commit, so if a broken lock lets two builders race, the first rename wins and the
other uses the winner's entry. Readers of published entries never take a lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..errors import CacheCorruptError
from ..messages import say
from ..store import LocalStore, Published
from ..store.manifest import MANIFEST_FILE
from .build import Request
from .lookup import find_entry
from .outcome import Options, Outcome

if TYPE_CHECKING:
    from . import remote as remote_tier


def obtain(store: LocalStore, request: Request, *, lock_timeout: Optional[float],
           join: bool = True,
           remote: Optional["remote_tier.Tier"] = None) -> Outcome:
    """The entry of ``request.key``, checked against ``request.expected``; built with the
    request's build (:meth:`Request.start`, on a miss only) if no process has yet.

    With ``join``, fill chunks of a live build of the key while waiting for it. With
    ``remote``, a local miss looks the key up there before building, and a build is
    uploaded in the background after its local commit (:mod:`cachekit.obtain.remote`); a
    local hit never touches the remote (it only warns of this process's background uploads
    to it that failed). A remote entry that disagrees with the request is refused before
    its download (a miss).

    Every entry is checked, whatever its source. One that disagrees (a manifest of another
    dtype, shape or row count, written by another process, user or host) is removed, with
    a note on stderr, and obtained again, once: built, unless another process published a
    good entry meanwhile. A second mismatch is CacheCorruptError."""
    options = Options(lock_timeout, join, remote)
    outcome = _get(store, request, options)
    problem = _problem(request, outcome)
    if problem is None:
        return outcome
    _remove_mismatch(store, outcome.entry, problem)
    outcome = _get(store, request, options)
    problem = _problem(request, outcome)
    if problem is not None:
        raise CacheCorruptError(outcome.entry.path / MANIFEST_FILE, "the entry does not "
                                f"match the call, again after it was removed: {problem}",
                                "see who writes under the cache root")
    return outcome


def _problem(request: Request, outcome: Outcome) -> Optional[str]:
    expected = request.expected
    return None if expected is None else expected.check(outcome.entry.manifest)


def _get(store: LocalStore, request: Request, options: Options) -> Outcome:
    """A hit, or on a miss what :class:`~.miss.Miss` comes by."""
    if options.remote is not None:
        from . import background

        background.warn_failed(options.remote.store)
    found = find_entry(store, request.key)
    if found is not None:
        return Outcome(found, "local")
    from .miss import Miss  # the build's machinery: imported on a miss only

    return Miss(store, request, options).obtain()


def _remove_mismatch(store: LocalStore, entry: Published, problem: str) -> None:
    """Remove ``entry``, which disagrees with the call as ``problem`` says, unless another
    process replaced it meanwhile, and say so (always, as for an entry refused for its
    signature); CacheCorruptError when this process cannot remove it."""
    try:
        removed = store.still_published(entry) and store.remove_entry(entry.manifest.key)
    except OSError as e:
        raise CacheCorruptError(entry.path / MANIFEST_FILE,
                                f"the entry does not match the call: {problem}") from e
    if removed:
        say(f"removed entry {entry.manifest.key[:12]}: it does not match the call "
            f"({problem}); obtaining it again", always=True)


