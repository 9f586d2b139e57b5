"""A disaggregated server on a multi-controller slice for real: three `pathserve serve` processes
of one virtual CPU device each, JAX's distributed runtime over loopback (gloo). Process 0 is the
prefill group (it serves HTTP and schedules); processes 1 and 2 are the generate group, one
2-device mesh across both (tensor=2, its collectives between the processes). Prompts' pages move
from process 0 to each generate process by `jax.experimental.transfer`, preempted slots' states
back; the generate call's tokens reach process 0 through the distributed runtime's key-value store.

A mixed batch (prompts longer than a chunk, prompts behind a shared system prompt of more than a
page, a request with logprobs) with an int8 KV cache in a pool of 5 pages (4 slots of up
to 4 pages: sequences are preempted and recomputed on the prefill side) gives the greedy tokens of
the interleaved engine in one process with a pool for every slot, and so do two sequences that
preempt each other while they decode (the state moves back to process 0); both generate processes
pull the same bytes. A float KV cache on two processes (1 + 1, no warmup) gives the same tokens
too, and a request behind the system prompt after them hits the prefix cache.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.server_process import ServerProcess, free_port
from tests.xla_flags import cpu_devices

pytestmark = pytest.mark.slow  # three processes compiling both sides (docs/development.md)

ENGINE = [
    "per_device_batch_size=2",  # 2 generate devices: 4 slots
    "max_prefill_predict_length=64",
    "max_target_length=256",
    "prefill_chunk_size=32",
    "decode_steps_per_call=4",
    "cpu_kernels=off",  # XLA's ops: the reference engine's numerics
    "ici_tensor_parallelism=-1",
    "quantize_kvcache=true",
    "attention=paged",
    "pagedattn_num_pages=5",  # the scratch page and 4: one longest sequence at a time
    "pagedattn_tokens_per_page=64",
    "enable_model_warmup=true",  # each group compiles its own side's calls
    "inference_server=ExperimentalMaxtextDisaggregatedServer",
    "prefill_slice=cpu-1",
    "generate_slice=cpu-2",
]
ONE_DEVICE = cpu_devices(1)
SYSTEM = [(11 * j) % 250 + 20 for j in range(70)]  # a full page of 64 and some, shared
REQUESTS = [  # (prompt, max_tokens, logprobs)
    ([(3 * i + j) % 250 + 20 for j in range(n)] if i % 2 else SYSTEM + [40 + i] * n, max_tokens, logprobs)
    for i, (n, max_tokens, logprobs) in enumerate(
        [(5, 150, None), (100, 140, None), (9, 16, None), (150, 30, None), (30, 8, None), (40, 24, 1), (61, 10, None)]
    )
]

# Then two short prompts that decode 200 tokens each at once: both grow into their third page
# together, and the 4 pages cannot hold 6, so the newer is preempted while it decodes (its state
# goes back to the prefill side for the recompute).
DECODING = [([21, 22, 23, 24, 25, 26, 27, 28, 29, 30], 200, None), ([31, 32, 33, 34, 35, 36, 37, 38, 39, 40], 200, None)]


def serving_group(args: list[str], count: int):
    """`count` `pathserve serve ARGS` processes of one device each, one distributed runtime;
    yields them once process 0 is ready, stops them after."""
    coordinator = free_port()
    processes = [
        ServerProcess.pathserve(
            *args, "runtime=multicontroller", f"coordinator_address=127.0.0.1:{coordinator}",
            f"num_processes={count}", f"process_id={process_id}", "distributed_timeout_s=10", env=ONE_DEVICE,
        )
        for process_id in range(count)
    ]
    try:
        processes[0].wait_ready(timeout=600)
        yield processes
    finally:
        for process in processes:
            process.stop()


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    """(process 0, process 1, process 2), process 0 ready to serve."""
    yield from serving_group([str(tiny_model_dir), *ENGINE], 3)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    """The interleaved engine's tokens in this process (one device, a pool for every slot)."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine

    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=256, prefill_chunk_size=32,
        decode_steps_per_call=4, cpu_kernels="off", quantize_kvcache=True,
    )
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    params = engine.load_params()
    out = []
    for batch in (REQUESTS, DECODING):
        requests = [(p, SamplingParams(max_tokens=m, logprobs=lp)) for p, m, lp in batch]
        out += [r.token_ids for r in run_to_completion(engine, params, requests, prefix_caching=True)]
    return out


