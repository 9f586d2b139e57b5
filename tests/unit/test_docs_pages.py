"""The pages of README.md and docs/ stay true: links resolve, repository paths exist, the README stays a
front page and no page grows long, the usage synopses (`text` blocks) name options the commands have,
and the architecture page's figures on the import graph are the source's; the configuration page names
every key, the architecture page every method of the engine contract, the development page every
`PATHSERVE_*` variable. Their shell commands and Python examples: tests/test_docs_commands.py."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from itertools import takewhile

import pytest

from tests.docs_blocks import REPO, code_blocks

PATHSERVE = r"(?:\.venv/bin/)?pathserve"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def synopses() -> list[tuple[str, int, str]]:
    """(file, line, usage line) for each line of a `text` block that starts with a command."""
    out = []
    for block in code_blocks("text"):
        for offset, line in enumerate(block.text.splitlines()):
            if re.match(PATHSERVE + r" |\.venv/bin/python -m ", line):
                out.append((str(block.path), block.line + offset, line))
    return out


def _help_of(words: list[str]) -> str:
    """`pathserve WORDS --help` as printed (the bench commands hand --help to their own parsers;
    `bench serve` and `bench overhead` to loadtest's programs, run as processes)."""
    from contextlib import redirect_stdout
    from io import StringIO

    from serving.cli.main import BENCH_PROGRAMS, main

    if len(words) == 2 and words[0] == "bench" and words[1] in BENCH_PROGRAMS:
        run = subprocess.run(
            [sys.executable, "-m", BENCH_PROGRAMS[words[1]], "--help"], capture_output=True, text=True, cwd=REPO
        )
        return run.stdout
    out = StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main([*words, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("where", synopses(), ids=lambda w: f"{w[0]}:{w[1]}")
def test_usage_synopses_name_real_options(where):
    path, line, usage = where
    first = usage.split()[0]
    words = usage.split()[1:]
    if first.endswith("python"):  # python -m MODULE ...: the option in the module's source
        source = (REPO / (words[1].replace(".", "/") + ".py")).read_text()
        options = re.findall(r"--[\w-]+", usage)
        assert [o for o in options if f'"{o}"' not in source] == [], f"{path}:{line}"
        return
    help_text = _help_of(list(takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w), words)))
    options = re.findall(r"--[\w-]+", usage)
    assert [o for o in options if o not in help_text] == [], f"{path}:{line}: {usage}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and path.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


REPO_PATH = re.compile(r"(?<![\w/.-])((?:serving|tests|configs|loadtest|tools|manifests|docs)/[\w./*-]+)")


def test_the_repository_paths_the_pages_name_exist():
    """`serving/...`, `tests/...`, `configs/...` and the like, in prose and commands alike."""
    missing = []
    for page in PAGES:
        for path in REPO_PATH.findall(page.read_text()):
            path = path.rstrip(".,;:")
            if "{" not in path and not list(REPO.glob(path.rstrip("/"))):
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert missing == []


def test_the_readme_is_a_front_page_and_no_page_is_long():
    assert len((REPO / "README.md").read_text().splitlines()) < 120
    assert {
        p.name: n for p in (REPO / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > 250
    } == {}


@pytest.fixture
def import_graph():
    """tests/unit/import_graph.py, its parses of serving/ dropped after the test."""
    from tests.unit import import_graph

    yield import_graph
    import_graph.forget_parses()


def test_the_architecture_page_counts_what_the_boundary_test_skips(import_graph):
    """docs/architecture.md says how many imports sit under `if TYPE_CHECKING:` (which
    tests/unit/import_graph.py leaves out) and which cycles they would close."""
    blocks = imports = 0
    typed_edges: dict[str, set[str]] = {}
    modules = import_graph.module_names(REPO, "serving")
    for name, path in modules.items():
        for node in ast.walk(import_graph.parse(path)):
            if (
                isinstance(node, ast.If)
                and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            ):
                blocks += 1
                for statement in node.body:
                    if isinstance(statement, ast.Import | ast.ImportFrom):
                        imports += 1
                        for alias in statement.names:
                            target = statement.module or alias.name
                            sub = f"{target}.{alias.name}" if statement.module else target
                            typed_edges.setdefault(name, set()).add(sub if sub in modules else target)
    page = (REPO / "docs" / "architecture.md").read_text()
    assert f"there are {imports} of them in {blocks} blocks" in page
    edges = import_graph.graph(REPO, "serving")
    for name, targets in typed_edges.items():
        edges[name] |= {t for t in targets if t in modules and t != name}
    closed = import_graph.cycles(edges) + import_graph.cycles(import_graph.collapse(edges, 2))
    for cycle in closed:  # each cycle the page names, every module of it
        assert all(f"`{module}`" in page for module in cycle), cycle
    words = ["no", "one", "two", "three", "four", "five", "six"]
    assert f"would close {words[len(closed)]} cycle" in page, len(closed)


def test_the_configuration_page_names_every_key():
    from serving.config import ServingConfig

    page = (REPO / "docs" / "configuration.md").read_text()
    assert [key for key in ServingConfig.model_fields if f"`{key}`" not in page] == []


def test_the_architecture_page_names_every_method_of_the_engine_contract():
    tree = ast.parse((REPO / "serving" / "engine" / "api.py").read_text())
    (contract,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineAPI"]
    methods = [f.name for f in contract.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    page = (REPO / "docs" / "architecture.md").read_text()
    assert methods and [name for name in methods if f"`{name}`" not in page] == []


def test_the_development_page_names_every_pathserve_variable_the_code_reads():
    """Each `PATHSERVE_*` name written as a string in serving/, loadtest/ or tests/."""
    names = {
        name
        for folder in ("serving", "loadtest", "tests")
        for path in (REPO / folder).rglob("*.py")
        for name in re.findall(r"[\"'](PATHSERVE_[A-Z_]+)[\"']", path.read_text())
    }
    page = (REPO / "docs" / "development.md").read_text()
    assert names and sorted(name for name in names if f"`{name}`" not in page) == []
