"""The exception tree of cachekit.

::

    CachekitError                       root: catch this to catch everything cachekit raises
    +-- LockTimeout (TimeoutError)      another process held a build lock past lock_timeout
    +-- ImageDecodeError (ValueError)   rows that could not be decoded; .failures lists them all
    +-- NotAnArrayError (TypeError)     a map function returned something that is not an array
    +-- CacheCorruptError (OSError)     an entry on disk disagrees with its manifest
    |   +-- DatasetCorruptError         ... found where a torch Dataset reads its rows
    |   +-- UnsignedEntryError          ... has no valid signature while CACHEKIT_SIGNING_KEY
    |                                       is set (see :mod:`cachekit.store.signing`)
    +-- BuildGone                       the build a process worked on was committed, discarded
    |                                       or taken over meanwhile
    +-- ReadOnlyCacheError (PermissionError)  a miss needed a build but the root is read-only
    +-- CacheRootError (NotADirectoryError)   the cache root (or a parent) is not a directory
    +-- RemoteUnavailableError (OSError)      the remote tier did not answer in time or failed
    +-- UsageError                      bad command-line input (``cachekit`` exits with 2)
    +-- InvalidArgument (ValueError)    an argument has the right type but a wrong value
    +-- InvalidArgumentType (TypeError) an argument has the wrong type

``RemoteWarning`` (a CachekitError and a ``UserWarning``) is the category of the one warning
a process gives when its remote tier fails and it carries on with the local root;
``StaleEntryWarning`` (the same) the category of the warning a hit gives when files of its
column changed since the entry was built.

Every exception carries the path or rows it is about, says how to fix it, and survives
pickling, because errors cross process and thread pools.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

from . import redaction

Failure = Tuple[int, str, str]
"""One bad row: (row position, path, reason)."""


class CachekitError(Exception):
    """Root of every error cachekit raises."""


class LockTimeout(CachekitError, TimeoutError):
    """Waited ``timeout`` seconds for another process's build of ``key`` and gave up."""

    def __init__(self, lock_path: str | Path, timeout: float, owner: str = "unknown",
                 hint: str = "") -> None:
        self.lock_path = str(lock_path)
        self.timeout = timeout
        self.owner = owner
        self.hint = hint
        super().__init__(
            f"gave up after {timeout:g} s waiting for {owner} to build the entry of lock "
            f"{self.lock_path}; raise lock_timeout (None waits for good)"
            + (f", or: {hint}" if hint else "")
        )

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.lock_path, self.timeout, self.owner, self.hint))


class ImageDecodeError(CachekitError, ValueError):
    """Some rows could not be decoded; no entry was published.

    The rows that decoded are kept as a source for later builds of the same rows (not an
    entry: ``cachekit ls`` lists it among failed builds), so that a retry, or the column
    without these rows, decodes only what it must.

    ``failures`` lists every bad row as ``(row, path, reason)``, not only the first.
    ``rows`` (the column's length) and ``cwd`` (the working directory of the build): when
    every row is a missing file at a relative path, the message names ``cwd``, since the
    paths were most likely written relative to another directory. ``fix``: what to do, when
    it is not that (every row of a ``map`` with ``on_error="zero"`` failed).
    """

    def __init__(self, failures: Sequence[Failure], rows: Optional[int] = None,
                 cwd: Optional[str] = None, fix: Optional[str] = None) -> None:
        self.failures = [(int(r), redaction.value(p), redaction.text(why))
                         for r, p, why in failures]
        self.rows, self.cwd, self.fix = rows, cwd, fix
        shown = "\n".join(f"  row {r}: {p!r}: {why}" for r, p, why in self.failures[:10])
        more = len(self.failures) - 10
        tail = f"\n  ... and {more} more" if more > 0 else ""
        fix = ("fix or drop these rows, or pass on_error='zero' to store them as zeros; the "
               "rows that decoded are kept, so the next call decodes only these")
        if self.fix is not None:
            fix = self.fix
        elif self.all_missing_and_relative():
            fix = (f"every path is missing, and every path is relative: they were looked up "
                   f"from the working directory {cwd}; run from the directory they are "
                   "relative to, or give absolute paths (e.g. "
                   "df['img_path'].map(os.path.abspath) where they resolve)")
        super().__init__(f"{len(self.failures)} row(s) could not be decoded:\n{shown}{tail}\n"
                         f"{fix}")

    def all_missing_and_relative(self) -> bool:
        """Whether every one of ``rows`` rows failed as a missing file at a relative path."""
        return (self.cwd is not None and self.rows == len(self.failures) > 0 and all(
            why.startswith("FileNotFoundError") and not os.path.isabs(path)
            for _, path, why in self.failures))

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.failures, self.rows, self.cwd, self.fix))


