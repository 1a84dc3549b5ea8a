"""A per-row call (``Cache.images``, ``Cache.map``) as a :class:`~.build.Request`: its key and
what its entry must look like for a hit, its :class:`~.row_build.RowBuild` on a miss, and
what happens between obtaining the entry and opening it (:meth:`RowRequest.settle`).

Settling may send the call back for a build: when an earlier check recorded that files of
the entry changed (``locks/KEY.stale.json``), when a contiguous entry was asked for and
the one found shares its rows, or when the entry this call made shares its rows from files
larger than the cache's budget, which copying its rows shrinks (:func:`copying_shrinks`).
The entry is then opened as a donor, set aside, and the call obtains the key again, built
here (never downloaded: the remote tier's copy of the key is that entry's, unless another
host healed it first); its build shares every row it can with the entry set aside
(:func:`.donors.find`'s ``healed``), which is removed once the build has linked or copied
its files. A healed entry replaces the remote tier's stale copy (:mod:`.remote`).
"""

from __future__ import annotations

import dataclasses
import errno
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..messages import say
from ..store import STALE, LocalStore, Published, linkers
from ..store.manifest import Manifest
from ..units import format_size
from .expected import Expected
from .outcome import Outcome
from .row_call import BuildSettings, RowCall

if TYPE_CHECKING:  # imported on a miss only: a hit needs none of the build's machinery
    from .row_build import RowBuild, SetAside
    from .staleness import Recorded


