"""``Entry``: a published cache entry, mapped read-only, and how this call came by it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from .errors import CacheCorruptError, InvalidArgument
from .store import holds
from .store import manifest as manifests
from .store.entry_files import EntryFiles
from .store.row_view import Rows

if TYPE_CHECKING:
    from .obtain import Outcome

SOURCES = ("local", "remote", "built", "joined")
"""How a call obtained its entry: found in the local root (or published there by another
process while this call waited), downloaded, built by this call, or filled in part by it."""
OUTCOMES = ("hit", "waited", "joined", "built", "pulled")
"""What the process did, in one word: found the entry, waited for another process's build
of it, computed rows of that build, built it, or downloaded it from the remote tier."""


class Entry:
    """A published cache entry.

    ``array`` holds the (N, ...) rows in order, read-only: the data file's numpy memmap
    when the entry is ``contiguous``, else a :class:`~cachekit.store.row_view.RowView`
    over the files that hold its rows (rows shared with other entries are stored once;
    indexing gives numpy arrays, ``numpy.asarray`` gathers the whole). ``valid`` marks the rows
    that were produced (False where ``on_error="zero"`` stored zeros); ``manifest`` is the
    parsed manifest as a dict; ``source`` says how this call got the entry and ``hit`` is
    True when it built nothing; ``outcome`` says what this process did, in one word (one
    of :data:`OUTCOMES`: "waited" where ``source`` is "local" but another process built
    the entry while this one waited).

    What this call spent, in this process: ``wait_seconds`` waiting for another process's
    build (not counting the time it filled chunks of it), ``build_seconds`` building (its
    own build, or the chunks it filled of another's; 0 on a hit), and ``decode_seconds``,
    the part of ``build_seconds`` spent computing rows.

    While it lives, it holds its entry (:mod:`cachekit.store.holds`): ``prune``, budgets
    and ``clear --older-than`` pass over the entry as in use. It keeps the entry's files
    open (:mod:`cachekit.store.entry_files`), so that what it reads, and what the
    DataLoader workers it starts read, stays the same bytes even after ``clear`` removed
    the entry.

    ``rows_decoded``, ``rows_joined``, ``rows_reused``: of the entry's rows, those this call
    decoded, those other processes decoded for its build (its joiners, or the dead builds it
    resumed; for a joiner, the builder and the other joiners), and those its build shares
    with other entries of the same recipe or with an earlier row of its column. For a call
    that built or joined they add up to ``len(entry)``; on a hit all three are 0.
    """

    def __init__(self, path: Path, manifest: manifests.Manifest, *, source: str,
                 wait_seconds: float = 0.0, build_seconds: float = 0.0,
                 decode_seconds: float = 0.0,
                 row_counts: tuple[int, int, int] = (0, 0, 0),
                 outcome: Optional[str] = None) -> None:
        if source not in SOURCES:
            raise InvalidArgument(f"source must be one of {SOURCES}, not {source!r}")
        if outcome is None:
            from .obtain.outcome import outcome_word

            outcome = outcome_word(source)
        if outcome not in OUTCOMES:
            raise InvalidArgument(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
        self.outcome = outcome
        self.path = Path(path)
        self.key: str = manifest.key
        self.source = source
        self.wait_seconds = wait_seconds
        self.build_seconds = build_seconds
        self.decode_seconds = decode_seconds
        self.rows_decoded, self.rows_joined, self.rows_reused = (int(n) for n in row_counts)
        self._manifest = manifest
        self.manifest: dict[str, Any] = manifest.to_json()
        self.array: Rows = self._map()  # before anything sized by the manifest
        self.valid = _valid_rows(manifest)

    @classmethod
    def from_outcome(cls, outcome: "Outcome") -> "Entry":
        """The entry an obtain call came by, with what the call spent on it."""
        return cls(outcome.entry.path, outcome.entry.manifest, source=outcome.source,
                   wait_seconds=outcome.wait_seconds, build_seconds=outcome.build_seconds,
                   decode_seconds=outcome.decode_seconds, row_counts=outcome.row_counts,
                   outcome=outcome.word)

    @property
    def contiguous(self) -> bool:
        """Whether the rows are one data file's, in order (``array`` is then a memmap);
        False for a derived entry, whose rows are shared with other entries or repeat
        earlier rows of its column, each stored once (see ``cache.images(...,
        contiguous=True)``)."""
        return self._manifest.contiguous

    @property
    def hit(self) -> bool:
        """True when the entry was served without building in this call."""
        return self.source in ("local", "remote")

    def __len__(self) -> int:
        return self._manifest.rows

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the location and manifest only, a few KiB whatever N (DataLoader workers
        get entries this way), and for a child that multiprocessing starts the descriptors
        of the open files; ``array`` and ``valid`` are re-made on first use. An entry that
        came without descriptors opens its files by path then and holds the entry
        (:mod:`cachekit.store.holds`)."""
        return {k: v for k, v in self.__dict__.items()
                if k not in ("array", "valid", "_labels", "_hold")}

    def show(self, rows: Optional[Sequence[int]] = None, sample: int = 16) -> Any:
        """A contact sheet (a PIL image) of ``rows`` of an images entry, or of ``sample``
        rows spread over it: each row's pixels under its number and, for the entry a call
        of this process returned, the tail of its path (see :mod:`cachekit.sheet`)."""
        from . import sheet

        chosen = sheet.choose_rows(len(self), rows, sample)
        return sheet.contact_sheet(self.array, chosen, self.__dict__.get("_labels"))

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: for the attributes __getstate__ dropped.
        if name == "array":
            self.array = self._map()
            return self.array
        if name == "valid":
            self.valid = _valid_rows(self._manifest)
            return self.valid
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return (f"<cachekit.Entry {self.key} {self._manifest.dtype}{list(self._manifest.shape)}"
                f" {self.source}>")

    def _map(self, mode: str = "r") -> Rows:
        """The entry's rows, mapped read-only ("r") or copy-on-write ("c") from the files
        this object keeps open: the same bytes every time, after the entry was removed or
        its key built again in place too."""
        files = self.__dict__.get("_files")
        if files is None:
            files = self._files = self._open_files()
        return files.rows(self._manifest, mode)

    def _open_files(self) -> EntryFiles:
        """Open the entry's files by path, and hold the entry. When the key was built again
        in place since this entry was opened (made contiguous, or healed after a file
        changed), the files of its manifest are gone: the key's current manifest, of the
        same rows, is taken up instead (a Dask task may open an entry it was sent long
        after the call that returned it)."""
        try:
            files = EntryFiles.open(self.path, self._manifest)
        except CacheCorruptError:
            current = _rebuilt(self.path, self._manifest)
            if current is None and not self.path.exists():
                raise CacheCorruptError(self.path, REMOVED, REMOVED_FIX, removed=True) from None
            if current is None:
                raise
            files = EntryFiles.open(self.path, current)
            self._manifest, self.manifest = current, current.to_json()
        self._hold = holds.hold(self.path)
        return files

    def tensor(self):
        """A torch.Tensor of the entry's rows.

        For a contiguous entry it maps the file copy-on-write, without copying: pages are
        shared with ``array`` and every other reader through the page cache, and a write to
        the tensor changes only this process's copy of that page, never the cache (a
        read-only mapping would crash on write). It maps the file this object keeps open,
        so it does so after the entry was removed too (``clear``, ``prune``, another
        process's budget). For a derived entry it gathers the rows into memory (a copy of
        its own).
        """
        import torch

        rows = self._map("c")
        return torch.from_numpy(rows if isinstance(rows, np.ndarray) else np.asarray(rows))

    def dataset(self, targets: Any = None, transform: Optional[Callable] = None):
        """A torch Dataset over this entry: item i -> uint8 tensor, or (tensor, targets[i])."""
        from .dataset import EntryDataset

        return EntryDataset(self, targets=targets, transform=transform)


REMOVED = ("the entry was removed (`cachekit clear`, `prune` or a cache budget) after this "
           "Entry was made, before this process opened it")
REMOVED_FIX = "call cache.images (or map) again for the entry, built again if need be"


def _rebuilt(path: Path, manifest: manifests.Manifest) -> Optional[manifests.Manifest]:
    """The manifest of the entry at ``path`` when it is another build of ``manifest``'s
    key with the same rows (shape, dtype, failed rows); None otherwise."""
    try:
        current = manifests.read(path, manifest.key)
    except (OSError, CacheCorruptError):
        return None
    same = (current.shape, current.dtype, current.failed_count) == (
        manifest.shape, manifest.dtype, manifest.failed_count)
    return current if same and current != manifest else None


def _valid_rows(manifest: manifests.Manifest) -> np.ndarray:
    """Read-only (N,) bool array: False for the rows the manifest lists as failed."""
    valid = ~manifest.failed()
    valid.flags.writeable = False
    return valid
