"""``Cache``: the public face of cachekit.

``Cache.images``, ``Cache.map`` and ``@Cache.memoize`` check their arguments, make the
key material and a request (:class:`cachekit.obtain.RowRequest`, memoize's own), and take
one path, :meth:`Cache._obtain`: :func:`cachekit.obtain.obtain` looks the key up and
returns what it found, or waits, joins or builds (the request's build, made on a miss
only); this module then opens the entry (for images keyed by paths, checking a sample of
their files for changes), reports the use to an active W&B run and keeps to the budget.
"""

from __future__ import annotations

import os
import sys
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import numpy as np

from . import _wandb, arguments, keys, options, source_stats
from .code_identity import function_identity
from .engine.running import choices
from .engine.decoding.images import backend_for
from .engine.running.rows import ArrayRow, ImageRow
from .entry import Entry
from .errors import CacheCorruptError, InvalidArgument, InvalidArgumentType
from .messages import quiet
from .obtain import BuildSettings, Outcome, Request, RowCall, RowRequest, obtain, staleness
from .store import LocalStore, default_root
from .store.local import MakeRoom

PathLike = Union[str, "os.PathLike[str]"]
Opened = TypeVar("Opened")
_OPEN_ATTEMPTS = 5
"""Times a call obtains its entry again when it was removed (a `clear` or `prune` of
another process) between its commit and its opening: each time is a new build, so a
clear that runs in a tight loop fails a call only after five lost races in a row."""


