"""`pathserve serve` as MaxText's disaggregated server, a real process on two CPU devices
(`--xla_force_host_platform_device_count=2`): the prefill engine on the first, the generate engine
on the second, each prompt's KV moved between them. Concurrent greedy requests, streamed and not,
give the tokens of one interleaved engine on XLA's ops (the same numerics); the warmup compiles
both sides; a split that does not cover the devices stops the server before it loads anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.conftest import tiny_engine
from tests.server_process import ServerProcess

TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
# tiny_engine's shapes and numerics (XLA's ops), so that its tokens are the reference
OVERRIDES = ["per_device_batch_size=4", "max_prefill_predict_length=64", "max_target_length=128", "cpu_kernels=off",
             "decode_steps_per_call=4", "prefix_cache=off", "ici_tensor_parallelism=-1"]
PROMPTS = [[(7 * i + 3 * j) % 250 + 20 for j in range(n)] for i, n in enumerate((3, 9, 17, 30, 41, 64))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Its own server: two devices and the disaggregated split, warmup on (both sides compile)."""
    process = ServerProcess.pathserve(
        str(tiny_model_dir), *OVERRIDES, "inference_server=ExperimentalMaxtextDisaggregatedServer_1",
        "enable_model_warmup=true", env=TWO_DEVICES,
    ).wait_ready()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[str]:
    model, engine, params = tiny_engine(tiny_model_dir, 4)
    runs = run_to_completion(engine, params, [(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS])
    return [model.tokenizer.decode(run.token_ids) for run in runs]


def test_the_ready_line_names_both_sides(server):
    output = server.output()
    assert "disaggregated: prefill on 1 devices" in output and "generate on 1" in output, output[-3000:]
    assert float(re.search(r"warmup (\d+\.\d) s", output)[1]) > 0  # it compiled both sides


def test_concurrent_requests_get_one_engines_greedy_tokens(server, reference):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id

    def complete(i: int) -> str:
        extra = {"ignore_eos": True}
        if i % 2:  # streamed
            stream = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body=extra)
            return "".join(chunk.choices[0].text for chunk in stream)
        reply = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 6 requests, 4 slots: two wait for room
        texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == reference


def test_a_prompt_longer_than_one_prefill_is_refused_naming_the_prompt(server):
    """Every prompt prefills whole on the prefill engine: at most max_prefill_predict_length tokens."""
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [21] * 65, "max_tokens": 4}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "max_prefill_predict_length=64" in response.json()["error"]["message"]


def test_a_split_that_does_not_cover_the_devices_stops_before_loading(tiny_model_dir):
    env = {**os.environ, **TWO_DEVICES}
    run = subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", str(tiny_model_dir), *OVERRIDES,
         "inference_server=ExperimentalMaxtextDisaggregatedServer", "prefill_slice=cpu-1", "generate_slice=cpu-2"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode != 0
    assert "puts 1 devices on prefill and 2 on generate, but there are 2 devices" in run.stderr, run.stderr[-2000:]
