"""MaxText's disaggregated server on CPU devices (`--xla_force_host_platform_device_count`): the
prefill engine on the first devices, the generate engine on the rest, each prompt's pages moved
between them.

- Engines over 8 devices, 4 + 4, each side's mesh fsdp 2 x tensor 2: a mixed batch (chunked
  prompts longer than one prefill, prompts behind a shared system prompt that hit the prefix cache,
  a request with logprobs) gives the interleaved engine's greedy tokens on 4 of those
  devices, with a float KV cache, and with an int8 one in a pool of 8 pages, where sequences are
  preempted and recomputed on the prefill side.
- `pathserve serve` on 2 devices, 1 + 1: concurrent greedy requests, streamed and not, give the
  tokens of one interleaved engine on XLA's ops (the same numerics); the warmup compiles both
  sides; a split that does not cover the devices stops the server before it loads anything."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.conftest import tiny_engine
from tests.server_process import ServerProcess
from tests.xla_flags import cpu_devices

TWO_DEVICES = cpu_devices(2)
# tiny_engine's shapes and numerics (XLA's ops), so that its tokens are the reference
OVERRIDES = ["per_device_batch_size=4", "max_prefill_predict_length=64", "max_target_length=128", "cpu_kernels=off",
             "decode_steps_per_call=4", "ici_tensor_parallelism=-1"]
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


def test_a_long_prompt_prefills_in_chunks_and_a_repeated_one_hits_the_prefix_cache(server, tiny_model_dir):
    """A prompt of 100 tokens (more than one prefill of 64), twice: the second reads the first's
    full page from the prefill side's pool; both give the reference's tokens."""
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    prompt = [(5 * j) % 250 + 20 for j in range(100)]
    _, engine, params = tiny_engine(tiny_model_dir, 4)
    expected = run_to_completion(engine, params, [(prompt, SamplingParams(max_tokens=MAX_TOKENS))])[0].token_ids
    hits = _metric(server, "pathserve_prefix_cache_hits")
    for _ in range(2):
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == engine.model.tokenizer.decode(expected)
    assert _metric(server, "pathserve_prefix_cache_hits") > hits


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_split_that_does_not_cover_the_devices_stops_before_loading(tiny_model_dir):
    env = {**os.environ, **TWO_DEVICES}
    run = subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", str(tiny_model_dir), *OVERRIDES,
         "inference_server=ExperimentalMaxtextDisaggregatedServer", "prefill_slice=cpu-1", "generate_slice=cpu-2"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode != 0
    assert "puts 1 devices on prefill and 2 on generate, but there are 2 devices" in run.stderr, run.stderr[-2000:]


EIGHT_DEVICES = textwrap.dedent(
    """
    import json, sys
    import jax
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine
    from serving.orchestrator.disaggregated import DisaggregatedExecutor
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams
    from serving.runtime import make_mesh

    source, requests = sys.argv[1], json.loads(sys.argv[2])
    requests = [(p, SamplingParams(max_tokens=m, logprobs=l)) for p, m, l in requests]
    devices = jax.devices()
    preempted = [0]  # the preemptions the disaggregated runs' plans carry
    prepare = DisaggregatedExecutor._prepare

    def counting(self, plan):
        preempted[0] += len(plan.preempted)
        return prepare(self, plan)

    DisaggregatedExecutor._prepare = counting
    out = {}
    # float KV with a pool for every slot; int8 KV with a pool of 8 pages (MaxText's paged keys):
    # 4 sequences of up to 4 pages each preempt one another
    for int8, pages in ((False, {}), (True, {"attention": "paged", "pagedattn_num_pages": 8, "pagedattn_tokens_per_page": 64})):
        cfg = ServingConfig(
            per_device_batch_size=1, max_prefill_predict_length=64, max_target_length=256, prefill_chunk_size=32,
            decode_steps_per_call=4, cpu_kernels="off", quantize_kvcache=int8, ici_fsdp_parallelism=2,
            ici_tensor_parallelism=2, **pages,
        )
        model = load_model(source, cfg)

        def engine(devices, **kw):
            e = Engine(model, cfg.engine, make_mesh(cfg.devices, devices), **kw)
            return e, e.load_params()

        interleaved, params = engine(devices[:4])
        generate, generate_params = engine(devices[4:])
        prefill = engine(devices[:4], mirror=generate.limits)
        preempted[0] = 0
        out[int8] = {
            "interleaved": [r.token_ids for r in run_to_completion(interleaved, params, requests, prefix_caching=True)],
            "disaggregated": [
                r.token_ids
                for r in run_to_completion(generate, generate_params, requests, prefix_caching=True, prefill=prefill)
            ],
            "slots": generate.max_concurrent_decodes,
            "pages": generate.limits.num_pages,
            "preempted": preempted[0],
            "sides": [len(prefill[0].mesh.devices.flat), len(generate.mesh.devices.flat)],
        }
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # four engines per KV format, each compiling its shapes (docs/development.md)
def test_on_8_devices_4_and_4_a_mixed_batch_gets_the_interleaved_engines_tokens(tiny_model_dir):
    system = [(11 * j) % 250 + 20 for j in range(70)]  # full pages (2 of 32; int8's: 1 of 64) and some, shared
    requests = [
        ([(3 * i + j) % 250 + 20 for j in range(n)] if i % 2 else system + [40 + i] * n, max_tokens, logprobs)
        for i, (n, max_tokens, logprobs) in enumerate(
            [(5, 150, None), (100, 140, None), (9, 16, None), (150, 30, None), (30, 8, None), (40, 24, 1), (61, 10, None)]
        )
    ]
    env = {**os.environ, **cpu_devices(8)}
    run = subprocess.run(
        [sys.executable, "-c", EIGHT_DEVICES, str(tiny_model_dir), json.dumps(requests)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for kv in ("false", "true"):  # float KV; int8 KV in a pool of 8 pages
        assert out[kv]["sides"] == [4, 4] and out[kv]["slots"] == 4  # 7 requests, 4 slots: three wait
        assert out[kv]["disaggregated"] == out[kv]["interleaved"]
        assert [len(t) for t in out[kv]["interleaved"]] == [r[1] for r in requests]
    assert out["false"]["preempted"] == 0
    assert out["true"]["pages"] == 8 and out["true"]["preempted"] > 0  # recomputed on the prefill side
