"""What a function is, as key material: its names, source and code, what it captured, and
the caller's ``version`` (:func:`function_identity`), for ``Cache.map`` and ``memoize``."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import types
from typing import Any, Callable

from .errors import InvalidArgument, InvalidArgumentType
from .keys import digest, encode


def function_identity(fn: Callable[..., Any], version: Any = None) -> dict[str, Any]:
    """Key material naming a function's behaviour: module, qualified name, a hash of its
    source and of its compiled code, its captured values (closure cells, a bound method's
    ``self``, a partial's arguments) and defaults, and the caller's ``version``.

    Any source change, even to a comment or a blank line inside the function, changes the
    key (a rebuild, never a stale hit). For a lambda only the lambda expression itself is
    hashed, not the statement around it. The compiled code is hashed too, so a source file
    edited after it was imported cannot lend its text to the old code; bytecode differs
    between Python minor versions, so they do not share entries. Globals the function reads
    and functions it calls (other than captured ones) are not covered: bump ``version`` when
    they change. When the source or a captured value cannot be read or encoded (functions
    typed at the REPL, builtins, callable objects, closures over unencodable objects),
    ``version`` is required and names the behaviour.
    """
    if not callable(fn):
        raise InvalidArgumentType(f"expected a function, got {type(fn).__qualname__}")
    if version is not None and not isinstance(version, (str, int)):
        raise InvalidArgumentType(f"version must be a str or int, not {type(version).__qualname__}")
    if isinstance(fn, functools.partial):
        identity: dict[str, Any] = {"partial": function_identity(fn.func, version)}
    else:
        identity = {**_names(fn), "version": version}
    try:
        if isinstance(fn, functools.partial):
            identity["bound"] = digest([list(fn.args), dict(fn.keywords)])
        else:
            identity.update(_behaviour(fn, frozenset()))
    except (OSError, TypeError, ValueError, SyntaxError) as e:
        if version is None:
            raise InvalidArgumentType(
                f"cannot key function {_names(fn)['qualname']}: {e}; pass version='...' to "
                "name its behaviour yourself (and change it whenever the function changes)"
            ) from None
    return identity


def _names(fn: Any) -> dict[str, Any]:
    return {"module": getattr(fn, "__module__", None),
            "qualname": getattr(fn, "__qualname__", None)
            or getattr(fn, "__name__", None) or type(fn).__qualname__}


def _behaviour(fn: Any, seen: frozenset[int]) -> dict[str, Any]:
    """Source and code hashes, captured values and defaults; raises when one cannot be read
    or encoded."""
    source_digest, code_digest = _code_hashes(fn)
    seen = seen | {id(fn)}
    cells = zip(fn.__code__.co_freevars, getattr(fn, "__closure__", None) or ())
    captured = [_captured(cell, name, seen) for name, cell in cells]
    if inspect.ismethod(fn):
        captured.append(fn.__self__)  # a method's result depends on its instance's state
    return {
        "source": source_digest,
        "code": code_digest,
        "captured": digest(captured),
        "defaults": digest([getattr(fn, "__defaults__", None),
                            getattr(fn, "__kwdefaults__", None)]),
    }


def _captured(cell: Any, name: str, seen: frozenset[int]) -> Any:
    """A closure cell's value as key material: modules and classes by name (like globals),
    functions by their own identity, anything else as itself. A cell not yet filled (a
    method's ``__class__`` while its class body runs) is named like a global."""
    try:
        value = cell.cell_contents
    except ValueError:
        return ["unbound", name]
    if isinstance(value, types.ModuleType):
        return ["module", value.__name__]
    if isinstance(value, type):
        return ["class", value.__module__, value.__qualname__]
    if isinstance(value, types.FunctionType):
        if id(value) in seen:  # a nested function that refers to itself
            return ["recursive", value.__qualname__]
        return ["function", _names(value), _behaviour(value, seen)]
    return value


_CODE_HASHES: dict[int, tuple[types.CodeType, str, str]] = {}
"""By ``id`` of the code object, which the value holds so the id is never reused. Not by
the code object itself: code objects compare equal when only a comment differs (on 3.10
even when lines moved), and a function defined again from edited source must be read again."""


def _code_hashes(fn: Any) -> tuple[str, str]:
    """Digests of ``fn``'s source and compiled code, computed once per code object: finding
    a lambda's source parses its whole file, which a hit must not pay for every call."""
    code = getattr(fn, "__code__", None)
    if code is None:  # a builtin, ufunc or callable object: nothing to read
        raise InvalidArgumentType(f"{type(fn).__qualname__} {fn!r} has no Python source to key")
    known = _CODE_HASHES.get(id(code))
    if known is None:
        source = _source_text(fn)
        known = (code, hashlib.blake2b(source.encode(), digest_size=16).hexdigest(),
                 _code_digest(code))
        _CODE_HASHES[id(code)] = known
    return known[1], known[2]


def _code_digest(code: types.CodeType) -> str:
    """Digest of compiled code as it runs, nested code objects included."""

    def const(value: Any) -> Any:
        if isinstance(value, types.CodeType):
            return ["code", _code_digest(value)]
        if isinstance(value, frozenset):  # iteration order follows the string hash seed
            return ["frozenset", sorted(encode(const(item)) for item in value)]
        if isinstance(value, tuple):
            return ["tuple", [const(item) for item in value]]
        return [type(value).__name__, repr(value)]

    return digest([code.co_code, code.co_names, code.co_varnames, code.co_freevars,
                   code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
                   code.co_kwonlyargcount, code.co_flags, [const(c) for c in code.co_consts]])


def _source_text(fn: Any) -> str:
    """The source of ``fn``: its whole ``def`` block, or for a lambda the lambda expression.

    ``inspect.getsource`` gives a lambda's first line only (the body of a lambda spread over
    several lines would escape the key) and the same line for two lambdas written on it, so
    a lambda is found in the parsed file instead.
    """
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name != "<lambda>":
        return inspect.getsource(fn)
    lines, _ = inspect.findsource(fn)
    text = "".join(lines)
    found = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Lambda)
             and node.lineno == code.co_firstlineno]
    if len(found) > 1:
        found = _lambdas_holding(found, code)
    if len(found) != 1:
        raise InvalidArgument(f"{len(found)} lambdas on line {code.co_firstlineno} cannot be "
                              "told apart")
    segment = ast.get_source_segment(text, found[0])
    if segment is None:
        raise InvalidArgument("the lambda's source cannot be located")
    return segment


def _lambdas_holding(nodes: list[ast.Lambda], code: Any) -> list[ast.Lambda]:
    """The innermost of ``nodes`` whose text span holds every instruction of ``code``."""
    if not hasattr(code, "co_positions"):  # Python < 3.11 records no columns
        return nodes
    spans = [(l0, c0, l1, c1) for l0, l1, c0, c1 in code.co_positions()
             if None not in (l0, l1, c0, c1) and (l0, c0) != (l1, c1)]

    def holds(node: ast.Lambda) -> bool:
        start, end = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)
        return all(start <= (l0, c0) and (l1, c1) <= end for l0, c0, l1, c1 in spans)

    holding = [node for node in nodes if holds(node)]
    return [node for node in holding
            if not any(other is not node and _inside(other, node) for other in holding)]


def _inside(inner: ast.Lambda, outer: ast.Lambda) -> bool:
    start, end = (outer.lineno, outer.col_offset), (outer.end_lineno, outer.end_col_offset)
    return start <= (inner.lineno, inner.col_offset) and (
        inner.end_lineno, inner.end_col_offset) <= end
