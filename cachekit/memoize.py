"""``@cache.memoize``: cache a whole preprocessing function's arrays, keyed by its arguments.

The key is the function's identity (:func:`cachekit.code_identity.function_identity`: module,
qualified name, source, ``version``) plus each argument, bound with ``inspect.signature``
and defaults applied, so ``f(df)`` and ``f(df, size=32)`` share an entry. The entry is
obtained through the cache's one path like every other entry, so concurrent callers share
one execution and the use is reported to W&B. The return value is stored as one ``.npy``
file per array (``data.npy``, ``leaf_1.npy``, ...; the manifest's ``files``) and a JSON
``structure`` in the manifest that nests them::

    {"array": 0}                      leaf 0 (its kind, numpy or torch, is in "leaves")
    {"tuple": [node, ...]}            also "list"
    {"dict": [[key, node], ...]}      str keys, in the returned order

Every call, hit or miss, returns that structure memory-mapped from the entry: numpy arrays
as read-only memmaps, tensors as tensors over a copy-on-write mapping of the same pages.
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import numpy as np

from . import _fs, arrays, keys
from .code_identity import function_identity
from .obtain import Expected
from .obtain.built import Built
from .store.local import MakeRoom
from .errors import CacheCorruptError, InvalidArgument, InvalidArgumentType
from .store.manifest import MEMOIZE_KIND, MANIFEST_FILE, Manifest, file_name
from .store import BuildDir

if TYPE_CHECKING:
    from .engine.filling.claimed import ChunkCallback

Node = dict  # a JSON structure node, see the module docstring
Obtain = Callable[..., Any]
"""``Cache._obtain``: (request, open function) -> the opened entry."""
EXPECTED = Expected(MEMOIZE_KIND, leaves=True)
"""What every memoize call knows of its entry before reading it: the kind, and that its
files are the leaves its structure names (the shapes and dtypes are the function's)."""


def memoize(obtain: Obtain, fn: Optional[Callable[..., Any]] = None, *,
            version: Optional[Union[str, int]] = None,
            ignore: Union[str, Iterable[str]] = (), make_room: Optional[MakeRoom] = None
            ) -> Any:
    """Decorate ``fn`` (or return a decorator when ``fn`` is None) to cache its result,
    getting entries through ``obtain``; ``make_room`` (a cache budget) is told the bytes
    of a result before they are written."""
    if fn is None:
        return lambda f: memoize(obtain, f, version=version, ignore=ignore,
                                 make_room=make_room)
    if not callable(fn):
        raise InvalidArgumentType(f"memoize decorates a function, not {type(fn).__qualname__} "
                                  f"{fn!r}; pass a version as memoize(version=...)")
    signature = inspect.signature(fn)
    ignored = _ignored_names(ignore, signature, fn)
    identity = function_identity(fn, version)  # now: a bad closure fails at decoration
    qualname = getattr(fn, "__qualname__", None) or repr(fn)

    def key_of(args: tuple, kwargs: dict) -> tuple[str, dict[str, str]]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {}
        for name, value in bound.arguments.items():
            if name in ignored:
                continue
            try:
                arguments[name] = keys.digest(value)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InvalidArgumentType(
                    f"cannot key argument {name!r} of {qualname}: {e}; pass "
                    f"ignore=({name!r},) to memoize if it does not change the result"
                ) from None
        key = keys.entry_key(MEMOIZE_KIND, {"function": identity, "arguments": arguments})
        return key, arguments

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key, arguments = key_of(args, kwargs)

        def run(current: BuildDir) -> Built:
            result = fn(*args, **kwargs)
            structure, leaves = _flatten(result, qualname)
            if make_room is not None:
                make_room(sum(array.nbytes for array, _ in leaves), [key])
            first = _write_leaves(current.dir, leaves)
            return Built(
                kind=MEMOIZE_KIND, rows=first.shape[0] if first.shape else 1,
                files=tuple((file_name(i), kind) for i, (_, kind) in enumerate(leaves)),
                params={"function": identity, "arguments": arguments}, structure=structure)

        return obtain(_Call(key, run),
                      lambda outcome: load(outcome.entry.path, outcome.entry.manifest))

    def cache_key(*args: Any, **kwargs: Any) -> str:
        """The entry key these arguments map to, without calling the function."""
        return key_of(args, kwargs)[0]

    wrapper.cache_key = cache_key  # type: ignore[attr-defined]
    return wrapper


class _Call:
    """One memoize call as a :class:`cachekit.obtain.Request`; its build (on a miss) runs
    the function with ``run`` and writes its leaves."""

    expected = EXPECTED
    raise_failures = True

    def __init__(self, key: str, run: Callable[[BuildDir], Built]) -> None:
        self.key, self.run = key, run

    def start(self) -> "_Build":
        return _Build(self.run)

    def close(self) -> None:
        pass  # its build holds nothing open before it runs


class _Build:
    """The build of a memoize entry: one whole call of the function, never joined."""

    joinable = False
    replaces = False
    heals = None

    def __init__(self, run: Callable[[BuildDir], Built]) -> None:
        self.run = run

    def computes_nothing(self) -> bool:
        return False

    def build(self, current: BuildDir, on_chunk: ChunkCallback) -> Built:
        current.drop_resumed()  # a whole-call build resumes nothing: free their disk now
        current.announce()  # it says nothing more until its commit, however long it runs
        return self.run(current)

    def join(self, directory: Any, spare: Any) -> None:
        return None

    def committed(self, published: Any) -> None:
        pass


def _ignored_names(ignore: Union[str, Iterable[str]], signature: inspect.Signature,
                   fn: Callable[..., Any]) -> frozenset[str]:
    names = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    unknown = [n for n in names if n not in signature.parameters]
    if unknown:
        raise InvalidArgument(f"ignore names {unknown} that are not parameters of "
                              f"{getattr(fn, '__qualname__', fn)}{signature}")
    return frozenset(names)


def _flatten(value: Any, qualname: str) -> tuple[Node, list[tuple[np.ndarray, str]]]:
    """Split a return value into its JSON structure and its arrays, checking every type
    before anything is written."""
    leaves: list[tuple[np.ndarray, str]] = []

    def walk(item: Any, where: str) -> Node:
        kind = type(item)
        if kind in (np.ndarray, np.memmap):
            leaves.append((_storable(item, where), "numpy"))
            return {"array": len(leaves) - 1}
        if _is_tensor(item):
            leaves.append((_storable(_tensor_array(item, where), where), "torch"))
            return {"array": len(leaves) - 1}
        if kind in (tuple, list):
            return {kind.__name__: [walk(x, f"{where}[{i}]") for i, x in enumerate(item)]}
        if kind is dict:
            bad = [k for k in item if not isinstance(k, str)]
            if bad:
                raise InvalidArgumentType(f"{qualname} returned a dict with key {bad[0]!r} at "
                                          f"{where}; only str keys can be stored")
            return {"dict": [[k, walk(v, f"{where}[{k!r}]")] for k, v in item.items()]}
        raise InvalidArgumentType(
            f"{qualname} returned {kind.__qualname__} at {where}; memoize stores a numpy "
            "array, a torch tensor, or a tuple/list/dict of them (convert it, e.g. "
            "np.asarray(...), or cache only the arrays)"
        )

    structure = walk(value, "result")
    if not leaves:
        raise InvalidArgumentType(f"{qualname} returned no arrays at all; there is nothing to "
                                  "store")
    return structure, leaves


def _storable(array: np.ndarray, where: str) -> np.ndarray:
    if array.dtype.hasobject:
        raise InvalidArgumentType(f"the array at {where} holds Python objects; only plain "
                                  "dtypes can be memory-mapped")
    return array


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor_array(tensor: Any, where: str) -> np.ndarray:
    try:
        return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as e:
        raise InvalidArgumentType(f"the tensor at {where} has no numpy equivalent ({e}); "
                                  "convert it, e.g. .float()") from None


def _write_leaves(directory: _fs.DirHandle, leaves: list[tuple[np.ndarray, str]]
                  ) -> np.ndarray:
    """Write each array to its own .npy file, in order; return the first."""
    for i, (array, _) in enumerate(leaves):
        out = arrays.create_array(directory, file_name(i), array.shape, array.dtype)
        if array.size:
            out[...] = array  # any memory layout in, C order out
            arrays.flush(out)
        del out
    return leaves[0][0]


def load(entry_dir: Path, manifest: Manifest) -> Any:
    """Rebuild a memoize entry's return value from its files, each validated and mapped."""
    path = entry_dir / MANIFEST_FILE
    if manifest.kind != MEMOIZE_KIND:
        raise CacheCorruptError(path, f"entry is a {manifest.kind!r} entry, not memoize")
    leaves = manifest.files
    opened: dict[int, Any] = {}

    def leaf(index: Any) -> Any:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(leaves):
            raise CacheCorruptError(path, f"structure refers to a missing leaf {index!r}")
        if index not in opened:
            record = leaves[index]
            if record.kind == "torch":
                import torch

                opened[index] = torch.from_numpy(record.open(entry_dir, "c"))
            else:
                opened[index] = record.open(entry_dir)
        return opened[index]

    def build(node: Any) -> Any:
        if isinstance(node, dict) and len(node) == 1:
            (tag, body), = node.items()
            if tag == "array":
                return leaf(body)
            if tag in ("tuple", "list") and isinstance(body, list):
                items = [build(x) for x in body]
                return tuple(items) if tag == "tuple" else items
            if tag == "dict" and isinstance(body, list) and all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in body
            ):
                return {k: build(v) for k, v in body}
        raise CacheCorruptError(path, f"malformed structure node {node!r}")

    return build(manifest.structure)
