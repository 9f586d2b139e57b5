"""The boundaries the design states (../shared/DESIGN.md), checked on the source: no cycles, a model that names no backend,
front-ends and deploy without JAX. Each check is also shown to fail on a tree that breaks it.

"No cycles" is of the imports that run. Imports under `if TYPE_CHECKING:` (annotations only) are
counted and pinned here, with the cycles they would close: a new one fails the test until it is
listed (or removed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.import_graph import collapse, cycles, forget_parses, graph, parse, type_only_imports

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _parses_shared_by_this_modules_tests():
    yield
    forget_parses()


def _violations_of_the_model_boundary(edges: dict[str, set[str]]) -> list[str]:
    """Imports from serving.models of anything in serving outside it (kernels, engine, ...)."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        if name.startswith("serving.models")
        for target in targets
        if not target.startswith("serving.models")
    )


def test_the_serving_package_has_no_import_cycles():
    edges = graph(REPO, "serving")
    assert cycles(edges) == []
    assert cycles(collapse(edges, 2)) == []  # nor between its packages (serving.engine, ...)


# Imports for annotations only (under TYPE_CHECKING), and the cycles they would close if they ran.
TYPE_ONLY_IMPORTS = [
    "serving.api.app -> serving.orchestrator",
    "serving.api.app -> serving.request",
    "serving.api.state -> serving.orchestrator",
    "serving.api.state -> serving.text.tokenizer",
    "serving.batch.runner -> serving.orchestrator",
    "serving.engine.compiled_memory -> serving.engine.engine",
    "serving.engine.warmup -> serving.engine.engine",
    "serving.grpc.adapters -> serving.api.state",
    "serving.grpc.decode -> serving.config",
    "serving.grpc.decode -> serving.text.tokenizer",
    "serving.grpc.server -> serving.api.state",
    "serving.grpc.service -> serving.api.state",
    "serving.grpc.service -> serving.orchestrator",
    "serving.openai.convert -> serving.orchestrator",
    "serving.openai.convert -> serving.text.tokenizer",
    "serving.openai.logprobs -> serving.text.tokenizer",
    "serving.openai.streaming -> serving.orchestrator",
    "serving.openai.streaming -> serving.text.tokenizer",
    "serving.openai.tool_calls -> serving.text.tokenizer",
    "serving.orchestrator.orchestrator -> serving.lora.registry",
    "serving.orchestrator.streams -> serving.orchestrator.orchestrator",
]
CYCLES_WITH_TYPE_ONLY_IMPORTS = [
    ["serving.engine.engine", "serving.engine.warmup", "serving.engine.engine"],
    ["serving.orchestrator.orchestrator", "serving.orchestrator.streams", "serving.orchestrator.orchestrator"],
]
PACKAGE_CYCLES_WITH_TYPE_ONLY_IMPORTS = [["serving.api", "serving.grpc", "serving.api"]]


def test_imports_for_annotations_only_are_counted_with_the_cycles_they_would_close():
    assert type_only_imports(REPO, "serving") == TYPE_ONLY_IMPORTS
    edges = graph(REPO, "serving", type_checking=True)
    assert cycles(edges) == CYCLES_WITH_TYPE_ONLY_IMPORTS
    assert cycles(collapse(edges, 2)) == PACKAGE_CYCLES_WITH_TYPE_ONLY_IMPORTS


def test_the_model_imports_nothing_of_serving_outside_it():
    assert _violations_of_the_model_boundary(graph(REPO, "serving")) == []


def test_the_checks_fail_on_a_tree_that_breaks_them(tmp_path):
    models, kernels = tmp_path / "serving" / "models", tmp_path / "serving" / "kernels"
    models.mkdir(parents=True)
    kernels.mkdir()
    for package in (tmp_path / "serving", models, kernels):
        (package / "__init__.py").write_text("")
    (models / "llama.py").write_text("from serving.kernels import cpu\n")
    (kernels / "cpu.py").write_text("import serving.models.llama\n")
    edges = graph(tmp_path, "serving")
    assert cycles(edges) == [["serving.kernels.cpu", "serving.models.llama", "serving.kernels.cpu"]]
    assert _violations_of_the_model_boundary(edges) == ["serving.models.llama -> serving.kernels.cpu"]
    (kernels / "cpu.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import serving.models.llama\n")
    assert cycles(graph(tmp_path, "serving")) == []  # the import that closed it runs only for types
    assert type_only_imports(tmp_path, "serving") == ["serving.kernels.cpu -> serving.models.llama"]
    assert cycles(graph(tmp_path, "serving", type_checking=True)) != []


NO_JAX = (
    "serving.api.app",
    "serving.api.gate",
    "serving.api.prometheus",
    "serving.api.server",
    "serving.openai.convert",
    "serving.batch.runner",
    "serving.deploy.cli",
    "serving.deploy.kube",
    "serving.deploy.plan",
    "serving.engine.limits",
    "serving.grpc.server",
    "serving.grpc.service",
    "serving.grpc.decode",
    "serving.cli",
)


def _jax_modules_after_importing(modules: tuple[str, ...]) -> list[str]:
    code = (
        f"import sys; import {', '.join(modules)};"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return eval(run.stdout)


def test_front_ends_deploy_and_the_cli_import_no_jax():
    assert _jax_modules_after_importing(NO_JAX) == []


def test_the_jax_check_sees_jax():
    assert "jax" in _jax_modules_after_importing(("serving.models.llama",))


def test_the_product_imports_nothing_of_loadtest():
    """loadtest speaks HTTP to a server (or is run as a program); `serving`, its CLI included,
    never imports it: `pathserve bench serve / overhead` run loadtest's programs as processes."""
    import ast

    found = []
    for path in sorted((REPO / "serving").rglob("*.py")):
        for node in ast.walk(parse(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "loadtest" or n.startswith("loadtest.")]
    assert found == []