class Cache:
    """A content-addressed, process-safe cache of preprocessed arrays under ``root``.

    ``root``: a directory, or None for $CACHEKIT_DIR, else $XDG_CACHE_HOME/cachekit, else
    ~/.cache/cachekit. ``remote``: an fsspec URL of a remote tier shared by several hosts
    (``"s3://bucket/prefix"``; None: $CACHEKIT_REMOTE; "" or unset: local only), see
    docs/object-stores.md. ``lock_timeout``: seconds to wait for another process's build (None
    waits forever). ``workers``: parallel rows in a build (None: usable CPUs).
    ``executor``: where a build's rows run: None (cachekit's rule), "threads", "processes",
    or a concurrent.futures.Executor such as dask's ``client.get_executor()`` (see
    docs/build-engine.md). ``join``: a process that finds a live build of its key (this
    host, or another host of a shared root) fills chunks nobody holds instead of only
    waiting. ``progress``: show bars (None: only when stderr is a terminal; False: no bars,
    and no notes of the call's work on stderr either, only its warnings).
    ``max_size``: the root's budget in bytes (an int, or a size such as "50G"; None:
    ``$CACHEKIT_MAX_SIZE``, unset: no budget): after each build or download this process
    commits, the least recently used entries are removed until the root fits, never the
    entry the call returns nor a live build, and before a build or download writes until
    what it writes fits too, never the entries it shares rows with; an entry the call made
    whose rows are shared from files larger than the budget is first copied into one file
    of its own, when that frees bytes (docs/managing.md).
    """

    def __init__(self, root: Optional[PathLike] = None, *, remote: Optional[str] = None,
                 lock_timeout: Optional[float] = None, workers: Optional[int] = None,
                 executor: Any = None, join: bool = True,
                 progress: Optional[bool] = None,
                 max_size: Optional[Union[int, str]] = None) -> None:
        options.check_lock_timeout(lock_timeout)
        workers = choices.check_workers(workers)
        if not isinstance(join, bool):
            raise InvalidArgumentType(f"join must be True or False, not {join!r}")
        choices.check_executor(executor)
        if progress not in (True, False, None):
            raise InvalidArgument(f"progress must be True, False or None, not {progress!r}")
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.lock_timeout = lock_timeout
        self.join = join
        self.workers = workers
        self.executor = executor
        self.progress = progress
        self.max_size = arguments.budget(max_size)
        self._store = LocalStore(self.root)
        self.remote, self._remote_store = arguments.remote_tier(remote)

    def __repr__(self) -> str:
        return f"cachekit.Cache({str(self.root)!r})"

    def _show_progress(self) -> bool:
        if self.progress is None:
            return sys.stderr is not None and sys.stderr.isatty()
        return self.progress

    def images(self, paths: Any, size: Union[int, Sequence[int]], *, mode: str = "RGB",
               fit: str = "stretch", resample: str = "bilinear", on_error: str = "raise",
               validate: str = "path", draft: bool = False,
               backend: str = "tensor",
               storage_options: Optional[dict[str, Any]] = None,
               contiguous: bool = False) -> Entry:
        """Decode, orient, convert and resize every image of ``paths`` into an (N, C, H, W)
        uint8 entry, built once whatever the number of processes asking at the same time.

        ``backend="tensor"`` (the default) decodes JPEGs with torchvision and resizes bilinear
        "stretch" and "pad" with torch's uint8 antialiased kernel: the pixels of
        ``torchvision.transforms.v2`` on the decoded tensor, within one level of the
        ``"pil"`` pipeline's (two, for a rare value). A "crop", or a filter other than
        bilinear, is ``"pil"`` for the whole call, its key included: torch's kernel would be
        more than a level off there.
        A file it does not cover (other formats, CMYK, palette, 16-bit, ...) goes through
        ``"pil"`` for that file.
        ``backend="pil"``: Pillow throughout, bit-identical to torchvision ``Resize((h, w))`` on
        the PIL image. docs/usage.md has the table of which pipeline covers what.

        ``draft=True`` lets JPEGs decode at a reduced DCT scale first: much faster, close to
        but not identical with the exact pixels (see README). Both are part of the key.

        ``paths`` may hold fsspec URLs (``s3://``, ``gs://``, ``az://``, ``https://``,
        ``file://``), mixed with local paths: their objects are fetched where the rows run
        (docs/object-stores.md, "Sources in a bucket"). ``storage_options``: keyword
        arguments for their fsspec filesystems (endpoint, credentials, ...), on top of
        fsspec's own configuration; never part of the key nor shown in a message.

        Rows that committed entries of the same recipe hold are shared with them, not
        decoded or stored again, and a file named on several rows is decoded and stored
        once: such an entry is derived (``entry.contiguous`` is False, ``entry.array`` a
        read-only row view). ``contiguous=True`` returns an entry whose
        rows are one file of its own (``entry.array`` a memmap), copying them when needed;
        it is not part of the key.
        """
        paths = arguments.path_column(paths)
        fetching = arguments.fetch_settings(paths, storage_options)
        height, width = arguments.image_size(size)
        arguments.choose("mode", mode, tuple(options.MODES))
        arguments.choose("fit", fit, options.FITS)
        arguments.choose("resample", resample, options.RESAMPLE_NAMES)
        arguments.choose("on_error", on_error, options.ON_ERROR)
        arguments.choose("validate", validate, options.VALIDATE)
        arguments.choose("backend", backend, options.BACKENDS)
        if not isinstance(draft, bool) or not isinstance(contiguous, bool):
            raise InvalidArgumentType("draft and contiguous must be True or False, not "
                                      f"{draft!r} and {contiguous!r}")
        max_read = options.max_read_bytes()  # a bad $CACHEKIT_MAX_READ_BYTES fails here
        params = {"size": [height, width], "mode": mode, "fit": fit, "resample": resample,
                  "on_error": on_error, "validate": validate, "draft": draft}
        backend = backend_for(backend, fit, resample)  # "tensor" with crop: "pil" throughout
        if backend != "pil":  # absent means "pil": the keys of "pil" entries never change
            params["backend"] = backend
        material: dict[str, Any] = {"column": keys.column_material(paths)}
        if validate == "stat":
            material["stat"] = source_stats.stat_signature(paths.to_numpy(dtype=object),
                                                           storage_options, fetching)
        elif validate == "content":
            from .engine.decoding import fetch  # (asyncio: imported only where it is used)

            material["content"] = fetch.content_signature(
                paths.to_numpy(dtype=object), self.workers, max_read, storage_options, fetching)
        row = ImageRow((height, width), mode, fit, resample, draft, max_read, backend,
                       storage_options, fetching)
        template = ((options.MODES[mode], height, width), np.dtype(np.uint8))
        entry = self._rows(RowCall("images", paths, row, params, material, template, on_error,
                                   contiguous))
        entry._labels = paths.array  # what entry.show() writes under row i: the i-th path
        # (by position, whatever the Series' index; never pickled)
        return entry

    def map(self, fn: Callable[[Any], Any], values: Any, *,
            version: Optional[Union[str, int]] = None, on_error: str = "raise") -> Entry:
        """Run ``fn`` on every value (in parallel, on the cache's executor) and stack the
        results to (N, ...).

        The first result fixes the row shape and dtype. For executor="processes" or an
        Executor instance, ``fn`` must pickle (a module-level function, not a lambda). The
        key covers ``fn``'s module, qualified name and source, ``version``, and the values
        in order. With
        ``on_error="raise"`` an exception from ``fn`` propagates unchanged and nothing is
        published; with ``"zero"`` the row is stored as zeros and marked invalid.
        """
        column = arguments.value_column(values)
        arguments.choose("on_error", on_error, options.ON_ERROR)
        params = {"function": function_identity(fn, version), "on_error": on_error}
        material = {"column": keys.column_material(column)}
        return self._rows(RowCall("map", column, ArrayRow(fn), params, material, None,
                                  on_error))

    def memoize(self, fn: Optional[Callable[..., Any]] = None, *,
                version: Optional[Union[str, int]] = None,
                ignore: Union[str, Sequence[str]] = ()) -> Any:
        """Decorator caching a whole function's returned arrays, keyed by its identity,
        ``version`` and arguments (``ignore`` names arguments left out of the key).

        Use as ``@cache.memoize`` or ``@cache.memoize(version="2", ignore=("verbose",))``;
        see :mod:`cachekit.memoize`. Every call returns the stored structure memory-mapped.
        """
        from .memoize import memoize

        return memoize(self._obtain, fn, version=version, ignore=ignore,
                       make_room=self._room_maker())

    def _obtain(self, request: Request, open_entry: Callable[[Outcome], Opened]) -> Opened:
        """The one path every entry takes: obtain it (a hit, or waiting for, joining or
        building it: :func:`cachekit.obtain.obtain`), open it, report the use to an active
        W&B run, and keep to the budget.

        ``cachekit clear`` may remove the entry between reading its manifest and opening
        its data, and ``open_entry`` may set it aside to be built again (FileNotFoundError):
        neither is corruption, so it is obtained again (the work of both: ``Outcome.after``)."""
        with quiet(self.progress is False), staleness.call_running(), closing(request):
            earlier: Optional[Outcome] = None
            for attempt in range(_OPEN_ATTEMPTS):
                outcome = obtain(self._store, request, lock_timeout=self.lock_timeout,
                                 join=self.join, remote=self._remote_tier()).after(earlier)
                try:
                    opened = open_entry(outcome)
                except (CacheCorruptError, FileNotFoundError):
                    if attempt == _OPEN_ATTEMPTS - 1 or self._store.still_published(
                            outcome.entry):
                        raise
                    earlier = outcome
                    continue
                _wandb.report(outcome)  # into the user's active wandb run; never raises
                if self.max_size is not None and outcome.committed_here:
                    from .admin.budget import keep_to_budget

                    keep_to_budget(self._store, self.max_size, outcome.entry.manifest)
                return opened
        raise AssertionError("unreachable")

    def _room_maker(self) -> Optional[MakeRoom]:
        """What leaves room within the budget for a build, a download or a memoized result
        before it writes; None without a budget. (admin.budget is imported only when room
        is made: a hit loads none of it.)"""
        return None if self.max_size is None else self._make_room

    def _make_room(self, needed: int, keep: list[str]) -> None:
        from .admin.budget import make_room

        assert self.max_size is not None
        make_room(self._store, self.max_size, needed, keep)

    def _remote_tier(self) -> Any:
        if self._remote_store is None:
            return None
        from .obtain.remote import Tier

        return Tier(self._remote_store, progress=self._show_progress(),
                    make_room=self._room_maker())

    def _rows(self, call: RowCall) -> Entry:
        """Obtain the entry of a per-row call (its rows shared with the committed entries
        of its recipe that hold them), settle it, open it and, for images keyed by their
        paths alone, check a sample of their files for changes."""
        settings = BuildSettings(self.workers, self.executor, progress=self._show_progress(),
                                 make_room=self._room_maker())
        request = RowRequest(self._store, call, settings, self.max_size)

        def open_entry(outcome: Outcome) -> Entry:
            request.settle(outcome)
            entry = Entry.from_outcome(outcome)
            if request.checks_staleness(outcome):
                staleness.check(outcome.entry.path, outcome.entry.manifest, call.column,
                                request.record_stale, request.shared_on_record(outcome))
            return entry

        return self._obtain(request, open_entry)

    # Inspection and maintenance: thin wrappers over cachekit.admin.inspect/removal/integrity.

    def entries(self) -> list:
        """Every published entry as a frozen ``EntryInfo`` (key, kind, rows, shape, dtype,
        bytes, created, last_used, path, ...), oldest first. Unreadable entries are listed
        with ``problem`` set instead of aborting the listing. The rows a failed build kept
        are listed too, with ``failed_build`` set to the key that failed: no call hits them,
        later builds share their rows, and clear and prune remove them like entries."""
        from .admin.inspect import scan

        return list(scan(self._store).entries)

    def clear(self, keys: Optional[Sequence[str]] = None, *,
              older_than: Optional[Any] = None):
        """Remove published entries: all, or ``keys`` (full keys or unique prefixes); with
        ``older_than`` (seconds, a timedelta or "7d") only those unused for that long.
        Orphaned build directories of dead builders go too. Safe while other processes read;
        builds in progress are never touched. Returns a ``RemovalReport`` (``removed_entries``,
        ``skipped``, ``failed``, ``freed_bytes``)."""
        from .admin.local_removal import removal_for_clear
        from .units import seconds

        keys = [keys] if isinstance(keys, str) else keys
        age = None if older_than is None else seconds(older_than)
        return removal_for_clear(self._store, keys, older_than=age).execute()

    def prune(self, max_bytes: Union[int, str]):
        """Remove least recently used entries until the cache holds at most ``max_bytes``
        (an int, or a size like "10G"). Returns a ``RemovalReport``."""
        from .admin.local_removal import removal_for_prune
        from .units import byte_count

        return removal_for_prune(self._store, byte_count(max_bytes)).execute()

    def verify(self, keys: Optional[Sequence[str]] = None) -> list:
        """Fully check entries (all, or ``keys``; not those another cachekit version made):
        manifest, headers, sizes, data checksums; with ``keys``, also the other entries that
        link a damaged file found. ``Problem`` (key, path, message) list."""
        from .admin.integrity import verify

        return verify(self._store, [keys] if isinstance(keys, str) else keys)
