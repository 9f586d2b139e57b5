"""Continuous batching with the real engine on a tiny model: concurrency, streams, stop strings,
cancellation (the same behaviours on the mock engine: tests/unit/test_orchestrator.py)."""

from __future__ import annotations

import threading
import time

import pytest

from serving.checkpoints.model_source import load_model
from serving.config import OrchestratorConfig, ServingConfig
from serving.engine.engine import Engine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.reference import ReferenceDecoder


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = ServingConfig(
        per_device_batch_size=4,
        max_prefill_predict_length=64,
        max_target_length=2048,
        decode_steps_per_call=2,
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    engine.warmup(params)
    return model, cfg, engine, params


@pytest.fixture
def orchestrator(setup):
    model, _cfg, engine, params = setup
    orch = Orchestrator(engine, params, model.tokenizer, OrchestratorConfig(max_queued_requests=64)).start()
    yield orch
    orch.stop(timeout=30)


def _prompts(tokenizer, n):
    ids = tokenizer.encode((DATA / "english.txt").read_text())
    return [ids[i * 9 : i * 9 + 3 + i % 7] for i in range(n)]


def test_concurrent_requests_match_the_plain_loop(setup, orchestrator):
    model, cfg, _, _ = setup
    prompts = _prompts(model.tokenizer, 10)
    samplings = [SamplingParams(max_tokens=5 + i) for i in range(10)]
    handles: list = [None] * 10
    results: list = [None] * 10

    def client(i):
        handles[i] = orchestrator.submit(prompts[i], samplings[i])
        results[i] = handles[i].result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    generator = ReferenceDecoder(model, cfg)
    for prompt, sampling, completion in zip(prompts, samplings, results, strict=True):
        expected = generator.generate(prompt, sampling)
        assert completion.token_ids == expected.token_ids
        assert completion.text == model.tokenizer.decode(expected.token_ids)
        assert completion.finish_reason == "length"
        assert completion.prompt_tokens == len(prompt) and completion.completion_tokens == sampling.max_tokens
        assert 0 < completion.time_to_first_token <= completion.token_times[-1]
        assert len(completion.token_times) == completion.completion_tokens


def test_stream_deltas_add_up_to_the_text(setup, orchestrator):
    model, *_ = setup
    handle = orchestrator.submit(_prompts(model.tokenizer, 1)[0], SamplingParams(max_tokens=20))
    deltas = [d.text for d in handle.stream()]
    assert deltas and "".join(deltas) == handle.completion.text  # how many: the pace's (not asserted)


def test_stop_string_ends_the_request_and_truncates(setup, orchestrator):
    model, *_ = setup
    prompt = _prompts(model.tokenizer, 1)[0]
    full = orchestrator.submit(prompt, SamplingParams(max_tokens=30)).result().text
    stop = full[10:13]
    assert len(stop) == 3
    cut = orchestrator.submit(prompt, SamplingParams(max_tokens=30), stop_strings=(stop,)).result()
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_cancellation_frees_the_slot(setup, orchestrator):
    model, _, engine, _ = setup
    prompts = _prompts(model.tokenizer, engine.max_concurrent_decodes + 1)
    long_ones = [orchestrator.submit(p, SamplingParams(max_tokens=1900)) for p in prompts[:-1]]
    streams = [h.stream() for h in long_ones]
    for stream in streams:
        next(stream)  # every slot is busy generating
    waiting = orchestrator.submit(prompts[-1], SamplingParams(max_tokens=3))
    for handle in long_ones:
        handle.cancel()
    completion = waiting.result()
    assert completion.completion_tokens == 3
    for handle, stream in zip(long_ones, streams, strict=True):
        for _ in stream:
            pass
        assert handle.completion.finish_reason == "cancelled"
        assert handle.completion.completion_tokens < 1900
    deadline = time.monotonic() + 10
    while orchestrator.metrics.active_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orchestrator.metrics.active_slots == 0


def test_metrics_record_steps(setup, orchestrator):
    model, *_ = setup
    orchestrator.submit(_prompts(model.tokenizer, 1)[0], SamplingParams(max_tokens=8)).result()
    m = orchestrator.metrics
    assert m.prefill_step.count >= 1 and m.generate_step.count >= 1 and m.time_to_first_token.count >= 1
    assert m.requests_finished.get("length", 0) >= 1


def test_profile_on_request_writes_a_trace(setup, orchestrator, tmp_path):
    model, *_ = setup
    orchestrator.request_profile(2, str(tmp_path / "trace"))
    orchestrator.submit(_prompts(model.tokenizer, 1)[0], SamplingParams(max_tokens=12)).result()
    deadline = time.monotonic() + 20
    while not list((tmp_path / "trace").rglob("perfetto_trace.json.gz")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))  # TensorBoard's
    assert list((tmp_path / "trace").rglob("perfetto_trace.json.gz"))  # ui.perfetto.dev's (loadtest.tpu_probe.device_ops reads it)
