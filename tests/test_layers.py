"""The package's folders are layers: read from the source (AST), never by importing it.

- No import cycle among cachekit's modules (imports under ``if TYPE_CHECKING:`` aside; an
  import inside a function counts: it runs the first time that function does).
- No two modules import each other in any way: at module level, inside a function or
  under ``if TYPE_CHECKING:``.
- Each layer imports only the layers below it: base modules (the top-level helpers that
  every package uses) import base modules; ``engine/`` and ``store/`` import base modules and
  themselves, never each other; ``obtain/`` coordinates them; ``admin/`` inspects and
  removes through ``store/``; the public face (``Cache``, ``Entry``, ``memoize``, ...) may
  use every package; ``cli/`` sits on top of everything.
- No private name (one starting with ``_``) is used across packages, neither imported nor
  reached as ``module._name``, except the private modules named in ``PRIVATE_MODULES``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cachekit"
BASE = {"_fs", "file_modes", "_version", "errors", "units", "options", "keys", "key_names",
        "code_identity", "processes", "liveness", "arrays", "checksums", "messages", "redaction",
        "urls", "source_stats", "small_json", "flushing"}
FACE = {"__init__", "__main__", "cache", "arguments", "entry", "memoize", "dataset", "demo", "samples",
        "_wandb"}
LAYERS = {"base": {"base"}, "engine": {"base", "engine"}, "store": {"base", "store"},
          "obtain": {"base", "engine", "store", "obtain"},
          "admin": {"base", "store", "admin"},
          "face": {"base", "engine", "store", "obtain", "admin", "face"},
          "cli": {"base", "engine", "store", "obtain", "admin", "face", "cli"}}
PRIVATE_MODULES = {"_fs", "_version", "_workers", "_worker_main", "_wandb"}
"""Private modules that other packages may import: the platform module, the version, the
worker processes' own modules and the W&B hook."""
ALLOWED = {("__main__", "cli")}
"""Edges that break the layer rule on purpose: ``python -m cachekit`` runs the CLI."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"  # the package itself: its __init__
    if len(parts) > 2 or module in PACKAGES:
        return parts[1]
    return "base" if parts[1] in BASE else "face"


def package_of(module: str) -> str:
    return module if module in PACKAGES else module.rpartition(".")[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = package_of(module).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(module: str, type_checking: bool = False
            ) -> Iterator[tuple[str, Optional[str], str, int]]:
    """(imported module, imported name or None, bound name, line) for every cachekit
    import of ``module``; those under TYPE_CHECKING only with ``type_checking``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    skip = set() if type_checking else _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cachekit":
                    yield alias.name, None, alias.asname or alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "cachekit":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                bound = alias.asname or alias.name
                if sub in MODULES:
                    yield sub, None, bound, node.lineno
                else:
                    yield source, alias.name, bound, node.lineno


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    return {m: {target for target, _, _, _ in imports(m, type_checking)
                if target in MODULES and target != m}
            for m in MODULES}


def mutual(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if a < b and a in edges.get(b, set()))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_tree_is_read_whole() -> None:
    assert {"cachekit.cache", "cachekit.engine.filling.builder", "cachekit.store.local",
            "cachekit.obtain.flow", "cachekit.admin.removal", "cachekit.cli"} <= set(MODULES)
    assert {"cachekit.engine", "cachekit.store", "cachekit.obtain", "cachekit.admin",
            "cachekit.cli"} <= PACKAGES


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_two_modules_import_each_other_in_any_way() -> None:
    assert mutual(graph(type_checking=True)) == []


def test_the_mutual_import_finder_sees_every_kind_of_import() -> None:
    assert mutual({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [("a", "b")]
    edges = graph(type_checking=True)
    assert "cachekit.obtain" in edges["cachekit.entry"]  # a TYPE_CHECKING import
    assert "cachekit.obtain" not in graph()["cachekit.entry"]
    assert "cachekit.engine.decoding.images" in edges["cachekit.engine.running.rows"]  # in a def


def test_no_module_is_over_400_lines() -> None:
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if there not in LAYERS[here] and (module.rpartition(".")[2], there) not in ALLOWED:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert wrong == []


def test_no_private_name_is_used_across_packages() -> None:
    wrong = []
    for module in MODULES:
        home = package_of(module)
        bound_modules: dict[str, str] = {}
        for target, name, bound, line in imports(module):
            if name is None:
                bound_modules[bound] = target
            leaf = name if name is not None else target.rpartition(".")[2]
            theirs = package_of(target) if name is None else (
                target if target in PACKAGES else package_of(target))
            if (leaf.startswith("_") and not leaf.startswith("__")
                    and leaf not in PRIVATE_MODULES and theirs != home):
                wrong.append(f"{module}:{line} imports {leaf} from {target}")
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound_modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                target = bound_modules[node.value.id]
                if package_of(target) != home and target not in PACKAGES | {home}:
                    wrong.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    assert wrong == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges, expected) -> None:
    assert cycles(edges) == expected
