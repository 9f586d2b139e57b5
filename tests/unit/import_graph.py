"""The import graph of a source tree, read from the files (nothing is imported): for boundary tests.

Imports inside functions count. Imports under `if TYPE_CHECKING:` never run: `graph` leaves them
out by default and `type_only_imports` lists them, so that a test can count them and say which
cycles they would close (`graph(..., type_checking=True)`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def parse(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per content until `forget_parses`: the boundary and
    docs tests walk the same ~160 files several times (a parse of them all takes about half a
    second). Read-only to callers."""
    return _parse(path.read_text())


def forget_parses() -> None:
    """Drop the cached trees (~170k objects: each full collection of the garbage collector would
    walk them for the rest of the session, and freeing them at exit took most of a second)."""
    _parse.cache_clear()


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def imports_of(path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The modules of `known` that the file imports (absolute imports only); those under
    `if TYPE_CHECKING:` only with `type_checking`."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING" and not type_checking:
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level or node.module is None:
                return
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)

    Visitor().visit(parse(path))
    return {name for name in found if name in known}


def graph(root: Path, package: str, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (with `type_checking`, also those it
    imports for annotations only)."""
    modules = module_names(root, package)
    known = set(modules)
    return {name: imports_of(path, known, type_checking) - {name} for name, path in modules.items()}


def type_only_imports(root: Path, package: str) -> list[str]:
    """"module -> target" for each import of the package that runs only under TYPE_CHECKING."""
    at_run_time, with_types = graph(root, package), graph(root, package, type_checking=True)
    return sorted(f"{m} -> {t}" for m, targets in with_types.items() for t in targets - at_run_time[m])


def collapse(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph between packages named by their first `depth` dotted parts (serving.engine, ...)."""

    def unit(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    out: dict[str, set[str]] = {}
    for name, targets in edges.items():
        out.setdefault(unit(name), set()).update(unit(t) for t in targets if unit(t) != unit(name))
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Some cycles of the graph (empty exactly when it has none), each as a closed path."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found