class NotAnArrayError(CachekitError, TypeError):
    """A ``map`` function returned something other than an array or tensor: a bug in the
    function, so it is raised even with ``on_error="zero"``."""


class CacheCorruptError(CachekitError, OSError):
    """An entry's files disagree with its manifest; its bytes are never returned. Also
    raised, as a "removed cache entry" (``removed``), where an entry that a process was
    sent (a pickled ``Entry``) is gone when it opens it: nothing is corrupt there, but
    nothing can be read either."""

    FIX = "remove it with `cachekit clear KEY` and it will be rebuilt on next use"
    removed = False

    def __init__(self, path: str | Path, reason: str, fix: Optional[str] = None,
                 removed: bool = False) -> None:
        self.path = str(path)
        self.reason = reason
        self.fix = fix
        self.removed = removed
        # OSError treats a 2-tuple of args as (errno, strerror): pass one message instead.
        super().__init__(f"{'removed' if removed else 'corrupt'} cache entry {self.path}: "
                         f"{reason}; {fix or self.FIX}")

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.path, self.reason, self.fix, self.removed))


class OtherFormatError(CacheCorruptError):
    """The manifest at ``path`` is of another entry format: another cachekit version made
    it. This version never hits it nor shares its rows, but it is not damaged: ``cachekit
    verify`` does not count it as a problem, and as it is never used, ``cachekit prune``, a
    budget or ``cachekit clear --older-than`` remove it before the entries in use."""


class UnsignedEntryError(CacheCorruptError):
    """``CACHEKIT_SIGNING_KEY`` is set and the manifest at ``path`` is not signed with it
    (no signature, or one that does not match). A cache hit refuses such an entry, removes
    it and builds its own; ``ls`` and ``verify`` report it as a problem."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        OSError.__init__(
            self,
            f"refused cache entry {self.path}: {reason}; the entry was not written with this "
            "key: set the same CACHEKIT_SIGNING_KEY for every process that "
            "writes this cache root, or unset it to accept unsigned entries; "
            "`cachekit clear KEY` removes the entry (the next use builds it again, signed)"
        )

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.path, self.reason))


_ENTRY_PATH = re.compile(r"(?:corrupt|removed) cache entry (.+?): ")


class DatasetCorruptError(CacheCorruptError):
    """The entry behind a Dataset is corrupt or was removed: raised where the rows are read.

    torch re-raises a DataLoader worker's exception in the main process as
    ``type(exc)(message)`` and falls back to ``RuntimeError`` when that call fails, so this
    class also accepts that one message: ``except cachekit.CacheCorruptError`` then works the
    same with ``num_workers=0`` and ``num_workers>0``.
    """

    REMOVED = ("the entry was removed (`cachekit clear`, `prune` or a cache budget) after "
               "this Dataset was made, so there is nothing left to remove")
    """Why, when the entry's directory is gone (``removed=True``): nothing is corrupt."""
    REMOVED_FIX = ("call cache.images (or map, memoize) again to build the entry, and make a "
                   "new Dataset from the entry it returns")

    def __init__(self, path: str | Path, reason: Optional[str] = None,
                 removed: bool = False) -> None:
        if removed:  # not corrupt: gone; and `cachekit clear KEY` would find nothing
            self._message_only = False
            super().__init__(path, self.REMOVED, self.REMOVED_FIX, removed=True)
            return
        if reason is not None:
            self._message_only = False
            super().__init__(path, reason)
            return
        # torch's re-raise: `path` is the whole message, with the worker's traceback.
        message = str(path)
        found = _ENTRY_PATH.findall(message)
        self.removed = f"removed cache entry {found[-1]}: " in message if found else False
        self._message_only = True
        self.path = found[-1] if found else ""
        self.reason = message
        OSError.__init__(self, message)

    def __reduce__(self):  # type: ignore[override]
        if self._message_only:
            return (type(self), (self.reason,))
        return (type(self), (self.path, self.reason, self.removed))