def complete(url: str, prompt: list[int], max_tokens: int, logprobs: int | None) -> str:
    """A greedy completion's text (compared with the reference's tokens decoded)."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]


def test_a_mixed_batch_gets_the_interleaved_engines_tokens(group, reference, tiny_model_dir):
    leader, generate_lead, generate_other = group
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(lambda r: complete(leader.url, *r), REQUESTS))
        got += list(pool.map(lambda r: complete(leader.url, *r), DECODING))
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig

    tokenizer = load_model(str(tiny_model_dir), ServingConfig()).tokenizer
    assert [g[0] for g in got] == [tokenizer.decode(ids) for ids in reference], [g[1:] for g in got]
    assert [len(ids) for ids in reference] == [r[1] for r in REQUESTS + DECODING]
    metrics = httpx.get(f"{leader.url}/metrics", timeout=10).text
    preempted = _metric(metrics, "pathserve_preemptions")
    assert preempted > 0  # 4 usable pages for 4 slots of up to 4: recomputed on the prefill side
    leader.stop()
    for process in (generate_lead, generate_other):
        process.proc.wait(timeout=60)
    # Every prefill's final row was handed off, and each generate process pulled the same trees
    # (pages and states of the 6 prompts that prefill in rows, each preempted prompt's recompute
    # that had been handed off before); process 0 pulled the state
    # of the sequence preempted while it decoded.
    pulled = []
    for process in group:
        said = re.search(r"handed off (\d+) prompts; (\d+) moves, (\d+) bytes pulled here", process.output())
        assert said, process.output()[-3000:]
        pulled.append(int(said[3]))
        assert int(said[1]) >= len(REQUESTS) - 1
    assert pulled[1] == pulled[2] > 0 and pulled[0] > 0, pulled
    assert "disaggregated over processes: prefill [0]" in leader.output()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def float_pair(tiny_model_dir):
    """A float KV cache on two processes of one device: prefill on process 0, generate on 1."""
    engine = [a for a in ENGINE if not a.startswith(("quantize_kvcache", "pagedattn_num_pages", "enable_model_warmup"))]
    engine = [a.replace("generate_slice=cpu-2", "generate_slice=cpu-1") for a in engine]
    yield from serving_group(
        [str(tiny_model_dir), *engine, "enable_model_warmup=false", "per_device_batch_size=4"], 2
    )


@pytest.fixture(scope="module")
def float_reference(tiny_model_dir) -> list[str]:
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine

    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=256, prefill_chunk_size=32,
        decode_steps_per_call=4, cpu_kernels="off",
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    requests = [(p, SamplingParams(max_tokens=m, logprobs=lp)) for p, m, lp in REQUESTS[2:]]
    runs = run_to_completion(engine, engine.load_params(), requests, prefix_caching=True)
    return [model.tokenizer.decode(r.token_ids) for r in runs]


def test_a_float_cache_on_two_processes_gets_the_same_tokens(float_pair, float_reference):
    leader, _ = float_pair
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(lambda r: complete(leader.url, *r), REQUESTS[2:]))
    assert [g[0] for g in got] == float_reference
    # a request behind the system prompt once the batch is done: its full page is read from the
    # prefill side's pool (this pool has room: nothing was evicted)
    hits = _metric(httpx.get(f"{leader.url}/metrics", timeout=10).text, "pathserve_prefix_cache_hits")
    assert complete(leader.url, SYSTEM + [99] * 3, 4, None)[0]
    assert _metric(httpx.get(f"{leader.url}/metrics", timeout=10).text, "pathserve_prefix_cache_hits") > hits
    assert "disaggregated over processes: prefill [0] on 1 devices, generate [1]" in leader.output()