class RowRequest:
    """One per-row call to ``store``, as obtain and the public face see it."""

    def __init__(self, store: LocalStore, call: RowCall, settings: BuildSettings,
                 budget: Optional[int] = None) -> None:
        self.store, self.call, self.settings, self.budget = store, call, settings, budget
        self.key = call.key
        shape, dtype = call.template or (None, None)
        self.expected: Optional[Expected] = Expected(
            call.kind, rows=len(call.column), row_shape=shape,
            dtype=None if dtype is None else np.dtype(dtype).str)
        self.raise_failures = call.on_error == "raise"
        self._aside: Optional["SetAside"] = None
        self._build: Optional["RowBuild"] = None

    def start(self) -> "RowBuild":
        """The build (on a miss), given the entry set aside to be built again, if any."""
        from .row_build import RowBuild

        aside, self._aside = self._aside, None
        self._build = RowBuild(self.store, self.call, self.settings, aside)
        return self._build

    def close(self) -> None:
        """Let go of an entry set aside and not built again (removed: the next call builds
        the key), and of the donors its build found and never used."""
        if self._aside is not None:
            self._aside.close()
            self._aside = None
        if self._build is not None:
            self._build.release()

    def settle(self, outcome: Outcome) -> None:
        """Between obtaining and opening the entry: index a downloaded one, so that its rows
        may serve later builds; build it again (FileNotFoundError: obtain it again) when a
        contiguous entry was asked for and it shares its rows, or when a check recorded
        that its files changed, or when this call made it sharing its rows from files larger
        than the budget that a copy of its rows would shrink (it is built again
        contiguous)."""
        if self._aside is not None:  # another process built the key meanwhile
            self._aside.close()
            self._aside = None
        if outcome.source == "remote":
            if self._build is not None and self._build.heals is not None:
                self._heal_again_if_stale(outcome.entry)
            from .row_build import index_entry

            index_entry(self.store, outcome.entry)
        if self.call.contiguous and not outcome.entry.manifest.contiguous:
            self._build_again(outcome.entry, "its rows are shared with other entries and a "
                              "contiguous entry was asked for; copying them into one file")
            # (it returns only when it could not set the entry aside)
            say(f"entry {self.key[:12]}: a contiguous entry was asked for, but this one "
                "shares its rows and cannot be removed here (another user's, or a "
                "read-only root); returned as it is", always=True)
        elif self.budget is not None and outcome.committed_here \
                and copying_shrinks(self.store, outcome.entry.manifest, self.budget):
            manifest = outcome.entry.manifest
            self.call = dataclasses.replace(self.call, contiguous=True)
            self._build_again(outcome.entry, (
                f"its rows ({format_size(manifest.array_bytes)}) are shared from files of "
                f"{format_size(manifest.bytes)}, more than the cache budget of "
                f"{format_size(self.budget)}; copying them into one file of its own"))
        if outcome.source == "local" and self.checks_staleness(outcome):
            self._heal_if_stale(outcome.entry)

    def checks_staleness(self, outcome: Outcome) -> bool:
        """Whether the files of the entry are checked for changes: images keyed by their
        paths alone (``validate="path"``) found in the local root or downloaded from the
        remote tier (built on another host, perhaps long ago), or built here sharing rows
        on their donors' recorded stats (:attr:`.RowBuild.shared_on_record`)."""
        call = self.call
        if call.kind != "images" or call.params.get("validate") != "path":
            return False
        return (outcome.source in ("local", "remote")
                or self.shared_on_record(outcome) is not None)

    def shared_on_record(self, outcome: Outcome) -> Optional["Recorded"]:
        """The entry's rows, when this call built it sharing rows on their donors'
        records (:attr:`.RowBuild.shared_on_record`); None otherwise."""
        if outcome.source != "built" or self._build is None:
            return None
        return self._build.shared_on_record

    def record_stale(self, key: str, created: float, rows: list[int]) -> None:
        """Keep what a check found beside the entry (``locks/KEY.stale.json``), so that
        the next call of the column, in any process of this user, heals it."""
        try:
            self.store.write_record(STALE, key, {"created": created, "changed": len(rows)})
        except OSError:
            pass  # a read-only root: said as a warning all the same

    def _heal_if_stale(self, entry: Published) -> None:
        """When a check recorded that files of ``entry`` changed since it was built, build
        it again, decoding only the rows whose files changed (:meth:`_build_again`)."""
        manifest = entry.manifest
        record = self.store.read_record(STALE, self.key)[0]
        if record is None or record.get("created") != manifest.created:
            return
        self._build_again(entry, f"{record.get('changed', 'some')} of its files changed since "
                          "it was built (found by an earlier check); building it again, "
                          "decoding only their rows", stale=True)

    def _heal_again_if_stale(self, entry: Published) -> None:
        """A heal that downloaded another host's entry of the key instead of building it
        serves it only when every row's file still has the stat it records, as its own
        build would have shared only such rows (an entry that host built before the files
        changed is as stale as the one set aside); otherwise it builds it again here, in
        place of the bucket's copy too."""
        from .staleness import changed_rows

        changed = changed_rows(entry.path, entry.manifest, self.call.column)
        if changed:
            self._build_again(entry, f"the entry downloaded from the remote is stale here "
                              f"too ({len(changed)} of its files changed since it was "
                              "built); building it again, decoding only their rows",
                              stale=True)

    def _build_again(self, entry: Published, why: str, stale: bool = False) -> None:
        """Open the rows of ``entry`` to build from, set it aside, and raise
        FileNotFoundError, so that the call obtains the key again and builds it. Returns
        when another process did so first, or this one may not remove it. ``stale``: it is
        built again because files of its rows changed (its record is dropped, and a remote
        tier's copy of it is replaced: :attr:`.RowBuild.heals`)."""
        if entry.manifest.reuse is None:
            return
        from ..store.shared_rows import open_shared_rows

        source = open_shared_rows(self.store, self.key, entry.manifest.reuse.recipe)
        try:
            name = self.store.set_aside(self.key) if self.store.still_published(entry) \
                else None
        except OSError:
            name = None
        if not name:
            if source is not None:
                source.close()
            return
        if source is not None:
            source.store = None  # no longer under its key: its handle is kept, not let go of
        if stale:
            self.store.forget_record(STALE, self.key)
        from .row_build import SetAside

        self._aside = SetAside(self.store, self.key, source, name,
                               entry.manifest if stale else None)
        say(f"entry {self.key[:12]}: {why}")
        raise FileNotFoundError(errno.ENOENT, "removed to be built again", str(entry.path))


def copying_shrinks(store: LocalStore, manifest: Manifest, budget: int) -> bool:
    """Whether the derived entry of ``manifest`` holds more bytes than ``budget`` (the files
    it shares, which evicting every other entry cannot free) and a contiguous copy of its
    rows would hold fewer than removing it would free once the entries no live process uses
    are evicted (the rows of its files it does not use; a file that an entry in use links
    stays all the same, so copying its rows would only add them)."""
    return (not manifest.contiguous and manifest.bytes > budget
            and manifest.array_bytes < linkers.freeable_bytes(store.layout, manifest))
