"""`pathserve serve` with speculative decoding, a real server on loopback with the tiny model: the
n-gram lookup (its verify calls compiled at warmup) and a draft model (`speculative_model`) give
the same greedy text as a request that opts out, /metrics counts the proposals, and
`pathserve bench serve` reports them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tests.server_process import ServerProcess

OVERRIDES = ["per_device_batch_size=4", "max_prefill_predict_length=128", "max_target_length=256",
             "num_speculative_tokens=3", "prompt_lookup_min=1", "speculative_cost_ratio=0",
             "speculative_draft_cost_ratio=0"]  # a draft the target's size never pays: counted as free here
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def _complete(server, **extra):
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _proposed(server, method):
    text = httpx.get(f"{server.url}/metrics").text
    pattern = rf'^pathserve_spec_decode_proposed_tokens_total{{method="{method}"}} (\S+)$'
    return float(re.search(pattern, text, re.M).group(1))


@pytest.mark.slow  # two servers, each compiling its verify calls (docs/development.md)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_serve_speculates_with_the_same_text(tiny_model_dir, tmp_path, method):
    extra = (
        ["enable_model_warmup=true"] if method == "ngram"
        else [f"speculative_model={tiny_model_dir}", "enable_model_warmup=false"]  # not the serving profile's
    )
    server = ServerProcess.pathserve(
        str(tiny_model_dir), *OVERRIDES, f"speculative_method={method}", *extra
    ).wait_ready()
    try:
        plain = _complete(server, speculative=False)
        assert _proposed(server, method) == 0
        assert _complete(server) == plain
        assert _proposed(server, method) > 0
        if method == "ngram":
            run = subprocess.run(
                [sys.executable, "-m", "serving.cli", "bench", "serve", "--url", server.url, "--concurrency", "1",
                 "--requests", "3", "--max-prompt-words", "12", "--max-output-tokens", "120", "--ignore-eos", "--out", str(tmp_path)],
                capture_output=True, text=True, timeout=300,
            )
            assert run.returncode == 0, run.stderr[-3000:]
            level = json.loads((tmp_path / "serve-bench.json").read_text())["levels"][0]
            assert level["speculative"]["ngram"]["proposed"] > 0
            assert "speculative (ngram)" in run.stdout
    finally:
        assert server.stop() == 0, server.output()[-3000:]
