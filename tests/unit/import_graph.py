"""The import graph of a source tree, read from the files (nothing is imported): for boundary tests.

Imports under `if TYPE_CHECKING:` are left out (they never run); imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports (absolute imports only)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
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

    Visitor().visit(ast.parse(path.read_text()))
    return {name for name in found if name in known}


def graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = module_names(root, package)
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


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
