"""The boundaries the design states (../shared/DESIGN.md), checked on the source: no cycles, a model that names no backend,
front-ends and deploy without JAX. Each check is also shown to fail on a tree that breaks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.unit.import_graph import collapse, cycles, graph

REPO = Path(__file__).resolve().parents[2]


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