class BuildGone(CachekitError):
    """The build a process was filling chunks of was committed or discarded meanwhile (a
    joiner then looks for the entry; a builder whose own build went fails with this)."""

    def __init__(self, where: str) -> None:
        super().__init__(f"the chunk journal {where} was removed while this process filled "
                         "chunks of its build; nothing of it was published by this process")
        self.where = where

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.where,))


class ReadOnlyCacheError(CachekitError, PermissionError):
    """A miss needed a build, but the cache root cannot be written."""

    def __init__(self, root: str | Path, key: str, exists: Optional[bool] = None) -> None:
        self.root = str(root)
        self.key = key
        self.exists = os.path.isdir(self.root) if exists is None else exists
        state = ("is read-only" if self.exists else
                 "does not exist and cannot be created (its parent is read-only)")
        super().__init__(
            f"cache root {self.root} {state}, and entry {key} is not in it; "
            "build it where the root is writable (`cachekit build`), or point CACHEKIT_DIR "
            "at a writable directory"
        )

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.root, self.key, self.exists))


class CacheRootError(CachekitError, NotADirectoryError):
    """The cache root ``root`` cannot be one: ``blocker`` (the root itself, or the nearest
    of its parents that exists) is not a directory. Raised by ``Cache(root)`` at once."""

    def __init__(self, root: str | Path, blocker: str | Path) -> None:
        self.root = str(root)
        self.blocker = str(blocker)
        where = ("exists and is not a directory" if self.blocker == self.root
                 else f"cannot be made: {self.blocker} is not a directory")
        OSError.__init__(self, f"cache root {self.root} {where}; give Cache(root) (or "
                               "--root, or CACHEKIT_DIR) a directory, or a path where one "
                               "can be made")

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.root, self.blocker))


class UsageError(CachekitError):
    """Bad command-line input: reported in one line, and ``cachekit`` exits with status 2."""


class InvalidArgument(CachekitError, ValueError):
    """An argument of a public call has a value cachekit cannot use; the message says what
    to pass instead. Also a ``ValueError``, so code that caught that keeps working."""


class EntryNotFoundError(InvalidArgument, KeyError):
    """No entry matches a key or key prefix given to ``clear``, ``verify`` (or a command
    taking KEYs). Also a ``KeyError``, which it was before it was an argument error."""

    __str__ = Exception.__str__  # the message, not KeyError's quoted repr of it


class InvalidArgumentType(CachekitError, TypeError):
    """An argument of a public call has a type cachekit cannot use; the message says what
    to pass instead. Also a ``TypeError``, so code that caught that keeps working."""


def failure_reason(exc: BaseException) -> str:
    """The reason recorded for a row whose function raised ``exc``: its type and message,
    redacted (:func:`cachekit.redaction.text`: the message may quote a URL's credentials)."""
    return redaction.text(f"{type(exc).__name__}: {str(exc) or repr(exc)}")


def failure(row: int, value: Any, exc: BaseException) -> Failure:
    """The record of row ``row`` whose value ``value`` raised ``exc``: the row, the value
    as :func:`cachekit.redaction.value` shows it, and the reason. What is kept of a failed
    row, in memory, in a manifest or in a failure record: never a credential."""
    return (row, redaction.value(value), failure_reason(exc))


class RemoteUnavailableError(CachekitError, OSError):
    """A call to the remote tier at ``url`` (``what`` it was doing) failed or took longer
    than ``$CACHEKIT_REMOTE_TIMEOUT``. ``reason`` never holds credentials: the URL is shown
    without any user:password part, and cachekit never has the keys themselves."""

    def __init__(self, url: str, what: str, reason: str) -> None:
        self.url = url
        self.what = what
        self.reason = reason
        OSError.__init__(self, f"remote {url} did not work while {what}: {reason}; check the "
                               "endpoint and credentials of the store (fsspec/AWS "
                               "configuration), or raise CACHEKIT_REMOTE_TIMEOUT")

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.url, self.what, self.reason))


class RemoteWarning(CachekitError, UserWarning):
    """The remote tier failed; cachekit goes on with the local root (warned once per
    process and remote)."""


class StaleEntryWarning(CachekitError, UserWarning):
    """Files of an images column changed since its entry was built, which a hit keyed by the
    paths alone (``validate="path"``) does not see (warned once per process and entry)."""
